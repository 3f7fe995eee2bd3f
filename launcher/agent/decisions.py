"""The agent's decisions, as pure functions over plain data, like :func:`plan_round`.

The agent (:mod:`launcher.agent.agent`) gathers the facts (worker exit codes, the job's view in
etcd, probe results, the time), asks these functions what to do, and carries out the answer. Nothing
here talks to etcd, touches a process or reads a clock, so every branch is tested on literal data
(``tests/test_decisions.py``), including the NCCL shrink that CPU runs never take end to end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.control import EXIT_PEER_LOST, EXIT_UNSAVED, Assignment
from launcher.rendezvous.membership import JobView, Member, NodeRecord, Round

# --- worker exits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finish:
    """A local worker finished the job.

    Let the others finish the same last step, then mark the job done."""


@dataclass(frozen=True)
class Unsaved:
    """The workers trained the job to its end, but its final checkpoint could not be written.

    They say so with :data:`EXIT_UNSAVED`, the same on every rank: the node ends with that code.
    Nothing is restarted, which would only train the unsaved steps again into the same broken
    store, and the job is not marked done."""

    @property
    def reason(self) -> str:
        """Why the node leaves the job (its ``node_left``)."""
        return (
            "the job was trained, but its final checkpoint could not be written within "
            "checkpoint.final_retry_s (rank 0's final_save_failed names the steps not saved)"
        )


def leaves_done_job(done_in: int | None, current: Round | None, lost_round: int) -> bool:
    """Whether this node leaves because the job was trained, in round ``done_in`` (None: not yet).

    Workers still in that round finish its last step first: they are past its end, and leave on
    their own. Any other round cannot train again: it was formed at the very end (a node
    joining), and it waits for nodes that finished the old one and left. Workers in no round, or
    whose round's collectives failed (``lost_round``), have nothing left to do."""
    if done_in is None:
        return False
    return current is None or current.number != done_in or lost_round == current.number


@dataclass(frozen=True)
class Restart:
    """Leave the round and start the workers of ``local_ranks`` again."""

    local_ranks: tuple[int, ...]
    codes: tuple[int, ...]  # their exit codes, in the same order
    crashes: int  # this node's worker crashes so far, these included
    strike: str | None  # why this is a strike (a crash of its own), or None (EXIT_PEER_LOST only)

    @property
    def reason(self) -> str:
        """What the node tells the others when it leaves the round."""
        return f"worker exit codes {list(self.codes)}"


@dataclass(frozen=True)
class GiveUp:
    """Workers crashed more than ``cluster.max_restarts`` times: the node leaves the job."""

    crashes: int
    max_restarts: int

    def message(self, node_id: str) -> str:
        return (
            f"{node_id}: workers crashed {self.crashes} times "
            f"(cluster.max_restarts={self.max_restarts}); leaving the job"
        )


def on_worker_exits(
    codes: Sequence[int | None], crashes: int, max_restarts: int
) -> Finish | Unsaved | Restart | GiveUp | None:
    """What to do about the local workers' exit codes (None: still running), by local rank.

    Any 0 means the job is trained; any :data:`EXIT_UNSAVED`, that it is trained but its final
    state could not be saved. Other codes are failures: each is restarted, and each that
    is not :data:`EXIT_PEER_LOST` (peers went away, not this node's fault) counts as a crash and a
    strike; more than ``max_restarts`` crashes in all and the node gives up. ``crashes`` is the
    count before these exits. None when every worker still runs.
    """
    if 0 in codes:
        return Finish()
    if EXIT_UNSAVED in codes:
        return Unsaved()
    failed = [(rank, code) for rank, code in enumerate(codes) if code is not None]
    if not failed:
        return None
    crashed = [code for _, code in failed if code != EXIT_PEER_LOST]
    total = crashes + len(crashed)
    if total > max_restarts:
        return GiveUp(total, max_restarts)
    exit_codes = tuple(code for _, code in failed)
    return Restart(
        local_ranks=tuple(rank for rank, _ in failed),
        codes=exit_codes,
        crashes=total,
        strike=f"worker(s) crashed with exit codes {list(exit_codes)}" if crashed else None,
    )


# --- membership -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rejoin:
    """The job goes on without this node: leave, and join again as a new member.

    The workers stop, or stand by (:func:`keeps_workers`)."""

    reason: str
    strike: bool  # whether it counts against the node (fencing does; quarantine is the sentence)


