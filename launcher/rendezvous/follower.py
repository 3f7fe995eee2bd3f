"""One node's view of the job, kept from a snapshot and watches.

The view is a :class:`~launcher.rendezvous.membership.JobView`. Every agent keeps its view up to
date from a few watches, applying events one by one (no re-reading of all nodes per change), so a
membership change costs O(nodes) work in total. The leader watches every node's key and the
quarantine; any other node watches the round, the leader, ``done`` and its own keys only, and learns
its own writes from their success (:meth:`saw_own`). A node that sees its own key deleted (evicted
by a peer, or its lease expired) is fenced.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from launcher.rendezvous.etcd import etcd_errors, prefix_end
from launcher.rendezvous.etcd_client import EtcdClient
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.membership import JobView, NodeRecord, Round, RoundIncomplete

log = logging.getLogger(__name__)


def _membership(nodes: Mapping[Any, NodeRecord | None]) -> dict[Any, tuple[int, int, bool]]:
    """What of each node's record makes the leader wait for membership to settle."""
    return {k: (n.joined_rev, n.incarnation, n.ready) for k, n in nodes.items() if n is not None}


def only_deletes() -> list[int]:
    """A watch filter that drops puts: a node watching its own key needs only its deletion.

    ``etcd_errors`` has set the protobuf mode the etcd client needs before this import."""
    etcd_errors()
    from etcd3 import etcdrpc

    return [etcdrpc.WatchCreateRequest.NOPUT]


def _done_in(value: bytes) -> int:
    """The round named by the ``done`` key's value (:meth:`Rendezvous.mark_done`)."""
    return int(json.loads(value)["round"])


def read_round(
    etcd: EtcdClient,
    keys: JobKeys,
    head: bytes,
    revision: int,
    node_id: str = "",
    whole: bool = True,
) -> Round:
    """The round whose head is ``head``, read as of ``revision`` (0: the newest).

    It has every member key (``whole``) or only ``node_id``'s. Raises :class:`RoundIncomplete` if
    the member keys are not the ones the head names (a newer round deleted them meanwhile)."""
    folder = keys.round_part_folder(json.loads(head)["parts"])
    read = (folder, prefix_end(folder)) if whole else (folder + node_id, None)
    found = etcd.read_members(read, revision)
    rows = {kv.key.decode()[len(folder) :]: kv.value for kvs in found for kv in kvs}
    return Round.from_values(head, rows, whole)


