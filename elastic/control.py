"""The contract between an agent and each of its workers: environment, messages, exit codes.

A worker is started with a :class:`WorkerEnv` in its environment, talks to its agent over a
control channel (:class:`Channel`), and ends with an exit code the agent acts on: 0 (the job is
trained), :data:`EXIT_PEER_LOST` (peers went away and no round came: not this worker's fault),
:data:`EXIT_UNSAVED` (trained, but the final checkpoint could not be written), anything else a
local failure (a strike, and a restart). Workers live across rounds, so the agent cannot hand
them a round through the environment once; it sends each new assignment down the channel, and
the worker sends back what the agent needs to supervise it: that it is ready, a heartbeat with
its step and phase, and that it saw a peer fail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from elastic.sched_policy import helper_thread

log = logging.getLogger(__name__)

CONTROL_FD_ENV = "ELASTIC_CONTROL_FD"


# Exit code of a worker that gave up on its round because peers went away and no new round came:
# not this worker's fault, so its agent restarts it without reporting a failure of its own.
EXIT_PEER_LOST = 75
# Exit code of a worker that failed by itself (bad data, a CUDA error, a bug): its traceback is in
# its log, and its agent counts a strike against the node.
EXIT_FAILED = 1
# Exit code of a worker that trained the job to its end but whose final checkpoint could not be
# written within checkpoint.final_retry_s (every rank agrees; rank 0's final_save_failed names the
# steps not saved): no restart and no strike, and the job is not done. Its agent, and the
# launcher, end with it too (sysexits' EX_IOERR).
EXIT_UNSAVED = 74


@dataclass(frozen=True)
class WorkerEnv:
    """What an agent tells a worker it spawns; rounds come later, over the control channel."""

    config: str  # path of the resolved config.yaml
    run_dir: str
    node_id: str
    local_rank: int
    local_world_size: int
    threads: int

    _NAMES = {"local_rank": "LOCAL_RANK", "local_world_size": "LOCAL_WORLD_SIZE"}

    def to_environ(self) -> dict[str, str]:
        return {
            self._NAMES.get(f.name, "ELASTIC_" + f.name.upper()): str(getattr(self, f.name))
            for f in fields(self)
        }

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        values = {}
        for f in fields(cls):
            raw = os.environ[cls._NAMES.get(f.name, "ELASTIC_" + f.name.upper())]
            values[f.name] = int(raw) if f.type in (int, "int") else raw
        return cls(**values)


def local_world_size() -> int:
    """The workers of this worker's node, from its environment (1 outside a worker)."""
    return int(os.environ.get(WorkerEnv._NAMES["local_world_size"], "1"))


@dataclass(frozen=True)
class Assignment:
    """One worker's place in one round."""

    round: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    formed_at: float  # wall-clock time the round was formed (for the recovery breakdown)
    # When this round is the previous one minus some nodes: that round, and its ranks now gone.
    shrinks_round: int = 0
    excluded_ranks: tuple[int, ...] = ()
    after_step: int = 0  # leave the current round once this step is trained; 0: at once

    def shrink_of(self, previous: Assignment) -> list[int] | None:
        """The ranks of ``previous`` to exclude, if this round only removed ranks from it."""
        if self.excluded_ranks and self.shrinks_round == previous.round:
            return list(self.excluded_ranks)
        return None

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> Assignment:
        data = {k: v for k, v in msg.items() if k != "type"}
        data["excluded_ranks"] = tuple(data.get("excluded_ranks", ()))
        return cls(**data)


class Channel:
    """One end of a control socket; :meth:`serve` reads messages on a daemon thread.

    Messages are JSON lines over a socket pair, one per worker, created by the agent and
    inherited by the worker (its fd number is in ``ELASTIC_CONTROL_FD``); when either side dies
    the other reads end-of-file at once. Agent to worker: ``assign`` (round, rank, world size,
    store address) and ``standby`` (leave the current round and wait; numbered by ``seq``), each
    at once or, with ``after_step``, once that step is trained (a planned leave switches rounds
    between two steps; a planned leave's standby also names the next round, its store and world
    size: ``next_round``, ``store_host``, ``store_port``, ``world_size``); ``leave`` (this node
    is about to leave: say after which step). Worker to agent: ``ready``, ``status`` (step,
    phase, round, and ``stood_by``: the ``seq`` of the last standby carried out, sent at once,
    or in a planned leave once the next round's members all reached its set-up),
    ``peer_lost`` (round, error, trained: its steps in that round), ``leaving`` (after_step:
    the step the node can stop after), ``straggler`` (step, slowdown: this rank found itself a
    straggler; the agent acts on ``health.straggler``) and ``strike`` (reason: this rank found
    its node at fault, a corrupt replica or a run of non-finite steps).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self.closed = threading.Event()

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """The agent's end, and the socket to hand to a worker."""
        ours, theirs = socket.socketpair()
        theirs.set_inheritable(True)
        return cls(ours), theirs

    @classmethod
    def from_environ(cls) -> Channel:
        fd = int(os.environ[CONTROL_FD_ENV])
        return cls(socket.socket(fileno=fd))

    def send(self, type_: str, **fields: Any) -> bool:
        """Send one message; False when the other side is gone."""
        data = (json.dumps({"type": type_, **fields}) + "\n").encode()
        try:
            with self._send_lock:
                self._sock.sendall(data)
            return True
        except OSError:
            self.closed.set()
            return False

    def serve(self, on_message: Callable[[dict[str, Any]], None], name: str) -> threading.Thread:
        """Call ``on_message`` for every message until end-of-file, then set :attr:`closed`."""

        def loop() -> None:
            with self._sock.makefile("rb") as stream:
                try:
                    for line in stream:
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            log.warning("%s: unreadable control message %r", name, line[:200])
                            continue
                        on_message(msg)
                except OSError:
                    pass
            self.closed.set()
            on_message({"type": "eof"})

        thread = helper_thread(loop, name)
        thread.start()
        return thread

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
