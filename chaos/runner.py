"""Carry out a campaign's schedule on a running local job: real signals, at the step or second
each fault is due, and the end of each timed fault (a thaw, a node started again).

What was done is in the run's event log (``fault_injected``, ``fault_cleared``,
``fault_skipped``, written by :mod:`chaos.injectors`); the verdict is computed from there.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos import injectors
from chaos.campaign import CampaignConfig, FaultKind, FaultSpec, pick, schedule
from elastic.config import Config
from elastic.events import EventFollower

POLL_S = 0.1  # how often the schedule is looked at: well under a step
RESTARTED_EXIT_S = 30.0  # how long a restarted agent may take to end after the job


def due(spec: FaultSpec, step: int, since_start: float) -> bool:
    """Whether ``spec`` strikes now: training passed its step, or its seconds have elapsed."""
    return step >= spec.at_step if spec.at_step > 0 else since_start >= spec.at_s


@dataclass
class CampaignRunner:
    """One campaign on one local job (``cfg``), whose etcd is at ``endpoints``."""

    cfg: Config
    campaign: CampaignConfig
    endpoints: list[str]
    todo: list[FaultSpec] = field(init=False)
    down: dict[str, float] = field(default_factory=dict)  # node -> when it comes back (inf: never)
    frozen: dict[str, float] = field(default_factory=dict)  # node -> when it is thawed
    restarted: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    number: int = 0  # faults struck or skipped so far

    def __post_init__(self) -> None:
        self.todo = schedule(self.campaign)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    def run(self, job: subprocess.Popen[bytes]) -> None:
        """Follow the job until it exits, striking each fault when due."""
        follower = EventFollower(self.run_dir)
        started, step = None, 0
        try:
            while job.poll() is None:
                for e in follower.poll():
                    if e["event"] == "training_started" and started is None:
                        started = e["ts"]
                    elif e["event"] == "step":
                        step = max(step, e["step"])
                now = time.time()
                self._end_timed_faults(now)
                while self.todo and started is not None and due(self.todo[0], step, now - started):
                    self._strike(self.todo.pop(0))
                time.sleep(POLL_S)
        finally:
            self._end_timed_faults(float("inf"), restart=False)
            for node, proc in self.restarted:
                try:
                    proc.wait(timeout=RESTARTED_EXIT_S)
                except subprocess.TimeoutExpired:
                    injectors.kill_node(self.run_dir, node)
                    proc.wait(timeout=5)

    def _up(self) -> list[str]:
        nodes = [f"node{i}" for i in range(self.cfg.cluster.nodes)]
        return [n for n in nodes if n not in self.down and n not in self.frozen]

    def _strike(self, spec: FaultSpec) -> None:
        self.number += 1
        up = self._up()
        rank0 = None
        with contextlib.suppress(injectors.TargetNotFound):
            rank0 = injectors.node_with_rank(self.run_dir, 0)
        node = pick(spec.target, up, rank0, self.campaign.seed, self.number)
        takes_node = spec.kind is not FaultKind.kill_worker
        if node is None:
            self._skip(spec, spec.target, f"no node up matches target {spec.target!r}")
            return
        if takes_node and len(up) - 1 < self.cfg.cluster.min_nodes:
            self._skip(spec, node, "it would leave fewer than cluster.min_nodes nodes up")
            return
        try:
            if spec.kind is FaultKind.kill_worker:
                injectors.kill_worker(self.run_dir, node, 0)
            elif spec.kind is FaultKind.freeze_node:
                injectors.kill_node(self.run_dir, node, signal.SIGSTOP)
                self.frozen[node] = time.time() + spec.duration_s
            else:
                sig = signal.SIGKILL if spec.kind is FaultKind.kill_node else signal.SIGTERM
                injectors.kill_node(self.run_dir, node, sig)
                back = spec.restart_after_s
                self.down[node] = time.time() + back if back >= 0 else float("inf")
        except injectors.TargetNotFound as exc:
            self._skip(spec, node, str(exc))
            return
        print(f"chaos: fault {self.number}: {spec.kind} {node}", flush=True)

    def _skip(self, spec: FaultSpec, target: str, reason: str) -> None:
        injectors.skipped(self.run_dir, str(spec.kind), target, reason)
        print(f"chaos: fault {self.number} ({spec.kind}) skipped: {reason}", flush=True)

    def _end_timed_faults(self, now: float, restart: bool = True) -> None:
        """Thaw the nodes whose freeze is over and start the nodes whose repair is over; at the
        end (``restart=False``) thaw every node, so that nothing stays stopped."""
        for node, at in list(self.frozen.items()):
            if now >= at:
                injectors.thaw_node(self.run_dir, node)
                del self.frozen[node]
        for node, at in list(self.down.items()):
            if restart and now >= at:
                _, proc = injectors.restart_node(
                    self.run_dir, node, self.endpoints, self.cfg.cluster.nodes
                )
                self.restarted.append((node, proc))
                del self.down[node]
