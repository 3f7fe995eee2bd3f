"""Rendezvous at scale: N simulated nodes running the agents' real rendezvous code against one
real etcd, next to torch's c10d dynamic rendezvous (what torchrun uses) in the same run, twice:
with torchrun's defaults and tuned as a careful user would.

The rows, each labelled in the table with what it ran with:

- **ours**: :class:`launcher.rendezvous.rendezvous.Rendezvous`, the agent's code, with
  ``conf/config.yaml``'s ``rendezvous`` section (lease TTL 3 s, so a keep-alive every 0.75 s;
  settle 1 s): our defaults, not a tuning. ``--lease-ttl-s`` overrides the TTL, and the row
  then says so. ``settle_s`` delays none of the figures below: every round measured either
  reaches ``max_nodes`` or only removes members, and neither waits for membership to settle.
- **torchrun, defaults**: ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend``, built
  as torchrun builds its c10d handler (``create_backend``, then ``create_handler``) with no
  ``--rdzv-conf``: a keep-alive every 5 s, a node dead after 3 missed (15 s), a last call of
  30 s, and rank 0's agent sharing a store with its workers (torchrun's default).
- **torchrun, tuned**: the same as ``bench/torchrun_peer.py``'s ``TUNED`` (the shared
  ``peer_torchrun``'s ``TUNED=1``) runs torchrun: ``--rdzv-conf=last_call_timeout=1,
  keep_alive_interval=1,keep_alive_max_attempt=3`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (its 10 s gloo timeout has no part in a rendezvous): a keep-alive every 1 s, a node dead after
  3 missed (3 s), a last call of 1 s, no shared store. ``create_handler`` makes these
  ``RendezvousTimeout(last_call=1 s)`` (join, close and the 5 s heartbeat *timeout* keep their
  defaults) and ``keep_alive_interval=1, keep_alive_max_attempt=3``; each torch row's label is
  what its handlers report (``handler.settings``).

Clients (``--clients``, the same for every row of a run). A simulated node is a set of threads;
the nodes are spread over ``--procs`` host processes, and two of them live alone in processes
of their own, so that they can die for real (SIGKILL).

- ``per-node`` (the default): every simulated node has its own client, as every real agent
  does: ours its own etcd client (a gRPC channel with its polling threads, its own watch
  stream), torch's its own TCPStore client (a socket, made by torchrun's ``create_backend``).
  This is the arrangement whose figures can be compared, but on a small machine it costs ours
  far more CPU than torch's, so it saturates the cores first: on 2 cores a channel per node
  starved the keep-alives from 512 nodes on, and leases of live nodes expired.
- ``per-process``: the nodes of one process share one client: ours one etcd client, torch's one
  TCPStore client for all rendezvous traffic (state syncs and keep-alives). This lets more nodes
  fit on a small machine, but it is not neutral: gRPC multiplexes concurrent calls over its
  channel, while a TCPStore client holds a lock for each call, so a process's torch handlers
  wait for each other's calls, which a real deployment never does. Read torch's per-process
  figures as a pessimistic bound. The store each torch handler hands to its workers stays its
  own: a ``get`` that waits for a key holds a shared client for the whole wait, so rank 0's
  ``set`` of that very key (the master address, after every round) would wait behind it until
  the read timeout (60 s) failed the ``get``.

For each N and row:

- **first round**: from the moment the nodes start to join until every node sees a round with
  all N members;
- **re-form after a silent loss**: one node's process is SIGKILLed (ours: its lease runs out;
  torch: its keep-alives stop, and the survivors call ``next_rendezvous()`` again, as torchrun's
  agents do once their workers fail); until every survivor sees the round without it;
- **re-form after an eviction** (ours only: torch's rendezvous has no eviction): the other lone
  node is SIGKILLed and a survivor evicts it at once (as one does whose collective failed and
  whose probe found the agent gone);
- **watch events and bytes per round** (ours only), delivered to all the nodes together, in
  the first round;
- **live nodes dropped**: ours, nodes that fenced themselves although alive (false fencings),
  by reason; torch, live nodes that a node's sync removed from the rendezvous for want of a
  heartbeat (torch says so only in a debug message, which the bench counts), and how many
  removals that took (a removed node that is still joining adds itself again);
- **late keep-alives**: ours, keep-alives unanswered for half a lease TTL (each an
  ``etcd_unreachable`` event: the sign that the simulation starves itself); torch, keep-alives
  after the first round that failed (torch logs a warning: not written within the 5 s heartbeat
  timeout, as every keep-alive rewrites the one state key by compare-and-set and loses to the
  others' writes, or refused by the store);
- **cores busy**, first round and the idle round after it (``IDLE_S``, keep-alives only): by
  the nodes' processes, by the server (etcd; for torch the bench process, which serves the
  TCPStore), and by the whole machine, other users included. A phase during which the machine
  had at least ``SATURATED`` of its cores busy is flagged in the row: its figures measure the
  queue for a core, not the rendezvous.

    .venv/bin/python bench/rendezvous_scale.py                       # N = 32 ... 1024
    .venv/bin/python bench/rendezvous_scale.py --sizes 32,128 --skip-peer
    .venv/bin/python bench/rendezvous_scale.py --clients per-process --sizes 512,1024

Once a row does not form its first round at one N within ``--phase-timeout-s``, larger N are
not tried for that row, and the table says why.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchrun_peer import DEFAULTS, TUNED, PeerSettings  # noqa: E402

from elastic import event_types as ev  # noqa: E402
from elastic.event_types import EventType  # noqa: E402

LOSS, EVICT = "lost", "evicted"  # the two nodes that run alone in a process, to die for real
CLIENTS = ("per-node", "per-process")
IDLE_S = 5.0  # how long the idle cost of a formed round is measured: a torch keep-alive period
# A phase during which this share of the machine's cores was busy measured the queue for a
# core: its threads were runnable and waiting, so its figures are not the rendezvous' own.
SATURATED = 0.9


@dataclass(frozen=True)
class Busy:
    """Cores kept busy over one phase (core-seconds per second)."""

    # The window measured (the phase, give or take a few ms). CPU time is counted in 10 ms
    # ticks, so over less than a second the figures below are rough; the table shows the
    # window with every saturated phase.
    seconds: float
    nodes: float  # the simulated nodes' host processes
    server: float  # etcd, or the bench process serving torch's TCPStore
    machine: float  # everything on this machine, other users included

    @property
    def saturated(self) -> bool:
        return self.machine >= SATURATED * (os.cpu_count() or 1)

    def __str__(self) -> str:
        return f"{self.nodes:.2f} + {self.server:.2f} (machine {self.machine:.2f})"


@dataclass
class Result:
    """One row at one N; None where a phase did not complete or does not apply (``why`` says
    which)."""

    first_s: float | None = None
    loss_s: float | None = None
    evict_s: float | None = None
    events: int | None = None
    bytes: int | None = None
    # Live nodes dropped: ours, fencings by reason; torch, removals by node.
    dropped: Counter[str] = field(default_factory=Counter)
    late: int = 0  # late keep-alives (module docstring: each runtime's own sign)
    crashed: int = 0  # simulated agents whose rendezvous call raised
    busy: dict[str, Busy] = field(default_factory=dict)  # by phase
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


class Hosts:
    """The processes that host the simulated nodes, and the two lone ones. ``target`` is called
    as ``target(conn, seen, ids, *args)`` in each."""

    def __init__(self, target: Any, n: int, procs: int, args: tuple[Any, ...]) -> None:
        ctx = mp.get_context("spawn")
        self.seen = ctx.Queue()
        pool = [f"n{i:04d}" for i in range(n - 2)]
        groups = [pool[k::procs] for k in range(procs)] + [[LOSS], [EVICT]]
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for ids in groups:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(theirs, self.seen, ids, *args))
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        self.nodes = pool + [LOSS, EVICT]

    def ask(self, conns: list[Connection], *command: Any, timeout: float = 600) -> list[Any]:
        for c in conns:
            c.send(command)
        return [c.recv() if c.poll(timeout) else None for c in conns]

    def wait_ready(self, timeout: float) -> list[Any]:
        """What each process said once its nodes were built."""
        said = []
        for c in self.conns:
            if not c.poll(timeout):
                raise TimeoutError("a host process did not start its nodes")
            said.append(c.recv())
        return said

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
    """Cores kept busy since the last call, by the simulated nodes' processes, by the server
    and by the whole machine: what limits how many nodes one machine can simulate, and whether
    a phase's figures are the rendezvous' or the machine's."""

    def __init__(self, nodes: list[int], server: int) -> None:
        import psutil

        self._psutil = psutil
        self._procs = [psutil.Process(p) for p in nodes], psutil.Process(server)
        self._since = self._sample()

    def _sample(self) -> tuple[float, float, float, float]:
        def cpu(p: Any) -> float:
            with contextlib.suppress(Exception):  # a host process killed by the bench
                t = p.cpu_times()
                return t.user + t.system
            return 0.0

        nodes, server = self._procs
        t = self._psutil.cpu_times()
        machine = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return time.monotonic(), sum(cpu(p) for p in nodes), cpu(server), machine

    def busy(self) -> Busy:
        before, self._since = self._since, self._sample()
        elapsed = self._since[0] - before[0]
        rates = ((b - a) / elapsed for a, b in zip(before[1:], self._since[1:], strict=True))
        return Busy(elapsed, *rates)


