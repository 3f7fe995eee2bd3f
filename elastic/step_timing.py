"""A step's compute time, what the straggler comparison compares (:mod:`elastic.stragglers`).

Compute is the step from its start until backward handed its last gradient bucket to the
all-reduce (:class:`elastic.ddp_hook.DDPHook` says when), so that waiting for slow peers never
counts as this rank's own slowness. A sharded step (``parallel.shard=node``) hands no buckets and
waits for its peers all through (FSDP2 gathers each unit's weights): its compute is the whole
step less the time it was blocked in the mesh's collectives
(:meth:`elastic.abortable_group.RoundMesh.blocked_s`). On a GPU the same two moments are taken on
the device's own timeline, by CUDA events: the host only queues the kernels, so its clock would
time the queueing, not a throttled GPU's compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepTiming:
    """Times each step's compute; the result is :attr:`last_compute_s`.

    :meth:`begin` is called at the step's start, :meth:`bucket_handed` at each gradient bucket,
    and :meth:`end` once the step is done."""

    def __init__(self, device: torch.device, blocked: Callable[[], float]) -> None:
        self.device = device
        self._blocked = blocked  # seconds blocked on peers so far (RoundMesh.blocked_s)
        self._blocked_at = 0.0  # ... when the step began
        self.last_compute_s = 0.0  # the last step's compute time (see end)
        self._began = self._handed_at = 0.0  # perf_counter: the step's start, its last bucket
        # On a GPU, the same two moments on the device's timeline.
        self._marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._marked = False  # the last bucket's mark was recorded this step

    def begin(self) -> None:
        """Start timing a step, before its forward."""
        self._began = time.perf_counter()
        self._handed_at = 0.0
        self._blocked_at = self._blocked()
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
        was), less the time blocked on the mesh's collectives meanwhile. On a GPU it is read from
        its events (the step's loss was read on the host, so they have completed)."""
        waited = max(0.0, self._blocked() - self._blocked_at)  # 0 unless sharded
        self.last_compute_s = (self._handed_at or time.perf_counter()) - self._began - waited
        if self._marks is not None and self._marked:
            began, handed = self._marks
            handed.synchronize()
            self.last_compute_s = began.elapsed_time(handed) / 1000
