"""A worker's process group, rebuilt in place for every round, and abortable from any thread.

The worker process lives across rounds; only its process group is replaced (:meth:`enter`, the
set-up steps in :mod:`elastic.group_setup`), with the round's checkpoint save group
(:mod:`elastic.save_group`). Every collective of a round runs through the communicator, as a
tracked all-reduce (:meth:`Communicator.all_reduce`, and the DDP comm hook's,
:mod:`elastic.ddp_hook`) or in a recorded block (:meth:`Communicator.collective`), so that
:meth:`Communicator.abort` (the agent announced a new round) makes the step in flight fail at
once. Whether a round broke is a fact the communicator records, never a guess from an error's
text: the first collective that fails is kept as :attr:`Communicator.failure`, and an exception
raised anywhere else is the worker's own fault (:func:`elastic.round_end.round_end`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic import nccl_settings
from elastic.abortable_group import RoundMesh
from elastic.control import Assignment
from elastic.group_reaper import GroupReaper, forget_groups
from elastic.group_setup import init_group, meet, shrink
from elastic.nccl_group import agreed_to_shrink, can_shrink, healthy, must_abort
from elastic.round_end import CollectiveFailure, RoundAborted
from elastic.save_group import SaveGroup

log = logging.getLogger(__name__)


def pick_device(requested: str, local_rank: int) -> torch.device:
    """``auto``: this worker's GPU when CUDA is available, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but no GPU is visible: use cluster.device=auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device, requested: str = "auto") -> str:
    """The backend for ``device``: NCCL on CUDA and gloo on the CPU.

    ``requested="gloo"`` (``comm.backend``) puts gloo on CUDA tensors too, a test aid for
    simulated nodes that share one GPU."""
    if requested == "gloo":
        return "gloo"
    return "nccl" if device.type == "cuda" else "gloo"


