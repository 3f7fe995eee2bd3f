"""End to end: a real job while its etcd is restarted, loses one of 3 members, or is lost for good.

The job trains on while etcd is away; nobody is fenced and no round is formed. Past
``rendezvous.etcd_grace_s`` the job stops cleanly with the newest checkpoint kept, and a relaunch
resumes from it. The invariants of ``chaos/invariants.py`` hold over every run's whole log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from chaos.injectors import kill_embedded_etcd_member, start_etcd, stop_etcd
from elastic.events import read_events
from launcher.agent.agent import EXIT_ETCD_LOST
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd

from .conftest import Gate, launch, output
from .test_e2e import (
    RECORD,
    SAMPLES_PER_EPOCH,
    assert_invariants,
    newest_step,
    wait_event,
    wait_exit,
)


def steps_after(run_dir: Path, since: float) -> list[int]:
    return [e["step"] for e in read_events(run_dir) if e["event"] == "step" and e["ts"] > since]


def wait_every_node(run_dir: Path, proc, kind: str, since: float) -> None:  # type: ignore[no-untyped-def]
    """Until both nodes wrote ``kind`` after ``since``."""
    seen: set[str] = set()

    def both(e: dict) -> bool:
        if e["event"] == kind:
            seen.add(e["node"])
        return seen >= {"node0", "node1"}

    wait_event(run_dir, proc, both, since=since)


def test_etcd_restarted_for_3_s_and_for_10_s_mid_run_costs_nothing(
    tmp_path: Path, gate: Gate
) -> None:
    """Training goes on while etcd is away, within the lease and five times beyond it. Each
    outage is given 6 steps at the gate (2 are awaited in it), so that on any machine the job
    is still there when etcd comes back."""
    run_dir = tmp_path / "run"
    with EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log") as etcd:
        proc = launch(
            run_dir,
            "cluster.nodes=2",
            "trainer.epochs=3",
            f"cluster.etcd_endpoints=[{etcd.endpoint}]",
            RECORD,
            env=gate.env(),
        )
        wait_event(run_dir, proc, lambda e: e["event"] == "step" and e["step"] >= 3)
        for seconds in (3, 10):  # within the 2 s lease, and five times it
            gate.hold_after(newest_step(run_dir) + 6)
            down = stop_etcd(run_dir, etcd)
            # Training goes on while etcd is away: two steps, awaited from the event log.
            first = wait_event(run_dir, proc, lambda e: e["event"] == "step", since=down)
            wait_event(run_dir, proc, lambda e, s=first["step"]: e.get("step", 0) > s, since=down)
            time.sleep(max(0.0, down + seconds - time.time()))  # the outage's length
            start_etcd(run_dir, etcd)
            wait_every_node(run_dir, proc, "etcd_reachable", since=down)
            assert steps_after(run_dir, down), f"no step while etcd was down for {seconds} s"
        gate.open()
        assert wait_exit(proc, run_dir) == 0, output(run_dir)[-3000:]

    events = assert_invariants(run_dir, epochs=3)
    kinds = {e["event"] for e in events}
    assert "etcd_unreachable" in kinds
    assert not [e for e in events if e["event"] in ("fenced", "peer_evicted", "etcd_lost")]
    # One round while training; a node that leaves at the end takes the ``done`` key (under its
    # lease) with it, so the other may form a last round of its own once training is over.
    done = min(e["ts"] for e in events if e["event"] == "training_done")
    assert [e["round"] for e in events if e["event"] == "round_formed" and e["ts"] < done] == [1]
    assert not [e for e in events if e["event"] == "worker_exited" and e["code"] not in (0, None)]


def test_a_local_job_on_3_etcd_members_loses_one_without_a_stall_then_all_and_resumes(
    tmp_path: Path, gate: Gate
) -> None:
    """The local cluster's own 3-member etcd: one member killed costs nothing (the client fails
    over at once); all of them killed, the job stops cleanly past the grace period with the
    newest checkpoint kept, and a relaunch (a fresh embedded etcd) resumes from it. (The job
    waits at the gate through the grace period: a fast machine would finish it first.)"""
    run_dir = tmp_path / "run"
    overrides = ["cluster.nodes=2", "trainer.epochs=2", "cluster.embedded_etcd_members=3", RECORD]
    proc = launch(run_dir, *overrides, "rendezvous.etcd_grace_s=3", env=gate.env())
    wait_event(run_dir, proc, lambda e: e["event"] == "step" and e["step"] >= 3)
    killed = kill_embedded_etcd_member(run_dir, 0)  # the member every client talks to first
    wait_event(run_dir, proc, lambda e: e["event"] == "checkpoint_saved", since=killed)
    events = read_events(run_dir)
    # A keep-alive may go unanswered while the survivors elect a raft leader, if the dead member
    # led them (about a second; etcd extends every lease when a new leader takes over): that
    # costs no node its place and no round.
    assert not [e for e in events if e["event"] in ("fenced", "round_formed") and e["ts"] >= killed]
    # No stall: no gap between steps from the kill on much beyond the slowest one before it (a
    # checkpoint's), a generous bound next to a lease TTL plus a new round.
    ts = [e["ts"] for e in events if e["event"] == "step"]
    before = [b - a for a, b in zip(ts, ts[1:], strict=False) if b < killed]
    after = [b - a for a, b in zip(ts, ts[1:], strict=False) if b >= killed]
    assert after and max(after) < max(before) + 1.0, (max(before), max(after))

    gate.hold_after(0)
    for member in (1, 2):
        kill_embedded_etcd_member(run_dir, member)
    code = wait_exit(proc, run_dir)
    gate.open()
    out = output(run_dir)
    assert code != 0, out[-3000:]
    events = read_events(run_dir)
    left = {e["node"]: e["code"] for e in events if e["event"] == "node_left"}
    assert left == {"node0": EXIT_ETCD_LOST, "node1": EXIT_ETCD_LOST}
    assert "rendezvous.etcd_grace_s=3" in out and "bring etcd back" in out
    assert "Traceback" not in out
    for log in (run_dir / "logs").glob("node*.log"):
        assert "Traceback" not in log.read_text(), log
    pids = [e["worker_pid"] for e in events if e["event"] == "worker_started"]
    assert not any(psutil.pid_exists(p) for p in pids)
    # The newest commit is on disk: a worker stopped past the grace period may have committed a
    # checkpoint (the manifest's rename) and not yet logged its ``checkpoint_saved``.
    committed = sorted((run_dir / "checkpoints").glob("step_*/manifest.json"))
    newest = json.loads(committed[-1].read_text())["progress"]["step"]
    assert newest >= max(e["step"] for e in events if e["event"] == "checkpoint_saved")

    relaunched = time.time()
    again = launch(run_dir, *overrides)
    started = wait_event(run_dir, again, lambda e: e["event"] == "training_started", relaunched)
    assert started.get("resumed_from") == newest
    assert wait_exit(again, run_dir) == 0, output(run_dir)[-3000:]
    # The relaunch shows its own events, not the first run's replayed as new.
    assert "exit code 4" not in output(run_dir)
    events = assert_invariants(run_dir, epochs=2)
    done = [e for e in events if e["event"] == "training_done"]
    assert done[-1]["samples_seen"] == 2 * SAMPLES_PER_EPOCH
