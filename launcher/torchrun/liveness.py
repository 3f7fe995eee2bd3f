"""torch's dead-node bound, checked against the gap a live node leaves between heartbeats.

A bound inside the gap splits a round's world: :func:`keep_alive_problem` says why and refuses it
before the backend connects (:func:`launcher.torchrun.backend.create_rdzv_handler`).
"""

from __future__ import annotations

from launcher.rendezvous.credentials import rdzv_conf_name

TORCH_KEEP_ALIVE = (5, 3)  # torch's keep_alive_interval (s) and keep_alive_max_attempt
HANDLER_POLL_S = 1  # torch's handler reads the state once a second while it waits in a round


def keep_alive_problem(interval: int, attempts: int) -> str | None:
    """Why torch's dead-node bound would drop live nodes, with the fix; None when it does not.

    torch's handler takes a node for dead once its newest heartbeat in the state is older than
    ``keep_alive_interval * keep_alive_max_attempt``, and drops it from its own copy of the state
    at every read, without writing that back. A node joining a round writes a heartbeat only at a
    poll (once a second) that finds its last one older than the interval; once the round is
    complete, its next heartbeat comes one interval after its poll saw that. So a live node can
    go two intervals and a poll without one. A bound inside that gap lets the node that completes
    the round read a live peer as dead and start at a world size the others do not share: one
    agent of a 2-node round started its workers at world size 1 while the other waited for its
    rank (1 in 12 runs of tests/test_torchrun_handler.py at interval 1 s and 2 attempts)."""
    if interval < 1 or attempts < 1:
        return (
            f"etcd-v3 rendezvous: {rdzv_conf_name('keep_alive_interval')}={interval} and "
            f"{rdzv_conf_name('keep_alive_max_attempt')}={attempts} must be whole numbers, 1 or "
            f"more. Fix: e.g. keep_alive_interval=1,keep_alive_max_attempt="
            f"{_fewest_attempts(1)}"
        )
    if attempts >= _fewest_attempts(interval):
        return None
    return (
        f"etcd-v3 rendezvous: {rdzv_conf_name('keep_alive_max_attempt')}={attempts} at "
        f"keep_alive_interval={interval} takes a node for dead {attempts * interval} s after its "
        f"last heartbeat, but a live node can go {2 * interval + HANDLER_POLL_S} s without one "
        f"while a round completes, and torch's handler would then start the round at a world "
        f"size the other nodes do not share. Fix: keep_alive_max_attempt="
        f"{_fewest_attempts(interval)} or more"
    )


def _fewest_attempts(interval: int) -> int:
    """The fewest attempts whose bound clears the gap (:func:`keep_alive_problem`) by a poll.

    The poll is the margin a loaded machine needs."""
    return -(-(2 * interval + 2 * HANDLER_POLL_S) // interval)
