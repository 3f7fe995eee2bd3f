"""Round planning (launcher/rendezvous/round_plan.py), pure: who is in the next round, in which
order, whether it only drops members, and when a planned leave switches rounds."""

from __future__ import annotations

from dataclasses import replace

from launcher.rendezvous.membership import JobView, NodeRecord, Round
from launcher.rendezvous.round_plan import plan_round, shrink_only, switch_step


def node(name: str, rev: int = 0, incarnation: int = 0, slots: int = 1) -> NodeRecord:
    return NodeRecord(name, "127.0.0.1", 1000, slots, incarnation, ready=True, joined_rev=rev)


def leaving(n: NodeRecord, after_step: int) -> NodeRecord:
    return replace(n, leaving_after=after_step)


def rec(name: str, rev: int, incarnation: int = 0, ready: bool = True) -> NodeRecord:
    """A node record with every field named (``ready`` sits before ``joined_rev``)."""
    return NodeRecord(name, "127.0.0.1", 1000, 1, incarnation, ready=ready, joined_rev=rev)


def test_plan_round_orders_survivors_first_then_newcomers_by_join_order() -> None:
    current = Round.build(4, [node("b", 2), node("a", 1)])
    view = JobView({"a": node("a", 1), "c": node("c", 3), "d": node("d", 0)}, current, 10)
    assert [n.node_id for n in plan_round(view, 1, 3) or []] == ["a", "d", "c"]


def test_plan_round_keeps_an_intact_full_round_and_respects_min_nodes() -> None:
    full = Round.build(1, [node("a", 1), node("b", 2)])
    spare = JobView({"a": node("a", 1), "b": node("b", 2), "c": node("c", 3)}, full, 5)
    assert plan_round(spare, 1, 2) is None  # c waits as a spare: the round is full
    assert [n.node_id for n in plan_round(spare, 1, 3) or []] == ["a", "b", "c"]
    assert plan_round(JobView({"a": node("a", 1)}), 2, 3) is None


def test_plan_round_replaces_a_round_whose_member_reported_a_failure() -> None:
    current = Round.build(1, [node("a", 1), node("b", 2)])
    view = JobView({"a": node("a", 1), "b": node("b", 2, incarnation=1)}, current, 5)
    assert not view.round_intact()
    planned = plan_round(view, 1, 2) or []
    assert [(n.node_id, n.incarnation) for n in planned] == [("a", 0), ("b", 1)]


def test_a_leaving_member_breaks_the_round_and_is_not_placed_again() -> None:
    current = Round.build(1, [node("a", 1), node("b", 2), node("c", 3)])
    view = JobView({"a": node("a", 1), "b": leaving(node("b", 2), 16), "c": node("c", 3)}, current)
    assert not view.round_intact()
    planned = plan_round(view, 1, 3) or []
    assert [n.node_id for n in planned] == ["a", "c"]


def test_a_round_that_only_lets_planned_leavers_go_switches_after_their_step() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    current = Round.build(1, [a, b, c])
    view = JobView({"a": a, "b": leaving(b, 16), "c": leaving(c, 17)}, current)
    assert switch_step(view, [a]) == 17  # the later of the two: nobody has trained past it
    # Anything else switches at once: a failure (the step in flight cannot finish) or a join.
    assert switch_step(JobView({"a": a, "c": c}, current), [a, c]) == 0  # b died
    b_leaves = {"a": a, "b": leaving(b, 16), "c": c}
    assert switch_step(JobView(b_leaves, current), [a]) == 0  # c goes too, unplanned
    assert switch_step(JobView(b_leaves | {"d": node("d", 4)}, current), [a, c, node("d", 4)]) == 0
    # A leaver that came back as a new incarnation (it failed meanwhile) is a failure too.
    failed = b_leaves | {"b": leaving(node("b", 2, 1), 16)}
    assert switch_step(JobView(failed, current), [a, c]) == 0
    assert switch_step(JobView(b_leaves), [a, c]) == 0  # no round yet
    head, rows = Round.build(2, [a, c], after_step=16).to_values()
    assert Round.from_values(head, rows, whole=True).after_step == 16


# --- readiness, registrations and shrinking rounds ----------------------------------------------


def test_pure_non_ready_nodes_are_not_placed_in_a_round() -> None:
    view = JobView({"a": rec("a", 1), "b": rec("b", 2, ready=False), "c": rec("c", 3)})
    assert [n.node_id for n in plan_round(view, 1, 3) or []] == ["a", "c"]
    assert plan_round(view, 3, 3) is None  # only two of the three nodes are ready


def test_pure_a_ready_newcomer_joins_but_a_non_ready_one_does_not_break_the_round() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2)])
    quiet = JobView({"a": rec("a", 1), "b": rec("b", 2), "c": rec("c", 3, ready=False)}, current)
    assert quiet.round_intact()
    assert plan_round(quiet, 1, 3) is None
    ready = JobView({"a": rec("a", 1), "b": rec("b", 2), "c": rec("c", 3)}, current)
    assert [n.node_id for n in plan_round(ready, 1, 3) or []] == ["a", "b", "c"]


def test_pure_a_member_turning_non_ready_is_dropped() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2), rec("c", 3)])
    intact = JobView({"a": rec("a", 1), "b": rec("b", 2), "c": rec("c", 3)}, current)
    assert intact.round_intact() and plan_round(intact, 1, 3) is None
    view = JobView({"a": rec("a", 1), "b": rec("b", 2, ready=False), "c": rec("c", 3)}, current)
    assert not view.round_intact()
    planned = plan_round(view, 1, 3) or []
    assert [n.node_id for n in planned] == ["a", "c"]
    assert shrink_only(current, planned)


def test_pure_a_member_that_reported_a_failure_is_dropped_until_ready() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2)])
    failed = JobView({"a": rec("a", 1), "b": rec("b", 2, incarnation=1, ready=False)}, current)
    assert not failed.round_intact()
    assert [n.node_id for n in plan_round(failed, 1, 2) or []] == ["a"]
    back = JobView({"a": rec("a", 1), "b": rec("b", 2, incarnation=1)}, current)
    assert not back.round_intact()
    planned = plan_round(back, 1, 2) or []
    assert [(n.node_id, n.incarnation) for n in planned] == [("a", 0), ("b", 1)]
    assert not shrink_only(current, planned)  # b comes back as a new incarnation


def test_pure_a_re_registered_member_breaks_the_round() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2)])
    view = JobView({"a": rec("a", 1), "b": rec("b", 7)}, current)
    assert not view.round_intact()
    planned = plan_round(view, 1, 2) or []
    assert [(n.node_id, n.joined_rev) for n in planned] == [("a", 1), ("b", 7)]
    assert not shrink_only(current, planned)


def test_pure_shrink_only() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2), rec("c", 3)])
    assert shrink_only(current, [rec("a", 1), rec("c", 3)])
    assert shrink_only(current, [rec("b", 2)])
    assert not shrink_only(current, [rec("a", 1), rec("d", 4)])  # a newcomer
    assert not shrink_only(current, [rec("a", 1), rec("c", 9)])  # c registered again
    assert not shrink_only(current, [rec("a", 1), rec("c", 3, incarnation=1)])
    assert not shrink_only(None, [rec("a", 1)])
