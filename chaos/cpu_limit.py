"""Hold processes to a share of the CPU they use: the ``slow_node`` fault.

That fault is a node that is slow and not dead (a throttled GPU, a host with failing memory).

Where the kernel offers a CPU controller (cgroup v2's ``cpu.max``, or v1's ``cpu.cfs_quota_us``,
both writable as root) the processes move into a cgroup of their own whose quota is the CPU they
were using divided by the slow-down, measured just before; they move back when it ends. Anywhere
else a thread stops and continues them in turn (SIGSTOP for ``1 - 1/factor`` of every
:data:`DUTY_PERIOD_S`), which slows them as much but in bursts. :func:`limit_cpu` picks the first
that works and says which.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the quota's period: short, so the slow-down is even within a step
DUTY_PERIOD_S = 0.2  # the stop/continue cycle's period
MEASURE_S = 0.5  # how long the processes' own CPU use is measured before it is cut
MIN_CORES = 0.01


class CpuLimit:
    """A slow-down in force.

    :meth:`add` extends it to new processes (a slow machine's new workers are as slow); :meth:`end`
    lifts it (processes that exited meanwhile are skipped)."""

    how = ""

    def add(self, procs: list[psutil.Process]) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError


class CgroupLimit(CpuLimit):
    """The processes in a cgroup of their own with a CPU quota."""

    def __init__(
        self, group: Path, procs: list[psutil.Process], quota_file: str, cores: float
    ) -> None:
        self.group, self.quota_file = group, quota_file
        quota = max(1000, int(cores * PERIOD_US))
        if quota_file == "cpu.max":  # v2: the parent hands the controller down
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.subtree_control").write_text("+cpu")
        group.mkdir()
        try:
            if quota_file == "cpu.max":
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError:
            group.rmdir()
            raise
        self.homes: dict[int, Path] = {}
        self.add(procs)
        self.how = f"a CPU quota of {cores:.2f} cores ({group}/{quota_file})"

    def add(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            if p.pid in self.homes:
                continue
            with contextlib.suppress(ProcessLookupError, OSError):
                self.homes[p.pid] = _home(p.pid, self.group.parent)
                (self.group / "cgroup.procs").write_text(str(p.pid))

    def end(self) -> None:
        # The quota goes first: a task moved out of a throttled group can stay asleep until the
        # throttle's period ends, and with the group removed, never wakes.
        unlimited = "max" if self.quota_file == "cpu.max" else "-1"
        with contextlib.suppress(OSError):
            (self.group / self.quota_file).write_text(unlimited)
        for pid, home in self.homes.items():
            with contextlib.suppress(ProcessLookupError, OSError):
                (home / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            self.group.rmdir()


class Stopper(CpuLimit):
    """Processes stopped and continued by a thread of its own.

    The thread runs :meth:`_run`, which subclasses write and :meth:`start` runs; :meth:`end` stops
    the thread and continues them all."""

    def __init__(self, procs: list[psutil.Process]) -> None:
        self.procs, self._done = list(procs), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def add(self, procs: list[psutil.Process]) -> None:
        known = {p.pid for p in self.procs}
        self.procs = [*self.procs, *(p for p in procs if p.pid not in known)]

    def _each(self, action: str) -> None:
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                getattr(p, action)()

    def end(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._each("resume")


class DutyCycle(Stopper):
    """A thread that stops the processes for ``1 - 1/factor`` of every period."""

    def __init__(self, procs: list[psutil.Process], factor: float) -> None:
        super().__init__(procs)
        self.run_s = DUTY_PERIOD_S / factor
        self.stop_s = DUTY_PERIOD_S - self.run_s
        self.how = f"stopped {self.stop_s:.2f} s of every {DUTY_PERIOD_S:.1f} s"
        self.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self._each("suspend")
            self._done.wait(self.stop_s)
            self._each("resume")
            self._done.wait(self.run_s)


def cpu_controller() -> tuple[Path, str] | None:
    """Find where a cgroup with a CPU quota can be made here, and its quota file.

    None if nowhere (no cgroup file system, no CPU controller, or not root)."""
    if os.geteuid() != 0:
        return None
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return CGROUP_ROOT, "cpu.max"
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "cpu.cfs_quota_us"
    return None


def limit_cpu(procs: list[psutil.Process], factor: float, name: str) -> CpuLimit:
    """Slow ``procs`` down by ``factor`` (2.0: half the CPU they were using).

    It uses a cgroup quota where there is one (named ``name``), else a duty cycle."""
    found = cpu_controller()
    if found is not None:
        root, quota_file = found
        group = root / name
        if not group.exists():
            with contextlib.suppress(OSError):
                cores = max(MIN_CORES, used_cores(procs) / factor)
                return CgroupLimit(group, procs, quota_file, cores)
    return DutyCycle(procs, factor)


def used_cores(procs: list[psutil.Process], seconds: float = MEASURE_S) -> float:
    """The cores ``procs`` keep busy together, measured over ``seconds``."""

    def cpu() -> float:
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    before, began = cpu(), time.monotonic()
    time.sleep(seconds)  # a measurement over time, not a wait for an event
    return (cpu() - before) / (time.monotonic() - began)


def _home(pid: int, root: Path) -> Path:
    """The cgroup ``pid`` is in now, under the hierarchy mounted at ``root``."""
    v1 = root.name == "cpu"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "cpu" in controllers.split(",")) or (not v1 and controllers == ""):
            return root / path.lstrip("/")
    return root
