"""The LR policy's arithmetic: linear scaling, warm-up and milestones, keyed on samples."""

from __future__ import annotations

import pytest

from elastic.config import OptimConfig
from elastic.lr_policy import LRSchedule

GOYAL = LRSchedule.from_config(
    OptimConfig(lr=0.1, reference_batch=256, warmup_epochs=5, milestones_epochs=[30, 60, 80]),
    samples_per_epoch=1000,
)


def test_linear_scaling_rule() -> None:
    assert GOYAL.lr(10_000, global_batch=8192) == pytest.approx(0.1 * 32)
    assert GOYAL.lr(10_000, global_batch=256) == pytest.approx(0.1)
    # rescale_lr: losing a third of the workers loses a third of the LR
    assert GOYAL.lr(10_000, 2 * 32) / GOYAL.lr(10_000, 3 * 32) == pytest.approx(2 / 3)


def test_gradual_warmup_from_the_reference_lr() -> None:
    assert GOYAL.lr(0, 8192) == pytest.approx(0.1)
    assert GOYAL.lr(2500, 8192) == pytest.approx(0.1 + (3.2 - 0.1) / 2)
    assert GOYAL.lr(5000, 8192) == pytest.approx(3.2)


def test_warmup_never_starts_above_the_target_for_small_batches() -> None:
    assert GOYAL.lr(0, 64) == pytest.approx(0.025)


def test_milestones_divide_by_ten() -> None:
    assert GOYAL.lr(29_999, 256) == pytest.approx(0.1)
    assert GOYAL.lr(30_000, 256) == pytest.approx(0.01)
    assert GOYAL.lr(80_000, 256) == pytest.approx(0.0001)


def test_schedule_is_keyed_on_samples_not_steps() -> None:
    # Halfway through warm-up in samples is halfway at any world size (any global batch).
    for global_batch in (512, 1024, 4096):
        start, target = 0.1, GOYAL.target(global_batch)
        assert (GOYAL.lr(2500, global_batch) - start) / (target - start) == pytest.approx(0.5)
    assert GOYAL.warmup_samples == 5000 and GOYAL.milestones == (30_000, 60_000, 80_000)
