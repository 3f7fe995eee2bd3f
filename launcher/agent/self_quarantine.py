"""What a node does when it finds itself degraded while training: a straggler, a broken GPU.

A degraded node quarantines itself (:meth:`Admission.sentence`), and the agent's loop then drains
it as it drains a node an operator quarantined. Kept apart from the loop, which only gathers
facts, decides and acts: these findings arrive in its inbox and are judged here.
"""

from __future__ import annotations

import contextlib
import json
import time

from elastic import config
from elastic import event_types as ev
from elastic.events import EventLog
from launcher.agent import decisions as decide
from launcher.agent.admission import Admission
from launcher.agent.inbox import WorkerStraggler
from launcher.agent.planned_leave import PlannedLeave
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.rendezvous import Rendezvous


class SelfQuarantine:
    """One node's judgement of its own findings.

    :attr:`sentenced` is True once it quarantined itself in this registration; then a further
    finding changes nothing."""

    def __init__(
        self,
        cfg: config.Config,
        node_id: str,
        rdzv: Rendezvous,
        admission: Admission,
        leaving: PlannedLeave,
        events: EventLog,
    ) -> None:
        self._cfg, self._node_id, self._rdzv, self._admission = cfg, node_id, rdzv, admission
        self._leaving, self._events = leaving, events
        self.sentenced = False

    def reset(self) -> None:
        """A new registration: not sentenced in it yet."""
        self.sentenced = False

    def gpu_broke(self, reason: str) -> None:
        """A GPU of this node broke (:mod:`launcher.health.gpu_watch`): the node leaves."""
        if not self.sentenced:
            # A broken GPU leaves whatever the job's size: a hang or corrupt gradients are worse.
            self.sentenced = self._admission.sentence(f"a GPU broke while training: {reason}")

    def straggler(self, msg: WorkerStraggler) -> None:
        """A worker of this node straggles: evict the node or keep it.

        :func:`launcher.agent.decisions.on_straggler` decides. An evicted node quarantines itself,
        and the loop drains it as it drains a node an operator quarantined."""
        view = self._rdzv.view
        leaving = self._leaving.since is not None or self.sentenced
        step = decide.on_straggler(
            self._cfg.health.straggler.value,
            self._node_id,
            msg.slowdown,
            decide.others_go_on(view, self._node_id, self._cfg.cluster.min_nodes),
            leaving=leaving or self._node_id in view.quarantined,
        )
        evict = isinstance(step, decide.Evict)
        found = {"slowdown": msg.slowdown, "step": msg.step, "at": time.time(), "evicted": evict}
        with contextlib.suppress(*etcd_errors()):  # for the status command; the events keep it too
            self._rdzv.put_under_lease(self._rdzv.keys.straggler(self._node_id), json.dumps(found))
        if isinstance(step, decide.Evict):
            # The watch brings the quarantine to the view, and the loop drains the node.
            self.sentenced = self._admission.sentence(step.reason)
            return
        self._events.emit(ev.STRAGGLER_KEPT, reason=step, step=msg.step, slowdown=msg.slowdown)
