"""Structured JSON events, one file per node under ``<run_dir>/events/``.

Agents and workers append one JSON object per line with a wall-clock timestamp. Recovery is
measured from these files (fault to first step after), the chaos tests judge runs by them, and the
launcher's progress display follows them. Each line is written with a single ``write`` on a file
opened with ``O_APPEND``, so the agent and its workers can share a node's file without
interleaving; one file per node keeps bare-metal nodes from ever writing the same file.

A fact that a person should also read in the process's log is written by one call,
``emit(event, message, level=...)``, which appends the event and logs the message: the log line
and the event can never disagree or be written twice by hand.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastic.event_types import EventType, declared


def events_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "events"


class EventLog:
    """Appends events for one process; ``fields`` given here go into every event.

    ``logger``: where the messages of :meth:`emit` are logged (the owning module's logger).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        node_id: str,
        logger: logging.Logger | None = None,
        **fields: Any,
    ) -> None:
        self._log = logger or logging.getLogger(__name__)
        path = events_dir(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{node_id}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
        """Append one event of a declared type (:mod:`elastic.event_types`; a name declared
        nowhere raises :class:`~elastic.event_types.UndeclaredEvent`); with ``message``, also log
        that line at ``level``."""
        name = event.name if isinstance(event, EventType) else declared(event).name
        record = {"ts": time.time(), "event": name, **self._fields, **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        if self.sink is not None:
            self.sink(record)
        if message is not None:
            self._log.log(level, "%s", message)
        return record

    def close(self) -> None:
        os.close(self._fd)


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a run, all nodes merged, in timestamp order.

    A line cut short by a process killed mid-write is skipped: the fault injectors do kill
    processes at arbitrary points, and one torn line must not hide the rest of the log.
    """
    records: list[dict[str, Any]] = []
    for path in sorted(events_dir(run_dir).glob("*.jsonl")):
        records.extend(_parse(path.read_text(errors="replace").splitlines()))
    records.sort(key=lambda r: r["ts"])
    return records


def _parse(lines: list[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


class EventFollower:
    """Reads the events appended since the last call, across all node files of a run.

    With ``only_new``, what the files hold already is skipped: a launcher started again on the
    same run directory shows this run's events, not the earlier runs' replayed as new.
    ``pattern`` picks the files (``<node>.jsonl``: one node's).
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], only_new: bool = False, pattern: str = "*.jsonl"
    ) -> None:
        self._dir = events_dir(run_dir)
        self._pattern = pattern
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        if only_new:
            self._offsets = {p: p.stat().st_size for p in self._dir.glob(pattern)}

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        for path in sorted(self._dir.glob(self._pattern)):
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
                self._offsets[path] = f.tell()
            text = self._partial.pop(path, "") + chunk
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]  # a line still being written
            new.extend(_parse(lines[:-1]))
        new.sort(key=lambda r: r["ts"])
        return new

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, poll_s: float = 0.05
    ) -> dict[str, Any]:
        """The first new event matching ``predicate``; TimeoutError after ``timeout_s``.

        Events arrive in files written by other processes, so this polls; the wait is bounded.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for record in self.poll():
                if predicate(record):
                    return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"no matching event within {timeout_s:.0f} s")
            time.sleep(poll_s)