# --- ours ------------------------------------------------------------------------------------


class _Sink:
    """The simulated node's event sink: keeps fencings by reason and counts late keep-alives,
    drops the rest."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.late = 0

    def emit(self, event: EventType, message: str | None = None, /, **fields: Any) -> None:
        if event is ev.FENCED:
            self.reasons.append(fields.get("reason", "?"))
        elif event is ev.ETCD_UNREACHABLE:
            self.late += 1


def ours_process(
    conn: Connection,
    seen: Any,
    ids: list[str],
    endpoints: list[str],
    job_id: str,
    cfg: Any,
    n: int,
    clients: str,
) -> None:
    """Host our simulated nodes ``ids`` with ``cfg`` (a RendezvousConfig); obey ``conn``'s
    commands."""
    from launcher.rendezvous.etcd import INSECURE, connect
    from launcher.rendezvous.membership import NodeRecord
    from launcher.rendezvous.rendezvous import Rendezvous

    sinks = {i: _Sink() for i in ids}
    shared = connect(endpoints, security=INSECURE) if clients == "per-process" else None
    nodes: dict[str, Rendezvous] = {}
    crashed = 0

    def follower(node_id: str) -> Any:
        last = [0]

        def on_change() -> None:
            rnd = nodes[node_id].view.round
            if rnd is not None and rnd.number > last[0]:
                last[0] = rnd.number
                seen.put((node_id, rnd.number, rnd.size))

        return on_change

    for i, node_id in enumerate(ids):
        record = NodeRecord(node_id, "127.0.0.1", 1 + i, 1)
        nodes[node_id] = Rendezvous(
            shared or connect(endpoints, security=INSECURE),  # the bench's own plaintext etcd
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
            nodes[node_id].record.set_ready()
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
            whole = rdzv.whole_round(rdzv.view.round) if rdzv.view.round else None
            member = whole.member(arg[0]) if whole else None
            conn.send(bool(member) and rdzv.evict(member, "bench: its process was killed"))
        elif command == "stats":
            load = [r.load for r in nodes.values()]
            conn.send(
                (
                    sum(x.watch_events for x in load),
                    sum(x.watch_bytes + x.read_bytes for x in load),
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


def ours_label(cfg: Any, ttl_overridden: bool) -> str:
    """What our row ran with, and whether that is ``conf/config.yaml``'s defaults."""
    origin = (
        "TTL from --lease-ttl-s, the rest conf/config.yaml's defaults"
        if ttl_overridden
        else "conf/config.yaml's defaults"
    )
    return (
        f"ours: lease TTL {cfg.lease_ttl_s} s (keep-alive every {cfg.lease_ttl_s / 4:g} s), "
        f"settle {cfg.settle_s:g} s ({origin})"
    )


