"""Non-finite steps: a step whose gradients hold an inf or a NaN is skipped on every rank, and a
run of them rolls the job back to its newest checkpoint.

The decision needs no collective of its own: DDP's gradient all-reduce carries any rank's inf or
NaN to every rank (a rank's non-finite loss reaches its gradients through backward), so every
rank reads the same verdict from the averaged gradients and skips the same steps. Only a skipped
step pays one small all-reduce more, which names the first rank whose loss was not finite. A
forward pass that met a NaN also spoils the batch-norm statistics, which a skipped optimizer step
does not undo: they are copied before every step (:class:`BufferBackup`, a few kilobytes) and put
back. A NaN that persists (spoiled weights or data) is not skipped away: after
``health.nonfinite_rollback`` skipped steps in a row the ranks load the newest checkpoint (saves
wait while a run of them lasts). fp16's
loss scaler keeps its own overflow handling (:class:`elastic.precision.MixedPrecision`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


class Verdict(enum.Enum):
    TRAIN = "train"
    SKIP = "skip"
    ROLL_BACK = "roll_back"  # skip this one, and load the newest checkpoint


@dataclass
class NonFiniteSteps:
    """The non-finite steps of one worker: a pure count over what every rank sees alike."""

    rollback_after: int  # health.nonfinite_rollback
    streak: int = 0  # skipped steps in a row
    skipped: int = 0  # all skipped steps
    producers: list[int] = field(default_factory=list)  # the streak's first non-finite ranks

    def update(self, finite: bool, producer: int = -1) -> Verdict:
        """After a step's gradients were averaged: ``finite`` says whether they all are;
        ``producer`` is the first rank whose loss was not (-1: none, the gradients alone)."""
        if finite:
            self.streak, self.producers = 0, []
            return Verdict.TRAIN
        self.streak += 1
        self.skipped += 1
        self.producers.append(producer)
        if self.streak >= self.rollback_after:
            return Verdict.ROLL_BACK
        return Verdict.SKIP

    def rolled_back(self) -> None:
        self.streak, self.producers = 0, []

    def blamed(self) -> int:
        """The rank that produced every step of the streak so far, or -1 if no one did."""
        ranks = set(self.producers)
        return ranks.pop() if len(ranks) == 1 and -1 not in ranks else -1


def gradients_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient is finite: one norm over all of them (a NaN or inf anywhere makes
    it non-finite); a host sync, which the step's loss already costs."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)).item())


def first_producer(flags: Sequence[float]) -> int:
    """The first rank whose flag is set (its loss was not finite), -1 if none."""
    return next((rank for rank, bad in enumerate(flags) if bad), -1)


class BufferBackup:
    """A copy of a model's buffers (batch-norm statistics), taken before each step and put back
    when the step is skipped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._buffers = [b for b in model.buffers() if b is not None]
        self._copies = [b.detach().clone() for b in self._buffers]

    def save(self) -> None:
        if self._buffers:
            torch._foreach_copy_(self._copies, self._buffers)

    def restore(self) -> None:
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, self._copies)
