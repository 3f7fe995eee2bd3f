"""Writing a checkpoint and committing it: the save path of the checkpoints.

:class:`elastic.checkpoint.CheckpointManager` holds the :class:`CheckpointWriter`.

Every rank writes its shard with DCP (laid out by :mod:`elastic.shard_io`) and hashes it from
memory as it writes it: no file is read back, and no rank reads another's. A round's later saves
replay the plan DCP made at its first (:class:`Plan`). Rank 0 commits: it writes the manifest
(:mod:`elastic.manifest`) last, then prunes (:mod:`elastic.checkpoint_retention`). A failed save
(:class:`SaveFailed`) or an abandoned one (:class:`SaveAbandoned`) commits nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pickle
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic.checkpoint_retention import Retention
from elastic.checkpoint_store import CheckpointStore
from elastic.manifest import FORMAT, file_record, folder
from elastic.shard_io import METADATA, ShardWriter
from elastic.state import local

log = logging.getLogger("elastic.checkpoint")  # one logger for the saves and the loads


class SaveFailed(Exception):
    """A checkpoint could not be written here; the round and the older checkpoints are intact.

    It fails on this side of the network (disk full, permission lost, the store down): the
    half-written folder is removed, the newest good checkpoint stays, and the caller trains on
    and tries again at the next interval. DCP (or, at a save that replays a round's plan, the
    gathering of the hashes) reports it on every rank through a collective that completed, so
    the ranks agree on it.
    """

    def __init__(self, step: int, reason: str, fix: str) -> None:
        super().__init__(f"checkpoint of step {step} failed: {reason}. Fix: {fix}")
        self.step, self.reason, self.fix = step, reason, fix


class SaveAbandoned(Exception):
    """The round a save belonged to was left before every rank wrote its shard.

    Nothing of the save is committed (its folder, if any, has no manifest, and the next load
    removes it)."""


class SaveGuard(Protocol):
    """What a save consults while it runs, about its round and the state handed to it.

    Whether its round was left; a lock held while the state handed to it is read (the staged
    copy, which the next save refills); and whether a tensor of that state holds this save's
    values."""

    @property
    def abandoned(self) -> bool: ...

    def reading(self) -> AbstractContextManager[None]: ...

    def refilled(self, tensor: torch.Tensor) -> bool:
        """Whether this save refilled the staged ``tensor``.

        False for a staged tensor this save did not refill, which holds an older step: a save
        stages only the tensors its rank wrote in the round's last save."""
        ...