@dataclass(frozen=True)
class StopNode:
    """etcd stayed away beyond ``rendezvous.etcd_grace_s``: stop the workers and exit.

    Nothing is lost: the newest checkpoint stays, and a relaunch resumes from it."""


def on_membership(
    fenced: bool, quarantined: bool, etcd_lost: bool, draining: bool = False
) -> StopNode | Rejoin | None:
    """Whether this node lost its place in the job, and what it does then (None: it did not).

    It lost it when etcd stayed away past the grace period (``etcd_lost``: no round can form, so
    the node stops). It lost it too when the server says its lease expired or a peer evicted it
    (``fenced``), or when it is quarantined (by its own strikes or an operator). A node still
    ``draining`` for a quarantine that ran out meanwhile (a short ``health.quarantine_s``) is
    quarantined all the same: it said it leaves, so no round holds it until it joins again. An
    etcd that is merely away is none of these: the node trains on."""
    if etcd_lost:
        return StopNode()
    if fenced:
        return Rejoin("lost its place in the job (fenced)", strike=True)
    if quarantined or draining:
        return Rejoin("was quarantined", strike=False)
    return None


def keeps_workers(rejoin: Rejoin, quarantined: bool, exit_codes: Sequence[int | None]) -> bool:
    """Whether the workers stand by through a rejoin instead of being stopped and started again.

    A fenced node (frozen past its lease, cut off etcd) has workers that did nothing wrong: new
    ones would cost seconds of start-up (torch, the model, the loader) before the node trains
    again, on cores a local job shares with the nodes training meanwhile. Standing by, they leave
    their round at once as stopped ones would, and the next round gives them the survivors'
    state, as it gives a restarted worker. A quarantined node waits out its sentence, which may
    be long: its workers stop and free the devices. So do all of them if one has exited.
    """
    return rejoin.strike and not quarantined and all(code is None for code in exit_codes)


@dataclass(frozen=True)
class TakeOver:
    """The id is held by an earlier incarnation of this node (same host, its agent gone).

    Delete that registration and register at once, instead of waiting out its lease."""


@dataclass(frozen=True)
class WaitForId:
    """The holder may be alive, or on another host: try again until its lease runs out."""


@dataclass(frozen=True)
class IdTaken:
    """The id stayed held past the wait: another live node has it."""


def on_node_id_in_use(
    holder_host: str, my_host: str, holder_alive: bool, waited_too_long: bool
) -> TakeOver | WaitForId | IdTaken:
    """What to do when this node's id is registered already.

    Its own earlier incarnation is taken over: same host, and its agent refuses connections (a
    crash and an immediate restart, whose lease the server keeps for a TTL). Anything else is
    left to its lease, up to a bound."""
    if holder_host == my_host and not holder_alive:
        return TakeOver()
    return IdTaken() if waited_too_long else WaitForId()


# --- health checks --------------------------------------------------------------------------------

# Checks of what every node of the job shares: the checkpoint store and etcd.
SHARED_CHECKS = frozenset({"checkpoint_disk", "etcd"})


def refusing_checks(failed: Sequence[str], in_running_job: bool) -> list[str]:
    """The failed checks (by name) that keep this node out.

    A node that is already in a running job (rejoining, or restarting a crashed worker) is not
    refused for a check of what every node shares: the others fail it too, so refusing one node,
    or all of them one by one into quarantine, cannot help. The job goes on (failed saves are
    ``checkpoint_failed``; an absent etcd has its grace period) and the check is a warning. A node
    joining for the first time is refused, before it costs the job anything.
    """
    return [name for name in failed if not (in_running_job and name in SHARED_CHECKS)]


# --- rounds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assign:
    """Send the workers into ``round``, at the ranks of ``member``."""

    round: Round
    member: Member
    assignments: tuple[Assignment, ...]  # one per local rank


@dataclass(frozen=True)
class Standby:
    """The new round does not list this node: its workers leave theirs and wait.

    They leave after step ``after_step`` of theirs when the node leaves as planned (0: at
    once); then they wait for the members of ``round`` to set it up before they say they left,
    since a member may still be in the step after that one with them (:mod:`elastic.agent_link`)."""

    round: Round
    after_step: int = 0


