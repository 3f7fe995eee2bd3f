"""One gloo transport device per worker process (per interface), shared by all its gloo groups.

A gloo device runs a thread that polls its sockets every 10 ms, busy or idle (gloo's
``transport/tcp/device.cc``), and torch gives each group a device of its own. A worker held two
such threads (the training group's and the idle save group's), and a new pair each round; on
two shared cores each wake-up may take the training loop's core (docs/benchmarks.md, "Who takes
the training loop's core"). Groups made through :data:`BACKEND` share the process's devices
(one, or one per interface ``GLOO_SOCKET_IFNAME`` lists, as torch makes them): gloo keeps each
group's connections apart, and a lost peer fails them as before.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

BACKEND = "gloo_shared"  # the name torch knows the backend by (dist.Backend.register_backend)

IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # interfaces (comma-separated) gloo's sockets use

_devices: list[dist.ProcessGroupGloo.Device] = []  # made by the first group that needs them


def devices(ifname: str | None) -> list[dist.ProcessGroupGloo.Device]:
    """The process's gloo devices, made once, as torch makes each group's.

    One per interface ``ifname`` (``GLOO_SOCKET_IFNAME``) lists, else one on the address the
    host name resolves to."""
    if not _devices:
        if ifname and len(ifname) > 1:  # torch's own test of the variable
            _devices.extend(
                dist.ProcessGroupGloo.create_device(interface=name) for name in ifname.split(",")
            )
        else:
            _devices.append(dist.ProcessGroupGloo.create_default_device())
    return _devices


def options(timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """A gloo backend's options: the process's devices, two threads each, the group's timeout."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = devices(os.environ.get(IFNAME_ENV))
    opts._threads = 2 * len(opts._devices)
    opts._timeout = timeout
    return opts


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """torch's backend creator: a gloo backend on the process's devices."""
    return dist.ProcessGroupGloo(store, rank, size, options(timeout))


def register() -> None:
    """Make :data:`BACKEND` a backend name torch can create groups of; again is harmless."""
    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