class _Unguarded:
    abandoned = False

    def reading(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def refilled(self, tensor: torch.Tensor) -> bool:
        return True


UNGUARDED = _Unguarded()  # a save called in the foreground: nothing else reads its state


@dataclass(frozen=True)
class Failure:
    """Why a rank could not write its part of a save, as every rank learns it (picklable)."""

    kind: str  # the exception's class name
    text: str
    errno: int | None
    abandoned: bool  # the round was left (SaveAbandoned): no failure of the save itself

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        errno_ = getattr(error, "errno", None)
        return cls(type(error).__name__, str(error), errno_, isinstance(error, SaveAbandoned))

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


def save_failure_fix(
    errnos: list[int | None], free_bytes: int | None = None, needed_bytes: int = 0
) -> str:
    """What an operator should do about a failed save, from its errors and the space left.

    It reads the errors' errno (not their text), and the space left where the checkpoint goes
    (``free_bytes``, None where unknown) against what this rank had to write: a short write on a
    full disk may come without an errno."""
    codes = set(errnos)
    full = free_bytes is not None and free_bytes < needed_bytes
    if full or codes & {errno.ENOSPC, errno.EDQUOT}:
        return "free space where checkpoint.url points, or lower checkpoint.keep"
    if codes & {errno.EACCES, errno.EPERM, errno.EROFS}:
        return "make checkpoint.url writable by the job's user, or point it elsewhere"
    return "check that checkpoint.url is reachable and writable from every node"


# The one key the state is saved under (its tensors are "state.<name>" in DCP's .metadata): DCP
# wraps the state_dict() call of each top-level key in its logger, which cost 15 ms a save with
# the ResNet-50 state's 481 tensors as keys. Checkpoints of manifest format 1 have none.
ROOT = "state"


@dataclass(frozen=True)
class Plan:
    """What DCP planned, and what writing it gave, at a round's first save.

    The round's later saves replay it (:meth:`CheckpointWriter.write`). Its planner resolves
    each item to the tensor of the state it was given, the staged copy that every save of the
    round refills."""

    planner: SavePlanner
    plan: SavePlan  # this rank's final plan
    results: list[WriteResult]  # what writing it gave: each item's file, offset and length
    metadata: bytes  # DCP's .metadata as pickled (written by rank 0)


@dataclass(frozen=True)
class Written:
    """A checkpoint every rank has written and hashed, not committed yet."""

    step: int
    path: str
    tensors: list[str]  # the names saved
    wrote: list[str]  # the names of the tensors this rank wrote
    gathered: list[dict[str, Any]]  # each rank's file hashes and ``shared``, in rank order
    started: float  # perf_counter() when the save began
    plan: Plan  # for the next save of the round to replay


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint."""

    url: str
    bytes: int
    seconds: float  # from the save's start until the manifest was in place


class _ShardWriter(ShardWriter):
    """The shard writer of a save that may be abandoned.

    It writes nothing once the save's round was left, and reads the state only under the guard's
    lock (the staged copy, which the next save refills)."""

    def __init__(self, url: str, guard: SaveGuard) -> None:
        super().__init__(url)
        self.guard = guard

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self.guard.reading():
            if self.guard.abandoned:
                raise SaveAbandoned("the round was left before this rank wrote its shard")
            future = super().write_data(plan, planner)
        stale = sum(not self.guard.refilled(t) for t in self.wrote)
        if stale:  # DCP gave this rank other tensors than in the round's last save: none yet
            raise RuntimeError(
                f"{stale} of the tensors this rank wrote were not staged for this save (DCP's "
                "plan changed within the round); the next save stages every tensor"
            )
        return future


class CheckpointWriter:
    """Writes and commits the checkpoints of ``store``.

    ``retention`` prunes after each commit and cleans up after a failed save."""

    def __init__(self, store: CheckpointStore, retention: Retention) -> None:
        self._store, self._retention = store, retention

    def write(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        guard: SaveGuard = UNGUARDED,
        shared: dict[str, Any] | None = None,
        replay: Plan | None = None,
    ) -> Written:
        """Write the checkpoint of ``step``; a collective of ``group``.

        Called by every rank with its state. Each rank hashes the files it wrote; the last
        collective gathers the hashes, with ``shared`` and the seconds each rank took
        (``write_s``), to every rank.

        ``replay``, the plan of an earlier save of the same round on the same ``tensors``
        (:attr:`Written.plan`), skips DCP: each rank writes the items DCP gave it then, rank 0
        writes the ``.metadata`` DCP made then, and the gathering of the hashes is the save's
        one collective. DCP's planning and its three collectives of pickled per-item plans,
        results and metadata took 0.05-0.10 s of every save of the ResNet-50 state, half its
        time beyond writing the bytes (``bench/checkpoint.py``). Every save of a round would plan
        the same: the items, their sizes and so their offsets do not change. A rank whose write
        gives other results than the plan's fails the save (and the next save plans anew).

        Raises :class:`SaveFailed` on every rank when a rank could not write, and
        :class:`SaveAbandoned` when ``guard`` says the round was left before every rank wrote.
        """
        t0 = time.perf_counter()
        path = folder(self._store.root, step)
        rank = dist.get_rank(group)
        writer = _ShardWriter(self._store.url_of(path), guard)
        failures: dict[int, Failure] = {}
        mine: dict[str, Any] = {}
        if replay is None:
            planner = DefaultSavePlanner()
            try:
                metadata = dcp.save(
                    {ROOT: tensors}, storage_writer=writer, planner=planner, process_group=group
                )
            except CheckpointException as exc:  # DCP told every rank
                failures = {r: Failure.of(error) for r, (error, _) in exc.failures.items()}
            else:
                data = pickle.dumps(metadata)
                # torch 2.11's FileSystemWriter.finish() fills in a copy of the metadata, not the
                # one dcp.save returns (which then has no storage_data): take the bytes it wrote.
                if metadata.storage_data is None and rank == 0:
                    with writer.fs.create_stream(
                        writer.fs.concat_path(writer.path, METADATA), "rb"
                    ) as stream:
                        data = stream.read()
                replay = Plan(planner, planner.plan, writer.results, data)
        else:
            try:
                self._replay(writer, replay, rank == 0)
            except Exception as exc:  # the gathering below tells every rank
                mine["failed"] = Failure.of(exc)
        if not failures:
            mine |= {"files": writer.written, "write_s": time.perf_counter() - t0}
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, {**mine, **(shared or {})}, group=group)
            failures = {r: g["failed"] for r, g in enumerate(gathered) if "failed" in g}
        if failures:
            if any(f.abandoned for f in failures.values()):
                raise SaveAbandoned(f"the save of step {step} was abandoned")
            reason = "; ".join(f"rank {r}: {f}" for r, f in sorted(failures.items()))
            if rank == 0:  # every rank is past its writes by now
                self._retention.discard(path)
            needed = sum(t.numel() * t.element_size() for t in tensors.values())
            codes = [f.errno for f in failures.values()]
            raise SaveFailed(
                step, reason, save_failure_fix(codes, self._store.free_bytes(), needed)
            )
        assert replay is not None
        ptrs = {t.data_ptr() for t in writer.wrote}
        wrote = [name for name, t in tensors.items() if local(t).data_ptr() in ptrs]
        return Written(step, path, sorted(tensors), wrote, gathered, t0, replay)

    @staticmethod
    def _replay(writer: _ShardWriter, plan: Plan, coordinator: bool) -> None:
        """Write ``plan`` again, and its ``.metadata`` on the coordinator."""
        writer.fs.mkdir(writer.path)
        if writer.write_data(plan.plan, plan.planner).value() != plan.results:
            raise RuntimeError(
                "writing the round's plan again gave other offsets or lengths than at the "
                "round's first save; the next save plans anew"
            )
        if coordinator:
            writer.write_metadata(plan.metadata)

    def commit(self, written: Written, meta: dict[str, Any], guard: SaveGuard = UNGUARDED) -> Saved:
        """Rank 0: hash DCP's ``.metadata``, write the manifest (the commit), prune.

        Raises :class:`SaveFailed` when the manifest could not be written (the folder is then
        removed), and :class:`SaveAbandoned` when ``guard`` says the round was left.
        """
        path, step = written.path, written.step
        try:
            files = {name: f for g in written.gathered for name, f in g["files"].items()}
            for name in self._store.files(path):  # DCP's .metadata, written by this rank
                if name not in files:
                    files[name] = file_record(self._store.fs, f"{path}/{name}")
            manifest = {
                "format": FORMAT,
                "step": step,
                "saved_at": time.time(),
                "files": files,
                "world_size": len(written.gathered),
                "tensors": written.tensors,
                **meta,
            }
            if guard.abandoned:
                raise SaveAbandoned(f"the round was left before the commit of step {step}")
            self._store.put_manifest(path, manifest)
            seconds = time.perf_counter() - written.started
        except SaveAbandoned:
            raise
        except Exception as exc:  # local I/O of any fsspec backend: the commit did not happen
            self._retention.discard(path)
            failure = Failure.of(exc)
            raise SaveFailed(step, str(failure), save_failure_fix([failure.errno])) from exc
        try:
            self._retention.prune(step)
        except Exception as exc:  # committed; an old folder stays until the next prune
            log.warning("could not remove old checkpoints under %s: %s", self._store.url, exc)
        size = sum(f["size"] for f in files.values())
        return Saved(self._store.url_of(path), size, seconds)
