"""The job's membership as the rendezvous writes it and every process reads it: a node's record,
a round and its members (with their compact value and its split form), the ``leader`` key's
value, and a process's view of it all. Plain data, no I/O: the rendezvous (:mod:`launcher.
rendezvous`), the decisions (:mod:`launcher.agent.decisions`,
:mod:`launcher.rendezvous.round_plan`) and the status command share it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself under its lease."""

    node_id: str
    host: str
    store_port: int  # the agent's c10d TCPStore, used when this node holds rank 0
    slots: int  # workers this node runs
    incarnation: int = 0
    ready: bool = False  # its workers are up and waiting for a round
    # A planned leave (SIGTERM, a drain): the node trains up to this step, then leaves its round
    # for the next one, which the others form without it; 0: not leaving.
    leaving_after: int = 0
    joined_rev: int = 0  # etcd create_revision of the node key: the join order

    def to_json(self) -> str:
        data = asdict(self)
        del data["joined_rev"]
        return json.dumps(data)

    @classmethod
    def from_json(cls, raw: bytes | str, joined_rev: int) -> NodeRecord:
        return cls(**json.loads(raw), joined_rev=joined_rev)


@dataclass(frozen=True)
class Member:
    node_id: str
    joined_rev: int  # which registration of node_id this is
    incarnation: int
    host: str
    slots: int
    first_rank: int
    port: int = 0  # the node's agent port (its store_port): what peers probe


ROUND_LIMIT_BYTES = 1_400_000  # under etcd's default request limit (1.5 MiB) with room to spare


class RoundIncomplete(ValueError):
    """A split round's parts are not all there: a newer round replaced it meanwhile (and its
    parts were deleted), and that round's own event follows."""


@dataclass(frozen=True)
class Round:
    """A closed membership: who trains, with which global ranks, and where the c10d store is.

    Every node reads it, so its value is compact: each member is a list of its id,
    registration, incarnation, host, agent port and slots (ranks follow from the order), about
    50 bytes a member; 1024 nodes take about 50 KB. Past about 28,000 members the value would
    exceed what one etcd request carries: the members are then split over part keys, each
    under the limit, written before the ``round`` key that names them (:meth:`to_values`).
    """

    number: int
    members: tuple[Member, ...]
    store_host: str
    store_port: int
    formed_at: float = 0.0
    # The members of the previous round switch to this one after training this step (a planned
    # leave: nothing in flight is dropped); 0: at once.
    after_step: int = 0

    @property
    def world_size(self) -> int:
        return sum(m.slots for m in self.members)

    def member(self, node_id: str) -> Member | None:
        return next((m for m in self.members if m.node_id == node_id), None)

    def to_json(self) -> str:
        """The whole round as one value (:meth:`to_values` splits it where it must)."""
        return self._head(self._rows(), None)

    def to_values(self, parts_id: str, limit: int | None = None) -> tuple[str, list[str]]:
        """The ``round`` key's value and, for a round larger than ``limit`` bytes (default
        :data:`ROUND_LIMIT_BYTES`), its parts: consecutive runs of members, each value under
        ``limit``, stored under ``round_parts/<parts_id>/<index>``. The head then names
        ``parts_id`` and the count instead of carrying the members."""
        limit = ROUND_LIMIT_BYTES if limit is None else limit
        rows = self._rows()
        whole = self._head(rows, None)
        if len(whole) <= limit:
            return whole, []
        parts: list[str] = []
        chunk: list[str] = []
        size = 2  # the brackets
        for row in (json.dumps(r, separators=(",", ":")) for r in rows):
            if size + len(row) + 1 > limit:
                if not chunk:
                    raise ValueError(f"one member of round {self.number} exceeds {limit} bytes")
                parts.append("[" + ",".join(chunk) + "]")
                chunk, size = [], 2
            chunk.append(row)
            size += len(row) + 1
        parts.append("[" + ",".join(chunk) + "]")
        return self._head([], [parts_id, len(parts)]), parts

    def _rows(self) -> list[list[Any]]:
        return [
            [m.node_id, m.joined_rev, m.incarnation, m.host, m.port, m.slots] for m in self.members
        ]

    def _head(self, rows: list[list[Any]], parts: list[Any] | None) -> str:
        head: dict[str, Any] = {
            "number": self.number,
            "members": rows,
            "store": [self.store_host, self.store_port],
            "formed_at": round(self.formed_at, 3),
            "after_step": self.after_step,
        }
        if parts is not None:
            head["parts"] = parts
        return json.dumps(head, separators=(",", ":"))

    @classmethod
    def from_json(
        cls,
        raw: bytes | str,
        read_parts: Callable[[str, int], Sequence[bytes | str]] | None = None,
    ) -> Round:
        """The round from its value; a split round's members from ``read_parts(parts_id,
        count)``, its part values in order (asked only for a split round, so that a whole one
        is parsed once). :class:`RoundIncomplete` if they are not all there."""
        data = json.loads(raw)
        rows = data["members"]
        if "parts" in data:
            parts_id, count = data["parts"]
            parts = read_parts(parts_id, count) if read_parts else []
            if len(parts) != count:
                raise RoundIncomplete(
                    f"round {data['number']} has {count} parts, {len(parts)} found"
                )
            rows = [row for part in parts for row in json.loads(part)]
        members, rank = [], 0
        for node_id, joined_rev, incarnation, host, port, slots in rows:
            members.append(Member(node_id, joined_rev, incarnation, host, slots, rank, port))
            rank += slots
        host, port = data["store"]
        return cls(
            data["number"], tuple(members), host, port, data["formed_at"], data["after_step"]
        )

    @classmethod
    def build(cls, number: int, nodes: list[NodeRecord], after_step: int = 0) -> Round:
        members, rank = [], 0
        for n in nodes:
            members.append(
                Member(n.node_id, n.joined_rev, n.incarnation, n.host, n.slots, rank, n.store_port)
            )
            rank += n.slots
        return cls(
            number,
            tuple(members),
            nodes[0].host,
            nodes[0].store_port,
            round(time.time(), 3),
            after_step,
        )


