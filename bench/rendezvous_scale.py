"""Rendezvous at scale: N simulated nodes running the agents' real rendezvous code against one
real etcd, next to torch's c10d dynamic rendezvous (what torchrun uses) in the same run.

A simulated node is :class:`launcher.rendezvous.Rendezvous`, the agent's code, with its own
lease, keep-alive stream, watches and requests; the nodes are spread over ``--procs`` processes,
and the nodes of one process share one etcd client (one gRPC channel and watch stream). A real
agent has a channel, and a CPU, of its own; on two cores, a channel per simulated node (with its
polling threads) starved the keep-alives from 512 nodes on, and the leases of live nodes
expired. Two of the nodes live alone in processes of their own, so that they can die for real
(SIGKILL). For each N:

- **first round**: from the moment the nodes start to join until every node sees a round with
  all N members;
- **re-form after a silent loss**: one node's process is SIGKILLed (its lease runs out); until
  every survivor sees the round without it;
- **re-form after an eviction**: the other lone node is SIGKILLed and a survivor evicts it at once
  (as one does whose collective failed and whose probe found the agent gone);
- **watch events and bytes per round**, delivered to all the nodes together, in the first round;
- **fencings**: nodes that fenced themselves although alive (false fencings);
- **late keep-alives**: keep-alives that went unanswered for half a lease TTL, each an
  ``etcd_unreachable`` event: the sign that the simulation starves itself (a lease whose
  keep-alives stay late expires, and its live node is fenced).

The peer: the same N as threads calling ``DynamicRendezvousHandler.next_rendezvous()`` of
torch.distributed.elastic over a ``C10dRendezvousBackend`` (one TCPStore), with torch's defaults
(a heartbeat every 5 s, a node dead after 3 missed, a last call of 30 s). Its re-form: a node's
process is SIGKILLed and the survivors call ``next_rendezvous()`` again, as torchrun's agents do
once their workers fail.

    .venv/bin/python bench/rendezvous_scale.py                       # N = 32 ... 1024
    .venv/bin/python bench/rendezvous_scale.py --sizes 32,128 --skip-peer

Once one N does not form its first round within ``--phase-timeout-s``, larger N are not tried
for that runtime, and the table says why.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOSS, EVICT = "lost", "evicted"  # the two nodes that run alone in a process, to die for real


@dataclass
class Result:
    """One runtime at one N; None where a phase did not complete (``why`` says)."""

    first_s: float | None = None
    loss_s: float | None = None
    evict_s: float | None = None
    events: int | None = None
    bytes: int | None = None
    fencings: Counter[str] = field(default_factory=Counter)  # false fencings, by reason
    late: int = 0  # keep-alives unanswered for half a lease TTL
    crashed: int = 0  # simulated agents whose rendezvous call raised
    first_cores: tuple[float, float] | None = None  # cores busy in the first round: nodes, etcd
    idle_cores: tuple[float, float] | None = None  # the same for IDLE_S after it (keep-alives)
    why: str = ""


@dataclass
class Seen:
    """What the nodes reported: by node, the newest round it saw and its member count."""

    rounds: dict[str, tuple[int, int]] = field(default_factory=dict)

    def drain(self, q: Any, timeout: float) -> None:
        with contextlib.suppress(queue.Empty):
            node, number, size = q.get(timeout=timeout)
            self.rounds[node] = max(self.rounds.get(node, (0, 0)), (number, size))
            while True:
                node, number, size = q.get_nowait()
                self.rounds[node] = max(self.rounds.get(node, (0, 0)), (number, size))

    def wait(
        self, q: Any, nodes: list[str], ok: Any, since: float, timeout_s: float
    ) -> float | None:
        """Seconds from ``since`` (wall clock, shared by the processes) until
        ``ok((number, size))`` holds for every node; None past ``since + timeout_s``."""
        while time.time() < since + timeout_s:
            if all(ok(self.rounds.get(n, (0, 0))) for n in nodes):
                return time.time() - since
            self.drain(q, 0.05)
        return None


# --- our rendezvous --------------------------------------------------------------------------


class _Sink:
    """The simulated node's event sink: keeps fencings by reason and counts late keep-alives,
    drops the rest."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.late = 0

    def emit(self, event: str, message: str | None = None, /, **fields: Any) -> None:
        if event == "fenced":
            self.reasons.append(fields.get("reason", "?"))
        elif event == "etcd_unreachable":
            self.late += 1


