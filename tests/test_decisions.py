"""The agent's decisions (launcher/agent/decisions.py) on literal data: no etcd, no processes; and
its inbox (launcher/agent/inbox.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

from elastic.control import EXIT_PEER_LOST, EXIT_UNSAVED, Assignment
from launcher.agent.decisions import (
    REQUESTABLE_KINDS,
    Assign,
    Drain,
    Evict,
    Finish,
    GiveUp,
    IdTaken,
    Leave,
    Rejoin,
    Restart,
    Standby,
    StopNode,
    TakeOver,
    Unsaved,
    WaitForId,
    answer_fault_request,
    assignments,
    away_for,
    follow_round,
    join_timed_out,
    keeps_workers,
    leaves_done_job,
    on_membership,
    on_node_id_in_use,
    on_stop,
    on_straggler,
    on_worker_exits,
    others_go_on,
    publishes_progress,
    refusing_checks,
)
from launcher.agent.inbox import Inbox, RendezvousChanged, Signal, WorkerExited, WorkerPeerLost
from launcher.agent.peer_decisions import (
    Blameless,
    Fruitless,
    Probe,
    Reach,
    evicts_now,
    fruitless,
    no_one_to_blame,
    on_peer_lost,
    peers_to_evict,
    reaches_the_round,
    ring_neighbours,
)
from launcher.local_cluster import FINISHED_GRACE_S, still_waiting
from launcher.rendezvous.membership import JobView, NodeRecord, Round, excluded_ranks

from .test_round_plan import leaving, node


def job(
    rnd: Round | None, *nodes: NodeRecord, quarantined: frozenset[str] = frozenset()
) -> JobView:
    """The leader's view: it follows every node."""
    return JobView({n.node_id: n for n in nodes}, rnd, quarantined=quarantined, complete=True)


# --- worker exits -------------------------------------------------------------------------------


def test_running_workers_need_nothing() -> None:
    assert on_worker_exits([None, None], crashes=0, max_restarts=3) is None


def test_a_worker_that_finished_finishes_the_node() -> None:
    assert on_worker_exits([0, 0], 0, 3) == Finish()
    assert on_worker_exits([0, None], 0, 3) == Finish()  # the other finishes the same last step
    assert on_worker_exits([0, -9], 5, 3) == Finish()  # finished beats crashed and gave up


def test_a_worker_trained_but_unsaved_ends_the_node_without_a_restart_or_a_strike() -> None:
    assert on_worker_exits([EXIT_UNSAVED, None], 0, 3) == Unsaved()  # the other ends alike
    assert on_worker_exits([EXIT_UNSAVED, EXIT_UNSAVED], 3, 3) == Unsaved()  # no restart limit
    assert "checkpoint.final_retry_s" in Unsaved().reason


def test_a_crash_restarts_the_worker_with_a_strike() -> None:
    plan = on_worker_exits([None, -9], crashes=1, max_restarts=3)
    assert plan == Restart(
        local_ranks=(1,),
        codes=(-9,),
        crashes=2,
        strike="worker(s) crashed with exit codes [-9]",
    )
    assert isinstance(plan, Restart) and plan.reason == "worker exit codes [-9]"


def test_peer_lost_restarts_without_a_strike() -> None:
    plan = on_worker_exits([EXIT_PEER_LOST, None], crashes=3, max_restarts=3)
    assert plan == Restart(local_ranks=(0,), codes=(EXIT_PEER_LOST,), crashes=3, strike=None)


def test_a_crash_and_a_peer_lost_count_one_crash_and_restart_both() -> None:
    plan = on_worker_exits([1, EXIT_PEER_LOST, None], crashes=0, max_restarts=3)
    assert plan == Restart(
        local_ranks=(0, 1),
        codes=(1, EXIT_PEER_LOST),
        crashes=1,
        strike=f"worker(s) crashed with exit codes [1, {EXIT_PEER_LOST}]",
    )


