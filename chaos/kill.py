"""Signal a whole node of a local job from another terminal, as a machine failure would.

Usage: ``python -m chaos.kill <run_dir> <node_id> [--signal KILL|STOP|CONT|TERM]``; use it to
watch a recovery.

A node that is not running (the job has ended, or the node is down already) is a clear line and
exit 2, not a traceback: this is the first fault a newcomer sends, from the README."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from chaos.injectors import kill_node, thaw_node
from launcher.agent.fault_helper import TargetNotFound


def main(argv: list[str] | None = None) -> int:
    """Send the signal; 0 once sent, 2 when there is no such run or running node."""
    parser = argparse.ArgumentParser(prog="python -m chaos.kill", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="the job's run directory, runs/<job_id>")
    parser.add_argument("node_id", help="the node to signal, e.g. node1")
    parser.add_argument(
        "--signal",
        default="KILL",
        choices=["KILL", "STOP", "CONT", "TERM"],
        help="KILL: a dead machine (the default); STOP: a hung one; CONT: thaw it; TERM: a "
        "planned leave",
    )
    args = parser.parse_args(argv)
    if not (args.run_dir / "events").is_dir():
        print(
            f"chaos.kill: {args.run_dir} holds no job's events: name a run directory that "
            "./dev.sh run printed (runs/<job_id>)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.signal == "CONT":
            thaw_node(args.run_dir, args.node_id)
        else:
            kill_node(args.run_dir, args.node_id, signal.Signals[f"SIG{args.signal}"])
    except TargetNotFound as exc:
        print(
            f"chaos.kill: cannot signal {args.node_id}: {exc}. The job has ended or the node "
            "is down already; start a job and signal it while it trains",
            file=sys.stderr,
        )
        return 2
    print(f"sent SIG{args.signal} to {args.node_id} of {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
