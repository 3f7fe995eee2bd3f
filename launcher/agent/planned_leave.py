"""A node's planned leave of a round that goes on without it.

It follows a stop signal, or an operator's drain (``quarantine add``) of the node.

The node asks its workers after which step they can stop (the step in flight and the next) and
publishes the latest such step; the others form the next round without it and switch to it
between two steps, so no step is dropped and no failure has to be detected. The node leaves once
its workers are out of the round (:func:`launcher.agent.decisions.on_stop`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic import event_types as ev
from elastic.events import EventLog
from launcher.agent import decisions as decide
from launcher.agent.workers import WorkerGroup
from launcher.rendezvous.membership import JobView


class PlannedLeave:
    """One node's planned leave.

    ``leave_after(step)`` publishes the step its workers stop after
    (:meth:`launcher.rendezvous.record.OwnRecord.leave_after`)."""

    def __init__(
        self,
        node_id: str,
        min_nodes: int,
        watchdog_s: float,
        workers: WorkerGroup,
        events: EventLog,
        leave_after: Callable[[int], None],
    ) -> None:
        self._node_id, self._min_nodes, self._watchdog_s = node_id, min_nodes, watchdog_s
        self._workers, self._events, self._leave_after = workers, events, leave_after
        self.since: float | None = None  # monotonic: when the workers were asked
        self._answers: dict[int, int] = {}  # local rank: the step it can stop after

    def reset(self) -> None:
        """A new registration: nothing asked yet."""
        self.since, self._answers = None, {}

    def answer(self, local_rank: int, after_step: int) -> None:
        """A worker's answer; once all answered, the step goes to etcd."""
        self._answers[local_rank] = after_step
        if len(self._answers) == len(self._workers.slots):
            self._leave_after(max(self._answers.values()))

    def may_leave(self, view: JobView, in_round: bool, fenced: bool, why: str) -> bool:
        """Whether the node may leave now.

        When it must drain first, this starts the drain (for the reason ``why``)."""
        now = time.monotonic()
        answered = len(self._answers) == len(self._workers.slots)
        step = decide.on_stop(
            in_round=in_round,
            others_go_on=decide.others_go_on(view, self._node_id, self._min_nodes),
            asked=self.since is not None,
            out=(not in_round and self._workers.out_of_round)
            or (answered and max(self._answers.values()) == 0)
            or fenced
            or any(code is not None for code in self._workers.exit_codes()),
            overdue=self.since is not None and now - self.since > 2 * self._watchdog_s,
        )
        if isinstance(step, decide.Drain):
            self.since = now
            self._events.emit(ev.NODE_DRAINING, reason=why)
            self._workers.leave()
        return isinstance(step, decide.Leave)
