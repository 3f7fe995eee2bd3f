"""This node's worker processes: starting, talking to, watching and stopping them.

A worker is started once and lives across rounds; its agent sends it each round over a control
channel (:mod:`elastic.control`) and hears back from it: ready, heartbeats, a peer lost. Only a
worker that died is started again, in the same slot.

A slot posts what the agent must react to (ready, a peer lost, the process's exit) to the agent's
inbox (:mod:`launcher.agent.inbox`); heartbeats only feed the slot's watchdog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from elastic import event_types as ev
from elastic.control import CONTROL_FD_ENV, Assignment, Channel, WorkerEnv
from elastic.events import EventLog
from elastic.lifeline import tied
from launcher.agent.inbox import (
    Message,
    WorkerExited,
    WorkerLeaving,
    WorkerPeerLost,
    WorkerReady,
    WorkerStraggler,
    WorkerStrike,
)
from launcher.agent.watchdog import Watchdog
from launcher.rendezvous.etcd import PROTOBUF_MODE
from launcher.rendezvous.membership import Round

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0  # how long a worker killed with SIGKILL is waited for


class WorkerSlot:
    """One local rank's worker process, the current one of possibly several over the job."""

    def __init__(
        self,
        env: WorkerEnv,
        log_dir: Path,
        events: EventLog,
        watchdog_s: float,
        post: Callable[[Message], None],
    ) -> None:
        self.env = env
        self.log_path = log_dir / f"worker{env.local_rank}.log"
        self._events = events
        self._post = post
        self._lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: Channel | None = None
        self.ready = False
        self.watchdog = Watchdog(watchdog_s)
        self.stopping = False
        self.finished_in: int | None = None  # the round its worker said it finished the job in

    def start(self) -> None:
        channel, theirs = Channel.pair()
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== worker {self.env.local_rank} started {time.ctime()} ===\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                # Through the lifeline, not preexec_fn: the agent runs gRPC threads, and Python
                # code between fork and exec trips gRPC's fork handlers.
                tied([sys.executable, "-m", "elastic.trainer"]),
                env={
                    **{k: v for k, v in os.environ.items() if k != PROTOBUF_MODE},  # no etcd
                    **self.env.to_environ(),
                    CONTROL_FD_ENV: str(theirs.fileno()),
                    "PYTHONUNBUFFERED": "1",
                },
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        theirs.close()
        with self._lock:
            self.channel, self.ready, self.stopping = channel, False, False
            self.finished_in = None
        channel.serve(self._on_message, name=f"worker{self.env.local_rank}-link")
        self._events.emit(
            ev.WORKER_STARTED,
            local_rank=self.env.local_rank,
            worker_pid=self.proc.pid,
            log=str(self.log_path),
        )
        threading.Thread(target=self._wait, args=(self.proc,), daemon=True).start()

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        now = time.monotonic()
        rank = self.env.local_rank
        if kind == "ready":
            with self._lock:
                self.ready = True
                self.watchdog.start(now)
            self._post(WorkerReady(rank))
        elif kind == "status":
            with self._lock:
                self.watchdog.heartbeat(msg, now)  # the agent asks the watchdog on its own time
        elif kind == "peer_lost":
            self._post(WorkerPeerLost(rank, int(msg["round"]), int(msg["trained"])))
        elif kind == "leaving":
            self._post(WorkerLeaving(rank, int(msg["after_step"])))
        elif kind == "straggler":
            self._post(WorkerStraggler(rank, int(msg["step"]), float(msg["slowdown"])))
        elif kind == "strike":
            self._post(WorkerStrike(rank, str(msg["reason"])))
        elif kind == "finished":
            with self._lock:
                self.finished_in = int(msg["round"])
        # "eof": the process exit follows, posted by _wait

    def _wait(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        self._events.emit(
            ev.WORKER_EXITED,
            local_rank=self.env.local_rank,
            worker_pid=proc.pid,
            code=code,
            stopped_by_agent=self.stopping,
        )
        self._post(WorkerExited(self.env.local_rank, code))

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def frozen(self) -> str | None:
        """Why the watchdog takes this worker for frozen, or None."""
        with self._lock:
            if not self.ready or self.exit_code is not None:
                return None
            return self.watchdog.verdict(time.monotonic())

    @property
    def stood_by(self) -> int:
        """The number of the last ``standby`` this worker carried out (it left its round)."""
        with self._lock:
            return int(self.watchdog.status.get("stood_by", 0))

    def excuse(self, now: float) -> None:
        """The agent was not running until ``now``: see :meth:`Watchdog.excuse`."""
        with self._lock:
            self.watchdog.excuse(now)

    def send(self, kind: str, **fields: Any) -> None:
        if self.channel is not None:
            self.channel.send(kind, **fields)

    def stop(self, grace_s: float) -> None:
        """Stop the worker: close its control channel, SIGTERM its children, SIGKILL the rest.

        Closing the channel ends the worker at once: it ignores SIGTERM, which a planned leave
        may have sent the whole node. What is left after ``grace_s`` gets SIGKILL."""
        self.stopping = True
        if self.proc is None:
            return
        if self.channel is not None:
            self.channel.close()
        # Only Popen waits for the worker itself: a psutil wait would reap it first, and
        # Popen's waiting thread would then read the lost status as 0, a clean exit.
        deadline = time.monotonic() + grace_s
        victims: list[psutil.Process] = []
        if self.proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker = psutil.Process(self.proc.pid)
                victims = [worker, *worker.children(recursive=True)]
        for v in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                v.terminate()
                v.resume()  # a stopped process only sees SIGTERM once it runs again
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # asleep in the kernel (a hung driver or mount),
                # or traced: it dies when it wakes, and the agent's loop reaps it then
                log.warning(
                    "worker pid %d still runs %.0f s after SIGKILL (uninterruptible sleep in "
                    "the kernel, or traced); going on without waiting",
                    self.proc.pid,
                    KILL_WAIT_S,
                )
        left = max(0.0, deadline - time.monotonic())
        _, alive = psutil.wait_procs(victims[1:], timeout=left)
        for v in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                v.kill()
        psutil.wait_procs(alive, timeout=5)

    def kill(self) -> None:
        """SIGKILL now (a frozen worker cannot be asked to stop)."""
        self.stop(grace_s=0.0)


class WorkerGroup:
    """The slots of one node."""

    def __init__(self, slots: list[WorkerSlot], events: EventLog) -> None:
        self.slots = slots
        self._events = events
        self.standby_seq = 0  # the number of the last standby sent

    @classmethod
    def start(
        cls,
        envs: list[WorkerEnv],
        log_dir: Path,
        events: EventLog,
        watchdog_s: float,
        post: Callable[[Message], None],
    ) -> WorkerGroup:
        log_dir.mkdir(parents=True, exist_ok=True)
        group = cls([WorkerSlot(env, log_dir, events, watchdog_s, post) for env in envs], events)
        for slot in group.slots:
            slot.start()
        return group

    def exit_codes(self) -> list[int | None]:
        return [s.exit_code for s in self.slots]

    def pids(self) -> dict[str, int]:
        """Each running worker's pid, by name (``worker<local rank>``)."""
        return {f"worker{i}": s.proc.pid for i, s in enumerate(self.slots) if s.proc}

    @property
    def ready(self) -> bool:
        return all(s.ready and s.exit_code is None for s in self.slots)

    @property
    def step(self) -> int:
        """The step the workers last began (their heartbeats' newest); 0 before any."""
        return max((int(s.watchdog.status.get("step") or 0) for s in self.slots), default=0)

    def finished_in(self, timeout_s: float) -> int | None:
        """The round in which the exited workers said they finished the job; None if none did.

        Waits up to ``timeout_s`` for their channels to be read to the end: the process's exit
        can be seen before its last message."""
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            if slot.channel is not None:
                slot.channel.closed.wait(max(0.0, deadline - time.monotonic()))
        rounds = [s.finished_in for s in self.slots if s.finished_in is not None]
        return max(rounds) if rounds else None

    def assign(self, assignments: list[Assignment]) -> None:
        for slot, a in zip(self.slots, assignments, strict=True):
            slot.send("assign", **asdict(a))

    def standby(self, after_step: int = 0, successor: Round | None = None) -> None:
        """Take the workers out of their round, at once or after ``after_step``.

        A planned leave names the round that follows theirs (``successor``), whose set-up they
        await before they say they left. The request is numbered, so that :attr:`out_of_round`
        knows when they did."""
        self.standby_seq += 1
        handover = {}
        if after_step and successor is not None:
            handover = {
                "next_round": successor.number,
                "world_size": successor.world_size,
                "store_host": successor.store_host,
                "store_port": successor.store_port,
            }
        for slot in self.slots:
            slot.send("standby", after_step=after_step, seq=self.standby_seq, **handover)

    def kill_frozen(self) -> None:
        """Kill the workers the watchdog takes for frozen; they are restarted as crashed."""
        for slot in self.slots:
            reason = slot.frozen()
            if reason is not None:
                self._events.emit(
                    ev.WORKER_FROZEN,
                    f"{slot.env.node_id}: worker {slot.env.local_rank} frozen ({reason})",
                    level=logging.WARNING,
                    local_rank=slot.env.local_rank,
                    reason=reason,
                )
                slot.kill()

    def leave(self) -> None:
        """Ask every worker after which step it can leave its round (answered by ``leaving``)."""
        for slot in self.slots:
            slot.send("leave")

    @property
    def out_of_round(self) -> bool:
        """Whether every worker carried out the last ``standby`` (it says so at once) or exited."""
        return all(s.exit_code is not None or s.stood_by == self.standby_seq for s in self.slots)

    def stop(self, grace_s: float) -> None:
        threads = [threading.Thread(target=s.stop, args=(grace_s,)) for s in self.slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
