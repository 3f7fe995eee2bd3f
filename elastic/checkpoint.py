"""Sharded checkpoints with DCP to any fsspec URL: the one object a worker holds, and the load.

DCP is torch.distributed.checkpoint. ``<url>/step_<step>/`` holds one shard file per rank (laid
out by :mod:`elastic.shard_io`), DCP's ``.metadata``, and ``manifest.json``, the commit record
that rank 0 writes last (:mod:`elastic.manifest`). DCP writes a replicated tensor once and
reshards on load, so a checkpoint loads at any world size. A load takes the newest checkpoint
whose files all match its manifest (:mod:`elastic.checkpoint_verify`), and sets aside the ones
that do not. The save path is :mod:`elastic.checkpoint_save`; which folders stay,
:mod:`elastic.checkpoint_retention`; the folders as files, :mod:`elastic.checkpoint_store`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic import event_types as ev
from elastic.checkpoint_retention import Retention
from elastic.checkpoint_save import ROOT, CheckpointWriter, Saved
from elastic.checkpoint_store import CheckpointStore
from elastic.checkpoint_verify import CheckpointInfo, Verifier
from elastic.events import EventLog
from elastic.manifest import folder
from elastic.shard_io import ShardReader

log = logging.getLogger(__name__)


# Runs a block of collectives of the current round (``Communicator.collective``).
Collective = Callable[[str], AbstractContextManager[None]]


def _no_guard(what: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


# Training state a checkpoint may lack and a resumed job starts fresh: the loss scaler exists
# only under trainer.precision=fp16.
OPTIONAL_STATE = ("scaler.",)


class CheckpointManager:
    """The checkpoints under one URL: the one object a worker holds for them.

    ``collective`` guards the collectives of a load (the worker passes
    ``Communicator.collective``). A save runs on a group of its own, in the background
    (:class:`elastic.async_checkpoint.BackgroundSaver`, through :attr:`writer`), and its failures
    are the save's, never the round's."""

    def __init__(
        self,
        url: str,
        keep: int,
        events: EventLog | None = None,
        collective: Collective = _no_guard,
    ) -> None:
        self.store = CheckpointStore(url)
        self.url = self.store.url
        self.events = events
        self._collective = collective
        self.writer = CheckpointWriter(self.store, Retention(self.store, keep))
        self.verifier = Verifier(self.store, events)

    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        group: dist.ProcessGroup | None = None,
    ) -> Saved | None:
        """Write and commit the checkpoint of ``step`` in the foreground; a collective.

        :meth:`CheckpointWriter.write` then :meth:`CheckpointWriter.commit`, a collective of
        ``group`` (the default group when None). Returns what was committed on rank 0, None on
        the others."""
        written = self.writer.write(step, tensors, group)
        return self.writer.commit(written, meta) if dist.get_rank(group) == 0 else None

    def committed(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is committed, as rank 0 finds it; a collective.

        A collective so that every rank takes the same answer while an older round's commit may
        land."""
        found: list[Any] = [None]
        if dist.get_rank() == 0:
            found[0] = self.store.has_manifest(folder(self.store.root, step))
        with self._collective("checkpoint lookup"):
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def newest_valid(self) -> CheckpointInfo | None:
        """The newest complete, verified checkpoint; cleans up the ones that are not.

        One process reads every file (the health check, the tools); a job's ranks share the work
        in :meth:`restore`."""
        for path in self.store.folders():
            reason = self.verifier.verify(path)
            if reason is None:
                return self.verifier.info(path)
            self.verifier.set_aside(path, reason)
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
        """Load the newest valid checkpoint into ``tensors``; a collective.

        Rank 0 lists the checkpoints, every rank verifies its share of each one's files until one
        passes on every rank, and every rank loads it."""
        rank, world = dist.get_rank(), dist.get_world_size()
        listing: list[Any] = [None]
        if rank == 0:
            listing[0] = self.store.folders()
        with self._collective("checkpoint restore"):
            dist.broadcast_object_list(listing, src=0)
        info = None
        for path in listing[0]:
            reasons: list[Any] = [None] * world
            mine = self.verifier.verify(path, rank, world)
            with self._collective("checkpoint restore"):
                dist.all_gather_object(reasons, mine)
            reason = next((r for r in reasons if r is not None), None)
            if reason is None:
                info = self.verifier.info(path)
                break
            if rank == 0:
                self.verifier.set_aside(path, reason)
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