def run_ours(
    endpoints: list[str],
    etcd_pid: int,
    n: int,
    procs: int,
    cfg: Any,
    clients: str,
    timeout_s: float,
) -> Result:
    res = Result()
    job_id = f"scale{n}-{uuid.uuid4().hex[:6]}"
    hosts = Hosts(ours_process, n, procs, (endpoints, job_id, cfg, n, clients))
    try:
        hosts.wait_ready(timeout_s)
        seen = Seen()
        pool, lone = hosts.conns[:-2], hosts.conns[-2:]
        cores = Cores([p.pid for p in hosts.procs], etcd_pid)
        t0 = time.time()
        hosts.ask(pool, "join")  # the lone two join last: neither is the leader
        hosts.ask(lone, "join")
        res.first_s = seen.wait(hosts.seen, hosts.nodes, lambda r: r[1] == n, t0, timeout_s)
        res.busy["first round"] = cores.busy()
        if res.first_s is not None:
            seen.wait(hosts.seen, hosts.nodes, lambda r: False, time.time(), IDLE_S)
            res.busy["idle"] = cores.busy()
        stats = [s for s in hosts.ask(hosts.conns, "stats", timeout=60) if s]
        res.events, res.bytes = sum(s[0] for s in stats), sum(s[1] for s in stats)
        res.dropped, res.crashed = dropped(stats), sum(s[3] for s in stats)
        res.late = sum(s[4] for s in stats)
        if res.first_s is None:
            res.why = (
                f"no round of all {n} nodes in {timeout_s:.0f} s: {res.late} keep-alives went "
                f"unanswered for half a TTL and {res.dropped.total()} live nodes were fenced"
            )
            return res

        number = max(r[0] for r in seen.rounds.values())
        survivors = hosts.nodes[:-2] + [EVICT]
        t1 = time.time()
        hosts.kill(len(hosts.conns) - 2)
        res.loss_s = seen.wait(
            hosts.seen, survivors, lambda r: r[0] > number and r[1] == n - 1, t1, timeout_s
        )
        res.busy["re-form, lost"] = cores.busy()
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
            res.busy["re-form, evicted"] = cores.busy()
        stats = [s for s in hosts.ask(pool, "stats", timeout=60) if s]
        res.dropped = dropped(stats)
        res.crashed = max(res.crashed, sum(s[3] for s in stats))
        res.late = max(res.late, sum(s[4] for s in stats))
        hosts.ask(pool, "stop", timeout=120)
        return res
    finally:
        hosts.close()


