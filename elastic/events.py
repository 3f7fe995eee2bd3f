"""Structured JSON events, one file per node under ``<run_dir>/events/``.

Agents and workers append one JSON object per line with a wall-clock timestamp. Recovery is
measured from these files (fault to first step after), the chaos tests judge runs by them, and the
launcher's progress display follows them. Each line is written with a single ``write`` on a file
opened with ``O_APPEND``, so the agent and its workers can share a node's file without
interleaving; one file per node keeps bare-metal nodes from ever writing the same file.

A fact that a person should also read in the process's log is written by one call,
``emit(event, message, level=...)``, which appends the event and logs the message: the log line
and the event can never disagree or be written twice by hand.

**Rotation.** A run of days must not grow one file without end, so a node's file past
``trainer.events_rotate_mb`` is renamed ``<node>.jsonl.<n>`` (``n`` counting up from 1) and a
new ``<node>.jsonl`` started. ``*.jsonl`` thus still names one current file per
node, and :func:`event_files` lists a node's rotated files, oldest first, before it: every reader
here (:func:`read_events`, :class:`EventFollower`) goes through it. Several processes append to
one file, so the writer that finds the file full renames it under an ``flock`` on the file
itself (one renamer per file), and every writer, before each line, compares its descriptor's
inode with the path's and reopens the path when they differ: a line goes whole into one file or
the next, never lost, in each writer's order. ``trainer.events_keep`` rotated files are kept per
node, 0 (the default) keeping them all: the invariant checker, ``curves.png`` and the goodput
verdict read the whole log, and a week at 1 step/s writes about 175 MB of it on rank 0's node,
little next to the checkpoints (docs/operations.md, "Disk use"); a bound is there for runs that
log far more (``trainer.record_samples``).
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.event_types import EventType, declared

MB = 1 << 20


def events_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "events"


@dataclass(frozen=True)
class Rotation:
    """When a node's event file is rotated and how many rotated files it keeps."""

    max_bytes: int  # a file at least this large is renamed before the next line
    keep: int = 0  # rotated files kept per node, the oldest deleted first; 0: every one

    @classmethod
    def of_mb(cls, mb: float, keep: int) -> Rotation:
        """From ``trainer.events_rotate_mb`` and ``trainer.events_keep``."""
        return cls(max(1, int(mb * MB)), keep)


def rotation_number(path: Path) -> int | None:
    """``n`` of a rotated file ``<node>.jsonl.<n>``; None for anything else."""
    stem, _, n = path.name.rpartition(".")
    return int(n) if stem.endswith(".jsonl") and n.isdigit() else None


def event_files(run_dir: str | os.PathLike[str], pattern: str = "*.jsonl") -> list[Path]:
    """The event files of the nodes whose current file ``pattern`` names, in writing order.

    That is the order their lines were written: each node's rotated files, oldest first, then
    its current file.

    A node's rotated files are listed even while it has no current file (between a rotation and
    the next line)."""
    folder = events_dir(run_dir)
    rotated = [p for p in folder.glob(f"{pattern}.*") if rotation_number(p) is not None]

    def order(path: Path) -> tuple[str, float]:
        n = rotation_number(path)
        return (path.name, math.inf) if n is None else (path.name.rpartition(".")[0], n)

    return sorted([*rotated, *folder.glob(pattern)], key=order)


