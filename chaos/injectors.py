"""Fault injectors: real signals to real processes, partitions, slow links and slow nodes.

Processes are found through the run's event log. Network partitions and slow links are of
nodes run in namespaces (:mod:`chaos.netns`); slow nodes come from :mod:`chaos.cpu_limit`.

Nodes and workers are found through the events; etcd members through the
:class:`~launcher.rendezvous.embedded_etcd.EmbeddedEtcd` that owns them, or, for the one ``python -m
launcher`` starts, by their data directory under the run's.

Each injection is itself written to the event log (``events/chaos.jsonl``) with the moment the
signal was sent, so recovery can be measured from the log alone: fault to first step after.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

from chaos.cpu_limit import CpuLimit, limit_cpu
from chaos.netns import PEER_LINK, LocalNetwork
from elastic import config
from elastic import event_types as ev
from elastic.events import read_events
from elastic.lifeline import tied
from elastic.manifest import MANIFEST, candidates
from launcher.agent.fault_helper import TargetNotFound, log_event, process_tree, send
from launcher.local_cluster import agent_argv
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd

BALLAST = ".chaos-ballast"  # the file that fills a checkpoint file system


def _newest(run_dir: Path, event: ev.EventType, **match: Any) -> dict[str, Any]:
    found = [
        e
        for e in read_events(run_dir)
        if event.matches(e) and all(e.get(k) == v for k, v in match.items())
    ]
    if not found:
        raise TargetNotFound(f"no {event.name} event with {match} in {run_dir}")
    return found[-1]


def node_with_rank(run_dir: str | os.PathLike[str], rank: int = 0) -> str:
    """The node whose worker held ``rank`` in the newest round that synced its state."""
    return str(_newest(Path(run_dir), ev.STATE_SYNCED, rank=rank)["node"])


def node_processes(run_dir: str | os.PathLike[str], node_id: str) -> list[psutil.Process]:
    """A node's agent and every process under it (its workers and their helpers)."""
    agent = _newest(Path(run_dir), ev.AGENT_STARTED, node=node_id)
    return process_tree(agent["pid"], f"the agent of {node_id}")


def kill_node(
    run_dir: str | os.PathLike[str], node_id: str, sig: signal.Signals = signal.SIGKILL
) -> float:
    """Signal a whole node at once, as a machine failure would; returns when it was sent.

    ``SIGSTOP`` freezes the node (its agent and workers), like a machine that hangs.
    """
    procs = node_processes(run_dir, node_id)
    return send(run_dir, procs, sig, kind="node", target=node_id)


def thaw_node(run_dir: str | os.PathLike[str], node_id: str) -> float:
    """``SIGCONT`` a frozen node (logged as ``fault_cleared``): it finds itself fenced out."""
    procs = node_processes(run_dir, node_id)
    return send(run_dir, procs, signal.SIGCONT, event=ev.FAULT_CLEARED, kind="node", target=node_id)


def kill_agent(
    run_dir: str | os.PathLike[str], node_id: str, sig: signal.Signals = signal.SIGKILL
) -> float:
    """Signal a node's agent alone, its workers left running.

    ``SIGSTOP`` is an agent that stops answering (its lease runs out) while its workers still
    train; :func:`thaw_node` resumes it."""
    agent = node_processes(run_dir, node_id)[0]
    return send(run_dir, [agent], sig, kind="agent", target=node_id)


def kill_worker(
    run_dir: str | os.PathLike[str],
    node_id: str,
    local_rank: int = 0,
    sig: signal.Signals = signal.SIGKILL,
) -> float:
    """Signal one worker (the newest one started for that node and local rank)."""
    started = _newest(Path(run_dir), ev.WORKER_STARTED, node=node_id, local_rank=local_rank)
    try:
        proc = psutil.Process(started["worker_pid"])
    except psutil.NoSuchProcess as exc:
        raise TargetNotFound(f"worker {local_rank} of {node_id} is not running") from exc
    return send(run_dir, [proc], sig, kind="worker", target=f"{node_id}/worker{local_rank}")


def slow_node(run_dir: str | os.PathLike[str], node_id: str, factor: float) -> CpuLimit:
    """Hold a node's workers (and their loader processes) to ``1 / factor`` of the CPU they use.

    The limit is :func:`chaos.cpu_limit.limit_cpu`'s, its agent untouched: a node that is slow, not
    dead, as a throttled GPU is. :func:`unslow_node` lifts it."""
    workers = node_processes(run_dir, node_id)[1:]
    if not workers:
        raise TargetNotFound(f"{node_id} runs no worker")
    limit = limit_cpu(workers, factor, f"chaos-slow-{os.getpid()}-{node_id}")
    log_event(
        run_dir,
        ev.FAULT_INJECTED,
        kind="slow_node",
        target=node_id,
        factor=factor,
        how=limit.how,
        pids=[p.pid for p in workers],
    )
    return limit


