"""Checkpoints written while training goes on.

A save stalls the training thread only while it copies the state into a staging copy in host
memory (pinned for a GPU): one copy per rank, allocated at the first save and reused by every
later one. After the first save of a round a rank copies only its share, the tensors DCP had it
write: DCP splits the replicated tensors among the ranks the same way at every save of a round
(a save that finds otherwise fails, and the next copies everything); it then writes them as DCP
planned them at the round's first save, without DCP (``elastic.checkpoint.Plan``). A thread of
its own writes the copy out and commits it (:meth:`elastic.checkpoint.CheckpointManager.save`)
on the round's save group, a gloo group beside the training group (``Communicator.save_group``),
so that the save's collectives never interleave with training's and a peer frozen in the middle
of a save holds only the save.

The rules that keep a background save safe:

- One save at a time per rank: the next waits for the previous one of the same round, abortably
  (the ranks then enter the save group's collectives in the same order).
- Leaving a round abandons its save if it is not done (:meth:`BackgroundSaver.abandon`). An
  abandoned save that has not begun to read its staged copy never does, so the next round's save
  may refill it; one reading it finishes first (the refill waits for it). An abandoned save is
  never committed, and the folder it leaves has no manifest: the next prune or load removes it.
- The end of training waits for the last save (:meth:`BackgroundSaver.wait`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic.checkpoint import CheckpointManager, Plan, SaveAbandoned, SaveFailed
from elastic.communicator import RoundAborted
from elastic.events import EventLog

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.05  # how soon a rank waiting for its previous save sees an abort


@dataclass
class _Save:
    """One save in the background; its guard (``elastic.checkpoint.SaveGuard``)."""

    step: int
    round: int
    staging: threading.Lock  # the saver's: held while the staged copy is read
    fresh: frozenset[int]  # the data_ptr() of each staged tensor this save refilled
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    gathered: list[dict[str, Any]] | None = None  # every rank's figures, once all have written
    wrote: frozenset[str] | None = None  # the names this rank wrote, once every rank has
    plan: Plan | None = None  # for the round's next save to replay, once every rank has written

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self.staging:
            yield

    def refilled(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.fresh


@dataclass(frozen=True)
class Started:
    stall_s: float  # how long the caller was held: the previous save's end, then staging
    copied_bytes: int  # what staging copied: the whole state, or this rank's share
    # Every rank's figures from the previous save of this round (``shared``, ``write_s``,
    # ``stall_s``), the same on every rank; None when there was none or it did not get that far.
    previous: list[dict[str, Any]] | None


class BackgroundSaver:
    """Saves of one worker, in the background; outlives rounds (its staged copy does)."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self._staged: dict[str, torch.Tensor] = {}
        self._staging = threading.Lock()
        self._current: _Save | None = None

    @property
    def staged_bytes(self) -> int:
        """The host memory the staged copy holds."""
        return sum(t.numel() * t.element_size() for t in self._staged.values())

    def start(
        self,
        manager: CheckpointManager,
        step: int,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        group: dist.ProcessGroup,
        round_: int,
        aborted: Callable[[], bool],
        shared: dict[str, Any] | None = None,
    ) -> Started:
        """Stage ``tensors`` and write them in the background as the checkpoint of ``step``;
        a collective of ``group``, called by every rank at the same step. ``shared`` (numbers)
        is gathered to every rank with the save's hashes, with this call's stall added.

        Raises :class:`RoundAborted` when ``aborted()`` turns true while the previous save of
        this round is still being written.
        """
        t0 = time.perf_counter()
        previous = self._current
        if previous is not None and previous.round != round_:
            previous = None
        if previous is not None:
            while not previous.done.wait(WAIT_POLL_S):
                if aborted():
                    raise RoundAborted("the round was left while the previous save was written")
        # DCP splits the replicated tensors among the ranks the same way at every save of a
        # round: after the first, a rank stages only its share.
        share = previous.wrote if previous is not None else None
        with self._staging:  # an abandoned save still reading its copy finishes first
            fresh, replaced = self._stage(tensors, share)
        # And it writes what DCP planned then, into the same staged tensors.
        replay = previous.plan if previous is not None and not replaced else None
        save = _Save(step, round_, self._staging, fresh)
        copied = sum(
            t.numel() * t.element_size() for t in self._staged.values() if save.refilled(t)
        )
        self._current = save
        rank = dist.get_rank(group)
        stall = time.perf_counter() - t0  # and the start of the thread, below
        go = threading.Event()
        threading.Thread(
            target=self._run,
            args=(manager, save, replay, meta, group, rank, {**(shared or {}), "stall_s": stall}),
            kwargs={"go": go},
            name=f"checkpoint-step{step}",
            daemon=True,
        ).start()
        go.set()
        return Started(stall, copied, previous.gathered if previous is not None else None)

    def _stage(
        self, tensors: dict[str, torch.Tensor], share: frozenset[str] | None
    ) -> tuple[frozenset[int], bool]:
        """Copy ``tensors`` (only the names in ``share``, unless None) into the staged copy;
        returns the data_ptr() of each staged tensor refilled, and whether the staged copy was
        allocated anew (then all of it is refilled)."""
        replaced = self._staged.keys() != tensors.keys()
        if replaced:
            pin = any(t.is_cuda for t in tensors.values())
            self._staged = {
                k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in tensors.items()
            }
            share = None
        names = list(tensors.keys() if share is None else share)
        # One call for all: the ResNet-50 state's 481 copy_ calls took 1-2 ms more.
        torch._foreach_copy_(
            [self._staged[name] for name in names],
            [tensors[name].detach() for name in names],
            non_blocking=True,
        )
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.current_stream().synchronize()  # the copies into pinned memory are done
        return frozenset(self._staged[name].data_ptr() for name in names), replaced

    def _run(
        self,
        manager: CheckpointManager,
        save: _Save,
        replay: Plan | None,
        meta: dict[str, Any],
        group: dist.ProcessGroup,
        rank: int,
        shared: dict[str, Any],
        go: threading.Event,
    ) -> None:
        """The save's thread: write, commit, report. Nothing here is the round's failure.

        It waits for :meth:`start` to let it go (``go``), the last thing before returning: begun
        at once, its planning would hold the GIL that the caller needs to return, for up to a
        switch interval (5 ms)."""
        go.wait()
        step = save.step
        try:
            written = manager.write(step, self._staged, group, save, shared, replay)
            save.gathered, save.wrote = written.gathered, frozenset(written.wrote)
            save.plan = written.plan
            saved = manager.commit(written, meta, save) if rank == 0 else None
        except SaveAbandoned:
            log.info("the checkpoint of step %d was abandoned with round %d", step, save.round)
        except SaveFailed as exc:
            if rank == 0:
                self.events.emit(
                    "checkpoint_failed",
                    f"{exc}; training goes on, the next interval tries again",
                    level=logging.WARNING,
                    step=exc.step,
                    reason=exc.reason,
                    fix=exc.fix,
                    round=save.round,
                )
        except (Exception, CheckpointException) as exc:  # the save group's collectives broke
            if not save.abandoned and rank == 0:
                self.events.emit(
                    "checkpoint_failed",
                    f"checkpoint of step {step} failed: {type(exc).__name__}: {exc}; training "
                    "goes on, the next interval tries again",
                    level=logging.WARNING,
                    step=step,
                    reason=f"the save's collectives failed: {type(exc).__name__}: {exc}"[:500],
                    fix="none needed if a peer was lost (the round is rebuilt); otherwise raise "
                    "rendezvous.pg_timeout_s above the time a save takes",
                    round=save.round,
                )
        else:
            if saved is not None:
                self.events.emit(
                    "checkpoint_saved",
                    step=step,
                    url=saved.url,
                    bytes=saved.bytes,
                    stall_s=shared["stall_s"],
                    seconds=saved.seconds,
                    round=save.round,
                )
        finally:
            save.done.set()

    def abandon(self) -> None:
        """The worker left the round: its save, if not done, must not write or commit."""
        save = self._current
        if save is not None and not save.done.is_set():
            save.abandoned = True

    def wait(self, aborted: Callable[[], bool]) -> None:
        """Until the current save is done (the end of training); abortable like :meth:`start`."""
        save = self._current
        while save is not None and not save.done.wait(WAIT_POLL_S):
            if aborted():
                raise RoundAborted("the round was left while the last save was written")