class Communicator:
    """Owns the default process group of the current round.

    It owns the group's set-up, its abortable collectives and what failed in them, its abort
    and its close."""

    def __init__(self, device: torch.device, timeout_s: float, backend: str = "auto") -> None:
        self.device = device
        self.backend = backend_for(device, backend)
        if self.backend == "nccl":  # before the process's first NCCL group reads them
            nccl_settings.apply(timeout_s)
        self.timeout = timedelta(seconds=timeout_s)
        self.assignment: Assignment | None = None
        self.saves = SaveGroup(self.timeout)  # this round's group for checkpoint saves
        self._lock = threading.Lock()
        self._aborted = threading.Event()
        self._pending: list[torch.futures.Future[torch.Tensor]] = []
        self._works: list[dist.Work] = []  # this round's tracked all-reduces
        self.reaper = GroupReaper(device, timeout_s)  # shuts the old rounds' groups down
        self.mesh = RoundMesh()  # parallel.shard=node: the round's mesh groups (sharding.py)
        self.retired_busy = 0  # groups retired with collectives in flight (close), ever
        self._announced = 0  # the newest round the agent has announced
        self._failure: CollectiveFailure | None = None
        self._group_aborted = False  # the current group's NCCL communicator was aborted (freed)
        self._open_blocks = 0  # collective() blocks running now
        # On NCCL, an event recorded after the last collective() block: its collectives were
        # waited on by the current stream, so it completes only once they have on the device.
        self._block_mark: torch.cuda.Event | None = None

    # --- rounds ------------------------------------------------------------------------------

    def enter(self, assignment: Assignment) -> None:
        """Replace the current group (if any) by the group of ``assignment``'s round.

        Raises :class:`RoundAborted` when a newer round was announced before or while the group
        was built: the peers of this round have moved on, and its collectives would never end.
        """
        with self._lock:
            if assignment.round < self._announced:
                raise RoundAborted(f"round {self._announced} was announced")
            previous, self.assignment = self.assignment, assignment
            self._aborted.clear()
            self._pending = []
            self._failure = None
        # The old group's teardown is no collective of the new round's: only the new group's
        # creation counts as one in flight (an abort then aborts it).
        with self._recorded("group set-up"):
            excluded = assignment.shrink_of(previous) if previous is not None else None
            # A shrink is a collective of every survivor: one rank shrinking while another
            # builds anew would wait for it forever. So the ranks agree at the meet.
            offers = meet(assignment, self._can_shrink(excluded), self.timeout, self._aborted)
            if offers is None:
                raise RoundAborted(f"round {self._announced} was announced")
            agreed = agreed_to_shrink(offers, assignment.world_size)
            shrunk = agreed and excluded is not None and shrink(excluded)
            if not shrunk:
                self.close()
            with self.collective("group set-up"):
                if not shrunk:
                    init_group(assignment, self.backend, self.device, self.timeout)
                self.saves.open()
        if self._aborted.is_set():
            raise RoundAborted(f"round {self._announced} was announced")

    def _can_shrink(self, excluded: list[int] | None) -> bool:
        """Whether this rank can make the new round's group by shrinking its current one.

        See :func:`elastic.nccl_group.can_shrink`: this is what the rank offers at the meet."""
        live = dist.is_initialized() and not self._group_aborted
        supported = live and (
            dist.distributed_c10d._get_default_group()._get_backend(self.device).supports_shrinking
        )
        return can_shrink(self.backend, excluded, live, supported)

    def abort(self, reason: str, before_round: int | None = None) -> None:
        """Make the step in flight fail now; callable from any thread.

        On NCCL it also aborts the communicator.

        With ``before_round``, only a round older than that is aborted: the training thread may
        already have entered the announced round by the time the message reader gets here, and
        aborting that round would leave this rank out of it while its peers wait.
        """
        with self._lock:
            if before_round is not None:
                self._announced = max(self._announced, before_round)
                current = self.assignment
                if current is not None and current.round >= before_round:
                    return
            if self._aborted.is_set():
                return
            self._aborted.set()
            pending, self._pending = self._pending, []
        for fut in pending:
            if not fut.done():
                fut.set_exception(RoundAborted(reason))
        self.mesh.abort(reason)
        self._abort_group_if_needed()

    def _abort_group_if_needed(self) -> None:
        """Abort the NCCL communicator unless it is idle and healthy, or already being aborted."""
        group = self._group_to_abort()
        if group is not None:
            group.abort()

    def _group_to_abort(self) -> dist.ProcessGroup | None:
        """The current group if it must be aborted and nobody has begun to; marked as aborted.

        The test is :func:`elastic.nccl_group.must_abort` (what each costs is written there).
        One with a failed collective is never destroyed without an abort, since the destroy may
        wait for the failed kernel (a survivor hung so on the GPU machine, 2026-11-28). Marked
        before the abort: the training thread that reaches :meth:`close` meanwhile leaves the
        group to its abort instead of waiting on it."""
        if self.backend != "nccl" or not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
        with self._lock:
            if not must_abort(
                self.backend, self._group_aborted, self._idle(), healthy(group, self.device)
            ):
                return None
            self._group_aborted = True  # being freed: it can be destroyed, never shrunk
        return group

    @property
    def aborted(self) -> bool:
        """Whether the agent moved this worker out of the current round."""
        return self._aborted.is_set()

    @property
    def failure(self) -> CollectiveFailure | None:
        """The first collective of the current round that failed, if one did.

        That is the comm hook's all-reduce, the group's set-up, DDP's one-time bucket rebuild,
        or a block the trainer runs under :meth:`collective` (the state sync and the checkpoint
        collectives)."""
        with self._lock:
            return self._failure or self.mesh.failure()

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Run collectives of the current round, recording a failure as the round's.

        An exception leaving the block is recorded as the round's :attr:`failure` (and raised
        on).

        Only collectives and what they carry belong in the block: a local fault inside it would
        be taken for a broken round. DCP reports a rank's local failure through a collective that
        completed, as a ``CheckpointException``, a ``BaseException``: it passes through here
        without being recorded, which is right, since every rank's group is still intact.
        """
        with self._lock:
            self._open_blocks += 1
        try:
            with self._recorded(what):
                yield
        finally:
            mark = None  # only NCCL's idleness is asked (_abort_group_if_needed)
            if self.backend == "nccl" and torch.cuda.is_initialized():
                mark = torch.cuda.Event()
                mark.record()
            with self._lock:
                self._open_blocks -= 1
                self._block_mark = mark or self._block_mark

    @contextlib.contextmanager
    def _recorded(self, what: str) -> Iterator[None]:
        """Record an exception leaving the block as the round's :attr:`failure`.

        The launches of tracked collectives (the hook's, :meth:`all_reduce`'s) run only in this."""
        try:
            yield
        except Exception as exc:
            with self._lock:
                self._record(what, exc)
            raise

    def _idle(self) -> bool:
        """Whether no collective of the round may still run; with the lock held.

        Idle means no block open, every tracked work completed, the last block's device mark
        reached. Errors are the backend's to report (:func:`elastic.nccl_group.healthy`):
        ``Work.exception()`` cannot be called from Python (torch 2.11 to 2.14: pybind11 cannot
        convert its ``exception_ptr``).
        """
        if self._open_blocks:
            return False
        if not all(w.is_completed() for w in self._works):
            return False
        return self._block_mark is None or self._block_mark.query()

    def _record(self, what: str, exc: BaseException) -> None:
        """Keep the round's first failure; called with ``self._lock`` held."""
        if self._failure is None:
            self._failure = CollectiveFailure.of(what, exc)

    def close(self, wait_s: float = 0.0) -> None:
        """Let go of the current group; its shutdown runs on a thread (:mod:`elastic.group_reaper`).

        A collective still in flight (gloo cannot abort one) may linger on the old group's
        threads until its timeout; it holds only buffers of the discarded DDP instance. The
        group is shut down once it has ended. ``wait_s``: how long to wait for every teardown
        handed over so far, as a worker leaving for good does.
        """
        if dist.is_initialized():
            to_abort = self._group_to_abort()  # aborted beside the next round, as shut down
            with self._lock:
                works, self._works = self._works, []
                self._block_mark = None
            in_flight = [w for w in works if not w.is_completed()] + self.mesh.retire()
            if in_flight:
                log.info("retiring the old group with %d collective(s) in flight", len(in_flight))
                self.retired_busy += 1  # they may still write into what they were given
            self.reaper.take(forget_groups(), in_flight, to_abort)
            self._group_aborted = False
            self.saves.drop()  # forgotten with the rest
        if wait_s > 0 and not self.reaper.drain(wait_s):
            log.warning("old groups still shutting down after %.0f s", wait_s)

    # --- tracked all-reduces -----------------------------------------------------------------

    def launch(self, tensor: torch.Tensor, what: str) -> dist.Work | None:
        """Start an all-reduce of ``tensor``, kept in this round's works.

        None once the round was left. Under the lock: :meth:`abort` then sees every collective
        begun before it, and none begins after it (a collective begun on a communicator it chose
        not to abort could wait forever on a dead peer)."""
        with self._recorded(what), self._lock:  # gloo may refuse at once: peer gone
            if self._aborted.is_set():
                return None
            work = dist.all_reduce(tensor, async_op=True)
            # Completed works are close()'s no longer: kept, one per bucket per step would pile
            # up for the whole round.
            self._works = [w for w in self._works if not w.is_completed()]
            self._works.append(work)  # retired with its group if still in flight (close)
            return work

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` over the round's ranks in place, abortably.

        A blocking all-reduce cannot be interrupted, and a peer frozen or moved on to a newer
        round would hold this rank in it until the peer came back or for the whole
        ``rendezvous.pg_timeout_s``. Raises :class:`RoundAborted` as soon as :meth:`abort` is
        called; a failure is recorded as ``what``'s."""
        work = self.launch(tensor, what)
        if work is None:
            raise RoundAborted("the round was left")
        self.track(work, what, tensor, tensor).wait()
        # gloo completes a work's future, and so ours, just before it marks the work completed:
        # returned, an all-reduce must count as done (:meth:`_idle`, which close() asks).
        work.wait()

    def barrier(self, what: str) -> None:
        """Wait until every rank of the round has got here, abortably (:meth:`all_reduce`)."""
        self.all_reduce(torch.zeros(1, device=self.device), what)

    def track(
        self, work: dist.Work, what: str, out: torch.Tensor, reduced: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """A future of ``work`` that completes with ``out`` once done, or fails on an abort.

        ``work`` is a collective of this round in flight, writing ``reduced``. The future
        completes with ``out`` (``reduced`` copied into it, if another tensor) once the work is
        done, or with :class:`RoundAborted` when :meth:`abort` is called; a failure of the work
        is recorded as ``what``'s.

        On CUDA the future names the device: completing it then records an event on the stream
        that made ``out`` (after the all-reduce, on a stream that waited for it), and whoever
        waits on it, DDP before it reads the bucket, waits for that event. Without a device it
        would complete as soon as NCCL had queued the all-reduce, and DDP would read the bucket
        before the all-reduce (and the cast back from ``grad_dtype``) had run on the GPU."""
        devices = [self.device] if self.device.type == "cuda" else None
        ours: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
        with self._lock:
            if self._aborted.is_set():
                ours.set_exception(RoundAborted("the round was left"))
                return ours
            # Completed futures are abort()'s no longer: kept, one per bucket per step would
            # pile up for the whole round.
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(ours)

        def finish(fut: torch.futures.Future[Any]) -> None:
            with self._lock:
                if ours.done() or self._aborted.is_set():
                    return  # abort() completes ours: it took it from _pending under this lock
                try:
                    fut.value()
                except Exception as exc:
                    self._record(what, exc)
                    # Without its traceback: torch keeps a broken step's futures, the future
                    # its error, and the traceback this frame with the round's tensors.
                    ours.set_exception(exc.with_traceback(None))
                else:
                    if reduced is not out:
                        out.copy_(reduced)
                    ours.set_result(out)

        work.get_future().add_done_callback(finish)
        return ours
