"""Shut old process groups down off the training thread, so a round's set-up never waits for it.

Destroying an idle NCCL group costs 0.5 s (an H200, 2026-11-28): its shutdown waits for a poll of
NCCL's proxy thread and joins torch's watchdog. On the training thread that is most of a rebuild.
torch needs only to forget the old groups before the next one is built: :func:`forget_groups`
does that, and a :class:`GroupReaper` shuts them down on a thread of their own meanwhile.

A group handed over with collectives still in flight is shut down only once they have ended, and
let go then: dropping a gloo group's last reference joins its threads, which on the training
thread would stall a round by up to the group's timeout (gloo cannot abort them). An NCCL group
that must be aborted first (:func:`elastic.nccl_group.must_abort`) is aborted here too: an abort
costs 0.5-1 s, and ends its collectives.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger("elastic.communicator")  # the teardown is the communicator's

POLL_S = 0.05  # how often a teardown looks whether the collectives it waits for have ended
LAST_WAIT_S = 10.0  # how long a worker leaving for good waits for its groups' shutdown


def forget_groups() -> list[dist.ProcessGroup]:
    """Make torch forget every process group of this process, shutting none down; the groups.

    ``destroy_process_group`` shuts down the groups it finds in torch's table of group names,
    then clears every table: emptied first, it only clears. The groups come newest first, the
    order torch shuts them down in. A torch without that table gets a plain destroy, and [].
    """
    names = getattr(dist.distributed_c10d._world, "pg_names", None)
    if not isinstance(names, dict):
        dist.destroy_process_group()
        return []
    groups = sorted(names, key=lambda pg: names[pg], reverse=True)
    names.clear()
    dist.destroy_process_group()
    return groups


class GroupReaper:
    """Shuts down the groups a round left, each round's on a thread of its own."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s  # the groups' own: no collective of theirs outlives it
        self.teardown_s: list[float] = []  # each round's, handed over to shut down; for benches
        self._threads: list[threading.Thread] = []
        self._stuck: list[list[dist.ProcessGroup]] = []  # never shut down, held for good

    def take(
        self,
        groups: list[dist.ProcessGroup],
        in_flight: list[dist.Work],
        abort: dist.ProcessGroup | None = None,
    ) -> None:
        """Shut ``groups`` down once ``in_flight`` has ended, without waiting for it here.

        ``abort``: one of them to abort first, which is what ends its collectives (NCCL's)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(
            target=self._reap, args=(groups, in_flight, abort), name="group-reaper", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every teardown handed over so far; whether all ended."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        return not self._threads

    def _reap(
        self,
        groups: list[dist.ProcessGroup],
        in_flight: list[dist.Work],
        abort: dist.ProcessGroup | None,
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is a thread's own
        started = time.monotonic()
        if abort is not None:
            try:
                abort.abort()
            except Exception as exc:  # shut down below all the same
                log.warning("aborting an old group failed: %s: %s", type(exc).__name__, exc)
        deadline = time.monotonic() + self.timeout_s + 10
        while not all(w.is_completed() for w in in_flight):
            if time.monotonic() >= deadline:
                # Torn down under a blocked collective, a gloo group can crash the process.
                log.warning("a collective outlived its group's timeout: the group is kept")
                self._stuck.append(groups)
                return
            time.sleep(POLL_S)
        for group in groups:
            try:
                group.shutdown()
            except Exception as exc:  # the group is gone either way; say why it was not clean
                log.warning("shutting an old group down failed: %s: %s", type(exc).__name__, exc)
        self.teardown_s.append(time.monotonic() - started)
