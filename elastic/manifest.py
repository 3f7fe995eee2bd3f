"""Checkpoint folders and their commit records (``manifest.json``), read without torch.

A checkpoint is ``<url>/step_<9 digits>/`` and is committed once its ``manifest.json`` exists: a
JSON object with the ``format``, the ``step`` and ``files: {name: {size, sha256}}``
(:mod:`elastic.checkpoint` writes and verifies it). The layout lives here, with fsspec and json
only, because more than the trainer reads it: a node's health check sizes the disk it needs from
the newest manifest, and importing torch for that would cost the agent and the doctor seconds at
start-up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

MANIFEST = "manifest.json"
FORMAT = 2  # the shards in elastic.shard_io's layout
FORMATS = (1, 2)  # what loads: 1 is DCP's own layout, written before
PREFIX = "step_"


def folder(root: str, step: int) -> str:
    """The folder of the checkpoint of ``step`` under ``root``."""
    return f"{root}/{PREFIX}{step:09d}"


def candidates(fs: AbstractFileSystem, root: str) -> list[str]:
    """Checkpoint folders under ``root``, newest first, committed or not; ``*.corrupt`` folders
    (moved aside by the loader) are not among them."""
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
