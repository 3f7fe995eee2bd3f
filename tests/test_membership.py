"""The membership's wire format and view (launcher/rendezvous/membership.py), pure: a round's
ranks, its head and member keys (what a node reads does not grow with the job), and which
registration of a node a round lists."""

from __future__ import annotations

import pytest

from launcher.rendezvous.membership import JobView, Round, RoundIncomplete

from .test_round_plan import node, rec


def test_round_ranks_follow_member_slots() -> None:
    r = Round.build(1, [node("a", slots=2), node("b", slots=3)], parts_id="p1")
    assert [(m.node_id, m.first_rank) for m in r.members] == [("a", 0), ("b", 2)]
    assert (r.world_size, r.size, r.whole) == (5, 2, True)
    head, rows = r.to_values()
    assert Round.from_values(head, rows, whole=True) == r


def test_a_round_is_a_small_head_and_one_small_key_per_member() -> None:
    """What a node reads of a round does not grow with the job: the head and its own key."""
    sizes = {}
    for n in (8, 1024):
        r = Round.build(3, [node(f"node-{i:04d}", i + 1) for i in range(n)], parts_id="p")
        head, rows = r.to_values()
        sizes[n] = (len(head), max(len(v) for v in rows.values()))
        mine = Round.from_values(head, {"node-0005": rows["node-0005"]}, whole=False)
        assert not mine.whole and [m.node_id for m in mine.members] == ["node-0005"]
        assert (mine.size, mine.world_size, mine.number) == (n, n, 3)
        assert mine.member("node-0005") == r.member("node-0005")
        assert mine.member("node-0006") is None
        outside = Round.from_values(head, {}, whole=False)  # a node the round leaves out
        assert outside.members == () and outside.size == n
        assert Round.from_values(head, rows, whole=True) == r
    assert all(head < 200 and row < 40 for head, row in sizes.values()), sizes  # digits only


def test_a_whole_read_that_misses_or_changes_a_member_is_incomplete() -> None:
    r = Round.build(3, [node(f"n{i}", i + 1) for i in range(4)], parts_id="p")
    head, rows = r.to_values()
    with pytest.raises(RoundIncomplete):  # a key deleted by a newer round meanwhile
        Round.from_values(head, {k: v for k, v in rows.items() if k != "n2"}, whole=True)
    other = Round.build(3, [node(f"n{i}", i + 5) for i in range(4)], parts_id="p").to_values()[1]
    with pytest.raises(RoundIncomplete):  # as many keys, not the ones the head names
        Round.from_values(head, other, whole=True)
    with pytest.raises(ValueError, match="not whole"):  # only a whole round is written
        Round.from_values(head, {"n1": rows["n1"]}, whole=False).to_values()


def test_pure_is_member_matches_only_the_same_registration_and_incarnation() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2)])
    view = JobView({"a": rec("a", 1), "b": rec("b", 2)}, current)
    b = view.is_member(rec("b", 2))
    assert b is not None and (b.node_id, b.joined_rev, b.first_rank) == ("b", 2, 1)
    assert view.is_member(rec("b", 5)) is None  # a new registration of b
    assert view.is_member(rec("b", 2, incarnation=1)) is None
    assert view.is_member(rec("z", 3)) is None
    assert JobView({"a": rec("a", 1)}).is_member(rec("a", 1)) is None  # no round yet
