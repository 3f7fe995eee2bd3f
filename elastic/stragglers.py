"""Stragglers: ranks that compute much slower than the others, found while the job trains.

A GPU that throttles or a host whose memory degrades does not fail: it slows every step of every
rank, since the gradient all-reduce waits for the slowest. Every ``health.straggler_every``
steps the ranks of a round sum a vector holding each one's mean compute time per step since the
last comparison (forward and backward, up to the gradient all-reduce:
:attr:`elastic.step_timing.StepTiming.last_compute_s`, timed by CUDA events on a GPU), one
small all-reduce. Every rank then sees the same figures and reaches the same verdict
(:class:`StragglerWatch`, a pure function of them), so the straggling rank itself says so in a
``straggler`` event that names its node.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


def slowdowns(compute_s: Sequence[float]) -> list[float]:
    """Each rank's compute time over the median of all ranks' (1.0: as fast as the median)."""
    median = statistics.median(compute_s)
    return [t / median if median > 0 else 1.0 for t in compute_s]


@dataclass
class StragglerWatch:
    """The comparisons of one round.

    A rank is a straggler once it was slower than the median by ``factor`` in ``windows``
    comparisons running. It is reported once, when it becomes one, and again only after a
    comparison in which it kept up."""

    factor: float
    windows: int
    _streaks: dict[int, int] = field(default_factory=dict)

    def update(self, compute_s: Sequence[float]) -> dict[int, float]:
        """The ranks that became stragglers with this comparison, with their slowdown.

        With two ranks the median is their mean, so only a rank ``2 * factor - 1`` times slower
        than the other is one. A rank alone is never one."""
        if len(compute_s) < 2:
            return {}
        found = {}
        for rank, slowdown in enumerate(slowdowns(compute_s)):
            streak = self._streaks.get(rank, 0) + 1 if slowdown >= self.factor else 0
            self._streaks[rank] = streak
            if streak == self.windows:
                found[rank] = slowdown
        return found
