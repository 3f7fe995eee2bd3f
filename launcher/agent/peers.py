"""The agent's look at its peers: which of the round's other agents answer, and what follows.

A worker that sees a collective fail makes its agent probe the round's other agents. A refused
connection means the peer's process is gone, and its key is deleted at once (an eviction), so
the leader forms a smaller round without waiting for the lease. A frozen peer still accepts (the
kernel does) and is left to its lease. Before a node says it is ready, it checks that it reaches
every live member of the round, so that a node cut off by the network does not join a round it
cannot train in. The decisions are pure functions in :mod:`launcher.agent.peer_decisions`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from elastic import event_types as ev
from elastic.config import RendezvousConfig
from elastic.events import EventLog
from launcher.agent import peer_decisions as decide
from launcher.rendezvous.membership import JobView, Member, Round

PROBE_AGAIN_S = 0.2  # after a failed collective, peers are probed this often until a new round
# A survivor that is neither the round's first live member nor next to the dead peer evicts it
# itself after probing this long (or a lease TTL, if shorter) with the round still standing:
# those may be frozen, or may not have seen the failure (peer_decisions.evicts_now).
EVICT_BACKUP_S = 1.0
# Rounds in a row left with no one to blame, none trained in, after which a node stops: each costs
# rendezvous.pg_timeout_s or a lease TTL, and a cause that outlives this many does not heal.
FRUITLESS_ROUNDS = 5
WHY_EVICTED = {
    decide.Reach.DEAD: "its agent refuses connections",
    decide.Reach.UNREACHABLE: "unreachable from the majority of the round",
}


def probe(host: str, port: int, timeout_s: float) -> decide.Reach:
    """Whether an agent listens at ``host:port``.

    A refused connection means its process is gone. A stopped process still accepts (the kernel
    does), so a frozen node is not "dead". No answer at all within ``timeout_s`` is the network
    (or a machine that is off)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return decide.Reach.ALIVE
    except ConnectionRefusedError:
        return decide.Reach.DEAD
    except OSError:
        return decide.Reach.UNREACHABLE


class Peers:
    """Probes the round's other agents for one node.

    ``evict(member, reason)`` deletes a dead peer's key
    (:meth:`launcher.rendezvous.rendezvous.Rendezvous.evict`)."""

    def __init__(
        self,
        node_id: str,
        cfg: RendezvousConfig,
        events: EventLog,
        evict: Callable[[Member, str], object],
        whole: Callable[[Round], Round | None],
    ) -> None:
        self._node_id, self._cfg, self._events, self._evict = node_id, cfg, events, evict
        self._whole = whole  # a round with every member (a node keeps only its own)
        self.lost_round = 0  # the newest round in which a local worker saw a collective fail
        self.trained_in_lost = 0  # the most steps a local worker trained in lost_round
        self._probing_since: float | None = None  # monotonic: when probing for lost_round began
        self._cut_off = False  # it could not reach the round's members when it last looked
        # The latest rounds left with no one to blame.
        self._blameless: list[decide.Blameless] = []

    def lost(self, round_number: int, trained: int) -> None:
        """A local worker saw a collective of ``round_number`` fail, ``trained`` steps into it."""
        if round_number > self.lost_round:
            self.lost_round, self.trained_in_lost = round_number, trained
        elif round_number == self.lost_round:
            self.trained_in_lost = max(self.trained_in_lost, trained)

    def on_lost(
        self, current: Round | None, view: JobView, step: int
    ) -> decide.Probe | decide.Fruitless | str | None:
        """After a failed collective, probe the peers and evict those that are dead.

        Returns the probe while the round stands (the loop probes again in
        :data:`PROBE_AGAIN_S`). Returns the reason to leave the round when every peer answers yet
        the collectives failed, unless :data:`FRUITLESS_ROUNDS` such rounds in a row saw this
        node train nothing (:func:`~launcher.agent.peer_decisions.fruitless`: the node stops);
        ``step`` is its workers'. None when there is nothing to look at."""
        whole = self._whole(current) if current is not None else None
        found = decide.on_peer_lost(whole, self.lost_round, view, self._node_id)
        if found is None:
            self._probing_since = None
            return None
        reach = self.probe_all(found.peers)
        now = time.monotonic()
        self._probing_since = self._probing_since or now
        waited = now - self._probing_since
        if decide.no_one_to_blame(found, reach, waited, self._cfg.lease_ttl_s):
            self._probing_since = None
            self._blameless.append(decide.Blameless(step, self.trained_in_lost))
            del self._blameless[:-FRUITLESS_ROUNDS]  # only the latest count
            if stop := decide.fruitless(self._blameless, FRUITLESS_ROUNDS):
                return stop
            return (
                f"round {found.round.number}'s collectives failed, yet every peer answers: "
                "leaving it so that it is formed again"
            )
        backup = min(EVICT_BACKUP_S, self._cfg.lease_ttl_s)
        if decide.evicts_now(found, reach, self._node_id, waited, backup):
            for member in decide.peers_to_evict(found, reach, self._node_id):
                self._evict(member, WHY_EVICTED[reach[member.node_id]])
        return found

    def probe_all(self, peers: Sequence[Member]) -> dict[str, decide.Reach]:
        """Each peer's agent port, probed in parallel: by node id."""
        timeout = self._cfg.probe_timeout_s
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(peers)))) as pool:
            found = list(pool.map(lambda p: probe(p.host, p.port, timeout), peers))
        return {p.node_id: r for p, r in zip(peers, found, strict=True)}

    def reaches_the_round(self, view: JobView) -> bool:
        """Whether this node reaches every live member of the current round, before saying ready.

        See :func:`~launcher.agent.peer_decisions.reaches_the_round`. An event says so once
        while it does not."""
        if view.round is None:
            return True
        rnd = self._whole(view.round)
        if rnd is None:  # etcd away, or the round replaced: look again at the next one
            return False
        reach = self.probe_all([m for m in rnd.members if m.node_id != self._node_id])
        ok = decide.reaches_the_round(rnd, reach, self._node_id)
        cut = sorted(n for n, r in reach.items() if r is decide.Reach.UNREACHABLE)
        if not ok and not self._cut_off:
            self._events.emit(
                ev.PEERS_UNREACHABLE,
                f"{self._node_id} cannot reach {', '.join(cut)} of round {view.round.number}: "
                "waiting for the network before it joins (a check of every node's links and "
                "firewall between the hosts' store ports may help)",
                level=logging.WARNING,
                peers=cut,
            )
        self._cut_off = not ok
        return ok
