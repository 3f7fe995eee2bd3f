"""The per-node agent: joins the job in etcd and supervises this node's workers across rounds.

One agent runs on every node (``cluster=bare_metal``), or one per simulated node
(``cluster=local``, spawned by :mod:`launcher.local_cluster`). Its life:

1. Prove the node fit (:mod:`launcher.health.checks`): wait out a quarantine if there is one, then
   run the health checks and publish the report to etcd. A node that fails them does not join; it
   exits with :data:`EXIT_UNHEALTHY` and the others carry on without it.
2. Host a c10d TCPStore (used when this node holds rank 0 of a round), register in etcd, and start
   one worker per GPU or CPU slot. Workers load data and model, then say they are ready; the node
   then reports itself ready and the leader places it in the next round.
3. Whenever a new round lists this node, send each worker its rank in it over the control
   channel; the workers rebuild their process group in place and carry on from the newest state
   any of them holds. A round without this node puts the workers on standby.
4. Faults: a worker that reports a failed collective makes the agent probe the round's other
   agents, and a peer that refuses the connection is dead: its key is deleted at once, and the
   leader forms a smaller round. A local worker that crashes, or that the watchdog finds frozen,
   makes this node leave the round at once (the incarnation goes up) and is started again; the
   node comes back in a later round. A node that lost its lease (fenced) puts its workers on
   standby and registers again as a new member; its workers enter the next round with the
   survivors' state (a quarantined node stops them instead). Each crash or fencing is a strike
   (:mod:`launcher.health.quarantine`); too many and the node is quarantined: it leaves, waits
   out the cooldown and starts over at 1.
   The health checks run again before every rejoin and every worker restart.
5. When the workers finish the job, mark it done; when another node did, leave too.

The node that holds global rank 0 also writes the job's ``progress`` key, at most once a second,
from its rank-0 worker's step events (:mod:`launcher.rendezvous.progress_key`), for ``python -m
launcher.status``.

SIGTERM or SIGINT stops a node cleanly. A node in a round that goes on without it leaves as
planned: it asks its workers after which step they can stop (the step in flight and the next),
publishes that step, and the others form the next round without it and switch to it between two
steps, so no step is dropped and no failure has to be detected. Then its workers are stopped and
its lease revoked (its keys vanish at once). Workers ignore SIGTERM: a signal sent to the whole
node reaches them too, and the agent decides when they stop.

Everything the agent reacts to arrives in its inbox (:mod:`launcher.agent.inbox`): worker messages
and exits, signals, fault requests (:mod:`launcher.agent.fault_requests`), and changes of the
rendezvous's view. Its loop is "gather the facts, decide, act":
the decisions (what a worker exit, a lost peer, fencing or quarantine, a new round mean for this
node) are pure functions in :mod:`launcher.agent.decisions`, and the loop carries out their answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from elastic import config
from elastic.control import WorkerEnv
from elastic.events import EventLog
from launcher.agent import decisions as decide
from launcher.agent.fault_requests import FaultRequests
from launcher.agent.inbox import (
    FaultRequested,
    Inbox,
    Message,
    RendezvousChanged,
    Signal,
    WorkerLeaving,
    WorkerPeerLost,
)
from launcher.agent.slots import local_slots
from launcher.agent.workers import WorkerGroup
from launcher.health.checks import run_checks
from launcher.health.quarantine import Entry, Quarantine, clear_command
from launcher.health.report import Status
from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_errors, etcd_security
from launcher.rendezvous.lease import ETCD_LOST_FIX
from launcher.rendezvous.membership import JobView, Member, NodeRecord, Round
from launcher.rendezvous.progress_key import ProgressPublisher
from launcher.rendezvous.rendezvous import (
    EtcdDenied,
    EtcdLost,
    NodeIdInUse,
    Rendezvous,
)

log = logging.getLogger("launcher.agent")

STOP_GRACE_S = 5.0  # how long workers get to exit after SIGTERM before SIGKILL
EXIT_UNHEALTHY = 3  # the node failed its health checks (or cannot reach etcd) and did not join
EXIT_ETCD_LOST = 4  # etcd stayed away beyond rendezvous.etcd_grace_s; the checkpoint is kept
EXIT_NODE_ID_IN_USE = 5  # another live node holds this node's id (cluster.node_id)
QUARANTINE_POLL_S = 2.0  # how often a quarantined node looks up from its wait (signals)
IDLE_WAKE_S = 1.0  # the loop looks at the workers' watchdogs and the join timeout this often
PROBE_AGAIN_S = 0.2  # after a failed collective, peers are probed this often until a new round
# A survivor that is not the round's first live member evicts a dead peer itself after probing
# this long (or a lease TTL, if shorter) with the round still standing. The first one may be
# frozen, or may not have seen the failure at all: gloo's ring leaves a rank waiting on a live
# neighbour that gave up, without an error, so its agent never probes.
EVICT_BACKUP_S = 1.0


def probe(host: str, port: int, timeout_s: float) -> decide.Reach:
    """Whether an agent listens at ``host:port``. A refused connection means its process is
    gone; a stopped process still accepts (the kernel does), so a frozen node is not "dead";
    no answer at all within ``timeout_s`` is the network (or a machine that is off)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return decide.Reach.ALIVE
    except ConnectionRefusedError:
        return decide.Reach.DEAD
    except OSError:
        return decide.Reach.UNREACHABLE


