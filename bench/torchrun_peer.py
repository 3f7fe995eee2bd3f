"""The torchrun peer, driven from Python: three torchrun agents running the shared ``train.py``.

The script is the shared peer's (``shared/bench/peer_torchrun``). The agents run at torch's
defaults or tuned, with the node that hosts the c10d store known.

The benches start node0 first and the others only once its agent serves the store, so that
node0 hosts it (started at once, any agent may win the race for the port; the shared ``run.sh``
staggers its starts by 0.3 s, less than an agent's start-up). Its step log lines (``step N
wall_time world``, ``start wall_time world= rank= from_step= ...``) give the stall and the redone
steps after a fault by the definitions of :mod:`chaos.recovery_figures`, and the job's own pace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

NODES = ["node0", "node1", "node2"]  # node0 hosts the c10d store
BATCH = 32  # train.py's per-rank batch
STORE_WAIT_S = 120.0  # node0's agent must serve its store within this
PROGRESS_AFTER_RESTART_S = 0.5  # a restarted job's step this long after the fault is progress


@dataclass(frozen=True)
class PeerSettings:
    """How the peer's torchrun runs: one row of a bench's table."""

    name: str
    env: dict[str, str]
    args: list[str]


DEFAULTS = PeerSettings("torchrun, defaults", {}, [])
# As a careful user tunes it for fast recovery (the shared peer's TUNED=1): no shared rendezvous
# store (it dies with the node of rank 0), keep-alives every 1 s with a node dead after 3
# missed, a 1 s last call, and a 10 s gloo timeout so that a frozen peer fails the collective.
TUNED = PeerSettings(
    "torchrun, tuned",
    {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PG_TIMEOUT_S": "10"},
    ["--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"],
)
PEERS = [DEFAULTS, TUNED]


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


class Peer:
    """Three torchrun agents of the peer job, each in its own session (a node)."""

    def __init__(
        self,
        work: Path,
        train: Path,
        settings: PeerSettings,
        *,
        steps: int,
        step_sleep: float,
        ckpt_every: int,
        nnodes: str,
        max_restarts: int,
    ) -> None:
        self.work = work
        self.train = train
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.env = {
            **os.environ,
            **settings.env,
            "LOG_DIR": str(self.logs),
            "CKPT_PATH": str(work / "ckpt.pt"),
            "STEPS": str(steps),
            "CKPT_EVERY": str(ckpt_every),
            "STEP_SLEEP": f"{step_sleep:.3f}",
        }
        self.port = free_port()
        self.argv = [
            "torchrun",
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=peer",
            *settings.args,
            str(train),
        ]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str) -> None:
        with open(self.work / f"{node}.out", "ab") as out:
            self.procs[node] = subprocess.Popen(
                self.argv,
                env={**self.env, "NODE_NAME": node},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_all(self) -> None:
        """node0 first, and the others once its agent serves the c10d store."""
        self.start(NODES[0])
        deadline = time.monotonic() + STORE_WAIT_S
        while not answers(self.port):
            if time.monotonic() > deadline or self.procs[NODES[0]].poll() is not None:
                raise RuntimeError(f"the peer's node0 served no store; see {self.work}/node0.out")
            time.sleep(0.1)
        for node in NODES[1:]:
            self.start(node)

    def signal(self, node: str, sig: signal.Signals) -> float:
        """``sig`` to the node's agent and every process under it; when it was sent."""
        sent = time.time()
        with contextlib.suppress(psutil.NoSuchProcess):
            agent = psutil.Process(self.procs[node].pid)
            for p in [agent, *agent.children(recursive=True)]:
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
