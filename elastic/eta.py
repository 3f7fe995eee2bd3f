"""The time a run has left: the samples still to train over the recent pace.

For the launcher's progress display and for the ``progress`` key that ``python -m
launcher.commands.status`` reads, both fed with rank 0's ``step`` events (their time and samples
seen).
The pace is measured over the last :data:`WINDOW_S` seconds: not since the start, which rounds of
another world size and stalls long past would skew, nor over one step, whose rate jumps with every
checkpoint and evaluation; a stall or a smaller world shows in the estimate within a minute.
:func:`eta_s` is the pure computation; :class:`Pace` keeps the window for a caller that follows
the events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

WINDOW_S = 60.0


def eta_s(
    history: Sequence[tuple[float, int]], total_samples: int, window_s: float = WINDOW_S
) -> float | None:
    """Seconds until ``total_samples`` are trained, from ``history``.

    ``history`` is ``(time, samples seen)`` of the steps, oldest first. The pace runs from the
    newest step back to the last step at or before ``window_s`` earlier, and never across a
    rollback (samples seen that went down). 0 once every sample is trained; None while it cannot
    be told (no total, no pace yet)."""
    if not history or total_samples <= 0:
        return None
    end_t, end_samples = history[-1]
    if end_samples >= total_samples:
        return 0.0
    start = len(history) - 1
    while (
        start > 0
        and history[start][0] > end_t - window_s
        and history[start - 1][1] <= history[start][1]
    ):
        start -= 1
    start_t, start_samples = history[start]
    if end_t <= start_t or end_samples <= start_samples:
        return None
    return (total_samples - end_samples) * (end_t - start_t) / (end_samples - start_samples)


def as_text(seconds: float | None) -> str:
    """``2h05m``, ``12m30s``, ``45s``; ``-`` when not known."""
    if seconds is None:
        return "-"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Pace:
    """The steps of the last window (and the one before it) for :func:`eta_s`."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.total_samples = 0  # from a training_started event; 0: not known yet
        self._steps: deque[tuple[float, int]] = deque()

    def add(self, ts: float, samples: int) -> None:
        self._steps.append((ts, samples))
        while len(self._steps) > 1 and self._steps[1][0] <= ts - self.window_s:
            self._steps.popleft()

    def eta_s(self) -> float | None:
        return eta_s(list(self._steps), self.total_samples, self.window_s)
