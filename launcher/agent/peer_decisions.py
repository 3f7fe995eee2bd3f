"""The agent's decisions after a failed collective, as pure functions over plain data.

Which peers to probe, what a probe found, whom to evict and who evicts, when a broken round
with no one to blame is left, and when a node reaches its round well enough to say it is ready.
:mod:`launcher.agent.peers` probes and acts; like :mod:`launcher.agent.decisions`, nothing here
talks to etcd, touches a process or reads a clock (``tests/test_decisions.py``).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.rendezvous.membership import JobView, Member, Round


@dataclass(frozen=True)
class Probe:
    """Probe the agents of ``peers`` (the other members of ``round`` not known to be gone)."""

    round: Round
    peers: tuple[Member, ...]


def on_peer_lost(current: Round | None, lost_round: int, view: JobView, me: str) -> Probe | None:
    """Whether to probe the peers after a failed collective of round ``lost_round`` (0: none).

    A local worker reported that collective. The peers are probed while that is the round the
    workers are in; a report about an older round is stale.

    The agent probes again until the round is replaced: a killed process's port may still accept
    for a moment, and an eviction that found etcd away must be tried again."""
    if current is None or lost_round != current.number:
        return None
    peers = tuple(
        m
        for m in current.members
        if m.node_id != me and (m.node_id in view.nodes or not view.complete)
    )
    return Probe(current, peers)


class Reach(enum.Enum):
    """What a probe of a peer agent's port found."""

    ALIVE = "alive"  # it connected: the agent's process exists (a frozen one too: the kernel
    # answers for it)
    DEAD = "dead"  # refused: no process listens, the agent is gone
    UNREACHABLE = "unreachable"  # no answer within the timeout: the network between us, or a
    # machine that is off


def peers_to_evict(probe: Probe, reach: Mapping[str, Reach], me: str) -> list[Member]:
    """The members of the probed round to evict (``reach`` by node id).

    A peer not probed counts as alive. Evicted are those whose agent is gone, and those this
    node cannot reach when this node is on the majority side of the round (a network partition).

    Of two sides that cannot reach each other but both reach etcd, only one may evict the
    other: the side that holds more of the round's live nodes, or on a tie the side with the
    round's first member (rank 0). The other side evicts no one; it is evicted, and it finds
    itself fenced. A peer that is merely slow connects within the probe's timeout (the kernel
    answers for it) and is never evicted here."""
    state = {p.node_id: reach.get(p.node_id, Reach.ALIVE) for p in probe.peers}
    live = [m for m in probe.round.members if state.get(m.node_id) is not Reach.DEAD]
    mine = {me} | {n for n, r in state.items() if r is Reach.ALIVE}
    majority = 2 * len(mine) > len(live) or (
        2 * len(mine) == len(live) and probe.round.members[0].node_id in mine
    )
    evict = {Reach.DEAD, Reach.UNREACHABLE} if majority else {Reach.DEAD}
    return [
        member
        for peer in probe.peers
        if state[peer.node_id] in evict and (member := probe.round.member(peer.node_id))
    ]


def evicts_now(
    probe: Probe, reach: Mapping[str, Reach], me: str, waited_s: float, backup_s: float
) -> bool:
    """Whether this node sends the evictions :func:`peers_to_evict` names, now.

    A few evictions per dead node, not one per survivor. At once evict the first member of the
    round (in rank order) that this node's probe found alive, itself included, and the live
    members next to a peer it found not alive (:func:`ring_neighbours`). The others evict only
    once they have probed for ``backup_s`` with the round still standing. The first one may be
    frozen (its port still accepts), or may not have seen the failure: a gloo ring leaves a rank
    waiting on a live neighbour that gave up, without an error, and the node that did see it
    would otherwise wait ``backup_s``."""
    ids = [m.node_id for m in probe.round.members]
    alive = [n for n in ids if n == me or reach.get(n, Reach.ALIVE) is Reach.ALIVE]
    return alive[0] == me or me in ring_neighbours(ids, set(alive)) or waited_s >= backup_s


def ring_neighbours(ids: Sequence[str], alive: set[str]) -> set[str]:
    """The members of ``alive`` next to one that is not, in the round's rank order, cyclic.

    Their collectives meet a gone peer first: a ring's ranks send to the next rank and receive
    from the one before."""
    # Bisected, not scanned: a partition of a round of thousands leaves many gone, and the agent
    # decides again at each probe (1,024 gone of 2,048: 0.6 ms, where a scan for each took 49).
    live = [i for i, n in enumerate(ids) if n in alive]
    if len(live) == len(ids) or not live:
        return set()
    found = set()
    for i, n in enumerate(ids):
        if n not in alive:
            k = bisect.bisect_left(live, i)  # live[k - 1] before it (the last, at k = 0)
            found |= {ids[live[k - 1]], ids[live[k % len(live)]]}
    return found


def no_one_to_blame(
    probe: Probe, reach: Mapping[str, Reach], waited_s: float, backup_s: float
) -> bool:
    """Whether this node should leave a round whose collectives failed though no peer is at fault.

    It should once it has probed for ``backup_s`` and every peer still answers. ``backup_s`` is
    a lease TTL: the time a dead or frozen peer takes to lose its lease and the round. Such a
    failure is a network fault that outlasted ``rendezvous.pg_timeout_s`` and healed before the
    probes, or a timeout that fired late. Nobody is evicted, but the round's group is broken for
    good, and only a new round mends it. The node leaves (a failure report: no strike, its
    workers kept) and rejoins."""
    return waited_s >= backup_s and all(
        reach.get(p.node_id, Reach.ALIVE) is Reach.ALIVE for p in probe.peers
    )


@dataclass(frozen=True)
class Blameless:
    """A round this node left with no one to blame.

    Its workers' step then, and the steps they trained in it (the most any of them did)."""

    step: int
    trained: int


@dataclass(frozen=True)
class Fruitless:
    """Rounds this node left with no one to blame, ``rounds`` in a row, none of them trained in.

    The last was left at ``step``."""

    rounds: int
    step: int

    def message(self) -> str:
        return (
            f"{self.rounds} rounds in a row failed though every peer answered, and this node "
            f"trained no step in any of them (the last at step {self.step}): a collective that "
            "fails by itself (an operation the backend lacks, a bug in the job) or a data path "
            "blocked while the agents' ports answer (a firewall); forming rounds again will not "
            "mend it, and the newest checkpoint stands"
        )


def fruitless(left: Sequence[Blameless], limit: int) -> Fruitless | None:
    """Whether the last ``limit`` rounds left with no one to blame saw this node train nothing.

    Counted by the node's own steps, not the job's: the others may train between its rounds,
    alone, and then it fails a step further on each time, still without training one."""
    recent = left[-limit:]
    if len(recent) < limit or any(r.trained for r in recent):
        return None
    return Fruitless(limit, recent[-1].step)


def reaches_the_round(round: Round | None, reach: Mapping[str, Reach], me: str) -> bool:
    """Whether this node may say it is ready to join.

    It may when it reaches every live member of the current round (``reach`` by node id). A node
    cut off from its peers would be placed in a round whose group it cannot set up, stalling
    every member for ``pg_timeout_s`` at each try; it waits until the network heals instead. A
    member that is gone (refused) does not count: it leaves the round by itself."""
    if round is None:
        return True
    return all(
        reach.get(m.node_id, Reach.ALIVE) is not Reach.UNREACHABLE
        for m in round.members
        if m.node_id != me
    )