def keep_slow(agent_pid: int, limit: CpuLimit) -> None:
    """Extend a :func:`slow_node` to the workers its node's agent (``agent_pid``) started since.

    Those come from a restart, a rejoin: the machine is what is slow."""
    with contextlib.suppress(TargetNotFound, psutil.NoSuchProcess):
        limit.add(process_tree(agent_pid, "the slow node's agent")[1:])


def unslow_node(run_dir: str | os.PathLike[str], node_id: str, limit: CpuLimit) -> float:
    """End a :func:`slow_node`."""
    limit.end()
    return log_event(run_dir, ev.FAULT_CLEARED, kind="slow_node", target=node_id)


def corrupt_replica(run_dir: str | os.PathLike[str], node_id: str) -> float:
    """Send SIGUSR1 to a node's first worker, which flips a bit of its parameters.

    With ``chaos.allow`` it flips one bit of a parameter between two steps
    (:meth:`elastic.chaos_hooks.ChaosHooks.before_step`), a silent memory fault that the replica
    check must find and repair. Without it the signal would kill the worker: the caller checks."""
    started = _newest(Path(run_dir), ev.WORKER_STARTED, node=node_id, local_rank=0)
    try:
        proc = psutil.Process(started["worker_pid"])
    except psutil.NoSuchProcess as exc:
        raise TargetNotFound(f"worker 0 of {node_id} is not running") from exc
    return send(run_dir, [proc], signal.SIGUSR1, kind="replica", target=f"{node_id}/worker0")


