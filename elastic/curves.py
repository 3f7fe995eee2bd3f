"""TensorBoard curves of a run: rank 0's events as scalars under ``<run_dir>/tensorboard/``.

Every figure worth a curve (loss, LR, samples/s, world size, evaluations, each recovery's
breakdown, each checkpoint, each rollback or skipped step) is already an event of the worker
(:mod:`elastic.event_types`), so the curves are drawn from those records: nothing is measured
twice, and the curves cannot disagree with the event files. :func:`scalars` maps one event to
its scalars (pure); :class:`Curves` hangs on the event log's ``sink`` while this worker holds
global rank 0, and writes them with ``torch.utils.tensorboard`` on a thread of its own: the
workers' protobuf runs in Python (the agent's etcd client needs it so), where a scalar costs
about 0.4 ms, which the training thread must not pay. ``tensorboard`` is an optional package:
without it the curves are off (a ``curves_off`` event says so) and the run is otherwise the same.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elastic import event_types as ev
from elastic.events import EventLog
from elastic.sched_policy import helper_thread

Scalar = tuple[str, float, int]  # (tag, value, global step)

TENSORBOARD_DIR = "tensorboard"  # under the run directory
FLUSH_S = 10.0  # the writer's file is flushed this often: a killed worker loses no more
CLOSE_WAIT_S = 5.0  # at the end, how long the last scalars may take to reach the file


def _step(e: Mapping[str, Any]) -> list[Scalar]:
    figures = [
        ("train/loss", e["loss"]),
        ("train/lr", e["lr"]),
        ("train/samples_per_s", e["samples_per_s"]),
        ("train/world_size", e["world_size"]),
    ]
    if e.get("loss_scale") is not None:  # fp16
        figures.append(("train/loss_scale", e["loss_scale"]))
    figures += [(f"train/{name}", value) for name, value in e.get("metrics", {}).items()]
    return [(tag, float(value), e["step"]) for tag, value in figures]


def _recovered(e: Mapping[str, Any]) -> list[Scalar]:
    stall = e["first_step_at"] - e["interrupted_at"]
    parts = [(f"recovery/{key}", e[key]) for key in ("rendezvous_s", "rebuild_s", "sync_s")]
    figures = [("recovery/stall_s", stall), *parts, ("recovery/first_step_s", e["first_step_s"])]
    return [(tag, float(value), e["step"]) for tag, value in figures]


def _rolled_back(e: Mapping[str, Any]) -> list[Scalar]:
    lost = e["step"] - e["to_step"] if e["to_step"] is not None else 0  # None: no checkpoint
    return [("faults/rollback_steps_lost", float(lost), e["step"])]


SCALARS: dict[str, Callable[[Mapping[str, Any]], list[Scalar]]] = {
    ev.STEP.name: _step,
    ev.TRAINING_STARTED.name: lambda e: [("train/world_size", float(e["world_size"]), e["step"])],
    ev.EVALUATED.name: lambda e: [
        (f"eval/{key}", float(e[key]), e["step"]) for key in ("top1", "top5", "loss")
    ],
    ev.RECOVERED.name: _recovered,
    ev.CHECKPOINT_SAVED.name: lambda e: [
        (f"checkpoint/{key}", float(e[key]), e["step"]) for key in ("seconds", "stall_s", "bytes")
    ],
    ev.CHECKPOINT_FAILED.name: lambda e: [("checkpoint/failed", 1.0, e["step"])],
    ev.ROLLED_BACK.name: _rolled_back,
    ev.STEP_NONFINITE.name: lambda e: [("faults/nonfinite_streak", float(e["streak"]), e["step"])],
    ev.STEP_SKIPPED.name: lambda e: [("faults/fp16_skipped_scale", float(e["scale"]), e["step"])],
}


def scalars(event: Mapping[str, Any]) -> list[Scalar]:
    """The scalars of one event, ``(tag, value, global step)``; none for an event without a curve.

    Accuracies are fractions, as in the event; a rollback's value is the steps it threw away, a
    run of non-finite steps its length so far, an fp16 skip the loss scale after it."""
    mapping = SCALARS.get(event.get("event", ""))
    return mapping(event) if mapping else []


def summary_writer() -> type | None:
    """``torch.utils.tensorboard.SummaryWriter``, or None when ``tensorboard`` is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class Curves:
    """Writes :func:`scalars` of the events this worker appends while it holds global rank 0.

    :meth:`follow` is told the worker's rank at every round: at rank 0 the sink is attached and a
    writer thread started (its own event file under ``log_dir``); at any other rank the sink is
    detached and the thread closes its file, so a worker that stops being rank 0 stops writing.
    ``enabled``: ``trainer.tensorboard``; ``tensorboard`` is imported here, at the worker's
    start, so that no round pays for it.
    """

    def __init__(self, events: EventLog, run_dir: str | os.PathLike[str], enabled: bool) -> None:
        self._events = events
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._writer_class = summary_writer() if enabled else None
        self._missing = enabled and self._writer_class is None  # said once, at rank 0
        self._queue: queue.SimpleQueue[Mapping[str, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the writer thread detaches the sink when it fails

    def follow(self, rank: int) -> None:
        """This worker's global rank in the round it enters (-1: none, at the end)."""
        if rank == 0 and self._missing:
            self._missing = False
            self._events.emit(
                ev.CURVES_OFF,
                "TensorBoard curves are off: the tensorboard package is not installed "
                "(pip install '.[tensorboard]')",
                reason="tensorboard is not installed",
            )
        with self._lock:
            if rank == 0 and self._queue is None and self._writer_class is not None:
                self._queue = queue.SimpleQueue()
                self._thread = helper_thread(self._write, "curves", (self._queue,))
                self._thread.start()
                self._events.sink = self._queue.put
            elif rank != 0 and self._queue is not None:
                self._queue.put(None)
                self._detach(self._queue)

    def close(self) -> None:
        """Stop writing and wait (at most :data:`CLOSE_WAIT_S`) for the file to be closed."""
        thread = self._thread
        self.follow(-1)
        if thread is not None:
            thread.join(CLOSE_WAIT_S)

    def _detach(self, records: queue.SimpleQueue[Mapping[str, Any] | None]) -> None:
        """Take the sink off the event log, if ``records`` is still the one it feeds."""
        if self._queue is records:
            self._events.sink = None
            self._queue = None

    def _write(self, records: queue.SimpleQueue[Mapping[str, Any] | None]) -> None:
        """The writer thread of one stretch at rank 0: until it is given None."""
        assert self._writer_class is not None
        try:
            writer = self._writer_class(log_dir=str(self.log_dir), flush_secs=FLUSH_S)
            try:
                while (record := records.get()) is not None:
                    for tag, value, step in scalars(record):
                        writer.add_scalar(tag, value, step, walltime=record["ts"])
            finally:
                writer.close()
        except Exception as exc:  # a full or lost disk: the curves stop, training goes on
            with self._lock:
                self._detach(records)  # the next round at rank 0 tries again
            self._events.emit(
                ev.CURVES_OFF,
                f"TensorBoard curves stopped: {type(exc).__name__}: {exc}",
                reason=f"writing {self.log_dir} failed: {type(exc).__name__}: {exc}"[:500],
            )