def test_crashes_beyond_max_restarts_give_up() -> None:
    assert isinstance(on_worker_exits([-9], crashes=2, max_restarts=3), Restart)  # the 3rd: ok
    assert on_worker_exits([-9], crashes=3, max_restarts=3) == GiveUp(crashes=4, max_restarts=3)
    assert on_worker_exits([1, 1], crashes=2, max_restarts=3) == GiveUp(4, 3)
    assert on_worker_exits([-9], crashes=0, max_restarts=0) == GiveUp(1, 0)


# --- membership ---------------------------------------------------------------------------------


def test_fencing_rejoins_with_a_strike_and_quarantine_without() -> None:
    assert on_membership(fenced=False, quarantined=False, etcd_lost=False) is None
    assert on_membership(fenced=True, quarantined=False, etcd_lost=False) == Rejoin(
        "lost its place in the job (fenced)", strike=True
    )
    assert on_membership(fenced=False, quarantined=True, etcd_lost=False) == Rejoin(
        "was quarantined", strike=False
    )
    fenced_and_quarantined = on_membership(fenced=True, quarantined=True, etcd_lost=False)
    assert isinstance(fenced_and_quarantined, Rejoin) and fenced_and_quarantined.strike


def test_a_drain_for_a_quarantine_that_ran_out_meanwhile_still_rejoins() -> None:
    """health.quarantine_s=4 ran out while a slowed worker handed its round over: the node,
    marked leaving, sat outside every round for the rest of the job (issue 47)."""
    assert on_membership(False, quarantined=False, etcd_lost=False, draining=True) == Rejoin(
        "was quarantined", strike=False
    )


def test_a_fenced_node_keeps_live_workers_and_a_quarantined_one_stops_them() -> None:
    fenced = Rejoin("lost its place in the job (fenced)", strike=True)
    assert keeps_workers(fenced, quarantined=False, exit_codes=[None, None])
    assert not keeps_workers(fenced, quarantined=True, exit_codes=[None, None])
    assert not keeps_workers(fenced, quarantined=False, exit_codes=[None, 1])
    assert not keeps_workers(Rejoin("was quarantined", strike=False), False, [None])


def test_etcd_lost_beyond_the_grace_period_stops_the_node_whatever_else_holds() -> None:
    for fenced in (False, True):
        for quarantined in (False, True):
            assert on_membership(fenced, quarantined, etcd_lost=True) == StopNode()


def test_an_id_held_by_this_nodes_own_dead_incarnation_is_taken_over_at_once() -> None:
    assert on_node_id_in_use("10.0.0.5", "10.0.0.5", holder_alive=False, waited_too_long=False) == (
        TakeOver()
    )
    # Alive, or another host's: its lease decides, up to a bound.
    assert on_node_id_in_use("10.0.0.5", "10.0.0.5", True, False) == WaitForId()
    assert on_node_id_in_use("10.0.0.9", "10.0.0.5", False, False) == WaitForId()
    assert on_node_id_in_use("10.0.0.9", "10.0.0.5", True, True) == IdTaken()
    assert on_node_id_in_use("10.0.0.5", "10.0.0.5", False, True) == TakeOver()


def test_a_node_in_a_running_job_is_not_refused_for_what_every_node_shares() -> None:
    failed = ["checkpoint_disk", "etcd", "open_files"]
    assert refusing_checks(failed, in_running_job=False) == failed  # a first join: refused
    assert refusing_checks(failed, in_running_job=True) == ["open_files"]  # its own fault only
    assert refusing_checks(["checkpoint_disk"], in_running_job=True) == []


# --- peer lost ----------------------------------------------------------------------------------


def test_peer_lost_probes_the_other_members_not_known_to_be_gone() -> None:
    rnd = Round.build(5, [node("a", 1), node("b", 2), node("c", 3)])
    view = job(rnd, node("a", 1), node("c", 3), node("z", 9))  # b's key is gone already
    found = on_peer_lost(rnd, lost_round=5, view=view, me="a")
    assert found == Probe(rnd, (rnd.member("c"),))
    # A node that does not lead knows only its own record: it probes every other member.
    own = JobView({"a": node("a", 1)}, rnd)
    assert on_peer_lost(rnd, 5, own, "a") == Probe(rnd, (rnd.member("b"), rnd.member("c")))


