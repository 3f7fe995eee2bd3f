"""Rendezvous at scale: N nodes against one real etcd, next to torch's c10d rendezvous.

The leader and two nodes that die run the agents' real rendezvous code, the others simulated as
``--clients`` says. Torch's c10d dynamic rendezvous (what torchrun uses) runs in the same run,
twice: with torchrun's defaults and tuned as a careful user would.

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

Clients (``--clients``; torch's rows run ``per-node`` unless ``per-process`` is asked):

- ``async`` (the default): the node that leads and the two lone nodes run the agents' real
  code, each in a process of its own; the other N - 3 are simulated (:mod:`sim_nodes`), many to
  a host process on one asyncio loop and one gRPC channel, each with its own lease, its own
  registration and watches, and its own reads, doing with etcd what a real node that does not
  lead does. A real node's client costs a 2-core machine more than etcd does for that node;
  these cost about 1.3 ms of CPU a node to join, and 1,024 of them at rest 0.36 of a core.
- ``per-node``: every simulated node runs the real code with its own client: ours its own etcd
  client (a gRPC channel with its threads, its own watch stream), torch's its own TCPStore
  client (a socket, made by torchrun's ``create_backend``). On 2 cores this saturates from 512
  nodes on, and leases of live nodes expire.
- ``per-process``: the real code, the nodes of one process sharing one client: ours one etcd
  client, torch's one TCPStore client for all rendezvous traffic. Not neutral: gRPC multiplexes
  concurrent calls over its channel, while a TCPStore client holds a lock for each call, so a
  process's torch handlers wait for each other's calls, which a real deployment never does.
  The store each torch handler hands to its workers stays its own.

For each N and row:

- **first round**: ours: N - 1 nodes join at once (the first one leads), and once the machine is
  quiet again (``QUIET``) the last one joins: from its join until every node sees a round with
  all N (by when each node reports it), the leader's reaction, its proposal, etcd's fan-out and
  each node's read of its own member key, which a burst of joins on 2 cores would inflate; the
  burst (until the last of the N - 1 is ready) is shown apart. torch: all N call
  ``next_rendezvous()`` at once (a round that waited for a late node would close at the last
  call without it, as ``min_nodes`` is 1), until every node has the round;
- **re-form after a silent loss**: one node's process is SIGKILLed (ours: its lease runs out;
  torch: its keep-alives stop, and the survivors call ``next_rendezvous()`` again, as torchrun's
  agents do once their workers fail); until every survivor sees the round without it;
- **re-form after an eviction** (ours only: torch's rendezvous has no eviction): the other lone
  node is SIGKILLed and a survivor evicts it at once (as one does whose collective failed and
  whose probe found the agent gone);
- **rejoin**: the lost node comes back (ours: both lone nodes, so that the round reaches
  ``max_nodes`` and no settle time applies; torch: the lost one, while every survivor asks
  ``num_nodes_waiting()`` every ``MONITOR_S`` as torchrun's agent does); until every node sees
  the round with all N;
- **etcd requests, watch events and bytes a node** (ours only), first round and loss re-form:
  requests besides keep-alives (a watch created counts as one), the watch events delivered,
  and the bytes of the watch events' keys and values and of the member keys each node read;
- **server CPU a round**: etcd's core-milliseconds over the phase (torch: the bench process,
  which serves the TCPStore); **leader CPU**: the leading node's process over the phase;
- **live nodes dropped**: ours, nodes that fenced themselves although alive (false fencings),
  by reason; torch, live nodes that a node's sync removed from the rendezvous for want of a
  heartbeat (torch says so only in a debug message, which the bench counts), and how many
  removals that took (a removed node that is still joining adds itself again);
- **late keep-alives**: ours, keep-alives unanswered for half a lease TTL (each an
  ``etcd_unreachable`` event: the sign that the simulation starves itself); torch, keep-alives
  after the first round that failed (torch logs a warning);
- **crashed**: rendezvous calls that raised, with the most common error;
- **cores busy**, first round and the idle round after it (``IDLE_S``, keep-alives only): by
  the nodes' processes, by the server, and by the whole machine, other users included. A phase
  during which the machine had at least ``SATURATED`` of its cores busy measured the queue for
  a core, not the rendezvous: its time is not reported ("saturated"), and the row names it.

    .venv/bin/python bench/rendezvous_scale.py                       # N = 128 ... 1024
    .venv/bin/python bench/rendezvous_scale.py --sizes 32,128 --skip-peer
    .venv/bin/python bench/rendezvous_scale.py --clients per-node --sizes 128,256

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
from collections.abc import Callable
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
MONITOR_S = 0.1  # torchrun's --monitor-interval default: its agent's look at the rendezvous
LEADER = "leader"  # with --clients async: the real node that leads, alone in its process
CLIENTS = ("async", "per-node", "per-process")
SAMPLE_S = 0.1  # how often the cores busy are sampled
QUIET, QUIET_S = 0.6, 0.5  # the machine is quiet again: under this share of its cores, this long
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
    """One row at one N.

    A figure is None where a phase did not complete or does not apply (``why`` says which)."""

    first_s: float | None = None
    join_s: float | None = None  # ours: N - 1 nodes joining at once, until the last is ready
    loss_s: float | None = None
    evict_s: float | None = None
    rejoin_s: float | None = None
    load: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # by phase: Load.take
    leader: dict[str, float] = field(default_factory=dict)  # ours: the leader's CPU s, by phase
    # Live nodes dropped: ours, fencings by reason; torch, removals by node.
    dropped: Counter[str] = field(default_factory=Counter)
    late: int = 0  # late keep-alives (module docstring: each runtime's own sign)
    crashed: Counter[str] = field(default_factory=Counter)  # rendezvous calls that raised, by what
    busy: dict[str, Busy] = field(default_factory=dict)  # by phase
    why: str = ""


@dataclass
class Seen:
    """What the nodes reported: by node, the newest round it saw and its member count, and when.

    The time is when it first saw that (wall clock, shared by the processes)."""

    rounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    at: dict[str, float] = field(default_factory=dict)

    def drain(self, q: Any, timeout: float) -> None:
        with contextlib.suppress(queue.Empty):
            self._add(*q.get(timeout=timeout))
            while True:
                self._add(*q.get_nowait())

    def forget(self, node: str) -> None:
        """A node that comes back as a new process: its count starts anew."""
        self.rounds.pop(node, None)
        self.at.pop(node, None)

    def _add(self, node: str, number: int, size: int, t: float) -> None:
        if (number, size) > self.rounds.get(node, (0, 0)):
            self.rounds[node], self.at[node] = (number, size), t

    def wait(
        self,
        q: Any,
        nodes: list[str],
        ok: Any,
        since: float,
        timeout_s: float,
        base: dict[str, tuple[int, int]] | None = None,
    ) -> float | None:
        """Seconds from ``since`` until ``ok((number, size))`` held for every node.

        It counts until the last of them reported it, for a report other than its ``base`` one when
        given; None past ``since + timeout_s``."""
        base = base or {}

        def done(node: str) -> bool:
            now = self.rounds.get(node)
            return now is not None and ok(now) and (node not in base or now != base[node])

        while time.time() < since + timeout_s:
            if all(done(n) for n in nodes):
                return max(self.at[n] for n in nodes) - since
            self.drain(q, 0.05)
        return None


class Hosts:
    """The processes that host the simulated nodes.

    ``groups`` holds ``(target, ids, args)``, each called as ``target(conn, seen, ids, *args)`` in a
    process of its own. The last two are the lone nodes, which die for real (SIGKILL) and come back
    (:meth:`restart`)."""

    def __init__(self, groups: list[tuple[Any, list[str], tuple[Any, ...]]]) -> None:
        self._ctx = mp.get_context("spawn")
        self.seen = self._ctx.Queue()
        self.groups = groups
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for index in range(len(groups)):
            self._spawn(index)
        self.nodes = [i for _, ids, _ in groups for i in ids]

    @classmethod
    def spread(cls, target: Any, n: int, procs: int, args: tuple[Any, ...]) -> Hosts:
        """``n - 2`` nodes over ``procs`` processes, and the two lone ones, all ``target``'s."""
        pool = [f"n{i:04d}" for i in range(n - 2)]
        groups = [pool[k::procs] for k in range(procs)] + [[LOSS], [EVICT]]
        return cls([(target, ids, args) for ids in groups])

    def _spawn(self, index: int) -> None:
        target, ids, args = self.groups[index]
        mine, theirs = self._ctx.Pipe()
        p = self._ctx.Process(target=target, args=(theirs, self.seen, ids, *args))
        p.start()
        if index < len(self.conns):
            self.conns[index], self.procs[index] = mine, p
        else:
            self.conns.append(mine)
            self.procs.append(p)

    def restart(self, index: int, timeout: float) -> Any:
        """Start group ``index`` again (a killed lone node rejoins); what it said once ready."""
        self._spawn(index)
        if not self.conns[index].poll(timeout):
            raise TimeoutError("a restarted host process did not start its nodes")
        return self.conns[index].recv()

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


