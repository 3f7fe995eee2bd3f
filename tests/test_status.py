"""``python -m launcher.commands.status`` and the ``progress`` key: the screen and its data on
literal keys, the newest checkpoint from manifests, the publisher on a real event file, and the
errors against a real etcd. The screen during a real job is checked in tests/test_e2e.py
(SIGTERM)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from elastic.events import EventLog
from launcher.agent.progress_key import ProgressPublisher, progress_record
from launcher.commands import status
from launcher.health.node_report import CheckResult, HealthReport, Status
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.membership import NodeRecord, Round, leader_value

from .test_round_plan import node

NOW = 1_800_000_000.0
BASE = "/elastic/job1"


def step_event(step: int, ts: float = NOW - 2) -> dict:
    return {
        "ts": ts,
        "event": "step",
        "node": "node0",
        "round": 2,
        "step": step,
        "samples": 16 * step,
        "epoch": 0,
        "loss": 2.25,
        "lr": 0.0125,
        "world_size": 2,
        "samples_per_s": 31.5,
    }


def report(node_id: str, ok: bool = True) -> str:
    results = (
        CheckResult("open_files", Status.PASS if ok else Status.FAIL, "RLIMIT_NOFILE 256"),
        CheckResult("gpu", Status.SKIP, "CPU node"),
    )
    return HealthReport(node_id, "10.0.0.9", NOW - 30, 0.1, results).to_json()


def job_keys() -> dict[str, tuple[bytes, int]]:
    """node0 and node1 in round 2 (node0 leads), node2 registered and waiting, node3 unfit and
    quarantined by its own strikes, node1 with a strike."""
    a, b, c = node("node0", 11), node("node1", 12), node("node2", 40)
    members = Round.build(2, [a, b]).members
    rnd = Round(2, members, "127.0.0.1", 1000, NOW - 65.0, parts_id="000000000002-000000000011")
    keys = {f"{BASE}/nodes/{n.node_id}": (n.to_json().encode(), n.joined_rev) for n in (a, b, c)}
    head, rows = rnd.to_values()
    keys[f"{BASE}/round"] = (head.encode(), 0)
    for node_id, row in rows.items():
        keys[f"{BASE}/round_parts/{rnd.parts_id}/{node_id}"] = (row.encode(), 0)
    keys[f"{BASE}/leader"] = (leader_value("node0", 11).encode(), 0)
    record = progress_record(step_event(30), 480, "file:///ckpt", NOW - 1, 125.04)
    keys[f"{BASE}/progress"] = (json.dumps(record).encode(), 0)
    entry = {
        "node_id": "node3",
        "since": NOW - 10,
        "until": NOW + 290,
        "reasons": ["failed health checks: open_files"],
        "by": "agent",
    }
    keys[f"{BASE}/quarantine/node3"] = (json.dumps(entry).encode(), 0)
    for n in ("node0", "node1", "node2"):
        keys[f"{BASE}.health/reports/{n}"] = (report(n).encode(), 0)
    keys[f"{BASE}.health/reports/node3"] = (report("node3", ok=False).encode(), 0)
    keys[f"{BASE}.health/strikes/node1"] = (json.dumps([{"ts": NOW, "reason": "x"}]).encode(), 0)
    found = {"slowdown": 2.71, "step": 28, "at": NOW - 4, "evicted": False}
    keys[f"{BASE}.health/stragglers/node1"] = (json.dumps(found).encode(), 0)
    return keys


CHECKPOINT = {
    "step": 25,
    "url": "file:///ckpt/step_000000025",
    "saved_at": NOW - 12,
    "age_s": 12.0,
    "world_size": 2,
    "samples_seen": 400,
    "bytes": 45_000_000,
}


def test_the_status_data_names_members_round_progress_and_checkpoint() -> None:
    data = status.gather(job_keys(), "/elastic", "job1", NOW, CHECKPOINT, ("127.0.0.1:2379",))
    assert json.loads(json.dumps(data)) == data  # what --json prints
    assert data["round"]["number"] == 2 and data["round"]["world_size"] == 2
    assert data["round"]["age_s"] == 65.0 and data["leader"] == "node0" and not data["done"]
    members = {m["node"]: m for m in data["members"]}
    assert [m["node"] for m in data["members"]] == ["node0", "node1", "node2", "node3"]
    assert members["node0"]["ranks"] == [0, 0] and members["node0"]["leader"]
    assert members["node1"]["ranks"] == [1, 1] and members["node1"]["strikes"] == 1
    assert members["node2"]["ranks"] is None and members["node2"]["ready"]  # not placed yet
    assert not members["node3"]["registered"] and members["node3"]["host"] == "10.0.0.9"
    assert members["node3"]["quarantine"]["left_s"] == 290.0
    assert not members["node3"]["health"]["ok"]
    p = data["progress"]
    assert (p["step"], p["samples"], p["lr"], p["samples_per_s"]) == (30, 480, 0.0125, 31.5)
    assert p["age_s"] == 2.0 and p["eta_s"] == 125.0
    assert data["checkpoint"]["step"] == 25


def test_a_member_registered_again_is_not_given_the_ranks_of_its_old_registration() -> None:
    keys = job_keys()
    again = NodeRecord("node1", "127.0.0.1", 1000, 1, ready=False, joined_rev=50)
    keys[f"{BASE}/nodes/node1"] = (again.to_json().encode(), 50)
    data = status.gather(keys, "/elastic", "job1", NOW)
    node1 = next(m for m in data["members"] if m["node"] == "node1")
    assert node1["ranks"] is None and not node1["in_round"]


def test_the_screen_shows_every_line_an_operator_needs() -> None:
    data = status.gather(job_keys(), "/elastic", "job1", NOW, CHECKPOINT, ("127.0.0.1:2379",))
    screen = status.render(data)
    assert "round      2: world size 2 on 2 node(s), formed 65 s ago; leader node0" in screen
    assert "step 30, epoch 0, samples 480/480, lr 0.0125, loss 2.2500, 31.5 samples/s" in screen
    assert "world size 2 (round 2), 2.0 s ago; ETA 2m05s" in screen
    assert "checkpoint step 25, saved 12 s ago, 45.0 MB, world size 2" in screen
    rows = {line.split()[0]: line for line in screen.splitlines()[5:] if line.strip()}
    assert rows["node0"].split()[:5] == ["node0", "*", "127.0.0.1", "0", "yes"]
    assert "ok (1 pass, 1 skip), 30 s ago" in rows["node0"]
    assert "1 strike(s)" in rows["node1"]
    assert "2.7x slower at step 28, 4.0 s ago (kept)" in rows["node1"]
    assert "not registered" in rows["node3"] and "FAIL open_files" in rows["node3"]
    assert "by agent: failed health checks: open_files" in rows["node3"]
    # A job with no round, no progress and no checkpoint yet says so instead of failing.
    keys = {k: v for k, v in job_keys().items() if not k.endswith(("/round", "/progress"))}
    empty = status.render(status.gather(keys, "/elastic", "job1", NOW))
    assert "round      none yet" in empty and "progress   none published yet" in empty
    assert "checkpoint none committed yet" in empty


def test_the_key_range_holds_the_job_and_its_health_keys_and_no_other_job() -> None:
    start, end = JobKeys("/elastic", "run1").everything()
    inside = ["/elastic/run1/nodes/a", "/elastic/run1/progress", "/elastic/run1.health/reports/a"]
    outside = ["/elastic/run1-b/nodes/a", "/elastic/run1_b/round", "/elastic/run10/round"]
    assert all(start <= k < end for k in inside)
    assert not any(start <= k < end for k in outside)


def write_checkpoint(root: Path, step: int, size: int, *, commit: bool = True) -> None:
    folder = root / f"step_{step:09d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * size)
    if commit:
        manifest = {
            "format": 1,
            "step": step,
            "saved_at": NOW - 100,
            "world_size": 2,
            "files": {"__0_0.distcp": {"size": 8, "sha256": "-"}},
            "progress": {"samples_seen": 16 * step},
        }
        (folder / "manifest.json").write_text(json.dumps(manifest))


def test_the_newest_checkpoint_is_the_newest_committed_one_whose_files_are_all_there(
    tmp_path: Path,
) -> None:
    write_checkpoint(tmp_path, 5, 8)
    write_checkpoint(tmp_path, 10, 3)  # a file shorter than its manifest says
    write_checkpoint(tmp_path, 15, 8, commit=False)  # an interrupted save
    found = status.newest_checkpoint(f"file://{tmp_path}", NOW)
    assert found is not None
    assert (found["step"], found["age_s"], found["bytes"]) == (5, 100.0, 8)
    assert found["url"] == f"file://{tmp_path}/step_000000005"
    assert status.newest_checkpoint(f"file://{tmp_path}/none", NOW) is None


def test_the_publisher_puts_rank_0s_newest_step_and_a_failing_or_slow_etcd_costs_nothing(
    tmp_path: Path,
) -> None:
    rnd = Round.build(1, [node("node0", 1), node("node1", 2)])
    events = EventLog(tmp_path, "node0")
    put: list[str] = []
    slow = threading.Event()

    def into_etcd(value: str) -> None:
        if slow.is_set():
            time.sleep(5)  # an etcd that does not answer: the client's timeout
        if not put:
            put.append("failed")
            raise ConnectionError("etcd away")
        put.append(value)

    # Puts a second apart, not the agent's PROGRESS_EVERY_S, to keep the test short.
    publisher = ProgressPublisher(str(tmp_path), "node0", "file:///ckpt", into_etcd, every_s=1.0)
    other = ProgressPublisher(str(tmp_path), "node1", "file:///ckpt", into_etcd, every_s=1.0)
    try:
        events.emit("training_started", total_samples=480)
        events.emit("step", **{k: v for k, v in step_event(1).items() if k not in ("ts", "event")})
        other.tick(rnd)  # ranks 1: never
        publisher.tick(rnd)  # the put fails: skipped
        deadline = time.monotonic() + 5
        while put != ["failed"] and time.monotonic() < deadline:
            time.sleep(0.01)
        publisher.tick(rnd)  # within the second: nothing read, nothing put
        time.sleep(1.0)
        events.emit("step", **{k: v for k, v in step_event(2).items() if k not in ("ts", "event")})
        publisher.tick(rnd)
        while len(put) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        record = json.loads(put[1])
        assert (record["step"], record["total_samples"], record["lr"]) == (2, 480, 0.0125)
        assert record["checkpoint_url"] == "file:///ckpt" and record["round"] == 2
        assert record["eta_s"] > 0  # 448 samples left at the pace of steps 1 and 2
        slow.set()
        time.sleep(1.0)
        events.emit("step", **{k: v for k, v in step_event(3).items() if k not in ("ts", "event")})
        began = time.monotonic()
        publisher.tick(rnd)  # handed to the put thread, which waits for etcd
        time.sleep(1.0)
        events.emit("step", **{k: v for k, v in step_event(4).items() if k not in ("ts", "event")})
        publisher.tick(rnd)
        assert time.monotonic() - began < 1.5  # the loop never waited for etcd
        assert len(put) == 2
    finally:
        publisher.close()
        other.close()


def test_no_etcd_and_no_job_are_errors_that_name_the_setting_and_the_fix(
    etcd_endpoint: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = f"run_dir={tmp_path}"
    code = status.main(["job_id=nope", run, "cluster.etcd_endpoints=[127.0.0.1:9]"])
    err = capsys.readouterr().err
    assert code == 1 and "cluster.etcd_endpoints=[127.0.0.1:9]" in err and "Fix:" in err
    code = status.main(["job_id=nope", run, f"cluster.etcd_endpoints=[{etcd_endpoint}]"])
    err = capsys.readouterr().err
    assert code == 1 and "no keys of job nope" in err and "Fix: check job_id" in err
    code = status.main(["job_id=nope", run])  # a local run that is not running
    err = capsys.readouterr().err
    assert code == 1 and "etcd.endpoints does not exist" in err and "Fix:" in err


def test_a_local_run_is_found_by_its_id_its_directory_or_as_the_newest_running_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic import config
    from launcher.compose import compose, finalize

    monkeypatch.chdir(tmp_path)
    for job, port in (("older", 2001), ("newer", 2002)):
        run_dir = tmp_path / "runs" / job
        run_dir.mkdir(parents=True)
        config.save(
            finalize(compose([f"job_id={job}", f"run_dir={run_dir}"])), run_dir / "config.yaml"
        )
        (run_dir / "etcd.endpoints").write_text(f"127.0.0.1:{port}\n")
        os.utime(run_dir / "etcd.endpoints", (NOW + port, NOW + port))  # newer: started later
    cfg, endpoints = status.job_and_endpoints([], tmp_path)
    assert (cfg.job_id, endpoints) == ("newer", ["127.0.0.1:2002"])
    assert cfg.checkpoint.url == f"file://{tmp_path}/runs/newer/checkpoints"
    cfg, endpoints = status.job_and_endpoints(["job_id=older"], tmp_path)
    assert (cfg.job_id, endpoints) == ("older", ["127.0.0.1:2001"])
    cfg, endpoints = status.job_and_endpoints([f"run_dir={tmp_path}/runs/older"], tmp_path)
    assert (cfg.job_id, endpoints) == ("older", ["127.0.0.1:2001"])