def test_the_first_alive_and_a_dead_peers_ring_neighbours_evict_at_once_the_others_later() -> None:
    rnd = Round.build(5, [node(n, i) for i, n in enumerate("abcde", start=1)])
    found = Probe(rnd, ())
    reach = {"a": ALIVE, "b": ALIVE, "c": DEAD, "d": ALIVE, "e": ALIVE}  # c is gone
    # a comes first; b and d are c's neighbours (b sends to c, d receives from it).
    assert [n for n in "abde" if evicts_now(found, reach, n, 0.0, backup_s=3.0)] == ["a", "b", "d"]
    assert not evicts_now(found, reach, "e", waited_s=2.9, backup_s=3.0)
    # a may be frozen (its port accepts), b and d may not have seen it: after a lease, all do.
    assert evicts_now(found, reach, "e", waited_s=3.0, backup_s=3.0)
    # Rank 0 gone: the ring wraps, so the last member is its neighbour, as is the next.
    first_gone = {"a": DEAD, "b": ALIVE, "c": ALIVE, "d": ALIVE, "e": ALIVE}
    assert [n for n in "bcde" if evicts_now(found, first_gone, n, 0.0, 3.0)] == ["b", "e"]
    # A partition: cut off from b and c, e's side is a, d and e, and a evicts first, d as c's
    # neighbour; cut off from all (peers_to_evict then evicts no one: e is the minority), e
    # comes first on its side.
    cut = {"a": ALIVE, "b": CUT, "c": CUT, "d": ALIVE}
    assert [n for n in "ade" if evicts_now(found, cut, n, 0.0, 3.0)] == ["a", "d"]
    assert evicts_now(found, {"a": CUT, "b": CUT, "c": CUT, "d": CUT}, "e", 0.0, 3.0)


def test_ring_neighbours_are_the_live_members_next_to_a_gone_one_cyclic() -> None:
    ids = list("abcdef")
    assert ring_neighbours(ids, set(ids)) == set()
    assert ring_neighbours(ids, set()) == set()
    assert ring_neighbours(ids, set("abdef")) == {"b", "d"}
    assert ring_neighbours(ids, set("bcdf")) == {"f", "b", "d"}  # a, e gone: a wraps to f
    assert ring_neighbours(ids, set("ad")) == {"a", "d"}
    assert ring_neighbours(ids, {"c"}) == {"c"}


def test_a_broken_round_whose_peers_all_answer_is_left_after_a_lease() -> None:
    """A partition that healed before pg_timeout_s fired: every probe connects, nobody is
    evicted, and after a lease TTL (time for a dead or frozen peer to lose its lease) the node
    leaves the round so that it is formed again."""
    rnd = Round.build(5, [node("a", 1), node("b", 2), node("c", 3)])
    found = Probe(rnd, (rnd.member("b"), rnd.member("c")))
    everyone = {"b": ALIVE, "c": ALIVE}
    assert not no_one_to_blame(found, everyone, waited_s=2.9, backup_s=3.0)
    assert no_one_to_blame(found, everyone, waited_s=3.0, backup_s=3.0)
    assert peers_to_evict(found, everyone, "a") == []
    # A peer that is dead or out of reach is someone to blame: eviction (or fencing) mends it.
    assert not no_one_to_blame(found, {"b": ALIVE, "c": DEAD}, 9.0, 3.0)
    assert not no_one_to_blame(found, {"b": CUT, "c": ALIVE}, 9.0, 3.0)


def test_rounds_left_with_no_one_to_blame_and_trained_nothing_in_stop_the_node() -> None:
    """A collective that fails by itself (an operation the backend lacks) fails every round
    though every peer answers: after 5 such rounds in a row in which the node trained nothing it
    stops, instead of forming rounds without end. The others may train alone between its rounds,
    so its step moves on (in a 2-node CI run of 2026-11-30, node0 trained step 5 alone between
    two of node1's rounds); a round it trained in starts the count again."""
    none = [Blameless(7, 0)] * 4
    assert fruitless(none, 5) is None
    stop = fruitless([Blameless(3, 2), *none, Blameless(7, 0)], 5)
    assert stop == Fruitless(rounds=5, step=7)
    assert stop.message().startswith(
        "5 rounds in a row failed though every peer answered, and this node trained no step in "
        "any of them (the last at step 7)"
    )
    moving = [Blameless(s, 0) for s in (5, 5, 6, 8, 9)]  # the others trained between
    assert fruitless(moving, 5) == Fruitless(rounds=5, step=9)
    assert fruitless([*none, Blameless(8, 1)], 5) is None  # it trained a step in the last


