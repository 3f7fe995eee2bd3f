"""The per-node agent: joins the job in etcd, runs this node's workers round after round.

One agent runs on every node (``cluster=bare_metal``), or one per simulated node
(``cluster=local``, spawned by :mod:`launcher.local_cluster`). Its life:

1. Host a c10d TCPStore (used when this node holds rank 0 of a round), register in etcd.
2. Wait until a round that holds this node is formed and intact.
3. Start one worker per GPU or CPU slot with its global rank and the round, and watch them.
4. When the round ends (a member left or failed), a local worker crashes, or the workers lost a
   peer, stop the workers and go back to 2. A crash is reported to etcd at once (the node's
   incarnation goes up), which makes the leader form a new round without waiting for a lease.
5. When the workers finish the job, mark it done; when another node did, leave too.

SIGTERM or SIGINT stops a node cleanly: workers stopped, lease revoked (its keys vanish at once).
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

from elastic import config
from elastic.communicator import EXIT_PEER_LOST, WorkerEnv
from elastic.etcd import connect
from elastic.events import EventLog
from elastic.rendezvous import JobView, Member, NodeRecord, Rendezvous, Round
from launcher.workers import WorkerGroup

log = logging.getLogger("launcher.agent")

STOP_GRACE_S = 5.0  # how long workers get to exit after SIGTERM before SIGKILL


class Outcome(enum.Enum):
    DONE = "done"  # the job is trained
    ROUND_ENDED = "round_ended"  # a member left or failed: a new round comes
    CRASHED = "crashed"  # a local worker failed on its own
    PEER_LOST = "peer_lost"  # local workers saw a collective fail
    FENCED = "fenced"  # this node lost its lease
    STOPPED = "stopped"  # SIGTERM / SIGINT


def local_slots(cfg: config.Config) -> tuple[int, str]:
    """How many workers this node runs, and on what device."""
    import torch

    use_cuda = cfg.cluster.device == "cuda" or (
        cfg.cluster.device == "auto" and torch.cuda.is_available()
    )
    if use_cuda:
        return cfg.cluster.workers_per_node or torch.cuda.device_count(), "cuda"
    return cfg.cluster.workers_per_node or cfg.cluster.cpu_workers, "cpu"


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
        self._last_round = 0
        self.rdzv: Rendezvous

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
        client = connect(self.endpoints)
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
        self.rdzv.join()
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
            self.rdzv.leave()
            self.events.emit("node_left", code=code, signal=self.stop_signal)
            client.close()
        return code

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum
        self.rdzv.notify()

    def _loop(self) -> int:
        restarts = 0
        waiting_since = time.monotonic()
        while True:
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            if self.rdzv.fenced.is_set():
                log.warning("%s lost its lease; joining again as a new member", self.node_id)
                self.rdzv.rejoin()
                waiting_since = time.monotonic()
                continue
            view = self.rdzv.view
            if view.done:
                log.info("the job is done")
                return 0
            me = self._admitted(view)
            if me is None:
                waited = time.monotonic() - waiting_since
                if waited > self.cfg.rendezvous.join_timeout_s:
                    self.events.emit("join_timeout", waited_s=waited)
                    log.error(
                        "%s was not admitted into a round within rendezvous.join_timeout_s="
                        "%.0f; are cluster.min_nodes nodes up?",
                        self.node_id,
                        waited,
                    )
                    return 1
                self.rdzv.wait(
                    lambda v: (
                        self._admitted(v) is not None or v.done or self.stop_signal is not None
                    ),
                    timeout=1.0,
                )
                continue
            assert view.round is not None
            outcome = self._run_round(view.round, me)
            waiting_since = time.monotonic()
            if outcome is Outcome.DONE:
                self.rdzv.mark_done()
                return 0
            if outcome is Outcome.CRASHED:
                restarts += 1
                if restarts > self.cfg.cluster.max_restarts:
                    log.error(
                        "%s: workers crashed %d times (cluster.max_restarts=%d); leaving",
                        self.node_id,
                        restarts,
                        self.cfg.cluster.max_restarts,
                    )
                    return 1
                self.rdzv.report_failure("worker crashed")
            elif outcome is Outcome.PEER_LOST:
                self._await_new_round(view.round)

    def _admitted(self, view: JobView) -> Member | None:
        """This node's membership in the current round, if that round is intact and new to us."""
        rnd = view.round
        if rnd is None or view.done or rnd.number <= self._last_round or not view.round_intact():
            return None
        me = rnd.member(self.node_id)
        if me is None or me.incarnation != self.rdzv.node.incarnation:
            return None
        return me

    def _await_new_round(self, rnd: Round) -> None:
        """After losing a peer: the round should be replaced soon; if not, ask for a new one."""
        replaced = self.rdzv.wait(
            lambda v: (
                v.done
                or v.round is None
                or v.round.number != rnd.number
                or not v.round_intact()
                or self.stop_signal is not None
            ),
            timeout=self.cfg.rendezvous.peer_lost_grace_s,
        )
        if replaced is None:
            self.rdzv.report_failure("peer lost and no new round followed")

    # --- one round -----------------------------------------------------------------------------

    def _run_round(self, rnd: Round, me: Member) -> Outcome:
        self._last_round = rnd.number
        envs = [
            WorkerEnv(
                config=self.config_path,
                run_dir=str(self.run_dir),
                node_id=self.node_id,
                round=rnd.number,
                rank=me.first_rank + i,
                world_size=rnd.world_size,
                local_rank=i,
                local_world_size=self.slots,
                store_host=rnd.store_host,
                store_port=rnd.store_port,
                threads=self.threads,
            )
            for i in range(self.slots)
        ]
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
        group = WorkerGroup.spawn(
            envs, self.run_dir / "logs" / self.node_id, self.events, on_exit=self.rdzv.notify
        )
        try:
            outcome = None
            while outcome is None:
                self.rdzv.wait(lambda v: self._round_event(v, rnd, group) is not None, timeout=1.0)
                outcome = self._round_event(self.rdzv.view, rnd, group)
            if outcome is Outcome.DONE or self.rdzv.view.done:
                # Peers finish the same step; give their last collective a moment to complete.
                self.rdzv.wait(lambda v: None not in group.exit_codes(), timeout=STOP_GRACE_S)
            return outcome
        finally:
            group.stop(STOP_GRACE_S)
            self.events.emit("workers_stopped", round=rnd.number, codes=group.exit_codes())

    def _round_event(self, view: JobView, rnd: Round, group: WorkerGroup) -> Outcome | None:
        """What ended the round for this node, or None while it goes on."""
        if self.stop_signal is not None:
            return Outcome.STOPPED
        if self.rdzv.fenced.is_set():
            return Outcome.FENCED
        codes = group.exit_codes()
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return (
                Outcome.PEER_LOST if all(c == EXIT_PEER_LOST for c in failed) else Outcome.CRASHED
            )
        if None not in codes or view.done:
            return Outcome.DONE
        if view.round is None or view.round.number != rnd.number or not view.round_intact():
            return Outcome.ROUND_ENDED
        return None


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
