"""A peer job's three nodes and the step logs they write, whichever runtime the peer is.

The peers (torchrun: bench/torchrun_peer.py; torchft: bench/torchft_peer.py) differ in what
each node runs, not in how a bench strikes a node or reads the result. Each node is a process
tree in a session of its own, as a machine, so a fault reaches all of it. Every rank appends
``step N wall_time world`` for each step it completed and a ``start wall_time world= rank=
from_step= ...`` line when its process (re)starts training. From those lines come the stall
and redone steps after a fault, by the definitions of :mod:`chaos.recovery_figures`, and the
job's own pace.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

NODES = ["node0", "node1", "node2"]  # node0 hosts the peer's store
BATCH = 32  # the peer's per-rank batch
PROGRESS_AFTER_RESTART_S = 0.5  # a restarted job's step this long after the fault is progress


@dataclass(frozen=True)
class PeerRecovery:
    stall_s: float | None  # None: no progress after the fault
    redone_steps: int | None
    detail: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class PeerJob:
    """The nodes of one peer job, each a process tree in its own session, and their logs."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """``argv`` in a session of its own, its output appended to ``work/<name>.out``."""
        with open(self.work / f"{name}.out", "ab") as out:
            return subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def signal(self, node: str, sig: signal.Signals) -> float:
        """``sig`` to the node's process and every process under it; when it was sent."""
        sent = time.time()
        with contextlib.suppress(psutil.NoSuchProcess):
            top = psutil.Process(self.procs[node].pid)
            for p in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(sig)
        return sent

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def lines(self, node: str | None = None) -> list[list[str]]:
        """The split log lines of ``node`` (or of every node), each node's in order."""
        logs = [self.logs / f"{node}.log"] if node else sorted(self.logs.glob("*.log"))
        return [ln.split() for log in logs if log.exists() for ln in log.read_text().splitlines()]

    def steps(self) -> list[tuple[float, int, int]]:
        """``(time, step, world size)`` of every step any rank logged, in time order."""
        return sorted((float(p[2]), int(p[1]), int(p[3])) for p in self.lines() if p[0] == "step")

    def max_step(self) -> int:
        return max((s for _, s, _ in self.steps()), default=0)

    def pace(self) -> dict[int, float]:
        """The job's own fault-free pace: the median samples/s at each world size.

        It is taken between consecutive steps of one worker incarnation (a node's log between two
        ``start`` lines), as :func:`chaos.verdict.pace` takes ours within a round."""
        by_size: dict[int, list[float]] = {}
        for node in NODES:
            previous = None
            for p in self.lines(node):
                if p[0] != "step":
                    previous = None  # a new incarnation
                    continue
                t, step, world = float(p[2]), int(p[1]), int(p[3])
                if previous is not None and step == previous[1] + 1 and t > previous[0]:
                    by_size.setdefault(world, []).append(BATCH * world / (t - previous[0]))
                previous = (t, step)
        return {w: statistics.median(r) for w, r in by_size.items()}

    def recovery(self, fault_ts: float, victim: str) -> PeerRecovery:
        """The survivors' stall and redone steps after a fault at ``fault_ts`` on ``victim``.

        The stall runs until a survivor completes a step beyond the one in flight, or any step of a
        job restarted after the fault. Redone steps are the ones trained again because the job
        resumed from an older checkpoint."""
        last_before, after, resumed_from = 0, [], None
        for node in NODES:
            if node == victim:
                continue
            for p in self.lines(node):
                if p[0] == "step":
                    t, step = float(p[2]), int(p[1])
                    if t < fault_ts:
                        last_before = max(last_before, step)
                    else:
                        after.append((t, step))
                elif p[0] == "start" and float(p[1]) > fault_ts:
                    resumed_from = int(p[4].split("=")[1])
        progress = sorted(
            t
            for t, step in after
            if step > last_before + 1
            or (resumed_from is not None and t > fault_ts + PROGRESS_AFTER_RESTART_S)
        )
        if not progress:
            return PeerRecovery(
                None, None, f"no progress after the fault (last step {last_before})"
            )
        redone = last_before - resumed_from if resumed_from is not None else 0
        stall = progress[0] - fault_ts
        return PeerRecovery(
            stall,
            redone,
            f"stall {stall:.2f} s, last step before {last_before}, resumed from {resumed_from}, "
            f"{redone} redone",
        )

    def stop(self) -> None:
        for node in self.procs:
            self.signal(node, signal.SIGCONT)
            self.signal(node, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
