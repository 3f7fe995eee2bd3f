"""Sharded checkpoints with torch.distributed.checkpoint (DCP) to any fsspec URL.

``<url>/step_<step>/`` holds one shard file per rank (laid out by :mod:`elastic.shard_io`), DCP's
``.metadata``, and ``manifest.json``, the commit record that rank 0 writes last
(:mod:`elastic.manifest`). DCP writes a replicated tensor once and reshards on load, so a
checkpoint loads at any world size. Each rank hashes its shard from memory as it writes it: no
file is read back, and no rank reads another's. A load takes the newest checkpoint whose files
all match its manifest: DCP's ``.metadata`` is a pickle, and verifying it against our own
manifest first keeps resume from unpickling anything we did not write. A failed save
(:class:`SaveFailed`) or an abandoned one (:class:`SaveAbandoned`) commits nothing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic import event_types as ev
from elastic.events import EventLog
from elastic.manifest import FORMAT, FORMATS, MANIFEST, candidates, file_record, folder
from elastic.shard_io import METADATA, ShardReader, ShardWriter

log = logging.getLogger(__name__)


# Runs a block of collectives of the current round (``Communicator.collective``).
Collective = Callable[[str], AbstractContextManager[None]]


def _no_guard(what: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def _fsync_dir(path: str) -> None:
    """Make a local folder's entries durable (its files' names, a rename into it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """The round a save belonged to was left before every rank wrote its shard: nothing of it
    is committed (its folder, if any, has no manifest, and the next load removes it)."""


class SaveGuard(Protocol):
    """What a save consults while it runs: whether its round was left, a lock held while the
    state handed to it is read (the staged copy, which the next save refills), and whether a
    tensor of that state holds this save's values."""

    @property
    def abandoned(self) -> bool: ...

    def reading(self) -> AbstractContextManager[None]: ...

    def refilled(self, tensor: torch.Tensor) -> bool:
        """False for a staged tensor this save did not refill, which holds an older step: a
        save stages only the tensors its rank wrote in the round's last save."""
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
    """What an operator should do about a failed save, from the errors' errno (not their text),
    and from the space left where the checkpoint goes (``free_bytes``, None where unknown)
    against what this rank had to write: a short write on a full disk may come without an
    errno."""
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

# Training state a checkpoint may lack and a resumed job starts fresh: the loss scaler exists
# only under trainer.precision=fp16.
OPTIONAL_STATE = ("scaler.",)


@dataclass(frozen=True)
class CheckpointInfo:
    url: str
    step: int
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """What DCP planned, and what writing it gave, at a round's first save: the round's later
    saves replay it (:meth:`CheckpointManager.write`). Its planner resolves each item to the
    tensor of the state it was given, the staged copy that every save of the round refills."""

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
    """The shard writer of a save that may be abandoned: it writes nothing once the save's round
    was left, and reads the state only under the guard's lock (the staged copy, which the next
    save refills)."""

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


