"""Checkpoints written while training goes on.

A save holds the training thread only while it copies the state into a staged copy in host
memory (pinned for a GPU), one per rank, allocated once and reused. A thread of its own then
writes the copy out and commits it (:class:`elastic.checkpoint_save.CheckpointWriter`) on the
round's save group, a gloo group beside the training group (:mod:`elastic.save_group`), so that
the save's collectives never interleave with training's and a peer frozen in the middle of a
save holds only the save. One save runs at a time per rank, so the ranks enter the save group's
collectives in the same order. Leaving a round abandons its save (:meth:`BackgroundSaver.abandon`),
and the end of training waits for the last one (:meth:`BackgroundSaver.wait`), which says whether
it committed: the end is not the end until the final state is saved (:mod:`elastic.final_save`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from elastic import event_types as ev
from elastic.checkpoint import CheckpointManager
from elastic.checkpoint_save import Plan, SaveAbandoned, SaveFailed
from elastic.events import EventLog
from elastic.round_end import RoundAborted
from elastic.sched_policy import helper_thread
from elastic.state import local

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.05  # how soon a rank waiting for its previous save sees an abort


@dataclass
class _Save:
    """One save in the background; its guard (``elastic.checkpoint_save.SaveGuard``)."""

    step: int
    round: int
    staging: threading.Lock  # the saver's: held while the staged copy is read
    fresh: frozenset[int]  # the data_ptr() of each staged tensor this save refilled
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    gathered: list[dict[str, Any]] | None = None  # every rank's figures, once all have written
    wrote: frozenset[str] | None = None  # the names this rank wrote, once every rank has
    plan: Plan | None = None  # for the round's next save to replay, once every rank has written
    committed: bool = False  # rank 0 (which commits), once the manifest is in place

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


def _memmove_all(copies: list[tuple[int, int, int]]) -> None:
    for destination, source, size in copies:
        ctypes.memmove(destination, source, size)


def _staged_as(staged: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``staged``, the staged copy of ``tensor``'s local shard, as the DTensor ``tensor`` is.

    DCP then saves it as the shard of the whole tensor it is (``parallel.shard=node``), and a
    load at another shape reads each shard's slice. A plain tensor is staged as itself."""
    if not isinstance(tensor, DTensor):
        return staged
    return DTensor.from_local(
        staged,
        tensor.device_mesh,
        tensor.placements,
        run_check=False,  # no collective: the shard's bounds are those of the tensor staged
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def copy_host(
    staged: list[torch.Tensor],
    sources: list[torch.Tensor],
    pool: ThreadPoolExecutor | None,
    threads: int,
) -> None:
    """Copy host ``sources`` into ``staged`` (same shapes and dtypes), split among threads.

    That is ``staged[i].copy_(sources[i])``, on the calling thread and ``threads - 1`` of
    ``pool``'s (with ``pool`` None, on the calling thread alone), each with a share of the
    tensors, largest first. The contiguous ones are copied by glibc's ``memmove``, which releases
    the GIL; the rest (and any not in host memory) by ``copy_``, on the calling thread.

    Why not ``torch._foreach_copy_``: on the CPU it copies the tensors one after the other, each
    split among torch's threads and joined again. For the ResNet-50 state (205 MB, 481 tensors,
    2 threads) that took 18-23 ms within the checkpoint bench, where this takes 15-19 ms
    (``bench/checkpoint.py``). The stall of a save at world 1 is this copy."""
    bins: list[list[tuple[int, int, int]]] = [[] for _ in range(threads if pool else 1)]
    loads = [0] * len(bins)
    rest = []
    pairs = sorted(zip(staged, sources, strict=True), key=lambda pair: -pair[1].nbytes)
    for destination, source in pairs:
        if destination.shape != source.shape or destination.dtype != source.dtype:
            raise ValueError(
                f"staging {tuple(source.shape)} {source.dtype} into "
                f"{tuple(destination.shape)} {destination.dtype}"
            )
        on_host = source.device.type == destination.device.type == "cpu"
        if not (on_host and source.is_contiguous() and destination.is_contiguous()):
            rest.append((destination, source))
        elif source.nbytes:
            least = loads.index(min(loads))
            bins[least].append((destination.data_ptr(), source.data_ptr(), source.nbytes))
            loads[least] += source.nbytes
    others = [pool.submit(_memmove_all, copies) for copies in bins[1:] if copies] if pool else []
    _memmove_all(bins[0])
    for destination, source in rest:
        destination.copy_(source)
    for other in others:
        other.result()


class BackgroundSaver:
    """Saves of one worker, in the background; outlives rounds (its staged copy does)."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self._staged: dict[str, torch.Tensor] = {}
        self._staging = threading.Lock()
        self._current: _Save | None = None
        self._copiers: ThreadPoolExecutor | None = None  # staging's threads beside the caller's

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
        """Stage ``tensors`` and write them in the background as the checkpoint of ``step``.

        A collective of ``group``, called by every rank at the same step. ``shared`` (numbers)
        is gathered to every rank with the save's hashes, with this call's stall added.

        Raises :class:`RoundAborted` when ``aborted()`` turns true while the previous save of
        this round, which this one waits for, is still being written.

        After the first save of a round a rank stages only its share, the tensors DCP had it
        write: DCP splits the replicated tensors among the ranks the same way at every save of a
        round (a save that finds otherwise fails, and the next stages everything). It then writes
        them as DCP planned them at the round's first save, without DCP
        (:class:`elastic.checkpoint_save.Plan`).
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
            fresh, replaced, copied = self._stage({k: local(t) for k, t in tensors.items()}, share)
        staged = {k: _staged_as(self._staged[k], t) for k, t in tensors.items()}
        # And it writes what DCP planned then, into the same staged tensors.
        replay = previous.plan if previous is not None and not replaced else None
        save = _Save(step, round_, self._staging, fresh)
        self._current = save
        rank = dist.get_rank(group)
        stall = time.perf_counter() - t0  # and the start of the thread, below
        go = threading.Event()
        figures = {**(shared or {}), "stall_s": stall}
        helper_thread(
            self._run,
            f"checkpoint-step{step}",
            (manager, save, staged, replay, meta, group, rank, figures, go),
        ).start()
        go.set()
        return Started(stall, copied, previous.gathered if previous is not None else None)

    def _stage(
        self, tensors: dict[str, torch.Tensor], share: frozenset[str] | None
    ) -> tuple[frozenset[int], bool, int]:
        """Copy ``tensors`` (only the names in ``share``, unless None) into the staged copy.

        Returns the data_ptr() of each staged tensor refilled, whether the staged copy was
        allocated anew (then all of it is refilled: a name, shape or dtype changed), and the
        bytes copied."""
        replaced = self._staged.keys() != tensors.keys() or any(
            (s := self._staged[k]).shape != t.shape or s.dtype != t.dtype
            for k, t in tensors.items()
        )
        if replaced:
            pin = any(t.is_cuda for t in tensors.values())
            self._staged = {
                k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in tensors.items()
            }
            share = None
        names = list(tensors.keys() if share is None else share)
        staged, sources = [self._staged[n] for n in names], [tensors[n].detach() for n in names]
        if all(t.device.type == "cpu" for t in sources):
            threads = torch.get_num_threads()
            if self._copiers is None and threads > 1:
                self._copiers = ThreadPoolExecutor(threads - 1, thread_name_prefix="staging")
            copy_host(staged, sources, self._copiers, threads)
        else:
            # One call for all: the ResNet-50 state's 481 copy_ calls took 1-2 ms more.
            torch._foreach_copy_(staged, sources, non_blocking=True)
            if any(t.is_cuda for t in sources):
                torch.cuda.current_stream().synchronize()  # the copies into pinned memory are done
        copied = sum(t.nbytes for t in staged)
        return frozenset(t.data_ptr() for t in staged), replaced, copied

    def _run(
        self,
        manager: CheckpointManager,
        save: _Save,
        staged: dict[str, torch.Tensor],
        replay: Plan | None,
        meta: dict[str, Any],
        group: dist.ProcessGroup,
        rank: int,
        shared: dict[str, Any],
        go: threading.Event,
    ) -> None:
        """The save's thread: write ``staged``, commit, report. Nothing here is the round's failure.

        It waits for :meth:`start` to let it go (``go``), the last thing before returning: begun
        at once, its planning would hold the GIL that the caller needs to return, for up to a
        switch interval (5 ms)."""
        go.wait()
        step = save.step
        try:
            written = manager.writer.write(step, staged, group, save, shared, replay)
            save.gathered, save.wrote = written.gathered, frozenset(written.wrote)
            save.plan = written.plan
            saved = manager.writer.commit(written, meta, save) if rank == 0 else None
        except SaveAbandoned:
            log.info("the checkpoint of step %d was abandoned with round %d", step, save.round)
        except SaveFailed as exc:
            if rank == 0:
                self.events.emit(
                    ev.CHECKPOINT_FAILED,
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
                    ev.CHECKPOINT_FAILED,
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
                save.committed = True
                self.events.emit(
                    ev.CHECKPOINT_SAVED,
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
        """The worker left the round: its save, if not done, must not write or commit.

        An abandoned save that has not begun to read its staged copy never does, so the next
        round's save may refill it; one reading it finishes first (the refill waits for it). The
        folder it leaves has no manifest: the next prune or load removes it.
        """
        save = self._current
        if save is not None and not save.done.is_set():
            save.abandoned = True

    def wait(self, aborted: Callable[[], bool]) -> int | None:
        """Until the current save is done (the end of training); abortable like :meth:`start`.

        Returns its step if this rank committed it: on rank 0, which commits, the end of
        training learns whether the final state is saved; None when it failed, was abandoned or
        none ran, and on the other ranks (rank 0's answer reaches them through a collective)."""
        save = self._current
        while save is not None and not save.done.wait(WAIT_POLL_S):
            if aborted():
                raise RoundAborted("the round was left while the last save was written")
        return save.step if save is not None and save.committed else None
