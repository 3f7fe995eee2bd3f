"""chaos/cpu_limit.py on a real busy process: both ways of slowing it cut its CPU, and lift."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from chaos.cpu_limit import CgroupLimit, DutyCycle, cpu_controller, limit_cpu, used_cores

BUSY = "while True: pass"
# What a busy loop that runs at all gets, whatever else the machine runs: the bound that tells
# "running again" from "never woke up" (a task moved out of a throttled group can sleep for
# ever). A share of a core would be a timing bound: beside the suite's other tests on 2 cores,
# a busy loop freed from a quarter-core quota was measured at 0.26 cores (CI, 2026-11-28).
RUNS = 0.05


@pytest.fixture
def busy() -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_duty_cycle_stops_a_busy_process_for_most_of_the_time_and_resumes_it(
    busy: psutil.Process,
) -> None:
    before = used_cores([busy])
    limit = DutyCycle([busy], factor=4.0)
    try:
        during = used_cores([busy], seconds=1.0)
    finally:
        limit.end()
    assert before > RUNS, f"the busy loop used {before:.2f} cores"
    assert during < before / 2, (before, during)
    assert busy.status() != psutil.STATUS_STOPPED
    assert used_cores([busy]) > RUNS  # running again


@pytest.mark.skipif(cpu_controller() is None, reason="no writable cgroup CPU controller here")
def test_a_cgroup_quota_holds_a_busy_process_to_its_share_and_is_removed(
    busy: psutil.Process,
) -> None:
    limit = limit_cpu([busy], factor=4.0, name=f"test-cpu-limit-{busy.pid}")
    assert isinstance(limit, CgroupLimit), limit.how
    try:
        during = used_cores([busy], seconds=1.0)
    finally:
        limit.end()
    assert during < 0.5, (during, limit.how)  # about a quarter of a core
    assert not limit.group.exists()  # removed, so empty: the process went back home
    assert used_cores([busy]) > RUNS  # running again