# --- the peer: torch's c10d dynamic rendezvous -----------------------------------------------


@dataclass(frozen=True)
class PeerRow:
    """A torch row: torchrun's c10d rendezvous as ``settings`` run torchrun in the recovery and
    goodput benches (:mod:`torchrun_peer`): its ``--rdzv-conf`` (the last one given, as
    torchrun's parser keeps), and whether rank 0's agent shares the rendezvous store with its
    workers (torchrun's default; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` turns it off)."""

    name: str
    rdzv_conf: str
    share_store: bool

    @classmethod
    def of(cls, settings: PeerSettings) -> PeerRow:
        flag = "--rdzv-conf="
        confs = [a.removeprefix(flag) for a in settings.args if a.startswith(flag)]
        share = settings.env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"
        return cls(settings.name, confs[-1] if confs else "", share)

    def conf(self) -> dict[str, str]:
        """``rdzv_conf`` as torchrun hands it to ``RendezvousParameters``: strings by key."""
        return dict(kv.split("=", 1) for kv in self.rdzv_conf.split(",") if kv)


PEERS = (PeerRow.of(DEFAULTS), PeerRow.of(TUNED))


class _TorchLog(logging.Handler):
    """What torch's handlers say only in their log, counted: keep-alives that failed (warnings)
    and the nodes a sync removed for want of a heartbeat (debug messages, logged only after the
    sync's write won, so each is a removal that took). Kept off the bench's output."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.failed = 0
        self.removed: list[str] = []  # node descriptors, ``addr_pid_localid``

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "failed to send a keep-alive heartbeat" in message:
            self.failed += 1
        elif message.endswith("since they had no heartbeat."):
            self.removed += re.findall(r"'([^']+)'", message.split(" have been removed")[0])


def peer_process(
    conn: Connection,
    seen: Any,
    ids: list[str],
    host: str,
    port: int,
    run_id: str,
    n: int,
    peer: PeerRow,
    clients: str,
) -> None:
    """Host torch rendezvous handlers for ``ids``, built as torchrun builds its c10d handler
    from ``peer``'s settings; obey ``conn``'s commands."""
    if not peer.share_store:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    said = _TorchLog()
    torch_log = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    torch_log.addHandler(said)
    torch_log.setLevel(logging.DEBUG)
    torch_log.propagate = False
    # is_host=False: the bench serves the store; torchrun's agent on the endpoint's host would.
    params = RendezvousParameters(
        "c10d", f"{host}:{port}", run_id, 1, n, "127.0.0.1", is_host=False, **peer.conf()
    )
    shared = create_backend(params)[0] if clients == "per-process" else None
    handlers = {}
    for node_id in ids:
        backend, store = create_backend(params)  # torchrun's c10d handler: a client per agent
        handlers[node_id] = create_handler(store, shared or backend, params)
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

    s = next(iter(handlers.values())).settings
    conn.send(
        f"{peer.name}: keep-alive every {s.keep_alive_interval.total_seconds():g} s, dead after "
        f"{s.keep_alive_max_attempt} missed, last call {s.timeout.last_call.total_seconds():g} s"
        f", {'shared' if peer.share_store else 'no shared'} store"
    )
    threads: list[threading.Thread] = []
    while True:
        command, *_ = conn.recv()
        if command == "join":  # returns at once: the threads report through ``seen``
            threads = [threading.Thread(target=next_round, args=(i,), daemon=True) for i in ids]
            for t in threads:
                t.start()
            conn.send("joining")
        elif command == "stats":
            conn.send((0, 0, said.removed, crashed, said.failed))
        elif command == "stop":
            conn.send("stopped")
            os._exit(0)  # handlers' heartbeat threads and blocked rendezvous calls end with us


def run_peer(
    n: int, procs: int, peer: PeerRow, clients: str, timeout_s: float
) -> tuple[str, Result]:
    """One torch row at ``n``: its label (the settings its handlers reported) and result."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    res = Result()
    label = peer.name
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )
    run_id = f"scale{n}-{uuid.uuid4().hex[:6]}"
    hosts = Hosts(peer_process, n, procs, ("127.0.0.1", server.port, run_id, n, peer, clients))
    try:
        label = hosts.wait_ready(timeout_s)[0]
        seen = Seen()
        cores = Cores([p.pid for p in hosts.procs], os.getpid())
        t0 = time.time()
        hosts.ask(hosts.conns, "join")
        res.first_s = seen.wait(hosts.seen, hosts.nodes, lambda r: r[1] == n, t0, timeout_s)
        res.busy["first round"] = cores.busy()
        if res.first_s is None:
            res.why = f"no round of all {n} nodes in {timeout_s:.0f} s"
        else:
            seen.wait(hosts.seen, hosts.nodes, lambda r: False, time.time(), IDLE_S)
            res.busy["idle"] = cores.busy()
            survivors = hosts.nodes[:-2] + [EVICT]
            t1 = time.time()
            hosts.kill(len(hosts.conns) - 2)
            hosts.ask(hosts.conns[:-2] + hosts.conns[-1:], "join")  # their workers failed
            res.loss_s = seen.wait(
                hosts.seen, survivors, lambda r: r[0] == 2 and r[1] == n - 1, t1, timeout_s
            )
            res.busy["re-form, lost"] = cores.busy()
            if res.loss_s is None:
                res.why = f"no round without the lost node in {timeout_s:.0f} s"
        stats = [s for s in hosts.ask(hosts.alive(), "stats", timeout=30) if s]
        res.crashed = sum(s[3] for s in stats)
        res.late = sum(s[4] for s in stats)
        lost = hosts.procs[-2].pid  # its removal is no false one
        res.dropped = Counter(d for d in dropped(stats).elements() if node_pid(d) != lost)
        return label, res
    finally:
        with contextlib.suppress(Exception):
            hosts.ask(hosts.alive(), "stop", timeout=10)
        hosts.close()
        del server