def cpu_seconds(proc: Any) -> float:
    """A process's CPU time so far (user and system), from its ``psutil.Process``."""
    t = proc.cpu_times()
    return t.user + t.system


class Cores:
    """Cores kept busy by the simulated nodes' processes, by the server and by the whole machine.

    The nodes' processes are ``pids()``, which changes as lone nodes die and come back. This is
    what limits how many nodes one machine can simulate, and whether a phase's figures are the
    rendezvous' or the machine's. Sampled every ``SAMPLE_S`` by a thread, so that any window's share
    can be read afterwards (:meth:`window`), such as a round's formation known only from the nodes'
    reports."""

    def __init__(self, pids: Callable[[], list[int]], server: int) -> None:
        import psutil

        self._psutil, self._pids, self._server = psutil, pids, server
        self._procs: dict[int, Any] = {}
        self._samples = [self._sample()]
        self._mark = self._samples[0][0]
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._samples.append(self._sample())

    def _cpu(self, pid: int) -> float | None:
        with contextlib.suppress(Exception):  # a host process killed by the bench
            return cpu_seconds(self._procs.setdefault(pid, self._psutil.Process(pid)))
        return None

    def _sample(self) -> tuple[float, dict[int, float], float, float]:
        nodes = {pid: cpu for pid in self._pids() if (cpu := self._cpu(pid)) is not None}
        t = self._psutil.cpu_times()
        machine = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return time.time(), nodes, self._cpu(self._server) or 0.0, machine

    def window(self, t0: float, t1: float) -> Busy:
        """The cores busy between wall times ``t0`` and ``t1``, from the samples around them.

        A process that died meanwhile counts up to its last sample, one that started from 0."""
        self._samples.append(self._sample())
        before = max((x for x in self._samples if x[0] <= t0), key=lambda x: x[0])
        after = min((x for x in self._samples if x[0] >= t1), key=lambda x: x[0])
        elapsed = max(after[0] - before[0], 1e-6)
        nodes = sum(cpu - before[1].get(pid, 0.0) for pid, cpu in after[1].items())
        gone = [pid for pid in before[1] if pid not in after[1]]
        last = {pid: max(x[1].get(pid, 0.0) for x in self._samples) for pid in gone}
        nodes += sum(last[pid] - before[1][pid] for pid in gone)
        server, machine = after[2] - before[2], after[3] - before[3]
        return Busy(elapsed, nodes / elapsed, server / elapsed, machine / elapsed)

    def quiet(self, timeout_s: float) -> bool:
        """Wait until the machine has been below ``QUIET`` of its cores busy for ``QUIET_S``.

        Then the work a burst queued is done. False past ``timeout_s``."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            now = time.time()
            if self.window(now - QUIET_S, now).machine < QUIET * (os.cpu_count() or 1):
                return True
            time.sleep(SAMPLE_S)
        return False

    def busy(self) -> Busy:
        """The cores busy since the previous call."""
        now = time.time()
        busy, self._mark = self.window(self._mark, now), now
        return busy

    def stop(self) -> None:
        self._stop.set()


class Spent:
    """One process's CPU seconds since the previous :meth:`take` (0 once it is gone)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self._last = cpu_seconds(self._proc)

    def take(self) -> float:
        now = self._last
        with contextlib.suppress(Exception):  # gone: nothing more spent
            now = cpu_seconds(self._proc)
        spent, self._last = now - self._last, now
        return spent


