"""The faults ``python -m chaos`` asks a worker to make in itself.

A NaN loss at chosen steps (``chaos.nan_steps``); a bit flipped in a parameter (SIGUSR1,
``corrupt_replica``); collectives that fail by themselves from a chosen step on a chosen node
(``chaos.fail_collectives_node``, ``chaos.fail_collectives_step``).

One seam, :class:`ChaosHooks`, which the trainer calls before and during each step. Without
``chaos.allow`` it installs no signal handler and its calls do nothing, so a production job
cannot be made to corrupt itself by a stray signal or a leftover setting."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastic import event_types as ev
from elastic.config import ChaosConfig
from elastic.events import EventLog
from elastic.state import TrainState

if TYPE_CHECKING:
    from elastic.communicator import Communicator

FLIPPED_BIT = 20  # a mantissa bit: seen by a checksum, harmless to training


@dataclass
class ChaosHooks:
    """The worker's fault hooks; inert unless ``allow``."""

    cfg: ChaosConfig
    flip: threading.Event = field(default_factory=threading.Event)  # SIGUSR1 arrived
    poisoned: set[int] = field(default_factory=set)  # chaos.nan_steps already made NaN

    @classmethod
    def install(cls, cfg: ChaosConfig) -> ChaosHooks:
        """The hooks of ``cfg``; with ``chaos.allow``, SIGUSR1 asks for a bit flip."""
        hooks = cls(cfg)
        if cfg.allow:
            signal.signal(signal.SIGUSR1, lambda signum, frame: hooks.flip.set())
        return hooks

    def before_step(self, state: TrainState, events: EventLog, step: int) -> None:
        """Flip the bit SIGUSR1 asked for.

        Between two steps, so that no collective sees half of it (:meth:`TrainState.flip_bit`)."""
        if not (self.cfg.allow and self.flip.is_set()):
            return
        self.flip.clear()
        name = state.flip_bit(FLIPPED_BIT)
        events.emit(ev.BIT_FLIPPED, step=step, param=name, index=0, bit=FLIPPED_BIT)

    def fail_collectives(self, comm: Communicator, node: str, step: int) -> None:
        """Fail a collective of ``step`` by itself, on chaos.fail_collectives_node.

        From chaos.fail_collectives_step on, in every round: raised in the communicator's block,
        it is the round's failed collective, as gloo's refusal of an operation it lacks was
        (PREMUL_SUM, 2026-11-29), while every peer still answers. Its agent finds no one to blame
        and forms the round again, until it stops (``launcher/agent/peers.py``)."""
        c = self.cfg
        if not c.allow or node != c.fail_collectives_node or step < c.fail_collectives_step:
            return
        with comm.collective("chaos.fail_collectives_step"):
            raise RuntimeError(f"chaos: a collective of step {step} fails by itself on {node}")

    def poison(self, rank: int, step: int) -> bool:
        """Whether this rank's loss is made NaN at ``step``.

        Each of chaos.nan_steps once, on rank chaos.nan_rank, so that the steps a rollback trains
        again are clean."""
        c = self.cfg
        if not c.allow or rank != c.nan_rank or step not in c.nan_steps or step in self.poisoned:
            return False
        self.poisoned.add(step)
        return True