def ours_process(
    conn: Connection, seen: Any, endpoints: list[str], job_id: str, ids: list[str], ttl: int, n: int
) -> None:
    """Host the simulated nodes ``ids``; obey ``conn``'s commands."""
    from elastic.config import RendezvousConfig
    from launcher.etcd import INSECURE, connect
    from launcher.rendezvous import NodeRecord, Rendezvous

    cfg = RendezvousConfig(lease_ttl_s=ttl)
    sinks = {i: _Sink() for i in ids}
    client = connect(endpoints, security=INSECURE)  # the bench's own plaintext etcd
    nodes: dict[str, Rendezvous] = {}
    crashed = 0

    def follower(node_id: str) -> Any:
        last = [0]

        def on_change() -> None:
            rnd = nodes[node_id].view.round
            if rnd is not None and rnd.number > last[0]:
                last[0] = rnd.number
                seen.put((node_id, rnd.number, len(rnd.members)))

        return on_change

    for i, node_id in enumerate(ids):
        record = NodeRecord(node_id, "127.0.0.1", 1 + i, 1)
        nodes[node_id] = Rendezvous(
            client,
            job_id=job_id,
            node=record,
            cfg=cfg,
            min_nodes=1,
            max_nodes=n,
            events=sinks[node_id],  # type: ignore[arg-type]
            on_change=follower(node_id),
        )

    def join(node_id: str) -> None:
        nonlocal crashed
        try:
            nodes[node_id].join()
            nodes[node_id].set_ready()
        except Exception:  # an agent would crash here: counted, as the table's "crashed"
            crashed += 1

    conn.send("ready")
    while True:
        command, *arg = conn.recv()
        if command == "join":
            with ThreadPoolExecutor(max_workers=min(32, len(ids))) as pool:
                list(pool.map(join, ids))
            conn.send("joined")
        elif command == "evict":
            rdzv = nodes[ids[0]]
            member = rdzv.view.round.member(arg[0]) if rdzv.view.round else None
            conn.send(bool(member) and rdzv.evict(member, "bench: its process was killed"))
        elif command == "stats":
            load = [r.load for r in nodes.values()]
            conn.send(
                (
                    sum(x.watch_events for x in load),
                    sum(x.watch_bytes for x in load),
                    [r for s in sinks.values() for r in s.reasons],
                    crashed,
                    sum(s.late for s in sinks.values()),
                )
            )
        elif command == "stop":
            with ThreadPoolExecutor(max_workers=min(32, len(ids))) as pool:
                list(pool.map(lambda r: r.leave(), nodes.values()))
            conn.send("stopped")
            return


class Hosts:
    """The processes that host the simulated nodes, and the two lone ones."""

    def __init__(self, target: Any, n: int, procs: int, args: tuple[Any, ...]) -> None:
        ctx = mp.get_context("spawn")
        self.seen = ctx.Queue()
        pool = [f"n{i:04d}" for i in range(n - 2)]
        groups = [pool[k::procs] for k in range(procs)] + [[LOSS], [EVICT]]
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for ids in groups:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(theirs, self.seen, *args[:2], ids, *args[2:]))
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        self.nodes = pool + [LOSS, EVICT]

    def ask(self, conns: list[Connection], *command: Any, timeout: float = 600) -> list[Any]:
        for c in conns:
            c.send(command)
        return [c.recv() if c.poll(timeout) else None for c in conns]

    def wait_ready(self, timeout: float) -> None:
        for c in self.conns:
            if not c.poll(timeout):
                raise TimeoutError("a host process did not start its nodes")
            c.recv()

    def alive(self) -> list[Connection]:
        return [c for c, p in zip(self.conns, self.procs, strict=True) if p.is_alive()]

    def kill(self, index: int) -> None:
        os.kill(self.procs[index].pid, signal.SIGKILL)
        self.procs[index].join()

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


class Cores:
    """Cores kept busy by the simulated nodes' processes and by etcd, since the last call: what
    limits how many nodes one machine can simulate."""

    def __init__(self, nodes: list[int], etcd: int) -> None:
        import psutil

        self._procs = [psutil.Process(p) for p in nodes], psutil.Process(etcd)
        self._since = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        def cpu(p: Any) -> float:
            with contextlib.suppress(Exception):  # a host process killed by the bench
                t = p.cpu_times()
                return t.user + t.system
            return 0.0

        nodes, etcd = self._procs
        return time.monotonic(), sum(cpu(p) for p in nodes), cpu(etcd)

    def busy(self) -> tuple[float, float]:
        (t0, n0, e0), (t1, n1, e1) = self._since, self._sample()
        self._since = (t1, n1, e1)
        return (n1 - n0) / (t1 - t0), (e1 - e0) / (t1 - t0)