# --- the table -------------------------------------------------------------------------------


def dropped(stats: list[tuple[Any, ...]]) -> Counter[str]:
    """The drops of live nodes the host processes reported: ours by reason, torch's by node."""
    return Counter(what for s in stats for what in s[2])


def node_pid(descriptor: str) -> int:
    """The process of a torch node descriptor (``addr_pid_localid``)."""
    return int(descriptor.rsplit("_", 2)[1])


def cell(seconds: float | None, applies: bool = True) -> str:
    if not applies:
        return "n/a"
    return "-" if seconds is None else f"{seconds:.2f} s"


def saturation(busy: dict[str, Busy]) -> str:
    """The phases whose figures measured the machine rather than the rendezvous."""
    cores = os.cpu_count()
    hit = [
        f"{phase} ({b.machine:.2f} of {cores} over {b.seconds:.2f} s)"
        for phase, b in busy.items()
        if b.saturated
    ]
    return "SATURATED: " + ", ".join(hit) if hit else "no"


def row(n: int, label: str, clients: str, r: Result, ours: bool) -> str:
    events = "-" if r.events is None else f"{r.events:,} ({r.events / n:.1f}/node)"
    size = "-" if r.bytes is None else f"{r.bytes / 2**20:.1f} MiB"
    if ours:
        fenced = f"{r.dropped.total()}" + "".join(f"; {k}: {v}" for k, v in r.dropped.items())
    else:
        fenced = f"{len(r.dropped)} ({r.dropped.total()} removals)"
    first, idle = (str(r.busy[k]) if k in r.busy else "-" for k in ("first round", "idle"))
    return (
        f"| {n} | {label} | {clients} | {cell(r.first_s)} | {cell(r.loss_s)} "
        f"| {cell(r.evict_s, ours)} | {events if ours else 'n/a'} | {size if ours else 'n/a'} "
        f"| {fenced} | {r.late} | {r.crashed} | {first} | {idle} | {saturation(r.busy)} "
        f"| {r.why} |"
    )


