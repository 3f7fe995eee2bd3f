"""``python -m chaos.node_helper``: one requested fault, carried out on this node and ended.

An agent of a job started with ``chaos.allow=true`` starts this helper, in a session of its own,
for each fault request it accepts (:mod:`launcher.fault_requests`); nothing else should. The
helper outlives the agent it stops or kills, so it can end the fault as a campaign run on this
machine would: it thaws a frozen node after ``--duration-s``, and starts a killed or departed
node's agent again after ``--restart-after-s`` with the command line, directory and environment
it had (a repaired machine whose supervisor starts the launcher again). Each step is an event in
the node's own event file (role ``chaos``), as :mod:`chaos.injectors` writes them.
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

import psutil

from chaos import injectors

LEAVE_TIMEOUT_S = 300.0  # a departing agent that has not exited by then is started again anyway


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
            worker = injectors.process_tree(args.worker_pid, f"worker {args.local_rank}")[0]
            target = f"{node}/worker{args.local_rank}"
            injectors.send(
                run_dir, [worker], signal.SIGKILL, writer=node, kind="worker", target=target
            )
            return 0
        # The agent started this helper: it is in the agent's tree, and must not stop itself.
        procs = [
            p
            for p in injectors.process_tree(args.agent_pid, f"the agent of {node}")
            if p.pid != os.getpid()
        ]
    except injectors.TargetNotFound as exc:
        injectors.skipped(run_dir, args.kind, node, str(exc))
        return 1
    if args.kind == "freeze_node":
        injectors.send(run_dir, procs, signal.SIGSTOP, writer=node, kind="node", target=node)
        time.sleep(args.duration_s)  # the fault's length, not a wait for anything
        injectors.send(
            run_dir, procs, signal.SIGCONT, "fault_cleared", writer=node, kind="node", target=node
        )
        return 0
    agent = procs[0]
    with agent.oneshot():
        command, cwd, env = agent.cmdline(), agent.cwd(), agent.environ()
    sig = signal.SIGKILL if args.kind == "kill_node" else signal.SIGTERM
    injectors.send(run_dir, procs, sig, writer=node, kind="node", target=node)
    if args.kind == "leave_node":  # it finishes its step in flight and leaves on its own
        psutil.wait_procs([agent], timeout=LEAVE_TIMEOUT_S)
    if args.restart_after_s < 0:
        return 0
    time.sleep(args.restart_after_s)  # the repair's length
    injectors.log_event(run_dir, "fault_cleared", writer=node, kind="restart", target=node)
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
