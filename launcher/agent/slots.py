"""How many workers a node runs, on which device, and whether the job's layout takes them.

The agent starts them, the doctor checks for them.

Asking CUDA means importing torch, which costs seconds; on a machine that cannot have a usable
NVIDIA GPU the answer is known without it. So the device is decided from plain facts first
(:func:`device_without_cuda`: the ``cluster.device`` setting, the GPU device nodes, and
``CUDA_VISIBLE_DEVICES``), and torch is asked only when a GPU may really be there.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from elastic import config

# The nodes the NVIDIA driver creates per GPU (/dev/nvidia0, ...; not nvidiactl or nvidia-uvm),
# and WSL2's GPU paravirtualisation device, through which CUDA reaches the host's GPUs.
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg")


def gpu_device_nodes() -> list[str]:
    """The GPU device nodes present on this machine."""
    return sorted(path for pattern in GPU_DEVICE_NODES for path in glob.glob(pattern))


def device_without_cuda(
    setting: str, device_nodes: Sequence[str], cuda_visible_devices: str | None
) -> str | None:
    """The device this node trains on, when the facts decide it without asking CUDA.

    None when only CUDA can tell (``auto``, and a GPU may be visible).

    ``setting`` is ``cluster.device``; ``device_nodes`` are the GPU device nodes found
    (:func:`gpu_device_nodes`); ``cuda_visible_devices`` is that variable, None when unset. CUDA
    stops reading the variable at its first invalid entry, so an empty value or one that starts
    with ``-1`` hides every GPU.
    """
    if setting in ("cpu", "cuda"):
        return str(setting)
    first = None if cuda_visible_devices is None else cuda_visible_devices.split(",")[0].strip()
    if not device_nodes or first in ("", "-1"):
        return "cpu"
    return None


def local_slots(cfg: config.Config) -> tuple[int, str]:
    """How many workers this node runs, and on what device.

    Imports torch only when the node may train on a GPU."""
    device = device_without_cuda(
        cfg.cluster.device, gpu_device_nodes(), os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    if device != "cpu":
        import torch  # heavy (seconds): only where a GPU may be used

        if device == "cuda" or torch.cuda.is_available():
            return cfg.cluster.workers_per_node or torch.cuda.device_count(), "cuda"
    return cfg.cluster.workers_per_node or cfg.cluster.cpu_workers, "cpu"


def layout_refusal(slots: int, round_number: int, round_nodes: int, round_ranks: int) -> str | None:
    """Why a node of ``slots`` workers may not join a job under ``parallel.shard=node``; or None.

    Each node's state is sharded over its workers, so every node must run as many as the nodes
    of the job's current round (``round_ranks`` workers on ``round_nodes`` nodes; no round yet:
    0 nodes). A node short of a GPU, under ``cluster.workers_per_node=0``, would run fewer."""
    if round_nodes == 0 or round_ranks == slots * round_nodes:
        return None
    per_node, uneven = divmod(round_ranks, round_nodes)
    count = f"{per_node}" if not uneven else "the same number"
    return config.problem(
        "cluster.workers_per_node",
        slots,
        f"this node runs {slots} workers, and round {round_number} runs {round_ranks} on "
        f"{round_nodes} nodes: parallel.shard=node shards each node's state over its workers, "
        f"so every node must run as many",
        f"start this node with cluster.workers_per_node={count} (on CPU, cluster.cpu_workers), "
        f"or mend the GPU it misses",
    )