@dataclass(frozen=True)
class JobView:
    """This process's picture of the job in etcd, as of ``revision``.

    Only the leader follows the whole membership (``complete``): every other node knows its own
    record, the round, the leader, ``done`` and its own quarantine key, which is what it acts on,
    so a membership change costs one watch event at the leader, not one at every node.
    """

    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)
    round: Round | None = None
    round_rev: int = 0  # mod_revision of the round key; 0 when there is none
    done_in: int | None = None  # the round that trained the job, once a node marked it done
    revision: int = 0
    quarantined: frozenset[str] = frozenset()  # node ids kept out (launcher.health.quarantine)
    leader: str = ""  # the ``leader`` key's value (:func:`leader_value`); "" while there is none
    complete: bool = False  # ``nodes`` and ``quarantined`` hold the whole job (the leader's view)

    @property
    def done(self) -> bool:
        """Whether the job is trained (sticky: see :meth:`Rendezvous._publish`)."""
        return self.done_in is not None

    def round_intact(self) -> bool:
        """Every member of the current round is still live, as the registration and incarnation
        it joined with, not quarantined and not leaving, as far as this view knows: a view that
        is not complete trusts the leader for the members it does not follow."""
        if self.round is None:
            return False
        for m in self.round.members:
            n = self.nodes.get(m.node_id)
            if m.node_id in self.quarantined or (n is None and self.complete):
                return False
            if n is not None and (
                (n.joined_rev, n.incarnation) != (m.joined_rev, m.incarnation)
                or not n.ready
                or n.leaving_after
            ):
                return False
        return True

    def is_member(self, node: NodeRecord) -> Member | None:
        """``node``'s place in the current round, if the round lists this very registration."""
        m = self.round.member(node.node_id) if self.round else None
        if m is None or (m.joined_rev, m.incarnation) != (node.joined_rev, node.incarnation):
            return None
        return m


def leader_value(node_id: str, joined_rev: int) -> str:
    """The ``leader`` key's value: which registration of which node leads."""
    return json.dumps([node_id, joined_rev])
