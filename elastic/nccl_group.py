"""The decisions over a round's NCCL communicator: abort or only destroy it, shrink or rebuild it.

An abort is what frees a kernel stuck on a dead peer, but it costs 0.5-1 s (NCCL's proxy threads
see its flag only when their 500 ms poll returns), and it frees the communicator, which a shrink
needs alive. A destroy waits for one of those polls too (0.5 s on an H200), so neither is cheap;
a communicator with nothing in flight and no error is only destroyed, beside the next round
(:mod:`elastic.group_reaper`), and the ranks shrink only when every one of them offered to at
the round's meet (a shrink is a collective of every survivor). The communicator
(:mod:`elastic.communicator`) gathers the facts; these pure functions decide. The environment NCCL
runs with is :mod:`elastic.nccl_settings`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SHRINK, REBUILD = b"shrink", b"rebuild"  # what a rank offers at the meet


def must_abort(backend: str, aborted: bool, idle: bool, healthy: bool) -> bool:
    """Whether a round's group must be aborted before it is destroyed.

    It must on NCCL, unless it was already, or nothing of it may still run (``idle``) and it
    reports no error (``healthy``). gloo has no abort: its collectives end at their timeout
    (:meth:`elastic.communicator.Communicator.close`)."""
    return backend == "nccl" and not aborted and not (idle and healthy)


def healthy(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the group's backend reports no error (a failed collective, a lost peer, a timeout).

    Unknown (a torch without ``get_error``) counts as not."""
    backend = group._get_backend(device)
    if not hasattr(backend, "get_error"):
        return False
    return backend.get_error() == torch._C._distributed_c10d.ErrorType.SUCCESS


def agreed_to_shrink(offers: list[bytes], world_size: int) -> bool:
    """Whether every rank of the round offered to shrink at the meet (the values of its keys)."""
    return len(offers) == world_size and all(o == SHRINK for o in offers)


def can_shrink(backend: str, excluded: list[int] | None, live: bool, supported: bool) -> bool:
    """Whether a round's group may be the previous one shrunk.

    Only NCCL shrinks, only a round that removed ranks and added none (``excluded``), and only a
    communicator that still lives (``live``: ncclCommShrink needs its parent, which an abort
    frees) and can (``supported``)."""
    return backend == "nccl" and excluded is not None and live and supported
