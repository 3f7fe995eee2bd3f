"""The etcd rendezvous against a real etcd server (and real processes for node death)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elastic.config import RendezvousConfig
from launcher.rendezvous import leader
from launcher.rendezvous.etcd import connect, read_at_one_revision
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.membership import JobView, NodeRecord
from launcher.rendezvous.rendezvous import NodeIdInUse, Rendezvous

from .conftest import FAST, AnswerLost


def ids(rdzv: Rendezvous, view: JobView) -> list[str]:
    """The round's members, in rank order, as ``rdzv`` reads them whole: a node that does not
    lead keeps only its own member key, and reads the others on demand."""
    assert view.round is not None
    whole = rdzv.whole_round(view.round)
    assert whole is not None and whole.whole
    return [m.node_id for m in whole.members]


def leading(make, node_id: str, **kwargs):  # type: ignore[no-untyped-def]
    """A node made first and left to claim the lead before the test makes another. A test that
    reads other members' rows from this node's view needs it to lead: a node that does not
    lead keeps only its own row, and under load a node made next can win the claim."""
    rdzv = make(node_id, **kwargs)
    assert rdzv.wait(lambda v: bool(v.leader), timeout=10) is not None and rdzv.leads
    return rdzv


def round_number(n: int):  # type: ignore[no-untyped-def]
    return lambda v: v.round is not None and v.round.number >= n


# --- against etcd --------------------------------------------------------------------------------


def test_a_snapshot_reads_every_key_as_of_one_revision(etcd_client, job_id) -> None:
    a, b = f"/elastic/{job_id}/a", f"/elastic/{job_id}/b"
    etcd_client.put(a, "1")
    first, _ = read_at_one_revision(etcd_client, [(a, None)])
    etcd_client.put(b, "2")
    etcd_client.put(a, "3")
    revision, found = read_at_one_revision(etcd_client, [(a, None), (b, None)], first)
    assert revision == first
    assert [[kv.value for kv in kvs] for kvs in found] == [[b"1"], []]  # as it was then
    revision, found = read_at_one_revision(etcd_client, [(a, None), (b, None)])
    assert revision > first and [[kv.value for kv in kvs] for kvs in found] == [[b"3"], [b"2"]]


def test_node_key_lives_under_a_lease_and_leave_removes_it(make, etcd_client, job_id) -> None:
    a = make("a")
    key = f"/elastic/{job_id}/nodes/a"
    value, meta = etcd_client.get(key)
    assert value is not None and meta.lease_id == a._lease.id
    a.leave()
    assert etcd_client.get(key)[0] is None


def test_duplicate_node_id_is_refused_naming_the_holder_which_can_be_taken_over(make) -> None:
    first = make("a")
    with pytest.raises(NodeIdInUse, match="cluster.node_id") as err:
        make("a")
    holder = err.value.holder
    assert (holder.node_id, holder.store_port) == ("a", first.node.store_port)
    seen = first.wait(lambda view: "a" in view.nodes, timeout=5)  # its own key, by its watch
    assert seen is not None and holder.joined_rev == seen.nodes["a"].joined_rev
    # What an agent does when the holder is its own dead incarnation: delete that registration.
    assert first.evict(holder, "an earlier incarnation of this node, now gone")
    assert first.fenced.wait(5)  # the old registration finds itself gone


def test_a_registration_whose_answer_is_lost_stands(etcd_endpoint, etcd_client, job_id) -> None:
    """etcd created the node's key, and the answer was lost: the retry finds the key under a
    lease of its own earlier attempt, so the node is registered, not refused as its own rival
    (which cost a lease TTL's wait before the key expired)."""
    raw = AnswerLost(connect([etcd_endpoint]))
    r = Rendezvous(
        raw,
        job_id=job_id,
        node=NodeRecord("a", "127.0.0.1", 1000, 1),
        cfg=FAST,
        min_nodes=1,
        max_nodes=1,
    )
    raw.lose = 1
    r.join()
    try:
        _, meta = etcd_client.get(f"/elastic/{job_id}/nodes/a")
        assert meta.lease_id == r._lease.id and meta.create_revision == r._registration
        r.record.set_ready()  # and it goes on as any node: a round of its own
        assert r.wait(lambda view: view.round is not None, timeout=10) is not None
    finally:
        r.leave()
    assert etcd_client.get(f"/elastic/{job_id}/nodes/a")[0] is None


def test_first_round_waits_for_max_nodes_then_forms_at_once(make) -> None:
    slow = RendezvousConfig(lease_ttl_s=2, settle_s=0.3, first_round_wait_s=30)
    a = leading(make, "a", max_nodes=3, cfg=slow)  # b's view is a follower's, of its own row
    b = make("b", max_nodes=3, cfg=slow)
    assert a.wait(round_number(1), timeout=1.0) is None  # 2 of 3: still waiting
    t0 = time.monotonic()
    make("c", max_nodes=3, cfg=slow)
    view = b.wait(round_number(1), timeout=10)
    assert view is not None and time.monotonic() - t0 < 5
    assert not view.round.whole and view.round.members == (view.round.member("b"),)
    assert (view.round.size, view.round.member("b").first_rank) == (3, 1)
    assert ids(b, view) == ["a", "b", "c"]


def test_min_nodes_holds_the_round_back(make) -> None:
    a = make("a", min_nodes=2)
    assert a.wait(round_number(1), timeout=1.5) is None
    make("b", min_nodes=2)
    view = a.wait(round_number(1), timeout=10)
    assert view is not None and view.round.world_size == 2


def test_settle_time_closes_a_round_below_max_nodes(make) -> None:
    a = make("a", max_nodes=3)
    make("b", max_nodes=3)
    view = a.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
    assert view is not None


def test_a_late_node_enters_at_the_next_round(make) -> None:
    a = make("a", max_nodes=3)
    make("b", max_nodes=3)
    first = a.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
    assert first is not None
    c = make("c", max_nodes=3)
    view = c.wait(round_number(first.round.number + 1), timeout=10)
    assert view is not None
    assert ids(c, view) == ["a", "b", "c"]


def test_done_names_its_round_to_the_others_and_to_a_newcomer_and_stops_new_rounds(
    make,
) -> None:
    a = make("a", max_nodes=3)
    b = make("b", max_nodes=3)
    first = b.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
    assert first is not None and first.done_in is None
    a.mark_done(first.round.number)
    seen = b.wait(lambda v: v.done, timeout=10)  # through b's watch
    assert seen is not None and seen.done_in == first.round.number
    c = make("c", max_nodes=3)  # from c's snapshot; and no round makes room for it
    known = c.wait(lambda v: v.done, timeout=10)
    assert known is not None and known.done_in == first.round.number
    assert c.wait(round_number(first.round.number + 1), timeout=1.5) is None


def test_round_replacement_is_fenced(make) -> None:
    a = make("a", max_nodes=2)
    b = make("b", max_nodes=2)
    # Both in the round: the leader has nothing left to propose (a round of a alone, with b
    # still to come, would be replaced by the leader too).
    view = a.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
    assert view is not None and view.round is not None
    members = list(view.nodes.values())
    assert a.propose(view, members)  # replaces the round it saw
    assert not b.propose(view, members)  # the same stale view loses
    number = view.round.number + 1
    latest = b.wait(round_number(number), timeout=5)
    assert latest is not None and latest.round.number == number


def test_a_rounds_member_keys_are_fenced_read_one_each_and_their_stale_folders_deleted(
    make, etcd_client, job_id, monkeypatch
) -> None:
    """The leader writes one key per member, in batches of at most MEMBERS_PER_TXN, before the
    fenced head; a losing proposal's keys and an older round's go; a node reads only its own
    key with each round (O(1) bytes whatever the job's size) and all of them on demand."""
    monkeypatch.setattr(leader, "MEMBERS_PER_TXN", 2)  # three members: two batches
    a = leading(make, "a")
    b, c = make("b"), make("c")
    view = a.wait(lambda v: v.round is not None and v.round.world_size == 3, timeout=10)
    assert view is not None and view.round is not None and view.round.whole  # a leads
    folders = JobKeys("/elastic", job_id).round_parts

    def parts() -> list[str]:
        return sorted(m.key.decode()[len(folders) :] for _, m in etcd_client.get_prefix(folders))

    members = list(view.nodes.values())
    # c's reads are measured from here: it must have read the round it is in already (its watch
    # may deliver that round late on a loaded machine, and the read would count below).
    assert c.wait(round_number(view.round.number), timeout=10)
    assert a.propose(view, members)
    assert not b.propose(view, members)  # the same stale view loses, and its keys go
    number = view.round.number + 1
    folder = parts()[0].split("/")[0]
    assert folder.startswith(f"{number:012d}-{a._registration:012d}-")
    assert parts() == [f"{folder}/{n}" for n in ("a", "b", "c")]  # the older round's are gone
    d = make("d")  # no room for it: it reads the round from its first snapshot
    for follower, me in ((c, "c"), (d, None)):  # c from a watch event
        before = follower.load.read_bytes
        seen = follower.wait(round_number(number), timeout=10)
        assert seen is not None and seen.round is not None and not seen.round.whole
        assert [m.node_id for m in seen.round.members] == ([me] if me else [])
        assert seen.round.size == 3 and seen.round.parts_id == folder
        assert follower.load.read_bytes - before < 100  # its own key at most
        assert ids(follower, seen) == ["a", "b", "c"]  # on demand, checked against the digest
        assert follower.whole_round(seen.round) is follower.whole_round(seen.round)  # kept
    d.leave()
    c.leave()
    assert a.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
    assert [p.split("/")[0] for p in parts()] == [parts()[0].split("/")[0]] * 2


def test_report_failure_brings_a_new_round_with_the_new_incarnation(make) -> None:
    a = leading(make, "a", max_nodes=2)  # b's row is read from its view
    b = make("b", max_nodes=2)
    assert a.wait(round_number(1), timeout=10)
    b.record.report_failure("test")
    view = a.wait(round_number(2), timeout=10)  # b left the round at once: not ready
    assert view is not None and ids(a, view) == ["a"]
    b.record.set_ready()
    view = a.wait(round_number(3), timeout=10)
    assert view is not None and view.round.member("b").incarnation == 1


def test_an_evicted_node_fences_itself_and_the_others_go_on(make) -> None:
    a = leading(make, "a", max_nodes=2)  # b's row is read from its view
    b = make("b", max_nodes=2)
    view = a.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
    assert view is not None
    assert a.evict(view.round.member("b"), "test")
    assert not a.evict(view.round.member("b"), "test")  # that registration is gone already
    assert b.fenced.wait(timeout=5)
    after = a.wait(lambda v: v.round.number > view.round.number, timeout=5)
    assert after is not None and ids(a, after) == ["a"]


def eventually(check, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_on_change_is_called_for_view_changes_and_fencing(
    make, etcd_endpoint: str, job_id: str
) -> None:
    """The agent's inbox hears of every change: the callback runs once the view or the fenced
    flag shows it."""
    seen: list[tuple[int, bool]] = []
    b = Rendezvous(
        connect([etcd_endpoint]),
        job_id=job_id,
        node=NodeRecord("b", "127.0.0.1", 1001, 1),
        cfg=FAST,
        min_nodes=1,
        max_nodes=2,
        on_change=lambda: seen.append((b.view.revision, b.fenced.is_set())),
    )
    b.join()
    try:
        b.record.set_ready()
        a = make("a", max_nodes=2)
        view = b.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
        assert view is not None
        assert eventually(lambda: any(rev >= view.revision for rev, _ in seen))
        assert not any(fenced for _, fenced in seen)
        assert a.evict(view.round.member("b"), "test")
        assert b.fenced.wait(timeout=5)
        assert eventually(lambda: any(fenced for _, fenced in seen))
    finally:
        b.leave()


NODE_PROCESS = textwrap.dedent("""
    import sys
    from elastic.config import RendezvousConfig
    from launcher.rendezvous.etcd import connect
    from launcher.rendezvous.membership import JobView, NodeRecord
    from launcher.rendezvous.rendezvous import Rendezvous
    endpoint, job = sys.argv[1], sys.argv[2]
    r = Rendezvous(connect([endpoint]), job_id=job, node=NodeRecord("doomed", "127.0.0.1", 1, 1),
                   cfg=RendezvousConfig(lease_ttl_s=2, settle_s=0.3, first_round_wait_s=0.3),
                   min_nodes=1, max_nodes=3)
    r.join()
    r.record.set_ready()
    print("joined", flush=True)
    sys.stdin.read()
""")


def test_a_killed_node_is_dropped_when_its_lease_expires(make, etcd_endpoint, job_id) -> None:
    a = make("a", max_nodes=3)
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE_PROCESS, etcd_endpoint, job_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "joined"
        both = a.wait(lambda v: v.round is not None and v.round.world_size == 2, timeout=10)
        assert both is not None
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        view = a.wait(
            lambda v: v.round is not None and v.round.number > both.round.number, timeout=15
        )
        took = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
    assert view is not None
    assert ids(a, view) == ["a"]
    assert "doomed" not in view.nodes
    assert took < 2 + 0.3 + 3  # TTL + settle + generous slack


def test_a_node_that_registers_again_is_a_new_member(make) -> None:
    """A relaunched node must not mistake the round of its previous registration for its own."""
    a = make("a", max_nodes=2)
    b = make("b", max_nodes=2)
    first = b.wait(round_number(1), timeout=10)
    assert first is not None
    a.leave()
    a.join()  # same node id, incarnation 0 again, but a new registration
    a.record.set_ready()
    assert not a.view.round_intact() or a.view.round.number > first.round.number
    view = a.wait(
        lambda v: v.round_intact() and v.round.number > first.round.number and v.round.member("a"),
        timeout=10,
    )
    assert view is not None
    assert view.round.member("a").joined_rev == view.nodes["a"].joined_rev


def test_a_node_evicted_while_it_did_not_run_finds_out_by_reading_its_key(
    make, etcd_client
) -> None:
    """An agent frozen while a peer evicted it must not act on the view it wakes to before its
    watch speaks: :meth:`Rendezvous.confirm` reads its key and fences it at once."""
    a, b = make("a"), make("b")
    a.confirm()  # its own registration, still there
    assert not a.fenced.is_set()
    b._stop.set()  # as frozen: its threads run no more,
    b._wake.set()
    b.follower.cancel()  # and no watch tells it that its key went
    etcd_client.delete(b.keys.node("b"))
    assert not b.fenced.is_set()
    b.confirm()
    assert b.fenced.is_set()
