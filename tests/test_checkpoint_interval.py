"""The checkpoint interval: a pure function of the settings and the last save's figures."""

from __future__ import annotations

import math

import pytest

from elastic.checkpoint_interval import (
    LLAMA3_GPU_HOURS_PER_INTERRUPTION,
    Measured,
    choose_interval,
    job_mtbf_hours,
)
from elastic.config import CheckpointConfig, CheckpointInterval

AUTO = CheckpointConfig(interval=CheckpointInterval.auto, every_steps=50)


def test_before_anything_is_measured_every_steps_holds() -> None:
    for cfg in (CheckpointConfig(every_steps=7), AUTO, CheckpointConfig(every_minutes=1)):
        assert choose_interval(cfg, None, 8).steps == cfg.every_steps
    zero = Measured(step_s=0.0, stall_s=0.1, write_s=1.0)  # the last save of a run
    assert choose_interval(AUTO, zero, 8).steps == 50


def test_auto_is_young_daly_from_the_stall_and_the_mtbf() -> None:
    """sqrt(2 x 0.05 s x 100 h) = 189.7 s; at 0.5 s a step, 380 steps."""
    cfg = CheckpointConfig(interval=CheckpointInterval.auto, mtbf_hours=100)
    got = choose_interval(cfg, Measured(step_s=0.5, stall_s=0.05, write_s=2.0), 16)
    assert got.steps == math.ceil(math.sqrt(2 * 0.05 * 100 * 3600) / 0.5) == 380
    assert "Young/Daly" in got.reason and "100 h MTBF" in got.reason


def test_auto_never_saves_more_often_than_a_save_takes_to_write() -> None:
    cfg = CheckpointConfig(interval=CheckpointInterval.auto, mtbf_hours=0.001)  # 3.6 s
    got = choose_interval(cfg, Measured(step_s=0.25, stall_s=0.02, write_s=30.0), 4)
    assert got.steps == 120 and "30.00 s a save takes to write" in got.reason


def test_the_default_mtbf_is_llama3s_rate_scaled_to_the_jobs_gpus() -> None:
    assert round(LLAMA3_GPU_HOURS_PER_INTERRUPTION) == 50_677
    assert job_mtbf_hours(CheckpointConfig(), 16_384) == pytest.approx(54 * 24 / 419)
    assert job_mtbf_hours(CheckpointConfig(mtbf_hours=5), 16_384) == 5
    # A larger job fails more often, so it checkpoints more often.
    slow = Measured(step_s=1.0, stall_s=0.1, write_s=1.0)
    assert choose_interval(AUTO, slow, 1024).steps < choose_interval(AUTO, slow, 8).steps


def test_every_minutes_applies_when_it_comes_before_every_steps() -> None:
    cfg = CheckpointConfig(every_steps=1000, every_minutes=2)
    got = choose_interval(cfg, Measured(step_s=0.5, stall_s=0.0, write_s=0.0), 2)
    assert got.steps == 240 and "every_minutes=2" in got.reason
    cfg = CheckpointConfig(every_steps=100, every_minutes=2)
    assert choose_interval(cfg, Measured(step_s=0.5, stall_s=0.0, write_s=0.0), 2).steps == 100


def test_the_worst_rank_decides_so_every_rank_agrees() -> None:
    gathered = [
        {"step_s": 0.5, "stall_s": 0.01, "write_s": 3.0, "files": {}},
        {"step_s": 0.7, "stall_s": 0.03, "write_s": 2.0, "files": {}},
    ]
    assert Measured.worst(gathered) == Measured(step_s=0.7, stall_s=0.03, write_s=3.0)
    assert Measured.worst(gathered[::-1]) == Measured.worst(gathered)
