"""The two threads that keep one registration of a node alive and in step with the job.

The lease keeper's thread (``rdzv-keepalive``) refreshes the registration's lease
(:class:`launcher.rendezvous.lease.LeaseKeeper`). The sync thread (``rdzv-sync``) keeps the
view's watches alive, re-reads the job now and then, writes the node's record where a write found
etcd away, claims the lead when nobody holds it and, as leader, proposes rounds. While etcd is
away the sync loop backs off (:func:`launcher.rendezvous.etcd_client.backoff`) and stays quiet:
the keep-alive says when etcd is away.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from elastic.config import RendezvousConfig
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.etcd_client import EtcdClient, backoff
from launcher.rendezvous.follower import JobFollower
from launcher.rendezvous.leader import Leadership, leads
from launcher.rendezvous.lease import Emit, LeaseKeeper
from launcher.rendezvous.record import OwnRecord
from launcher.rendezvous.standing import Standing

# The rendezvous's log, as its lines have always been named.
log = logging.getLogger("launcher.rendezvous.rendezvous")


class Upkeep:
    """The threads of each registration of ``node_id`` in turn.

    :meth:`start` starts them for one registration, then :meth:`stop` ends them. ``stopping`` ends
    both threads; ``wake`` makes the sync loop look again at once (a change to write, etcd back)."""

    def __init__(
        self,
        etcd: EtcdClient,
        cfg: RendezvousConfig,
        node_id: str,
        *,
        follower: JobFollower,
        record: OwnRecord,
        leadership: Leadership,
        standing: Standing,
        emit: Emit,
        stopping: threading.Event,
        wake: threading.Event,
    ) -> None:
        self._etcd, self._cfg, self._node_id, self._emit = etcd, cfg, node_id, emit
        self._registration = 0  # the create revision of the node's key, while started
        self._lease: Any = None  # the registration's lease, while started
        self._follower, self._record, self._leadership = follower, record, leadership
        self._standing, self._stopping, self._wake = standing, stopping, wake
        self._threads: list[threading.Thread] = []

    def start(self, registration: int, lease: Any) -> None:
        """Start the lease keeper's thread and the sync thread of one registration.

        The registration is ``registration`` (its key's create revision), under ``lease``."""
        self._registration, self._lease = registration, lease
        keeper = LeaseKeeper(
            self._etcd.raw,
            self._lease.id,
            self._cfg,
            self._node_id,
            self._emit,
            on_back=self._wake.set,  # the sync thread re-reads the job and re-opens the watch
            on_expired=lambda: self._standing.fence_now("the lease expired (etcd says so)"),
            on_lost=self._standing.etcd_gone,
            count_keepalive=self._etcd.load.count_keepalive,
        )
        self._threads = [
            threading.Thread(
                target=keeper.run, args=(self._stopping,), name="rdzv-keepalive", daemon=True
            ),
            threading.Thread(target=self._sync_loop, name="rdzv-sync", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """End both threads, waiting a few seconds for each.

        A sync thread that outlives the wait claims the lead no more (the lease is about to be
        revoked)."""
        self._stopping.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        self._lease = None

    def _sync_loop(self) -> None:
        """The sync thread's body: watches, re-reads, the lead and rounds, until stopped.

        It keeps the watches alive, re-reads the job now and then, claims the lead when nobody holds
        it, and proposes rounds as leader."""
        next_resync = 0.0
        failures = 0
        follower = self._follower
        while not self._stopping.is_set():
            deadline: float | None = None
            try:
                now = time.monotonic()
                leading = leads(follower.view, self._node_id, self._registration)
                if not follower.watch_ids or leading != follower.following_all:
                    follower.subscribe(leading)
                    next_resync = now + self._cfg.resync_s
                elif now >= next_resync or follower.reread:
                    follower.reread = False
                    follower.snapshot(follower.following_all)
                    next_resync = now + self._cfg.resync_s
                self._record.flush()
                if not follower.view.leader and follower.watch_ids and self._claimable():
                    self._leadership.claim(self._node_id, self._registration, self._lease)
                if not self._standing.fenced.is_set():
                    deadline = self._leadership.maybe_propose(
                        follower.view, self._node_id, self._registration, follower.last_change
                    )
                failures = 0
            except etcd_errors() as exc:  # the keep-alive says when etcd is away; no log spam
                self._etcd.no_space(exc)
                log.debug("rendezvous sync failed (%s); retrying", exc)
                follower.cancel()
                deadline = next_resync = time.monotonic() + backoff(failures)
                failures += 1
            wait = min(deadline or next_resync, next_resync) - time.monotonic()
            self._wake.wait(timeout=max(0.01, wait))
            self._wake.clear()

    def _claimable(self) -> bool:
        """Whether this registration may claim the lead: live, not fenced."""
        return not self._standing.fenced.is_set() and self._lease is not None
