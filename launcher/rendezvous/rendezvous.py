"""etcd v3 rendezvous: which nodes are in the job and which round they train in.

A node registers under a lease of its own; its registration is its key's create revision, so a
node that registers again is a new member, never mistaken for the one a stale round lists. The
parts, each in its module here: the node's own record (``record``), the lease keeping
(``lease``), the view of the job kept from watches (``follower``), on the node that leads the
round proposals (``leader``), the two threads that keep a registration going (``upkeep``),
whether the node is fenced or cut off (``standing``), a dead peer's eviction (``eviction``), and
the one etcd client they all call through, which counts what the node costs etcd and retries
through outages (``etcd_client``). A round is replaced only by a transaction conditioned on the
revision its proposer read (fencing), so two proposers never both win.

A peer that sees a node die deletes its key (:meth:`Rendezvous.evict`) instead of waiting for the
lease; a node whose key is gone, evicted or expired, fences itself. etcd away is not a lost
lease: the node trains on and retries, up to ``rendezvous.etcd_grace_s``. The agent passes
``on_change`` and then reads :attr:`~Rendezvous.view`, :attr:`~Rendezvous.fenced` and
:attr:`~Rendezvous.etcd_lost`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from elastic import event_types as ev
from elastic.config import RendezvousConfig
from elastic.event_types import EventType
from elastic.events import EventLog
from launcher.rendezvous.etcd import etcd_errors, lease_gone
from launcher.rendezvous.etcd_client import EtcdClient
from launcher.rendezvous.eviction import evict
from launcher.rendezvous.follower import JobFollower, read_round
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.leader import Leadership, leads
from launcher.rendezvous.membership import (
    JobView,
    Member,
    NodeRecord,
    Round,
    RoundIncomplete,
)
from launcher.rendezvous.record import OwnRecord
from launcher.rendezvous.standing import Standing
from launcher.rendezvous.upkeep import Upkeep

log = logging.getLogger(__name__)


class NodeIdInUse(RuntimeError):
    """The node id is registered already, by another live node or an earlier incarnation.

    An earlier incarnation of this node holds it while its lease still runs (a crash, then a restart
    at once)."""

    def __init__(self, message: str, holder: NodeRecord) -> None:
        super().__init__(message)
        self.holder = holder  # the registration that holds the id (joined_rev: its revision)


class Rendezvous:
    """One node's membership in a job: join, wait for a view, propose, evict, leave.

    That is what the node asks of the rendezvous. It wires the parts to one etcd client and one
    condition: its record, the view it follows, the leadership, its standing and the threads of its
    upkeep."""

    def __init__(
        self,
        client: Any,
        *,
        job_id: str,
        node: NodeRecord,
        cfg: RendezvousConfig,
        min_nodes: int,
        max_nodes: int,
        events: EventLog | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """Build the node's parts over the etcd client ``client``; :meth:`join` starts them.

        ``on_change`` is called on the rendezvous's threads, after each change of the view and when
        this node is fenced; it must return at once (the agent posts to its inbox)."""
        self._cfg = cfg
        self._events = events
        self.keys = JobKeys(cfg.prefix, job_id)
        self._node_key = self.keys.node(node.node_id)  # its id never changes
        self._etcd = EtcdClient(
            client,
            node_id=node.node_id,
            prefix=self.keys.rendezvous,
            grace_s=cfg.etcd_grace_s,
            emit=self._emit,
        )
        self.load = self._etcd.load
        standing = Standing(node.node_id, self._emit, on_change or (lambda: None))
        self.fenced, self.etcd_lost = standing.fenced, standing.etcd_lost
        self._fence_now = standing.fence_now
        self._lease: Any = None
        self._registration = 0  # create revision of this node's key
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._whole: Round | None = None  # the newest round read whole (:meth:`whole_round`)
        self.follower = JobFollower(
            self._etcd,
            self.keys,
            node,
            cond=standing.cond,
            wake=self._wake,
            stopping=self._stop,
            fenced=self.fenced,
            fence=standing.fence,
            changed=standing.changed,
        )
        self.record = OwnRecord(
            self._etcd,
            self._node_key,
            node,
            self._emit,
            saw_own=self.follower.saw_own,
            fence=self._fence_now,
            wake=self._wake.set,
        )
        self.leadership = Leadership(self._etcd, self.keys, cfg, min_nodes, max_nodes, self._emit)
        self._upkeep = Upkeep(
            self._etcd,
            cfg,
            node.node_id,
            follower=self.follower,
            record=self.record,
            leadership=self.leadership,
            standing=standing,
            emit=self._emit,
            stopping=self._stop,
            wake=self._wake,
        )

    # --- membership --------------------------------------------------------------------------

    def join(self) -> None:
        """Register this node under a fresh lease and start following the job.

        While etcd does not answer this retries with backoff, up to ``rendezvous.etcd_grace_s``;
        then it raises :class:`~launcher.rendezvous.etcd_client.EtcdLost`.
        """
        self._stop.clear()
        self.fenced.clear()
        self.follower.reset(self.record.fresh())
        leases: list[Any] = []  # one per attempt: a retried attempt may have registered
        lease, ok, responses = self.retry("register", lambda: self._register(leases))
        if ok:
            registration = responses[0].response_put.header.revision
        else:
            [(value, meta)] = responses[0]
            lease = next((ours for ours in leases if ours.id == meta.lease_id), None)
            if lease is None:
                self._revoke(leases)
                raise NodeIdInUse(
                    f"node id {self.node.node_id!r} is already live in this job: give each "
                    "node its own cluster.node_id, or wait for the old node's lease to expire",
                    NodeRecord.from_json(value, meta.create_revision),
                )
            # An earlier attempt registered and its answer was lost: that registration stands.
            registration = meta.create_revision
        self._revoke([other for other in leases if other is not lease])
        self._registration = registration
        self._lease = lease
        self.record.start(self._registration, lease)
        self._upkeep.start(self._registration, lease)
        self._emit(ev.NODE_REGISTERED, lease=lease.id, ttl_s=self._cfg.lease_ttl_s)

    def confirm(self) -> None:
        """Read this node's key now, and fence it if the key is gone or another registration's.

        For an agent that did not run for a while (frozen): the view it wakes to may list a
        round formed while it was stopped, and its watch may not yet have told it that a peer
        evicted it meanwhile. Sending the workers into that round would hold them in a group
        set-up that no peer comes to, for ``rendezvous.pg_timeout_s``. etcd away: nothing to
        learn here; the lease keeper decides."""
        if self.fenced.is_set() or not self._registration:
            return
        try:
            _, meta = self._etcd.get(self._node_key)
        except etcd_errors():
            return
        if meta is None or meta.create_revision != self._registration:
            self._fence_now("this node was evicted by a peer")

    def _register(self, leases: list[Any]) -> tuple[Any, bool, list[Any]]:
        """One attempt to create this node's key under a new lease, kept in ``leases``."""
        lease = self._etcd.lease(self._cfg.lease_ttl_s)
        leases.append(lease)
        t = self._etcd.transactions
        ok, responses = self._etcd.transaction(
            compare=[t.version(self._node_key) == 0],
            success=[t.put(self._node_key, self.node.to_json(), lease)],
            failure=[t.get(self._node_key)],
        )
        return lease, ok, responses

    def _revoke(self, leases: list[Any]) -> None:
        """Revoke ``leases`` (those of attempts that did not register); etcd away: they expire."""
        for lease in leases:
            with contextlib.suppress(*etcd_errors()):
                self._etcd.revoke_lease(lease.id)

    def retry(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, retried with backoff while etcd does not answer.

        It retries up to ``rendezvous.etcd_grace_s``, through
        :meth:`launcher.rendezvous.etcd_client.EtcdClient.retry`."""
        return self._etcd.retry(what, call)

    def leave(self) -> None:
        """Stop following the job and revoke the lease, which deletes this node's keys at once."""
        self._upkeep.stop()
        self.follower.cancel()
        if self._lease is not None:
            try:
                self._etcd.revoke_lease(self._lease.id)
            except Exception as exc:
                # Not revoked, it expires by itself within its TTL; if it is gone already, its
                # keys went with it.
                if not lease_gone(exc):
                    log.warning("could not revoke lease: %s", exc)
            self._lease = None

    def whole_round(self, rnd: Round) -> Round | None:
        """``rnd`` with every member, for a node that must look at its peers.

        A node looks at its peers after a failed collective, or in a check before it says ready. The
        round is read once per round (every member key, O(nodes) bytes), then kept. None if etcd did
        not answer, or a newer round replaced it meanwhile (its member keys are gone): the caller
        looks at the newer one."""
        if rnd.whole:
            return rnd
        kept = self._whole
        if kept is not None and (kept.number, kept.parts_id) == (rnd.number, rnd.parts_id):
            return kept
        try:
            self._whole = read_round(self._etcd, self.keys, rnd.head, 0)
        except (*etcd_errors(), RoundIncomplete) as exc:
            log.info("cannot read round %d's members (%s)", rnd.number, exc)
            return None
        return self._whole

    def evict(self, member: Member | NodeRecord, reason: str) -> bool:
        """Delete a dead peer's key, if it is still the registration ``member`` names.

        See :func:`launcher.rendezvous.eviction.evict`. False if it is not (gone already, or
        registered again), or etcd did not answer: the caller may try again."""
        return evict(self._etcd, self.keys, self.view.leader, member, reason, self._emit)

    def mark_done(self, round_number: int) -> None:
        """Tell the others the job is trained, in round ``round_number``.

        Retried while etcd is away, see :meth:`join`."""
        record = json.dumps({"node": self.node.node_id, "round": round_number})
        self.retry("mark the job done", lambda: self._etcd.put(self.keys.done, record, self._lease))

    def put_under_lease(self, key: str, value: str) -> None:
        """Put ``key`` (the ``progress`` key) under this node's lease, so it goes with the node.

        It is put once, not retried, and raises what etcd raises; while unregistered it does
        nothing. A refusal for lack of space is named
        (:meth:`~launcher.rendezvous.etcd_client.EtcdClient.no_space`)."""
        lease = self._lease
        if lease is None or self.fenced.is_set():
            return
        self._etcd.put_tracking_space(key, value, lease)

    # --- the view ----------------------------------------------------------------------------

    @property
    def view(self) -> JobView:
        return self.follower.view

    @property
    def synced(self) -> bool:
        """:meth:`JobFollower.synced` for this registration."""
        return self.follower.synced(self._registration)

    def wait(self, predicate: Callable[[JobView], bool], timeout: float) -> JobView | None:
        """Block until the view satisfies ``predicate`` or this node is fenced; None on timeout."""
        return self.follower.wait(predicate, timeout)

    @property
    def node(self) -> NodeRecord:
        """This node's record, as written or being written."""
        return self.record.node

    @property
    def leads(self) -> bool:
        """Whether this registration holds the ``leader`` key, as of the view.

        After :meth:`leave`: as it was."""
        return leads(self.view, self.node.node_id, self._registration)

    def propose(self, view: JobView, members: list[NodeRecord]) -> bool:
        """:meth:`Leadership.propose` as this registration."""
        return self.leadership.propose(view, members, self._registration)

    def _emit(
        self,
        event: EventType,
        message: str | None = None,
        /,
        *,
        level: int = logging.INFO,
        **fields: Any,
    ) -> None:
        if self._events is not None:
            self._events.emit(event, message, level=level, **fields)
        elif message is not None:
            log.log(level, "%s", message)
