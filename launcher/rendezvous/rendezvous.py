"""etcd v3 rendezvous: which nodes are in the job and which round they train in.

Keys under ``<prefix>/<job>/`` (:mod:`launcher.rendezvous.keys` builds them):

- ``nodes/<node_id>``: a live node, JSON :class:`NodeRecord`, under the node's lease. A dead
  machine's key vanishes when the lease expires; a node that leaves revokes its lease. A node
  whose workers crashed bumps ``incarnation`` in place, which tells the others it needs a new round.
  A registration is identified by the key's create revision: a node that registers again (after a
  restart or after being fenced) is a new member, never mistaken for the one a stale round lists.
  ``ready`` says the node's workers are up and waiting for a round; only ready nodes are placed in
  rounds, so a node that joins (or restarts a crashed worker) costs the others nothing until it
  can train.
- ``round``: the current :class:`Round`, replaced only by a transaction conditioned on the
  revision the proposer read (fencing): two proposers can never both win, and a process that tags
  its work with an older round number can tell that it is stale.
- ``done``: put under a lease by the first node whose workers finished the job; it names the
  round that trained it.
- ``quarantine/<node_id>``: a node kept out of the job for a cooldown (the key's lease), written
  by :mod:`launcher.health.quarantine`. Such a node is never placed in a round.

Every agent keeps a local :class:`JobView` up to date from one prefix watch, applying events one by
one (no re-reading of all nodes per change), so a membership change costs O(nodes) work in total.
Only the leader, the live node that joined first, proposes rounds. A round that only removes
members is proposed at once (the survivors are waiting); one that adds members closes when at
least ``min_nodes`` are ready and either ``max_nodes`` are or membership has been still for
``settle_s``. A peer that sees a node die (its agent refuses connections) deletes that node's key
with :meth:`Rendezvous.evict` instead of waiting for the lease; an evicted node that was in fact
alive sees its own key vanish and fences itself.

An unreachable etcd (restarted, electing a leader, cut off by the network) is not a lost lease:
the lease lives on the server, which restores it with a fresh TTL when it comes back, and no
other node can form a round without etcd. So the node keeps training, retries with backoff, and
only the server's word fences it: a lease the server says expired, or this node's key deleted
(evicted). A node cut off from etcd alone cannot train on without the others either: once they
form a round without it, its collectives in the old one fail. Past ``rendezvous.etcd_grace_s``
without etcd the node gives up (:attr:`Rendezvous.etcd_lost`), and the agent stops the node
cleanly (:mod:`launcher.rendezvous.lease`). Writes of this node's own record
(ready, a failure) that find etcd away are kept and retried by the sync thread; each write is
conditioned on this node's registration, so a node evicted meanwhile never re-creates its key.

Whoever follows the job (the agent) passes ``on_change``, called whenever the view changes or the
node fences itself; it then reads :attr:`Rendezvous.view`, :attr:`Rendezvous.fenced` and
:attr:`Rendezvous.etcd_lost`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from elastic.config import RendezvousConfig
from elastic.events import EventLog
from launcher.rendezvous.etcd import (
    EtcdLoad,
    allow_watch_filters,
    denied,
    etcd_errors,
    lease_gone,
    prefix_end,
    read_at_one_revision,
)
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.leader import Leadership, leads
from launcher.rendezvous.lease import LeaseKeeper
from launcher.rendezvous.membership import (
    JobView,
    Member,
    NodeRecord,
    Round,
    RoundIncomplete,
    leader_value,
)

log = logging.getLogger(__name__)


class NodeIdInUse(RuntimeError):
    """The node id is registered already: by another live node, or by an earlier incarnation of
    this one whose lease still runs (a crash, then a restart at once)."""

    def __init__(self, message: str, holder: NodeRecord) -> None:
        super().__init__(message)
        self.holder = holder  # the registration that holds the id (joined_rev: its revision)


class EtcdLost(ConnectionError):
    """etcd did not answer for longer than ``rendezvous.etcd_grace_s``."""


class EtcdDenied(EtcdLost):
    """etcd answered and refused: the user may not use the job's keys. Raised at once, since
    waiting out the grace period cannot change a role."""


RETRY_MIN_S, RETRY_MAX_S = 0.25, 4.0  # backoff of the calls retried while etcd is away


def backoff(attempt: int) -> float:
    """Seconds before retry number ``attempt`` (0-based) of a call that found etcd away."""
    return min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(attempt, 16))


def _membership(nodes: Mapping[Any, NodeRecord | None]) -> dict[Any, tuple[int, int, bool]]:
    """What of each node's record makes the leader wait for membership to settle."""
    return {k: (n.joined_rev, n.incarnation, n.ready) for k, n in nodes.items() if n is not None}