class EventLog:
    """Appends events for one process; ``fields`` given here go into every event.

    ``logger``: where the messages of :meth:`emit` are logged (the owning module's logger).
    ``rotation``: when this writer rotates the file; without one it never does, but still follows
    the rotations of the node's other writers (a short-lived writer such as a fault helper's).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        node_id: str,
        logger: logging.Logger | None = None,
        *,
        rotation: Rotation | None = None,
        **fields: Any,
    ) -> None:
        self._log = logger or logging.getLogger(__name__)
        path = events_dir(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{node_id}.jsonl"
        self._rotation = rotation
        # The agent's threads emit concurrently; the descriptor is replaced on a rotation.
        self._lock = threading.Lock()
        self._fd = self._open()
        self._fields = {"node": node_id, "host": socket.gethostname(), "pid": os.getpid(), **fields}
        # Given every event this process appends, after it is written (rank 0's TensorBoard
        # curves, elastic/curves.py); it must return at once and never raise.
        self.sink: Callable[[dict[str, Any]], None] | None = None

    def update(self, **fields: Any) -> None:
        """Change fields that go into every later event (a worker's rank and round)."""
        self._fields.update(fields)

    def emit(
        self,
        event: EventType | str,
        message: str | None = None,
        /,
        *,
        level: int = logging.INFO,
        **fields: Any,
    ) -> dict[str, Any]:
        """Append one event of a declared type; with ``message``, also log that line at ``level``.

        Types are declared in :mod:`elastic.event_types`; a name declared nowhere raises
        :class:`~elastic.event_types.UndeclaredEvent`."""
        name = event.name if isinstance(event, EventType) else declared(event).name
        record = {"ts": time.time(), "event": name, **self._fields, **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._follow_rotation()
            os.write(self._fd, line)
        if self.sink is not None:
            self.sink(record)
        if message is not None:
            self._log.log(level, "%s", message)
        return record

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _follow_rotation(self) -> None:
        """Before a line: rotate a full file, and follow another writer's rotation.

        Rotate the file when it is full, and write to the path's file when another writer
        rotated it. Two ``stat`` calls a line (about 4 us)."""
        mine = os.fstat(self._fd)
        if self._rotation is not None and mine.st_size >= self._rotation.max_bytes:
            self._rotate(mine, self._rotation)
        elif _inode(self.path) == (mine.st_dev, mine.st_ino):
            return
        try:
            fd, self._fd = self._fd, self._open()
        except FileNotFoundError:  # the run's folder was deleted under this process: write on
            return
        os.close(fd)

    def _rotate(self, mine: os.stat_result, rotation: Rotation) -> None:
        """Rename the full file, unless another writer of it has already.

        The ``flock`` on the file makes its writers take turns, and only the one that still finds
        it at the path renames it (after which the path names another file)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if _inode(self.path) != (mine.st_dev, mine.st_ino):
                return
            rotated = sorted(
                (n, p)
                for p in event_files(self.path.parent.parent, glob.escape(self.path.name))
                if (n := rotation_number(p)) is not None
            )
            newest = rotated[-1][0] if rotated else 0
            os.rename(self.path, self.path.with_name(f"{self.path.name}.{newest + 1}"))
            if rotation.keep:
                for _, old in rotated[: max(0, len(rotated) + 1 - rotation.keep)]:
                    old.unlink(missing_ok=True)
            self._log.info(
                "%s rotated at %.1f MB (trainer.events_rotate_mb), as %s.%d",
                self.path,
                mine.st_size / MB,
                self.path.name,
                newest + 1,
            )
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a run, all nodes and their rotated files merged, in timestamp order.

    A line cut short by a process killed mid-write is skipped: the fault injectors do kill
    processes at arbitrary points, and one torn line must not hide the rest of the log.
    """
    follower = EventFollower(run_dir)
    # The second pass reads a file renamed between the first's listing and its opening the path.
    records = follower.poll() + follower.poll()
    records.sort(key=lambda r: r["ts"])
    return records


def _parse(lines: list[bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            yield json.loads(line.decode(errors="replace"))
        except json.JSONDecodeError:
            continue


@dataclass
class _Cursor:
    """How far one file (an inode: a rotation renames it, the cursor stays) has been read."""

    offset: int = 0
    partial: bytes = b""  # a line still being written
    missed: bool = False  # absent from the last listing


class RunEnded(Exception):
    """:meth:`EventFollower.wait_for`: the run's writers ended before the awaited event."""


class EventFollower:
    """Reads the events appended since the last call, across all node files of a run.

    With ``only_new``, what the files hold already is skipped: a launcher started again on the
    same run directory shows this run's events, not the earlier runs' replayed as new.
    ``pattern`` picks the nodes (``<node>.jsonl``: one node's), rotated files included.

    Files are followed by inode, not name, so a file renamed by a rotation goes on from where
    it was read. An inode the file system hands to a new file after the old one was deleted
    (``trainer.events_keep``) is told apart by its size, smaller than what was read of the old.
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], only_new: bool = False, pattern: str = "*.jsonl"
    ) -> None:
        self._run_dir = run_dir
        self._pattern = pattern
        self._cursors: dict[tuple[int, int], _Cursor] = {}
        if only_new:
            for path in event_files(run_dir, pattern):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                self._cursors[st.st_dev, st.st_ino] = _Cursor(st.st_size)

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        seen: set[tuple[int, int]] = set()
        for path in event_files(self._run_dir, self._pattern):
            try:
                with open(path, "rb") as f:  # the file opened is the one read, whatever its name
                    st = os.fstat(f.fileno())
                    key = (st.st_dev, st.st_ino)
                    cursor = self._cursors.get(key)
                    if cursor is None or st.st_size < cursor.offset:
                        cursor = self._cursors[key] = _Cursor()
                    f.seek(cursor.offset)
                    chunk = f.read()
            except FileNotFoundError:  # deleted (events_keep) or renamed since the listing
                continue
            cursor.offset += len(chunk)
            cursor.missed = False
            seen.add(key)
            lines = (cursor.partial + chunk).split(b"\n")
            cursor.partial = lines[-1]
            new.extend(_parse(lines[:-1]))
        # A file missing from one listing may have been renamed between it and the opening of
        # its path; one missing from two in a row is gone.
        for key in self._cursors.keys() - seen:
            if self._cursors[key].missed:
                del self._cursors[key]
            else:
                self._cursors[key].missed = True
        new.sort(key=lambda r: r["ts"])
        return new

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout_s: float,
        poll_s: float = 0.05,
        running: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """The first new event matching ``predicate``; TimeoutError after ``timeout_s``.

        Events arrive in files written by other processes, so this polls; the wait is bounded.
        With ``running`` (whether the run's writers still run), a run that has ended without the
        event ends the wait at once, :class:`RunEnded`, after a last read of what it wrote: no
        wait on a finished run lasts its whole timeout.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            ended = running is not None and not running()  # before the read: nothing is missed
            for record in self.poll():
                if predicate(record):
                    return record
            if ended:
                raise RunEnded("the run ended before a matching event was written")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no matching event within {timeout_s:.0f} s")
            time.sleep(poll_s)