def restart_node(
    run_dir: str | os.PathLike[str], node_id: str, endpoints: list[str], nodes_on_machine: int
) -> tuple[float, subprocess.Popen[bytes]]:
    """Start a killed or departed node's agent again, as a repaired machine rejoins.

    It is a fresh agent on the run's ``config.yaml``, in a session of its own (so that
    :func:`kill_node` reaches all of it), tied to this process. Logged as ``fault_cleared`` before
    it starts."""
    run_dir = Path(run_dir)
    sent = log_event(run_dir, ev.FAULT_CLEARED, kind="restart", target=node_id)
    config_path = run_dir / "config.yaml"
    port = config.load(config_path).metrics.port
    argv = agent_argv(config_path, node_id, endpoints, nodes_on_machine, port)
    with open(run_dir / "logs" / f"{node_id}.log", "ab") as out:
        proc = subprocess.Popen(
            tied(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return sent, proc


def stop_etcd(run_dir: str | os.PathLike[str], etcd: EmbeddedEtcd, member: int = 0) -> float:
    """SIGKILL one member of an etcd this process started.

    That is an outage of a 1-member etcd, or a lost member of three; :func:`start_etcd` brings it
    back on the same port and data."""
    pid = etcd.pid(member)
    if pid is None:
        raise TargetNotFound(f"etcd member {member} is not running")
    record = log_event(
        run_dir, ev.FAULT_INJECTED, kind="etcd", target=f"member{member}", pids=[pid]
    )
    etcd.stop_member(member, kill=True)
    return record


def start_etcd(run_dir: str | os.PathLike[str], etcd: EmbeddedEtcd, member: int = 0) -> float:
    """Start a member stopped by :func:`stop_etcd` again, as an operator restarts etcd.

    It returns once the member is healthy (logged as ``fault_cleared`` at that moment)."""
    etcd.start_member(member)
    return log_event(run_dir, ev.FAULT_CLEARED, kind="etcd", target=f"member{member}")


def kill_embedded_etcd_member(run_dir: str | os.PathLike[str], member: int) -> float:
    """SIGKILL one member of the embedded etcd that ``python -m launcher`` started for the run.

    That etcd has ``cluster.embedded_etcd_members=3``; the member is found by its data directory
    under the run's."""
    data_dir = str(Path(run_dir) / "etcd" / f"member{member}")
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--data-dir" in cmd and cmd[cmd.index("--data-dir") + 1] == data_dir:
            return send(run_dir, [p], signal.SIGKILL, kind="etcd", target=f"member{member}")
    raise TargetNotFound(f"no etcd process with --data-dir {data_dir}")


def corrupt_shard(run_dir: str | os.PathLike[str], url: str) -> float:
    """Flip one byte of the newest committed checkpoint at ``url``, then verify it and log that.

    The byte is in the middle of its largest shard, as a disk or a copy gone bad would flip it. The
    checkpoint is verified as every load does (:meth:`elastic.checkpoint_verify.Verifier.verify`)
    and the answer logged (``checkpoint_verified``). A load must refuse it, and in-place recovery
    never loads one, so the fault is judged here (the verdict also checks that no such checkpoint
    was loaded later)."""
    from elastic.checkpoint_store import CheckpointStore
    from elastic.checkpoint_verify import Verifier  # torch: only for this fault

    store = CheckpointStore(url)
    for folder in candidates(store.fs, store.root):
        try:
            files = json.loads(store.fs.cat_file(f"{folder}/{MANIFEST}"))["files"]
        except (OSError, ValueError, KeyError):
            continue  # not committed
        name = max(files, key=lambda n: files[n]["size"])
        data = bytearray(store.fs.cat_file(f"{folder}/{name}"))
        if not data:
            continue
        data[len(data) // 2] ^= 0xFF
        target = f"{folder.rsplit('/', 1)[-1]}/{name}"
        sent = log_event(run_dir, ev.FAULT_INJECTED, kind="checkpoint", target=target)
        store.fs.pipe_file(f"{folder}/{name}", bytes(data))
        refused = Verifier(store).verify(folder)
        log_event(
            run_dir, ev.CHECKPOINT_VERIFIED, kind="checkpoint", target=target, refused=refused
        )
        return sent
    raise TargetNotFound(f"no committed checkpoint at {url} yet")


def fill_disk(
    run_dir: str | os.PathLike[str], folder: str | os.PathLike[str], keep_mb: int, limit_gb: float
) -> Path:
    """Fill the file system holding ``folder`` (where checkpoints go) until ``keep_mb`` are left.

    It writes a ballast file; :func:`clear_disk` removes it. A file system with more than
    ``limit_gb`` free is refused (:class:`TargetNotFound`): filling it would fill the machine's
    disk for everyone, so give the checkpoints a small one of their own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free > limit_gb * 2**30:
        raise TargetNotFound(
            f"{folder} is on a file system with {free / 2**30:.1f} GB free, over "
            f"campaign.fill_limit_gb={limit_gb}: filling it would fill this machine's disk; put "
            "checkpoint.url on a small file system of its own, or raise the limit"
        )
    ballast = folder / BALLAST
    log_event(run_dir, ev.FAULT_INJECTED, kind="disk", target=str(folder), free_mb=free // 2**20)
    chunk = b"\0" * 2**24
    with open(ballast, "wb", buffering=0) as f:  # unbuffered: a full disk fails the write itself
        try:
            while (left := shutil.disk_usage(folder).free - keep_mb * 2**20) > 0:
                f.write(chunk[: min(left, len(chunk))])
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return ballast


def clear_disk(run_dir: str | os.PathLike[str], ballast: Path) -> float:
    """End a :func:`fill_disk`."""
    ballast.unlink(missing_ok=True)
    return log_event(run_dir, ev.FAULT_CLEARED, kind="disk", target=str(ballast.parent))


def partition(run_dir: str | os.PathLike[str], net: LocalNetwork, node: int, link: str) -> float:
    """Cut node ``node`` of ``net`` off its peers (``link="peer"``) or off etcd (``"etcd"``).

    :func:`heal` joins it again."""
    sent = log_event(run_dir, ev.FAULT_INJECTED, kind="partition", target=f"node{node}", link=link)
    net.set_link(node, link, up=False)
    return sent


def heal(run_dir: str | os.PathLike[str], net: LocalNetwork, node: int, link: str) -> float:
    """End a :func:`partition`."""
    net.set_link(node, link, up=True)
    return log_event(run_dir, ev.FAULT_CLEARED, kind="partition", target=f"node{node}", link=link)


def throttle(
    run_dir: str | os.PathLike[str], net: LocalNetwork, node: int, rate_mbit: float
) -> float:
    """Slow node ``node``'s link to its peers to ``rate_mbit`` (:meth:`LocalNetwork.set_rate`).

    It is a node that is slow, not dead. :func:`unthrottle` lifts the limit."""
    sent = log_event(
        run_dir, ev.FAULT_INJECTED, kind="slow_network", target=f"node{node}", rate_mbit=rate_mbit
    )
    net.set_rate(node, PEER_LINK, rate_mbit)
    return sent


def unthrottle(run_dir: str | os.PathLike[str], net: LocalNetwork, node: int) -> float:
    """End a :func:`throttle`."""
    net.set_rate(node, PEER_LINK, None)
    return log_event(run_dir, ev.FAULT_CLEARED, kind="slow_network", target=f"node{node}")
