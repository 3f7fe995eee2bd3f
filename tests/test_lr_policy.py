"""The LR policy's arithmetic: linear scaling, warm-up, milestones, slow start and poly decay, keyed
on samples."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from elastic.config import ConfigError, OptimConfig, Policy, Schedule, WarmupStart
from elastic.lr_policy import LRPolicy, LRSchedule, Ramp

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


# --- LRPolicy: what a change of world size does to the LR ---------------------------------------

RESIZE = OptimConfig(
    lr=0.1, reference_batch=256, warmup_epochs=5, milestones_epochs=[30, 60, 80]
)  # resize_warmup_epochs is set per test
AFTER_WARMUP = 10_000  # samples seen: past the 5000-sample warm-up, before the first milestone


def policy(resize_warmup_epochs: float = 0.5, name: str = "rescale_lr") -> LRPolicy:
    cfg = replace(RESIZE, policy=Policy(name), resize_warmup_epochs=resize_warmup_epochs)
    return LRPolicy.from_config(cfg, batch_size=32, samples_per_epoch=1000)


def test_rescale_lr_shrink_lowers_the_lr_at_once() -> None:
    """3 -> 2 workers of 32: the LR drops to 2/3 on the spot, with no ramp."""
    p = policy()
    old = p.lr(AFTER_WARMUP, p.global_batch(3, 0), None)
    assert old == pytest.approx(0.1 * 96 / 256)
    new_batch = p.global_batch(2, 96)
    assert new_batch == 64
    assert p.after_resize(AFTER_WARMUP, old, new_batch) is None
    assert p.lr(AFTER_WARMUP, new_batch, None) == pytest.approx(0.025)
    assert p.lr(AFTER_WARMUP, new_batch, None) / old == pytest.approx(2 / 3)


def test_rescale_lr_growth_ramps_linearly_over_resize_warmup_samples() -> None:
    """2 -> 3 workers: the LR climbs from the old LR to the schedule over 500 samples."""
    p = policy(resize_warmup_epochs=0.5)
    assert p.resize_warmup_samples == 500
    old = p.lr(AFTER_WARMUP, p.global_batch(2, 0), None)
    assert old == pytest.approx(0.025)
    new_batch = p.global_batch(3, 64)
    ramp = p.after_resize(AFTER_WARMUP, old, new_batch)
    assert ramp == Ramp(AFTER_WARMUP, old)
    target = 0.1 * 96 / 256
    for done in (0, 100, 250, 400, 499):
        expected = old + (target - old) * done / 500
        assert p.lr(AFTER_WARMUP + done, new_batch, ramp) == pytest.approx(expected)
    assert p.lr(AFTER_WARMUP + 499, new_batch, ramp) < target
    assert p.lr(AFTER_WARMUP + 500, new_batch, ramp) == pytest.approx(target)
    assert p.lr(AFTER_WARMUP + 3000, new_batch, ramp) == pytest.approx(target)


def test_rescale_lr_without_resize_warmup_applies_growth_at_once() -> None:
    p = policy(resize_warmup_epochs=0)
    assert p.resize_warmup_samples == 0
    assert p.after_resize(AFTER_WARMUP, 0.025, 96) is None
    assert p.lr(AFTER_WARMUP, 96, None) == pytest.approx(0.0375)


def test_keep_global_batch_keeps_the_first_rounds_batch_and_lr() -> None:
    p = policy(name="keep_global_batch")
    assert p.global_batch(3, 0) == 96  # first round: world * batch_size
    assert p.global_batch(2, 0) == 64
    for world in (1, 2, 5):
        assert p.global_batch(world, 96) == 96
    old = p.lr(AFTER_WARMUP, 96, None)
    assert old == pytest.approx(0.0375)
    assert p.after_resize(AFTER_WARMUP, old, p.global_batch(2, 96)) is None
    assert p.lr(AFTER_WARMUP, p.global_batch(2, 96), None) == pytest.approx(old)
    assert policy().global_batch(2, 96) == 64  # rescale_lr ignores the first round's batch


# --- The seeds' shapes: Akiba's slow start, MLPerf's poly decay ---------------------------------


def test_slow_start_scales_the_lr_until_it_ends() -> None:
    """Akiba et al.: 0.5x for 40 epochs, then /10 at 40, 70 and 85; no LR warm-up."""
    akiba = LRSchedule.from_config(
        OptimConfig(
            lr=0.1,
            warmup_epochs=0,
            slow_start_epochs=40,
            slow_start_factor=0.5,
            milestones_epochs=[40, 70, 85],
        ),
        samples_per_epoch=1000,
    )
    peak = 0.1 * 32768 / 256  # 12.8
    assert akiba.lr(0, 32768) == pytest.approx(0.5 * peak)  # 6.4 from the first step
    assert akiba.lr(39_999, 32768) == pytest.approx(0.5 * peak)
    assert akiba.lr(40_000, 32768) == pytest.approx(0.1 * peak)  # slow start over, first /10
    assert akiba.lr(70_000, 32768) == pytest.approx(0.01 * peak)
    assert akiba.lr(85_000, 32768) == pytest.approx(0.001 * peak)


def test_slow_start_applies_to_the_warmed_up_lr() -> None:
    cfg = replace(RESIZE, slow_start_epochs=10, slow_start_factor=0.5)
    s = LRSchedule.from_config(cfg, samples_per_epoch=1000)
    # halfway through the 5-epoch warm-up at 8192: (0.1 + (3.2 - 0.1) / 2) * 0.5
    assert s.lr(2500, 8192) == pytest.approx((0.1 + 3.1 / 2) * 0.5)
    assert s.lr(9_999, 8192) == pytest.approx(3.2 * 0.5)
    assert s.lr(10_000, 8192) == pytest.approx(3.2)


# lr 0.1 per 256 -> peak 0.4 at 1024; warm-up 10 epochs of 1000 samples; 50 epochs in all, so the
# poly decay spans 50_000 - 10_000 = 40_000 samples; end = 0.25 * peak.
POLY = OptimConfig(
    lr=0.1, warmup_epochs=10, schedule=Schedule.poly, poly_power=2, end_lr_factor=0.25
)


def poly_policy(**kw) -> LRPolicy:
    cfg = replace(POLY, **kw)
    return LRPolicy.from_config(cfg, batch_size=32, samples_per_epoch=1000, total_samples=50_000)


def test_poly_decay_by_hand() -> None:
    s = poly_policy().schedule
    assert s.lr(5_000, 1024) == pytest.approx(0.1 + (0.4 - 0.1) * 0.5)  # warm-up, halfway
    assert s.lr(10_000, 1024) == pytest.approx(0.4)  # the peak
    # end + (peak - end) * (1 - done / 40_000) ** 2 with end = 0.25 * 0.4 = 0.1:
    assert s.lr(20_000, 1024) == pytest.approx(0.1 + 0.3 * 0.75**2)  # 0.26875
    assert s.lr(30_000, 1024) == pytest.approx(0.1 + 0.3 * 0.5**2)  # 0.175
    assert s.lr(50_000, 1024) == pytest.approx(0.1)  # the end
    assert s.lr(60_000, 1024) == pytest.approx(0.1)  # never below it


def test_poly_ends_at_zero_by_default() -> None:
    s = poly_policy(end_lr_factor=0.0).schedule
    assert s.lr(30_000, 1024) == pytest.approx(0.4 * 0.5**2)
    assert s.lr(50_000, 1024) == 0.0


def test_rescale_lr_scales_the_poly_peak_with_the_global_batch() -> None:
    """1024 -> 512 samples per step halves the whole poly curve, the end LR included; growing
    back is ramped in from the LR in use towards the decayed schedule."""
    p = poly_policy(resize_warmup_epochs=0.5)
    big, small = p.global_batch(32, 0), p.global_batch(16, 1024)
    assert (big, small) == (1024, 512)
    assert p.lr(30_000, small, None) == pytest.approx(0.05 + 0.15 * 0.5**2)  # peak 0.2, end 0.05
    assert p.lr(30_000, small, None) / p.lr(30_000, big, None) == pytest.approx(0.5)
    assert p.lr(50_000, small, None) == pytest.approx(0.05)
    old = p.lr(30_000, small, None)
    ramp = p.after_resize(30_000, old, big)
    assert ramp == Ramp(30_000, old)
    # 250 of the 500 ramp samples later: halfway from the old LR to the schedule at 30_250
    scheduled = 0.1 + 0.3 * (1 - 20_250 / 40_000) ** 2
    assert p.lr(30_250, big, ramp) == pytest.approx(old + (scheduled - old) * 0.5)
    assert p.lr(30_500, big, ramp) == pytest.approx(0.1 + 0.3 * (1 - 20_500 / 40_000) ** 2)


def test_poly_needs_the_total_and_room_after_warmup() -> None:
    with pytest.raises(ValueError, match="optim.schedule=poly.*Fix: pass total_samples"):
        LRPolicy.from_config(POLY, batch_size=32, samples_per_epoch=1000)
    with pytest.raises(ConfigError, match="optim.warmup_epochs=10.*Fix: lower optim.warmup"):
        LRSchedule.from_config(POLY, samples_per_epoch=1000, total_samples=10_000)
    # the step schedule needs no total: the three-argument call still works
    assert LRPolicy.from_config(RESIZE, 32, 1000).schedule.total_samples == 0


def test_cosine_decay_by_hand() -> None:
    """Half a cosine from the peak at the end of warm-up to end_lr_factor of it at the end."""
    cfg = replace(POLY, schedule=Schedule.cosine)
    s = LRPolicy.from_config(cfg, batch_size=32, samples_per_epoch=1000, total_samples=50_000)
    sched = s.schedule
    assert sched.lr(10_000, 1024) == pytest.approx(0.4)  # the peak, after 10 epochs of warm-up
    # end + (peak - end) * (1 + cos(pi * done / 40_000)) / 2 with end = 0.1:
    assert sched.lr(20_000, 1024) == pytest.approx(0.1 + 0.3 * (1 + math.cos(math.pi / 4)) / 2)
    assert sched.lr(30_000, 1024) == pytest.approx(0.1 + 0.3 * 0.5)  # halfway
    assert sched.lr(50_000, 1024) == pytest.approx(0.1)
    assert sched.lr(60_000, 1024) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="optim.schedule=cosine.*Fix: pass total_samples"):
        LRPolicy.from_config(cfg, batch_size=32, samples_per_epoch=1000)
    with pytest.raises(ConfigError, match="the cosine schedule decays after warm-up"):
        LRSchedule.from_config(cfg, samples_per_epoch=1000, total_samples=10_000)


def test_warmup_from_zero_rises_linearly_to_the_peak() -> None:
    cfg = replace(POLY, schedule=Schedule.cosine, warmup_start=WarmupStart.zero)
    s = LRSchedule.from_config(cfg, samples_per_epoch=1000, total_samples=50_000)
    assert s.lr(0, 1024) == 0.0
    assert s.lr(2_500, 1024) == pytest.approx(0.1)  # a quarter of the way to 0.4
    assert s.lr(10_000, 1024) == pytest.approx(0.4)
