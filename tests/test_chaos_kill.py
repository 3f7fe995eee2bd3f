"""``python -m chaos.kill``, the README's first fault: a real signal to a node's processes, and a
clear line, not a traceback, when there is nothing to signal."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from chaos.kill import main
from elastic import event_types as ev
from elastic.events import EventLog


def agent_started(run_dir: Path, node_id: str, pid: int) -> None:
    log = EventLog(run_dir, node_id, role="agent", pid=pid)
    try:
        log.emit(ev.AGENT_STARTED, pgid=pid, slots=1, device="cpu")
    finally:
        log.close()


AGENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_running_node_is_killed_with_its_children(tmp_path: Path) -> None:
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        worker = psutil.Process(int(agent.stdout.readline()))
        agent_started(tmp_path, "node1", agent.pid)
        assert main([str(tmp_path), "node1"]) == 0
        assert agent.wait(timeout=10) == -signal.SIGKILL
        psutil.wait_procs([worker], timeout=10)  # reaped by init, or a zombie: not running
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    finally:
        agent.kill()


def test_a_node_that_has_ended_is_a_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    agent_started(tmp_path, "node1", ended.pid)
    assert main([str(tmp_path), "node1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot signal node1: the agent of node1 (pid {ended.pid}) is not running" in err
    assert "The job has ended" in err


def test_a_run_directory_without_events_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "runs" / "nope"), "node1"]) == 2
    assert "holds no job's events" in capsys.readouterr().err
