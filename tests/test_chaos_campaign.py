"""``python -m chaos`` end to end: a scripted campaign of real faults on a real local job passes
its invariants and reports each fault and the goodput; a run whose record breaks an invariant
fails the campaign and names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import FAST_JOB

DROP_SAMPLE = Path(__file__).parent / "drop_sample"
CAMPAIGN_TIMEOUT_S = 600


def chaos(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "chaos",
            "job_id=campaign",
            f"run_dir={run_dir}",
            *FAST_JOB,
            *overrides,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CAMPAIGN_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout + done.stderr


def test_a_scripted_campaign_keeps_the_invariants_and_reports_each_fault_and_the_goodput(
    tmp_path: Path,
) -> None:
    """A node killed and started again, a worker killed, a node frozen and thawed, a planned
    leave and return (conf/campaign/scripted.yaml), on a 3-node job."""
    code, out = chaos(
        tmp_path,
        "campaign=scripted",
        "campaign.baseline_steps=5",
        "cluster.nodes=3",
        "trainer.epochs=16",
    )
    assert code == 0, out[-4000:]
    out_dir = tmp_path / "run" / "chaos"
    report = json.loads((out_dir / "report.json").read_text())
    assert report["ok"] and all(v == [] for v in report["violations"].values())
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds == ["node SIGKILL", "worker SIGKILL", "node SIGSTOP", "node SIGTERM"], report
    assert report["skipped"] == []
    for f in report["faults"]:
        assert f["stall_s"] is not None and f["stall_s"] < 60, f
    # A fault-free rate for each number of nodes the campaign left up (a freeze and a leave may
    # overlap: then one node was up).
    assert {"3", "2"} <= set(report["rates"]) <= {"3", "2", "1"}
    assert 0.3 < report["goodput"] <= 1.2, report["goodput"]
    assert (out_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    summary = (out_dir / "summary.txt").read_text()
    assert "verdict: PASS" in summary and "goodput:" in summary


def test_a_campaign_whose_record_breaks_an_invariant_fails_and_names_it(tmp_path: Path) -> None:
    code, out = chaos(
        tmp_path,
        "campaign.faults=[{kind:kill_worker,at_step:3,target:any}]",
        "campaign.baseline=false",
        "cluster.nodes=2",
        "trainer.epochs=1",
        env={"PYTHONPATH": str(DROP_SAMPLE), "ELASTIC_TEST_DROP_SAMPLE_AT": "2"},
    )
    assert code == 1, out[-4000:]
    assert "samples      BROKEN" in out and "trained more than once" in out
    assert "verdict: FAIL" in out
    report = json.loads((tmp_path / "run" / "chaos" / "report.json").read_text())
    assert not report["ok"] and report["goodput"] is None
