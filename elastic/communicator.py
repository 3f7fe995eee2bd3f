"""The process group of one round: which backend, where its store is, and how to tear it down.

The agent hands each worker its round through environment variables (:class:`WorkerEnv`). The
group bootstraps through the c10d TCPStore that the agent of the round's first node hosts, under a
key prefix per round, so groups of different rounds can never mix even on the same store. Gloo is
used on CPU and NCCL on GPU, chosen from the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist

# Exit code of a worker whose collective failed because a peer went away: not this worker's
# fault, so its agent waits for the next round instead of reporting a failure of its own.
EXIT_PEER_LOST = 75


@dataclass(frozen=True)
class WorkerEnv:
    """What an agent tells a worker it spawns."""

    config: str  # path of the resolved config.yaml
    run_dir: str
    node_id: str
    round: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    store_host: str
    store_port: int
    threads: int

    _NAMES = {
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "store_host": "MASTER_ADDR",
        "store_port": "MASTER_PORT",
    }

    def to_environ(self) -> dict[str, str]:
        return {
            self._NAMES.get(f.name, "ELASTIC_" + f.name.upper()): str(getattr(self, f.name))
            for f in fields(self)
        }

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        values = {}
        for f in fields(cls):
            raw = os.environ[cls._NAMES.get(f.name, "ELASTIC_" + f.name.upper())]
            values[f.name] = int(raw) if f.type == "int" else raw
        return cls(**values)


def pick_device(requested: str, local_rank: int) -> torch.device:
    """``auto``: this worker's GPU when CUDA is available, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but no GPU is visible: use cluster.device=auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Communicator:
    """Owns the default process group of one round."""

    def __init__(self, env: WorkerEnv, device: torch.device, timeout_s: float) -> None:
        self.env = env
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)

    def connect(self) -> None:
        store = dist.TCPStore(
            self.env.store_host, self.env.store_port, is_master=False, timeout=self.timeout
        )
        dist.init_process_group(
            backend_for(self.device),
            store=dist.PrefixStore(f"round{self.env.round}/", store),
            rank=self.env.rank,
            world_size=self.env.world_size,
            timeout=self.timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the communication layer (a peer died or the group broke).

    DDP reports a failed all-reduce from its autograd hook as a plain RuntimeError, so besides
    c10d's own error types the message is checked for the transports' wording.
    """
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in (
            "Gloo",
            "gloo",
            "NCCL",
            "Connection closed by peer",
            "Connection reset",
            "Broken pipe",
            "Timed out",
            "timed out",
            "ProcessGroup",
        )
    )
