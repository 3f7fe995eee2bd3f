"""The parts of one node's agent, built and wired together.

This module is the composition root of :mod:`launcher.agent.agent`. Each part has one job (the
etcd client, the rendezvous, the quarantine, fault requests, peers, admission, the workers and
their planned leave); the agent's loop uses them. They talk back to the agent only through its
inbox (``post``) and the callbacks given here, so none of them imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic import config
from elastic import event_types as ev
from elastic.control import WorkerEnv
from elastic.events import EventLog
from launcher.agent.admission import EXIT_UNHEALTHY, Admission
from launcher.agent.fault_requests import FaultAnswerer, FaultRequests
from launcher.agent.inbox import FaultRequested, Message, RendezvousChanged
from launcher.agent.peers import Peers
from launcher.agent.planned_leave import PlannedLeave
from launcher.agent.workers import WorkerGroup
from launcher.health.quarantine import Quarantine
from launcher.metrics.exporter import MetricsServer, start_metrics
from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_security
from launcher.rendezvous.membership import NodeRecord
from launcher.rendezvous.rendezvous import Rendezvous

log = logging.getLogger("launcher.agent")


@dataclass(frozen=True)
class Node:
    """Who and where the node is: what every part is built from."""

    cfg: config.Config
    node_id: str
    host: str
    endpoints: list[str]
    slots: int
    device: str
    run_dir: Path
    events: EventLog


@dataclass(frozen=True)
class Parts:
    metrics: MetricsServer | None
    guard: Quarantine
    rdzv: Rendezvous
    faults: FaultAnswerer
    peers: Peers
    admission: Admission


def assemble(
    node: Node,
    client: Any,
    store_port: int,
    post: Callable[[Message], None],
    *,
    stopped: Callable[[float], int | None],
    worker_pid: Callable[[int], int],
    metrics: tuple[int, Callable[[], Mapping[str, int]]] = (0, dict),
) -> Parts:
    """Build the parts of ``node``'s agent over the etcd ``client``.

    ``store_port`` is the port of the TCPStore the agent hosts. ``metrics`` is the port the node
    serves its metrics on (0: none; its URL is published with the node's record) and its workers'
    pids by name. ``stopped`` and ``worker_pid`` are as :class:`Admission` and
    :class:`FaultAnswerer` take them."""
    cfg = node.cfg
    port, worker_pids = metrics
    server = start_metrics(cfg, node.node_id, (node.host, port), worker_pids, node.events)
    guard = Quarantine(client, cfg.rendezvous.prefix, cfg.job_id, cfg.health, node.events)
    rdzv = Rendezvous(
        client,
        job_id=cfg.job_id,
        node=NodeRecord(
            node.node_id,
            node.host,
            store_port,
            node.slots,
            metrics_url=server.url if server else "",
        ),
        cfg=cfg.rendezvous,
        min_nodes=cfg.cluster.min_nodes,
        max_nodes=config.max_nodes(cfg),
        events=node.events,
        on_change=lambda: post(RendezvousChanged()),
    )
    if server is not None:
        server.etcd = rdzv.load  # counted from here on
    requests = FaultRequests(
        client,
        cfg.rendezvous.prefix,
        cfg.job_id,
        node.node_id,
        post=lambda rid, request: post(FaultRequested(rid, request)),
    )
    return Parts(
        metrics=server,
        guard=guard,
        rdzv=rdzv,
        faults=FaultAnswerer(
            requests,
            node.node_id,
            node.run_dir,
            cfg.chaos.allow,
            node.slots,
            node.events,
            worker_pid=worker_pid,
        ),
        peers=Peers(node.node_id, cfg.rendezvous, node.events, rdzv.evict, rdzv.whole_round),
        admission=Admission(
            cfg,
            node.node_id,
            node.host,
            node.endpoints,
            node.slots,
            node.device,
            guard,
            rdzv,
            node.events,
            stopped=stopped,
        ),
    )


def round_store(timeout_s: float) -> dist.TCPStore:
    """The c10d TCPStore the agent hosts, used when this node holds rank 0 of a round.

    It binds every interface on an ephemeral port (docs/bare-metal.md, security)."""
    return dist.TCPStore(
        "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def connect_etcd(node: Node) -> Any:
    """The etcd client, or None once the node's exit is said (etcd cannot be reached)."""
    try:
        return connect(
            node.endpoints,
            timeout_s=node.cfg.health.etcd_timeout_s,
            security=etcd_security(node.cfg.cluster),
        )
    except EtcdUnavailable as exc:
        node.events.emit(
            ev.NODE_LEFT,
            f"{node.node_id} cannot join: {exc}",
            level=logging.ERROR,
            code=EXIT_UNHEALTHY,
            signal=None,
            reason=str(exc),
        )
        return None


def start_workers(
    node: Node,
    config_path: str,
    threads: int,
    post: Callable[[Message], None],
    leave_after: Callable[[int], None],
) -> tuple[WorkerGroup, PlannedLeave]:
    """Start one worker per slot, once (each with ``threads`` threads), and their planned leave.

    The planned leave publishes its step through ``leave_after``."""
    cfg = node.cfg
    envs = [
        WorkerEnv(config_path, str(node.run_dir), node.node_id, i, node.slots, threads)
        for i in range(node.slots)
    ]
    log_dir = node.run_dir / "logs" / node.node_id
    workers = WorkerGroup.start(envs, log_dir, node.events, cfg.rendezvous.watchdog_s, post=post)
    leaving = PlannedLeave(
        node.node_id,
        cfg.cluster.min_nodes,
        cfg.rendezvous.watchdog_s,
        workers,
        node.events,
        leave_after,
    )
    log.info(
        "%s joined job %s (%d %s worker(s))", node.node_id, cfg.job_id, node.slots, node.device
    )
    return workers, leaving
