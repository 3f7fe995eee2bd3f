"""The agent's inbox: everything the agent reacts to arrives here as one small message.

Worker slots post what their workers say and when they exit, the rendezvous posts when its view
changes or it fences the node, and the signal handlers post the signals; the agent's loop blocks
on the inbox alone, with a timeout for what only time reveals. Most messages are wake-ups: what
they are about stays the truth of its owner (a slot's exit code, the rendezvous's view), read
when the agent wakes, so a message about a worker replaced meanwhile does no harm. What exists
only as a message is carried in it: a signal, a fault request, the round of a failed collective,
the step after which a leaving worker can stop, a worker's finding that it straggles or that its
node is at fault, a broken GPU. The queue's ``put`` is reentrant, so a signal handler may post
while the main thread is inside ``get``.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerReady:
    """The worker of ``local_rank`` loaded its data and model and waits for a round."""

    local_rank: int


@dataclass(frozen=True)
class WorkerPeerLost:
    """The worker of ``local_rank`` saw a collective of ``round`` fail."""

    local_rank: int
    round: int  # stale once the agent is in a newer round
    trained: int  # steps it trained in that round before the failure


@dataclass(frozen=True)
class WorkerLeaving:
    """The worker of ``local_rank`` can leave its round after ``after_step`` (0: it is in none).

    This is its answer to the agent's ``leave``."""

    local_rank: int
    after_step: int


@dataclass(frozen=True)
class WorkerStraggler:
    """The worker of ``local_rank`` found itself ``slowdown`` times slower than the median rank.

    It found so in the comparison after ``step`` (:mod:`elastic.stragglers`)."""

    local_rank: int
    step: int
    slowdown: float


@dataclass(frozen=True)
class WorkerStrike:
    """The worker of ``local_rank`` found its node at fault while training.

    Such a fault is a corrupt replica, or a run of non-finite steps. It is a strike, for
    ``reason``."""

    local_rank: int
    reason: str


@dataclass(frozen=True)
class WorkerExited:
    """The worker process of ``local_rank`` exited."""

    local_rank: int
    code: int  # negative: killed by that signal


@dataclass(frozen=True)
class Signal:
    """The agent received ``signum`` (SIGTERM, SIGINT): stop the node cleanly."""

    signum: int


@dataclass(frozen=True)
class FaultRequested:
    """A fault was requested for this node through etcd (:mod:`launcher.agent.fault_requests`)."""

    request_id: str
    request: dict[str, Any]  # the requester's JSON, not yet checked


@dataclass(frozen=True)
class GpuFault:
    """The GPU watch (:mod:`launcher.health.gpu_watch`) found a GPU of this node broken."""

    reason: str


@dataclass(frozen=True)
class RendezvousChanged:
    """The rendezvous's view of the job changed, or it fenced this node."""


Message = (
    WorkerReady
    | WorkerPeerLost
    | WorkerLeaving
    | WorkerStraggler
    | WorkerStrike
    | WorkerExited
    | Signal
    | FaultRequested
    | GpuFault
    | RendezvousChanged
)


class Inbox:
    """A queue of :data:`Message`; any thread, and a signal handler, may post."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def put(self, message: Message) -> None:
        self._queue.put(message)

    def take(self, timeout: float) -> list[Message]:
        """Wait up to ``timeout`` seconds for a message, then take it and all queued behind it.

        An empty list when none came in time (``timeout`` 0: do not wait)."""
        try:
            first = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        messages = [first]
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                return messages