IDLE_S = 5.0  # how long the idle cost of a formed round is measured


def run_ours(
    endpoints: list[str], etcd_pid: int, n: int, procs: int, ttl: int, timeout_s: float
) -> Result:
    res = Result()
    job_id = f"scale{n}-{uuid.uuid4().hex[:6]}"
    hosts = Hosts(ours_process, n, procs, (endpoints, job_id, ttl, n))
    try:
        hosts.wait_ready(timeout_s)
        seen = Seen()
        pool, lone = hosts.conns[:-2], hosts.conns[-2:]
        cores = Cores([p.pid for p in hosts.procs], etcd_pid)
        t0 = time.time()
        hosts.ask(pool, "join")  # the lone two join last: neither is the leader
        hosts.ask(lone, "join")
        res.first_s = seen.wait(hosts.seen, hosts.nodes, lambda r: r[1] == n, t0, timeout_s)
        res.first_cores = cores.busy()
        if res.first_s is not None:
            seen.wait(hosts.seen, hosts.nodes, lambda r: False, time.time(), IDLE_S)
            res.idle_cores = cores.busy()
        stats = [s for s in hosts.ask(hosts.conns, "stats", timeout=60) if s]
        res.events, res.bytes = sum(s[0] for s in stats), sum(s[1] for s in stats)
        res.fencings, res.crashed = fencings(stats), sum(s[3] for s in stats)
        res.late = sum(s[4] for s in stats)
        if res.first_s is None:
            nodes, etcd = res.first_cores
            res.why = (
                f"no round of all {n} nodes in {timeout_s:.0f} s: the simulation kept "
                f"{nodes + etcd:.1f} of this machine's {os.cpu_count()} cores busy (etcd "
                f"{etcd:.2f}), {res.late} keep-alives went unanswered for half a TTL and "
                f"{res.fencings.total()} live nodes were fenced"
            )
            return res

        number = max(r[0] for r in seen.rounds.values())
        survivors = hosts.nodes[:-2] + [EVICT]
        t1 = time.time()
        hosts.kill(len(hosts.conns) - 2)
        res.loss_s = seen.wait(
            hosts.seen, survivors, lambda r: r[0] > number and r[1] == n - 1, t1, timeout_s
        )
        if res.loss_s is None:
            res.why = f"no round without the lost node in {timeout_s:.0f} s"
        else:
            number = max(seen.rounds[s][0] for s in survivors)
            hosts.kill(len(hosts.conns) - 1)
            t2 = time.time()
            hosts.ask(pool[:1], "evict", EVICT)
            res.evict_s = seen.wait(
                hosts.seen, survivors[:-1], lambda r: r[0] > number and r[1] == n - 2, t2, timeout_s
            )
        stats = [s for s in hosts.ask(pool, "stats", timeout=60) if s]
        res.fencings = fencings(stats)
        res.crashed = max(res.crashed, sum(s[3] for s in stats))
        res.late = max(res.late, sum(s[4] for s in stats))
        hosts.ask(pool, "stop", timeout=120)
        return res
    finally:
        hosts.close()


# --- the peer: torch's c10d dynamic rendezvous -----------------------------------------------


