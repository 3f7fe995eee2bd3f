"""The time left: the pure estimate, the window that feeds it, and the progress line showing it."""

from __future__ import annotations

import io

import pytest

from elastic.eta import Pace, as_text, eta_s
from launcher.progress import ProgressDisplay


def test_the_time_left_is_the_samples_left_at_the_recent_pace() -> None:
    history = [(0.0, 0), (10.0, 100), (20.0, 200)]
    assert eta_s(history, 1000) == pytest.approx(80.0)  # 800 left at 10 samples/s
    assert eta_s(history, 200) == 0.0 and eta_s(history, 150) == 0.0
    assert eta_s(history, 0) is None  # no total known
    assert eta_s([], 1000) is None and eta_s([(5.0, 50)], 1000) is None  # no pace yet
    assert eta_s([(0.0, 50), (10.0, 50)], 1000) is None  # a stall from the start: no pace


def test_the_pace_is_the_last_window_and_never_across_a_rollback() -> None:
    # 1 sample/s for 100 s, then 10 samples/s: a 60 s window sees only the new pace (and the
    # step at its start).
    history = [(float(t), t) for t in range(0, 101, 10)]
    history += [(100.0 + t, 100 + 10 * t) for t in range(10, 61, 10)]
    assert eta_s(history, 1700) == pytest.approx(100.0)
    assert eta_s(history, 1700, window_s=1000) == pytest.approx(1000 / (700 / 160))
    # A rollback from 300 back to 200 samples: the pace restarts from it.
    rolled = [(0.0, 0), (10.0, 200), (20.0, 300), (30.0, 200), (40.0, 250)]
    assert eta_s(rolled, 1250) == pytest.approx(200.0)  # 5 samples/s, 1000 left
    # A stall inside the window slows the estimate down: it is part of the recent pace.
    stalled = [(0.0, 0), (10.0, 100), (40.0, 100), (50.0, 200)]
    assert eta_s(stalled, 1200) == pytest.approx(250.0)  # 200 samples in 50 s, 1000 left


def test_the_window_keeps_one_step_at_or_before_its_start() -> None:
    pace = Pace(window_s=60.0)
    assert pace.eta_s() is None
    pace.total_samples = 1000
    for t in range(0, 200, 10):
        pace.add(float(t), 5 * t)
    assert pace.eta_s() == pytest.approx((1000 - 950) / 5)
    pace.add(1000.0, 960)  # after a long stall, the step before it still gives a pace
    assert pace.eta_s() == pytest.approx(40 / (10 / 810))


def test_as_text() -> None:
    assert [as_text(s) for s in (None, 0.4, 45, 750, 7500)] == ["-", "0s", "45s", "12m30s", "2h05m"]


def test_the_progress_line_of_a_step_shows_the_time_left() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, min_interval_s=0.0)
    started = {"ts": 0.0, "event": "training_started", "total_samples": 1000, "samples_seen": 0}
    display.handle([{**started, "resumed_from": None, "in_place": False, "world_size": 2}])
    step = {"event": "step", "step": 10, "epoch": 0, "loss": 1.0, "lr": 0.1, "world_size": 2}
    display.handle([{**step, "ts": 20.0, "samples": 200, "samples_per_s": 10.0}])
    assert out.getvalue().splitlines()[-1].endswith("| ETA 1m20s")  # 800 left at 10/s
