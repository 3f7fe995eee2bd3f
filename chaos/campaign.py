"""A chaos campaign: the schema of ``conf/campaign/*.yaml`` and the seeded schedule it makes.

A campaign is a list of faults, each with its kind, when it strikes (after a step, or seconds
into training), its target and how it ends (a thaw after ``duration_s``, a node started again
after ``restart_after_s``). The list is either written out (``faults``) or drawn at random
(``mtbf_s``: exponential gaps at that mean, kinds drawn from ``kinds``) from ``seed``, so that a
campaign can be replayed exactly. Which node a fault hits is decided when it strikes, among the
nodes then up, by a generator seeded from the campaign's seed and the fault's number: the same
campaign on the same job picks the same nodes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from elastic.config import Choice, problem

MAX_RANDOM_FAULTS = 1000  # a random campaign without ``count`` runs until the job ends


class FaultKind(Choice):
    kill_node = "kill_node"  # SIGKILL a node: its agent and every process under it
    kill_worker = "kill_worker"  # SIGKILL one training worker; its agent restarts it
    freeze_node = "freeze_node"  # SIGSTOP a node for duration_s (a hung machine)
    leave_node = "leave_node"  # SIGTERM a node: a planned leave (preemption, drain)
    kill_etcd_member = "kill_etcd_member"  # SIGKILL one etcd member, started again after duration_s
    fill_disk = "fill_disk"  # fill the checkpoint file system for duration_s (campaign.fill_*)
    corrupt_shard = "corrupt_shard"  # flip a byte of the newest committed checkpoint
    # With campaign.netns (each node in a network namespace), for duration_s:
    partition_peers = "partition_peers"  # cut a node off its peers (it still reaches etcd)
    partition_etcd = "partition_etcd"  # cut a node off etcd (it still reaches its peers)
    slow_network = "slow_network"  # rate-limit a node's link to its peers to campaign.slow_mbit
    # Hold a node's workers to 1/campaign.slow_factor of their CPU for duration_s (a cgroup
    # quota where there is one, else stop/continue): a straggler (chaos/cpu_limit.py).
    slow_node = "slow_node"
    # Flip one bit of one parameter in a node's worker (needs chaos.allow=true): the replica
    # check must find it and repair it from the majority.
    corrupt_replica = "corrupt_replica"


SHARED_KINDS = (FaultKind.kill_etcd_member, FaultKind.fill_disk, FaultKind.corrupt_shard)
NETWORK_KINDS = (FaultKind.partition_peers, FaultKind.partition_etcd, FaultKind.slow_network)
TIMED_KINDS = (  # end after duration_s
    FaultKind.freeze_node,
    FaultKind.slow_node,
    *SHARED_KINDS[:2],
    *NETWORK_KINDS,
)


@dataclass
class FaultSpec:
    kind: FaultKind = FaultKind.kill_node
    at_step: int = 0  # strike once training passed this step...
    at_s: float = 0.0  # ...or this many seconds after training started (exactly one of the two)
    # node<K>, rank0, not_rank0 (any up node but rank 0's), any; the shared kinds strike the
    # job's etcd or checkpoints, whatever the target
    target: str = "not_rank0"
    # freeze_node, slow_node, kill_etcd_member, fill_disk, the network kinds: end after this long
    duration_s: float = 5.0
    restart_after_s: float = -1.0  # kill_node, leave_node: started again after this; <0: never
    # slow_node: lifted as soon as the job names the node a straggler, duration_s at the latest,
    # so that the time it takes is measured, whatever the machine's pace
    until_named: bool = False
    # ...and only once the job trains at this many ranks or more (a node struck before is back
    # in): 0, whatever its world size
    min_world: int = 0


@dataclass
class CampaignConfig:
    name: str = "scripted"
    seed: int = 0
    faults: list[FaultSpec] = field(default_factory=list)  # a written-out schedule
    mtbf_s: float = 0.0  # >0: random faults at this mean time between faults, after `faults`
    kinds: list[FaultKind] = field(
        default_factory=lambda: [FaultKind.kill_node, FaultKind.freeze_node, FaultKind.leave_node]
    )
    count: int = 0  # random faults to draw; 0: until the job ends
    target: str = "not_rank0"  # random faults' target
    freeze_s: float = 5.0  # random freezes, etcd member losses and full disks last this long
    restart_after_s: float = 10.0  # randomly killed or stopped nodes come back after this
    etcd_members: int = 1  # members of the campaign's own etcd (3: kill_etcd_member loses one)
    fill_keep_mb: int = 1  # fill_disk leaves this much free
    fill_limit_gb: float = 4.0  # fill_disk refuses a file system with more free (the machine's)
    # Start each node as a bare-metal launcher in a network namespace of its own (root, ip, tc),
    # so that the network kinds can cut or slow its links (chaos/netns.py).
    netns: bool = False
    slow_mbit: float = 300.0  # slow_network's rate
    slow_factor: float = 2.0  # slow_node: its workers get 1/slow_factor of the CPU they used
    out_dir: str = ""  # "" = <run_dir>/chaos
    # Attach to a running job (job_id, cluster.etcd_endpoints, run_dir: where its events are)
    # instead of launching one: faults are requested through etcd (the job needs chaos.allow).
    attach: bool = False


@dataclass
class ChaosCommandConfig:
    """The root of ``python -m chaos``'s own configuration (conf/chaos.yaml)."""

    campaign: CampaignConfig = field(default_factory=CampaignConfig)


