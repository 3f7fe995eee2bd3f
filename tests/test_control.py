"""Assignments: the shrink of a previous round, and the round trip through a control message."""

from __future__ import annotations

import json
from dataclasses import asdict

from elastic.control import Assignment

PREVIOUS = Assignment(3, rank=0, world_size=4, store_host="h", store_port=29500, formed_at=1.0)


def test_shrink_of_the_previous_round_gives_its_excluded_ranks() -> None:
    shrunk = Assignment(4, 0, 2, "h", 29500, 2.0, shrinks_round=3, excluded_ranks=(1, 3))
    assert shrunk.shrink_of(PREVIOUS) == [1, 3]


def test_shrink_of_another_round_or_without_excluded_ranks_is_none() -> None:
    other = Assignment(4, 0, 2, "h", 29500, 2.0, shrinks_round=2, excluded_ranks=(1, 3))
    assert other.shrink_of(PREVIOUS) is None
    nothing_removed = Assignment(4, 0, 4, "h", 29500, 2.0, shrinks_round=3)
    assert nothing_removed.shrink_of(PREVIOUS) is None
    fresh = Assignment(4, 0, 5, "h", 29500, 2.0)
    assert fresh.shrink_of(PREVIOUS) is None


def test_from_message_round_trips_an_assignment_through_json() -> None:
    a = Assignment(4, 1, 2, "h", 29500, 2.5, shrinks_round=3, excluded_ranks=(1, 3))
    msg = {"type": "assign", **asdict(a)}
    assert Assignment.from_message(msg) == a
    wire = json.loads(json.dumps(msg))  # the tuple arrives as a list
    assert wire["excluded_ranks"] == [1, 3]
    assert Assignment.from_message(wire) == a
    assert Assignment.from_message(wire).shrink_of(PREVIOUS) == [1, 3]


def test_from_message_without_shrink_fields_uses_the_defaults() -> None:
    msg = {"type": "assign", "round": 5, "rank": 0, "world_size": 1}
    msg |= {"store_host": "h", "store_port": 1, "formed_at": 0.0}
    got = Assignment.from_message(msg)
    assert (got.shrinks_round, got.excluded_ranks) == (0, ())