def only_deletes() -> list[int]:
    """A watch filter that drops puts: a node watching its own key needs only its deletion.
    (``etcd_errors`` has set the protobuf mode the etcd client needs before this import.)"""
    etcd_errors()
    from etcd3 import etcdrpc

    return [etcdrpc.WatchCreateRequest.NOPUT]


def _done_in(value: bytes) -> int:
    """The round named by the ``done`` key's value (:meth:`Rendezvous.mark_done`)."""
    return int(json.loads(value)["round"])


class Rendezvous:
    """One node's membership in a job: registration, the watched view, and round proposals."""

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
        """``on_change`` is called on the rendezvous's threads, after each change of the view and
        when this node is fenced; it must return at once (the agent posts to its inbox)."""
        self._client = client
        allow_watch_filters(client)
        self._cfg = cfg
        self._events = events
        self._on_change = on_change or (lambda: None)
        self.node = node
        self.keys = JobKeys(cfg.prefix, job_id)
        # This node's own keys (its id never changes; every other key is self.keys').
        self._node_key = self.keys.node(node.node_id)
        self._own_quarantine_key = self.keys.quarantined(node.node_id)

        self._cond = threading.Condition()
        self._view = JobView()
        self._last_change = time.monotonic()
        self._lease: Any = None
        self._registration = 0  # create revision of this node's key
        self._record_dirty = False  # self.node has changes etcd has not taken yet
        self._written = (node, 0)  # this node's newest record written, and its revision
        self._record_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._watch_ids: list[int] = []  # empty: no watch (yet, or broken)
        self._following_all = False  # the watches cover every node (this node leads)
        self._applied: dict[str, int] = {}  # by key: the mod revision of the newest event applied
        self._floor = 0  # the revision of the snapshot the watches started after
        self._reread = False  # the watches missed something (a split round's parts): read again
        self.fenced = threading.Event()
        self.etcd_lost = threading.Event()
        self.load = EtcdLoad()
        self.leadership = Leadership(
            client, self.keys, cfg, min_nodes, max_nodes, self._emit, self.load
        )

    # --- membership --------------------------------------------------------------------------

    def join(self) -> None:
        """Register this node under a fresh lease and start following the job.

        While etcd does not answer this retries with backoff, up to ``rendezvous.etcd_grace_s``;
        then it raises :class:`EtcdLost`.
        """
        self._stop.clear()
        self.fenced.clear()
        self.node = replace(self.node, incarnation=0, ready=False, leaving_after=0)
        self._record_dirty = False
        with self._cond:  # forget what an earlier registration saw; a fresh snapshot follows
            self._written = (self.node, 0)
            self._view = JobView()
        lease, ok, responses = self.retry("register", self._register)
        if not ok:
            self._client.revoke_lease(lease.id)
            [(value, meta)] = responses[0]
            raise NodeIdInUse(
                f"node id {self.node.node_id!r} is already live in this job: give each node its "
                "own cluster.node_id, or wait for the old node's lease to expire",
                NodeRecord.from_json(value, meta.create_revision),
            )
        self._registration = responses[0].response_put.header.revision
        self._lease = lease
        keeper = LeaseKeeper(
            self._client,
            lease.id,
            self._cfg,
            self.node.node_id,
            self._emit,
            on_back=self._wake.set,  # the sync thread re-reads the job and re-opens the watch
            on_expired=self._lease_expired,
            on_lost=self._etcd_gone,
            count_request=self.load.count_request,
        )
        self._threads = [
            threading.Thread(
                target=keeper.run, args=(self._stop,), name="rdzv-keepalive", daemon=True
            ),
            threading.Thread(target=self._sync_loop, name="rdzv-sync", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._emit("node_registered", lease=lease.id, ttl_s=self._cfg.lease_ttl_s)

    def _register(self) -> tuple[Any, bool, list[Any]]:
        self.load.requests += 2
        lease = self._client.lease(self._cfg.lease_ttl_s)
        t = self._client.transactions
        ok, responses = self._client.transaction(
            compare=[t.version(self._node_key) == 0],
            success=[t.put(self._node_key, self.node.to_json(), lease)],
            failure=[t.get(self._node_key)],
        )
        return lease, ok, responses

    def retry(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, retried with backoff while etcd does not answer, for at most
        ``rendezvous.etcd_grace_s``; then :class:`EtcdLost`."""
        started, attempt = time.monotonic(), 0
        while True:
            try:
                return call()
            except etcd_errors() as exc:
                if denied(exc):
                    prefix = self.keys.rendezvous
                    raise EtcdDenied(
                        f"etcd denied {self.node.node_id} the job's keys ({prefix}) while "
                        f"trying to {what}. Fix: grant cluster.etcd_user's role readwrite on "
                        f"them (etcdctl role grant-permission ROLE readwrite --prefix=true "
                        f"{prefix}), or run the job under a prefix the role covers "
                        "(rendezvous.prefix, job_id)"
                    ) from exc
                waited = time.monotonic() - started
                if waited > self._cfg.etcd_grace_s:
                    raise EtcdLost(
                        f"etcd did not answer for {waited:.0f} s "
                        f"(rendezvous.etcd_grace_s={self._cfg.etcd_grace_s:g}) while trying to "
                        f"{what}: {exc.__class__.__name__}"
                    ) from exc
                log.info("etcd unavailable (%s); retrying to %s", exc.__class__.__name__, what)
                time.sleep(backoff(attempt))
                attempt += 1

    def leave(self) -> None:
        """Stop following the job and revoke the lease, which deletes this node's keys at once."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        self._cancel_watches()
        if self._lease is not None:
            try:
                self._client.revoke_lease(self._lease.id)
            except Exception as exc:
                # Not revoked, it expires by itself within its TTL; if it is gone already, its
                # keys went with it.
                if not lease_gone(exc):
                    log.warning("could not revoke lease: %s", exc)
            self._lease = None

    def report_failure(self, reason: str) -> None:
        """Leave the current round at once: this node's workers failed. The node is placed in a
        later round when it reports itself ready again. If etcd is away, the sync thread writes
        the record once it answers."""
        self.node = replace(self.node, incarnation=self.node.incarnation + 1, ready=False)
        self._write_record()
        self._emit("failure_reported", incarnation=self.node.incarnation, reason=reason)

    def leave_after(self, step: int) -> None:
        """A planned leave: this node's workers train up to ``step``, and the others form the
        next round without it, switching to it after that step (:func:`switch_step`)."""
        self.node = replace(self.node, leaving_after=step)
        self._write_record()
        self._emit("node_leaving", after_step=step)

    def set_ready(self) -> None:
        """This node's workers wait for a round: it may be placed in the next one (written now,
        or by the sync thread once etcd answers)."""
        self.node = replace(self.node, ready=True)
        self._write_record()
        self._emit("node_ready", incarnation=self.node.incarnation)

    def _write_record(self) -> None:
        """Write :attr:`node` now, or, if etcd is away, leave it to the sync thread."""
        self._record_dirty = True
        try:
            self._put_record()
        except etcd_errors() as exc:
            log.info("etcd unavailable (%s); this node's record is written later", exc)
            self._wake.set()

    def _put_record(self) -> None:
        """Put :attr:`node` under the lease, if the key is still this registration's; raises what
        etcd raises. A key that is gone means the node was evicted or its lease expired: it is
        fenced (the watch may not have said so yet). One write at a time, so an older record
        never lands after a newer one."""
        t = self._client.transactions
        with self._record_lock:
            record = self.node
            self.load.requests += 1
            ok, responses = self._client.transaction(
                compare=[t.create(self._node_key) == self._registration],
                success=[t.put(self._node_key, record.to_json(), self._lease)],
                failure=[],
            )
            if self.node is record:  # else a newer record is on its way
                self._record_dirty = False
            if ok:
                written = replace(record, joined_rev=self._registration)
                self._saw_own(written, responses[0].response_put.header.revision)
        if not ok:
            with self._cond:
                fenced = self._fence("this node's key is gone (evicted, or its lease expired)")
            if fenced:
                self._changed()

    def _saw_own(self, record: NodeRecord, revision: int) -> None:
        """Put this node's own record, written at ``revision``, into the view: a node that does
        not lead watches only its key's deletion, so it learns its writes from their success.
        A snapshot read before the write completed is corrected with it (:meth:`_snapshot`)."""
        with self._cond:
            self._written = (record, revision)
            view = self._view
            if record.node_id not in view.nodes or revision <= self._applied.get(
                self._node_key, self._floor
            ):
                return  # gone (fenced), not read yet, or the watch has it already
            self._applied[self._node_key] = revision
            self._publish(replace(view, nodes={**view.nodes, record.node_id: record}), True)
        self._changed()

    def evict(self, member: Member | NodeRecord, reason: str) -> bool:
        """Delete a dead peer's key, if it is still the registration ``member`` names. False if
        it is not (gone already, or registered again), or etcd did not answer: the caller may
        try again."""
        t = self._client.transactions
        key = self.keys.node(member.node_id)
        held = leader_value(member.node_id, member.joined_rev)
        try:
            ok = False
            self.load.requests += 1
            if self.view.leader == held:  # it leads: the others need a new leader at once
                ok, _ = self._client.transaction(
                    compare=[t.create(key) == member.joined_rev, t.value(self.keys.leader) == held],
                    success=[t.delete(key), t.delete(self.keys.leader)],
                    failure=[],
                )
            if not ok:
                self.load.requests += 1
                ok, _ = self._client.transaction(
                    compare=[t.create(key) == member.joined_rev],
                    success=[t.delete(key)],
                    failure=[],
                )
        except etcd_errors() as exc:
            log.info("etcd unavailable (%s); evicting %s later", exc, member.node_id)
            return False
        if ok:
            self._emit("peer_evicted", peer=member.node_id, reason=reason)
        return bool(ok)

    def mark_done(self, round_number: int) -> None:
        """Tell the others the job is trained, in round ``round_number`` (retried while etcd is
        away, see :meth:`join`)."""
        record = json.dumps({"node": self.node.node_id, "round": round_number})
        self.load.requests += 1
        self.retry(
            "mark the job done", lambda: self._client.put(self.keys.done, record, self._lease)
        )

    def put_under_lease(self, key: str, value: str) -> None:
        """Put ``key`` (the ``progress`` key) under this node's lease, so it goes with the node;
        once, not retried: raises what etcd raises, and nothing while unregistered."""
        lease = self._lease
        if lease is None or self.fenced.is_set():
            return
        self.load.requests += 1
        self._client.put(key, value, lease)

    # --- the view ----------------------------------------------------------------------------

    @property
    def view(self) -> JobView:
        with self._cond:
            return self._view

    @property
    def synced(self) -> bool:
        """Whether the view is of etcd as of this node's registration or later. Before that it
        is empty (a rejoin starts afresh), and an empty view says nothing about the round: a
        node that rejoins with its workers still loaded must not say it is ready on it."""
        with self._cond:
            return self._registration > 0 and self._view.revision >= self._registration

    def wait(self, predicate: Callable[[JobView], bool], timeout: float) -> JobView | None:
        """Block until the view satisfies ``predicate`` or this node is fenced; None on timeout."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.fenced.is_set() or predicate(self._view), timeout=timeout
            )
            return self._view if ok else None

    def _publish(self, view: JobView, membership_changed: bool) -> None:
        """Install a newer view; called with ``self._cond`` held, and then :meth:`_changed`
        once it is released. ``membership_changed``: a node came, went, or changed its
        registration, incarnation or readiness (the leader's settle time starts again)."""
        if membership_changed:
            self._last_change = time.monotonic()
        # "done" is sticky: the key vanishes with its writer's lease once the job is over.
        done_in = view.done_in if view.done_in is not None else self._view.done_in
        self._view = replace(view, done_in=done_in)
        self._cond.notify_all()
        self._wake.set()

    def _changed(self) -> None:
        """Tell whoever follows the job that the view changed or this node was fenced; called
        without ``self._cond`` held, so the callback can read the view."""
        try:
            self._on_change()
        except Exception:  # the watch and keep-alive threads must survive a faulty callback
            log.exception("rendezvous on_change callback failed")

    def _snapshot(self, everyone: bool) -> int:
        """Read, as of one revision, what this node follows: the round, the leader, ``done``,
        and its own record and quarantine key; the whole membership and quarantine instead of
        its own when ``everyone`` (the leader). Installs the view if it is not older than the one
        held; returns the snapshot's revision (watches start after it), or 0 if this node's own
        key is gone (it is fenced)."""
        keys = list(self._singles())
        if everyone:
            ranges = [self.keys.nodes, self.keys.quarantine]
            reads = [(k, None) for k in keys] + [(r, prefix_end(r)) for r in ranges]
        else:
            reads = [(k, None) for k in [*keys, self._node_key, self._own_quarantine_key]]
        self.load.requests += len(reads)
        revision, found = read_at_one_revision(self._client, reads)
        nodes: dict[str, NodeRecord] = {}
        rnd, round_rev, leader, done_in, quarantined = None, 0, "", None, set()
        for kv in (kv for kvs in found for kv in kvs):
            key = kv.key.decode()
            if key.startswith(self.keys.nodes):
                rec = NodeRecord.from_json(kv.value, kv.create_revision)
                nodes[rec.node_id] = rec
            elif key == self.keys.round:
                rnd, round_rev = self._read_round(kv.value, revision), kv.mod_revision
            elif key == self.keys.leader:
                leader = kv.value.decode()
            elif key == self.keys.done:
                done_in = _done_in(kv.value)
            elif key.startswith(self.keys.quarantine):
                quarantined.add(key[len(self.keys.quarantine) :])
        if self.node.node_id not in nodes:  # evicted, or the lease expired: no revision to read
            with self._cond:
                fenced = self._fence("this node's key is gone (evicted, or its lease expired)")
            if fenced:
                self._changed()
            return 0
        written, written_rev = self._written
        if written_rev > revision:  # this node wrote its record after the snapshot was read
            nodes[self.node.node_id] = written
        view = JobView(
            nodes, rnd, round_rev, done_in, revision, frozenset(quarantined), leader, everyone
        )
        with self._cond:
            newer = revision >= self._view.revision
            if newer:
                self._applied, self._floor = {}, revision
                self._publish(view, _membership(view.nodes) != _membership(self._view.nodes))
        if newer:
            self._changed()
        return revision

    def _read_round(self, raw: bytes, revision: int) -> Round:
        """The round from the ``round`` key's value, with its parts if it was split, read as of
        ``revision`` (where the value was seen: its parts were written before it and are
        deleted only by a later round)."""

        def read_parts(parts_id: str, count: int) -> list[bytes]:
            folder = self.keys.round_part_folder(parts_id)
            self.load.requests += count
            reads = [(f"{folder}{i:06d}", None) for i in range(count)]
            _, found = read_at_one_revision(self._client, reads, revision)
            return [kv.value for kvs in found for kv in kvs]

        return Round.from_json(raw, read_parts)

    def _on_watch(self, response: Any) -> None:
        """Runs on the etcd client's watch thread: apply each event to the view.

        The watches of one node are several (the round, the leader, ``done``, its own keys, or
        every node's as leader), so events of different keys may arrive out of revision order:
        an event is applied if it is newer than the snapshot and than the last one applied to
        its key."""
        if isinstance(response, Exception):
            log.info("etcd watch broke (%s); re-reading the job", type(response).__name__)
            self._watch_ids = []
            self._wake.set()
            return
        changed = False
        self.load.watch_events += len(response.events)
        self.load.watch_bytes += sum(len(ev.key) + len(ev.value) for ev in response.events)
        with self._cond:
            view = self._view
            nodes, rnd, round_rev = dict(view.nodes), view.round, view.round_rev
            done_in = view.done_in
            quarantined, leader = set(view.quarantined), view.leader
            rev, joined, applied = view.revision, False, False
            for ev in response.events:
                key, deleted = ev.key.decode(), type(ev).__name__ == "DeleteEvent"
                if ev.mod_revision <= self._applied.get(key, self._floor):
                    continue  # in the snapshot already, or delivered twice (two watches)
                self._applied[key] = ev.mod_revision
                rev, applied = max(rev, ev.mod_revision), True
                if key.startswith(self.keys.nodes):
                    node_id = key[len(self.keys.nodes) :]
                    if deleted and node_id == self.node.node_id and not self._stop.is_set():
                        changed |= self._fence("this node was evicted by a peer")
                    before = nodes.pop(node_id, None)
                    if not deleted:
                        nodes[node_id] = NodeRecord.from_json(ev.value, ev.create_revision)
                    after = nodes.get(node_id)
                    joined |= _membership({0: before}) != _membership({0: after})
                elif key == self.keys.round and not deleted:
                    try:
                        rnd = self._read_round(ev.value, ev.mod_revision)
                    except (*etcd_errors(), RoundIncomplete) as exc:
                        log.info("cannot read the round's parts (%s); re-reading the job", exc)
                        self._reread = True  # what follows this event comes with the re-read
                        self._wake.set()
                        break
                    round_rev = ev.mod_revision
                elif key == self.keys.leader:
                    leader = "" if deleted else ev.value.decode()
                elif key == self.keys.done and not deleted:
                    done_in = _done_in(ev.value)
                elif key.startswith(self.keys.quarantine):
                    node_id = key[len(self.keys.quarantine) :]
                    (quarantined.discard if deleted else quarantined.add)(node_id)
            if applied:
                self._publish(
                    replace(
                        view,
                        nodes=nodes,
                        round=rnd,
                        round_rev=round_rev,
                        done_in=done_in,
                        revision=rev,
                        quarantined=frozenset(quarantined),
                        leader=leader,
                    ),
                    joined,
                )
                changed = True
        if changed:
            self._changed()

    # --- background threads ------------------------------------------------------------------

    def _lease_expired(self) -> None:
        """The keeper's word: the server says this node's lease is gone."""
        with self._cond:
            fenced = self._fence("the lease expired (etcd says so)")
        if fenced:
            self._changed()

    def _etcd_gone(self) -> None:
        """The keeper's word: etcd stayed away past ``rendezvous.etcd_grace_s``."""
        with self._cond:
            self.etcd_lost.set()
            self._cond.notify_all()
        self._changed()

    def _fence(self, reason: str) -> bool:
        """Consider this node out of the job; called with ``self._cond`` held, and then
        :meth:`_changed` if this returns True (it was not fenced yet)."""
        if self.fenced.is_set():
            return False
        self._emit(
            "fenced",
            f"{self.node.node_id} is fenced out of the job: {reason}",
            level=logging.WARNING,
            reason=reason,
        )
        self.fenced.set()
        self._cond.notify_all()
        return True

    def _sync_loop(self) -> None:
        """Keep the watches alive, re-read the job now and then, claim the lead when nobody
        holds it, and propose rounds as leader."""
        next_resync = 0.0
        failures = 0
        while not self._stop.is_set():
            deadline: float | None = None
            try:
                now = time.monotonic()
                leads = self._leads()
                if not self._watch_ids or leads != self._following_all:
                    self._subscribe(leads)
                    next_resync = now + self._cfg.resync_s
                elif now >= next_resync or self._reread:
                    self._reread = False
                    self._snapshot(self._following_all)
                    next_resync = now + self._cfg.resync_s
                if self._record_dirty:
                    self._put_record()
                if not self.view.leader and self._watch_ids and self._claimable():
                    self.leadership.claim(self.node.node_id, self._registration, self._lease)
                if not self.fenced.is_set():
                    deadline = self.leadership.maybe_propose(
                        self.view, self.node.node_id, self._registration, self._last_change
                    )
                failures = 0
            except etcd_errors() as exc:  # the keep-alive says when etcd is away; no log spam
                log.debug("rendezvous sync failed (%s); retrying", exc)
                self._cancel_watches()
                deadline = next_resync = time.monotonic() + backoff(failures)
                failures += 1
            wait = min(deadline or next_resync, next_resync) - time.monotonic()
            self._wake.wait(timeout=max(0.01, wait))
            self._wake.clear()

    def _claimable(self) -> bool:
        """Whether this registration may claim the lead: live, not fenced."""
        return not self.fenced.is_set() and self._lease is not None

    def _leads(self) -> bool:
        return leads(self.view, self.node.node_id, self._registration)

    def _subscribe(self, everyone: bool) -> None:
        """Watch what this node follows, from a fresh snapshot on: the round, the leader and
        ``done``, then every node's key and the quarantine as leader (``everyone``), else its own
        key's deletion (an eviction) and its own quarantine key."""
        self._cancel_watches()
        revision = self._snapshot(everyone)
        if not revision:
            return
        add, start = self._client.add_watch_callback, revision + 1
        ids = [add(k, self._on_watch, start_revision=start) for k in self._singles()]
        if everyone:
            ids += [
                add(p, self._on_watch, range_end=prefix_end(p), start_revision=start)
                for p in (self.keys.nodes, self.keys.quarantine)
            ]
        else:
            ids += [
                add(self._node_key, self._on_watch, start_revision=start, filters=only_deletes()),
                add(self._own_quarantine_key, self._on_watch, start_revision=start),
            ]
        self._watch_ids, self._following_all = ids, everyone
        self.load.requests += len(ids)

    def _singles(self) -> tuple[str, ...]:
        return (self.keys.round, self.keys.leader, self.keys.done)

    def _cancel_watches(self) -> None:
        ids, self._watch_ids = self._watch_ids, []
        for watch_id in ids:
            try:
                self._client.cancel_watch(watch_id)
            except Exception as exc:  # etcd away, or the stream already broke
                log.debug("cancel_watch: %s", exc)

    def propose(self, view: JobView, members: list[NodeRecord]) -> bool:
        """:meth:`Leadership.propose` as this registration."""
        return self.leadership.propose(view, members, self._registration)

    def _emit(
        self, event: str, message: str | None = None, /, *, level: int = logging.INFO, **fields: Any
    ) -> None:
        if self._events is not None:
            self._events.emit(event, message, level=level, **fields)
        elif message is not None:
            log.log(level, "%s", message)