def follow_round(
    view: JobView, me: NodeRecord, current: Round | None, workers_ready: bool
) -> Assign | Standby | None:
    """What the current round of ``view`` means for this node; None when there is nothing to do.

    The node's workers are in ``current`` (None: on standby).

    ``me`` is the node's own record: its incarnation may be ahead of the view's (a failure just
    reported), and then a round listing the view's record is not this node's. Its registration is
    the view's record (the node learns its create revision from the watch). A round that lists
    this node is entered only when all its members are still live and ready, and this node's
    workers are ready; otherwise a newer round follows at once, or the workers become ready.
    """
    rnd = view.round
    if rnd is None or (current is not None and rnd.number == current.number):
        return None
    mine = view.nodes.get(me.node_id)
    member = view.is_member(mine) if mine and mine.incarnation == me.incarnation else None
    if member is None:
        return Standby(rnd, rnd.after_step) if current is not None else None
    if not view.round_intact() or not workers_ready:
        return None
    return Assign(rnd, member, tuple(assignments(current, rnd, member)))


def assignments(previous: Round | None, new: Round, me: Member) -> list[Assignment]:
    """What each of this node's workers (``me.slots`` of them) is told about round ``new``.

    The workers come from round ``previous`` (None: on standby or fresh). Local rank i gets
    global rank first_rank + i."""
    # An in-place shrink (new.shrinks) applies to workers in the round it shrinks.
    excluded = new.shrinks if previous is not None and previous.number + 1 == new.number else ()
    return [
        Assignment(
            round=new.number,
            rank=me.first_rank + i,
            world_size=new.world_size,
            store_host=new.store_host,
            store_port=new.store_port,
            formed_at=new.formed_at,
            shrinks_round=previous.number if excluded and previous else 0,
            excluded_ranks=excluded,
            after_step=new.after_step if previous is not None else 0,
        )
        for i in range(me.slots)
    ]


# --- the agent's own time -------------------------------------------------------------------------

AWAY_S = 2.0  # a wait that overran its timeout by this much: the agent was stopped or starved


def away_for(asked_s: float, waited_s: float) -> float:
    """How long the agent did not run, judged from one wait of its loop.

    The wait was asked to last at most ``asked_s`` and took ``waited_s`` (monotonic). The answer
    is 0 unless it overran by more than :data:`AWAY_S`. An agent that was stopped (SIGSTOP, a
    hung machine) wakes up with its workers' heartbeats unread. Their silence is its own, and
    blaming them would kill healthy workers and count a strike for a fault the lease already
    deals with."""
    overran = waited_s - asked_s
    return overran if overran > AWAY_S else 0.0


# --- a planned leave ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drain:
    """Ask the workers after which step they can stop (``leave``), and publish it.

    The others form the next round without this node and switch to it between two steps."""


@dataclass(frozen=True)
class Leave:
    """Stop the workers, revoke the lease and exit."""


def others_go_on(view: JobView, me: str, min_nodes: int) -> bool:
    """Whether the job can form a round without node ``me``.

    It can when at least ``min_nodes`` other nodes are ready, not leaving and not quarantined
    (what :func:`plan_round` would place). A node that does not lead follows only its own record
    and its own member key: it counts the other members of the round, which the leader keeps
    placeable."""
    if view.done:
        return False
    if not view.complete and view.round is not None:
        return view.round.size - (view.round.member(me) is not None) >= min_nodes
    others = [
        n
        for n in view.nodes.values()
        if n.node_id != me and n.ready and not n.leaving_after and n.node_id not in view.quarantined
    ]
    return len(others) >= min_nodes


def on_stop(
    in_round: bool, others_go_on: bool, asked: bool, out: bool, overdue: bool
) -> Drain | Leave | None:
    """What the node does now that a stop signal (SIGTERM, SIGINT) came.

    A node in a round whose job goes on without it (``others_go_on``: enough nodes stay that are
    not leaving) leaves as planned. It drains: its workers finish the step in flight and the one
    after, the others switch rounds in between, and nothing is dropped. It then leaves once its
    workers are ``out`` of the round, or when the drain is ``overdue``. It also leaves when the
    others stop going on (they leave too: the whole job was stopped). Anything else leaves at
    once: there is no round to hand over. None: the drain is under way."""
    if not asked:
        return Drain() if in_round and others_go_on else Leave()
    return Leave() if out or overdue or not others_go_on else None


