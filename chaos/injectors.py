"""Fault injectors: real signals to real processes, found through the run's event log.

Each injection is itself written to the event log (``events/chaos.jsonl``) with the moment the
signal was sent, so recovery can be measured from the log alone: fault to first step after.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import psutil

from elastic.events import EventLog, read_events

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


def _signal(
    run_dir: str | os.PathLike[str],
    procs: list[psutil.Process],
    sig: signal.Signals,
    event: str = "fault_injected",
    **fields: Any,
) -> float:
    log = EventLog(run_dir, CHAOS_NODE, role="chaos")
    try:
        record = log.emit(event, signal=sig.name, pids=[p.pid for p in procs], **fields)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
    finally:
        log.close()
    return float(record["ts"])