def test_no_report_or_a_stale_one_probes_nothing() -> None:
    rnd = Round.build(5, [node("a", 1), node("b", 2)])
    view = job(rnd, node("a", 1), node("b", 2))
    assert on_peer_lost(rnd, lost_round=0, view=view, me="a") is None
    assert on_peer_lost(rnd, lost_round=4, view=view, me="a") is None  # an older round
    assert on_peer_lost(None, lost_round=5, view=view, me="a") is None  # on standby


ALIVE, DEAD, CUT = Reach.ALIVE, Reach.DEAD, Reach.UNREACHABLE


def test_peers_whose_agent_is_gone_are_evicted_by_anyone() -> None:
    rnd = Round.build(5, [node("a", 1), node("b", 2), node("c", 3), node("d", 4)])
    view = job(rnd, node("a", 1), node("b", 2), node("c", 3), node("d", 4))
    found = on_peer_lost(rnd, 5, view, "a")
    assert found is not None and [p.node_id for p in found.peers] == ["b", "c", "d"]
    evicted = peers_to_evict(found, {"b": ALIVE, "c": DEAD}, "a")  # d not probed: alive
    assert [(m.node_id, m.joined_rev) for m in evicted] == [("c", 3)]
    assert peers_to_evict(found, {"b": ALIVE, "c": ALIVE, "d": ALIVE}, "a") == []
    # Even a node that reaches nobody else evicts the dead.
    assert [m.node_id for m in peers_to_evict(found, {"b": CUT, "c": CUT, "d": DEAD}, "a")] == ["d"]


def test_an_unreachable_peer_is_evicted_by_the_majority_side_only() -> None:
    """A partition: the side with more live members evicts the other; a tie goes to the side
    with the round's first member; the other side evicts no one (it is the one cut off)."""
    rnd = Round.build(5, [node("a", 1), node("b", 2), node("c", 3)])
    view = job(rnd, node("a", 1), node("b", 2), node("c", 3))
    majority = on_peer_lost(rnd, 5, view, "a")
    minority = on_peer_lost(rnd, 5, view, "c")
    assert majority is not None and minority is not None
    assert [m.node_id for m in peers_to_evict(majority, {"b": ALIVE, "c": CUT}, "a")] == ["c"]
    assert peers_to_evict(minority, {"a": CUT, "b": CUT}, "c") == []
    # a dead member does not count: a and c alone, a holds rank 0 and wins the tie
    assert [m.node_id for m in peers_to_evict(majority, {"b": DEAD, "c": CUT}, "a")] == [
        "b",
        "c",
    ]
    assert [m.node_id for m in peers_to_evict(minority, {"a": CUT, "b": DEAD}, "c")] == ["b"]
    two = Round.build(6, [node("a", 1), node("b", 2)])
    found = on_peer_lost(two, 6, job(two, node("a", 1), node("b", 2)), "b")
    assert found is not None and peers_to_evict(found, {"a": CUT}, "b") == []


def test_a_node_joins_only_once_it_reaches_every_live_member_of_the_round() -> None:
    rnd = Round.build(5, [node("a", 1), node("b", 2)])
    assert reaches_the_round(None, {}, "c")  # no round yet
    assert reaches_the_round(rnd, {"a": ALIVE, "b": ALIVE}, "c")
    assert reaches_the_round(rnd, {"a": ALIVE, "b": DEAD}, "c")  # b leaves by itself
    assert not reaches_the_round(rnd, {"a": ALIVE, "b": CUT}, "c")
    assert reaches_the_round(rnd, {"b": ALIVE}, "a")  # its own old place does not count


