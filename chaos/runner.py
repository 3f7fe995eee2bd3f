"""Carry out a campaign's schedule on a running job, at the step or second each fault is due.

On a local job the runner signals the processes itself and ends each timed fault (a thaw, a node
started again). Attached to a job elsewhere (``campaign.attach=true``), it asks each node's agent
for the fault through etcd (:mod:`chaos.requests`), and the node's helper strikes and ends it.

What was done is in the run's event log (``fault_injected``, ``fault_cleared``,
``fault_skipped``, written by :mod:`chaos.injectors`); the verdict is computed from there.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from chaos import injectors
from chaos.campaign import (
    NETWORK_KINDS,
    SHARED_KINDS,
    CampaignConfig,
    FaultKind,
    FaultSpec,
    pick,
    schedule,
)
from chaos.cpu_limit import CpuLimit
from chaos.netns import ETCD_LINK, PEER_LINK, LocalNetwork
from chaos.requests import NoAnswer, request_fault
from elastic import event_types as ev
from elastic.config import Config
from elastic.events import EventFollower
from launcher.agent.fault_helper import TargetNotFound, log_event, skipped
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd
from launcher.rendezvous.keys import JobKeys

POLL_S = 0.1  # how often the schedule is looked at: well under a step
KEEP_SLOW_S = 1.0  # how often a slow node's new workers are slowed too
RESTARTED_EXIT_S = 30.0  # how long a restarted agent may take to end after the job


def due(spec: FaultSpec, step: int, since_start: float, world: int = 0) -> bool:
    """Whether ``spec`` strikes now, at a world size of at least its ``min_world``.

    It strikes once training passed its step, or its seconds have elapsed."""
    if world < spec.min_world:
        return False
    return step >= spec.at_step if spec.at_step > 0 else since_start >= spec.at_s


class Slowed(NamedTuple):
    """A node slowed by a ``slow_node`` fault."""

    limit: CpuLimit
    until: float  # when it is lifted
    until_named: bool  # lifted sooner, once the job names it a straggler after ``since``
    since: float  # when it was slowed: a naming logged before says nothing of the slowdown

    def lifted_by(self, e: dict[str, Any]) -> bool:
        """Whether event ``e`` lifts it now: the job named the node since it was slowed.

        Only with ``until_named``. A naming logged just before the strike may be read after it."""
        return self.until_named and ev.STRAGGLER.matches(e) and e["ts"] > self.since


@dataclass
class CampaignRunner:
    """One campaign on one job (``cfg``), whose etcd is at ``endpoints``.

    With ``remote`` (an etcd client), faults are requested from the nodes' agents instead of
    signalled here."""

    cfg: Config
    campaign: CampaignConfig
    endpoints: list[str]
    remote: Any = None
    etcd: EmbeddedEtcd | None = None  # the job's etcd, when this campaign started it
    net: LocalNetwork | None = None  # the nodes' namespaces (campaign.netns)
    # Starts a node again (a repaired machine); None: its agent, on this machine's network.
    start_node: Callable[[str], subprocess.Popen[bytes]] | None = None
    todo: list[FaultSpec] = field(init=False)
    down: dict[str, float] = field(default_factory=dict)  # node -> when it comes back (inf: never)
    frozen: dict[str, float] = field(default_factory=dict)  # node -> when it is thawed
    restarted: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    etcd_down: dict[int, float] = field(default_factory=dict)  # member -> when it is started
    ballast: dict[Path, float] = field(default_factory=dict)  # file -> when it is removed
    cut: dict[tuple[str, FaultKind], float] = field(default_factory=dict)  # -> when it ends
    slowed: dict[str, Slowed] = field(default_factory=dict)
    agents: dict[str, int] = field(default_factory=dict)  # node -> its newest agent's pid
    # node -> the pid of what started it again, until its agent says it started: before, the
    # log names the agent before it, and a fault would strike that one (or its zombie).
    starting: dict[str, int] = field(default_factory=dict)
    kept_slow_at: float = 0.0
    number: int = 0  # faults struck or skipped so far

    def __post_init__(self) -> None:
        self.todo = schedule(self.campaign)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    def run(self, running: Callable[[], bool]) -> None:
        """Follow the job while ``running()`` and until it has trained, striking faults.

        Each fault strikes when due."""
        follower = EventFollower(self.run_dir)
        began = time.time()  # attached to a job that trains already: seconds count from here
        started, step, world, trained = None, 0, 0, False
        # The world size is read from steps past the last strike and the step it may have
        # found in flight: the ones logged before it still say the world it struck.
        world_after = 0
        try:
            while running() and not trained:
                for e in follower.poll():
                    if ev.AGENT_STARTED.matches(e):
                        self.agents[e["node"]] = e["pid"]
                        self.starting.pop(e["node"], None)
                    if ev.TRAINING_STARTED.matches(e) and started is None:
                        started = max(e["ts"], began)
                    elif ev.STEP.matches(e):
                        step = max(step, e["step"])
                        if e["step"] > world_after:
                            world = e["world_size"]
                    trained |= ev.TRAINING_DONE.matches(e)
                    slow = self.slowed.get(e.get("node", ""))
                    if slow is not None and slow.lifted_by(e):
                        self.slowed[e["node"]] = slow._replace(until=0.0)
                now = time.time()
                self._end_timed_faults(now)
                if now - self.kept_slow_at >= KEEP_SLOW_S:  # new workers of a slow node
                    self.kept_slow_at = now
                    for node, slow in self.slowed.items():
                        if node in self.agents:
                            injectors.keep_slow(self.agents[node], slow.limit)
                while (
                    self.todo
                    and started is not None
                    and due(self.todo[0], step, now - started, world)
                ):
                    self._strike(self.todo.pop(0))
                    world_after, world = step + 1, 0
                time.sleep(POLL_S)
        finally:
            self._end_timed_faults(float("inf"), restart=False)
            for node, proc in self.restarted:
                try:
                    proc.wait(timeout=RESTARTED_EXIT_S)
                except subprocess.TimeoutExpired:  # clean-up, not a fault: not logged as one
                    print(
                        f"chaos: {node} did not end {RESTARTED_EXIT_S:.0f} s after the job; killed",
                        flush=True,
                    )
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session (restart_node)
                    proc.wait(timeout=5)

    def started(self) -> list[subprocess.Popen[bytes]]:
        """The nodes this campaign started again."""
        return [proc for _, proc in self.restarted]

    def _up(self) -> list[str]:
        if self.remote is None:
            nodes = [f"node{i}" for i in range(self.cfg.cluster.nodes)]
        else:  # the nodes registered now
            folder = JobKeys(self.cfg.rendezvous.prefix, self.cfg.job_id).nodes
            nodes = sorted(m.key.decode()[len(folder) :] for _, m in self.remote.get_prefix(folder))
        for node, proc in self.restarted:  # a restarted agent that ended before it started
            if self.starting.get(node) == proc.pid and proc.poll() is not None:
                del self.starting[node]
        cut = {node for node, _ in self.cut}
        out = cut | self.down.keys() | self.frozen.keys() | self.slowed.keys()
        out |= self.starting.keys()
        return [n for n in nodes if n not in out]

    def _strike(self, spec: FaultSpec) -> None:
        self.number += 1
        if spec.kind in SHARED_KINDS:
            self._strike_shared(spec)
            return
        up = self._up()
        rank0 = None
        with contextlib.suppress(TargetNotFound):
            rank0 = injectors.node_with_rank(self.run_dir, 0)
        node = pick(spec.target, up, rank0, self.campaign.seed, self.number)
        takes_node = spec.kind not in (FaultKind.kill_worker, FaultKind.corrupt_replica)
        if node is None:
            self._skip(spec, spec.target, f"no node up matches target {spec.target!r}")
            return
        if takes_node and len(up) - 1 < self.cfg.cluster.min_nodes:
            self._skip(spec, node, "it would leave fewer than cluster.min_nodes nodes up")
            return
        if self.remote is not None:
            self._request(spec, node)
            return
        try:
            if spec.kind in NETWORK_KINDS:
                self._cut(spec, node)
            elif spec.kind is FaultKind.kill_worker:
                injectors.kill_worker(self.run_dir, node, 0)
            elif spec.kind is FaultKind.freeze_node:
                injectors.kill_node(self.run_dir, node, signal.SIGSTOP)
                self.frozen[node] = time.time() + spec.duration_s
            elif spec.kind is FaultKind.corrupt_replica:
                if not self.cfg.chaos.allow:
                    raise TargetNotFound(
                        "corrupt_replica needs the job's chaos.allow=true (without it the "
                        "signal would kill the worker)"
                    )
                injectors.corrupt_replica(self.run_dir, node)
            elif spec.kind is FaultKind.slow_node:
                limit = injectors.slow_node(self.run_dir, node, self.campaign.slow_factor)
                now = time.time()
                self.slowed[node] = Slowed(limit, now + spec.duration_s, spec.until_named, now)
            else:
                sig = signal.SIGKILL if spec.kind is FaultKind.kill_node else signal.SIGTERM
                injectors.kill_node(self.run_dir, node, sig)
                back = spec.restart_after_s
                self.down[node] = time.time() + back if back >= 0 else float("inf")
        except TargetNotFound as exc:
            self._skip(spec, node, str(exc))
            return
        print(f"chaos: fault {self.number}: {spec.kind} {node}", flush=True)

    def _cut(self, spec: FaultSpec, node: str) -> None:
        """Cut or slow ``node``'s link for ``duration_s``."""
        if self.net is None:
            raise TargetNotFound(
                f"{spec.kind} needs each node in a network namespace: set campaign.netns=true "
                "(root, with ip and tc)"
            )
        i = int(node.removeprefix("node"))
        if spec.kind is FaultKind.slow_network:
            injectors.throttle(self.run_dir, self.net, i, self.campaign.slow_mbit)
        else:
            link = PEER_LINK if spec.kind is FaultKind.partition_peers else ETCD_LINK
            injectors.partition(self.run_dir, self.net, i, link)
        self.cut[(node, spec.kind)] = time.time() + spec.duration_s

    def _strike_shared(self, spec: FaultSpec) -> None:
        """A fault of what every node shares: the job's etcd, its checkpoints."""
        now, target = time.time(), spec.kind.value
        try:
            if spec.kind is FaultKind.corrupt_shard:
                target = self.cfg.checkpoint.url
                injectors.corrupt_shard(self.run_dir, target)
            elif spec.kind is FaultKind.fill_disk:
                url = self.cfg.checkpoint.url
                target = url.removeprefix("file://")
                if "://" in target:
                    raise TargetNotFound(f"checkpoint.url={url} is not a local path")
                c = self.campaign
                path = injectors.fill_disk(self.run_dir, target, c.fill_keep_mb, c.fill_limit_gb)
                self.ballast[path] = now + spec.duration_s
            else:
                if self.etcd is None:
                    raise TargetNotFound(
                        "the job's etcd is not this campaign's (attached): nothing to kill"
                    )
                member = random.Random(f"{self.campaign.seed}:{self.number}").randrange(
                    len(self.etcd.members)
                )
                target = f"member{member}"
                if member in self.etcd_down:
                    raise TargetNotFound(f"etcd {target} is down already")
                injectors.stop_etcd(self.run_dir, self.etcd, member)
                self.etcd_down[member] = now + spec.duration_s
        except TargetNotFound as exc:
            self._skip(spec, target, str(exc))
            return
        print(f"chaos: fault {self.number}: {spec.kind} {target}", flush=True)

    def _request(self, spec: FaultSpec, node: str) -> None:
        """Ask ``node``'s agent for the fault.

        Its helper ends it, so only the time it is down is kept here (for the nodes up)."""
        try:
            answer = request_fault(
                self.remote,
                self.cfg.rendezvous.prefix,
                self.cfg.job_id,
                node,
                str(spec.kind),
                duration_s=spec.duration_s,
                restart_after_s=spec.restart_after_s,
            )
        except NoAnswer as exc:
            self._skip(spec, node, str(exc))
            return
        if not answer.accepted:
            self._skip(spec, node, f"{node} refused it: {answer.reason}")
            return
        now = time.time()
        if spec.kind is FaultKind.freeze_node:
            self.frozen[node] = now + spec.duration_s
        elif spec.kind is not FaultKind.kill_worker:
            back = spec.restart_after_s
            self.down[node] = now + back if back >= 0 else float("inf")
        print(f"chaos: fault {self.number}: {spec.kind} {node} (requested)", flush=True)

    def _skip(self, spec: FaultSpec, target: str, reason: str) -> None:
        skipped(self.run_dir, str(spec.kind), target, reason)
        print(f"chaos: fault {self.number} ({spec.kind}) skipped: {reason}", flush=True)

    def _end_timed_faults(self, now: float, restart: bool = True) -> None:
        """Thaw the nodes whose freeze is over and start the nodes whose repair is over.

        At the end (``restart=False``) thaw every node, so that nothing stays stopped. Full disks
        and lost etcd members and slow nodes end on time, and at the end in any case."""
        for path, at in list(self.ballast.items()):
            if now >= at or not restart:
                injectors.clear_disk(self.run_dir, path)
                del self.ballast[path]
        for (node, kind), at in list(self.cut.items()):
            if (now >= at or not restart) and self.net is not None:
                i = int(node.removeprefix("node"))
                if kind is FaultKind.slow_network:
                    injectors.unthrottle(self.run_dir, self.net, i)
                else:
                    link = PEER_LINK if kind is FaultKind.partition_peers else ETCD_LINK
                    injectors.heal(self.run_dir, self.net, i, link)
                del self.cut[(node, kind)]
        for node, slow in list(self.slowed.items()):
            if now >= slow.until or not restart:
                injectors.unslow_node(self.run_dir, node, slow.limit)
                del self.slowed[node]
        for member, at in list(self.etcd_down.items()):
            if (now >= at or not restart) and self.etcd is not None:
                injectors.start_etcd(self.run_dir, self.etcd, member)
                del self.etcd_down[member]
        for node, at in list(self.frozen.items()):
            if now >= at:
                if self.remote is None:  # else the node's helper thaws it
                    injectors.thaw_node(self.run_dir, node)
                del self.frozen[node]
        for node, at in list(self.down.items()):
            if restart and now >= at and self.remote is not None:
                del self.down[node]  # its helper starts it again
            elif restart and now >= at:
                if self.start_node is None:
                    _, proc = injectors.restart_node(
                        self.run_dir, node, self.endpoints, self.cfg.cluster.nodes
                    )
                else:
                    log_event(self.run_dir, ev.FAULT_CLEARED, kind="restart", target=node)
                    proc = self.start_node(node)
                self.restarted.append((node, proc))
                self.starting[node] = proc.pid
                del self.down[node]
