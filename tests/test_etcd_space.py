"""etcd stays bounded: real etcd servers, filled, compacted and defragmented.

The embedded etcd compacts its history and runs under a space quota; a job's write cost is
measured by :func:`launcher.rendezvous.etcd_usage.usage`; an etcd past its quota (``NOSPACE``)
is named as such, with the fix, by a node that trains on and by one that tries to join; and the
doctor checks an external etcd's alarms, size and compaction.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from elastic import event_types as ev
from elastic.event_types import EventType
from elastic.events import EventLog, read_events
from launcher.commands.doctor import etcd_compaction_row, etcd_space_row
from launcher.health.node_report import Status
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd
from launcher.rendezvous.etcd import connect
from launcher.rendezvous.etcd_client import EtcdFull
from launcher.rendezvous.etcd_usage import compacted, revisions_per_hour, usage
from launcher.rendezvous.membership import NodeRecord
from launcher.rendezvous.rendezvous import Rendezvous

from .conftest import FAST, REPO

MB = 1 << 20
QUOTA = 2 * MB  # a few puts of BIG fill it
BIG = b"x" * (MB // 2)


def fill(client: Any) -> int:
    """Put BIG values until etcd refuses one for lack of space; how many it took. etcd holds a
    put to the size of its database file, which grows when its backend commits (every 100 ms),
    so a burst of puts may overshoot the quota a few times over before the alarm fires."""
    most = 16 * QUOTA // len(BIG)
    for i in range(most):
        try:
            client.put(f"/fill/{i}", BIG)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return i
    raise AssertionError(f"etcd took {most} puts of {len(BIG)} bytes under a {QUOTA}-byte quota")


class Watched(EventLog):
    """An event log that also says when an event of one kind was written."""

    def __init__(self, run_dir: Path, node: str, kind: EventType) -> None:
        super().__init__(run_dir, node, role="agent")
        self.kind, self.seen = kind, threading.Event()

    def emit(self, event: EventType, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().emit(event, *args, **kwargs)
        if event is self.kind:
            self.seen.set()


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log", quota_bytes=QUOTA) as etcd:
        yield etcd


def node(etcd: EmbeddedEtcd, name: str, events: EventLog | None = None) -> Rendezvous:
    return Rendezvous(
        connect(etcd.endpoints),
        job_id="space",
        node=NodeRecord(name, "127.0.0.1", 1000, 1),
        cfg=replace(FAST, etcd_grace_s=60.0),
        min_nodes=1,
        max_nodes=2,
        events=events,
    )


def test_usage_counts_the_revisions_written_and_the_database_size(etcd_client: Any) -> None:
    before = usage(etcd_client)
    for i in range(3):
        etcd_client.put("/usage-test", str(i))
    after = usage(etcd_client)
    assert after.revision >= before.revision + 3  # other tests may write to the same etcd
    assert after.db_size > 0
    assert after.db_size_in_use is not None and 0 < after.db_size_in_use <= after.db_size
    assert revisions_per_hour(before, before._replace(revision=before.revision + 3), 3.6) == 3000


def test_a_full_etcd_is_named_nospace_with_the_fix_and_the_fix_works(
    small_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    events = Watched(tmp_path / "run", "a", ev.ETCD_NO_SPACE)
    a = node(small_etcd, "a", events)
    a.join()
    a.record.set_ready()
    try:
        assert a.wait(lambda v: v.round is not None, timeout=15) is not None
        client = connect(small_etcd.endpoints)
        assert fill(client) > 0
        # The node in the job trains on: its progress put is refused, and named, once.
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                a.put_under_lease(a.keys.progress, "{}")
        assert events.seen.is_set()
        (full,) = [e for e in read_events(tmp_path / "run") if ev.ETCD_NO_SPACE.matches(e)]
        assert f"etcd at {small_etcd.endpoint} is out of space (NOSPACE alarm" in full["reason"]
        assert "alarm disarm" in full["fix"] and "--auto-compaction-retention" in full["fix"]
        # A node that tries to join is refused at once, not after rendezvous.etcd_grace_s.
        b = node(small_etcd, "b")
        began = time.monotonic()
        refused = r"while trying to register: etcd at .* out of space \(NOSPACE alarm"
        with pytest.raises(EtcdFull, match=refused):
            b.join()
        assert time.monotonic() - began < 10
        # The doctor fails it too.
        row = etcd_space_row(client, small_etcd.endpoint)
        assert row.status is Status.FAIL and "NOSPACE" in row.message
        assert f"etcdctl --endpoints={small_etcd.endpoint} alarm disarm" in row.message
        # The fix the messages give: compact, defragment, disarm; then writes land again.
        client.delete_prefix("/fill/")
        client.compact(usage(client).revision, physical=True)
        client.defragment()
        for alarm in client.list_alarms():  # etcdctl alarm disarm: each member's
            client.disarm_alarm(alarm.member_id)
        a.put_under_lease(a.keys.progress, "{}")
        assert etcd_space_row(client, small_etcd.endpoint).status is Status.PASS
    finally:
        a.leave()


def test_the_doctor_names_a_full_etcd(small_etcd: EmbeddedEtcd) -> None:
    fill(connect(small_etcd.endpoints))
    doctor = subprocess.run(
        [sys.executable, "-m", "launcher.commands.doctor", "--json", "cluster=bare_metal",
         "cluster.device=cpu", f"cluster.etcd_endpoints=[{small_etcd.endpoint}]"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert doctor.returncode == 1, doctor.stderr
    rows = {r["name"]: r for r in json.loads(doctor.stdout)["results"]}
    assert rows["etcd_space"]["status"] == "fail" and "NOSPACE" in rows["etcd_space"]["message"]
    assert rows["etcd_compaction"]["status"] == "pass"  # a young etcd: not yet due


def test_the_embedded_etcd_defragments_a_mostly_free_database_when_it_starts(
    tmp_path: Path,
) -> None:
    etcd = EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log").start()
    try:
        client = connect(etcd.endpoints)
        for i in range(8):
            client.put(f"/big/{i}", BIG)
        client.delete_prefix("/big/")
        client.compact(usage(client).revision, physical=True)
        freed = usage(client).db_size  # the file keeps the pages the compaction freed
        assert freed > 4 * MB
        client.close()
        etcd.stop()
        etcd.start()  # a relaunch on the same data
        client = connect(etcd.endpoints)
        assert usage(client).db_size < MB
        client.close()
    finally:
        etcd.stop()


def test_the_doctor_warns_on_an_etcd_that_never_compacts(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "e", tmp_path / "e.log", compaction_retention="0") as etcd:
        client = connect(etcd.endpoints)
        for i in range(30):
            client.put("/elastic/job/progress", str(i))
        row = etcd_compaction_row(client, "/elastic/job/progress", warn_after=20)
        assert row.status is Status.WARN
        assert "compacted none of its 31 revisions" in row.message
        assert "--auto-compaction-mode=periodic --auto-compaction-retention=1h" in row.message
        young = etcd_compaction_row(client, "/elastic/job/progress")  # 31 of 10,000
        assert young.status is Status.PASS and "not yet due" in young.message


def test_the_doctor_passes_an_etcd_that_compacts(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "e", tmp_path / "e.log", compaction_retention="1s") as etcd:
        client = connect(etcd.endpoints)
        for i in range(5):
            client.put("/elastic/job/progress", str(i))
        # etcd's compactor runs on its own clock: wait, bounded, until it has run.
        deadline = time.monotonic() + 30
        while not compacted(client, "/elastic/job/progress"):
            assert time.monotonic() < deadline, "etcd never compacted with a 1 s retention"
            time.sleep(0.1)
        row = etcd_compaction_row(client, "/elastic/job/progress", warn_after=2)
        assert row.status is Status.PASS and "etcd compacts its history" in row.message
