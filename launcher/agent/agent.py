"""The per-node agent: joins the job in etcd and supervises this node's workers across rounds.

One agent runs on every node (``cluster=bare_metal``), or one per simulated node
(``cluster=local``). It gets the node admitted (:mod:`launcher.agent.admission`), starts one worker
per GPU or CPU slot once, and then loops: gather the facts (worker exits, the rendezvous's view,
probes of peers, the time), decide with the pure functions of :mod:`launcher.agent.decisions`,
act (:mod:`launcher.agent.actions`: send the workers into a round or to standby, restart a
crashed worker, rejoin after fencing, finish; or leave as planned), and wait for its inbox
(:mod:`launcher.agent.inbox`). What the node finds wrong with itself while training (a straggler,
a broken GPU) is judged by :mod:`launcher.agent.self_quarantine`.
Workers ignore SIGTERM: a signal sent to the whole node reaches them too, and the agent decides
when they stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from elastic import config
from elastic import event_types as ev
from elastic.control import EXIT_UNSAVED
from elastic.events import EventLog, Rotation
from launcher.agent import decisions as decide
from launcher.agent.actions import IDLE_WAKE_S, STOP_GRACE_S, Actions
from launcher.agent.admission import EXIT_ETCD_LOST, EXIT_UNHEALTHY
from launcher.agent.inbox import (
    FaultRequested,
    GpuFault,
    Inbox,
    Message,
    Signal,
    WorkerLeaving,
    WorkerPeerLost,
    WorkerStraggler,
    WorkerStrike,
)
from launcher.agent.parts import Node, assemble, connect_etcd, round_store, start_workers
from launcher.agent.peer_decisions import Fruitless, Probe
from launcher.agent.peers import PROBE_AGAIN_S
from launcher.agent.progress_key import ProgressPublisher
from launcher.agent.self_quarantine import SelfQuarantine
from launcher.agent.slots import local_slots
from launcher.agent.workers import WorkerGroup
from launcher.health.gpu_watch import GpuWatch
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.lease import ETCD_LOST_FIX
from launcher.rendezvous.membership import JobView
from launcher.rendezvous.rendezvous import Rendezvous

log = logging.getLogger("launcher.agent")


class Agent:
    """One node's agent; :meth:`run` is its whole life and returns its exit code."""

    def __init__(
        self,
        cfg: config.Config,
        config_path: str,
        node_id: str,
        host: str,
        endpoints: list[str],
        nodes_on_machine: int = 1,
        metrics_port: int | None = None,
    ) -> None:
        """``metrics_port``: where this node serves /metrics; None: ``metrics.port``."""
        self.cfg = cfg
        self.metrics_port = cfg.metrics.port if metrics_port is None else metrics_port
        self.config_path = config_path
        self.node_id = node_id
        self.host = host
        self.endpoints = endpoints
        self.slots, self.device = local_slots(cfg)
        cores = os.cpu_count() or 1
        self.threads = cfg.cluster.threads_per_worker or max(
            1, cores // (self.slots * nodes_on_machine)
        )
        self.run_dir = Path(cfg.run_dir)
        rotation = Rotation.of_mb(cfg.trainer.events_rotate_mb, cfg.trainer.events_keep)
        self.events = EventLog(self.run_dir, node_id, logger=log, rotation=rotation, role="agent")
        self.node = Node(
            cfg, node_id, host, endpoints, self.slots, self.device, self.run_dir, self.events
        )
        self.inbox = Inbox()
        self.stop_signal: int | None = None
        self.rdzv: Rendezvous
        self.workers: WorkerGroup
        self._pids: Callable[[], dict[str, int]] = dict  # the workers', once they are started
        self.degraded: SelfQuarantine
        self.act: Actions
        self.leave_reason = ""  # why the node leaves the job, when it leaves on its own

    # --- life cycle ----------------------------------------------------------------------------

    def run(self) -> int:
        self.events.emit(ev.AGENT_STARTED, pgid=os.getpgid(0), slots=self.slots, device=self.device)
        store = round_store(self.cfg.rendezvous.pg_timeout_s)
        client = connect_etcd(self.node)
        if client is None:
            return EXIT_UNHEALTHY
        parts = assemble(
            self.node,
            client,
            store.port,
            self.inbox.put,
            stopped=self._stopped,
            worker_pid=lambda i: p.pid if (p := self.workers.slots[i].proc) else 0,
            metrics=(self.metrics_port, lambda: self._pids()),
        )
        self.rdzv, self.faults, self.peers = parts.rdzv, parts.faults, parts.peers
        self.admission = parts.admission
        with contextlib.ExitStack() as metrics_served:
            if parts.metrics is not None:
                metrics_served.callback(parts.metrics.close)
            return self._run(client.close)

    def _run(self, close_client: Callable[[], None]) -> int:
        """Join, start the workers and follow the job until this node leaves it.

        ``close_client`` closes the etcd client, when the node leaves before it joined."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        code = self._join(in_running_job=False)
        if code:  # an unfit node's checks said why already; etcd's refusal is said here
            self.events.emit(
                ev.NODE_LEFT,
                f"{self.node_id}: {self.leave_reason}" if self.leave_reason else None,
                level=logging.ERROR,
                code=code,
                signal=self.stop_signal,
                reason=self.leave_reason,
            )
            close_client()
            return code
        self.workers, self.leaving = start_workers(
            self.node, self.config_path, self.threads, self.inbox.put, self.rdzv.record.leave_after
        )
        self._pids = self.workers.pids
        self.degraded = SelfQuarantine(
            self.cfg, self.node_id, self.rdzv, self.admission, self.leaving, self.events
        )
        self.act = Actions(
            self.node_id,
            self.rdzv,
            self.workers,
            self.leaving,
            self.admission,
            self.degraded,
            self.events,
            join=self._join,
            receive=self._receive,
        )
        self.progress = ProgressPublisher(
            str(self.run_dir),
            self.node_id,
            self.cfg.checkpoint.url,
            put=lambda value: self.rdzv.put_under_lease(self.rdzv.keys.progress, value),
        )
        gpus = GpuWatch(self.cfg.health, self.device, self.events, self._on_gpu_fault)
        gpus.start()
        code = 1
        try:
            code = self._loop()
        finally:
            gpus.close()
            self.progress.close()
            self.workers.stop(STOP_GRACE_S)
            self.rdzv.leave()
            self.events.emit(
                ev.NODE_LEFT, code=code, signal=self.stop_signal, reason=self.leave_reason
            )
            # The client's channel is left to the process's exit: closed, it makes the etcd
            # client's watch thread (etcd3 0.12) die with a traceback in every agent's log.
        return code

    def others_led(self) -> frozenset[str] | None:
        """The other nodes, from its view, if this node led the job as it ended; else None.

        A leader's view holds every node (:func:`launcher.alerts.reports_failure`)."""
        rdzv: Rendezvous | None = getattr(self, "rdzv", None)  # None: etcd never answered
        if rdzv is None or not rdzv.leads:
            return None
        return frozenset(rdzv.view.nodes) - {self.node_id}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.inbox.put(Signal(signum))  # reentrant: safe even if the main thread is in the queue

    def _receive(self, timeout: float) -> None:
        """Wait up to ``timeout`` for messages and take in what they alone carry.

        The rest only wake the loop, which then reads the workers and the view afresh."""
        for msg in self.inbox.take(timeout):
            self._take(msg)

    def _wait(self, timeout: float) -> None:
        """Receive messages for the loop (:meth:`_receive`), and notice a wait that overran.

        A wait that overran means the agent itself did not run (stopped or starved); its
        workers' watchdogs then restart from now."""
        began = time.monotonic()
        self._receive(timeout)
        now = time.monotonic()
        away = decide.away_for(timeout, now - began)
        if away:
            self.events.emit(
                ev.AGENT_RESUMED,
                f"{self.node_id}: the agent did not run for {away:.1f} s (stopped or starved "
                "of CPU); its workers' silence in that time is not held against them",
                level=logging.WARNING,
                away_s=round(away, 3),
            )
            for slot in self.workers.slots:
                slot.excuse(now)
            self.rdzv.confirm()  # evicted while stopped: fenced before it follows a stale round

    def _take(self, msg: Message) -> None:
        if isinstance(msg, Signal):
            self.stop_signal = msg.signum
        elif isinstance(msg, WorkerPeerLost):
            self.peers.lost(msg.round, msg.trained)
        elif isinstance(msg, WorkerLeaving):
            self.leaving.answer(msg.local_rank, msg.after_step)
        elif isinstance(msg, FaultRequested):
            self.faults.take(msg.request_id, msg.request)
        elif isinstance(msg, WorkerStraggler):
            self.degraded.straggler(msg)
        elif isinstance(msg, WorkerStrike):
            # A quarantine it leads to drains the node, as an operator's would.
            self.admission.strike(msg.reason)
        elif isinstance(msg, GpuFault):
            self.degraded.gpu_broke(msg.reason)

    def _loop(self) -> int:
        """Gather the facts, decide, act and wait, until the node is done or must go.

        It waits for the inbox at most :data:`IDLE_WAKE_S`, for the watchdogs and the join
        timeout."""
        waiting_since = time.monotonic()
        while True:
            view = self.rdzv.view
            if self.stop_signal is not None and self._drained(view):
                return 128 + self.stop_signal
            rejoin = decide.on_membership(
                self.rdzv.fenced.is_set(),
                self.node_id in view.quarantined,
                self.rdzv.etcd_lost.is_set(),
                draining=self.stop_signal is None and self.leaving.since is not None,
            )
            if isinstance(rejoin, decide.StopNode):  # run() stops the workers
                self.leave_reason = f"etcd away beyond rendezvous.etcd_grace_s; {ETCD_LOST_FIX}"
                return EXIT_ETCD_LOST
            # Quarantined by an operator while training: a drain, like a stop signal.
            if rejoin is not None and (rejoin.strike or self._drained(view)):
                code = self.act.rejoin(rejoin)
                if code:
                    return code
                waiting_since = time.monotonic()
                continue
            self.workers.kill_frozen()
            with contextlib.suppress(*etcd_errors()):  # etcd away: followed again on a later pass
                self.faults.requests.follow()
            exits = decide.on_worker_exits(
                self.workers.exit_codes(), self.act.crashes, self.cfg.cluster.max_restarts
            )
            if isinstance(exits, decide.Finish):  # the others finish the same last step
                self.act.finish()
                return 0
            if isinstance(exits, decide.Unsaved):  # every rank ends so: no restart, not done
                self.act.finish()
                self.leave_reason = exits.reason
                return EXIT_UNSAVED
            if decide.leaves_done_job(view.done_in, self.act.current, self.peers.lost_round):
                log.info("the job is done")
                return 0
            if isinstance(exits, decide.GiveUp):
                self.events.emit(
                    ev.RESTART_LIMIT,
                    exits.message(self.node_id),
                    level=logging.ERROR,
                    crashes=exits.crashes,
                    max_restarts=exits.max_restarts,
                )
                return 1
            if isinstance(exits, decide.Restart):
                code = self.act.restart(exits)
                if code:
                    return code
                continue
            if code := self._say_ready():
                return code
            lost = self.peers.on_lost(self.act.current, view, self.workers.step)
            if isinstance(lost, Fruitless):
                self.leave_reason = lost.message()
                log.error("%s stops: %s", self.node_id, self.leave_reason)
                return 1
            if isinstance(lost, str):
                self.act.leave_round(lost)
            probing = isinstance(lost, Probe)
            self.act.follow_round(view)
            self.progress.tick(self.act.current)  # rank 0's node: the progress key, once a second
            now = time.monotonic()
            if self.act.current is not None:
                waiting_since = now
            elif decide.join_timed_out(waiting_since, now, self.cfg.rendezvous.join_timeout_s):
                self._not_placed(now - waiting_since)
                return 1
            soon = probing or self.leaving.since is not None
            self._wait(timeout=PROBE_AGAIN_S if soon else IDLE_WAKE_S)

    def _not_placed(self, waited_s: float) -> None:
        timeout = self.cfg.rendezvous.join_timeout_s
        self.events.emit(
            ev.JOIN_TIMEOUT,
            f"{self.node_id} was not placed in a round within rendezvous.join_timeout_s="
            f"{timeout:.0f}; are cluster.min_nodes nodes up?",
            level=logging.ERROR,
            waited_s=waited_s,
        )

    def _say_ready(self) -> int:
        """:meth:`Admission.say_ready`: 0, or the exit code of a node its job's layout refuses."""
        code = self.admission.say_ready(
            self.workers.ready, lambda: self.peers.reaches_the_round(self.rdzv.view)
        )
        if code:
            self.leave_reason = self.admission.reason
        return code

    def _drained(self, view: JobView) -> bool:
        """Whether the node may leave now, or drains first (:meth:`PlannedLeave.may_leave`).

        It is asked once a stop signal came, or a quarantine."""
        why = signal.Signals(self.stop_signal).name if self.stop_signal else "quarantined"
        return self.leaving.may_leave(
            view, self.act.current is not None, self.rdzv.fenced.is_set(), why
        )

    def _join(self, in_running_job: bool) -> int:
        """:meth:`Admission.join`: 0 once registered, else the exit code and its reason."""
        code = self.admission.join(in_running_job)
        if code:
            self.leave_reason = self.admission.reason
        return code

    def _on_gpu_fault(self, reason: str) -> None:
        self.inbox.put(GpuFault(reason))  # from the watch's thread

    def _stopped(self, timeout: float) -> int | None:
        """The stop signal, once the messages that come within ``timeout`` are taken in."""
        self._receive(timeout)
        return self.stop_signal
