"""Whether a checkpoint folder may be loaded: it has a manifest, and every file it lists matches.

DCP's ``.metadata`` is a pickle: verifying it against our own manifest first keeps a load from
unpickling anything we did not write. A folder that fails is set aside, so no later load reads
it again: an interrupted save is removed, a damaged checkpoint moved aside for a person to look
at. The ranks of a job share the reading (each verifies its share of the files).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from elastic import event_types as ev
from elastic.checkpoint_store import CheckpointStore
from elastic.events import EventLog
from elastic.manifest import FORMATS, MANIFEST, file_record


@dataclass(frozen=True)
class CheckpointInfo:
    url: str
    step: int
    manifest: dict[str, Any]


class Verifier:
    """Verifies the folders of ``store``.

    Each one set aside is a ``checkpoint_skipped`` event in ``events``."""

    def __init__(self, store: CheckpointStore, events: EventLog | None = None) -> None:
        self._store, self._events = store, events

    def verify(self, path: str, rank: int = 0, world: int = 1) -> str | None:
        """The reason a load refuses ``path``, or None if its files match its manifest.

        None if ``path`` has a manifest and rank ``rank``'s share (of ``world``) of the files it
        lists match it (the whole folder by default)."""
        fs = self._store.fs
        try:
            manifest = self._store.manifest(path)
        except FileNotFoundError:
            return "incomplete"
        except ValueError:
            return "manifest unreadable"
        if manifest.get("format") not in FORMATS:
            return f"unknown format {manifest.get('format')!r}"
        for name in sorted(manifest["files"])[rank::world]:
            expected, file = manifest["files"][name], f"{path}/{name}"
            if not fs.exists(file):
                return f"{name} missing"
            try:
                record = file_record(fs, file, expected, torch.get_num_threads())
            except ValueError as exc:
                return f"{name}: {exc}"
            if {k: expected.get(k) for k in record} != record:
                return f"{name} does not match its checksum"
        return None

    def info(self, path: str) -> CheckpointInfo:
        """The checkpoint in the folder ``path``, as its manifest describes it."""
        manifest = self._store.manifest(path)
        return CheckpointInfo(self._store.url_of(path), manifest["step"], manifest)

    def set_aside(self, path: str, reason: str) -> None:
        """Remove an interrupted save, or move a damaged checkpoint aside.

        An interrupted save has no manifest. A damaged checkpoint (files that do not match its
        manifest) moves aside as ``<folder>.corrupt`` for a person to look at."""
        fs = self._store.fs
        if reason != "incomplete":  # file by file: object stores have no folder to move
            aside = f"{path}.corrupt"
            fs.makedirs(aside, exist_ok=True)
            for name in self._store.files(path) + [MANIFEST]:
                with contextlib.suppress(FileNotFoundError):
                    fs.mv(f"{path}/{name}", f"{aside}/{name}")
        with contextlib.suppress(FileNotFoundError):  # an object store's folder went with them
            fs.rm(path, recursive=True)
        if self._events:
            self._events.emit(ev.CHECKPOINT_SKIPPED, url=self._store.url_of(path), reason=reason)
