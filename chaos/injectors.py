"""Fault injectors: real signals to real processes, found through the run's event log, and
network partitions and slow links of nodes run in namespaces (:mod:`chaos.netns`).

Nodes and workers are found through the events; etcd members through the
:class:`~launcher.embedded_etcd.EmbeddedEtcd` that owns them, or, for the one ``python -m
launcher`` starts, by their data directory under the run's.

Each injection is itself written to the event log (``events/chaos.jsonl``) with the moment the
signal was sent, so recovery can be measured from the log alone: fault to first step after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from chaos.netns import PEER_LINK, LocalNetwork
from elastic.events import EventLog, read_events
from elastic.lifeline import tied
from launcher.embedded_etcd import EmbeddedEtcd

CHAOS_NODE = "chaos"


class TargetNotFound(LookupError):
    """The event log names no live process for the requested target."""


def _newest(run_dir: Path, event: str, **match: Any) -> dict[str, Any]:
    found = [
        e
        for e in read_events(run_dir)
        if e["event"] == event and all(e.get(k) == v for k, v in match.items())
    ]
    if not found:
        raise TargetNotFound(f"no {event} event with {match} in {run_dir}")
    return found[-1]


def node_with_rank(run_dir: str | os.PathLike[str], rank: int = 0) -> str:
    """The node whose worker held ``rank`` in the newest round that synced its state."""
    return str(_newest(Path(run_dir), "state_synced", rank=rank)["node"])


def node_processes(run_dir: str | os.PathLike[str], node_id: str) -> list[psutil.Process]:
    """A node's agent and every process under it (its workers and their helpers)."""
    agent = _newest(Path(run_dir), "agent_started", node=node_id)
    try:
        root = psutil.Process(agent["pid"])
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess as exc:
        raise TargetNotFound(f"the agent of {node_id} (pid {agent['pid']}) is not running") from exc


def kill_node(
    run_dir: str | os.PathLike[str], node_id: str, sig: signal.Signals = signal.SIGKILL
) -> float:
    """Signal a whole node at once, as a machine failure would; returns when it was sent.

    ``SIGSTOP`` freezes the node (its agent and workers), like a machine that hangs.
    """
    procs = node_processes(run_dir, node_id)
    return _signal(run_dir, procs, sig, kind="node", target=node_id)


def thaw_node(run_dir: str | os.PathLike[str], node_id: str) -> float:
    """``SIGCONT`` a frozen node (logged as ``fault_cleared``): it finds itself fenced out."""
    procs = node_processes(run_dir, node_id)
    return _signal(
        run_dir, procs, signal.SIGCONT, event="fault_cleared", kind="node", target=node_id
    )


def kill_agent(
    run_dir: str | os.PathLike[str], node_id: str, sig: signal.Signals = signal.SIGKILL
) -> float:
    """Signal a node's agent alone, its workers left running: ``SIGSTOP`` is an agent that
    stops answering (its lease runs out) while its workers still train; :func:`thaw_node`
    resumes it."""
    agent = node_processes(run_dir, node_id)[0]
    return _signal(run_dir, [agent], sig, kind="agent", target=node_id)


def kill_worker(
    run_dir: str | os.PathLike[str],
    node_id: str,
    local_rank: int = 0,
    sig: signal.Signals = signal.SIGKILL,
) -> float:
    """Signal one worker (the newest one started for that node and local rank)."""
    started = _newest(Path(run_dir), "worker_started", node=node_id, local_rank=local_rank)
    try:
        proc = psutil.Process(started["worker_pid"])
    except psutil.NoSuchProcess as exc:
        raise TargetNotFound(f"worker {local_rank} of {node_id} is not running") from exc
    return _signal(run_dir, [proc], sig, kind="worker", target=f"{node_id}/worker{local_rank}")


