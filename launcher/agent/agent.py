"""The per-node agent: joins the job in etcd and supervises this node's workers across rounds.

One agent runs on every node (``cluster=bare_metal``), or one per simulated node
(``cluster=local``). It gets the node admitted (:mod:`launcher.agent.admission`), starts one worker
per GPU or CPU slot once, and then loops: gather the facts (worker exits, the rendezvous's view,
probes of peers, the time), decide with the pure functions of :mod:`launcher.agent.decisions`,
act (send the workers into a round or to standby, restart a crashed worker, rejoin after
fencing, leave as planned, finish), and wait for its inbox (:mod:`launcher.agent.inbox`).
Workers ignore SIGTERM: a signal sent to the whole node reaches them too, and the agent decides
when they stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from elastic import config
from elastic import event_types as ev
from elastic.control import EXIT_UNSAVED
from elastic.events import EventLog, Rotation
from launcher.agent import decisions as decide
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
from launcher.agent.parts import Node, assemble, connect_etcd, start_workers
from launcher.agent.peers import PROBE_AGAIN_S
from launcher.agent.progress_key import ProgressPublisher
from launcher.agent.slots import local_slots
from launcher.agent.workers import WorkerGroup
from launcher.health.gpu_watch import GpuWatch
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.etcd_client import EtcdLost
from launcher.rendezvous.lease import ETCD_LOST_FIX
from launcher.rendezvous.membership import JobView, Round
from launcher.rendezvous.rendezvous import Rendezvous

log = logging.getLogger("launcher.agent")

STOP_GRACE_S = 5.0  # how long workers get to exit after SIGTERM before SIGKILL
IDLE_WAKE_S = 1.0  # the loop looks at the workers' watchdogs and the join timeout this often


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
    ) -> None:
        self.cfg = cfg
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
        self.current: Round | None = None  # the round this node's workers were sent to
        self.crashes = 0
        self.leave_reason = ""  # why the node leaves the job, when it leaves on its own
        self.sentenced = False  # it quarantined itself (a straggler) in this registration

    # --- life cycle ----------------------------------------------------------------------------

    def run(self) -> int:
        self.events.emit(ev.AGENT_STARTED, pgid=os.getpgid(0), slots=self.slots, device=self.device)
        store = dist.TCPStore(  # used when this node holds rank 0 of a round
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.cfg.rendezvous.pg_timeout_s),
        )
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
        )
        self.rdzv, self.faults, self.peers = parts.rdzv, parts.faults, parts.peers
        self.admission = parts.admission
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
            client.close()
            return code
        self.workers, self.leaving = start_workers(
            self.node, self.config_path, self.threads, self.inbox.put, self.rdzv.record.leave_after
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
        """If this node led the job as it ended, the other nodes live in its view then (a
        leader's view holds every node); else None (:func:`launcher.alerts.reports_failure`)."""
        rdzv: Rendezvous | None = getattr(self, "rdzv", None)  # None: etcd never answered
        if rdzv is None or not rdzv.leads:
            return None
        return frozenset(rdzv.view.nodes) - {self.node_id}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.inbox.put(Signal(signum))  # reentrant: safe even if the main thread is in the queue

    def _receive(self, timeout: float) -> None:
        """Wait up to ``timeout`` for messages and take in what they alone carry; the rest only
        wake the loop, which then reads the workers and the view afresh."""
        for msg in self.inbox.take(timeout):
            self._take(msg)

    def _wait(self, timeout: float) -> None:
        """:meth:`_receive`, from the loop: a wait that overran means the agent itself did not
        run (stopped or starved); its workers' watchdogs then restart from now."""
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
            self.peers.lost_round = max(self.peers.lost_round, msg.round)
        elif isinstance(msg, WorkerLeaving):
            self.leaving.answer(msg.local_rank, msg.after_step)
        elif isinstance(msg, FaultRequested):
            self.faults.take(msg.request_id, msg.request)
        elif isinstance(msg, WorkerStraggler):
            self._on_straggler(msg)
        elif isinstance(msg, WorkerStrike):
            # A quarantine it leads to drains the node, as an operator's would.
            self.admission.strike(msg.reason)
        elif isinstance(msg, GpuFault) and not self.sentenced:
            # A broken GPU leaves whatever the job's size: a hang or corrupt gradients are worse.
            self.sentenced = self.admission.sentence(f"a GPU broke while training: {msg.reason}")

    def _loop(self) -> int:
        """Until the node is done or must go: gather the facts, decide, act, and wait for the
        inbox (at most :data:`IDLE_WAKE_S`: watchdogs, the join timeout)."""
        waiting_since = time.monotonic()
        while True:
            view = self.rdzv.view
            if self.stop_signal is not None and self._drained(view):
                return 128 + self.stop_signal
            rejoin = decide.on_membership(
                self.rdzv.fenced.is_set(),
                self.node_id in view.quarantined,
                self.rdzv.etcd_lost.is_set(),
            )
            if isinstance(rejoin, decide.StopNode):  # run() stops the workers
                self.leave_reason = f"etcd away beyond rendezvous.etcd_grace_s; {ETCD_LOST_FIX}"
                return EXIT_ETCD_LOST
            # Quarantined by an operator while training: a drain, like a stop signal.
            if rejoin is not None and (rejoin.strike or self._drained(view)):
                code = self._rejoin(rejoin)
                if code:
                    return code
                waiting_since = time.monotonic()
                continue
            self.workers.kill_frozen()
            with contextlib.suppress(*etcd_errors()):  # etcd away: followed again on a later pass
                self.faults.requests.follow()
            exits = decide.on_worker_exits(
                self.workers.exit_codes(), self.crashes, self.cfg.cluster.max_restarts
            )
            if isinstance(exits, decide.Finish):  # the others finish the same last step
                self._finish()
                return 0
            if isinstance(exits, decide.Unsaved):  # every rank ends so: no restart, not done
                self._finish()
                self.leave_reason = exits.reason
                return EXIT_UNSAVED
            if decide.leaves_done_job(view.done_in, self.current, self.peers.lost_round):
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
                code = self._restart(exits)
                if code:
                    return code
                continue
            if (
                not self.rdzv.node.ready
                and self.workers.ready
                and self.rdzv.synced
                and self.peers.reaches_the_round(self.rdzv.view)
            ):
                self.rdzv.record.set_ready()
            lost = self.peers.on_lost(self.current, view)
            if isinstance(lost, str):
                self._leave_round(lost)
            probing = isinstance(lost, decide.Probe)
            self._follow_round(view)
            self.progress.tick(self.current)  # rank 0's node: the progress key, once a second
            now = time.monotonic()
            if self.current is not None:
                waiting_since = now
            elif decide.join_timed_out(waiting_since, now, self.cfg.rendezvous.join_timeout_s):
                self.events.emit(
                    ev.JOIN_TIMEOUT,
                    f"{self.node_id} was not placed in a round within "
                    f"rendezvous.join_timeout_s={self.cfg.rendezvous.join_timeout_s:.0f}; "
                    "are cluster.min_nodes nodes up?",
                    level=logging.ERROR,
                    waited_s=now - waiting_since,
                )
                return 1
            soon = probing or self.leaving.since is not None
            self._wait(timeout=PROBE_AGAIN_S if soon else IDLE_WAKE_S)

    # --- acting on decisions -------------------------------------------------------------------

    def _drained(self, view: JobView) -> bool:
        """A stop signal came, or a quarantine: whether the node may leave now, or drains first
        (:meth:`PlannedLeave.may_leave`)."""
        why = signal.Signals(self.stop_signal).name if self.stop_signal else "quarantined"
        return self.leaving.may_leave(
            view, self.current is not None, self.rdzv.fenced.is_set(), why
        )

    def _follow_round(self, view: JobView) -> None:
        """Send the workers into a new round that lists this node, or to standby if it does not."""
        step = decide.follow_round(view, self.rdzv.node, self.current, self.workers.ready)
        if isinstance(step, decide.Standby):
            self.workers.standby(step.after_step)
            self.events.emit(ev.STANDBY, round=step.round, after_step=step.after_step)
            self.current = None
        elif isinstance(step, decide.Assign):
            rnd, me = step.round, step.member
            self.workers.assign(list(step.assignments))
            self.events.emit(
                ev.ROUND_JOINED,
                f"{self.node_id}: round {rnd.number}, ranks {me.first_rank}-"
                f"{me.first_rank + me.slots - 1} of {rnd.world_size}",
                round=rnd.number,
                world_size=rnd.world_size,
                first_rank=me.first_rank,
                nodes=rnd.size,
                **self.rdzv.load.take(),  # what this node cost etcd since its previous round
            )
            self.current = rnd

    def _leave_round(self, reason: str) -> None:
        """Leave the current round at once (a failure report), the workers standing by."""
        self.rdzv.record.report_failure(reason)
        if self.current is not None:
            self.workers.standby()
            self.current = None

    def _restart(self, plan: decide.Restart) -> int:
        """Leave the round and start the failed workers again once the node checks out healthy.
        Returns 0 to carry on, or the agent's exit code."""
        self.crashes = plan.crashes
        self._leave_round(plan.reason)
        failed = [self.workers.slots[i] for i in plan.local_ranks]
        for s in failed:
            s.stop(0)
        if plan.strike is not None:
            if self.admission.strike(plan.strike):
                return self._rejoin(decide.Rejoin("quarantined", strike=False))
            code = self.admission.check(in_running_job=True)
            if code:
                return code
        for s in failed:
            s.start()
        return 0

    def _rejoin(self, rejoin: decide.Rejoin) -> int:
        """Fenced or quarantined: this node's rounds go on without it. Leave, wait out any
        quarantine, check the node again and join as a new member; 0, or the exit code."""
        sentenced = self.admission.strike(rejoin.reason) if rejoin.strike else None
        quarantined = sentenced is not None or self.node_id in self.rdzv.view.quarantined
        keep = decide.keeps_workers(rejoin, quarantined, self.workers.exit_codes())
        log.warning(
            "%s %s; leaving, to join again as a new member (its workers %s)",
            self.node_id,
            rejoin.reason,
            "stand by" if keep else "stop",
        )
        if keep:
            self.workers.standby()
        else:
            self.workers.stop(STOP_GRACE_S)
        self.current = None
        self.leaving.reset()
        self.sentenced = False
        self.rdzv.leave()
        code = self._join(in_running_job=True)
        if code:
            return code
        if not keep:
            for s in self.workers.slots:
                s.start()
        return 0

    def _finish(self) -> None:
        """A local worker trained the job to its end: let the others end too, then mark the job
        done if all of them saved it (exit 0; not :data:`EXIT_UNSAVED`)."""
        deadline = time.monotonic() + STOP_GRACE_S * 6
        while None in self.workers.exit_codes() and not self.rdzv.fenced.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(timeout=min(left, IDLE_WAKE_S))
        if all(c == 0 for c in self.workers.exit_codes()):
            # The round they trained it in: a node still in a later one leaves at once.
            finished_in = self.workers.finished_in(timeout_s=STOP_GRACE_S)
            if finished_in is None:
                finished_in = self.current.number if self.current else 0
            try:
                self.rdzv.mark_done(finished_in)
            except EtcdLost as exc:  # the others finish the same last step on their own
                log.warning("%s: could not mark the job done: %s", self.node_id, exc)
        self.current = None

    # --- health and quarantine -----------------------------------------------------------------

    def _on_straggler(self, msg: WorkerStraggler) -> None:
        """A worker of this node straggles: evict the node or keep it
        (:func:`launcher.agent.decisions.on_straggler`). An evicted node quarantines itself, and
        the loop drains it as it drains a node an operator quarantined."""
        view = self.rdzv.view
        leaving = self.leaving.since is not None or self.sentenced
        step = decide.on_straggler(
            self.cfg.health.straggler.value,
            self.node_id,
            msg.slowdown,
            decide.others_go_on(view, self.node_id, self.cfg.cluster.min_nodes),
            leaving=leaving or self.node_id in view.quarantined,
        )
        evict = isinstance(step, decide.Evict)
        found = {"slowdown": msg.slowdown, "step": msg.step, "at": time.time(), "evicted": evict}
        with contextlib.suppress(*etcd_errors()):  # for launcher.status; the events keep it too
            self.rdzv.put_under_lease(self.rdzv.keys.straggler(self.node_id), json.dumps(found))
        if isinstance(step, decide.Evict):
            # The watch brings the quarantine to the view, and the loop drains the node.
            self.sentenced = self.admission.sentence(step.reason)
            return
        self.events.emit(ev.STRAGGLER_KEPT, reason=step, step=msg.step, slowdown=msg.slowdown)

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