class CheckpointManager:
    """The checkpoints under one URL. ``collective`` guards the collectives of a load (the
    worker passes ``Communicator.collective``); a save runs on a group of its own, in the
    background (:class:`elastic.async_checkpoint.BackgroundSaver`), and its failures are the
    save's, never the round's."""

    def __init__(
        self,
        url: str,
        keep: int,
        events: EventLog | None = None,
        collective: Collective = _no_guard,
    ) -> None:
        self.url = url.rstrip("/")
        self.keep = keep
        self.events = events
        self._collective = collective
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    # --- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        group: dist.ProcessGroup | None = None,
    ) -> Saved | None:
        """:meth:`write` then :meth:`commit`, in the foreground; a collective of ``group`` (the
        default group when None). Returns what was committed on rank 0, None on the others."""
        written = self.write(step, tensors, group)
        return self.commit(written, meta) if dist.get_rank(group) == 0 else None

    def write(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        guard: SaveGuard = UNGUARDED,
        shared: dict[str, Any] | None = None,
        replay: Plan | None = None,
    ) -> Written:
        """Write the checkpoint of ``step``; a collective of ``group``, called by every rank with
        its state. Each rank hashes the files it wrote; the last collective gathers the hashes,
        with ``shared`` and the seconds each rank took (``write_s``), to every rank.

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
        path = folder(self.root, step)
        rank = dist.get_rank(group)
        writer = _ShardWriter(self._url(path), guard)
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
                self._discard(path)
            needed = sum(t.numel() * t.element_size() for t in tensors.values())
            codes = [f.errno for f in failures.values()]
            raise SaveFailed(step, reason, save_failure_fix(codes, self._free_bytes(), needed))
        assert replay is not None
        ptrs = {t.data_ptr() for t in writer.wrote}
        wrote = [name for name, t in tensors.items() if t.data_ptr() in ptrs]
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
            for name in self._files(path):  # DCP's .metadata, written by this rank
                if name not in files:
                    files[name] = file_record(self.fs, f"{path}/{name}")
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
            self._commit(path, manifest)
            seconds = time.perf_counter() - written.started
        except SaveAbandoned:
            raise
        except Exception as exc:  # local I/O of any fsspec backend: the commit did not happen
            self._discard(path)
            failure = Failure.of(exc)
            raise SaveFailed(step, str(failure), save_failure_fix([failure.errno])) from exc
        try:
            self._prune(step)
        except Exception as exc:  # committed; an old folder stays until the next prune
            log.warning("could not remove old checkpoints under %s: %s", self.url, exc)
        size = sum(f["size"] for f in files.values())
        return Saved(self._url(path), size, seconds)

    def _free_bytes(self) -> int | None:
        """The space left where the checkpoints go, on a local file system (None elsewhere)."""
        if not isinstance(self.fs, LocalFileSystem):
            return None
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    def _commit(self, path: str, manifest: dict[str, Any]) -> None:
        """Put the manifest in place: durably on a local file system, in one put elsewhere.

        Locally, the shards and ``.metadata`` are already fsynced; the folder is fsynced before
        the manifest (itself fsynced) is renamed into it, and after. An object store makes a
        single put atomic.
        """
        data = json.dumps(manifest, indent=1).encode()
        target = f"{path}/{MANIFEST}"
        if not isinstance(self.fs, LocalFileSystem):
            self.fs.pipe_file(target, data)  # object stores make a single put atomic
            return
        _fsync_dir(self.root)  # the folder's entry, then the shards' and .metadata's
        _fsync_dir(path)
        tmp = f"{target}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(path)

    def _discard(self, path: str) -> None:
        """Remove what a failed save left (rank 0), and the folders that abandoned saves left
        before it (:meth:`_remove_abandoned`): their space may be what this save lacked. Left
        to the next prune, which only a save that commits runs, they kept a full store full for
        good (found by CI: a save abandoned by a round change wrote into the space just freed,
        and every later save failed)."""
        self._remove_abandoned(before=path)
        with contextlib.suppress(Exception):  # the store may be what failed
            self.fs.rm(path, recursive=True)

    def _remove_abandoned(self, before: str) -> None:
        """Remove the folders older than ``before`` that were never committed (saves abandoned
        by a round change, or failed): no load takes them."""
        for path in self._uncommitted():
            if path < before:
                with contextlib.suppress(Exception):  # the store may be what failed
                    self.fs.rm(path, recursive=True)

    def _uncommitted(self) -> list[str]:
        """Checkpoint folders without a manifest (saves abandoned or failed), newest first."""
        with contextlib.suppress(Exception):
            return [p for p in self._candidates() if not self.fs.exists(f"{p}/{MANIFEST}")]
        return []

    def _prune(self, step: int) -> None:
        """Keep the newest ``keep`` committed checkpoints, and remove the abandoned folders
        older than ``step``'s."""
        committed = 0
        for path in self._candidates():
            if self.fs.exists(f"{path}/{MANIFEST}"):
                committed += 1
                if committed > self.keep:
                    self.fs.rm(path, recursive=True)
        self._remove_abandoned(before=folder(self.root, step))

    # --- loading -------------------------------------------------------------------------------

    def committed(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is committed, as rank 0 finds it; a collective,
        so that every rank takes the same answer while an older round's commit may land."""
        found: list[Any] = [None]
        if dist.get_rank() == 0:
            found[0] = self.fs.exists(f"{folder(self.root, step)}/{MANIFEST}")
        with self._collective("checkpoint lookup"):
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def newest_valid(self) -> CheckpointInfo | None:
        """The newest complete, verified checkpoint; cleans up the ones that are not. One
        process reads every file (the health check, the tools); a job's ranks share the work
        in :meth:`restore`."""
        for path in self._candidates():
            reason = self.verify(path)
            if reason is None:
                return self._info(path)
            self._set_aside(path, reason)
        return None

    def load(self, info: CheckpointInfo, tensors: dict[str, torch.Tensor]) -> None:
        """Load ``info`` into ``tensors`` in place; a collective, at any world size.

        State that a setting switched on since the save (the fp16 loss scaler of a job resumed
        with ``trainer.precision=fp16``) starts fresh; anything else the checkpoint lacks means
        it is another model or optimizer, and loading it would silently mix two runs.
        """
        missing = tensors.keys() - set(info.manifest.get("tensors", tensors))
        unknown = sorted(k for k in missing if not k.startswith(OPTIONAL_STATE))
        if unknown:
            raise ValueError(
                f"the checkpoint {info.url} has no {', '.join(unknown[:3])}"
                f"{f' (and {len(unknown) - 3} more)' if len(unknown) > 3 else ''}: it was saved "
                "by another model or optimizer. Fix: resume with the model and optim settings it "
                "was saved with, or start a new job (another job_id or checkpoint.url)"
            )
        if missing:
            log.info("%s: starting %s fresh", info.url, ", ".join(sorted(missing)))
        wanted = {k: v for k, v in tensors.items() if k not in missing}
        if info.manifest["format"] > 1:  # elastic.shard_io's layout
            dcp.load({ROOT: wanted}, storage_reader=ShardReader(info.url))
        else:  # DCP's own layout, written before ours
            dcp.load(wanted, checkpoint_id=info.url)

    def restore(self, tensors: dict[str, torch.Tensor]) -> CheckpointInfo | None:
        """Load the newest valid checkpoint into ``tensors``; a collective. Rank 0 lists the
        checkpoints, every rank verifies its share of each one's files until one passes on
        every rank, and every rank loads it."""
        rank, world = dist.get_rank(), dist.get_world_size()
        listing: list[Any] = [None]
        if rank == 0:
            listing[0] = self._candidates()
        with self._collective("checkpoint restore"):
            dist.broadcast_object_list(listing, src=0)
        info = None
        for path in listing[0]:
            reasons: list[Any] = [None] * world
            mine = self.verify(path, rank, world)
            with self._collective("checkpoint restore"):
                dist.all_gather_object(reasons, mine)
            reason = next((r for r in reasons if r is not None), None)
            if reason is None:
                info = self._info(path)
                break
            if rank == 0:
                self._set_aside(path, reason)
        if info is not None:
            t0 = time.perf_counter()
            with self._collective("checkpoint restore"):
                self.load(info, tensors)
            if self.events and rank == 0:
                self.events.emit(
                    ev.CHECKPOINT_LOADED,
                    step=info.step,
                    url=info.url,
                    saved_world_size=info.manifest["world_size"],
                    world_size=world,
                    seconds=time.perf_counter() - t0,
                )
        return info

    def verify(self, path: str, rank: int = 0, world: int = 1) -> str | None:
        """None if ``path`` has a manifest and rank ``rank``'s share (of ``world``) of the files
        it lists match it, else the reason a load refuses it (the whole folder by default)."""
        try:
            manifest = json.loads(self.fs.cat_file(f"{path}/{MANIFEST}"))
        except FileNotFoundError:
            return "incomplete"
        except ValueError:
            return "manifest unreadable"
        if manifest.get("format") not in FORMATS:
            return f"unknown format {manifest.get('format')!r}"
        for name in sorted(manifest["files"])[rank::world]:
            expected, file = manifest["files"][name], f"{path}/{name}"
            if not self.fs.exists(file):
                return f"{name} missing"
            try:
                record = file_record(self.fs, file, expected, torch.get_num_threads())
            except ValueError as exc:
                return f"{name}: {exc}"
            if {k: expected.get(k) for k in record} != record:
                return f"{name} does not match its checksum"
        return None

    def _info(self, path: str) -> CheckpointInfo:
        manifest = json.loads(self.fs.cat_file(f"{path}/{MANIFEST}"))
        return CheckpointInfo(self._url(path), manifest["step"], manifest)

    def _set_aside(self, path: str, reason: str) -> None:
        """Remove an interrupted save (no manifest); move a damaged checkpoint (files that do
        not match its manifest) aside as ``<folder>.corrupt`` for a person to look at."""
        if reason != "incomplete":  # file by file: object stores have no folder to move
            aside = f"{path}.corrupt"
            self.fs.makedirs(aside, exist_ok=True)
            for name in self._files(path) + [MANIFEST]:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.mv(f"{path}/{name}", f"{aside}/{name}")
        with contextlib.suppress(FileNotFoundError):  # an object store's folder went with them
            self.fs.rm(path, recursive=True)
        if self.events:
            self.events.emit(ev.CHECKPOINT_SKIPPED, url=self._url(path), reason=reason)

    # --- helpers -------------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        """Checkpoint folders, newest first (the layout is :mod:`elastic.manifest`'s)."""
        return candidates(self.fs, self.root)

    def _files(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)  # other processes wrote there
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(path, detail=False)]
        return sorted(n for n in names if n != MANIFEST and not n.endswith(".tmp"))

    def _url(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if "://" in path else f"{protocol}://{path}"