def peer_process(
    conn: Connection, seen: Any, host: str, port: int, ids: list[str], run_id: str, n: int
) -> None:
    """Host torch rendezvous handlers for ``ids``; obey ``conn``'s commands."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no store server per round's rank 0
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    handlers = {}
    for node_id in ids:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=600))
        handlers[node_id] = DynamicRendezvousHandler.from_backend(
            run_id,
            store,
            C10dRendezvousBackend(store, run_id),
            min_nodes=1,
            max_nodes=n,
            local_addr=node_id,
            timeout=RendezvousTimeout(),
        )
    crashed = 0
    rounds = dict.fromkeys(ids, 0)

    def next_round(node_id: str) -> None:
        nonlocal crashed
        try:
            info = handlers[node_id].next_rendezvous()
        except Exception:
            crashed += 1
            return
        rounds[node_id] += 1
        seen.put((node_id, rounds[node_id], info.world_size))

    conn.send("ready")
    threads: list[threading.Thread] = []
    while True:
        command, *_ = conn.recv()
        if command == "join":  # returns at once: the threads report through ``seen``
            threads = [threading.Thread(target=next_round, args=(i,), daemon=True) for i in ids]
            for t in threads:
                t.start()
            conn.send("joining")
        elif command == "stats":
            conn.send((0, 0, [], crashed, 0))
        elif command == "stop":
            conn.send("stopped")
            os._exit(0)  # handlers' heartbeat threads and blocked rendezvous calls end with us


def run_peer(n: int, procs: int, timeout_s: float) -> Result:
    from datetime import timedelta

    from torch.distributed import TCPStore

    res = Result()
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )
    hosts = Hosts(peer_process, n, procs, ("127.0.0.1", server.port, f"scale{n}", n))
    try:
        hosts.wait_ready(timeout_s)
        seen = Seen()
        t0 = time.time()
        hosts.ask(hosts.conns, "join")
        res.first_s = seen.wait(hosts.seen, hosts.nodes, lambda r: r[1] == n, t0, timeout_s)
        if res.first_s is None:
            res.why = f"no round of all {n} nodes in {timeout_s:.0f} s"
        else:
            survivors = hosts.nodes[:-2] + [EVICT]
            t1 = time.time()
            hosts.kill(len(hosts.conns) - 2)
            hosts.ask(hosts.conns[:-2] + hosts.conns[-1:], "join")  # their workers failed
            res.loss_s = seen.wait(
                hosts.seen, survivors, lambda r: r[0] == 2 and r[1] == n - 1, t1, timeout_s
            )
            if res.loss_s is None:
                res.why = f"no round without the lost node in {timeout_s:.0f} s"
        stats = [s for s in hosts.ask(hosts.alive(), "stats", timeout=30) if s]
        res.crashed = sum(s[3] for s in stats)
        return res
    finally:
        with contextlib.suppress(Exception):
            hosts.ask(hosts.alive(), "stop", timeout=10)
        hosts.close()
        del server


# --- the table -------------------------------------------------------------------------------


def fencings(stats: list[tuple[Any, ...]]) -> Counter[str]:
    """The fencings the host processes reported, by reason."""
    return Counter(reason for s in stats for reason in s[2])


def busy(cores: tuple[float, float] | None) -> str:
    return "-" if cores is None else f"{cores[0]:.2f} + {cores[1]:.2f}"


def cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def row(n: int, name: str, r: Result) -> str:
    events = "-" if r.events is None else f"{r.events:,} ({r.events / n:.1f}/node)"
    size = "-" if r.bytes is None else f"{r.bytes / 2**20:.1f} MiB"
    fenced = f"{r.fencings.total()}" + "".join(f"; {k}: {v}" for k, v in r.fencings.items())
    return (
        f"| {n} | {name} | {cell(r.first_s)} | {cell(r.loss_s)} | {cell(r.evict_s)} | {events} "
        f"| {size} | {fenced} | {r.late} | {r.crashed} | {busy(r.first_cores)} "
        f"| {busy(r.idle_cores)} "
        f"| {r.why} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32,128,256,512,1024")
    ap.add_argument("--procs", type=int, default=8, help="host processes for the nodes")
    ap.add_argument("--lease-ttl-s", type=int, default=3, help="ours: rendezvous.lease_ttl_s")
    ap.add_argument("--phase-timeout-s", type=float, default=120.0)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args()
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    from launcher.embedded_etcd import EmbeddedEtcd

    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{os.cpu_count()} cores; N in {sizes}; {args.procs} host processes; "
        f"lease TTL {args.lease_ttl_s} s; each phase bounded by {args.phase_timeout_s:.0f} s"
    )
    print(
        "| N | runtime | first round | re-form, lost | re-form, evicted | watch events, "
        "first round | watch bytes | fencings | late keep-alives | crashed | cores busy, first "
        "round (nodes + etcd) | cores busy, idle round | stopped because |"
    )
    print("| --- " * 13 + "|")
    stopped = {"ours": args.skip_ours, "torch c10d": args.skip_peer}
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EmbeddedEtcd(Path(tmp) / "etcd", Path(tmp) / "etcd.log").start()
        try:
            for n in sizes:
                procs = max(1, min(args.procs, (n - 2) // 2))
                for name in ("ours", "torch c10d"):
                    if stopped[name]:
                        continue
                    r = (
                        run_ours(
                            etcd.endpoints,
                            etcd.members[0].proc.pid,
                            n,
                            procs,
                            args.lease_ttl_s,
                            args.phase_timeout_s,
                        )
                        if name == "ours"
                        else run_peer(n, procs, args.phase_timeout_s)
                    )
                    print(row(n, name, r), flush=True)
                    stopped[name] = r.first_s is None
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
