"""The faults ``python -m chaos`` asks a worker to make in itself, only with ``chaos.allow``: a
NaN loss at chosen steps (``chaos.nan_steps``) and a bit flipped in a parameter (SIGUSR1)."""

from __future__ import annotations

from elastic import event_types as ev
from elastic.worker import Worker

FLIPPED_BIT = 20  # a mantissa bit: seen by a checksum, harmless to training


def poisoned(w: Worker, rank: int, step: int) -> bool:
    """Whether chaos.nan_steps makes this rank's loss NaN at ``step``: each listed step once,
    on rank chaos.nan_rank, so that the steps a rollback trains again are clean."""
    c = w.cfg.chaos
    if rank != c.nan_rank or step not in c.nan_steps or step in w.poisoned:
        return False
    w.poisoned.add(step)
    return True


def flip_one_bit(w: Worker, step: int) -> None:
    """chaos's corrupt_replica (SIGUSR1, only with chaos.allow), between two steps, so that no
    collective sees half of it (:meth:`TrainState.flip_bit`)."""
    w.flip_bit.clear()
    name = w.state.flip_bit(FLIPPED_BIT)
    w.events.emit(ev.BIT_FLIPPED, step=step, param=name, index=0, bit=FLIPPED_BIT)