def test_eviction_names_the_registration_the_round_lists() -> None:
    """A peer that registered again since the round is evicted as the round's member: the
    transaction compares the create revision, so the new registration is left alone."""
    rnd = Round.build(5, [node("a", 1), node("b", 2)])
    found = on_peer_lost(rnd, 5, job(rnd, node("a", 1), node("b", 7)), "a")
    assert found is not None
    [member] = peers_to_evict(found, {"b": DEAD}, "a")
    assert (member.node_id, member.joined_rev) == ("b", 2)


# --- following rounds ---------------------------------------------------------------------------


def me(name: str, incarnation: int = 0) -> NodeRecord:
    """The node's own record: it does not know its registration (joined_rev stays 0)."""
    return NodeRecord(name, "127.0.0.1", 1000, 1, incarnation, ready=True)


def test_a_member_is_assigned_its_ranks() -> None:
    rnd = Round.build(3, [node("a", 1, slots=2), node("b", 2, slots=2)])
    view = job(rnd, node("a", 1, slots=2), node("b", 2, slots=2))
    step = follow_round(view, me("b"), current=None, workers_ready=True)
    assert isinstance(step, Assign) and step.round == rnd and step.member.node_id == "b"
    assert [(a.round, a.rank, a.world_size) for a in step.assignments] == [(3, 2, 4), (3, 3, 4)]


def test_the_round_already_followed_needs_nothing() -> None:
    rnd = Round.build(3, [node("a", 1)])
    assert follow_round(job(rnd, node("a", 1)), me("a"), rnd, True) is None
    assert follow_round(job(None, node("a", 1)), me("a"), None, True) is None  # no round yet


def test_a_round_without_this_node_puts_the_workers_on_standby() -> None:
    old = Round.build(3, [node("a", 1), node("b", 2)])
    new = Round.build(4, [node("a", 1)])
    view = job(new, node("a", 1), node("b", 2))
    assert follow_round(view, me("b"), current=old, workers_ready=True) == Standby(new)
    assert follow_round(view, me("b"), current=None, workers_ready=True) is None  # standing by


def test_a_round_of_an_older_registration_or_incarnation_is_not_this_node() -> None:
    old = Round.build(3, [node("a", 1), node("b", 2)])
    rnd = Round.build(4, [node("a", 1), node("b", 2)])
    registered_again = job(rnd, node("a", 1), node("b", 7))
    assert follow_round(registered_again, me("b"), old, True) == Standby(rnd)
    # b reported a failure (incarnation 1) that the view does not show yet
    assert follow_round(job(rnd, node("a", 1), node("b", 2)), me("b", 1), old, True) == Standby(rnd)


def test_a_round_that_is_not_intact_or_workers_not_ready_waits() -> None:
    rnd = Round.build(4, [node("a", 1), node("b", 2)])
    assert follow_round(job(rnd, node("a", 1)), me("a"), None, True) is None  # b is gone
    not_ready = NodeRecord("b", "127.0.0.1", 1000, 1, 0, ready=False, joined_rev=2)
    assert follow_round(job(rnd, node("a", 1), not_ready), me("a"), None, True) is None
    quarantined = job(rnd, node("a", 1), node("b", 2), quarantined=frozenset({"b"}))
    assert follow_round(quarantined, me("a"), None, True) is None
    assert follow_round(job(rnd, node("a", 1), node("b", 2)), me("a"), None, False) is None


def test_a_planned_leave_hands_its_step_to_the_workers_of_both_sides() -> None:
    a, b = node("a", 1), node("b", 2)
    old = Round.build(3, [a, b])
    new = Round.build(4, [a], after_step=16)
    view = job(new, a, leaving(b, 16))
    assert follow_round(view, me("b"), current=old, workers_ready=True) == Standby(new, 16)
    step = follow_round(view, me("a"), current=old, workers_ready=True)
    assert isinstance(step, Assign) and [x.after_step for x in step.assignments] == [16]
    # A node that was in no round has no step to finish: it starts at once.
    step = follow_round(view, me("a"), current=None, workers_ready=True)
    assert isinstance(step, Assign) and [x.after_step for x in step.assignments] == [0]