class Agent:
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
        self.events = EventLog(self.run_dir, node_id, logger=log, role="agent")
        self.inbox = Inbox()
        self.stop_signal: int | None = None
        self.rdzv: Rendezvous
        self.guard: Quarantine
        self.workers: WorkerGroup
        self.current: Round | None = None  # the round this node's workers were sent to
        self.crashes = 0
        self.lost_round = 0  # the newest round in which a local worker saw a collective fail
        self.probing_since: float | None = None  # monotonic: when probing for lost_round began
        self.leave_reason = ""  # why the node leaves the job, when it leaves on its own
        self.draining_since: float | None = None  # a planned leave: when the workers were asked
        self.leave_answers: dict[int, int] = {}  # local rank: the step it can stop after
        self.cut_off = False  # it could not reach the round's members when it last looked
        self.requests_taken: set[str] = set()  # fault requests answered (a re-read repeats them)

    # --- life cycle ----------------------------------------------------------------------------

    def run(self) -> int:
        self.events.emit("agent_started", pgid=os.getpgid(0), slots=self.slots, device=self.device)
        store = dist.TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.cfg.rendezvous.pg_timeout_s),
        )
        try:
            client = connect(
                self.endpoints,
                timeout_s=self.cfg.health.etcd_timeout_s,
                security=etcd_security(self.cfg.cluster),
            )
        except EtcdUnavailable as exc:
            self.events.emit(
                "node_left",
                f"{self.node_id} cannot join: {exc}",
                level=logging.ERROR,
                code=EXIT_UNHEALTHY,
                signal=None,
                reason=str(exc),
            )
            return EXIT_UNHEALTHY
        self.guard = Quarantine(
            client, self.cfg.rendezvous.prefix, self.cfg.job_id, self.cfg.health, self.events
        )
        self.rdzv = Rendezvous(
            client,
            job_id=self.cfg.job_id,
            node=NodeRecord(self.node_id, self.host, store.port, self.slots),
            cfg=self.cfg.rendezvous,
            min_nodes=self.cfg.cluster.min_nodes,
            max_nodes=config.max_nodes(self.cfg),
            events=self.events,
            on_change=lambda: self.inbox.put(RendezvousChanged()),
        )
        self.requests = FaultRequests(
            client,
            self.cfg.rendezvous.prefix,
            self.cfg.job_id,
            self.node_id,
            post=lambda rid, request: self.inbox.put(FaultRequested(rid, request)),
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        code = self._admit(in_running_job=False) or self._register()
        if code:  # an unfit node's checks said why already; etcd's refusal is said here
            self.events.emit(
                "node_left",
                f"{self.node_id}: {self.leave_reason}" if self.leave_reason else None,
                level=logging.ERROR,
                code=code,
                signal=self.stop_signal,
                reason=self.leave_reason,
            )
            client.close()
            return code
        envs = [
            WorkerEnv(
                config=self.config_path,
                run_dir=str(self.run_dir),
                node_id=self.node_id,
                local_rank=i,
                local_world_size=self.slots,
                threads=self.threads,
            )
            for i in range(self.slots)
        ]
        self.workers = WorkerGroup.start(
            envs,
            self.run_dir / "logs" / self.node_id,
            self.events,
            self.cfg.rendezvous.watchdog_s,
            post=self.inbox.put,
        )
        log.info(
            "%s joined job %s (%d %s worker(s))",
            self.node_id,
            self.cfg.job_id,
            self.slots,
            self.device,
        )
        self.progress = ProgressPublisher(
            str(self.run_dir),
            self.node_id,
            self.cfg.checkpoint.url,
            put=lambda value: self.rdzv.put_under_lease(self.rdzv.keys.progress, value),
        )
        code = 1
        try:
            code = self._loop()
        finally:
            self.progress.close()
            self.workers.stop(STOP_GRACE_S)
            self.rdzv.leave()
            self.events.emit(
                "node_left", code=code, signal=self.stop_signal, reason=self.leave_reason
            )
            # The client's channel is left to the process's exit: closed, it makes the etcd
            # client's watch thread (etcd3 0.12) die with a traceback in every agent's log.
        return code

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
                "agent_resumed",
                f"{self.node_id}: the agent did not run for {away:.1f} s (stopped or starved "
                "of CPU); its workers' silence in that time is not held against them",
                level=logging.WARNING,
                away_s=round(away, 3),
            )
            for slot in self.workers.slots:
                slot.excuse(now)

    def _take(self, msg: Message) -> None:
        if isinstance(msg, Signal):
            self.stop_signal = msg.signum
        elif isinstance(msg, WorkerPeerLost):
            self.lost_round = max(self.lost_round, msg.round)
        elif isinstance(msg, WorkerLeaving):
            self.leave_answers[msg.local_rank] = msg.after_step
            if len(self.leave_answers) == len(self.workers.slots):
                self.rdzv.record.leave_after(max(self.leave_answers.values()))
        elif isinstance(msg, FaultRequested) and msg.request_id not in self.requests_taken:
            self.requests_taken.add(msg.request_id)
            self._on_fault_request(msg.request_id, msg.request)

    def _on_fault_request(self, request_id: str, request: dict[str, Any]) -> None:
        """Answer a fault request; if accepted, hand it to ``python -m
        launcher.agent.fault_helper``, in
        a session of its own, so that it outlives this agent when it stops or kills it."""
        answer = decide.answer_fault_request(request, self.cfg.chaos.allow, self.slots)
        kind, by = request.get("kind"), request.get("by", "?")
        if answer.accepted:
            self.events.emit(
                "fault_request_accepted",
                f"{self.node_id}: carrying out {kind} requested by {by}",
                request=request_id,
                kind=kind,
                by=by,
            )
        else:
            self.events.emit(
                "fault_refused",
                f"{self.node_id}: refused a {kind} request from {by}: {answer.reason}",
                level=logging.WARNING,
                request=request_id,
                kind=kind,
                by=by,
                reason=answer.reason,
            )
        try:
            self.requests.answer(request_id, answer)
        except etcd_errors() as exc:  # the requester then times out and says so
            log.warning("%s: could not answer fault request %s (%s)", self.node_id, request_id, exc)
        if not answer.accepted:
            return
        local_rank = int(request.get("local_rank", 0))
        slot = self.workers.slots[local_rank]
        argv = [
            sys.executable,
            "-m",
            "launcher.agent.fault_helper",
            f"--run-dir={self.run_dir}",
            f"--node={self.node_id}",
            f"--agent-pid={os.getpid()}",
            f"--kind={kind}",
            f"--duration-s={float(request.get('duration_s', 0))}",
            f"--restart-after-s={float(request.get('restart_after_s', -1))}",
            f"--worker-pid={slot.proc.pid if slot.proc else 0}",
            f"--local-rank={local_rank}",
        ]
        with open(self.run_dir / "logs" / f"{self.node_id}.chaos.log", "ab") as out:
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _loop(self) -> int:
        """Until the node is done or must go: gather the facts, decide
        (:mod:`launcher.agent.decisions`),
        act, and wait for the inbox (at most :data:`IDLE_WAKE_S`: watchdogs, the join timeout)."""
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
            self._kill_frozen()
            with contextlib.suppress(*etcd_errors()):  # etcd away: followed again on a later pass
                self.requests.follow()
            exits = decide.on_worker_exits(
                self.workers.exit_codes(), self.crashes, self.cfg.cluster.max_restarts
            )
            if isinstance(exits, decide.Finish):  # the others finish the same last step
                self._finish()
                return 0
            if decide.leaves_done_job(view.done_in, self.current, self.lost_round):
                log.info("the job is done")
                return 0
            if isinstance(exits, decide.GiveUp):
                self.events.emit(
                    "restart_limit",
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
                and self._reaches_the_round(self.rdzv.view)
            ):
                self.rdzv.record.set_ready()
            probing = self._probe_peers(view)
            self._follow_round(view)
            self.progress.tick(self.current)  # rank 0's node: the progress key, once a second
            now = time.monotonic()
            if self.current is not None:
                waiting_since = now
            elif decide.join_timed_out(waiting_since, now, self.cfg.rendezvous.join_timeout_s):
                self.events.emit(
                    "join_timeout",
                    f"{self.node_id} was not placed in a round within "
                    f"rendezvous.join_timeout_s={self.cfg.rendezvous.join_timeout_s:.0f}; "
                    "are cluster.min_nodes nodes up?",
                    level=logging.ERROR,
                    waited_s=now - waiting_since,
                )
                return 1
            soon = probing or self.draining_since is not None
            self._wait(timeout=PROBE_AGAIN_S if soon else IDLE_WAKE_S)

    # --- acting on decisions -------------------------------------------------------------------

    def _drained(self, view: JobView) -> bool:
        """A stop signal came, or a quarantine: whether the node may leave now, or drains first
        (:func:`decisions.on_stop`); a drain is started here."""
        now = time.monotonic()
        since = self.draining_since
        answered = len(self.leave_answers) == len(self.workers.slots)
        step = decide.on_stop(
            in_round=self.current is not None,
            others_go_on=decide.others_go_on(view, self.node_id, self.cfg.cluster.min_nodes),
            asked=since is not None,
            out=(self.current is None and self.workers.out_of_round)
            or (answered and max(self.leave_answers.values()) == 0)
            or self.rdzv.fenced.is_set()
            or any(code is not None for code in self.workers.exit_codes()),
            overdue=since is not None and now - since > 2 * self.cfg.rendezvous.watchdog_s,
        )
        if isinstance(step, decide.Drain):
            self.draining_since = now
            why = signal.Signals(self.stop_signal).name if self.stop_signal else "quarantined"
            self.events.emit("node_draining", reason=why)
            self.workers.leave()
        return isinstance(step, decide.Leave)

    def _kill_frozen(self) -> None:
        """Kill the workers the watchdog takes for frozen; they are restarted as crashed."""
        for slot in self.workers.slots:
            reason = slot.frozen()
            if reason is not None:
                self.events.emit(
                    "worker_frozen",
                    f"{self.node_id}: worker {slot.env.local_rank} frozen ({reason})",
                    level=logging.WARNING,
                    local_rank=slot.env.local_rank,
                    reason=reason,
                )
                slot.kill()

    def _follow_round(self, view: JobView) -> None:
        """Send the workers into a new round that lists this node, or to standby if it does not."""
        step = decide.follow_round(view, self.rdzv.node, self.current, self.workers.ready)
        if isinstance(step, decide.Standby):
            self.workers.standby(step.after_step)
            self.events.emit("standby", round=step.round, after_step=step.after_step)
            self.current = None
        elif isinstance(step, decide.Assign):
            rnd, me = step.round, step.member
            self.workers.assign(list(step.assignments))
            self.events.emit(
                "round_joined",
                f"{self.node_id}: round {rnd.number}, ranks {me.first_rank}-"
                f"{me.first_rank + me.slots - 1} of {rnd.world_size}",
                round=rnd.number,
                world_size=rnd.world_size,
                first_rank=me.first_rank,
                members=[m.node_id for m in rnd.members],
                **self.rdzv.load.take(),  # what this node cost etcd since its previous round
            )
            self.current = rnd

    def _probe_peers(self, view: JobView) -> bool:
        """A worker saw a collective of the current round fail: drop the peers that are dead.
        True while the round stands, so the loop probes again soon."""
        found = decide.on_peer_lost(self.current, self.lost_round, view, self.node_id)
        if found is None:
            self.probing_since = None
            return False
        reach = self._probe(found.peers)
        now = time.monotonic()
        self.probing_since = self.probing_since or now
        waited = now - self.probing_since
        if decide.no_one_to_blame(found, reach, waited, self.cfg.rendezvous.lease_ttl_s):
            self._leave_round(
                f"round {found.round.number}'s collectives failed, yet every peer answers: "
                "leaving it so that it is formed again"
            )
            self.probing_since = None
            return False
        backup = min(EVICT_BACKUP_S, self.cfg.rendezvous.lease_ttl_s)
        if not decide.evicts_now(found, reach, self.node_id, waited, backup):
            return True
        for member in decide.peers_to_evict(found, reach, self.node_id):
            why = {
                decide.Reach.DEAD: "its agent refuses connections",
                decide.Reach.UNREACHABLE: "unreachable from the majority of the round",
            }
            self.rdzv.evict(member, why[reach[member.node_id]])
        return True

    def _probe(self, peers: Sequence[Member]) -> dict[str, decide.Reach]:
        """Each peer's agent port, probed in parallel: by node id."""
        timeout = self.cfg.rendezvous.probe_timeout_s
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(peers)))) as pool:
            found = list(pool.map(lambda p: probe(p.host, p.port, timeout), peers))
        return {p.node_id: r for p, r in zip(peers, found, strict=True)}

    def _reaches_the_round(self, view: JobView) -> bool:
        """Before saying ready: whether this node reaches every live member of the current
        round (:func:`decisions.reaches_the_round`); logged once while it does not."""
        if view.round is None:
            return True
        reach = self._probe([m for m in view.round.members if m.node_id != self.node_id])
        ok = decide.reaches_the_round(view.round, reach, self.node_id)
        cut = sorted(n for n, r in reach.items() if r is decide.Reach.UNREACHABLE)
        if not ok and not self.cut_off:
            self.events.emit(
                "peers_unreachable",
                f"{self.node_id} cannot reach {', '.join(cut)} of round {view.round.number}: "
                "waiting for the network before it joins (a check of every node's links and "
                "firewall between the hosts' store ports may help)",
                level=logging.WARNING,
                peers=cut,
            )
        self.cut_off = not ok
        return ok

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
            if self._strike(plan.strike):
                return self._rejoin(decide.Rejoin("quarantined", strike=False))
            code = self._check(in_running_job=True)
            if code:
                return code
        for s in failed:
            s.start()
        return 0

    def _rejoin(self, rejoin: decide.Rejoin) -> int:
        """Fenced or quarantined: this node's rounds go on without it. Leave, wait out any
        quarantine, check the node again and join as a new member; 0, or the exit code."""
        sentenced = self._strike(rejoin.reason) if rejoin.strike else None
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
        self.draining_since, self.leave_answers = None, {}
        self.rdzv.leave()
        code = self._admit(in_running_job=True)
        if code:
            return code
        code = self._register()
        if code:
            return code
        if not keep:
            for s in self.workers.slots:
                s.start()
        return 0

    def _register(self) -> int:
        """Join the job (:meth:`Rendezvous.join`): 0, or the exit code, with
        :attr:`leave_reason` set. An id held by this node's own earlier incarnation is taken
        over at once; one held by a live node is waited for, up to two lease TTLs."""
        ttl = self.cfg.rendezvous.lease_ttl_s
        deadline = time.monotonic() + 2 * ttl + 1
        while True:
            try:
                self.rdzv.join()
                return 0
            except EtcdLost as exc:
                return self._gave_up(exc)
            except NodeIdInUse as exc:
                holder = exc.holder
                timeout = self.cfg.rendezvous.probe_timeout_s
                alive = probe(holder.host, holder.store_port, timeout) is not decide.Reach.DEAD
                step = decide.on_node_id_in_use(
                    holder.host, self.host, alive, time.monotonic() > deadline
                )
                if isinstance(step, decide.IdTaken):
                    self.leave_reason = str(exc)
                    return EXIT_NODE_ID_IN_USE
                if isinstance(step, decide.TakeOver):
                    self.rdzv.evict(holder, "an earlier incarnation of this node, now gone")
                    continue
            self._receive(timeout=ttl / 4)
            if self.stop_signal is not None:
                self.leave_reason = "stopped by a signal before it could register"
                return 128 + self.stop_signal

    def _gave_up(self, exc: EtcdLost) -> int:
        """etcd stayed away past the grace period, or refused this node the job's keys: the
        exit code, with :attr:`leave_reason` naming the fix."""
        if isinstance(exc, EtcdDenied):
            self.leave_reason = str(exc)
            return EXIT_UNHEALTHY
        self.leave_reason = f"{exc}; {ETCD_LOST_FIX}"
        return EXIT_ETCD_LOST

    def _finish(self) -> None:
        """A local worker finished the job: let the others finish, then mark the job done."""
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

    def _admit(self, in_running_job: bool) -> int:
        """Wait while this node is quarantined, then run the health checks: 0 when it may join,
        else the exit code."""
        try:
            found = self.rdzv.retry("read the quarantine", lambda: self.guard.get(self.node_id))
        except EtcdLost as exc:
            return self._gave_up(exc)
        if found is not None:
            entry, left = found
            self.events.emit(
                "quarantine_wait",
                f"{self.node_id} is quarantined for {left:.0f} s more "
                f"({'; '.join(entry.reasons)}); waiting. To end it sooner: "
                + clear_command(self.node_id, self.cfg.job_id, self.endpoints, self.cfg.cluster),
                level=logging.WARNING,
                left_s=left,
                reasons=list(entry.reasons),
                by=entry.by,
            )
            try:
                while not self.rdzv.retry(
                    "wait for the quarantine to end",
                    lambda: self.guard.wait_cleared(self.node_id, QUARANTINE_POLL_S),
                ):
                    self._receive(timeout=0)
                    if self.stop_signal is not None:
                        return 128 + self.stop_signal
            except EtcdLost as exc:
                return self._gave_up(exc)
            self.events.emit("quarantine_over")
        return self._check(in_running_job)

    def _check(self, in_running_job: bool) -> int:
        """Run the health checks and publish the report; 0 if the node may (re)join, else strike
        it and return :data:`EXIT_UNHEALTHY`. A node already in a running job is not refused for
        what every node shares (:func:`launcher.agent.decisions.refusing_checks`): that is a
        warning."""
        if not self.cfg.health.enabled:
            log.warning("%s: health checks are off (health.enabled=false)", self.node_id)
            return 0
        report = run_checks(self.cfg, self.node_id, self.endpoints, self.slots, self.device)
        try:
            self.guard.publish(report)
        except etcd_errors() as exc:  # etcd away: the report waits for the next check
            log.warning("%s: could not publish the health report (%s)", self.node_id, exc)
        refusing = set(decide.refusing_checks([r.name for r in report.failures], in_running_job))
        shared = [r for r in report.failures if r.name not in refusing]
        warnings = [f"{r.name}: {r.message}" for r in report.results if r.status is Status.WARN]
        warnings += [
            f"{r.name} (the whole job shares it; not refused): {r.message}" for r in shared
        ]
        self.events.emit(
            "health_checked",
            report.table(),
            ok=not refusing,
            seconds=round(report.seconds, 3),
            counts=report.counts,
            warnings=warnings,
        )
        if not refusing:
            return 0
        failed = [r for r in report.failures if r.name in refusing]
        failures = [f"{r.name}: {r.message}" for r in failed]
        entry = self._strike("failed health checks: " + ", ".join(r.name for r in failed))
        self.events.emit(
            "health_failed",
            f"{self.node_id} failed its health checks and does not join the job:\n  "
            + "\n  ".join(failures),
            level=logging.ERROR,
            failures=failures,
            quarantined_until=entry.until if entry else None,
        )
        return EXIT_UNHEALTHY

    def _strike(self, reason: str) -> Entry | None:
        """Count a failure of this node; the quarantine entry if this one put it there."""
        try:
            return self.guard.strike(self.node_id, reason)
        except etcd_errors() as exc:  # etcd away: the lease decides this node's fate instead
            log.warning("%s: could not record a strike (%s)", self.node_id, exc)
            return None
