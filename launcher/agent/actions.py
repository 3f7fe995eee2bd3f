"""The agent's acts: what its loop (:mod:`launcher.agent.agent`) does once the decisions answered.

The loop gathers the facts and asks :mod:`launcher.agent.decisions`; this carries out the answer
on the node's workers and its place in the job: send the workers into a round or to standby,
leave a round, restart crashed workers, rejoin as a new member, finish the job. It holds what the
acts change (the round the workers were sent to, the crashes so far), so the loop reads them here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastic import event_types as ev
from elastic.events import EventLog
from launcher.agent import decisions as decide
from launcher.agent.admission import Admission
from launcher.agent.planned_leave import PlannedLeave
from launcher.agent.self_quarantine import SelfQuarantine
from launcher.agent.workers import WorkerGroup
from launcher.rendezvous.etcd_client import EtcdLost
from launcher.rendezvous.membership import JobView, Round
from launcher.rendezvous.rendezvous import Rendezvous

log = logging.getLogger("launcher.agent")

STOP_GRACE_S = 5.0  # how long workers get to exit after SIGTERM before SIGKILL
IDLE_WAKE_S = 1.0  # the agent looks at its workers (watchdogs, exits) and join timeout this often


class Actions:
    """Carry out one node's acts on its workers and on its place in the job.

    ``join(in_running_job)`` registers the node again (0, or the exit code);
    ``receive(timeout)`` takes in the agent's messages that come within ``timeout``."""

    def __init__(
        self,
        node_id: str,
        rdzv: Rendezvous,
        workers: WorkerGroup,
        leaving: PlannedLeave,
        admission: Admission,
        degraded: SelfQuarantine,
        events: EventLog,
        *,
        join: Callable[[bool], int],
        receive: Callable[[float], None],
    ) -> None:
        self._node_id, self._rdzv, self._workers, self._leaving = node_id, rdzv, workers, leaving
        self._admission, self._degraded, self._events = admission, degraded, events
        self._join, self._receive = join, receive
        self.current: Round | None = None  # the round this node's workers were sent to
        self.crashes = 0

    def follow_round(self, view: JobView) -> None:
        """Send the workers into a new round that lists this node, or to standby if it does not."""
        step = decide.follow_round(view, self._rdzv.node, self.current, self._workers.ready)
        if isinstance(step, decide.Standby):
            self._workers.standby(step.after_step, step.round)
            self._events.emit(ev.STANDBY, round=step.round.number, after_step=step.after_step)
            self.current = None
        elif isinstance(step, decide.Assign):
            rnd, me = step.round, step.member
            self._workers.assign(list(step.assignments))
            self._events.emit(
                ev.ROUND_JOINED,
                f"{self._node_id}: round {rnd.number}, ranks {me.first_rank}-"
                f"{me.first_rank + me.slots - 1} of {rnd.world_size}",
                round=rnd.number,
                world_size=rnd.world_size,
                first_rank=me.first_rank,
                nodes=rnd.size,
                **self._rdzv.load.take(),  # what this node cost etcd since its previous round
            )
            self.current = rnd

    def leave_round(self, reason: str) -> None:
        """Leave the current round at once (a failure report), the workers standing by."""
        self._rdzv.record.report_failure(reason)
        if self.current is not None:
            self._workers.standby()
            self.current = None

    def restart(self, plan: decide.Restart) -> int:
        """Leave the round and start the failed workers again once the node checks out healthy.

        Returns 0 to carry on, or the agent's exit code."""
        self.crashes = plan.crashes
        self.leave_round(plan.reason)
        failed = [self._workers.slots[i] for i in plan.local_ranks]
        for s in failed:
            s.stop(0)
        if plan.strike is not None:
            if self._admission.strike(plan.strike):
                return self.rejoin(decide.Rejoin("quarantined", strike=False))
            code = self._admission.check(in_running_job=True)
            if code:
                return code
        for s in failed:
            s.start()
        return 0

    def rejoin(self, rejoin: decide.Rejoin) -> int:
        """Join the job again as a new member, once fenced or quarantined.

        This node's rounds go on without it. Leave, wait out any quarantine, check the node
        again and join as a new member; 0, or the exit code."""
        sentenced = self._admission.strike(rejoin.reason) if rejoin.strike else None
        quarantined = sentenced is not None or self._node_id in self._rdzv.view.quarantined
        keep = decide.keeps_workers(rejoin, quarantined, self._workers.exit_codes())
        log.warning(
            "%s %s; leaving, to join again as a new member (its workers %s)",
            self._node_id,
            rejoin.reason,
            "stand by" if keep else "stop",
        )
        if keep:
            self._workers.standby()
        else:
            self._workers.stop(STOP_GRACE_S)
        self.current = None
        self._leaving.reset()
        self._degraded.reset()
        self._rdzv.leave()
        code = self._join(True)
        if code:
            return code
        if not keep:
            for s in self._workers.slots:
                s.start()
        return 0

    def finish(self) -> None:
        """End the job once a local worker trained it to its end.

        Let the others end too, then mark the job done if all of them saved it (exit 0; not
        :data:`EXIT_UNSAVED`)."""
        deadline = time.monotonic() + STOP_GRACE_S * 6
        while None in self._workers.exit_codes() and not self._rdzv.fenced.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(min(left, IDLE_WAKE_S))
        if all(c == 0 for c in self._workers.exit_codes()):
            # The round they trained it in: a node still in a later one leaves at once.
            finished_in = self._workers.finished_in(timeout_s=STOP_GRACE_S)
            if finished_in is None:
                finished_in = self.current.number if self.current else 0
            try:
                self._rdzv.mark_done(finished_in)
            except EtcdLost as exc:  # the others finish the same last step on their own
                log.warning("%s: could not mark the job done: %s", self._node_id, exc)
        self.current = None
