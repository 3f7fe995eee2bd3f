"""The worker's end of its agent's control channel: assignments in, heartbeats and reports out.

The channel is :mod:`elastic.control`. Why a thread of its own: a new assignment must reach a
worker whose training thread is stuck in a collective on a peer that will never answer; the
reader aborts the communicator, which pulls the training thread out. A planned leave is instead
carried out by the training thread between two steps (:meth:`AgentLink.begin_step`), so that no
step in flight is dropped.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from elastic.communicator import Communicator
from elastic.control import Assignment, Channel
from elastic.ddp_hook import DDPHook
from elastic.group_setup import set_up_begun
from elastic.sched_policy import helper_thread

log = logging.getLogger("elastic.trainer")

HEARTBEAT_S = 0.5  # how often the worker tells its agent its phase and step
# How long a draining worker holds at the step it said it can stop after, for its agent's word:
# the agent publishes the step, the round is formed without the node, and its standby comes
# down the channel, which on 2 loaded cores took longer than a step (50 ms against 40). Well
# under health.watchdog_s, so that a held worker is never taken for a frozen one.
HOLD_S = 5.0
# How long a worker leaving as planned waits, before it says it left, for the members of the
# next round to reach its set-up: one may still be in the step after the last, waiting on this
# worker, until its own assignment comes (0.3 s on 2 loaded cores); were this worker stopped
# first, that step's all-reduce would fail on a lost peer. Bounded, since that round may fail.
HANDOVER_S = 5.0


class AgentLink:
    """The control channel's reader and heartbeat, and the planned switch between steps."""

    # Phases in which this worker trains in a round: a switch "after step N" waits for the
    # step loop; in any other phase there is no step to finish, and the switch is at once.
    IN_ROUND = frozenset({"joining", "step", "evaluate", "checkpoint"})

    def __init__(self, channel: Channel, comm: Communicator, hook: DDPHook) -> None:
        self.channel = channel
        self.comm = comm
        self.hook = hook  # whether backward waits for peers: said in every heartbeat
        self.status: dict[str, Any] = {"phase": "starting", "step": 0, "round": 0}
        self._inbox: queue.Queue[Assignment | None] = queue.Queue()
        self._lock = threading.Lock()
        self._switched = threading.Condition(self._lock)  # a switch was planned or cleared
        # A planned switch: (after step, reason, the new round, the standby's number or 0)
        self._switch: tuple[int, str, int | None, int] | None = None
        self._promised = 0  # the step this worker told a draining agent it can stop after
        # A planned leave's standby names the round that follows: store, round, world size.
        self._handover: dict[str, Any] | None = None
        channel.serve(self._on_message, name="agent-link")
        helper_thread(self._heartbeat, "heartbeat").start()

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "eof":
            # How the agent stops its worker: SIGTERM is ignored (see main), so that a stop
            # signal sent to the whole node reaches the agent's planned leave and not this.
            log.info("the agent closed the control channel; exiting")
            os._exit(1)
        if kind == "assign":
            assignment = Assignment.from_message(msg)
            self._inbox.put(assignment)
            reason = f"round {assignment.round} was formed"
            self._leave_round(assignment.after_step, reason, assignment.round)
        elif kind == "standby":
            self._inbox.put(None)
            self._handover = msg if "next_round" in msg else None
            reason = "this node is not in the current round"
            self._leave_round(msg.get("after_step", 0), reason, stood_by=msg.get("seq", 0))
        elif kind == "leave":
            with self._lock:  # the step in flight, as begin_step marks it
                in_round = self.status["phase"] in self.IN_ROUND
                # Peers may have started the step after the one in flight: stop after that one.
                after = self.status["step"] + 1 if in_round else 0
                self._promised = after
            self.channel.send("leaving", after_step=after)

    def _leave_round(
        self, after_step: int, reason: str, before_round: int | None = None, stood_by: int = 0
    ) -> None:
        """Abort the current round now, or leave it to the training thread after ``after_step``.

        Now, too, when the step in flight is already past ``after_step``: every member of the new
        round stops after that step, so none takes the next one. ``stood_by``: the number of the
        agent's ``standby``, echoed once it is carried out."""
        with self._lock:
            self._switched.notify_all()
            in_round = self.status["phase"] in self.IN_ROUND
            if after_step and in_round and self.status["step"] <= after_step:
                self._switch = (after_step, reason, before_round, stood_by)
                return
            self._switch, self._promised = None, 0
        if after_step and in_round:
            # Step after_step + 1 began before the word came: a node leaving after after_step
            # never takes it, so it would end on a lost peer. It was not recorded: none is lost.
            reason = f"{reason} (after step {after_step}; step {after_step + 1} was dropped)"
        self._abort(reason, before_round, stood_by)

    def _abort(self, reason: str, before_round: int | None, stood_by: int) -> None:
        self.comm.abort(reason, before_round=before_round)
        self._echo(stood_by)

    def _echo(self, stood_by: int) -> None:
        """Say that standby ``stood_by`` (0: none) is carried out.

        A draining agent stops this worker when it has left its round, and not before. Leaving
        as planned, it says so once the next round's members have all left theirs
        (:data:`HANDOVER_S`)."""
        if not stood_by:
            return
        h = self._handover
        if h and not set_up_begun(
            h["store_host"], h["store_port"], h["next_round"], h["world_size"], HANDOVER_S
        ):
            log.warning("round %d not set up within %.0f s; leaving", h["next_round"], HANDOVER_S)
        self.status["stood_by"] = stood_by
        self.channel.send("status", waiting=False, **self.status)

    def begin_step(self, step: int) -> bool:
        """Begin ``step``, unless a planned switch is due first; whether it began.

        Called by the training thread between steps. A due switch aborts the communicator, as a
        message does. The step is marked begun under the lock the message reader takes, so a
        switch that comes later finds it begun (:meth:`_leave_round`). Past the step it told a
        draining agent it can stop after, it waits up to :data:`HOLD_S` for the agent's switch:
        its peers stop there, and a step begun without them would fail on a lost peer."""
        last = step - 1
        with self._lock:
            if self._switch is None and self._promised and last >= self._promised:
                self._switched.wait_for(lambda: self._switch is not None, HOLD_S)
            if self._switch is None or last < self._switch[0]:
                self.status.update(phase="step", step=step)
                return True
            _, reason, before_round, stood_by = self._switch
            self._switch, self._promised = None, 0
        self._abort(f"{reason} (after step {last}, as planned)", before_round, stood_by)
        return False

    def left_round(self) -> None:
        """The training thread left its round some other way (a lost peer, an abort).

        A switch planned in it is moot, and would abort the next round; a standby's number
        still goes back, since a draining agent waits for it before the node may leave."""
        with self._lock:
            self.status["phase"] = "idle"  # a message from now on is carried out at once
            pending, self._switch, self._promised = self._switch, None, 0
        if pending is not None:
            self._echo(pending[3])

    def next_assignment(self, after: int, timeout: float) -> Assignment | None:
        """The newest assignment to a round later than ``after``; None on timeout."""
        deadline = time.monotonic() + timeout
        newest: Assignment | None = None
        while True:
            try:
                block = newest is None
                item = self._inbox.get(block, max(0.0, deadline - time.monotonic()) if block else 0)
            except queue.Empty:
                if newest is not None or time.monotonic() >= deadline:
                    return newest
                continue
            if item is None:
                newest = None  # standby: wait for the agent's next round
            elif item.round > after:
                newest = item

    def _heartbeat(self) -> None:
        while self.channel.send(
            "status", waiting=self.hook.waiting_for_peers, **self.status
        ) and not self.channel.closed.wait(HEARTBEAT_S):
            pass