# --- a straggler ---------------------------------------------------------------------------------


def test_a_straggler_is_evicted_only_under_evict_and_only_when_the_job_goes_on_without_it() -> None:
    evicted = on_straggler("evict", "n1", 2.04, others_go_on=True, leaving=False)
    assert isinstance(evicted, Evict) and "2.0x the median" in evicted.reason
    warned = on_straggler("warn", "n1", 2.0, others_go_on=True, leaving=False)
    assert isinstance(warned, str) and "health.straggler=warn" in warned
    kept = on_straggler("evict", "n1", 2.0, others_go_on=False, leaving=False)
    assert isinstance(kept, str) and "cluster.min_nodes" in kept
    assert isinstance(on_straggler("evict", "n1", 2.0, others_go_on=True, leaving=True), str)


# --- a planned leave ------------------------------------------------------------------------------


def test_others_go_on_counts_the_nodes_a_round_could_still_place() -> None:
    rnd = Round.build(1, [node("a", 1), node("b", 2), node("c", 3)])
    view = job(rnd, node("a", 1), node("b", 2), node("c", 3))
    assert others_go_on(view, "a", min_nodes=2)
    assert not others_go_on(view, "a", min_nodes=3)  # too few would stay
    assert not others_go_on(job(rnd, node("a", 1), leaving(node("b", 2), 9)), "a", 1)
    kept_out = job(rnd, node("a", 1), node("b", 2), quarantined=frozenset("b"))
    assert not others_go_on(kept_out, "a", 1)
    not_ready = NodeRecord("b", "127.0.0.1", 1000, 1, 0, ready=False, joined_rev=2)
    assert not others_go_on(job(rnd, node("a", 1), not_ready), "a", 1)
    done = JobView({"a": node("a", 1), "b": node("b", 2)}, rnd, done_in=1)
    assert not others_go_on(done, "a", 1)
    # A node that does not lead counts the round's other members, which the leader keeps
    # placeable, and its own quarantine.
    own = JobView({"a": node("a", 1)}, rnd)
    assert others_go_on(own, "a", min_nodes=2)
    assert not others_go_on(own, "a", min_nodes=3)


def test_a_stop_signal_drains_a_member_whose_job_goes_on_and_leaves_otherwise() -> None:
    drain = on_stop(in_round=True, others_go_on=True, asked=False, out=False, overdue=False)
    assert drain == Drain()
    assert on_stop(True, False, False, False, False) == Leave()  # the job ends with this node
    assert on_stop(False, True, False, False, False) == Leave()  # nothing to hand over
    # Draining: wait until the workers are out of their round, the drain is overdue, or the
    # others leave too (the whole job was stopped).
    assert on_stop(True, True, asked=True, out=False, overdue=False) is None
    assert on_stop(True, True, True, out=True, overdue=False) == Leave()
    assert on_stop(True, True, True, out=False, overdue=True) == Leave()
    assert on_stop(True, others_go_on=False, asked=True, out=False, overdue=False) == Leave()


# --- assignments and the NCCL shrink ------------------------------------------------------------


def test_ranks_follow_first_rank() -> None:
    rnd = Round.build(1, [node("a", 1, slots=3), node("b", 2, slots=2)])
    b = rnd.member("b")
    assert b is not None
    assert assignments(None, rnd, b) == [
        Assignment(1, rank, 5, "127.0.0.1", 1000, rnd.formed_at) for rank in (3, 4)
    ]


def test_a_shrink_excludes_the_ranks_of_the_removed_node() -> None:
    nodes = [node("a", 1, slots=2), node("b", 2, slots=2), node("c", 3, slots=2)]
    previous = Round.build(7, nodes)  # a: 0-1, b: 2-3, c: 4-5
    new = Round.build(8, [nodes[0], nodes[2]], previous=previous)  # b, from the middle, is gone
    assert excluded_ranks(previous, new) == (2, 3) == new.shrinks  # the leader's, in the head
    c = new.member("c")
    assert c is not None
    given = assignments(previous, new, c)
    assert [(a.rank, a.world_size) for a in given] == [(2, 4), (3, 4)]
    assert {(a.shrinks_round, a.excluded_ranks) for a in given} == {(7, (2, 3))}
    # the worker's side of the contract: a shrink of its own previous assignment
    old_c = Assignment(7, 4, 6, "127.0.0.1", 1000, 0.0)
    assert given[0].shrink_of(old_c) == [2, 3]


