"""Sharded checkpoints with torch.distributed.checkpoint (DCP) to any fsspec URL.

Layout: ``<url>/step_<step>/`` holds DCP's shard files (each rank writes its own; replicated DDP
tensors are de-duplicated across ranks by DCP's planner), DCP's ``.metadata``, and our
``manifest.json``. Rank 0 writes the manifest last, after DCP reports every rank's shard written:
it is the commit record. It lists every file with its size and sha256 and carries the training
progress as JSON.

Loading takes the newest checkpoint whose manifest exists and whose files all match it; a folder
without a manifest is an interrupted save and is removed, one whose files do not match is moved
aside as ``*.corrupt``. DCP's ``.metadata`` is a pickle, so verifying it against our own manifest
before DCP reads it is what keeps resume from unpickling anything we did not write. DCP reshards
on load, so a checkpoint written at one world size loads at any other.

A save that fails on this side of the network (disk full, permission lost, the store down) is
:class:`SaveFailed`: the half-written folder is removed, the newest good checkpoint stays, and
the caller trains on and tries again at the next interval. DCP reports such a failure on every
rank through a collective that completed, so the ranks agree on it. The collectives themselves run
under the communicator's ``collective`` guard, which records a broken round: a peer that dies
during a save is a peer failure, not a failed save.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic.events import EventLog
from elastic.manifest import FORMAT, MANIFEST, candidates

log = logging.getLogger(__name__)


# Runs a block of collectives of the current round (``Communicator.collective``).
Collective = Callable[[str], AbstractContextManager[None]]


def _no_guard(what: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class SaveFailed(Exception):
    """A checkpoint could not be written here; the round and the older checkpoints are intact."""

    def __init__(self, step: int, reason: str, fix: str) -> None:
        super().__init__(f"checkpoint of step {step} failed: {reason}. Fix: {fix}")
        self.step, self.reason, self.fix = step, reason, fix


def save_failure_fix(errors: list[BaseException]) -> str:
    """What an operator should do about a failed save, from the errors' errno (not their text)."""
    codes = {getattr(e, "errno", None) for e in errors}
    if codes & {errno.ENOSPC, errno.EDQUOT}:
        return "free space where checkpoint.url points, or lower checkpoint.keep"
    if codes & {errno.EACCES, errno.EPERM, errno.EROFS}:
        return "make checkpoint.url writable by the job's user, or point it elsewhere"
    return "check that checkpoint.url is reachable and writable from every node"


# Training state a checkpoint may lack and a resumed job starts fresh: the loss scaler exists
# only under trainer.precision=fp16.
OPTIONAL_STATE = ("scaler.",)


@dataclass(frozen=True)
class CheckpointInfo:
    url: str
    step: int
    manifest: dict[str, Any]


