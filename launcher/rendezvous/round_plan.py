"""Round planning, as pure functions over a :class:`~launcher.rendezvous.membership.JobView`.

They say who is in the next round and in which rank order, and whether the job waits for nodes. They
say whether a round only drops members (formed at once), which members an operator is draining, and
after which step a planned leave switches rounds. The leader's rendezvous
(:meth:`launcher.rendezvous.rendezvous.Rendezvous`) acts on them.
"""

from __future__ import annotations

from collections.abc import Set

from launcher.rendezvous.membership import JobView, NodeRecord, Round


def plan_round(view: JobView, min_nodes: int, max_nodes: int) -> list[NodeRecord] | None:
    """The members the next round should have, in rank order, or None if none is needed now.

    A new round is needed when there is none, when a member is gone, reported a failure, was
    quarantined or is leaving, or when nodes are waiting and the round has room for them.
    Quarantined and leaving nodes are never placed. Survivors keep their relative order, so
    rank 0 stays where it was unless its node left; newcomers follow in join order.
    """
    ready = _placeable(view)
    if view.done or len(ready) < min_nodes:
        return None
    current = view.round
    if current is not None and view.round_intact():
        waiting = [n for n in ready if current.member(n) is None]
        if not waiting or len(current.members) >= max_nodes:
            return None
    previous = [m.node_id for m in current.members] if current else []
    survivors = [ready[n] for n in previous if n in ready]
    newcomers = sorted(
        (n for n in ready.values() if n.node_id not in previous), key=lambda n: n.joined_rev
    )
    return (survivors + newcomers)[:max_nodes]


def _placeable(view: JobView) -> dict[str, NodeRecord]:
    """The nodes a round may hold: ready, not leaving, not quarantined."""
    return {
        n.node_id: n
        for n in view.nodes.values()
        if n.ready and not n.leaving_after and n.node_id not in view.quarantined
    }


def short_of_nodes(view: JobView, min_nodes: int, leader: str) -> int | None:
    """How many nodes are ready, when the job waits for nodes; None otherwise.

    The job waits when a round trained, it lost members, and fewer than ``min_nodes`` are ready to
    form the next. None also while the job is done or the ``leader`` itself leaves (the job is being
    stopped)."""
    me = view.nodes.get(leader)
    if view.done or view.round is None or view.round_intact() or me is None or me.leaving_after:
        return None
    ready = len(_placeable(view))
    return ready if ready < min_nodes else None


def shrink_only(current: Round | None, members: list[NodeRecord]) -> bool:
    """Whether ``members`` are members of ``current`` in the same registrations.

    Such a round only removes nodes, and is formed without waiting for membership to settle."""
    if current is None:
        return False
    return all(
        (m := current.member(n.node_id)) is not None
        and (m.joined_rev, m.incarnation) == (n.joined_rev, n.incarnation)
        for n in members
    )


def draining(view: JobView) -> frozenset[str]:
    """The members of the current round that an operator is draining.

    A drain is a quarantine (``quarantine add``) of a member still there, training, as it joined.
    The leader waits a little for them to leave as planned
    (:meth:`launcher.rendezvous.record.OwnRecord.leave_after`) before it drops them."""
    if view.round is None:
        return frozenset()
    return frozenset(
        m.node_id
        for m in view.round.members
        if m.node_id in view.quarantined
        and (n := view.nodes.get(m.node_id)) is not None
        and (n.joined_rev, n.incarnation) == (m.joined_rev, m.incarnation)
        and n.ready
        and not n.leaving_after
    )


def only_drops(current: Round | None, members: list[NodeRecord], nodes: Set[str]) -> bool:
    """Whether a round of ``members`` differs from ``current`` only by leaving out ``nodes``."""
    if current is None or not shrink_only(current, members):
        return False
    return {m.node_id for m in current.members} - {n.node_id for n in members} <= nodes


def switch_step(view: JobView, members: list[NodeRecord]) -> int:
    """When the members of the current round should move to a new round of ``members``.

    After the step the leaving nodes asked for, if the new round only lets planned leavers go (every
    other member stays as it was). Else 0, at once (a failure, a join: the step in flight is
    dropped)."""
    current = view.round
    if current is None or not shrink_only(current, members):
        return 0
    kept = {n.node_id for n in members}
    gone = [m for m in current.members if m.node_id not in kept]
    leaving = [view.nodes.get(m.node_id) for m in gone]
    if not gone or any(
        n is None
        or not n.leaving_after
        or (n.joined_rev, n.incarnation) != (m.joined_rev, m.incarnation)
        for n, m in zip(leaving, gone, strict=True)
    ):
        return 0
    return max(n.leaving_after for n in leaving if n is not None)
