"""The leader's part of a node's rendezvous: holding the ``leader`` key and proposing rounds.

Only the leader, the live registration that claimed the ``leader`` key first, proposes rounds.
A round that only removes members is proposed at once (the survivors are waiting); one that adds
members closes when at least ``min_nodes`` are ready and either ``max_nodes`` are or membership
has been still for ``settle_s``. Who is in it is :func:`launcher.rendezvous.round_plan.plan_round`;
this module adds the timing and the fenced write, and says when the job starts to wait for nodes
(``below_min_nodes``, which :mod:`launcher.alerts` turns into an alert).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from elastic import event_types as ev
from elastic.config import RendezvousConfig
from launcher.rendezvous.etcd import prefix_end
from launcher.rendezvous.etcd_client import EtcdClient
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.lease import Emit
from launcher.rendezvous.membership import (
    MEMBERS_PER_TXN,
    JobView,
    NodeRecord,
    Round,
    leader_value,
)
from launcher.rendezvous.round_plan import (
    draining,
    only_drops,
    plan_round,
    short_of_nodes,
    shrink_only,
    switch_step,
)


def leads(view: JobView, node_id: str, registration: int) -> bool:
    """Whether the registration ``registration`` of ``node_id`` holds the ``leader`` key."""
    return view.leader == leader_value(node_id, registration)


class Leadership:
    """Claims the lead and, as leader, replaces the round.

    Each call names the registration it acts for (its node id, create revision and lease), which
    changes when the node rejoins."""

    def __init__(
        self,
        etcd: EtcdClient,
        keys: JobKeys,
        cfg: RendezvousConfig,
        min_nodes: int,
        max_nodes: int,
        emit: Emit,
    ) -> None:
        self._etcd, self._keys, self._cfg = etcd, keys, cfg
        self._min, self._max = min_nodes, max_nodes
        self._emit = emit
        self._initial_settle = max(cfg.first_round_wait_s, cfg.settle_s)
        self._drain_seen: dict[str, float] = {}  # drained members: when the leader first saw them
        self._short = False  # the job waits for nodes, and this leader said so
        self._proposals = 0  # made by this process: each writes its members' keys apart

    def claim(self, node_id: str, registration: int, lease: Any) -> None:
        """Take the ``leader`` key if nobody holds it and the registration is still live.

        It is put under the node's lease, so it goes with the node. Of many claims, one wins."""
        t = self._etcd.transactions
        ok, _ = self._etcd.transaction(
            compare=[
                t.version(self._keys.leader) == 0,
                t.create(self._keys.node(node_id)) == registration,
            ],
            success=[t.put(self._keys.leader, leader_value(node_id, registration), lease)],
            failure=[],
        )
        if ok:
            self._emit(ev.LEADER_ELECTED, registration=registration)

    def maybe_propose(
        self, view: JobView, node_id: str, registration: int, last_change: float
    ) -> float | None:
        """As leader, replace the round when :func:`plan_round` says so and membership settled.

        Membership last changed at ``last_change`` (monotonic). Returns the monotonic time at which
        to look again (settle time still running), or None.
        """
        if not view.complete or not leads(view, node_id, registration):
            return None
        if view.round is not None and not view.round.whole:  # a complete view reads it whole
            return None
        if node_id not in view.nodes:
            return None
        self._say_short(view, node_id)
        members = plan_round(view, self._min, self._max)
        if members is None:
            return None
        # A drained member gets a lease TTL to say after which step it leaves (it answers in
        # milliseconds; one that cannot is dropped as a failed one would be). Only a round that
        # would just drop drained members waits; any other change is made at once.
        now = time.monotonic()
        self._drain_seen = {n: self._drain_seen.get(n, now) for n in draining(view)}
        waiting = {n: t + self._cfg.lease_ttl_s for n, t in self._drain_seen.items()}
        waiting = {n: t for n, t in waiting.items() if t > now}
        if waiting and only_drops(view.round, members, waiting.keys()):
            return min(waiting.values())
        if not shrink_only(view.round, members):
            settle = self._initial_settle if view.round is None else self._cfg.settle_s
            settles_at = last_change + settle
            if len(members) < self._max and time.monotonic() < settles_at:
                return settles_at
        self.propose(view, members, registration)
        return None

    def _say_short(self, view: JobView, node_id: str) -> None:
        """Say once, as the job starts to wait for nodes, that it does.

        The test is :func:`launcher.rendezvous.round_plan.short_of_nodes`."""
        ready = short_of_nodes(view, self._min, node_id)
        if ready is not None and not self._short and view.round is not None:
            self._emit(
                ev.BELOW_MIN_NODES,
                f"round {view.round.number} lost members and only {ready} node(s) are ready, "
                f"fewer than cluster.min_nodes={self._min}: the job waits for nodes",
                level=logging.WARNING,
                ready=ready,
                min_nodes=self._min,
                round=view.round.number,
            )
        self._short = ready is not None

    def propose(self, view: JobView, members: list[NodeRecord], registration: int) -> bool:
        """Replace the round seen in ``view`` by one of ``members``; False if it was stale.

        The transaction only succeeds if the round key still has the revision this node read, so
        of two proposers working from the same view exactly one wins, and a proposer with an old
        view loses.
        """
        keys = self._keys
        number = view.round.number + 1 if view.round else 1
        # The member keys go first, into this proposal's own folder (a rival's, or this
        # leader's own stale proposal that loses, never touches it), a bounded batch per
        # transaction; the fenced head then names the folder. Folders sort by round number.
        self._proposals += 1
        parts_id = f"{number:012d}-{registration:012d}-{self._proposals:06d}"
        new = Round.build(number, members, switch_step(view, members), view.round, parts_id)
        head, rows = new.to_values()
        folder = keys.round_part_folder(parts_id)
        t = self._etcd.transactions
        batch = list(rows.items())
        for i in range(0, len(batch), MEMBERS_PER_TXN):
            self._etcd.transaction(
                compare=[],
                success=[t.put(folder + n, v) for n, v in batch[i : i + MEMBERS_PER_TXN]],
                failure=[],
            )
        fence = (
            (t.mod(keys.round) == view.round_rev) if view.round else (t.version(keys.round) == 0)
        )
        # Won: the older rounds' member keys go (every folder that sorts before this one).
        # Lost: this proposal's own go.
        ok, _ = self._etcd.transaction(
            compare=[fence],
            success=[t.put(keys.round, head), t.delete(keys.round_parts, range_end=folder)],
            failure=[t.delete(folder, range_end=prefix_end(folder))],
        )
        if ok:
            before = {m.node_id for m in view.round.members} if view.round else set()
            after = {m.node_id for m in new.members}
            self._emit(
                ev.ROUND_FORMED,
                round=number,
                world_size=new.world_size,
                members=[m.node_id for m in new.members],
                removed=sorted(before - after),
                added=sorted(after - before),
                store=f"{new.store_host}:{new.store_port}",
                after_step=new.after_step,
            )
        return bool(ok)
