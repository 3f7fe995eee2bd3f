"""The job's membership as the rendezvous writes it and every process reads it.

The parts: a node's record, a round (its head and one key per member), the ``leader`` key's value,
and a process's view of it all. Plain data, no I/O: the rendezvous (:mod:`launcher.rendezvous`), the
decisions (:mod:`launcher.agent.decisions`, :mod:`launcher.rendezvous.round_plan`) and the status
command share it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace


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
    metrics_url: str = ""  # where its agent serves Prometheus metrics; "": nowhere

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


MEMBERS_PER_TXN = 100  # member keys the leader writes per transaction (etcd's default
# --max-txn-ops is 128)


class RoundIncomplete(ValueError):
    """A round's member keys are not the ones its head names.

    A newer round replaced it (and its members' keys were deleted) while they were read, and that
    round's own event follows."""


@dataclass(frozen=True)
class Round:
    """A closed membership: who trains, with which global ranks, and where the c10d store is.

    In etcd a round is a small head (``round``: its number, size, world size, store, step to
    switch after, the ranks it drops from the round before, and a digest of its members) and one
    key per member (``round_parts/<parts_id>/<node>``: its registration, incarnation, address,
    slots and first rank). A node reads the head and its own member key, O(1) bytes a round
    whatever the job's size; only the leader (and a node probing its peers) reads them all.

    ``whole``: ``members`` lists every member in rank order; otherwise only the reader's own
    (none if the round leaves it out), and ``size``/``ranks`` come from the head.
    """

    number: int
    members: tuple[Member, ...]
    store_host: str
    store_port: int
    formed_at: float = 0.0
    # The members of the previous round switch to this one after training this step (a planned
    # leave: nothing in flight is dropped); 0: at once.
    after_step: int = 0
    # The ranks of round ``number - 1`` this one drops, when it only drops members of it (NCCL
    # workers then shrink their communicator in place); () otherwise. Computed by the leader,
    # who knows both rounds whole (:func:`excluded_ranks`).
    shrinks: tuple[int, ...] = ()
    whole: bool = True
    size: int = 0  # members; from ``members`` when whole
    ranks: int = 0  # the world size; from ``members`` when whole
    parts_id: str = ""  # the folder of its member keys, once written
    head: bytes = field(default=b"", compare=False, repr=False)  # the value it was read from

    def __post_init__(self) -> None:
        if self.whole:
            object.__setattr__(self, "size", len(self.members))
            object.__setattr__(self, "ranks", sum(m.slots for m in self.members))

    @property
    def world_size(self) -> int:
        return self.ranks

    def member(self, node_id: str) -> Member | None:
        return next((m for m in self.members if m.node_id == node_id), None)

    @property
    def digest(self) -> str:
        """A hash of the whole membership, which the head carries.

        A reader of every member key checks that it has all of them, as written."""
        return _digest(self._rows())

    def _rows(self) -> dict[str, str]:
        return {
            m.node_id: json.dumps(
                [m.joined_rev, m.incarnation, m.host, m.port, m.slots, m.first_rank],
                separators=(",", ":"),
            )
            for m in self.members
        }

    def to_values(self) -> tuple[str, dict[str, str]]:
        """The head (the ``round`` key's value) and each member key's value, by node id.

        The head names :attr:`parts_id`."""
        if not self.whole:
            raise ValueError(f"round {self.number} is not whole: only its leader writes it")
        rows = self._rows()
        head = {
            "number": self.number,
            "size": self.size,
            "ranks": self.ranks,
            "store": [self.store_host, self.store_port],
            "formed_at": round(self.formed_at, 3),
            "after_step": self.after_step,
            "shrinks": list(self.shrinks),
            "parts": self.parts_id,
            "digest": _digest(rows),
        }
        return json.dumps(head, separators=(",", ":")), rows

    @classmethod
    def from_values(cls, head: bytes | str, rows: Mapping[str, bytes | str], whole: bool) -> Round:
        """A round from its head and member keys (by node id).

        ``whole``: ``rows`` are every member key, checked against the head's size and digest
        (:class:`RoundIncomplete` if they differ); else the reader's own (one, or none: the round
        leaves it out)."""
        data = json.loads(head)
        members = sorted(
            (_member(node_id, row) for node_id, row in rows.items()), key=lambda m: m.first_rank
        )
        rnd = cls(
            data["number"],
            tuple(members),
            *data["store"],
            data["formed_at"],
            data["after_step"],
            tuple(data["shrinks"]),
            whole=whole or len(members) == data["size"],
            size=data["size"],
            ranks=data["ranks"],
            parts_id=data["parts"],
            head=head if isinstance(head, bytes) else head.encode(),
        )
        if rnd.whole and (rnd.size, rnd.digest) != (data["size"], data["digest"]):
            raise RoundIncomplete(
                f"round {data['number']} names {data['size']} members; {len(rows)} read, not "
                "the ones it names"
            )
        return rnd

    @classmethod
    def build(
        cls,
        number: int,
        nodes: list[NodeRecord],
        after_step: int = 0,
        previous: Round | None = None,
        parts_id: str = "",
    ) -> Round:
        """Round ``number`` of ``nodes`` (ranks in their order), after ``previous`` (whole)."""
        members, rank = [], 0
        for n in nodes:
            members.append(
                Member(n.node_id, n.joined_rev, n.incarnation, n.host, n.slots, rank, n.store_port)
            )
            rank += n.slots
        rnd = cls(
            number,
            tuple(members),
            nodes[0].host,
            nodes[0].store_port,
            round(time.time(), 3),
            after_step,
            parts_id=parts_id,
        )
        return replace(rnd, shrinks=excluded_ranks(previous, rnd))


def excluded_ranks(previous: Round | None, new: Round) -> tuple[int, ...]:
    """The ranks of ``previous`` that ``new`` drops, or () unless ``new`` only removes nodes.

    Both rounds are whole. NCCL workers may shrink their communicator in place only for such a
    round. ``new`` must directly follow ``previous``. Its members must be members of ``previous`` as
    the same registration and incarnation (a restarted worker is not in the old communicator), with
    the same slots, in the same order (the survivors' ranks close up in order).
    """
    if previous is None or new.number != previous.number + 1:
        return ()
    kept = {m.node_id for m in new.members}
    survivors = [m for m in previous.members if m.node_id in kept]
    same = [(m.node_id, m.joined_rev, m.incarnation, m.slots) for m in survivors] == [
        (m.node_id, m.joined_rev, m.incarnation, m.slots) for m in new.members
    ]
    if not same:
        return ()
    return tuple(
        m.first_rank + i for m in previous.members if m.node_id not in kept for i in range(m.slots)
    )


def _digest(rows: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(rows.items())).encode()).hexdigest()[:16]


def _member(node_id: str, row: bytes | str) -> Member:
    joined_rev, incarnation, host, port, slots, first_rank = json.loads(row)
    return Member(node_id, joined_rev, incarnation, host, slots, first_rank, port)


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
        """Whether every member of the current round is still live, as far as this view knows.

        Live: as the registration and incarnation it joined with, not quarantined and not leaving. A
        view that is not complete trusts the leader for the members it does not follow."""
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