class Load:
    """What the nodes cost etcd over each phase, summed over every live host process.

    The cost is requests, watch events and bytes (the watch events' and the member keys each node
    read). A process killed with its node takes that node's count with it: a node's share, not the
    figure."""

    def __init__(self, hosts: Hosts) -> None:
        self._hosts = hosts
        self._last: dict[int, tuple[int, int, int]] = {}

    def take(self) -> tuple[int, int, int]:
        alive = self._hosts.alive()
        said = self._hosts.ask(alive, "stats", timeout=60)
        delta = [0, 0, 0]
        for conn, stats in zip(alive, said, strict=True):
            if not stats:
                continue
            pid = self._hosts.procs[self._hosts.conns.index(conn)].pid
            now = tuple(stats[:3])
            before = self._last.get(pid, (0, 0, 0))
            delta = [d + a - b for d, a, b in zip(delta, now, before, strict=True)]
            self._last[pid] = now
        return delta[0], delta[1], delta[2]


# --- ours ------------------------------------------------------------------------------------


class _Sink:
    """The simulated node's event sink.

    It keeps fencings by reason and counts late keep-alives, and drops the rest."""

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
    """Host our simulated nodes ``ids`` with ``cfg`` (a RendezvousConfig).

    It obeys ``conn``'s commands."""
    from launcher.rendezvous.etcd import INSECURE, connect
    from launcher.rendezvous.membership import NodeRecord
    from launcher.rendezvous.rendezvous import Rendezvous

    sinks = {i: _Sink() for i in ids}
    shared = connect(endpoints, security=INSECURE) if clients == "per-process" else None
    nodes: dict[str, Rendezvous] = {}
    crashed: list[str] = []  # what the rendezvous calls that raised said

    def follower(node_id: str) -> Any:
        last = [0]

        def on_change() -> None:
            rnd = nodes[node_id].view.round
            if rnd is not None and rnd.number > last[0]:
                last[0] = rnd.number
                seen.put((node_id, rnd.number, rnd.size, time.time()))

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
        try:
            nodes[node_id].join()
            nodes[node_id].record.set_ready()
        except Exception as exc:  # an agent would crash here: the table's "crashed"
            crashed.append(crash(exc))

    conn.send("ready")
    while True:
        command, *arg = conn.recv()
        if command == "join":
            with ThreadPoolExecutor(max_workers=min(32, len(ids))) as pool:
                list(pool.map(join, ids))
            conn.send(time.time())  # when its last node said it was ready
        elif command == "evict":
            rdzv = nodes[ids[0]]
            whole = rdzv.whole_round(rdzv.view.round) if rdzv.view.round else None
            member = whole.member(arg[0]) if whole else None
            conn.send(bool(member) and rdzv.evict(member, "bench: its process was killed"))
        elif command == "stats":
            load = [r.load for r in nodes.values()]
            conn.send(
                (
                    sum(x.requests for x in load),
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


def sim_process(
    conn: Connection, seen: Any, ids: list[str], endpoints: list[str], job_id: str, cfg: Any
) -> None:
    """Host simulated nodes ``ids``; obey ``conn``'s commands as :func:`ours_process` does.

    The nodes are those of :mod:`sim_nodes`: many on one loop and one channel, each with its
    own lease and watches."""
    import asyncio

    from sim_nodes import Fleet

    from launcher.rendezvous.keys import JobKeys

    async def serve() -> None:
        fleet = Fleet(
            endpoints[0],
            JobKeys(cfg.prefix, job_id),
            ids,
            cfg.lease_ttl_s,
            cfg.resync_s,
            lambda node, number, size: seen.put((node, number, size, time.time())),
        )
        fleet.start()
        conn.send("ready")
        while True:
            command, *_ = await asyncio.to_thread(conn.recv)
            if command == "join":
                await fleet.join_all()
                conn.send(max(n.ready_at for n in fleet.nodes.values()))
            elif command == "stats":
                requests, events, size, reasons, late = fleet.stats()
                conn.send((requests, events, size, reasons, [], late))
            elif command == "stop":
                await fleet.close()
                conn.send("stopped")
                return

    asyncio.run(serve())


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
    real = (endpoints, job_id, cfg, n, clients)
    if clients == "async":  # a real node leads, the pool is simulated, the lone two are real
        pool = [f"n{i:04d}" for i in range(n - 3)]
        groups = [(ours_process, [LEADER], (endpoints, job_id, cfg, n, "per-node"))]
        groups += [(sim_process, pool[k::procs], (endpoints, job_id, cfg)) for k in range(procs)]
        hosts = Hosts(groups + [(ours_process, [LOSS], real), (ours_process, [EVICT], real)])
    else:
        hosts = Hosts.spread(ours_process, n, procs, real)
    cores = Cores(lambda: [p.pid for p in hosts.procs], etcd_pid)
    try:
        hosts.wait_ready(timeout_s)
        seen = Seen()
        pool_conns, lone = hosts.conns[:-2], hosts.conns[-2:]
        load = Load(hosts)
        leads = Spent(hosts.procs[0].pid)  # the first node leads
        cores.busy()  # the phases count from here, not from the processes' start
        # N - 1 nodes join at once, the first one leading; the round waits for the last one,
        # which joins once the burst's work is done: the first round is the rendezvous' own
        # time, from the last node's join until every node is in the round.
        t0 = time.time()
        readies = hosts.ask(pool_conns[:1], "join")
        readies += hosts.ask(pool_conns[1:], "join")
        readies += hosts.ask(lone[:1], "join")
        res.join_s = max(float(t) for t in readies if t) - t0
        res.busy["joining"] = cores.busy()
        cores.quiet(timeout_s)
        cores.busy()
        t1 = time.time()
        hosts.ask(lone[1:], "join")
        res.first_s = seen.wait(hosts.seen, hosts.nodes, lambda r: r[1] == n, t1, timeout_s)
        res.busy["first round"] = cores.busy()
        res.load["first round"] = load.take()
        res.leader["first round"] = leads.take()
        if res.first_s is None:
            res.why = f"no round of all {n} nodes in {timeout_s:.0f} s"
            return res
        seen.wait(hosts.seen, hosts.nodes, lambda r: False, time.time(), IDLE_S)
        res.busy["idle"] = cores.busy()
        res.load["idle"] = load.take()
        leads.take()

        number = max(r[0] for r in seen.rounds.values())
        survivors = hosts.nodes[:-2] + [EVICT]
        t1 = time.time()
        hosts.kill(len(hosts.conns) - 2)
        res.loss_s = seen.wait(
            hosts.seen, survivors, lambda r: r[0] > number and r[1] == n - 1, t1, timeout_s
        )
        res.busy["re-form, lost"] = cores.busy()
        res.load["re-form, lost"] = load.take()
        res.leader["re-form, lost"] = leads.take()
        if res.loss_s is None:
            res.why = f"no round without the lost node in {timeout_s:.0f} s"
            return res
        number = max(seen.rounds[s][0] for s in survivors)
        hosts.kill(len(hosts.conns) - 1)
        t2 = time.time()
        hosts.ask(pool_conns[:1], "evict", EVICT)
        res.evict_s = seen.wait(
            hosts.seen, survivors[:-1], lambda r: r[0] > number and r[1] == n - 2, t2, timeout_s
        )
        res.busy["re-form, evicted"] = cores.busy()
        res.load["re-form, evicted"] = load.take()
        if res.evict_s is None:
            res.why = f"no round without the evicted node in {timeout_s:.0f} s"
            return res
        number = max(seen.rounds[s][0] for s in survivors[:-1])
        for index in (len(hosts.conns) - 2, len(hosts.conns) - 1):
            hosts.restart(index, timeout_s)
        t3 = time.time()
        hosts.ask(hosts.conns[-2:], "join")  # both come back: the round reaches max_nodes
        res.rejoin_s = seen.wait(
            hosts.seen, hosts.nodes, lambda r: r[0] > number and r[1] == n, t3, timeout_s
        )
        res.busy["rejoin"] = cores.busy()
        res.load["rejoin"] = load.take()
        if res.rejoin_s is None:
            res.why = f"no round with the two nodes back in {timeout_s:.0f} s"
        return res
    finally:
        cores.stop()
        stats = [s for s in hosts.ask(hosts.alive(), "stats", timeout=60) if s]
        res.dropped = dropped(stats)
        res.crashed = Counter(c for s in stats for c in s[4])
        res.late = sum(s[5] for s in stats)
        with contextlib.suppress(Exception):
            hosts.ask(hosts.alive(), "stop", timeout=120)
        hosts.close()


# --- the peer: torch's c10d dynamic rendezvous -----------------------------------------------


@dataclass(frozen=True)
class PeerRow:
    """A torch row: torchrun's c10d rendezvous as ``settings`` run torchrun in other benches.

    Those are the recovery and goodput benches (:mod:`torchrun_peer`). The settings are its
    ``--rdzv-conf`` (the last one given, as torchrun's parser keeps), and whether rank 0's agent
    shares the rendezvous store with its workers (torchrun's default;
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` turns it off)."""

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
    """Count what torch's handlers say only in their log, and keep it off the bench's output.

    It counts keep-alives that failed (warnings) and the nodes a sync removed for want of a
    heartbeat (debug messages, logged only after the sync's write won, so each is a removal that
    took)."""

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
    """Host torch rendezvous handlers for ``ids``; obey ``conn``'s commands.

    The handlers are built as torchrun builds its c10d handler, from ``peer``'s settings."""
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
    crashed: list[str] = []  # what the rendezvous calls that raised said
    rounds = dict.fromkeys(ids, 0)

    def next_round(node_id: str) -> None:
        try:
            info = handlers[node_id].next_rendezvous()
        except Exception as exc:
            crashed.append(crash(exc))
            return
        rounds[node_id] += 1
        seen.put((node_id, rounds[node_id], info.world_size, time.time()))

    def monitor(node_id: str) -> None:
        """Ask for the nodes waiting every ``MONITOR_S``, and go to a new round once there are any.

        This is what torchrun's agent does (``num_nodes_waiting``; membership changes)."""
        while True:
            time.sleep(MONITOR_S)
            try:
                if handlers[node_id].num_nodes_waiting() > 0:
                    break
            except Exception as exc:
                crashed.append(crash(exc))
                return
        next_round(node_id)

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
        elif command == "monitor":  # what torchrun's agent does while its workers train
            threads = [threading.Thread(target=monitor, args=(i,), daemon=True) for i in ids]
            for t in threads:
                t.start()
            conn.send("monitoring")
        elif command == "stats":
            conn.send((0, 0, 0, said.removed, crashed, said.failed))
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
    lost = 0
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )
    run_id = f"scale{n}-{uuid.uuid4().hex[:6]}"
    hosts = Hosts.spread(
        peer_process, n, procs, ("127.0.0.1", server.port, run_id, n, peer, clients)
    )
    cores = Cores(lambda: [p.pid for p in hosts.procs], os.getpid())
    try:
        label = hosts.wait_ready(timeout_s)[0]
        seen = Seen()
        cores.busy()  # the phases count from here, not from the processes' start
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
            lost = hosts.procs[-2].pid  # its removal is no false one
            hosts.kill(len(hosts.conns) - 2)
            hosts.ask(hosts.conns[:-2] + hosts.conns[-1:], "join")  # their workers failed
            res.loss_s = seen.wait(
                hosts.seen, survivors, lambda r: r[0] == 2 and r[1] == n - 1, t1, timeout_s
            )
            res.busy["re-form, lost"] = cores.busy()
            if res.loss_s is None:
                res.why = f"no round without the lost node in {timeout_s:.0f} s"
            else:
                seen.forget(LOSS)  # it comes back as a new process: its count anew
                base = dict(seen.rounds)
                hosts.restart(len(hosts.conns) - 2, timeout_s)
                t3 = time.time()
                hosts.ask(hosts.conns[:-2] + hosts.conns[-1:], "monitor")
                hosts.ask(hosts.conns[-2:-1], "join")
                res.rejoin_s = seen.wait(
                    hosts.seen, hosts.nodes, lambda r: r[1] == n, t3, timeout_s, base
                )
                res.busy["rejoin"] = cores.busy()
                if res.rejoin_s is None:
                    res.why = f"no round with the node back in {timeout_s:.0f} s"
        stats = [s for s in hosts.ask(hosts.alive(), "stats", timeout=30) if s]
        res.crashed = Counter(c for s in stats for c in s[4])
        res.late = sum(s[5] for s in stats)
        res.dropped = Counter(d for d in dropped(stats).elements() if node_pid(d) != lost)
        return label, res
    finally:
        cores.stop()
        with contextlib.suppress(Exception):
            hosts.ask(hosts.alive(), "stop", timeout=10)
        hosts.close()
        del server


# --- the table -------------------------------------------------------------------------------


def dropped(stats: list[tuple[Any, ...]]) -> Counter[str]:
    """The drops of live nodes the host processes reported: ours by reason, torch's by node."""
    return Counter(what for s in stats for what in s[3])


def node_pid(descriptor: str) -> int:
    """The process of a torch node descriptor (``addr_pid_localid``)."""
    return int(descriptor.rsplit("_", 2)[1])


def crash(exc: BaseException) -> str:
    """A rendezvous call's failure, as the table names it."""
    return f"{type(exc).__name__}: {exc}"[:160]


def crashes(r: Result) -> str:
    """How many calls raised, and the most common failure."""
    if not r.crashed:
        return "0"
    what, _ = r.crashed.most_common(1)[0]
    return f"{r.crashed.total()} ({what})"


def cell(r: Result, phase: str, seconds: float | None, applies: bool = True) -> str:
    """A phase's time, or why there is none.

    A phase that kept the machine's cores busy (:data:`SATURATED`) measured the queue for a core,
    and its time is not reported."""
    if not applies:
        return "n/a"
    if seconds is None:
        return "-"
    busy = r.busy.get(phase)
    if busy is not None and busy.saturated:
        return "saturated"
    return f"{seconds:.2f} s"


def per_node(r: Result, which: int, n: int, unit: str = "") -> str:
    """Item ``which`` of the first round's and the loss re-form's load (:class:`Load`), per node.

    That is per N nodes, then per the N - 1 survivors."""
    got = [r.load.get(p) for p in ("first round", "re-form, lost")]
    parts = [
        f"{x[which] / k:.1f}{unit}" if x else "-" for x, k in zip(got, (n, n - 1), strict=True)
    ]
    return " / ".join(parts)


def leader_ms(r: Result) -> str:
    """The leader's CPU over the first round and the loss re-form, in milliseconds."""
    got = [r.leader.get(p) for p in ("first round", "re-form, lost")]
    return " / ".join("-" if x is None else f"{x * 1000:.0f} ms" for x in got)


def server_ms(r: Result) -> str:
    """The server's CPU over the first round and the loss re-form, in core-milliseconds."""
    got = [r.busy.get(p) for p in ("first round", "re-form, lost")]
    return " / ".join(f"{b.server * b.seconds * 1000:.0f} ms" if b else "-" for b in got)


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
    if ours:
        fenced = f"{r.dropped.total()}" + "".join(f"; {k}: {v}" for k, v in r.dropped.items())
        load = [per_node(r, 0, n), per_node(r, 1, n), per_node(r, 2, n, " B")]
    else:
        fenced = f"{len(r.dropped)} ({r.dropped.total()} removals)"
        load = ["n/a"] * 3
        clients = "per-node" if clients == "async" else clients  # torch has no async client
    first, idle = (str(r.busy[k]) if k in r.busy else "-" for k in ("first round", "idle"))
    times = [
        cell(r, "first round", r.first_s),
        cell(r, "joining", r.join_s, ours),
        cell(r, "re-form, lost", r.loss_s),
        cell(r, "re-form, evicted", r.evict_s, ours),
        cell(r, "rejoin", r.rejoin_s),
    ]
    return (
        f"| {n} | {label} | {clients} | {' | '.join(times)} | {' | '.join(load)} "
        f"| {server_ms(r)} | {leader_ms(r) if ours else 'n/a'} | {fenced} | {r.late} "
        f"| {crashes(r)} | {first} | {idle} "
        f"| {saturation(r.busy)} | {r.why} |"
    )


HEADER = (
    "| N | runtime and settings | clients | first round (ours: from the last node's join) "
    "| ours: N - 1 joining at once "
    "| re-form, lost | re-form, evicted "
    "| rejoin | etcd requests a node: first round / re-form, lost | watch events a node "
    "| bytes to a node | server CPU a round: first / re-form, lost | leader CPU (same) "
    "| live nodes dropped "
    "| late keep-alives | crashed | cores busy, first round: nodes + server (machine) "
    "| cores busy, idle round | saturated phases | stopped because |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128,256,512,1024")
    ap.add_argument("--procs", type=int, default=8, help="host processes for the nodes")
    ap.add_argument(
        "--clients",
        choices=CLIENTS,
        default="async",
        help="async (ours): the nodes of a host process on one asyncio loop and one channel, "
        "each with its own lease and watches (bench/sim_nodes.py; torch's rows run per-node); "
        "per-node: each simulated node has its own client, as real agents do; per-process: the "
        "nodes of a host process share one (lighter, but it serializes torch's calls)",
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
        f"clients {args.clients} ("
        + {
            "async": "ours: a real leader, a real lone node to lose and one to evict, the rest "
            "simulated many to a process on one asyncio loop and channel, each its own lease and "
            "watches; torch: each node its own TCPStore client",
            "per-node": "each simulated node its own etcd or TCPStore client, as real agents",
            "per-process": "the nodes of a process share one etcd or TCPStore client; torch's "
            "calls then wait for each other",
        }[args.clients]
        + f"); each phase bounded by {args.phase_timeout_s:.0f} s; a phase with "
        f"{SATURATED:.0%} of the cores busy is flagged SATURATED and its time withheld (the "
        "machine's, not the rendezvous')"
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