def test_removing_several_nodes_excludes_all_their_ranks() -> None:
    nodes = [node(n, i + 1, slots=2) for i, n in enumerate("abcd")]
    previous = Round.build(2, nodes)
    assert excluded_ranks(previous, Round.build(3, [nodes[1], nodes[3]])) == (0, 1, 4, 5)


def test_a_round_that_adds_a_node_is_no_shrink() -> None:
    a, b, c = node("a", 1, slots=2), node("b", 2, slots=2), node("c", 3, slots=2)
    previous = Round.build(7, [a, b])
    assert excluded_ranks(previous, Round.build(8, [a, b, c])) == ()
    assert excluded_ranks(previous, Round.build(8, [a, c])) == ()  # b left, c came


def test_a_round_that_skips_a_number_is_no_shrink() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    previous = Round.build(7, [a, b, c])
    assert excluded_ranks(previous, Round.build(9, [a, c])) == ()
    # Round 8 shrinks round 7 in place, not the round 6 these workers are still in.
    new = Round.build(8, [a, c], previous=previous)
    member = new.member("c")
    assert member is not None and new.shrinks == (1,)
    older = Round.build(6, [a, b, c])
    assert {(x.shrinks_round, x.excluded_ranks) for x in assignments(older, new, member)} == {
        (0, ())
    }


def test_no_previous_round_or_nothing_removed_is_no_shrink() -> None:
    a, b = node("a", 1), node("b", 2)
    assert excluded_ranks(None, Round.build(1, [a, b])) == ()
    assert excluded_ranks(Round.build(1, [a, b]), Round.build(2, [a, b])) == ()


def test_a_restarted_or_re_registered_member_is_no_shrink() -> None:
    """Its workers are new processes, not in the old communicator: everyone builds anew."""
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    previous = Round.build(7, [a, b, c])
    assert excluded_ranks(previous, Round.build(8, [a, node("c", 3, incarnation=1)])) == ()
    assert excluded_ranks(previous, Round.build(8, [a, node("c", 9)])) == ()


def test_survivors_out_of_order_are_no_shrink() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    previous = Round.build(7, [a, b, c])
    assert excluded_ranks(previous, Round.build(8, [c, a])) == ()


# --- waiting for a round ------------------------------------------------------------------------


def test_join_timeout() -> None:
    assert not join_timed_out(waiting_since=100.0, now=160.0, limit_s=60.0)
    assert join_timed_out(waiting_since=100.0, now=160.5, limit_s=60.0)


# --- the inbox ----------------------------------------------------------------------------------


def test_the_inbox_hands_over_everything_queued_in_order() -> None:
    inbox = Inbox()
    assert inbox.take(0) == [] and inbox.take(0.01) == []
    posted = [WorkerPeerLost(0, 3, 0), WorkerExited(1, -9), RendezvousChanged()]
    for msg in posted:
        inbox.put(msg)
    assert inbox.take(1.0) == posted
    assert inbox.take(0) == []


def test_a_signal_handler_wakes_an_agent_blocked_on_its_inbox() -> None:
    inbox = Inbox()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: inbox.put(Signal(signum)))
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        t0 = time.monotonic()
        assert inbox.take(10.0) == [Signal(signal.SIGUSR1)]
        assert time.monotonic() - t0 < 5.0
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_wait_that_overran_by_more_than_two_seconds_means_the_agent_was_away() -> None:
    assert away_for(asked_s=1.0, waited_s=1.0) == 0.0
    assert away_for(asked_s=1.0, waited_s=2.9) == 0.0  # scheduling noise, a busy machine
    assert away_for(asked_s=0.2, waited_s=15.2) == 15.0  # SIGSTOP for 15 s


