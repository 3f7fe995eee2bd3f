"""The torchrun peer, driven from Python: three torchrun agents running the shared ``train.py``.

The script is the shared peer's (``shared/bench/peer_torchrun``). The agents run at torch's
defaults or tuned, with the node that hosts the c10d store known.

The benches start node0 first and the others only once its agent serves the store, so that
node0 hosts it (started at once, any agent may win the race for the port; the shared ``run.sh``
staggers its starts by 0.3 s, less than an agent's start-up). Its step logs, and how a fault
reaches a node, are bench/peer_job.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from peer_job import NODES, PeerJob, answers, free_port

STORE_WAIT_S = 120.0  # node0's agent must serve its store within this


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


class Peer(PeerJob):
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
        super().__init__(work)
        self.train = train
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

    def start(self, node: str) -> None:
        self.procs[node] = self.spawn(node, self.argv, {**self.env, "NODE_NAME": node})

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
