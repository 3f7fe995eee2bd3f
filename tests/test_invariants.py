"""The invariant checks on literal event logs: each one catches what it is there to catch."""

from __future__ import annotations

from typing import Any

from chaos.invariants import history_violations


def samples(
    ts: float, step: int, rnd: int, rank: int, before: str, world: int = 1
) -> dict[str, Any]:
    return {
        "ts": ts,
        "event": "samples",
        "step": step,
        "round": rnd,
        "rank": rank,
        "world_size": world,
        "before": before,
    }


def test_one_history_keeps_one_state_per_step_across_a_retried_step() -> None:
    events = [
        samples(1.0, 1, 1, 0, "a", world=2),
        samples(1.0, 1, 1, 1, "a", world=2),
        samples(2.0, 2, 1, 0, "b", world=2),  # step 2 dropped in flight when rank 1 died
        samples(3.0, 2, 2, 0, "b"),  # and tried again by the next round from the same state
    ]
    assert history_violations(events) == []


def test_a_straggler_of_a_left_round_that_took_one_more_step_alone_is_no_second_history() -> None:
    """Seen in a partition test: the others left round 3 in step 28's all-reduce, which had
    reached rank 1 already; it applied step 28 and started step 29 alone, while round 4 trained
    step 28 again from the same state, at world size 2."""
    events = [
        *(samples(1.0, 28, 3, rank, "s", world=3) for rank in range(3)),
        samples(2.0, 29, 3, 1, "alone", world=3),
        *(samples(2.1, 28, 4, rank, "s", world=2) for rank in range(2)),
        *(samples(2.2, 29, 4, rank, "redone", world=2) for rank in range(2)),
    ]
    assert history_violations(events) == []


def test_two_worlds_training_the_same_step_from_different_states_are_caught() -> None:
    events = [
        samples(1.0, 5, 3, 0, "x"),
        samples(1.1, 5, 4, 0, "y"),  # a second world at the same step, from another state
    ]
    assert history_violations(events) == [
        "step 5: rounds 3 and 4 trained it from different states with no checkpoint loaded "
        "between them (two histories)"
    ]
    rolled_back = [events[0], {"ts": 1.05, "event": "checkpoint_loaded"}, events[1]]
    assert history_violations(rolled_back) == []


def test_ranks_of_one_round_that_disagree_are_caught() -> None:
    events = [samples(1.0, 7, 2, 0, "a"), samples(1.0, 7, 2, 1, "b")]
    assert history_violations(events) == ["step 7: the ranks of round 2 trained it from 2 states"]
