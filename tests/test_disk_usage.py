"""A run directory's disk use by part (launcher/commands/disk_usage.py), on real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.events import EventLog
from launcher.commands.disk_usage import main, step_rate, usage


def test_each_part_counts_the_files_under_it_and_the_rest_is_other(tmp_path: Path) -> None:
    sizes = {
        "events/node0.jsonl": 10,
        "events/node0.jsonl.1": 20,
        "logs/node0.log": 3,
        "logs/node0/worker0.log": 4,
        "checkpoints/step_000000020/__0_0.distcp": 500,
        "config.yaml": 7,
        "chaos/report.json": 8,
    }
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    (tmp_path / "logs" / "link").symlink_to(tmp_path / "checkpoints")  # not followed
    assert usage(tmp_path) == {
        "events": 30,
        "logs": 7,
        "checkpoints": 500,
        "tensorboard": 0,
        "etcd": 0,
        "other": 15,
    }


def test_the_step_rate_is_taken_between_the_first_and_the_newest_step() -> None:
    steps = [{"event": "step", "ts": 100.0 + s / 2, "step": s} for s in (3, 1, 2, 5)]
    assert step_rate([*steps, {"event": "round_formed", "ts": 99.0}]) == (5, 2.0)
    assert step_rate(steps[:1]) == (3, None)
    assert step_rate([]) == (0, None)


def test_the_command_prints_each_part_per_step_and_per_day(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = EventLog(tmp_path, "node0", role="worker")
    for step in (1, 2):
        log.emit("step", step=step)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 steps trained" in out and "MB/day at" in out
    events = next(line for line in out.splitlines() if line.startswith("events"))
    assert int(events.split()[1].replace(",", "")) == usage(tmp_path)["events"]
    assert main([str(tmp_path / "absent")]) == 2
