"""The straggler verdict, on literal figures: who is slower than the median by the factor, for how
many comparisons running, and when it is said; and what a step's compute time counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastic import step_timing
from elastic.step_timing import StepTiming
from elastic.stragglers import StragglerWatch, slowdowns


def test_slowdowns_are_against_the_median() -> None:
    assert slowdowns([0.2, 0.2, 0.4, 0.2]) == [1.0, 1.0, 2.0, 1.0]
    assert slowdowns([0.0, 0.0]) == [1.0, 1.0]


def test_a_rank_slow_for_the_windows_running_is_reported_once() -> None:
    watch = StragglerWatch(factor=1.5, windows=3)
    slow = [0.2, 0.2, 0.5]
    assert watch.update(slow) == {}
    assert watch.update(slow) == {}
    assert watch.update(slow) == {2: pytest.approx(2.5)}
    assert watch.update(slow) == {}  # said already
    assert watch.update([0.2, 0.2, 0.2]) == {}  # it kept up: the streak starts again
    assert [watch.update(slow) for _ in range(3)][-1] == {2: pytest.approx(2.5)}


def test_a_slow_comparison_between_fast_ones_is_no_straggler() -> None:
    watch = StragglerWatch(factor=1.5, windows=2)
    assert watch.update([0.2, 0.2, 0.4]) == {}
    assert watch.update([0.2, 0.2, 0.2]) == {}
    assert watch.update([0.2, 0.2, 0.4]) == {}
    assert watch.update([0.2, 0.29, 0.2]) == {}  # below the factor


def test_two_ranks_need_a_wide_gap_and_one_rank_has_none() -> None:
    watch = StragglerWatch(factor=1.5, windows=1)
    assert watch.update([0.2, 0.5]) == {}  # 0.5 / 0.35 = 1.43
    assert watch.update([0.2, 0.7]) == {1: pytest.approx(0.7 / 0.45)}
    assert StragglerWatch(factor=1.5, windows=1).update([9.0]) == {}


def test_a_steps_compute_ends_with_its_last_bucket_handed_to_the_all_reduce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By the host's clock on the CPU: the wait for peers after the last bucket is not this
    rank's compute; a step that handed no bucket over computed until its end."""
    clock = iter([10.0, 10.2, 10.3, 20.0, 20.4])
    monkeypatch.setattr(step_timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    timing = StepTiming(torch.device("cpu"), lambda: 0.0)
    timing.begin()  # 10.0
    timing.bucket_handed()  # 10.2
    timing.bucket_handed()  # 10.3; then the all-reduce waits for a slow peer
    timing.end()
    assert timing.last_compute_s == pytest.approx(0.3)
    timing.begin()  # 20.0
    timing.end()  # 20.4
    assert timing.last_compute_s == pytest.approx(0.4)


def test_a_sharded_steps_compute_is_its_time_less_its_waits_on_the_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sharded step hands no buckets and waits for its peers all through (FSDP2 gathers each
    unit's weights): what the mesh's collectives blocked it is not its compute."""
    clock = iter([10.0, 11.0])
    blocked = iter([5.0, 5.7])  # seconds blocked on the mesh so far: at begin, at end
    monkeypatch.setattr(step_timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    timing = StepTiming(torch.device("cpu"), lambda: next(blocked))
    timing.begin()
    timing.end()
    assert timing.last_compute_s == pytest.approx(0.3)