class JobFollower:
    """The view of the job one registration of a node follows, and the watches that keep it.

    The view lives under ``cond``, shared with the rendezvous, which fences the node under it
    too: ``fence(reason)`` is called with ``cond`` held and says whether the node was fenced
    now; ``changed()`` is called without it once the view changed or the node was fenced.
    """

    def __init__(
        self,
        etcd: EtcdClient,
        keys: JobKeys,
        node: NodeRecord,
        *,
        cond: threading.Condition,
        wake: threading.Event,
        stopping: threading.Event,
        fenced: threading.Event,
        fence: Callable[[str], bool],
        changed: Callable[[], None],
    ) -> None:
        self._etcd, self._keys = etcd, keys
        self._node_id = node.node_id
        # This node's own keys (its id never changes; every other key is self._keys').
        self._node_key = keys.node(node.node_id)
        self._own_quarantine_key = keys.quarantined(node.node_id)
        self._cond, self._wake, self._stopping, self._fenced = cond, wake, stopping, fenced
        self._fence, self._changed = fence, changed
        self._view = JobView()
        self.last_change = time.monotonic()  # of the membership: the leader's settle time
        self._written = (node, 0)  # this node's newest record written, and its revision
        self.watch_ids: list[int] = []  # empty: no watch (yet, or broken)
        # This node follows every node (it leads): its watches, once made, cover every node's
        # key, and it reads each round with every member.
        self.following_all = False
        self._applied: dict[str, int] = {}  # by key: the mod revision of the newest event applied
        self._floor = 0  # the revision of the snapshot the watches started after
        self.reread = False  # the watches missed something (a round's member keys): read again

    def reset(self, node: NodeRecord) -> None:
        """Forget what an earlier registration saw; a fresh snapshot follows."""
        with self._cond:
            self._written = (node, 0)
            self._view = JobView()

    @property
    def view(self) -> JobView:
        with self._cond:
            return self._view

    def synced(self, registration: int) -> bool:
        """Whether the view is of etcd as of this node's registration or later.

        Before that it is empty (a rejoin starts afresh). An empty view says nothing about the
        round: a node that rejoins with its workers still loaded must not say it is ready on it."""
        with self._cond:
            return registration > 0 and self._view.revision >= registration

    def wait(self, predicate: Callable[[JobView], bool], timeout: float) -> JobView | None:
        """Block until the view satisfies ``predicate`` or this node is fenced; None on timeout."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._fenced.is_set() or predicate(self._view), timeout=timeout
            )
            return self._view if ok else None

    def _publish(self, view: JobView, membership_changed: bool) -> None:
        """Install a newer view; called with ``self._cond`` held.

        The caller then calls :meth:`_changed` once it is released. ``membership_changed``: a node
        came, went, or changed its registration, incarnation or readiness (the leader's settle time
        starts again)."""
        if membership_changed:
            self.last_change = time.monotonic()
        # "done" is sticky: the key vanishes with its writer's lease once the job is over.
        done_in = view.done_in if view.done_in is not None else self._view.done_in
        self._view = replace(view, done_in=done_in)
        self._cond.notify_all()
        self._wake.set()

    def snapshot(self, everyone: bool) -> int:
        """Read what this node follows as of one revision, into the view; return that revision.

        It follows the round, the leader, ``done``, and its own record and quarantine key; when
        ``everyone`` (the leader), the whole membership and quarantine instead of its own. The view
        is installed if it is not older than the one held. Returns the snapshot's revision (watches
        start after it), or 0 if this node's own key is gone (it is fenced)."""
        keys = list(self._singles())
        if everyone:
            ranges = [self._keys.nodes, self._keys.quarantine]
            reads = [(k, None) for k in keys] + [(r, prefix_end(r)) for r in ranges]
        else:
            reads = [(k, None) for k in [*keys, self._node_key, self._own_quarantine_key]]
        revision, found = self._etcd.read(reads)
        nodes: dict[str, NodeRecord] = {}
        rnd, round_rev, leader, done_in, quarantined = None, 0, "", None, set()
        for kv in (kv for kvs in found for kv in kvs):
            key = kv.key.decode()
            if key.startswith(self._keys.nodes):
                rec = NodeRecord.from_json(kv.value, kv.create_revision)
                nodes[rec.node_id] = rec
            elif key == self._keys.round:
                rnd, round_rev = self._read_round(kv.value, revision, everyone), kv.mod_revision
            elif key == self._keys.leader:
                leader = kv.value.decode()
            elif key == self._keys.done:
                done_in = _done_in(kv.value)
            elif key.startswith(self._keys.quarantine):
                quarantined.add(key[len(self._keys.quarantine) :])
        if self._node_id not in nodes:  # evicted, or the lease expired: no revision to read
            with self._cond:
                fenced = self._fence("this node's key is gone (evicted, or its lease expired)")
            if fenced:
                self._changed()
            return 0
        written, written_rev = self._written
        if written_rev > revision:  # this node wrote its record after the snapshot was read
            nodes[self._node_id] = written
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

    def _read_round(self, raw: bytes, revision: int, whole: bool) -> Round:
        """The round from its head, read as of ``revision``, with this node's own member key.

        With all of them when ``whole`` (the leader). ``revision`` is where the head was seen: its
        member keys were written before it and are deleted only by a later round."""
        return read_round(self._etcd, self._keys, raw, revision, self._node_id, whole)

    def _on_watch(self, response: Any) -> None:
        """Runs on the etcd client's watch thread: apply each event to the view.

        The watches of one node are several (the round, the leader, ``done``, its own keys, or
        every node's as leader), so events of different keys may arrive out of revision order:
        an event is applied if it is newer than the snapshot and than the last one applied to
        its key."""
        if isinstance(response, Exception):
            log.info("etcd watch broke (%s); re-reading the job", type(response).__name__)
            self.watch_ids = []
            self._wake.set()
            return
        changed = False
        # A round's member keys are read before the view is locked: a read may wait on etcd.
        rounds: dict[int, Round | Exception] = {}
        for ev in response.events:
            if ev.key.decode() == self._keys.round and type(ev).__name__ != "DeleteEvent":
                try:
                    rounds[ev.mod_revision] = self._read_round(
                        ev.value, ev.mod_revision, self.following_all
                    )
                except (*etcd_errors(), RoundIncomplete) as exc:
                    rounds[ev.mod_revision] = exc
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
                if key.startswith(self._keys.nodes):
                    node_id = key[len(self._keys.nodes) :]
                    if deleted and node_id == self._node_id and not self._stopping.is_set():
                        changed |= self._fence("this node was evicted by a peer")
                    before = nodes.pop(node_id, None)
                    if not deleted:
                        nodes[node_id] = NodeRecord.from_json(ev.value, ev.create_revision)
                    after = nodes.get(node_id)
                    joined |= _membership({0: before}) != _membership({0: after})
                elif key == self._keys.round and not deleted:
                    read = rounds[ev.mod_revision]
                    if isinstance(read, Exception):
                        log.info("cannot read round's member keys (%s); re-reading the job", read)
                        self.reread = True  # what follows this event comes with the re-read
                        self._wake.set()
                        break
                    rnd, round_rev = read, ev.mod_revision
                elif key == self._keys.leader:
                    leader = "" if deleted else ev.value.decode()
                elif key == self._keys.done and not deleted:
                    done_in = _done_in(ev.value)
                elif key.startswith(self._keys.quarantine):
                    node_id = key[len(self._keys.quarantine) :]
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

    def saw_own(self, record: NodeRecord, revision: int) -> None:
        """Put this node's own record, written at ``revision``, into the view.

        A node that does not lead watches only its key's deletion, so it learns its writes from
        their success. A snapshot read before the write completed is corrected with it
        (:meth:`snapshot`)."""
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

    def subscribe(self, everyone: bool) -> None:
        """Watch what this node follows, from a fresh snapshot on.

        It follows the round, the leader and ``done``. As leader (``everyone``) it also follows
        every node's key and the quarantine; else its own key's deletion (an eviction) and its own
        quarantine key."""
        self.cancel()
        self.following_all = everyone
        revision = self.snapshot(everyone)
        if not revision:
            return
        add, start = self._etcd.add_watch_callback, revision + 1
        ids = [add(k, self._on_watch, start_revision=start) for k in self._singles()]
        if everyone:
            ids += [
                add(p, self._on_watch, range_end=prefix_end(p), start_revision=start)
                for p in (self._keys.nodes, self._keys.quarantine)
            ]
        else:
            ids += [
                add(self._node_key, self._on_watch, start_revision=start, filters=only_deletes()),
                add(self._own_quarantine_key, self._on_watch, start_revision=start),
            ]
        self.watch_ids = ids

    def _singles(self) -> tuple[str, ...]:
        return (self._keys.round, self._keys.leader, self._keys.done)

    def cancel(self) -> None:
        ids, self.watch_ids = self.watch_ids, []
        for watch_id in ids:
            try:
                self._etcd.cancel_watch(watch_id)
            except Exception as exc:  # etcd away, or the stream already broke
                log.debug("cancel_watch: %s", exc)