TARGETS = "node<K>, rank0, not_rank0 or any"


def problems(c: CampaignConfig, nodes: int) -> list[str]:
    """Every value of the campaign that cannot work, each with the key and the fix."""
    found = []
    for i, f in enumerate(c.faults):
        key = f"campaign.faults[{i}]"
        if (f.at_step > 0) == (f.at_s > 0):
            found.append(
                problem(
                    f"{key}.at_step/at_s",
                    (f.at_step, f.at_s),
                    "a fault needs exactly one moment",
                    "set at_step to a step number or at_s to seconds into training, not both",
                )
            )
        if not target_ok(f.target, nodes):
            found.append(
                problem(
                    f"{key}.target",
                    f.target,
                    f"not a node of this {nodes}-node job",
                    f"use {TARGETS}",
                )
            )
        if f.min_world < 0:
            found.append(
                problem(f"{key}.min_world", f.min_world, "a number of ranks", "set it >= 0")
            )
        if f.until_named and f.kind is not FaultKind.slow_node:
            found.append(
                problem(
                    f"{key}.until_named",
                    True,
                    f"only a slow_node is named by the job, not a {f.kind}",
                    "remove it, or set it on a slow_node",
                )
            )
        if f.kind in TIMED_KINDS and f.duration_s <= 0:
            found.append(
                problem(f"{key}.duration_s", f.duration_s, f"a {f.kind} must end", "set it above 0")
            )
    if c.mtbf_s < 0:
        found.append(problem("campaign.mtbf_s", c.mtbf_s, "a mean time", "set it >= 0 (0: none)"))
    if c.mtbf_s > 0 and not c.kinds:
        found.append(problem("campaign.kinds", [], "nothing to draw from", "list fault kinds"))
    if not target_ok(c.target, nodes):
        found.append(problem("campaign.target", c.target, "not a node", f"use {TARGETS}"))
    if not c.faults and c.mtbf_s == 0:
        found.append(
            problem(
                "campaign.faults",
                [],
                "the campaign has no fault",
                "list faults, or set campaign.mtbf_s for random ones",
            )
        )
    if c.slow_factor <= 1:
        found.append(
            problem(
                "campaign.slow_factor",
                c.slow_factor,
                "a slow node runs slower",
                "set it above 1 (2.0: half speed)",
            )
        )
    if c.etcd_members not in (1, 3):
        found.append(
            problem("campaign.etcd_members", c.etcd_members, "etcd runs 1 or 3 here", "set 1 or 3")
        )
    return found


def target_ok(target: str, nodes: int) -> bool:
    if target in ("rank0", "not_rank0", "any"):
        return True
    return target.startswith("node") and target[4:].isdigit() and int(target[4:]) < nodes


def schedule(c: CampaignConfig) -> list[FaultSpec]:
    """List the campaign's faults: the written ones, then the random ones.

    The written ones come by step, then by time; the random ones by time, each random one drawn
    from ``seed`` alone."""
    written = sorted(c.faults, key=lambda f: (f.at_step == 0, f.at_step, f.at_s))
    if c.mtbf_s <= 0:
        return written
    rng = random.Random(c.seed)
    drawn, t = [], 0.0
    for _ in range(c.count or MAX_RANDOM_FAULTS):
        t += rng.expovariate(1.0 / c.mtbf_s)
        kind = c.kinds[rng.randrange(len(c.kinds))]
        drawn.append(
            FaultSpec(
                kind=kind,
                at_s=round(t, 3),
                target=c.target,
                duration_s=c.freeze_s,
                restart_after_s=c.restart_after_s,
            )
        )
    return written + drawn


def pick(target: str, up: list[str], rank0: str | None, seed: int, number: int) -> str | None:
    """The node fault ``number`` strikes, among the nodes ``up`` now; None if there is none.

    ``up`` is sorted by the caller; the choice depends only on it, the seed and the number.
    """
    if target.startswith("node"):
        return target if target in up else None
    candidates = [n for n in up if target == "any" or (target == "rank0") == (n == rank0)]
    if not candidates:
        return None
    return random.Random(f"{seed}:{number}").choice(candidates)
