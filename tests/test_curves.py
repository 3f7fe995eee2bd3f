"""The run's curves: the events' scalars (pure), rank 0's TensorBoard writer on a real event log
and real event files, read back with TensorBoard's own reader, and ``curves.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic import curves
from elastic import event_types as ev
from elastic.curves import Curves, scalars
from elastic.events import EventLog, read_events
from launcher.curves_png import draw
from launcher.progress import summary

STEP = {
    "ts": 100.0,
    "event": "step",
    "step": 7,
    "samples": 112,
    "step_samples": 16,
    "global_batch": 16,
    "epoch": 0,
    "loss": 2.5,
    "lr": 0.1,
    "world_size": 2,
    "samples_per_s": 40.0,
}
RECOVERED = {
    "event": "recovered",
    "step": 9,
    "world_size": 1,
    "interrupted_at": 200.0,
    "formed_at": 200.5,
    "first_step_at": 202.0,
    "rendezvous_s": 0.5,
    "rebuild_s": 0.25,
    "sync_s": 0.125,
    "first_step_s": 0.5,
}


def test_a_step_gives_loss_lr_pace_and_world_size_at_its_step() -> None:
    assert scalars(STEP) == [
        ("train/loss", 2.5, 7),
        ("train/lr", 0.1, 7),
        ("train/samples_per_s", 40.0, 7),
        ("train/world_size", 2.0, 7),
    ]
    assert ("train/loss_scale", 1024.0, 7) in scalars({**STEP, "loss_scale": 1024.0})
    assert ("train/accuracy", 0.5, 7) in scalars({**STEP, "metrics": {"accuracy": 0.5}})


def test_recoveries_checkpoints_evaluations_and_faults_have_their_figures() -> None:
    assert scalars(RECOVERED) == [
        ("recovery/stall_s", 2.0, 9),
        ("recovery/rendezvous_s", 0.5, 9),
        ("recovery/rebuild_s", 0.25, 9),
        ("recovery/sync_s", 0.125, 9),
        ("recovery/first_step_s", 0.5, 9),
    ]
    saved = {"event": "checkpoint_saved", "step": 10, "seconds": 1.5, "stall_s": 0.02, "bytes": 9}
    assert scalars(saved) == [
        ("checkpoint/seconds", 1.5, 10),
        ("checkpoint/stall_s", 0.02, 10),
        ("checkpoint/bytes", 9.0, 10),
    ]
    assert scalars({"event": "checkpoint_failed", "step": 20}) == [("checkpoint/failed", 1.0, 20)]
    evaluated = {"event": "evaluated", "step": 30, "top1": 0.5, "top5": 0.75, "loss": 1.25}
    assert scalars(evaluated) == [
        ("eval/top1", 0.5, 30),
        ("eval/top5", 0.75, 30),
        ("eval/loss", 1.25, 30),
    ]
    back = {"event": "rolled_back", "step": 33, "to_step": 30}
    assert scalars(back) == [("faults/rollback_steps_lost", 3.0, 33)]
    assert scalars({**back, "to_step": None}) == [("faults/rollback_steps_lost", 0.0, 33)]
    nonfinite = {"event": "step_nonfinite", "step": 31, "streak": 2}
    assert scalars(nonfinite) == [("faults/nonfinite_streak", 2.0, 31)]
    skipped = {"event": "step_skipped", "step": 32, "scale": 512.0}
    assert scalars(skipped) == [("faults/fp16_skipped_scale", 512.0, 32)]
    started = {"event": "training_started", "step": 40, "world_size": 3}
    assert scalars(started) == [("train/world_size", 3.0, 40)]
    assert scalars({"event": "round_formed", "round": 2}) == []


def test_the_scalars_read_only_fields_their_events_declare() -> None:
    for name in curves.SCALARS:
        kind = ev.declared(name)
        event = {field: 1 for field in kind.fields | ev.COMMON} | {"event": name}
        if "metrics" in event:  # a job's metrics (elastic.job.Loss): a name for each figure
            event["metrics"] = {"accuracy": 1}
        for tag, value, step in scalars(event):
            assert isinstance(tag, str) and isinstance(value, float) and step == 1


def read_back(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def emit_step(events: EventLog, step: int, loss: float) -> None:
    fields = {k: v for k, v in STEP.items() if k not in ("ts", "event")}
    events.emit(ev.STEP, **{**fields, "step": step, "loss": loss})


def test_only_a_worker_at_rank_0_writes_and_it_stops_when_it_is_no_longer_rank_0(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    events = EventLog(tmp_path, "node0", role="worker")
    writer = Curves(events, tmp_path, enabled=True)
    writer.follow(1)
    emit_step(events, 1, 4.0)  # rank 1: not written
    writer.follow(0)
    emit_step(events, 2, 3.0)
    events.emit(ev.RECOVERED, **{k: v for k, v in RECOVERED.items() if k != "event"})
    writer.follow(1)  # another worker holds rank 0 now
    emit_step(events, 3, 2.0)
    writer.close()
    writer.follow(0)  # and back: a new file beside the first
    emit_step(events, 4, 1.0)
    writer.close()
    assert events.sink is None
    found = read_back(tmp_path / "tensorboard")
    assert found["train/loss"] == [(2, 3.0), (4, 1.0)]
    assert found["recovery/stall_s"] == [(9, 2.0)]
    assert {"train/lr", "train/samples_per_s", "train/world_size"} <= found.keys()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_without_tensorboard_or_when_switched_off_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = EventLog(tmp_path, "node0", role="worker")
    Curves(events, tmp_path, enabled=False).follow(0)
    monkeypatch.setattr(curves, "summary_writer", lambda: None)
    missing = Curves(events, tmp_path, enabled=True)
    missing.follow(1)
    missing.follow(0)
    missing.follow(0)  # said once
    emit_step(events, 1, 1.0)
    missing.close()
    assert events.sink is None and not (tmp_path / "tensorboard").exists()
    off = ev.CURVES_OFF.of(read_events(tmp_path))
    assert [e["reason"] for e in off] == ["tensorboard is not installed"]


class FullDisk:
    """A SummaryWriter whose file system is full."""

    def __init__(self, **kwargs: Any) -> None:
        self.closed = False

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        self.closed = True


def test_a_writer_that_fails_stops_the_curves_and_never_the_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(curves, "summary_writer", lambda: FullDisk)
    events = EventLog(tmp_path, "node0", role="worker")
    writer = Curves(events, tmp_path, enabled=True)
    writer.follow(0)
    emit_step(events, 1, 1.0)  # the emit returns; the writer thread fails
    writer.close()
    assert events.sink is None
    (off,) = ev.CURVES_OFF.of(read_events(tmp_path))
    assert "No space left on device" in off["reason"]


def synthetic_run() -> list[dict[str, Any]]:
    """Ten steps at world size 2, a recovery at step 6 at world size 1, an evaluation at steps
    5 and 10, and a rollback from step 9 to 8 (steps 9 trained twice)."""
    events: list[dict[str, Any]] = []
    ts = 1000.0
    for step in [*range(1, 10), 9, 10]:
        ts += 1
        world = 2 if step < 6 else 1
        events.append({**STEP, "ts": ts, "step": step, "loss": 3.0 / step, "world_size": world})
        if step == 6:
            events.append({**RECOVERED, "ts": ts, "step": 6})
        if step in (5, 10):
            evaluated = {"event": "evaluated", "ts": ts, "step": step, "loss": 1.0}
            events.append({**evaluated, "top1": step / 20, "top5": step / 12})
        if step == 9 and not any(e["event"] == "rolled_back" for e in events):
            events += [
                {"event": "rolled_back", "ts": ts, "step": 9, "to_step": 8, "rank": r}
                for r in (0, 1)
            ]
    return events


def test_curves_png_is_drawn_from_the_events_and_named_in_the_summary(tmp_path: Path) -> None:
    path = tmp_path / "curves.png"
    assert draw(synthetic_run(), path, "job test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no partial file left
    assert not draw([e for e in synthetic_run() if e["event"] != "step"], tmp_path / "none.png", "")
    assert not (tmp_path / "none.png").exists()
    (tmp_path / "tensorboard").mkdir()
    text = summary(tmp_path, "file:///ckpt", "test")
    assert f"curves:        {path}" in text
    assert f"tensorboard --logdir {tmp_path / 'tensorboard'}" in text