# --- a straggler ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evict:
    """Quarantine this node with ``reason``.

    It leaves as planned (a drain, like an operator's ``quarantine add``), waits out
    ``health.quarantine_s``, checks itself again and rejoins."""

    reason: str


def on_straggler(
    policy: str, node_id: str, slowdown: float, others_go_on: bool, leaving: bool
) -> Evict | str:
    """Evict this node, or say why it stays, when a worker of it found itself a straggler.

    That worker is ``slowdown`` times slower than the median rank. The answer is an eviction
    (``health.straggler=evict``), or the sentence that says why the node stays. A node already
    on its way out stays on it; one the job cannot go on without stays too, since a slow round
    beats none."""
    if policy != "evict":
        return f"health.straggler={policy}: {node_id} stays in the job, slowing it"
    if leaving:
        return f"{node_id} is leaving already"
    if not others_go_on:
        return (
            f"{node_id} stays: without it the job would fall below cluster.min_nodes, "
            "and a slow round beats none"
        )
    return Evict(f"a straggler: its compute was {slowdown:.1f}x the median rank's")


# --- waiting for a round --------------------------------------------------------------------------


def join_timed_out(waiting_since: float, now: float, limit_s: float) -> bool:
    """Whether a node outside every round since ``waiting_since`` waited beyond ``limit_s``.

    ``limit_s`` is ``rendezvous.join_timeout_s``; the times come from the same monotonic clock."""
    return now - waiting_since > limit_s


# --- the job's progress in etcd (python -m launcher.commands.status) -----------------------------

# The ``progress`` key is written at most this often: each put is one etcd revision, kept until
# etcd compacts it, and at once a second it was all but every revision a running job wrote
# (3,600 an hour). launcher.commands.status shows the step with its age, which this bounds.
PROGRESS_EVERY_S = 5.0


def publishes_progress(
    current: Round | None,
    me: str,
    step: int,
    published: int,
    since_s: float,
    every_s: float = PROGRESS_EVERY_S,
) -> bool:
    """Whether this node's agent writes the job's ``progress`` key now.

    It writes only while its workers hold global rank 0 of the round they are in (``current``;
    rank 0 logs the steps). It writes only a step other than the one written last (``step``: the
    newest its rank 0 logged, 0 before any; ``published``: the step written last). It writes at
    most once every ``every_s`` (``since_s``: since the last write, monotonic). A write that
    fails is skipped, never retried: the next step's replaces it."""
    if current is None or step <= 0 or step == published or since_s < every_s:
        return False
    member = current.member(me)
    return member is not None and member.first_rank == 0


# --- fault requests (python -m chaos campaign.attach=true) ------------------------------------

REQUESTABLE_KINDS = ("kill_node", "kill_worker", "freeze_node", "leave_node")


@dataclass(frozen=True)
class FaultAnswer:
    """Whether this node carries out a fault request, and why not."""

    accepted: bool
    reason: str = ""


def answer_fault_request(request: Mapping[str, object], allow: bool, slots: int) -> FaultAnswer:
    """Whether to carry out ``request`` (the JSON a requester wrote) on this node.

    The node has ``slots`` workers. Only a job started with ``chaos.allow=true`` takes any; then
    only the kinds a node can do to itself (:data:`REQUESTABLE_KINDS`), with values that end."""
    if not allow:
        return FaultAnswer(
            False,
            "chaos.allow is false in this job's config; start the job with chaos.allow=true to "
            "let it take fault requests",
        )
    kind = request.get("kind")
    if kind not in REQUESTABLE_KINDS:
        return FaultAnswer(
            False, f"kind={kind!r} cannot be requested; use one of {', '.join(REQUESTABLE_KINDS)}"
        )
    duration = request.get("duration_s", 0)
    if kind == "freeze_node" and not (isinstance(duration, int | float) and 0 < duration <= 3600):
        return FaultAnswer(False, f"duration_s={duration!r}: a freeze must last 0-3600 s")
    rank = request.get("local_rank", 0)
    if kind == "kill_worker" and not (isinstance(rank, int) and 0 <= rank < slots):
        return FaultAnswer(False, f"local_rank={rank!r}: this node has workers 0-{slots - 1}")
    return FaultAnswer(True)
