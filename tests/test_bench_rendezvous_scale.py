"""The rendezvous-scale bench: its pure parts (the torch rows' settings taken from the torchrun
peer's, what torch's log says about keep-alives and removals, the saturation flag and the
figures it withholds, the rounds the nodes report), and its simulated nodes (bench/sim_nodes.py)
against a real etcd beside real nodes: they do and see what a real node that does not lead
does."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import time
from collections import Counter

from elastic.config import RendezvousConfig

from .conftest import REPO, load_bench

sys.path.insert(0, str(REPO / "bench"))  # the bench imports torchrun_peer as its neighbour
bench = load_bench("rendezvous_scale")


def test_torch_rows_run_torchrun_peer_settings() -> None:
    defaults, tuned = bench.PEERS
    assert (defaults.rdzv_conf, defaults.share_store, defaults.conf()) == ("", True, {})
    assert not tuned.share_store
    assert tuned.conf() == {
        "last_call_timeout": "1",
        "keep_alive_interval": "1",
        "keep_alive_max_attempt": "3",
    }
    # torchrun keeps the last --rdzv-conf given
    twice = bench.PeerSettings("x", {}, ["--rdzv-conf=a=1", "--nnodes=2", "--rdzv-conf=b=2"])
    assert bench.PeerRow.of(twice).conf() == {"b": "2"}


def _record(message: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("torch", level, __file__, 0, message, None, None)


def test_torch_log_counts_failed_keep_alives_and_removed_nodes() -> None:
    said = bench._TorchLog()
    said.emit(
        _record(
            "The node 'x_1_0' has failed to send a keep-alive heartbeat to the rendezvous 'r' "
            "due to an error of type RendezvousTimeoutError.",
            logging.WARNING,
        )
    )
    said.emit(
        _record(
            "As part of the sync operation the node(s) '127.0.0.1_4242_3', '127.0.0.1_77_0' have "
            "been removed from the rendezvous 'scale32-ab' since they had no heartbeat.",
            logging.DEBUG,
        )
    )
    said.emit(_record("Detected dead node '127.0.0.1_9_1', removing it", logging.DEBUG))
    assert said.failed == 1
    assert said.removed == ["127.0.0.1_4242_3", "127.0.0.1_77_0"]
    assert [bench.node_pid(d) for d in said.removed] == [4242, 77]
    assert bench.node_pid("my_host_name_12_5") == 12  # an address may hold underscores


def test_saturation_names_the_phases_with_the_machine_busy() -> None:
    cores = os.cpu_count() or 1
    quiet = bench.Busy(2.0, 0.1 * cores, 0.0, 0.5 * cores)
    busy = bench.Busy(0.3, 0.5 * cores, 0.1, 0.95 * cores)
    assert bench.saturation({"first round": quiet}) == "no"
    flag = bench.saturation({"first round": busy, "idle": quiet})
    assert flag.startswith("SATURATED: first round (") and "over 0.30 s" in flag
    assert "idle" not in flag


def test_a_saturated_phase_gives_no_time_and_a_crash_is_named() -> None:
    cores = os.cpu_count() or 1
    r = bench.Result(first_s=0.5, loss_s=3.1)
    r.busy["first round"] = bench.Busy(0.5, 0.95 * cores, 0.0, 0.95 * cores)
    r.busy["re-form, lost"] = bench.Busy(3.1, 0.1, 0.1, 0.3)
    assert bench.cell(r, "first round", r.first_s) == "saturated"
    assert bench.cell(r, "re-form, lost", r.loss_s) == "3.10 s"
    assert bench.cell(r, "rejoin", None) == "-"
    assert bench.cell(r, "re-form, evicted", 0.1, applies=False) == "n/a"
    assert bench.crashes(r) == "0"
    r.crashed = Counter({"DistStoreError: wait timeout": 2, "RendezvousTimeoutError: x": 1})
    assert bench.crashes(r) == "3 (DistStoreError: wait timeout)"


def test_a_round_counts_from_when_its_last_node_saw_it_and_a_rejoined_node_anew() -> None:
    q: queue.Queue = queue.Queue()
    seen, t = bench.Seen(), time.time()
    q.put(("a", 1, 2, t + 0.25))
    q.put(("b", 1, 2, t + 0.75))
    assert seen.wait(q, ["a", "b"], lambda r: r[1] == 2, t, 60) == 0.75
    q.put(("a", 1, 2, t + 1.0))  # told again: the first sight counts
    seen.drain(q, 0.01)
    assert seen.at["a"] == t + 0.25
    base = dict(seen.rounds)  # b comes back anew and reports its first round again
    q.put(("b", 1, 2, t + 2.0))
    assert seen.wait(q, ["b"], lambda r: True, time.time(), 0.3, base) is None
    seen.forget("b")
    assert seen.wait(q, ["b"], lambda r: True, time.time(), 0.2) is None  # nothing said yet
    q.put(("b", 1, 2, t + 3.0))
    assert seen.wait(q, ["b"], lambda r: True, t + 2.5, 60) == 0.5


def test_simulated_nodes_do_and_see_what_a_real_follower_does(
    make, etcd_endpoint: str, job_id: str
) -> None:
    """Four simulated nodes in one round with two real ones: each costs etcd what the real
    follower costs (requests besides keep-alives, watch events), reads about as many bytes,
    keeps its lease, and fences itself when a peer evicts it."""
    sim = load_bench("sim_nodes")
    from launcher.rendezvous.keys import JobKeys

    wait_for_all = RendezvousConfig(lease_ttl_s=2, settle_s=0.3, first_round_wait_s=30)
    leader = make("lead", max_nodes=6, cfg=wait_for_all)
    assert leader.wait(lambda v: v.leader != "", timeout=5)  # the others join a led job
    follower = make("real", max_nodes=6, cfg=wait_for_all)
    seen: dict[str, tuple[int, int]] = {}

    async def run() -> tuple[dict, dict]:
        fleet = sim.Fleet(
            etcd_endpoint,
            JobKeys("/elastic", job_id),
            ["sim0", "sim1", "sim2", "sim3"],
            2,
            30.0,
            lambda node, number, size: seen.__setitem__(node, (number, size)),
        )
        fleet.start()
        await fleet.join_all()
        deadline = time.monotonic() + 10
        while len(seen) < 4 or any(s != (1, 6) for s in seen.values()):
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.02)
        await asyncio.sleep(2.5)  # past a TTL: every lease kept
        first = {
            n.node_id: (n.requests, n.watch_events, n.watch_bytes + n.read_bytes)
            for n in fleet.nodes.values()
        }
        real = follower.load
        first["real"] = (real.requests, real.watch_events, real.watch_bytes + real.read_bytes)
        assert not any(n.fenced for n in fleet.nodes.values())
        assert sum(n.keepalives for n in fleet.nodes.values()) >= 4 * 4
        whole = leader.whole_round(leader.view.round)
        assert whole is not None and leader.evict(whole.member("sim2"), "test")
        while fleet.nodes["sim0"].round_seen < 2 or not fleet.nodes["sim2"].fenced:
            assert time.monotonic() < deadline + 10
            await asyncio.sleep(0.02)
        fenced = {n.node_id: n.fenced for n in fleet.nodes.values()}
        await fleet.close()
        return first, fenced

    first, fenced = asyncio.run(run())
    requests, events, size = first.pop("real")
    for sim_requests, sim_events, sim_size in first.values():
        assert (sim_requests, sim_events) == (requests, events)
        assert abs(sim_size - size) < 20  # its id and port are as long as the real one's
    assert fenced == {"sim0": "", "sim1": "", "sim2": sim.EVICTED, "sim3": ""}
    assert seen["sim0"] == (2, 5)
    gone = follower.wait(lambda v: v.round is not None and v.round.size == 2, timeout=10)
    assert gone is not None, "the simulated nodes left: their leases were revoked"
