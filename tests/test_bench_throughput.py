"""The throughput bench's arithmetic: the t interval of paired overheads, the pairs a target
width needs, the CPU interpolated at the window's edges, and the window's checks."""

from __future__ import annotations

import math
import re

import pytest

from .conftest import load_bench

bench = load_bench("throughput")


def test_t_quantile_table_and_expansion() -> None:
    assert bench.t975(1) == 12.706
    assert bench.t975(30) == 2.042
    # Past the table, against published values of Student's t.
    for df, t in ((31, 2.0395), (40, 2.0211), (60, 2.0003), (120, 1.9799)):
        assert bench.t975(df) == pytest.approx(t, abs=2e-4)
    with pytest.raises(ValueError):
        bench.t975(0)


def test_paired_interval_and_pairs_needed() -> None:
    interval = bench.paired([1.0, 2.0, 3.0], target=2.0)
    assert interval.mean == 2.0
    assert interval.half == pytest.approx(4.303 / math.sqrt(3))  # sd 1
    # n = 3: 4.303 / sqrt(3) = 2.48 > 2; n = 4: 3.182 / 2 = 1.59.
    assert interval.needed == 4
    assert str(interval) == "+2.0 % [-0.5, +4.5]"
    assert bench.paired([5.0, 5.0], target=2.0).needed == 2


def test_one_pair_has_no_interval() -> None:
    interval = bench.paired([1.5], target=2.0)
    assert (interval.half, interval.needed) == (None, None)
    assert interval.verdict(2.0).startswith("unresolved")
    assert str(interval) == "+1.5 %"


@pytest.mark.parametrize(
    ("mean", "half", "verdict"),
    [(1.0, 1.0, "met"), (3.5, 1.0, "NOT met"), (2.0, 0.5, "unresolved"), (-5.0, 9.0, "unres")],
)
def test_the_goal_is_judged_by_the_whole_interval(mean: float, half: float, verdict: str) -> None:
    assert bench.Interval(mean, half, 2).verdict(2.0).startswith(verdict)


def test_max_minutes_stops_once_the_goal_is_resolved_or_the_budget_would_be_passed() -> None:
    met, straddles = bench.Interval(0.5, 1.0, 4), bench.Interval(1.5, 2.0, 9)
    assert bench.settled(met, 3, 60.0, 1200.0).startswith("the goal is met")
    assert bench.settled(bench.Interval(4.0, 1.0, 4), 3, 60.0, 1200.0).startswith(
        "the goal is NOT met"
    )
    assert bench.settled(met, 2, 60.0, 1200.0) == ""  # resolved, on too few pairs
    assert bench.settled(straddles, 5, 500.0, 1200.0) == ""  # a 6th pair ends at 600 s
    assert "pass 20 minutes" in bench.settled(straddles, 5, 1050.0, 1200.0)  # at 1,260 s


def test_cpu_is_interpolated_between_samples() -> None:
    samples = [(10.0, {"workers": 0.0}), (11.0, {"workers": 2.0, "etcd": 0.5})]
    assert bench.cpu_at(samples, 10.25) == {"workers": 0.5, "etcd": 0.125}
    with pytest.raises(RuntimeError, match="no CPU sample on both sides"):
        bench.cpu_at(samples, 11.5)
    with pytest.raises(RuntimeError, match="never sampled"):
        bench.cpu_at([], 10.0)


def test_window_times_and_charges_the_measured_steps_only() -> None:
    ends = [1.0, 2.0, 3.0, 4.5, 5.0]
    # Two cores busy throughout: 2 CPU seconds per second, read every half second.
    cpu = [(t / 2, {"workers": t}) for t in range(13)]
    w = bench.window(ends, [32] * 5, warmup=1, steps=3, cpu=cpu)
    # Steps 2-4: 96 samples from t=1 to t=4.5, with 7 CPU seconds.
    assert w.samples_per_s == pytest.approx(96 / 3.5)
    assert w.step_s == pytest.approx(3.5 / 3)
    assert w.cpu_per_sample == pytest.approx(7 / 96)
    assert w.switches == {}  # none read
    # 10 involuntary context switches a second: 35 over the window's 3 steps.
    switches = [(t / 2, {"workers": 5.0 * t}) for t in range(13)]
    counted = bench.window(ends, [32] * 5, warmup=1, steps=3, cpu=cpu, switches=switches)
    assert counted.switches == {"workers": pytest.approx(35 / 3)}
    assert counted.cpu_per_sample == w.cpu_per_sample  # switches are no CPU
    with pytest.raises(RuntimeError, match="only 5 steps"):
        bench.window(ends, [32] * 5, warmup=3, steps=3, cpu=cpu)


def test_the_default_window_holds_whole_intervals() -> None:
    assert bench.window_problem(40, 30, 20, 5) is None
    assert bench.window_problem(60, 30, 20, 3) is None
    assert bench.window_problem(40, 30, 20, 0) is None  # no aggressive row


@pytest.mark.parametrize(
    ("steps", "warmup", "aggressive", "message"),
    [
        (20, 30, 5, "--steps 20: .* e.g. --steps 40"),  # the default interval only once
        (45, 30, 5, "--steps 45: .* e.g. --steps 40"),  # not whole intervals
        (40, 30, 3, "--steps 40: .* e.g. --steps 60"),  # not a multiple of 3
        (40, 20, 5, "--warmup-steps 20: .* e.g. --warmup-steps 30"),  # the first save in it
        (40, 30, 20, "--aggressive-every 20: .* e.g. --aggressive-every 5"),
        (40, 30, -1, "--aggressive-every -1: "),
        (30, 30, 0, "--steps 30: .* e.g. --steps 40"),  # no aggressive row: whole intervals
    ],
)
def test_a_window_that_misjudges_saves_is_refused(
    steps: int, warmup: int, aggressive: int, message: str
) -> None:
    problem = bench.window_problem(steps, warmup, 20, aggressive)
    assert problem is not None and re.match(message, problem), problem