class CheckpointManager:
    """The checkpoints under one URL. ``collective`` guards the collectives of a save or a load
    (the worker passes ``Communicator.collective``)."""

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

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
        """Write a checkpoint; a collective, called by every rank with its state.

        Raises :class:`SaveFailed` when the bytes could not be written or committed (on every
        rank when DCP's write failed, on rank 0 alone when the manifest could not be written).
        """
        t0 = time.perf_counter()
        path = f"{self.root}/step_{step:09d}"
        try:
            with self._collective("checkpoint save"):
                dcp.save(tensors, checkpoint_id=self._url(path))
        except CheckpointException as exc:
            errors = [error for error, _ in exc.failures.values()]
            reason = "; ".join(
                f"rank {rank}: {type(error).__name__}: {error}"
                for rank, (error, _) in sorted(exc.failures.items())
            )
            self._discard(path)
            raise SaveFailed(step, reason, save_failure_fix(errors)) from None
        if dist.get_rank() == 0:
            try:
                files = {
                    name: {
                        "size": self.fs.size(f"{path}/{name}"),
                        "sha256": self._sha256(f"{path}/{name}"),
                    }
                    for name in self._files(path)
                }
                manifest = {
                    "format": FORMAT,
                    "step": step,
                    "saved_at": time.time(),
                    "files": files,
                    "world_size": dist.get_world_size(),
                    "tensors": sorted(tensors),
                    **meta,
                }
                self._write_json(f"{path}/{MANIFEST}", manifest)
            except Exception as exc:  # local I/O of any fsspec backend: the commit did not happen
                self._discard(path)
                reason = f"{type(exc).__name__}: {exc}"
                raise SaveFailed(step, reason, save_failure_fix([exc])) from exc
            try:
                self._prune()
            except Exception as exc:  # committed; an old folder stays until the next prune
                log.warning("could not remove old checkpoints under %s: %s", self.url, exc)
            if self.events:
                self.events.emit(
                    "checkpoint_saved",
                    step=step,
                    url=self._url(path),
                    seconds=time.perf_counter() - t0,
                    bytes=sum(f["size"] for f in files.values()),
                )
        return self._url(path)

    def _write_json(self, path: str, data: dict[str, Any]) -> None:
        tmp = path + ".tmp"
        with self.fs.open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        self.fs.mv(tmp, path)

    def _discard(self, path: str) -> None:
        """Remove what a failed save left (rank 0; every rank is past its writes by then)."""
        if dist.get_rank() == 0:
            with contextlib.suppress(Exception):  # the store may be what failed
                self.fs.rm(path, recursive=True)

    def _prune(self) -> None:
        committed = [c for c in self._candidates() if self.fs.exists(f"{c}/{MANIFEST}")]
        for old in committed[self.keep :]:
            self.fs.rm(old, recursive=True)

    # --- loading -------------------------------------------------------------------------------

    def newest_valid(self) -> CheckpointInfo | None:
        """The newest complete, verified checkpoint; cleans up the ones that are not."""
        for path in self._candidates():
            reason = self._verify(path)
            if reason is None:
                manifest = json.loads(self.fs.cat_file(f"{path}/{MANIFEST}"))
                return CheckpointInfo(self._url(path), manifest["step"], manifest)
            if reason == "incomplete":
                self.fs.rm(path, recursive=True)
            else:
                self.fs.mv(path, path + ".corrupt", recursive=True)
            if self.events:
                self.events.emit("checkpoint_skipped", url=self._url(path), reason=reason)
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
        dcp.load({k: v for k, v in tensors.items() if k not in missing}, checkpoint_id=info.url)

    def restore(self, tensors: dict[str, torch.Tensor]) -> CheckpointInfo | None:
        """Rank 0 picks the newest valid checkpoint, every rank loads it. A collective."""
        choice: list[CheckpointInfo | None] = [None]
        if dist.get_rank() == 0:
            choice[0] = self.newest_valid()
        with self._collective("checkpoint restore"):
            dist.broadcast_object_list(choice, src=0)
        info = choice[0]
        if info is not None:
            t0 = time.perf_counter()
            with self._collective("checkpoint restore"):
                self.load(info, tensors)
            if self.events and dist.get_rank() == 0:
                self.events.emit(
                    "checkpoint_loaded",
                    step=info.step,
                    url=info.url,
                    saved_world_size=info.manifest["world_size"],
                    world_size=dist.get_world_size(),
                    seconds=time.perf_counter() - t0,
                )
        return info

    def _verify(self, path: str) -> str | None:
        """None if ``path`` is a complete checkpoint matching its manifest, else the reason."""
        try:
            manifest = json.loads(self.fs.cat_file(f"{path}/{MANIFEST}"))
        except FileNotFoundError:
            return "incomplete"
        except ValueError:
            return "manifest unreadable"
        if manifest.get("format") != FORMAT:
            return f"unknown format {manifest.get('format')!r}"
        for name, expected in manifest["files"].items():
            file = f"{path}/{name}"
            if not self.fs.exists(file):
                return f"{name} missing"
            if self.fs.size(file) != expected["size"] or self._sha256(file) != expected["sha256"]:
                return f"{name} does not match its checksum"
        return None

    # --- helpers -------------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        """Checkpoint folders, newest first (the layout is :mod:`elastic.manifest`'s)."""
        return candidates(self.fs, self.root)

    def _files(self, path: str) -> list[str]:
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(path, detail=False)]
        return sorted(n for n in names if n != MANIFEST and not n.endswith(".tmp"))

    def _sha256(self, path: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        return digest.hexdigest()

    def _url(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if "://" in path else f"{protocol}://{path}"
