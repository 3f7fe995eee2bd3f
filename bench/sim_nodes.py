"""Simulated nodes for ``bench/rendezvous_scale.py``: many in one process.

They run on one asyncio loop and one gRPC channel, each doing with etcd what a real node that
does not lead does (:class:`launcher.rendezvous.rendezvous.Rendezvous`).

Each node has its own lease (TTL ``lease_ttl_s``, a keep-alive every quarter of it), registers
its record under it by the same transaction, reads the job as of one revision (the round, the
leader, ``done``, its own key and its own quarantine key), watches the same five keys (its own
key for deletions only), says it is ready, re-reads the five keys every ``resync_s``, and reads
its own member key with each new round head. It counts what it costs etcd as a real node does
(:class:`launcher.rendezvous.etcd_client.EtcdLoad`), fences itself when its key is deleted or its
lease is gone, and counts a keep-alive unanswered for half a TTL as a real node reports one
(``etcd_unreachable``).

What the nodes of one process share is the transport: one channel, one ``LeaseKeepAlive`` stream
for all their leases and one ``Watch`` stream for all their watches, as etcd's API allows. What
each receives is still its own: etcd sends every watch its own events. Why: a real node's client
(a gRPC channel and its threads) costs a 2-core machine more than etcd does for that node, so
that from 512 such nodes on the bench measured its own CPU, not the rendezvous.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.membership import NodeRecord

TICK_S = 0.02  # how often a process sends the keep-alives that are due
EVICTED, EXPIRED = "evicted by a peer", "the lease expired (etcd says so)"


@dataclass
class SimNode:
    """One simulated node's state and what it cost etcd."""

    node_id: str
    record: NodeRecord
    lease: int = 0
    registration: int = 0
    round_seen: int = 0
    fenced: str = ""
    due: float = 0.0  # monotonic: when its next keep-alive is due
    unanswered_since: float = 0.0  # monotonic: the oldest keep-alive not answered yet; 0: none
    late: bool = False  # a keep-alive is unanswered for half a TTL (counted once an episode)
    requests: int = 0  # besides keep-alives, as EtcdLoad counts them
    keepalives: int = 0
    watch_events: int = 0
    watch_bytes: int = 0
    read_bytes: int = 0
    lates: int = 0
    ready_at: float = 0.0  # wall clock: when its record said ready


@dataclass
class _Stream:
    """A bidirectional stream's request queue, and the order in which its watches are created.

    Etcd answers a stream's create requests in order."""

    requests: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: deque = field(default_factory=deque)

    async def feed(self) -> AsyncIterator[Any]:
        while True:
            yield await self.requests.get()


