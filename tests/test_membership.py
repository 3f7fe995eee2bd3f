"""The membership's wire format and view (launcher/rendezvous/membership.py), pure: a round's
ranks, its compact value and the split form of a round too large for one etcd value, and which
registration of a node a round lists."""

from __future__ import annotations

import pytest

from launcher.rendezvous.membership import JobView, Round, RoundIncomplete

from .test_round_plan import node, rec


def test_round_ranks_follow_member_slots() -> None:
    r = Round.build(1, [node("a", slots=2), node("b", slots=3)])
    assert [(m.node_id, m.first_rank) for m in r.members] == [("a", 0), ("b", 2)]
    assert r.world_size == 5
    assert Round.from_json(r.to_json()) == r


def test_a_round_too_large_for_one_value_is_split_under_the_limit() -> None:
    r = Round.build(3, [node(f"node-{i:04d}", i + 1) for i in range(200)])
    head, parts = r.to_values("000000000003-000000000007", limit=1000)
    assert len(parts) > 1 and all(len(p) <= 1000 for p in parts) and len(head) < 1000
    asked: list[tuple[str, int]] = []

    def read_parts(parts_id: str, count: int) -> list[str]:
        asked.append((parts_id, count))
        return parts

    assert Round.from_json(head, read_parts) == r
    assert asked == [("000000000003-000000000007", len(parts))]
    with pytest.raises(RoundIncomplete):  # a part deleted by a newer round meanwhile
        Round.from_json(head, lambda parts_id, count: parts[:-1])
    assert r.to_values("unused") == (r.to_json(), [])  # under the default limit: one value
    assert Round.from_json(r.to_json(), read_parts) == r
    assert len(asked) == 1  # a whole round names no parts


def test_pure_is_member_matches_only_the_same_registration_and_incarnation() -> None:
    current = Round.build(1, [rec("a", 1), rec("b", 2)])
    view = JobView({"a": rec("a", 1), "b": rec("b", 2)}, current)
    b = view.is_member(rec("b", 2))
    assert b is not None and (b.node_id, b.joined_rev, b.first_rank) == ("b", 2, 1)
    assert view.is_member(rec("b", 5)) is None  # a new registration of b
    assert view.is_member(rec("b", 2, incarnation=1)) is None
    assert view.is_member(rec("z", 3)) is None
    assert JobView({"a": rec("a", 1)}).is_member(rec("a", 1)) is None  # no round yet
