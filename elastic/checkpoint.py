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
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic.events import EventLog

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1


@dataclass(frozen=True)
class CheckpointInfo:
    url: str
    step: int
    manifest: dict[str, Any]


class CheckpointManager:
    def __init__(self, url: str, keep: int, events: EventLog | None = None) -> None:
        self.url = url.rstrip("/")
        self.keep = keep
        self.events = events
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
        """Write a checkpoint; a collective, called by every rank with its state."""
        t0 = time.perf_counter()
        path = f"{self.root}/step_{step:09d}"
        dcp.save(tensors, checkpoint_id=self._url(path))
        if dist.get_rank() == 0:
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
                **meta,
            }
            self._write_json(f"{path}/{MANIFEST}", manifest)
            self._prune()
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
        """Load ``info`` into ``tensors`` in place; a collective, at any world size."""
        dcp.load(tensors, checkpoint_id=info.url)

    def restore(self, tensors: dict[str, torch.Tensor]) -> CheckpointInfo | None:
        """Rank 0 picks the newest valid checkpoint, every rank loads it. A collective."""
        choice: list[CheckpointInfo | None] = [None]
        if dist.get_rank() == 0:
            choice[0] = self.newest_valid()
        dist.broadcast_object_list(choice, src=0)
        info = choice[0]
        if info is not None:
            t0 = time.perf_counter()
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
        """Checkpoint folders, newest first."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        steps = sorted(
            (n for n in names if n.startswith("step_") and n[5:].isdigit()), reverse=True
        )
        return [f"{self.root}/{n}" for n in steps]

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
