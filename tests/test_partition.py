"""Network partitions: three bare-metal launchers, each in its own network namespace
(:mod:`chaos.netns`), one node cut off its peers and then off etcd by bringing a real link down,
then slowed down by a rate limit on its link.

Skipped where the host does not allow network namespaces (not root, no ``ip`` or ``tc``)."""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path

import pytest

from chaos import netns
from chaos.injectors import heal, node_with_rank, partition, throttle, unthrottle
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd

from .conftest import FAST_JOB, RESNET18, Gate, output
from .test_e2e import RECORD, assert_invariants, wait_event, wait_exit

WHY_NOT = netns.available()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
NODES = 3
EPOCHS = 8  # 80 steps: the faults cost 45 at most, on any machine (the job waits at the gate)
PG_TIMEOUT_S = 5  # a cut link fails the round's collectives after this long
SLOW_MBIT = 300  # a ResNet-18 step's allreduce then takes seconds, still within PG_TIMEOUT_S
SLOW_STEPS = 3


def start_node(
    net: netns.LocalNetwork, i: int, run_dir: Path, etcd_port: int, gate: Gate
) -> subprocess.Popen[str]:
    """Node ``i``'s launcher, run as on a machine of its own: ``cluster=bare_metal``."""
    argv = net.launcher(
        i,
        etcd_port,
        "job_id=partitioned",
        f"run_dir={run_dir}",
        *FAST_JOB,
        RESNET18,  # SLOW_MBIT slows its all-reduce
        f"trainer.epochs={EPOCHS}",
        f"rendezvous.pg_timeout_s={PG_TIMEOUT_S}",
        RECORD,
    )
    out = open(run_dir.parent / f"node{i}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        argv,
        cwd=run_dir.parent,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **gate.env()},
    )


def test_a_node_cut_off_is_dropped_and_rejoins_once_healed_and_a_slow_one_is_kept(
    tmp_path: Path, gate: Gate
) -> None:
    """Cut off its peers (etcd still reachable), the node's round fails after pg_timeout_s; the
    two others, the majority, evict it, and it fences itself. It joins again only once it
    reaches them (peers_unreachable meanwhile), so it never stalls their rounds. Cut off etcd
    (its peers still reachable), its lease runs out and the others go on without it; it trains
    no step in a round they left, and rejoins when etcd is back. Slowed down (a rate-limited
    link, whose collectives still end within pg_timeout_s), it stays: no eviction, no fencing.
    One history throughout. While the node finds its way back, the others wait at the gate: the
    job is still there to be joined, however fast the machine."""
    run_dir = tmp_path / "run"
    with (
        netns.LocalNetwork(NODES) as net,
        EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log", listen_host="0.0.0.0") as etcd,
    ):
        port = int(etcd.endpoint.rsplit(":", 1)[1])
        nodes = [start_node(net, 0, run_dir, port, gate)]
        # node0's launcher prepares the data before its agent starts; then the others.
        wait_event(run_dir, nodes[0], lambda e: e["event"] == "agent_started")
        nodes += [start_node(net, i, run_dir, port, gate) for i in range(1, NODES)]
        try:
            wait_event(run_dir, nodes[0], lambda e: e["event"] == "step" and e["step"] >= 6)
            rank0 = node_with_rank(run_dir, 0)
            victim = next(i for i in range(NODES) if f"node{i}" != rank0)
            target = f"node{victim}"

            cut = partition(run_dir, net, victim, netns.PEER_LINK)
            try:
                evicted = wait_event(
                    run_dir,
                    nodes[0],
                    lambda e: e["event"] == "peer_evicted" and e["peer"] == target,
                    cut,
                )
                blocked = wait_event(
                    run_dir,
                    nodes[0],
                    lambda e: e["event"] == "peers_unreachable" and e["node"] == target,
                    cut,
                )
                gate.hold_after(0)
            finally:
                healed = heal(run_dir, net, victim, netns.PEER_LINK)
            back = wait_event(
                run_dir,
                nodes[0],
                lambda e: e["event"] == "round_joined" and e["node"] == target,
                healed,
            )
            assert back["world_size"] == NODES
            gate.open()

            cut_etcd = partition(run_dir, net, victim, netns.ETCD_LINK)
            try:
                dropped = wait_event(
                    run_dir,
                    nodes[0],
                    lambda e: e["event"] == "round_formed" and target in e["removed"],
                    cut_etcd,
                )
                wait_event(
                    run_dir,
                    nodes[0],
                    lambda e: e["event"] == "step" and e["round"] == dropped["round"],
                    cut_etcd,
                )
                gate.hold_after(0)
            finally:
                healed_etcd = heal(run_dir, net, victim, netns.ETCD_LINK)
            again = wait_event(
                run_dir,
                nodes[0],
                lambda e: e["event"] == "round_joined" and e["node"] == target,
                healed_etcd,
            )
            assert again["world_size"] == NODES
            gate.open()
            paced = wait_event(
                run_dir,
                nodes[0],
                lambda e: e["event"] == "step" and e["round"] == again["round"],
                healed_etcd,
            )
            wait_event(  # the pace before the slowdown
                run_dir, nodes[0], lambda e: e["event"] == "step" and e["step"] >= paced["step"] + 5
            )

            slow = throttle(run_dir, net, victim, SLOW_MBIT)
            try:
                first = wait_event(run_dir, nodes[0], lambda e: e["event"] == "step", slow)
                wait_event(
                    run_dir,
                    nodes[0],
                    lambda e: e["event"] == "step" and e["step"] >= first["step"] + SLOW_STEPS,
                    slow,
                )
            finally:
                fast = unthrottle(run_dir, net, victim)
            codes = [wait_exit(p, run_dir) for p in nodes]
        finally:
            for p in nodes:
                p.kill()
    assert codes == [0] * NODES, [output(run_dir.parent / f"node{i}") for i in range(NODES)]

    events = assert_invariants(run_dir, epochs=EPOCHS)
    # Cut off its peers: the collectives failed after pg_timeout_s, and the majority evicted it.
    assert evicted["node"] != target and "majority" in evicted["reason"]
    assert PG_TIMEOUT_S - 1 < evicted["ts"] - cut < PG_TIMEOUT_S + 10
    assert blocked["ts"] < healed  # it waited for the network, not placed in a round meanwhile
    placed = [
        e
        for e in events
        if e["event"] == "round_formed" and target in e["added"] and cut < e["ts"] < healed
    ]
    assert placed == []
    # Cut off etcd: dropped by its lease (TTL 2 s here), not by a stall of the others.
    assert dropped["ts"] - cut_etcd < 10
    fenced = [e for e in events if e["event"] == "fenced" and e["node"] == target]
    assert len(fenced) == 2
    # Slowed down, not cut: every step took longer, and nobody took the slow node for dead.
    steps = [e for e in events if e["event"] == "step" and e["round"] == again["round"]]
    gaps = [(a["ts"], b["ts"] - a["ts"], b["ts"]) for a, b in zip(steps, steps[1:], strict=False)]
    before = [gap for _, gap, end in gaps if end < slow]
    during = [gap for start, gap, end in gaps if start >= first["ts"] and end < fast]
    assert len(during) >= SLOW_STEPS
    assert min(during) > 2 * statistics.median(before), (before, during)
    faults = {"round_formed", "peer_evicted", "fenced", "worker_peer_lost", "worker_frozen"}
    assert [e for e in events if e["event"] in faults and slow < e["ts"] < fast + 2] == []
