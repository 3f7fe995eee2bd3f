"""The event log: its follower and its rotation, on real files and real processes."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.events import (
    EventFollower,
    EventLog,
    Rotation,
    RunEnded,
    event_files,
    events_dir,
    read_events,
    rotation_number,
)


def test_a_follower_of_new_events_skips_what_earlier_runs_wrote(tmp_path: Path) -> None:
    old = EventLog(tmp_path, "node0", role="agent")
    old.emit("node_left", code=4)
    old.close()
    everything, only_new = EventFollower(tmp_path), EventFollower(tmp_path, only_new=True)
    again = EventLog(tmp_path, "node0", role="agent")
    again.emit("agent_started")
    EventLog(tmp_path, "node1", role="agent").emit("agent_started")  # a file that is new
    assert [e["event"] for e in everything.poll()] == [
        "node_left",
        "agent_started",
        "agent_started",
    ]
    assert sorted((e["node"], e["event"]) for e in only_new.poll()) == [
        ("node0", "agent_started"),
        ("node1", "agent_started"),
    ]


def test_rotated_files_are_listed_oldest_first_before_their_nodes_current_file(
    tmp_path: Path,
) -> None:
    folder = events_dir(tmp_path)
    folder.mkdir()
    names = ["node0.jsonl.10", "node0.jsonl", "node0.jsonl.2", "node1.jsonl.1", "chaos.jsonl"]
    for name in [*names, "node0.jsonl.tmp", "notes.txt"]:
        (folder / name).touch()
    assert [p.name for p in event_files(tmp_path)] == [
        "chaos.jsonl",
        "node0.jsonl.2",
        "node0.jsonl.10",
        "node0.jsonl",
        "node1.jsonl.1",  # between a rotation and the node's next line
    ]
    assert [p.name for p in event_files(tmp_path, "node0.jsonl")] == [
        "node0.jsonl.2",
        "node0.jsonl.10",
        "node0.jsonl",
    ]


WRITERS, PER_WRITER = 4, 1500


def _write(run_dir: Path, writer: int, start: Any) -> None:
    """One process's share: ``PER_WRITER`` events into the node file the others write too."""
    log = EventLog(run_dir, "node0", rotation=Rotation(max_bytes=16_384), writer=writer)
    if not start.wait(timeout=60):
        raise TimeoutError("the other writers never started")
    for seq in range(PER_WRITER):
        log.emit("step", seq=seq)
    log.close()


def test_writers_in_several_processes_rotate_one_file_and_lose_or_split_no_line(
    tmp_path: Path,
) -> None:
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_write, args=(tmp_path, i, start)) for i in range(WRITERS)]
    for p in procs:
        p.start()
    follower = EventFollower(tmp_path)
    followed = follower.poll()
    start.set()
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        followed += follower.poll()  # while files are renamed under it
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.01)
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    followed += follower.poll()

    files = event_files(tmp_path)
    assert len(files) > 20  # about 300 kB in 16 kB files: it rotated, many times over
    # In the files' order every line is whole, and each writer's lines are in its own order.
    lines = [line for f in files for line in f.read_bytes().splitlines()]
    order: dict[int, list[int]] = {i: [] for i in range(WRITERS)}
    for line in lines:
        e = json.loads(line)
        order[e["writer"]].append(e["seq"])
    assert order == {i: list(range(PER_WRITER)) for i in range(WRITERS)}
    everything = sorted((i, seq) for i in range(WRITERS) for seq in range(PER_WRITER))
    assert sorted((e["writer"], e["seq"]) for e in read_events(tmp_path)) == everything
    assert sorted((e["writer"], e["seq"]) for e in followed) == everything


def test_a_follower_goes_on_in_a_file_renamed_under_it_and_keeps_its_unfinished_line(
    tmp_path: Path,
) -> None:
    log = EventLog(tmp_path, "node0", role="agent")
    log.emit("agent_started")
    line = json.dumps({"ts": time.time(), "event": "node_ready", "incarnation": 1}) + "\n"
    fd = os.open(log.path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, line[:20].encode())  # a line its writer is still writing
    follower = EventFollower(tmp_path)
    assert [e["event"] for e in follower.poll()] == ["agent_started"]
    log.path.rename(log.path.with_name("node0.jsonl.1"))  # a rotation
    os.write(fd, line[20:].encode())
    os.close(fd)
    log.emit("node_registered")  # into a new node0.jsonl
    assert [e["event"] for e in follower.poll()] == ["node_ready", "node_registered"]
    assert follower.poll() == []


def test_a_writer_that_never_rotates_follows_the_rotation_of_another(tmp_path: Path) -> None:
    quiet = EventLog(tmp_path, "node0", role="chaos")
    rotating = EventLog(tmp_path, "node0", rotation=Rotation(max_bytes=1), role="agent")
    rotating.emit("agent_started")
    rotating.emit("node_registered")  # the file is full: renamed node0.jsonl.1 first
    quiet.emit("fault_cleared")
    assert [p.name for p in event_files(tmp_path)] == ["node0.jsonl.1", "node0.jsonl"]
    current = [json.loads(line)["event"] for line in rotating.path.read_bytes().splitlines()]
    assert current == ["node_registered", "fault_cleared"]


def test_only_the_newest_rotated_files_are_kept(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "node0", rotation=Rotation(max_bytes=1_000, keep=2), role="agent")
    for seq in range(200):
        log.emit("step", seq=seq)
    first, second, current = event_files(tmp_path)  # two rotated files and the current one
    assert current == log.path
    old = rotation_number(first)
    assert old is not None and old > 1 and rotation_number(second) == old + 1  # numbers go on
    seqs = [e["seq"] for e in read_events(tmp_path)]
    assert seqs == list(range(seqs[0], 200)) and seqs[0] > 0


def test_a_wait_on_a_run_that_ended_answers_at_once_and_misses_nothing(tmp_path: Path) -> None:
    """A real process writes one event and exits: a wait for that event returns it although
    the writer is gone by the time it is read; a wait for an event that will never come ends
    as soon as the process has, not at its timeout."""
    script = (
        "import sys; from elastic.events import EventLog; "
        "EventLog(sys.argv[1], 'node0', role='agent').emit('node_left', code=0)"
    )
    writer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    writer.wait(timeout=60)
    running = lambda: writer.poll() is None  # noqa: E731 - what wait_for asks, as a test would
    left = EventFollower(tmp_path).wait_for(
        lambda e: e["event"] == "node_left", timeout_s=600, running=running
    )
    assert left["code"] == 0

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    began = time.monotonic()
    with pytest.raises(RunEnded):
        EventFollower(tmp_path).wait_for(
            lambda e: e["event"] == "never", timeout_s=600, running=lambda: sleeper.poll() is None
        )
    assert time.monotonic() - began < 30  # 0.5 s and a poll; the timeout is 600 s
