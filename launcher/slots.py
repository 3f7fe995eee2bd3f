"""How many workers a node runs, and on which device: the agent starts them, the doctor checks
for them."""

from __future__ import annotations

from elastic import config


def local_slots(cfg: config.Config) -> tuple[int, str]:
    """How many workers this node runs, and on what device."""
    import torch

    use_cuda = cfg.cluster.device == "cuda" or (
        cfg.cluster.device == "auto" and torch.cuda.is_available()
    )
    if use_cuda:
        return cfg.cluster.workers_per_node or torch.cuda.device_count(), "cuda"
    return cfg.cluster.workers_per_node or cfg.cluster.cpu_workers, "cpu"
