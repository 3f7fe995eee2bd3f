"""``cluster=local``: simulate N nodes on this machine, each a real agent process.

Each simulated node is an agent in its own session and process group, so a fault injector can kill
a whole node (the agent and every worker under it) with one signal, as a machine failure would.
Unless ``cluster.etcd_endpoints`` names a running etcd, an embedded one is started for the job,
of ``cluster.embedded_etcd_members`` members (1, or 3 to survive the loss of one).

On NCCL, each simulated node passes for a host of its own (:func:`nccl_host_environ`): NCCL
refuses two ranks of one communicator on one GPU of one host, and a test machine has one GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from elastic import event_types as ev
from elastic.config import CommBackend, Config, Device
from elastic.control import EXIT_UNSAVED
from elastic.events import EventFollower
from elastic.lifeline import tied
from elastic.nccl_settings import own_host
from launcher.progress import ProgressDisplay
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd

log = logging.getLogger("launcher.local")

ENDPOINTS_FILE = "etcd.endpoints"  # in the run directory while the embedded etcd runs
SHUTDOWN_GRACE_S = 20.0
FINISHED_GRACE_S = 15.0  # once a node finished the job, how long the others may take to end
DISPLAY_INTERVAL_S = 0.25


def node_ids(count: int) -> list[str]:
    return [f"node{i}" for i in range(count)]


def run_local(
    cfg: Config, config_path: Path, follow: Callable[[list[dict[str, Any]]], None]
) -> int:
    """Run the job on simulated nodes until it is done; returns the launcher's exit code.

    ``follow`` gets every node's new events (none, too) on each pass, as the display does."""
    run_dir = Path(cfg.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    etcd, endpoints = _etcd_for(cfg, run_dir, logs)

    stop: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    agents: dict[str, subprocess.Popen[bytes]] = {}
    display = ProgressDisplay()
    follower = EventFollower(run_dir, only_new=True)  # before any agent writes

    def show() -> list[dict[str, Any]]:
        """The nodes' new events, shown and passed to ``follow``."""
        events = follower.poll()
        display.handle(events)
        follow(events)
        return events

    try:
        for node in node_ids(cfg.cluster.nodes):
            agents[node] = _start_agent(cfg, config_path, node, endpoints, logs)
        log.info("started %d nodes: %s (logs in %s)", len(agents), ", ".join(agents), logs)
        _supervise(agents, show, stop)
        if stop:
            log.warning("stopping: asking every node to leave the job")
            _shutdown(agents)
        show()
    finally:
        display.close()
        _shutdown(agents)
        if etcd is not None:
            (run_dir / ENDPOINTS_FILE).unlink(missing_ok=True)
            etcd.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop:
        return 128 + stop[0]
    return 0


def _etcd_for(cfg: Config, run_dir: Path, logs: Path) -> tuple[EmbeddedEtcd | None, list[str]]:
    """The etcd the job uses, and its endpoints: ``cluster.etcd_endpoints``, or an embedded one.

    An embedded one is started here, and returned too, for the caller to stop."""
    endpoints = list(cfg.cluster.etcd_endpoints)
    if endpoints:
        return None, endpoints
    members = cfg.cluster.embedded_etcd_members
    etcd = EmbeddedEtcd(run_dir / "etcd", logs / "etcd.log", members).start()
    log.info("embedded etcd (%d member(s)) at %s", members, ", ".join(etcd.endpoints))
    # How the commands beside a running job find it (launcher.commands.status job_id=...).
    (run_dir / ENDPOINTS_FILE).write_text(",".join(etcd.endpoints) + "\n")
    return etcd, etcd.endpoints


def nccl_host_environ(cfg: Config, node: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What the agent of simulated node ``node`` adds to its environment, for its workers' NCCL.

    With several nodes on CUDA and NCCL, each is a host of its own to NCCL
    (:func:`elastic.nccl_settings.own_host`), so that NCCL takes the ranks of nodes that share a
    GPU. A variable ``environ`` sets is kept."""
    cluster, backend = cfg.cluster, cfg.comm.backend
    if cluster.nodes < 2 or cluster.device != Device.cuda or backend != CommBackend.auto:
        return {}
    wanted = own_host(f"{cfg.job_id}-{node}")
    return {k: v for k, v in wanted.items() if k not in environ}


def local_metrics_port(port: int, node: str) -> int:
    """Where simulated node ``node`` serves /metrics: they share a host, so node i is port + i."""
    return port + int(node.removeprefix("node")) if port else 0


def agent_argv(
    config_path: Path, node: str, endpoints: list[str], nodes: int, metrics_port: int
) -> list[str]:
    """The command line of simulated node ``node``'s agent, one of ``nodes`` on this machine.

    ``metrics_port`` is ``metrics.port`` (:func:`local_metrics_port` picks the node's own)."""
    return [
        sys.executable,
        "-m",
        "launcher.agent",
        "--config",
        str(config_path),
        "--node-id",
        node,
        "--host",
        "127.0.0.1",
        "--etcd",
        ",".join(endpoints),
        "--nodes-on-machine",
        str(nodes),
        "--metrics-port",
        str(local_metrics_port(metrics_port, node)),
    ]


def _start_agent(
    cfg: Config, config_path: Path, node: str, endpoints: list[str], logs: Path
) -> subprocess.Popen[bytes]:
    """Start the agent of the simulated node ``node``, in a session of its own.

    In its own session, a fault injector kills the whole node with one signal. The agent's
    output goes to ``<logs>/<node>.log``."""
    argv = agent_argv(config_path, node, endpoints, cfg.cluster.nodes, cfg.metrics.port)
    with open(logs / f"{node}.log", "ab") as out:
        return subprocess.Popen(
            tied(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **nccl_host_environ(cfg, node, os.environ), "PYTHONUNBUFFERED": "1"},
        )


def _supervise(
    agents: dict[str, subprocess.Popen[bytes]],
    show: Callable[[], list[dict[str, Any]]],
    stop: list[int],
) -> None:
    """Show the nodes' new events until every agent has exited or a signal came (``stop``).

    ``show`` shows them. Once the job is trained, it stops the nodes still waiting for what will
    not come (:func:`still_waiting`)."""
    finished_at: float | None = None
    in_quarantine: set[str] = set()  # nodes waiting out a quarantine, from their events
    while not stop and any(p.poll() is None for p in agents.values()):
        for e in show():
            if ev.QUARANTINE_WAIT.matches(e):
                in_quarantine.add(e["node"])
            elif ev.QUARANTINE_OVER.matches(e):
                in_quarantine.discard(e["node"])
        codes = {node: p.poll() for node, p in agents.items()}
        # Trained, its final state saved (0) or not (EXIT_UNSAVED): the job is over.
        if finished_at is None and {0, EXIT_UNSAVED} & set(codes.values()):
            finished_at = time.monotonic()
        waiting = still_waiting(codes, finished_at, time.monotonic(), in_quarantine)
        if waiting:
            log.warning(
                "the job is trained; stopping %s, still waiting for what will not come "
                "(the end of a quarantine, a round)",
                ", ".join(waiting),
            )
            _shutdown({node: agents[node] for node in waiting})
        time.sleep(DISPLAY_INTERVAL_S)


def still_waiting(
    codes: Mapping[str, int | None],
    finished_at: float | None,
    now: float,
    in_quarantine: Collection[str] = (),
) -> list[str]:
    """The nodes (exit code None: running) to stop because the job is trained.

    Once one node exited 0 (it finished), those ``in_quarantine`` stop at once: they wait out
    their cooldown for a job that is over. The others stop after :data:`FINISHED_GRACE_S`: they
    finish the same last step within moments. One still running after that waits for what will
    not come (a node that was out of the last round, for a round)."""
    if finished_at is None:
        return []
    late = now - finished_at >= FINISHED_GRACE_S
    return [n for n, code in codes.items() if code is None and (late or n in in_quarantine)]


def _shutdown(agents: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM each agent (it stops its workers and revokes its lease), then kill stragglers."""
    for p in agents.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for p in agents.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
