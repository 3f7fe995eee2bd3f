"""The growth per recovery that the soak bench (bench/soak.py) prints and its short form
(tests/test_soak.py) holds near zero: chaos/resources.py's arithmetic, and where the device
memory comes from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chaos.resources import WARMUP, Sample, gpu_memory_mb, growth, slope

from .conftest import load_bench

soak = load_bench("soak")


def sample(recovery: int, pid: int, rss: float, fds: int = 10, role: str = "worker") -> Sample:
    return Sample(recovery, "node0", role, 0, pid, rss, fds, 5)


def test_growth_is_the_steepest_slope_of_the_survivors_past_their_warm_up() -> None:
    assert slope([(1, 1.0), (2, 3.0), (3, 5.0)]) == pytest.approx(2.0)
    assert slope([(1, 1.0), (1, 2.0)]) == 0.0
    flat = [sample(r, 1, 100.0 if r > WARMUP else 50.0 * r) for r in range(1, 12)]
    leaking = [sample(r, 2, 100.0 + 40 * r, fds=10 + r) for r in range(1, 12)]
    short = [sample(r, 3, 1000.0 * r) for r in range(1, WARMUP + 3)]  # too few to judge
    joiner = [sample(r, 4, 100.0 * r) for r in range(2, 12)]  # started again: warms up
    found = growth(flat + leaking + short + joiner)["worker"]
    assert found.processes == 2
    assert found.per_recovery["rss_mb"] == pytest.approx(40.0)
    assert found.per_recovery["fds"] == pytest.approx(1.0)
    assert found.worst["rss_mb"] == "node0 worker 0 (pid 2)"
    assert growth(flat)["worker"].per_recovery["rss_mb"] == pytest.approx(0.0)  # warm-up cut


def test_the_soak_bench_spaces_its_faults_by_steps_and_takes_the_kinds_in_turn() -> None:
    args = soak.parse(["--faults=3", "--every-steps=30", "--kinds=kill_node,leave_node"])
    assert soak.spaced(args) == (
        "campaign.faults=["
        "{kind:kill_node,at_step:30,target:not_rank0,min_world:0,duration_s:4.0,"
        "restart_after_s:3.0},"
        "{kind:leave_node,at_step:60,target:not_rank0,min_world:0,duration_s:4.0,"
        "restart_after_s:3.0},"
        "{kind:kill_node,at_step:90,target:not_rank0,min_world:0,duration_s:4.0,"
        "restart_after_s:3.0}]"
    )
    assert "campaign.mtbf_s=0" in soak.overrides(args, Path("/tmp/run"))


def test_the_same_node_pattern_strikes_the_last_node_once_it_is_back_each_time() -> None:
    args = soak.parse(["--pattern=same-node", "--faults=2", "--nodes=3"])
    assert (args.kinds, args.every_steps, args.warmup) == ("kill_node", 30, 20)
    assert soak.spaced(args) == (
        "campaign.faults=["
        "{kind:kill_node,at_step:30,target:node2,min_world:3,duration_s:4.0,"
        "restart_after_s:3.0},"
        "{kind:kill_node,at_step:60,target:node2,min_world:3,duration_s:4.0,"
        "restart_after_s:3.0}]"
    )


def test_device_memory_is_read_only_where_nvml_sees_a_gpu() -> None:
    """No NVML library or no GPU (CI): no process holds device memory, and nothing fails."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: its processes may hold device memory")
    assert gpu_memory_mb() == {}
