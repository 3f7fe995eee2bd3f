"""The invariant checks on literal event logs: each one catches what it is there to catch."""

from __future__ import annotations

from typing import Any

from chaos.invariants import history_violations, lr_violations
from elastic.config import Config
from elastic.lr_policy import LRPolicy


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


def _steps_with_a_resize(per_epoch: int, skip: int) -> tuple[list[dict[str, Any]], Config]:
    """Rank 0's step events of a world 2 -> 3 resize after step 4 (no warm-up, a one-step ramp),
    LRs from the policy itself; step ``skip`` left out, as when rank 0 was interrupted after its
    all-reduce and the next round took that step's state from another rank."""
    cfg = Config()
    cfg.optim.warmup_epochs = 0.0
    batch = cfg.data.batch_size
    policy = LRPolicy.from_config(cfg.optim, batch, per_epoch, total_samples=3 * per_epoch)
    events: list[dict[str, Any]] = []
    samples, lr, ramp = 0, 0.0, None
    for step in range(1, 9):
        world = 2 if step <= 4 else 3
        if step == 5:
            ramp = policy.after_resize(samples, lr, world * batch)
        lr = policy.lr(samples, world * batch, ramp)
        samples += world * batch
        if step != skip:
            events.append(
                {
                    "event": "step",
                    "step": step,
                    "samples": samples,
                    "step_samples": world * batch,
                    "world_size": world,
                    "lr": lr,
                    "global_batch": world * batch,
                }
            )
    return events, cfg


def test_a_step_rank_0_did_not_log_before_a_resize_is_replayed_in_its_own_world() -> None:
    per_epoch = 10 * Config().data.batch_size
    events, cfg = _steps_with_a_resize(per_epoch, skip=4)
    resized, after = events[3], events[4]  # steps 5 and 6
    assert resized["lr"] < after["lr"]  # the LR ramps in after the resize
    assert lr_violations(events, cfg, per_epoch) == []
    ramped = resized["lr"]
    resized["lr"] = after["lr"]  # the first step of world 3 at the full LR: no ramp
    assert lr_violations(events, cfg, per_epoch) == [
        f"step 5 (world 3): lr {after['lr']} != {ramped}"
    ]


def test_a_flipped_bit_is_excused_until_its_repair_and_no_longer() -> None:
    """States that differ because chaos flipped a bit are not two histories until the replica
    check repairs it (or a rollback ends it); after that, a difference is one again."""

    def at(ts: float, step: int, rank: int, before: str) -> dict[str, Any]:
        return {**samples(ts, step, 1, rank, before, world=2), "node": f"n{rank}", "pid": rank}

    flip = {"event": "bit_flipped", "ts": 1.5, "node": "n1", "pid": 1, "step": 1}
    repair = {"event": "replica_repaired", "ts": 2.5, "node": "n1", "pid": 1, "step": 2}
    first = [at(1.0, 1, 0, "a"), at(1.0, 1, 1, "a"), flip, at(2.0, 2, 0, "b"), at(2.0, 2, 1, "x")]
    assert history_violations([*first, repair, at(3.0, 3, 0, "c"), at(3.0, 3, 1, "c")]) == []
    late = [*first, repair, at(3.0, 3, 0, "c"), at(3.0, 3, 1, "y")]
    assert history_violations(late) == ["step 3: the ranks of round 1 trained it from 2 states"]
    assert history_violations(first) == []  # never repaired: the final digests tell
