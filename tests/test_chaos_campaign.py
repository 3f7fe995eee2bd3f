"""``python -m chaos`` end to end: a scripted campaign of real faults on a real local job passes
its invariants and reports each fault and the goodput; a campaign attached to a running job
through etcd has its faults carried out by the nodes, and fails naming the invariant the job's
record breaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.event_types import DECLARED, describe
from elastic.events import read_events

from .conftest import FAST_JOB, PATCH_HOOKS, RESNET18, Gate, back_after_restart, launch, output
from .test_e2e import wait_event

CAMPAIGN_TIMEOUT_S = 600


def chaos(
    tmp_path: Path, *overrides: str, job_id: str = "campaign", env: dict[str, str] | None = None
) -> tuple[int, str]:
    """``python -m chaos`` on the fast job in ``tmp_path/run``, ``env`` added to ours: its exit
    code and output."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "chaos", f"job_id={job_id}", f"run_dir={run_dir}", *FAST_JOB]
        + list(overrides),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CAMPAIGN_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout + done.stderr


def test_a_scripted_campaign_keeps_the_invariants_and_reports_each_fault_and_the_goodput(
    tmp_path: Path, gate: Gate
) -> None:
    """A node killed and started again, one of three etcd members lost for 3 s, a worker
    killed, a shard of the newest checkpoint corrupted, a bit flipped in a worker's parameters
    (found and repaired by the replica check), a node frozen and thawed, a node slowed
    to half its CPU (and named a straggler, comparisons every 2 steps), a planned leave and
    return (conf/campaign/scripted.yaml), on a 3-node job. Its last 3 steps wait at the gate for
    the node that left to be back, which a fast machine would not wait for."""
    gate.hold_end(3)
    gate.open_on(tmp_path / "run", back_after_restart(2))
    code, out = chaos(
        tmp_path,
        "campaign=scripted",
        "cluster.nodes=3",
        RESNET18,  # the script's steps and its slowed node are timed for ResNet-18's
        "trainer.epochs=16",
        "health.straggler_every=2",
        "health.straggler_windows=2",
        env=gate.env(),
    )
    assert code == 0, out[-4000:]
    out_dir = tmp_path / "run" / "chaos"
    report = json.loads((out_dir / "report.json").read_text())
    assert report["ok"] and all(v == [] for v in report["violations"].values())
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds == [
        "node SIGKILL",
        "etcd",
        "worker SIGKILL",
        "checkpoint",
        "replica SIGUSR1",
        "node SIGSTOP",
        "slow_node",
        "node SIGTERM",
    ], report
    assert report["skipped"] == []
    flipped = report["faults"][4]
    assert "repaired" in flipped["breakdown"], flipped  # by the next replica check
    slow = report["faults"][6]
    # Named while it is slow: the script lifts it once named (until_named), a minute at most. Two
    # comparisons of 2 steps take 4-5 s alone; CI's second test beside it took 15.3 s once.
    assert slow["detected_s"] is not None and slow["detected_s"] < 60, slow
    events = read_events(tmp_path / "run")
    lifted = [e for e in events if e["event"] == "fault_cleared"]
    lifted_s = next(e["ts"] for e in lifted if e["kind"] == "slow_node") - slow["ts"]
    assert 0 <= lifted_s - slow["detected_s"] < 5, (lifted_s, slow)  # by the naming
    assert "evicted" not in slow["breakdown"]  # health.straggler=warn
    for f in report["faults"]:
        assert f["stall_s"] is not None and f["stall_s"] < 60, f
    # The job's own pace at every world size up to its 3 nodes; the goodput can't exceed 1.
    assert set(report["rates"]) == {"1", "2", "3"}
    assert 0.3 < report["goodput"] <= 1.0, report["goodput"]
    assert report["fault_free_goodput"] is None  # the first fault at step 10: too soon to tell
    # The corrupted shard was verified and refused (its checksum), not left unjudged.
    verified = [e for e in events if e["event"] == "checkpoint_verified"]
    assert len(verified) == 1 and "does not match its checksum" in verified[0]["refused"]
    assert (out_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    summary = (out_dir / "summary.txt").read_text()
    assert "verdict: PASS" in summary and "goodput:" in summary
    # Every event the display shows renders from the real record: its line reads only the fields
    # its event carries. The campaign's faults produce most kinds of lines.
    shown = {e["event"] for e in events if describe(e) is not None}
    lines = {kind.name for kind in DECLARED.values() if kind.line is not None}
    assert len(shown) >= 15 and shown <= lines, sorted(shown)


def test_attached_through_etcd_a_campaign_has_its_faults_carried_out_and_names_a_broken_invariant(
    tmp_path: Path, etcd_endpoint: str, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bare metal without ssh: a job started with ``chaos.allow=true`` on two local agents; a
    campaign attached by job id and etcd requests a worker kill and a freeze, which the nodes'
    helpers carry out (and thaw). The job's record drops a sample (a hook of tests/patch_on_import),
    so the campaign must fail and name the samples invariant."""
    monkeypatch.setenv("PYTHONPATH", str(PATCH_HOOKS))
    monkeypatch.setenv("ELASTIC_TEST_DROP_SAMPLE_AT", "2")
    run_dir = tmp_path / "run"
    endpoints = f"cluster.etcd_endpoints=[{etcd_endpoint}]"
    job = launch(
        run_dir,
        "cluster.nodes=2",
        "trainer.epochs=2",
        "chaos.allow=true",
        "trainer.record_samples=true",
        endpoints,
        job_id=job_id,
    )
    try:
        wait_event(run_dir, job, lambda e: e["event"] == "node_registered")  # it runs: attach
        code, out = chaos(
            tmp_path,
            "campaign.attach=true",
            endpoints,
            "campaign.faults=[{kind:kill_worker,at_step:3,target:any},"
            "{kind:freeze_node,at_step:8,target:not_rank0,duration_s:1}]",
            job_id=job_id,
        )
        assert job.wait(timeout=CAMPAIGN_TIMEOUT_S) == 0, output(run_dir)[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    assert code == 1, out[-4000:]
    assert "samples      BROKEN" in out and "trained more than once" in out
    assert "the job trains at its own fault-free pace" in out
    events = read_events(run_dir)
    accepted = [e["kind"] for e in events if e["event"] == "fault_request_accepted"]
    assert accepted == ["kill_worker", "freeze_node"], accepted
    # Carried out on the nodes, by their helpers (the node's own event file), and ended.
    done = [(e["event"], e["kind"], e.get("signal")) for e in events if e.get("role") == "chaos"]
    assert done == [
        ("fault_injected", "worker", "SIGKILL"),
        ("fault_injected", "node", "SIGSTOP"),
        ("fault_cleared", "node", "SIGCONT"),
    ], done
    assert all(e["node"] != "chaos" for e in events if e.get("role") == "chaos")
