"""The rendezvous while etcd is away: real etcd servers, stopped and started again.

An unreachable etcd is not a lost lease. These drive :class:`Rendezvous` objects against their
own etcd (one member, or three), restart it on the same port and data, and check that nobody is
fenced, that writes made meanwhile land, and that only the grace period ends a node's wait.
The whole job through the same faults is in ``tests/test_e2e_etcd.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from elastic.events import EventLog, read_events
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd
from launcher.rendezvous.etcd import connect, grpc_target
from launcher.rendezvous.etcd_client import backoff
from launcher.rendezvous.lease import KeepAliveStream, Lease, lease_verdict
from launcher.rendezvous.membership import NodeRecord
from launcher.rendezvous.rendezvous import Rendezvous

from .conftest import FAST

# --- pure logic ---------------------------------------------------------------------------------


def test_only_the_server_fences_a_node_and_only_the_grace_period_stops_it() -> None:
    assert lease_verdict(ttl=2, unreachable_s=0.0, grace_s=60) is Lease.ALIVE
    assert lease_verdict(ttl=0, unreachable_s=0.0, grace_s=60) is Lease.EXPIRED
    # No answer for many lease TTLs is still an outage, not an expired lease ...
    assert lease_verdict(ttl=None, unreachable_s=20.0, grace_s=60) is Lease.OUTAGE
    # ... until the grace period is over.
    assert lease_verdict(ttl=None, unreachable_s=60.5, grace_s=60) is Lease.ETCD_LOST
    # An answer after a long outage counts: the server restored the lease, or it did not.
    assert lease_verdict(ttl=3, unreachable_s=90.0, grace_s=60) is Lease.ALIVE
    assert lease_verdict(ttl=0, unreachable_s=90.0, grace_s=60) is Lease.EXPIRED


def test_backoff_doubles_from_a_quarter_second_up_to_four() -> None:
    assert [backoff(i) for i in range(6)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff(5000) == 4.0  # an outage of hours: no float overflow


def test_one_grpc_target_names_every_member() -> None:
    target = grpc_target([("10.0.0.1", 2379), ("10.0.0.2", 2379), ("10.0.0.3", 2380)])
    assert target == "ipv4:10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2380"


# --- real etcd ----------------------------------------------------------------------------------

# A resync due every second: the retries while etcd is away must follow the backoff all the same.
OUTAGE_CFG = replace(FAST, etcd_grace_s=30.0, resync_s=1.0)


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd server for this test alone, so that stopping it harms no other test."""
    with EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log") as etcd:
        yield etcd


def joined(
    etcd: EmbeddedEtcd, name: str, tmp_path: Path, cfg: object = OUTAGE_CFG, **kw: int
) -> Rendezvous:
    r = Rendezvous(
        connect(etcd.endpoints),
        job_id="outage",
        node=NodeRecord(name, "127.0.0.1", 1000, 1),
        cfg=cfg,  # type: ignore[arg-type]
        min_nodes=kw.get("min_nodes", 2),
        max_nodes=kw.get("max_nodes", 2),
        events=EventLog(tmp_path / "run", name, role="agent"),
    )
    r.join()
    r.record.set_ready()
    return r


def formed(n: int):  # type: ignore[no-untyped-def]
    return lambda v: v.round is not None and v.round.number >= n and v.round_intact()


def test_an_etcd_restart_longer_than_the_lease_fences_nobody_and_keeps_the_round(
    own_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    a, b = joined(own_etcd, "a", tmp_path), joined(own_etcd, "b", tmp_path)
    try:
        view = a.wait(lambda v: formed(1)(v) and v.leader != "", timeout=15)
        assert view is not None and view.round is not None
        # The leader follows every node's record; whichever of the two claimed the lead.
        lead = a if json.loads(view.leader)[0] == "a" else b
        view = lead.view
        own_etcd.stop_member(0, kill=True)
        before = a.load.requests
        # Down for more than a lease TTL (2 s), as measured by the keep-alives that fail.
        assert not a.fenced.wait(3 * OUTAGE_CFG.lease_ttl_s)
        # Each attempt to read the job again is a few requests; 6 s of backoff holds 6 attempts.
        retried = a.load.requests - before
        assert retried <= 40, f"{retried} requests in 6 s of outage: the retries ignore backoff"
        # A write made while etcd is away is kept, and lands once it is back.
        b.record.report_failure("a worker crashed while etcd was away")
        own_etcd.start_member(0)
        after = lead.wait(
            lambda v: v.nodes.get("b") is not None and v.nodes["b"].incarnation == 1, 20
        )
        assert after is not None, "b's record never reached etcd"
        assert not a.fenced.is_set() and not b.fenced.is_set()
        assert not a.etcd_lost.is_set() and not b.etcd_lost.is_set()
        assert {n: r.joined_rev for n, r in after.nodes.items()} == {
            n: r.joined_rev for n, r in view.nodes.items()
        }, "the same registrations: the leases survived the restart"
        events = read_events(tmp_path / "run")
        kinds = [(e["node"], e["event"]) for e in events if e["event"].startswith("etcd_")]
        assert ("a", "etcd_unreachable") in kinds and ("a", "etcd_reachable") in kinds
        assert not [e for e in events if e["event"] == "fenced"]
    finally:
        a.leave()
        b.leave()


def test_past_the_grace_period_the_node_gives_up_and_says_why(
    own_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    a = joined(own_etcd, "a", tmp_path, cfg=replace(FAST, etcd_grace_s=2.0), min_nodes=1)
    try:
        own_etcd.stop_member(0, kill=True)
        assert a.etcd_lost.wait(15), "the node never gave up"
        assert not a.fenced.is_set()
        lost = [e for e in read_events(tmp_path / "run") if e["event"] == "etcd_lost"]
        assert len(lost) == 1
        assert "rendezvous.etcd_grace_s=2" in lost[0]["reason"]
        assert "bring etcd back" in lost[0]["fix"]
    finally:
        a.leave()  # etcd is down: the revoke fails with a warning, not an exception


def test_losing_one_member_of_three_costs_nothing(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log", members=3) as etcd:
        a, b = joined(etcd, "a", tmp_path), joined(etcd, "b", tmp_path)
        client = connect(etcd.endpoints)
        keepalive = KeepAliveStream(client, client.lease(10).id)
        try:
            view = a.wait(formed(1), timeout=15)
            assert view is not None and view.round is not None
            assert keepalive.refresh(timeout_s=1.0) > 0
            etcd.stop_member(0, kill=True)  # the member both clients talk to (the first)
            # Its stream ended with the member: the refresh goes out again on a new one, at once
            # (answered once the survivors have a raft leader, if the dead member was theirs).
            assert keepalive.refresh(timeout_s=3.0) > 0
            b.record.report_failure("a worker crashed after the member died")
            b.record.set_ready()
            after = a.wait(formed(2), timeout=15)
            assert after is not None, "no new round through the surviving members"
            assert not a.fenced.is_set() and not b.fenced.is_set()
            assert not [e for e in read_events(tmp_path / "run") if e["event"] == "etcd_lost"]
        finally:
            keepalive.close()
            a.leave()
            b.leave()