def restart_node(
    run_dir: str | os.PathLike[str], node_id: str, endpoints: list[str], nodes_on_machine: int
) -> tuple[float, subprocess.Popen[bytes]]:
    """Start a killed or departed node's agent again, as a repaired machine rejoins: a fresh
    agent on the run's ``config.yaml``, in a session of its own (so that :func:`kill_node`
    reaches all of it), tied to this process. Logged as ``fault_cleared`` before it starts."""
    run_dir = Path(run_dir)
    sent = _log(run_dir, "fault_cleared", kind="restart", target=node_id)
    argv = [
        sys.executable,
        "-m",
        "launcher.agent",
        "--config",
        str(run_dir / "config.yaml"),
        "--node-id",
        node_id,
        "--host",
        "127.0.0.1",
        "--etcd",
        ",".join(endpoints),
        "--nodes-on-machine",
        str(nodes_on_machine),
    ]
    with open(run_dir / "logs" / f"{node_id}.log", "ab") as out:
        proc = subprocess.Popen(
            tied(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return sent, proc


def skipped(run_dir: str | os.PathLike[str], kind: str, target: str, reason: str) -> float:
    """Log a fault that was due but could not be carried out, and why."""
    return _log(run_dir, "fault_skipped", kind=kind, target=target, reason=reason)


def stop_etcd(run_dir: str | os.PathLike[str], etcd: EmbeddedEtcd, member: int = 0) -> float:
    """SIGKILL one member of an etcd this process started (an outage of a 1-member etcd, a lost
    member of three); :func:`start_etcd` brings it back on the same port and data."""
    pid = etcd.pid(member)
    if pid is None:
        raise TargetNotFound(f"etcd member {member} is not running")
    record = _log(run_dir, "fault_injected", kind="etcd", target=f"member{member}", pids=[pid])
    etcd.stop_member(member, kill=True)
    return record


def start_etcd(run_dir: str | os.PathLike[str], etcd: EmbeddedEtcd, member: int = 0) -> float:
    """Start a member stopped by :func:`stop_etcd` again, as an operator restarts etcd; returns
    once it is healthy (logged as ``fault_cleared`` at that moment)."""
    etcd.start_member(member)
    return _log(run_dir, "fault_cleared", kind="etcd", target=f"member{member}")


def kill_embedded_etcd_member(run_dir: str | os.PathLike[str], member: int) -> float:
    """SIGKILL one member of the embedded etcd that ``python -m launcher`` started for the run
    (``cluster.embedded_etcd_members=3``), found by its data directory under the run's."""
    data_dir = str(Path(run_dir) / "etcd" / f"member{member}")
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--data-dir" in cmd and cmd[cmd.index("--data-dir") + 1] == data_dir:
            return _signal(run_dir, [p], signal.SIGKILL, kind="etcd", target=f"member{member}")
    raise TargetNotFound(f"no etcd process with --data-dir {data_dir}")


def partition(run_dir: str | os.PathLike[str], net: LocalNetwork, node: int, link: str) -> float:
    """Cut node ``node`` of ``net`` off its peers (``link="peer"``) or off etcd (``"etcd"``);
    :func:`heal` joins it again."""
    sent = _log(run_dir, "fault_injected", kind="partition", target=f"node{node}", link=link)
    net.set_link(node, link, up=False)
    return sent


def heal(run_dir: str | os.PathLike[str], net: LocalNetwork, node: int, link: str) -> float:
    """End a :func:`partition`."""
    net.set_link(node, link, up=True)
    return _log(run_dir, "fault_cleared", kind="partition", target=f"node{node}", link=link)


def throttle(
    run_dir: str | os.PathLike[str], net: LocalNetwork, node: int, rate_mbit: float
) -> float:
    """Slow node ``node``'s link to its peers to ``rate_mbit`` (:meth:`LocalNetwork.set_rate`):
    a node that is slow, not dead. :func:`unthrottle` lifts the limit."""
    sent = _log(
        run_dir, "fault_injected", kind="slow_network", target=f"node{node}", rate_mbit=rate_mbit
    )
    net.set_rate(node, PEER_LINK, rate_mbit)
    return sent


def unthrottle(run_dir: str | os.PathLike[str], net: LocalNetwork, node: int) -> float:
    """End a :func:`throttle`."""
    net.set_rate(node, PEER_LINK, None)
    return _log(run_dir, "fault_cleared", kind="slow_network", target=f"node{node}")


def _log(run_dir: str | os.PathLike[str], event: str, **fields: Any) -> float:
    """Write one chaos event to the run's log; returns its timestamp."""
    log = EventLog(run_dir, CHAOS_NODE, role="chaos")
    try:
        return float(log.emit(event, **fields)["ts"])
    finally:
        log.close()


def _signal(
    run_dir: str | os.PathLike[str],
    procs: list[psutil.Process],
    sig: signal.Signals,
    event: str = "fault_injected",
    **fields: Any,
) -> float:
    sent = _log(run_dir, event, signal=sig.name, pids=[p.pid for p in procs], **fields)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    return sent
