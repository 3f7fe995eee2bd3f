"""``python -m launcher.agent.fault_helper``: carry out one requested fault on this node and end it.

An agent of a job started with ``chaos.allow=true`` starts this helper, in a session of its own,
for each fault request it accepts (:mod:`launcher.agent.fault_requests`). It outlives the agent
it stops or kills, so it can end the fault as a campaign on this machine would: it thaws a frozen
node after ``--duration-s`` and starts a killed node's agent again after ``--restart-after-s``,
as it was started. It lives in the launcher because the runtime never runs test tooling; the
signal primitives below are the ones :mod:`chaos.injectors` uses too, and each fault is logged
(role ``chaos``) before its signal is sent, so recovery is measured from the log alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from elastic import event_types as ev
from elastic.event_types import EventType
from elastic.events import EventLog

LEAVE_TIMEOUT_S = 300.0  # a departing agent that has not exited by then is started again anyway
CHAOS_NODE = "chaos"  # the event file of faults struck from outside the nodes (a campaign)


class TargetNotFound(LookupError):
    """No live process for the requested target."""


def process_tree(pid: int, what: str) -> list[psutil.Process]:
    """Process ``pid`` (``what``, for the error) and every process under it."""
    try:
        root = psutil.Process(pid)
        if root.status() == psutil.STATUS_ZOMBIE:  # dead, its parent has not reaped it yet
            raise psutil.NoSuchProcess(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess as exc:
        raise TargetNotFound(f"{what} (pid {pid}) is not running") from exc


def log_event(
    run_dir: str | os.PathLike[str], event: EventType, writer: str = CHAOS_NODE, **fields: Any
) -> float:
    """Write one fault event to the run's log; returns its timestamp.

    ``writer`` names the file: a node's helper appends to its node's, which on bare metal no
    other machine writes."""
    log = EventLog(run_dir, writer, role="chaos")
    try:
        return float(log.emit(event, **fields)["ts"])
    finally:
        log.close()


def send(
    run_dir: str | os.PathLike[str],
    procs: list[psutil.Process],
    sig: signal.Signals,
    event: EventType = ev.FAULT_INJECTED,
    writer: str = CHAOS_NODE,
    **fields: Any,
) -> float:
    """Log ``event`` (with the signal, the pids and ``fields``), then signal ``procs``."""
    sent = log_event(run_dir, event, writer, signal=sig.name, pids=[p.pid for p in procs], **fields)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    return sent


def skipped(run_dir: str | os.PathLike[str], kind: str, target: str, reason: str) -> float:
    """Log a fault that was due but could not be carried out, and why."""
    return log_event(run_dir, ev.FAULT_SKIPPED, kind=kind, target=target, reason=reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--agent-pid", type=int, required=True)
    parser.add_argument(
        "--kind", required=True, choices=["kill_node", "kill_worker", "freeze_node", "leave_node"]
    )
    parser.add_argument("--duration-s", type=float, default=0.0)
    parser.add_argument("--restart-after-s", type=float, default=-1.0)
    parser.add_argument("--worker-pid", type=int, default=0)
    parser.add_argument("--local-rank", type=int, default=0)
    args = parser.parse_args(argv)
    run_dir, node = args.run_dir, args.node
    try:
        if args.kind == "kill_worker":
            worker = process_tree(args.worker_pid, f"worker {args.local_rank}")[0]
            target = f"{node}/worker{args.local_rank}"
            send(run_dir, [worker], signal.SIGKILL, writer=node, kind="worker", target=target)
            return 0
        # The agent started this helper: it is in the agent's tree, and must not stop itself.
        procs = [
            p for p in process_tree(args.agent_pid, f"the agent of {node}") if p.pid != os.getpid()
        ]
    except TargetNotFound as exc:
        skipped(run_dir, args.kind, node, str(exc))
        return 1
    if args.kind == "freeze_node":
        send(run_dir, procs, signal.SIGSTOP, writer=node, kind="node", target=node)
        time.sleep(args.duration_s)  # the fault's length, not a wait for anything
        send(
            run_dir, procs, signal.SIGCONT, ev.FAULT_CLEARED, writer=node, kind="node", target=node
        )
        return 0
    agent = procs[0]
    with agent.oneshot():
        command, cwd, env = agent.cmdline(), agent.cwd(), agent.environ()
    sig = signal.SIGKILL if args.kind == "kill_node" else signal.SIGTERM
    send(run_dir, procs, sig, writer=node, kind="node", target=node)
    if args.kind == "leave_node":  # it finishes its step in flight and leaves on its own
        psutil.wait_procs([agent], timeout=LEAVE_TIMEOUT_S)
    if args.restart_after_s < 0:
        return 0
    time.sleep(args.restart_after_s)  # the repair's length
    log_event(run_dir, ev.FAULT_CLEARED, writer=node, kind="restart", target=node)
    with open(run_dir / "logs" / f"{node}.log", "ab") as out:
        subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
