"""Checkpoint folders and their commit records (``manifest.json``), read without torch.

A checkpoint is ``<url>/step_<9 digits>/`` and is committed once its ``manifest.json`` exists: a
JSON object with the ``format``, the ``step`` and ``files: {name: record}``, where a file's
record is its ``size`` and its digest (:class:`PieceDigest`; :mod:`elastic.checkpoint_save`
writes the manifest, :mod:`elastic.checkpoint_verify` verifies it). The layout lives here, with
fsspec, hashlib and json only, because more than the trainer reads it: a node's health check
sizes the disk it needs from the newest manifest, and importing torch for that would cost the
agent and the doctor seconds at start-up.
"""

from __future__ import annotations

import hashlib
import json
import queue
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from elastic.sched_policy import helper_thread

MANIFEST = "manifest.json"
FORMAT = 3  # the shards in elastic.shard_io's layout, files hashed in pieces
# What loads: 1 is DCP's own layout, and 2 ours; both hashed each file whole (``sha256``).
FORMATS = (1, 2, 3)
PREFIX = "step_"

PIECE_BYTES = 4 << 20
_READ_AHEAD = 2  # pieces read per hashing thread before it hashes them, when verifying


class PieceDigest:
    """A file's record, ``{"size", "pieces_sha256", "piece_bytes"}``, hashed in pieces on threads.

    Its digest is the sha256 of the sha256 digests of its ``piece_bytes`` pieces in order. The
    pieces are hashed on ``threads`` threads of their own while the caller writes (or reads) the
    same bytes.

    Why pieces: one sha256 runs on one core at about 1.8 GB/s here, so hashing a 205 MB shard
    took 0.115 s, longer than ``dd`` took to write it (``bench/checkpoint.py``); in pieces, as
    many cores hash as the process may use (a worker's share of its node's, ``threads``). Why
    threads: hashlib releases the GIL on large buffers. The buffers handed to :meth:`update` must
    stay unchanged until the ``with`` block ends; a piece spanning several buffers is hashed by
    one thread, in order.

    ``backlog``, the buffers that may wait for each thread, bounds the memory of a caller that
    reads a file to hash it. 0, no bound, is for a writer, whose buffers are its own memory: it
    then never waits for the hash, and its fsync and the hash overlap (bounded, the write of the
    ResNet-50 state took twice as long).
    """

    def __init__(self, threads: int, piece_bytes: int = PIECE_BYTES, backlog: int = 0) -> None:
        self.piece_bytes = piece_bytes
        self._queues: list[queue.Queue[tuple[int, memoryview, bool] | None]] = [
            queue.Queue(backlog) for _ in range(threads)
        ]
        self._threads = [
            helper_thread(self._run, f"sha256-{i}", (q,)) for i, q in enumerate(self._queues)
        ]
        self._digests: dict[int, bytes] = {}
        self._size = 0

    def __enter__(self) -> PieceDigest:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._size % self.piece_bytes:  # the last piece is short: it ends here
            piece = self._size // self.piece_bytes
            self._queues[piece % len(self._queues)].put((piece, memoryview(b""), True))
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self, pieces: queue.Queue[tuple[int, memoryview, bool] | None]) -> None:
        sha256 = hashlib.sha256()
        while (item := pieces.get()) is not None:
            piece, buffer, last = item
            sha256.update(buffer)
            if last:
                self._digests[piece] = sha256.digest()
                sha256 = hashlib.sha256()

    def update(self, buffer: memoryview) -> None:
        """Hash ``buffer``, the next bytes of the file."""
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        while view.nbytes:
            piece, offset = divmod(self._size, self.piece_bytes)
            take = min(view.nbytes, self.piece_bytes - offset)
            last = offset + take == self.piece_bytes
            self._queues[piece % len(self._queues)].put((piece, view[:take], last))
            self._size += take
            view = view[take:]

    def record(self) -> dict[str, Any]:
        """The file's record (after the ``with`` block)."""
        pieces = b"".join(self._digests[i] for i in range(len(self._digests)))
        return {
            "size": self._size,
            "pieces_sha256": hashlib.sha256(pieces).hexdigest(),
            "piece_bytes": self.piece_bytes,
        }


def file_record(
    fs: AbstractFileSystem, path: str, like: dict[str, Any] | None = None, threads: int = 1
) -> dict[str, Any]:
    """A file's record from one read of it, in the form of ``like`` (a record to check it against).

    The file is hashed whole (``sha256``, manifest formats 1 and 2) or in pieces (the default),
    on ``threads`` threads."""
    if like is not None and "sha256" in like:
        digest, size = hashlib.sha256(), 0
        with fs.open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
                size += len(chunk)
        return {"size": size, "sha256": digest.hexdigest()}
    piece_bytes = like.get("piece_bytes") if like is not None else PIECE_BYTES
    if not isinstance(piece_bytes, int) or piece_bytes <= 0:
        raise ValueError(f"{path}: the record's piece_bytes is {piece_bytes!r}, not a size")
    with fs.open(path, "rb") as f, PieceDigest(threads, piece_bytes, _READ_AHEAD) as pieces:
        while chunk := f.read(piece_bytes):
            pieces.update(memoryview(chunk))
    return pieces.record()


def folder(root: str, step: int) -> str:
    """The folder of the checkpoint of ``step`` under ``root``."""
    return f"{root}/{PREFIX}{step:09d}"


def candidates(fs: AbstractFileSystem, root: str) -> list[str]:
    """Checkpoint folders under ``root``, newest first, committed or not.

    ``*.corrupt`` folders (moved aside by the loader) are not among them."""
    fs.invalidate_cache(root)  # other processes write there (an object store's listing is cached)
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
    steps = sorted(
        (n for n in names if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit()), reverse=True
    )
    return [f"{root}/{n}" for n in steps]


def committed(url: str) -> Iterator[dict[str, Any]]:
    """The manifests of the committed checkpoints at ``url``, newest first.

    The files are not verified against them (hashing a checkpoint takes as long as reading it):
    this is for knowing what the checkpoints are like, not for loading one. Folders without a
    readable manifest with a ``files`` table (interrupted saves) are passed over.
    """
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    for path in candidates(fs, root):
        try:
            manifest = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
        except (OSError, ValueError):
            continue
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if isinstance(files, dict) and all(
            isinstance(f, dict) and isinstance(f.get("size"), int) for f in files.values()
        ):
            yield manifest


def newest_manifest(url: str) -> dict[str, Any] | None:
    """The manifest of the newest committed checkpoint at ``url``, or None when there is none."""
    return next(committed(url), None)


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """The size of the checkpoint a manifest commits: the sum of its files' sizes."""
    return sum(int(f["size"]) for f in manifest["files"].values())
