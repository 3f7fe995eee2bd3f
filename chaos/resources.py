"""What a job's processes hold after each recovery, and how much of it each recovery adds.

A long unattended run survives hundreds of in-place rebuilds in processes that never restart, so
a few megabytes, descriptors or threads left behind per rebuild become gigabytes within weeks.
:class:`ResourceWatch` follows a run's event log, knows every agent and worker from their
``agent_started`` and ``worker_started`` events, and samples each live one (resident memory,
open descriptors, threads: ``psutil``; on a GPU node the device memory NVML sees it use) after
every ``recovered`` event. :func:`growth` fits a
line through each process's samples, past its warm-up, and gives the slope per recovery: the
figure ``bench/soak.py`` prints and its short form in the tests holds near zero.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from elastic import event_types as ev

METRICS = ("rss_mb", "gpu_mb", "fds", "threads")
WARMUP = 3  # a process's first recoveries fill caches and pools: not counted as growth


@dataclass(frozen=True)
class Sample:
    """One process after one recovery (``recovery``: its number in the run, from 1)."""

    recovery: int
    node: str
    role: str  # agent or worker
    local_rank: int  # -1 for an agent
    pid: int
    rss_mb: float
    fds: int
    threads: int
    gpu_mb: float = 0.0  # device memory, summed over the GPUs it uses (0 where there are none)


@dataclass(frozen=True)
class Growth:
    """The steepest growth per recovery among the survivors of one role, and its process.

    The survivors are the ``processes`` that lived through at least ``WARMUP + min_points``
    recoveries."""

    role: str
    processes: int
    per_recovery: dict[str, float]  # metric -> slope (MB, fds, threads per recovery)
    worst: dict[str, str]  # metric -> "node1 worker 0 (pid 123)"
    first: dict[str, float]  # metric -> the worst process's value after its warm-up
    last: dict[str, float]  # ... and at its last sample


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``points`` ((x, y) pairs); 0 with fewer than two distinct x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    num = sum((x - mx) * (y - my) for x, y in points)
    return num / sum((x - mx) ** 2 for x in xs)


def growth(
    samples: Iterable[Sample], min_points: int = 4, warmup: int = WARMUP
) -> dict[str, Growth]:
    """Per role, the steepest slope per recovery of each metric among the survivors.

    The survivors are the processes that ran from the first recovery on (a node started again
    warms up for several rounds: its first save allocates the staged copy, its first rounds DDP's
    buckets). They are counted past their first ``warmup`` samples."""
    samples = list(samples)
    first = min((s.recovery for s in samples), default=0)
    by_pid: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        by_pid.setdefault((s.role, s.pid), []).append(s)
    by_pid = {k: v for k, v in by_pid.items() if min(s.recovery for s in v) == first}
    out: dict[str, Growth] = {}
    for role in sorted({r for r, _ in by_pid}):
        lives = [
            sorted(v, key=lambda s: s.recovery)[warmup:]
            for (r, _), v in by_pid.items()
            if r == role
        ]
        lives = [life for life in lives if len(life) >= min_points]
        if not lives:
            continue
        per, worst, first, last = {}, {}, {}, {}
        for m in METRICS:
            fits = [(slope([(s.recovery, getattr(s, m)) for s in life]), life) for life in lives]
            k, life = max(fits, key=lambda f: f[0])
            s0 = life[0]
            per[m], first[m], last[m] = k, getattr(s0, m), getattr(life[-1], m)
            rank = "" if s0.role == "agent" else f" {s0.local_rank}"
            worst[m] = f"{s0.node} {s0.role}{rank} (pid {s0.pid})"
        out[role] = Growth(role, len(lives), per, worst, first, last)
    return out


def gpu_memory_mb() -> dict[int, float]:
    """Device memory in use by each process on this machine's GPUs.

    It is NVML's per-process figure, summed over GPUs; empty where NVML or a GPU is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML library, no driver or no GPU: nothing to read
        return {}
    used: dict[int, float] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                mb = (proc.usedGpuMemory or 0) / 2**20  # None where the driver will not say
                used[proc.pid] = used.get(proc.pid, 0.0) + mb
    except pynvml.NVMLError:
        return {}
    finally:
        pynvml.nvmlShutdown()
    return used


@dataclass
class ResourceWatch:
    """The job's agents and workers, known from its events, sampled after each recovery."""

    procs: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # pid -> node, role, lr
    samples: list[Sample] = field(default_factory=list)
    recoveries: int = 0

    def see(self, events: Iterable[Mapping[str, Any]]) -> bool:
        """Take in new events; True when one of them is a recovery (then sample)."""
        recovered = False
        for e in events:
            if ev.AGENT_STARTED.matches(e):
                self.procs[e["pid"]] = (e["node"], "agent", -1)
            elif ev.WORKER_STARTED.matches(e):
                self.procs[e["worker_pid"]] = (e["node"], "worker", e["local_rank"])
            elif ev.WORKER_EXITED.matches(e):
                self.procs.pop(e["worker_pid"], None)
            elif ev.RECOVERED.matches(e):
                recovered = True
        if recovered:
            self.recoveries += 1
            self.sample()
        return recovered

    def sample(self) -> list[Sample]:
        """Every known process that is alive now; the dead are forgotten."""
        now, gpu = [], gpu_memory_mb()
        for pid, (node, role, local_rank) in list(self.procs.items()):
            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    if p.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.NoSuchProcess(pid)
                    s = Sample(
                        self.recoveries,
                        node,
                        role,
                        local_rank,
                        pid,
                        p.memory_info().rss / 2**20,
                        p.num_fds(),
                        p.num_threads(),
                        gpu.get(pid, 0.0),
                    )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                del self.procs[pid]
                continue
            now.append(s)
        self.samples.extend(now)
        return now