def test_the_local_launcher_stops_nodes_still_waiting_once_the_job_is_trained() -> None:
    codes = {"node0": 0, "node1": None, "node2": None}
    assert still_waiting(codes, finished_at=None, now=100.0) == []  # nobody finished
    assert still_waiting(codes, finished_at=100.0, now=100.0 + FINISHED_GRACE_S / 2) == []
    assert still_waiting(codes, 100.0, 100.0 + FINISHED_GRACE_S + 1) == ["node1", "node2"]
    # A node waiting out a quarantine waits for a job that is over: stopped at once.
    assert still_waiting(codes, 100.0, 100.0, in_quarantine={"node2"}) == ["node2"]
    assert still_waiting(codes, None, 100.0, in_quarantine={"node2"}) == []  # not over yet


def test_a_fault_request_is_refused_unless_the_job_allows_chaos_and_names_the_fix() -> None:
    freeze = {"kind": "freeze_node", "duration_s": 5}
    refused = answer_fault_request(freeze, allow=False, slots=1)
    assert not refused.accepted and "chaos.allow=true" in refused.reason
    assert answer_fault_request(freeze, allow=True, slots=1).accepted


def test_a_fault_request_must_name_a_kind_a_node_can_do_to_itself_with_values_that_end() -> None:
    def why(request: dict) -> str:
        answer = answer_fault_request(request, allow=True, slots=2)
        assert not answer.accepted
        return answer.reason

    assert "kill_node" in why({"kind": "partition"}) and "kind=None" in why({})
    assert "duration_s" in why({"kind": "freeze_node", "duration_s": 0})
    assert "duration_s" in why({"kind": "freeze_node", "duration_s": "5"})
    assert "workers 0-1" in why({"kind": "kill_worker", "local_rank": 2})
    for kind in REQUESTABLE_KINDS:
        request = {"kind": kind, "duration_s": 1.0, "local_rank": 1}
        assert answer_fault_request(request, allow=True, slots=2).accepted


def test_every_requestable_kind_is_a_campaign_kind() -> None:
    from chaos.campaign import FaultKind

    assert set(REQUESTABLE_KINDS) <= {str(k) for k in FaultKind}


def test_a_done_job_is_left_unless_the_workers_finish_its_last_step() -> None:
    rnd = Round.build(9, [node("a", 1), node("b", 2)])
    assert not leaves_done_job(None, None, lost_round=0)
    assert not leaves_done_job(None, rnd, lost_round=9)  # not done: the round is mended
    assert leaves_done_job(9, None, lost_round=0)  # on standby
    assert not leaves_done_job(9, rnd, lost_round=0)  # finishing the last step
    assert not leaves_done_job(9, rnd, lost_round=8)  # an older round's report
    # Placed at the very end with nodes that finished the old round and left: nothing mends it.
    assert leaves_done_job(9, rnd, lost_round=9)
    # ... and without waiting for its collectives to fail (rendezvous.pg_timeout_s).
    assert leaves_done_job(8, rnd, lost_round=0)


def test_progress_is_published_by_rank_0s_node_for_a_new_step_at_most_every_5_s() -> None:
    rnd = Round.build(4, [node("a", 1, slots=2), node("b", 2, slots=2)])
    assert publishes_progress(rnd, "a", step=7, published=0, since_s=5.0)
    assert not publishes_progress(rnd, "b", step=7, published=0, since_s=5.0)  # ranks 2-3
    assert not publishes_progress(None, "a", step=7, published=0, since_s=5.0)  # on standby
    assert not publishes_progress(rnd, "c", step=7, published=0, since_s=5.0)  # not a member
    assert not publishes_progress(rnd, "a", step=0, published=0, since_s=5.0)  # no step yet
    assert not publishes_progress(rnd, "a", step=7, published=7, since_s=5.0)  # written already
    assert not publishes_progress(rnd, "a", step=8, published=7, since_s=4.9)  # within 5 s
    assert publishes_progress(rnd, "a", step=8, published=7, since_s=5.0)
    # A job resumed from an older checkpoint logs lower steps: they are news too.
    assert publishes_progress(rnd, "a", step=3, published=7, since_s=5.0)
