"""The per-node agent: joins the job in etcd and supervises this node's workers across rounds.

One agent runs on every node (``cluster=bare_metal``), or one per simulated node
(``cluster=local``, spawned by :mod:`launcher.local_cluster`). Its life:

1. Prove the node fit (:mod:`launcher.health`): wait out a quarantine if there is one, then run
   the health checks and publish the report to etcd. A node that fails them does not join; it
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
   node comes back in a later round. A node that lost its lease (fenced) stops its workers and
   registers again as a new member. Each crash or fencing is a strike (:mod:`launcher.quarantine`);
   too many and the node is quarantined: it leaves, waits out the cooldown and starts over at 1.
   The health checks run again before every rejoin and every worker restart.
5. When the workers finish the job, mark it done; when another node did, leave too.

SIGTERM or SIGINT stops a node cleanly: workers stopped, lease revoked (its keys vanish at once).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import FrameType

from elastic import config
from elastic.control import EXIT_PEER_LOST, Assignment, WorkerEnv
from elastic.events import EventLog
from launcher.etcd import EtcdUnavailable, connect
from launcher.health import Status, run_checks
from launcher.quarantine import Entry, Quarantine, clear_command
from launcher.rendezvous import Member, NodeRecord, Rendezvous, Round
from launcher.slots import local_slots
from launcher.workers import WorkerGroup, WorkerSlot

log = logging.getLogger("launcher.agent")

STOP_GRACE_S = 5.0  # how long workers get to exit after SIGTERM before SIGKILL
EXIT_UNHEALTHY = 3  # the node failed its health checks (or cannot reach etcd) and did not join
QUARANTINE_POLL_S = 2.0  # how often a quarantined node looks up from its wait (signals)


def probe(host: str, port: int, timeout_s: float) -> bool:
    """Whether an agent listens at ``host:port``. A refused connection means its process is
    gone; a stopped process still accepts (the kernel does), so a frozen node is not "dead"."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True  # unreachable or slow is not proof of death; the lease decides


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
        self.events = EventLog(self.run_dir, node_id, role="agent")
        self.stop_signal: int | None = None
        self.rdzv: Rendezvous
        self.guard: Quarantine
        self.workers: WorkerGroup
        self.current: Round | None = None  # the round this node's workers were sent to
        self.crashes = 0

    # --- life cycle ----------------------------------------------------------------------------

    def run(self) -> int:
        import torch.distributed as dist

        self.events.emit("agent_started", pgid=os.getpgid(0), slots=self.slots, device=self.device)
        store = dist.TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.cfg.rendezvous.pg_timeout_s),
        )
        try:
            client = connect(self.endpoints, timeout_s=self.cfg.health.etcd_timeout_s)
        except EtcdUnavailable as exc:
            log.error("%s cannot join: %s", self.node_id, exc)
            self.events.emit("node_left", code=EXIT_UNHEALTHY, signal=None, reason=str(exc))
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
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        code = self._admit()
        if code:
            self.events.emit("node_left", code=code, signal=self.stop_signal)
            client.close()
            return code
        self.rdzv.join()
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
            wake=self.rdzv.notify,
        )
        log.info(
            "%s joined job %s (%d %s worker(s))",
            self.node_id,
            self.cfg.job_id,
            self.slots,
            self.device,
        )
        code = 1
        try:
            code = self._loop()
        finally:
            self.workers.stop(STOP_GRACE_S)
            self.rdzv.leave()
            self.events.emit("node_left", code=code, signal=self.stop_signal)
            client.close()
        return code

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum
        self.rdzv.notify()

    def _loop(self) -> int:
        """React to whatever changed: signals, fencing, worker exits and reports, rounds."""
        waiting_since = time.monotonic()
        while True:
            seen = self.rdzv.changes
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            fenced = self.rdzv.fenced.is_set()
            if fenced or self.node_id in self.rdzv.view.quarantined:
                why = "lost its place in the job (fenced)" if fenced else "was quarantined"
                if fenced:
                    self._strike(why)
                code = self._rejoin(why)
                if code:
                    return code
                waiting_since = time.monotonic()
                continue
            codes = self.workers.exit_codes()
            if 0 in codes:  # the job is trained: the others finish the same last step
                self._finish()
                return 0
            if self.rdzv.view.done and self.current is None:
                log.info("the job is done")
                return 0
            for slot in self.workers.slots:
                reason = slot.frozen()
                if reason is not None:
                    self.events.emit("worker_frozen", local_rank=slot.env.local_rank, reason=reason)
                    log.warning(
                        "%s: worker %d frozen (%s)", self.node_id, slot.env.local_rank, reason
                    )
                    slot.kill()
            failed = [s for s in self.workers.slots if s.exit_code not in (None, 0)]
            if failed:
                code = self._restart(failed)
                if code:
                    return code
                continue
            if not self.rdzv.node.ready and self.workers.ready:
                self.rdzv.set_ready()
            self._handle_peer_lost()
            self._follow_round()
            if self.current is not None:
                waiting_since = time.monotonic()
            elif time.monotonic() - waiting_since > self.cfg.rendezvous.join_timeout_s:
                self.events.emit("join_timeout", waited_s=time.monotonic() - waiting_since)
                log.error(
                    "%s was not placed in a round within rendezvous.join_timeout_s=%.0f; "
                    "are cluster.min_nodes nodes up?",
                    self.node_id,
                    self.cfg.rendezvous.join_timeout_s,
                )
                return 1
            self.rdzv.wait_change(seen, timeout=1.0)

    # --- reactions -----------------------------------------------------------------------------

    def _follow_round(self) -> None:
        """Send the workers into a new round that lists this node, or to standby if it does not."""
        view = self.rdzv.view
        rnd = view.round
        if rnd is None or (self.current is not None and rnd.number == self.current.number):
            return
        mine = view.nodes.get(self.node_id)
        me = (
            view.is_member(mine)
            if mine and mine.incarnation == self.rdzv.node.incarnation
            else None
        )
        if me is None:
            if self.current is not None:
                self.workers.standby()
                self.events.emit("standby", round=rnd.number)
                self.current = None
            return
        if not view.round_intact() or not self.workers.ready:
            return  # a member is gone already: the next round follows at once
        self.workers.assign(self._assignments(rnd, me))
        self.events.emit(
            "round_joined",
            round=rnd.number,
            world_size=rnd.world_size,
            first_rank=me.first_rank,
            members=[m.node_id for m in rnd.members],
        )
        log.info(
            "%s: round %d, ranks %d-%d of %d",
            self.node_id,
            rnd.number,
            me.first_rank,
            me.first_rank + self.slots - 1,
            rnd.world_size,
        )
        self.current = rnd

    def _assignments(self, rnd: Round, me: Member) -> list[Assignment]:
        excluded: tuple[int, ...] = ()
        prev = self.current
        if prev is not None and prev.number == rnd.number - 1:
            kept = {m.node_id for m in rnd.members}
            if all(prev.member(m.node_id) for m in rnd.members):
                excluded = tuple(
                    m.first_rank + i
                    for m in prev.members
                    if m.node_id not in kept
                    for i in range(m.slots)
                )
        return [
            Assignment(
                round=rnd.number,
                rank=me.first_rank + i,
                world_size=rnd.world_size,
                store_host=rnd.store_host,
                store_port=rnd.store_port,
                formed_at=rnd.formed_at,
                shrinks_round=prev.number if excluded and prev else 0,
                excluded_ranks=excluded,
            )
            for i in range(self.slots)
        ]

    def _handle_peer_lost(self) -> None:
        """A worker saw a collective of the current round fail: drop the peers that are dead."""
        rnd = self.current
        if rnd is None or not any(s.peer_lost_round == rnd.number for s in self.workers.slots):
            return
        for s in self.workers.slots:
            s.peer_lost_round = 0
        view = self.rdzv.view
        peers = [
            (m, view.nodes[m.node_id])
            for m in rnd.members
            if m.node_id != self.node_id and m.node_id in view.nodes
        ]
        timeout = self.cfg.rendezvous.probe_timeout_s
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(peers)))) as pool:
            alive = list(pool.map(lambda p: probe(p[1].host, p[1].store_port, timeout), peers))
        for (member, _), up in zip(peers, alive, strict=True):
            if not up:
                self.rdzv.evict(member, "its agent refuses connections")

    def _restart(self, failed: list[WorkerSlot]) -> int:
        """Leave the round and start the failed workers again once the node checks out healthy.
        Returns 0 to carry on, or the agent's exit code."""
        crashed = [s for s in failed if s.exit_code != EXIT_PEER_LOST]
        self.crashes += len(crashed)
        if self.crashes > self.cfg.cluster.max_restarts:
            log.error(
                "%s: workers crashed %d times (cluster.max_restarts=%d); leaving",
                self.node_id,
                self.crashes,
                self.cfg.cluster.max_restarts,
            )
            return 1
        codes = [s.exit_code for s in failed]
        self.rdzv.report_failure(f"worker exit codes {codes}")
        if self.current is not None:
            self.workers.standby()
            self.current = None
        for s in failed:
            s.stop(0)
        if crashed:
            if self._strike(f"worker(s) crashed with exit codes {codes}"):
                return self._rejoin("quarantined")
            code = self._check()
            if code:
                return code
        for s in failed:
            s.start()
        return 0

    def _rejoin(self, why: str) -> int:
        """Fenced or quarantined: this node's rounds go on without it. Leave, wait out any
        quarantine, check the node again and join as a new member; 0, or the exit code."""
        log.warning("%s %s; leaving, to join again as a new member", self.node_id, why)
        self.workers.stop(STOP_GRACE_S)
        self.current = None
        self.rdzv.leave()
        code = self._admit()
        if code:
            return code
        self.rdzv.join()
        for s in self.workers.slots:
            s.start()
        return 0

    # --- health and quarantine -----------------------------------------------------------------

    def _admit(self) -> int:
        """Wait while this node is quarantined, then run the health checks: 0 when it may join,
        else the exit code."""
        found = self.guard.get(self.node_id)
        if found is not None:
            entry, left = found
            self.events.emit(
                "quarantine_wait", left_s=left, reasons=list(entry.reasons), by=entry.by
            )
            log.warning(
                "%s is quarantined for %.0f s more (%s); waiting. To end it sooner: %s",
                self.node_id,
                left,
                "; ".join(entry.reasons),
                clear_command(self.node_id, self.cfg.job_id, self.endpoints),
            )
            while not self.guard.wait_cleared(self.node_id, QUARANTINE_POLL_S):
                if self.stop_signal is not None:
                    return 128 + self.stop_signal
            self.events.emit("quarantine_over")
        return self._check()

    def _check(self) -> int:
        """Run the health checks and publish the report; 0 if the node passed, else strike it
        and return :data:`EXIT_UNHEALTHY`."""
        if not self.cfg.health.enabled:
            log.warning("%s: health checks are off (health.enabled=false)", self.node_id)
            return 0
        report = run_checks(self.cfg, self.node_id, self.endpoints, self.slots, self.device)
        self.guard.publish(report)
        log.info("%s", report.table())
        self.events.emit(
            "health_checked",
            ok=report.ok,
            seconds=round(report.seconds, 3),
            counts=report.counts,
            warnings=[f"{r.name}: {r.message}" for r in report.results if r.status is Status.WARN],
        )
        if report.ok:
            return 0
        failures = [f"{r.name}: {r.message}" for r in report.failures]
        entry = self._strike("failed health checks: " + ", ".join(r.name for r in report.failures))
        self.events.emit(
            "health_failed", failures=failures, quarantined_until=entry.until if entry else None
        )
        log.error(
            "%s failed its health checks and does not join the job:\n  %s",
            self.node_id,
            "\n  ".join(failures),
        )
        return EXIT_UNHEALTHY

    def _strike(self, reason: str) -> Entry | None:
        """Count a failure of this node; the quarantine entry if this one put it there."""
        from etcd3.exceptions import Etcd3Exception  # imported by now, after launcher.etcd's setup

        try:
            return self.guard.strike(self.node_id, reason)
        except Etcd3Exception as exc:  # etcd away: the lease decides this node's fate instead
            log.warning("%s: could not record a strike (%s)", self.node_id, exc)
            return None

    def _finish(self) -> None:
        """A local worker finished the job: let the others finish, then mark the job done."""
        self.rdzv.wait(lambda v: None not in self.workers.exit_codes(), timeout=STOP_GRACE_S * 6)
        if all(c == 0 for c in self.workers.exit_codes()):
            self.rdzv.mark_done()
        self.current = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one node's agent for a resolved config.")
    parser.add_argument("--config", required=True, help="resolved config.yaml of the job")
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address peers reach this node at")
    parser.add_argument("--etcd", required=True, help="comma-separated etcd endpoints host:port")
    parser.add_argument(
        "--nodes-on-machine",
        type=int,
        default=1,
        help="agents sharing this machine's cores (local simulation)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [{args.node_id}] %(name)s: %(message)s"
    )
    cfg = config.load(args.config)
    agent = Agent(
        cfg,
        args.config,
        args.node_id,
        args.host or socket.getfqdn(),
        args.etcd.split(","),
        args.nodes_on_machine,
    )
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