class Fleet:
    """The simulated nodes of one process.

    ``report(node_id, round, size)``: a node saw a new round (its number and member count), as the
    bench's ``Seen`` counts them."""

    def __init__(
        self,
        endpoint: str,
        keys: JobKeys,
        ids: list[str],
        ttl_s: int,
        resync_s: float,
        report: Callable[[str, int, int], None],
    ) -> None:
        import grpc
        from etcd3 import etcdrpc
        from etcd3.etcdrpc import kv_pb2

        self._rpc, self._delete = etcdrpc, kv_pb2.Event.DELETE
        self._channel = grpc.aio.insecure_channel(endpoint)
        self._kv = etcdrpc.KVStub(self._channel)
        self._leases = etcdrpc.LeaseStub(self._channel)
        self._watch = etcdrpc.WatchStub(self._channel)
        self._keys, self._ttl_s, self._resync_s, self._report = keys, ttl_s, resync_s, report
        self.nodes = {
            i: SimNode(i, NodeRecord(i, "127.0.0.1", 1 + k, 1)) for k, i in enumerate(ids)
        }
        self._watches: dict[int, tuple[SimNode, str]] = {}  # watch id -> node, key
        self._stream = _Stream()
        self._keepalive = _Stream()
        self._tasks: list[asyncio.Task] = []

    # --- a node's calls, as Rendezvous makes them --------------------------------------------

    async def _range(self, node: SimNode, key: str, revision: int = 0) -> Any:
        node.requests += 1
        return await self._kv.Range(self._rpc.RangeRequest(key=key.encode(), revision=revision))

    async def _put_record(self, node: SimNode, record: NodeRecord, first: bool) -> Any:
        """Register (the key must be absent) or rewrite (it must still be this registration)."""
        rpc, key = self._rpc, self._keys.node(node.node_id).encode()
        target = rpc.Compare.VERSION if first else rpc.Compare.CREATE
        compare = rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=target)
        if first:
            compare.version = 0
        else:
            compare.create_revision = node.registration
        put = rpc.RequestOp(
            request_put=rpc.PutRequest(key=key, value=record.to_json().encode(), lease=node.lease)
        )
        node.requests += 1
        return await self._kv.Txn(rpc.TxnRequest(compare=[compare], success=[put]))

    async def _snapshot(self, node: SimNode) -> int:
        """The five reads of a node's snapshot, as of the first one's revision."""
        keys = self._singles(node)
        first = await self._range(node, keys[0])
        revision = first.header.revision
        for key in keys[1:]:
            await self._range(node, key, revision)
        return revision

    def _singles(self, node: SimNode) -> list[str]:
        k = self._keys
        return [k.round, k.leader, k.done, k.node(node.node_id), k.quarantined(node.node_id)]

    async def join(self, node: SimNode) -> None:
        """Lease, registration, snapshot, watches, ready: what ``join`` and ``set_ready`` do."""
        node.requests += 1
        granted = await self._leases.LeaseGrant(self._rpc.LeaseGrantRequest(TTL=self._ttl_s))
        node.lease, node.due = granted.ID, time.monotonic() + self._ttl_s / 4
        answer = await self._put_record(node, node.record, first=True)
        if not answer.succeeded:
            node.fenced = "its id is registered already"
            return
        node.registration = answer.header.revision
        revision = await self._snapshot(node)
        for key in self._singles(node):
            create = self._rpc.WatchCreateRequest(key=key.encode(), start_revision=revision + 1)
            if key == self._keys.node(node.node_id):
                create.filters.append(self._rpc.WatchCreateRequest.NOPUT)
            node.requests += 1
            self._stream.pending.append((node, key))
            await self._stream.requests.put(self._rpc.WatchRequest(create_request=create))
        ready = replace(node.record, ready=True)
        if (await self._put_record(node, ready, first=False)).succeeded:
            node.record, node.ready_at = ready, time.time()

    # --- the process's shared streams ---------------------------------------------------------

    async def _watch_loop(self) -> None:
        async for response in self._watch.Watch(self._stream.feed()):
            if response.created:
                node, key = self._stream.pending.popleft()
                self._watches[response.watch_id] = (node, key)
                continue
            found = self._watches.get(response.watch_id)
            if found is None or not response.events:
                continue
            node, key = found
            node.watch_events += len(response.events)
            node.watch_bytes += sum(len(e.kv.key) + len(e.kv.value) for e in response.events)
            for event in response.events:
                deleted = event.type == self._delete
                if key == self._keys.node(node.node_id) and deleted and not node.fenced:
                    node.fenced = EVICTED
                elif key == self._keys.round and not deleted:
                    asyncio.get_running_loop().create_task(self._on_round(node, event.kv))

    async def _on_round(self, node: SimNode, kv: Any) -> None:
        """A new round head: read this node's own member key as of its revision."""
        head = json.loads(kv.value)
        if head["number"] <= node.round_seen:
            return
        folder = self._keys.round_part_folder(head["parts"])
        own = await self._range(node, folder + node.node_id, kv.mod_revision)
        node.read_bytes += sum(len(m.key) + len(m.value) for m in own.kvs)
        if head["number"] > node.round_seen:
            node.round_seen = head["number"]
            self._report(node.node_id, head["number"], head["size"])

    async def _keepalive_loop(self) -> None:
        """Renew each node's lease every quarter TTL from its grant, as its own keeper would.

        The process sends what is due every ``TICK_S``."""

        async def send() -> None:
            period = self._ttl_s / 4
            while True:
                now = time.monotonic()
                for node in self.nodes.values():
                    if not node.lease or node.fenced or node.due > now:
                        continue
                    waited = now - (node.unanswered_since or now)
                    if waited > self._ttl_s / 2 and not node.late:
                        node.late, node.lates = True, node.lates + 1
                    node.unanswered_since = node.unanswered_since or now
                    node.due = max(node.due + period, now)
                    node.keepalives += 1
                    request = self._rpc.LeaseKeepAliveRequest(ID=node.lease)
                    await self._keepalive.requests.put(request)
                await asyncio.sleep(TICK_S)

        by_lease = {}
        sender = asyncio.get_running_loop().create_task(send())
        try:
            async for answer in self._leases.LeaseKeepAlive(self._keepalive.feed()):
                if not by_lease or answer.ID not in by_lease:
                    by_lease = {n.lease: n for n in self.nodes.values()}
                node = by_lease.get(answer.ID)
                if node is None:
                    continue
                if answer.TTL <= 0 and not node.fenced:
                    node.fenced = EXPIRED
                node.unanswered_since, node.late = 0.0, False
        finally:
            sender.cancel()

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self._resync_s)
            for node in [n for n in self.nodes.values() if n.registration and not n.fenced]:
                await self._snapshot(node)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(c())
            for c in (self._watch_loop, self._keepalive_loop, self._resync_loop)
        ]

    async def join_all(self) -> None:
        await asyncio.gather(*(self.join(n) for n in self.nodes.values()))

    def stats(self) -> tuple[int, int, int, list[str], int]:
        """Requests, watch events, bytes, fencings by reason and late keep-alives, over every node.

        The bytes are of the watch events and of the nodes' own member keys; the counts run over
        every node so far."""
        nodes = list(self.nodes.values())
        return (
            sum(n.requests for n in nodes),
            sum(n.watch_events for n in nodes),
            sum(n.watch_bytes + n.read_bytes for n in nodes),
            [n.fenced for n in nodes if n.fenced],
            sum(n.lates for n in nodes),
        )

    async def close(self) -> None:
        """Revoke every lease (their keys go at once), as ``leave`` does, and stop."""
        revoke = [
            self._leases.LeaseRevoke(self._rpc.LeaseRevokeRequest(ID=n.lease))
            for n in self.nodes.values()
            if n.lease and not n.fenced
        ]
        await asyncio.gather(*revoke, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await self._channel.close()
