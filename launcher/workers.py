"""Starting, watching and stopping the worker processes of one node for one round."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from elastic.communicator import WorkerEnv
from elastic.events import EventLog
from elastic.lifeline import tied


class WorkerGroup:
    """The workers of one node in one round; ``on_exit`` is called from a thread when one exits."""

    def __init__(
        self,
        procs: list[subprocess.Popen[bytes]],
        envs: list[WorkerEnv],
        events: EventLog,
        on_exit: Callable[[], None],
    ) -> None:
        self.procs = procs
        self.envs = envs
        self._events = events
        self._on_exit = on_exit
        self._stopping = False
        self._waiters = [
            threading.Thread(target=self._wait, args=(i,), daemon=True) for i in range(len(procs))
        ]
        for t in self._waiters:
            t.start()

    @classmethod
    def spawn(
        cls, envs: list[WorkerEnv], log_dir: Path, events: EventLog, on_exit: Callable[[], None]
    ) -> WorkerGroup:
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = []
        for env in envs:
            log_path = log_dir / f"worker{env.local_rank}.log"
            with open(log_path, "ab") as out:
                out.write(
                    f"\n=== round {env.round} rank {env.rank}/{env.world_size} ===\n".encode()
                )
                out.flush()
                proc = subprocess.Popen(
                    # Through the lifeline, not preexec_fn: the agent runs gRPC threads, and Python
                    # code between fork and exec trips gRPC's fork handlers.
                    tied([sys.executable, "-m", "elastic.trainer"]),
                    env={**os.environ, **env.to_environ(), "PYTHONUNBUFFERED": "1"},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            procs.append(proc)
            events.emit(
                "worker_started",
                round=env.round,
                rank=env.rank,
                local_rank=env.local_rank,
                worker_pid=proc.pid,
                log=str(log_path),
            )
        return cls(procs, envs, events, on_exit)

    def _wait(self, i: int) -> None:
        code = self.procs[i].wait()
        env = self.envs[i]
        self._events.emit(
            "worker_exited",
            round=env.round,
            rank=env.rank,
            local_rank=env.local_rank,
            worker_pid=self.procs[i].pid,
            code=code,
            stopped_by_agent=self._stopping,
        )
        self._on_exit()

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def stop(self, grace_s: float) -> None:
        """SIGTERM every worker and its children, SIGKILL what is left after ``grace_s``."""
        self._stopping = True
        victims: list[psutil.Process] = []
        for p in self.procs:
            if p.poll() is not None:
                continue
            try:
                proc = psutil.Process(p.pid)
                victims += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for v in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                v.terminate()
        _, alive = psutil.wait_procs(victims, timeout=grace_s)
        for v in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                v.kill()
        psutil.wait_procs(alive, timeout=5)
        for p in self.procs:
            p.wait(timeout=5)
        for t in self._waiters:
            t.join(timeout=5)
