"""End to end: real launcher, agents, workers and etcd on this machine, faults by real signals."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from chaos.injectors import kill_node, kill_worker, node_with_rank
from chaos.invariants import lr_violations
from chaos.report import recovery
from elastic import config
from elastic.events import EventFollower, read_events

from .conftest import launch, output

SAMPLES_PER_EPOCH = 240  # 10 classes x 24 images (tests/conftest.FAST_JOB)
START_TIMEOUT_S = 180
FINISH_TIMEOUT_S = 300


def wait_exit(proc: subprocess.Popen[str], run_dir: Path) -> int:
    try:
        return proc.wait(timeout=FINISH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launcher did not finish in time:\n{output(run_dir)[-3000:]}")


def wait_event(run_dir: Path, proc: subprocess.Popen[str], predicate, since: float = 0.0) -> dict:  # type: ignore[no-untyped-def]
    """The first event since ``since`` matching ``predicate`` (or any once the launcher exits)."""
    follower = EventFollower(run_dir)
    try:
        return follower.wait_for(
            lambda e: (e["ts"] >= since and predicate(e)) or proc.poll() is not None,
            timeout_s=START_TIMEOUT_S,
        )
    except TimeoutError:
        proc.kill()
        pytest.fail(f"the awaited event never came:\n{output(run_dir)[-3000:]}")


def worker_pids(events: list[dict]) -> list[int]:
    return [e["worker_pid"] for e in events if e["event"] == "worker_started"]


@pytest.mark.parametrize("victim", ["not_rank0", "rank0"])
def test_killed_node_job_finishes_at_world_two_with_lr_rescaled(
    tmp_path: Path, victim: str
) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "cluster.nodes=3", "trainer.epochs=4")
    wait_event(run_dir, proc, lambda e: e["event"] == "step" and e["step"] >= 8)
    assert proc.poll() is None, output(run_dir)
    rank0 = node_with_rank(run_dir, 0)
    target = (
        rank0 if victim == "rank0" else next(n for n in ("node0", "node1", "node2") if n != rank0)
    )
    victims = [
        e["worker_pid"]
        for e in read_events(run_dir)
        if e["event"] == "worker_started" and e["node"] == target
    ]
    fault = kill_node(run_dir, target)

    assert wait_exit(proc, run_dir) == 0, output(run_dir)[-3000:]
    events = read_events(run_dir)
    after = [e for e in events if e["ts"] > fault]
    done = next(e for e in after if e["event"] == "training_done")
    assert done["world_size"] == 2
    assert done["samples_seen"] == 4 * SAMPLES_PER_EPOCH
    assert not any(psutil.pid_exists(p) for p in victims)

    loaded = next(e for e in after if e["event"] == "checkpoint_loaded")
    assert (loaded["saved_world_size"], loaded["world_size"]) == (3, 2)
    changed = next(e for e in after if e["event"] == "lr_changed")
    assert (changed["old_world_size"], changed["world_size"]) == (3, 2)
    assert changed["lr"] == pytest.approx(changed["old_lr"] * 2 / 3)  # past warm-up: linear rule
    cfg = config.load(run_dir / "config.yaml")
    assert lr_violations(events, cfg, SAMPLES_PER_EPOCH) == []

    rec = recovery(events, fault)
    assert rec.stall_s is not None and rec.resumed_from is not None
    assert rec.redone_steps <= cfg.checkpoint.every_steps
    assert "job" in output(run_dir) and "finished" in output(run_dir)


def test_killed_worker_is_restarted_by_its_agent(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "cluster.nodes=2", "trainer.epochs=3")
    wait_event(run_dir, proc, lambda e: e["event"] == "step" and e["step"] >= 6)
    fault = kill_worker(run_dir, "node1")

    assert wait_exit(proc, run_dir) == 0, output(run_dir)[-3000:]
    after = [e for e in read_events(run_dir) if e["ts"] > fault]
    reported = next(e for e in after if e["event"] == "failure_reported")
    assert reported["node"] == "node1" and reported["incarnation"] == 1
    rejoined = next(e for e in after if e["event"] == "round_joined" and e["node"] == "node1")
    assert rejoined["world_size"] == 2  # the node stays in the job with a fresh worker
    done = next(e for e in after if e["event"] == "training_done")
    assert done["world_size"] == 2 and done["samples_seen"] == 3 * SAMPLES_PER_EPOCH


def test_sigterm_stops_cleanly_and_a_restart_resumes_from_the_checkpoint(
    tmp_path: Path, etcd_endpoint: str, etcd_client, job_id: str
) -> None:
    run_dir = tmp_path / "run"
    endpoints = f"cluster.etcd_endpoints=[{etcd_endpoint}]"
    proc = launch(run_dir, "cluster.nodes=2", "trainer.epochs=3", endpoints, job_id=job_id)
    wait_event(run_dir, proc, lambda e: e["event"] == "checkpoint_saved" and e["step"] >= 10)
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc, run_dir) == 128 + signal.SIGTERM

    events = read_events(run_dir)
    left = {e["node"]: e["code"] for e in events if e["event"] == "node_left"}
    assert left == {"node0": 128 + signal.SIGTERM, "node1": 128 + signal.SIGTERM}
    assert not any(psutil.pid_exists(p) for p in worker_pids(events))
    # Leases revoked, not left to expire: the node keys are gone the moment the launcher is.
    assert list(etcd_client.get_prefix(f"/elastic/{job_id}/nodes/")) == []
    newest = max(e["step"] for e in events if e["event"] == "checkpoint_saved")
    manifest = json.loads(
        (run_dir / "checkpoints" / f"step_{newest:09d}" / "manifest.json").read_text()
    )

    relaunched = time.time()
    restart = launch(run_dir, "cluster.nodes=2", "trainer.epochs=3", endpoints, job_id=job_id)
    started = wait_event(
        run_dir, restart, lambda e: e["event"] == "training_started", since=relaunched
    )
    assert started.get("resumed_from") == newest
    assert started["samples_seen"] == manifest["progress"]["samples_seen"]
    assert wait_exit(restart, run_dir) == 0, output(run_dir)[-3000:]
    done = [e for e in read_events(run_dir) if e["event"] == "training_done"]
    assert done and done[-1]["samples_seen"] == 3 * SAMPLES_PER_EPOCH
