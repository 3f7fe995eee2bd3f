"""One gloo transport device per worker process, shared by every gloo group the worker makes.

A gloo device runs a thread that polls its sockets every 10 ms, busy or idle (gloo's
``transport/tcp/device.cc``), and torch gives each group a device of its own. A worker held two
such threads (the training group's and the idle save group's), and a new pair each round; on
two shared cores each wake-up may take the training loop's core (docs/benchmarks.md, "Who takes
the training loop's core"). Groups made through :data:`BACKEND` share the process's one device:
gloo keeps each group's connections apart, and a lost peer fails them as before.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

BACKEND = "gloo_shared"  # the name torch knows the backend by (dist.Backend.register_backend)

_device: dist.ProcessGroupGloo.Device | None = None  # made by the first group that needs it


def options(timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """A gloo backend's options: the process's device, and the group's timeout.

    The device is made as torch makes each group's (``GLOO_SOCKET_IFNAME``, else the host
    name's address)."""
    global _device
    if _device is None:
        _device = dist.ProcessGroupGloo.create_default_device()
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [_device]
    opts._timeout = timeout
    return opts


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """torch's backend creator: a gloo backend on the process's device."""
    return dist.ProcessGroupGloo(store, rank, size, options(timeout))


def register() -> None:
    """Make :data:`BACKEND` a backend name torch can create groups of; again is harmless."""
    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
