"""Which checkpoint folders stay under a URL: the newest ``checkpoint.keep`` committed ones.

After each commit the older committed checkpoints past ``keep`` are pruned, and so are the
folders that failed or abandoned saves left (no manifest: no load takes them). A failed save
removes them at once too: their space may be what it lacked.
"""

from __future__ import annotations

import contextlib

from elastic.checkpoint_store import CheckpointStore
from elastic.manifest import folder


class Retention:
    """Keeps the newest ``keep`` committed checkpoints of ``store``, and removes stale folders.

    It keeps nothing uncommitted older than the save in progress."""

    def __init__(self, store: CheckpointStore, keep: int) -> None:
        self._store = store
        self._keep = keep

    def prune(self, step: int) -> None:
        """Keep the newest ``keep`` committed checkpoints, and remove abandoned folders.

        The abandoned folders removed are those older than ``step``'s."""
        committed = 0
        for path in self._store.folders():
            if self._store.has_manifest(path):
                committed += 1
                if committed > self._keep:
                    self._store.fs.rm(path, recursive=True)
        self._remove_abandoned(before=folder(self._store.root, step))

    def discard(self, path: str) -> None:
        """Remove what a failed save left (rank 0), and the abandoned folders before it.

        The abandoned folders are those that abandoned saves left (:meth:`_remove_abandoned`):
        their space may be what this save lacked. Left to the next prune, which only a save that
        commits runs, they kept a full store full for good (found by CI: a save abandoned by a
        round change wrote into the space just freed, and every later save failed)."""
        self._remove_abandoned(before=path)
        with contextlib.suppress(Exception):  # the store may be what failed
            self._store.fs.rm(path, recursive=True)

    def _remove_abandoned(self, before: str) -> None:
        """Remove the folders older than ``before`` that were never committed.

        Those are saves abandoned by a round change, or failed: no load takes them."""
        for path in self._uncommitted():
            if path < before:
                with contextlib.suppress(Exception):  # the store may be what failed
                    self._store.fs.rm(path, recursive=True)

    def _uncommitted(self) -> list[str]:
        """Checkpoint folders without a manifest (saves abandoned or failed), newest first."""
        with contextlib.suppress(Exception):
            return [p for p in self._store.folders() if not self._store.has_manifest(p)]
        return []
