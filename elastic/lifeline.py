"""Tie a child process's life to its parent's: ``python -m elastic.lifeline PID CMD...``.

A node's workers must never outlive its agent, and a local cluster's agents and etcd must not
outlive the launcher: a SIGKILLed or OOM-killed parent would otherwise leave orphans that hold a
GPU, keep a lease alive or keep talking to peers of a round that is over. This trampoline asks the
kernel to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG`` survives ``exec``), checks that
the parent is still the expected one (it could have died before the signal was armed), then
becomes the real command. Spawning through it keeps Python code out of the window between fork
and exec, where the gRPC threads of an agent make ``preexec_fn`` unsafe.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def tied(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the process it starts dies with this one."""
    return [sys.executable, "-m", "elastic.lifeline", str(os.getpid()), *argv]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(f"lifeline: parent {parent} is gone; not starting {argv[0]}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
