"""Sample a process tree's Python stacks with py-spy over a window that events mark.

A profile of a whole training run is mostly start-up, imports and the first steps' one-time
costs. The steady state is what a step costs, so :class:`PyspyWindow` starts py-spy when its
``started`` predicate turns true (the warm-up's last step) and stops it when ``ended`` does. It
samples the root process and every descendant (``--subprocesses``), without pausing them
(``--nonblocking``), and writes py-spy's raw collapsed stacks, one line per distinct stack and
thread with its count (:mod:`bench.step_profile` splits them).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.1  # how often the predicates are asked
RATE_HZ = 100  # py-spy's samples per second and thread
STOP_WAIT_S = 30.0  # how long py-spy may take to write its file once stopped


class PyspyWindow:
    """py-spy over ``pid``'s tree from ``started()`` until ``ended()``, into ``out``."""

    def __init__(
        self,
        pid: int,
        out: Path,
        started: Callable[[], bool],
        ended: Callable[[], bool],
        timeout_s: float,
    ) -> None:
        beside = Path(sys.executable).with_name("py-spy")  # the venv's, off PATH
        spy = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        if spy is None:
            raise RuntimeError("--profile needs py-spy: pip install -e '.[test]' (or py-spy)")
        self.out = out
        self.seconds = 0.0  # how long py-spy sampled
        self._argv = [spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking"]
        self._argv += ["--threads", "--format", "raw", f"--rate={RATE_HZ}", f"--output={out}"]
        self._started, self._ended = started, ended
        self._deadline = time.monotonic() + timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyspy-window", daemon=True)

    def __enter__(self) -> PyspyWindow:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(STOP_WAIT_S + 5)

    def _wait_for(self, predicate: Callable[[], bool]) -> bool:
        while not predicate():
            if self._stop.wait(POLL_S) or time.monotonic() > self._deadline:
                return False
        return True

    def _run(self) -> None:
        if not self._wait_for(self._started):
            return
        spy = subprocess.Popen(self._argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        began = time.monotonic()
        self._wait_for(self._ended)
        self.seconds = time.monotonic() - began
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
        try:
            spy.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