HEADER = (
    "| N | runtime and settings | clients | first round | re-form, lost | re-form, evicted "
    "| watch events, first round | watch bytes | live nodes dropped | late keep-alives | crashed "
    "| cores busy, first round: nodes + server (machine) | cores busy, idle round "
    "| saturated phases | stopped because |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32,128,256,512,1024")
    ap.add_argument("--procs", type=int, default=8, help="host processes for the nodes")
    ap.add_argument(
        "--clients",
        choices=CLIENTS,
        default="per-node",
        help="per-node: each simulated node has its own client (as real agents do); per-process:"
        " the nodes of a host process share one (lighter, but it serializes torch's calls)",
    )
    ap.add_argument(
        "--lease-ttl-s", type=int, help="ours: rendezvous.lease_ttl_s (default conf/config.yaml's)"
    )
    ap.add_argument("--phase-timeout-s", type=float, default=120.0)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args()
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    import yaml

    from elastic.config import RendezvousConfig
    from launcher.rendezvous.embedded_etcd import EmbeddedEtcd

    defaults = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["rendezvous"]
    cfg = RendezvousConfig(**defaults)
    overridden = args.lease_ttl_s is not None and args.lease_ttl_s != cfg.lease_ttl_s
    if overridden:
        cfg = replace(cfg, lease_ttl_s=args.lease_ttl_s)
    ours = ours_label(cfg, overridden)

    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{os.cpu_count()} cores; N in {sizes}; {args.procs} host processes plus 2 lone nodes; "
        f"clients {args.clients} for every row ("
        + (
            "each simulated node its own etcd or TCPStore client, as real agents"
            if args.clients == "per-node"
            else "the nodes of a process share one etcd or TCPStore client; torch's calls then "
            "wait for each other"
        )
        + f"); each phase bounded by {args.phase_timeout_s:.0f} s; a phase with "
        f"{SATURATED:.0%} of the cores busy is flagged SATURATED: its figures are the machine's"
    )
    print(f"rows: {ours}; " + "; ".join(f"{p.name}: --rdzv-conf={p.rdzv_conf!r}" for p in PEERS))
    print(HEADER)
    print("| --- " * HEADER.count(" | ") + "| --- |")
    rows = ([] if args.skip_ours else ["ours"]) + ([] if args.skip_peer else list(PEERS))
    stopped: set[Any] = set()
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EmbeddedEtcd(Path(tmp) / "etcd", Path(tmp) / "etcd.log").start()
        try:
            for n in sizes:
                procs = max(1, min(args.procs, (n - 2) // 2))
                for which in rows:
                    if which in stopped:
                        continue
                    if isinstance(which, PeerRow):
                        label, r = run_peer(n, procs, which, args.clients, args.phase_timeout_s)
                    else:
                        label = ours
                        r = run_ours(
                            etcd.endpoints,
                            etcd.members[0].proc.pid,
                            n,
                            procs,
                            cfg,
                            args.clients,
                            args.phase_timeout_s,
                        )
                    print(row(n, label, args.clients, r, which == "ours"), flush=True)
                    if r.first_s is None:
                        stopped.add(which)
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
