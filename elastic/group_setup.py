"""How a round's process group is set up: the ranks meet, then build or shrink the group.

The caller is :meth:`elastic.communicator.Communicator.enter`. The ranks first meet on the
round's store, abortably; then each builds the group anew on that store, or shrinks its previous
one when every rank offered to.

These are the calls into torch that make a group, each bounded by the group's timeout; the
communicator decides which to make (:mod:`elastic.nccl_group`) and keeps the round's bookkeeping.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic import gloo_device
from elastic.control import Assignment
from elastic.nccl_group import REBUILD, SHRINK

log = logging.getLogger("elastic.communicator")  # the set-up is the communicator's

MEET_FIRST_PAUSE_S = 0.005  # a rank waiting for its round's peers looks again after this,
MEET_POLL_S = 0.1  # doubling up to this: how soon it sees an abort


def meet(
    assignment: Assignment, offer: bool, timeout: timedelta, aborted: threading.Event
) -> list[bytes] | None:
    """Wait until every rank of the round has reached its set-up, abortably; what each offered.

    Returns what every rank offered (:data:`~elastic.nccl_group.SHRINK` when ``offer``-ed, else
    :data:`~elastic.nccl_group.REBUILD`), or None once ``aborted`` is set.

    The group's own set-up cannot be interrupted: begun while a peer is frozen (a node
    stopped just before its round was formed), it waits out the whole
    ``rendezvous.pg_timeout_s``, even when the agent has announced a newer round without that
    peer a moment later. So the ranks first meet on the store, on a thread of their own (a
    store client connecting to a frozen host hangs whatever its timeout), while this thread
    watches for an abort; ranks that all met a moment ago set up at once.
    """
    met = threading.Event()
    errors: list[BaseException] = []
    offers: list[bytes] = []

    def wait_for_peers() -> None:
        keys = arrival_keys(assignment.round, assignment.world_size)
        pause = MEET_FIRST_PAUSE_S
        try:
            store = dist.TCPStore(
                assignment.store_host,
                assignment.store_port,
                is_master=False,
                timeout=timeout,
            )
            store.set(keys[assignment.rank], SHRINK if offer else REBUILD)
            deadline = time.monotonic() + timeout.total_seconds()
            while not store.check(keys) and not aborted.is_set():
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(
                        f"not every rank of round {assignment.round} reached its set-up "
                        f"within {timeout.total_seconds():.0f} s"
                    )
                time.sleep(pause)  # the peers' keys arrive at the store: look again
                pause = min(2 * pause, MEET_POLL_S)
            if not aborted.is_set():
                offers.extend(store.multi_get(keys))
        except dist.DistError as exc:
            errors.append(exc)
        met.set()

    name = f"meet-round{assignment.round}"
    threading.Thread(target=wait_for_peers, name=name, daemon=True).start()
    while not met.wait(MEET_POLL_S):
        if aborted.is_set():
            break
    if aborted.is_set():
        return None
    if errors:
        raise errors[0]
    return offers


def arrival_keys(round_: int, world_size: int) -> list[str]:
    """The keys by which the ranks of round ``round_`` say on its store they reached its set-up."""
    return [f"round{round_}/arrived/{rank}" for rank in range(world_size)]


def set_up_begun(host: str, port: int, round_: int, world_size: int, timeout_s: float) -> bool:
    """Whether every rank of round ``round_`` reached its set-up within ``timeout_s``.

    Then none is in the previous round any more. A worker leaving that round as planned asks
    before it goes (:meth:`elastic.agent_link.AgentLink`). On a thread of its own, as in
    :func:`meet`: a store client connecting to a frozen host hangs whatever its timeout."""
    begun = threading.Event()

    def wait() -> None:
        with contextlib.suppress(dist.DistError):  # the store is gone: the answer is no
            timeout = timedelta(seconds=timeout_s)
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            store.wait(arrival_keys(round_, world_size))
            begun.set()

    threading.Thread(target=wait, name=f"await-round{round_}", daemon=True).start()
    return begun.wait(timeout_s)


def init_group(
    assignment: Assignment, backend: str, device: torch.device, timeout: timedelta
) -> None:
    """Build the round's group on the c10d TCPStore of the round's first node's agent.

    That agent hosts the store. The group's keys sit under a key prefix per round, so that
    groups of different rounds never mix even on the same store."""
    store = dist.TCPStore(
        assignment.store_host, assignment.store_port, is_master=False, timeout=timeout
    )
    # torch names a process's groups, and their keys on the store, from a count of the
    # groups it has created, set back to 0 only when the default group is destroyed. A
    # set-up that failed (a peer lost while the group was built) leaves no group to destroy
    # and the count advanced on this rank alone: its next groups would wait for keys under
    # names no peer uses, round after round. No group exists here: count from 0, as the
    # destroy would have.
    dist.distributed_c10d._world.group_count = 0
    options = None
    if backend == "nccl":
        # Non-blocking communicators let abort() return even when a kernel is stuck.
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = False
    if backend == "gloo":
        gloo_device.register()
        backend = gloo_device.BACKEND  # gloo on the process's devices, across rounds too
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"round{assignment.round}/", store),
        rank=assignment.rank,
        world_size=assignment.world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
        pg_options=options,
    )


def shrink(excluded: list[int]) -> bool:
    """Shrink the current group by ``excluded``, as every rank agreed to; whether it worked.

    A shrink that fails is no failure of the round: the rank builds the group anew, and its
    peers' set-up (bounded by the group's timeout) shows whether they did too."""
    try:
        # SHRINK_ABORT is not exported as torch.distributed.SHRINK_ABORT (2.11 to 2.14).
        dist.shrink_group(excluded, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
    except Exception as exc:  # any backend's: the full rebuild follows
        log.warning("shrinking the group failed (%s: %s); building it anew", type(exc), exc)
        return False
    return True
