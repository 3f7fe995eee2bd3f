"""The checkpoint folders under one URL, as files: listed, read, and a manifest put in place.

Any fsspec URL (a local folder, an object store); the layout of the folders is
:mod:`elastic.manifest`'s. This knows only the files: what is written into a folder
(:mod:`elastic.checkpoint_save`), which folders stay (:mod:`elastic.checkpoint_retention`) and
which may be loaded (:mod:`elastic.checkpoint_verify`) are decided by the modules that use it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic.manifest import MANIFEST, candidates


def _fsync_dir(path: str) -> None:
    """Make a local folder's entries durable (its files' names, a rename into it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """The checkpoint folders under ``url`` (made if absent).

    ``fs`` and ``root`` are fsspec's file system and the path on it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    def folders(self) -> list[str]:
        """Checkpoint folders, newest first (the layout is :mod:`elastic.manifest`'s)."""
        return candidates(self.fs, self.root)

    def files(self, path: str) -> list[str]:
        """The names of the files in the folder ``path``.

        Its manifest and temporary files are left out."""
        self.fs.invalidate_cache(path)  # other processes wrote there
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(path, detail=False)]
        return sorted(n for n in names if n != MANIFEST and not n.endswith(".tmp"))

    def url_of(self, path: str) -> str:
        """The URL of ``path``, a path on :attr:`fs`."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if "://" in path else f"{protocol}://{path}"

    def has_manifest(self, path: str) -> bool:
        """Whether the folder ``path`` is committed (its manifest is in place)."""
        return bool(self.fs.exists(f"{path}/{MANIFEST}"))

    def manifest(self, path: str) -> dict[str, Any]:
        """The manifest of the folder ``path``.

        FileNotFoundError without one, ValueError for one that is not JSON."""
        manifest: dict[str, Any] = json.loads(self.fs.cat_file(f"{path}/{MANIFEST}"))
        return manifest

    def put_manifest(self, path: str, manifest: dict[str, Any]) -> None:
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

    def free_bytes(self) -> int | None:
        """The space left where the checkpoints go, on a local file system (None elsewhere)."""
        if not isinstance(self.fs, LocalFileSystem):
            return None
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None
