"""The parts of one node's agent, wired together: the composition root of :mod:`.agent`.

Each part has one job (the rendezvous, the quarantine, fault requests, peers, admission); the
agent's loop uses them and reaches them through :class:`Parts`. They talk back to the agent only
through its inbox (``post``) and the two callbacks given here, so none of them imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic import config
from elastic.events import EventLog
from launcher.agent.admission import Admission
from launcher.agent.fault_requests import FaultAnswerer, FaultRequests
from launcher.agent.inbox import FaultRequested, Message, RendezvousChanged
from launcher.agent.peers import Peers
from launcher.health.quarantine import Quarantine
from launcher.rendezvous.membership import NodeRecord
from launcher.rendezvous.rendezvous import Rendezvous


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
) -> Parts:
    """The parts of ``node``'s agent over the etcd ``client``; ``store_port``: the port of the
    TCPStore the agent hosts; ``stopped`` and ``worker_pid`` as :class:`Admission` and
    :class:`FaultAnswerer` take them."""
    cfg = node.cfg
    guard = Quarantine(client, cfg.rendezvous.prefix, cfg.job_id, cfg.health, node.events)
    rdzv = Rendezvous(
        client,
        job_id=cfg.job_id,
        node=NodeRecord(node.node_id, node.host, store_port, node.slots),
        cfg=cfg.rendezvous,
        min_nodes=cfg.cluster.min_nodes,
        max_nodes=config.max_nodes(cfg),
        events=node.events,
        on_change=lambda: post(RendezvousChanged()),
    )
    requests = FaultRequests(
        client,
        cfg.rendezvous.prefix,
        cfg.job_id,
        node.node_id,
        post=lambda rid, request: post(FaultRequested(rid, request)),
    )
    return Parts(
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
        peers=Peers(node.node_id, cfg.rendezvous, node.events, rdzv.evict),
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
