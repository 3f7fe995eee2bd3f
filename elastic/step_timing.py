"""A step's compute time, what the straggler comparison compares (:mod:`elastic.stragglers`).

Compute is the step from its start until backward handed its last gradient bucket to the
all-reduce (:class:`elastic.ddp_hook.DDPHook` says when), so that waiting for slow peers never
counts as this rank's own slowness. On a GPU the same two moments are taken on the device's own
timeline, by CUDA events: the host only queues the kernels, so its clock would time the queueing,
not a throttled GPU's compute.
"""

from __future__ import annotations

import time

import torch


class StepTiming:
    """Times each step's compute; the result is :attr:`last_compute_s`.

    :meth:`begin` is called at the step's start, :meth:`bucket_handed` at each gradient bucket,
    and :meth:`end` once the step is done."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last_compute_s = 0.0  # the last step's compute time (see end)
        self._began = self._handed_at = 0.0  # perf_counter: the step's start, its last bucket
        # On a GPU, the same two moments on the device's timeline.
        self._marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._marked = False  # the last bucket's mark was recorded this step

    def begin(self) -> None:
        """Start timing a step, before its forward."""
        self._began = time.perf_counter()
        self._handed_at = 0.0
        if self.device.type == "cuda":
            began, handed = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            began.record()
            self._marks, self._marked = (began, handed), False

    def bucket_handed(self) -> None:
        """A gradient bucket was handed to the all-reduce: the step's compute reaches here."""
        self._handed_at = time.perf_counter()
        if self._marks is not None:
            self._marks[1].record()  # on the stream backward queued this bucket on
            self._marked = True

    def end(self) -> None:
        """End timing a step, after the optimizer step.

        The compute time runs until the last bucket was handed over (or until now, when none
        was). On a GPU it is read from its events (the step's loss was read on the host, so they
        have completed)."""
        self.last_compute_s = (self._handed_at or time.perf_counter()) - self._began
        if self._marks is not None and self._marked:
            began, handed = self._marks
            handed.synchronize()
            self.last_compute_s = began.elapsed_time(handed) / 1000
