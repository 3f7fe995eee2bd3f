"""Chaos campaigns' pure parts: the seeded schedule, target picks, the checks on a campaign, and
the goodput arithmetic, on literal inputs; and the faults of what nodes share (a corrupted
shard, a full disk) on real files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest

from chaos.campaign import CampaignConfig, FaultKind, FaultSpec, pick, problems, schedule
from chaos.cli import nothing_to_judge, split
from chaos.injectors import clear_disk, corrupt_shard, fill_disk
from chaos.runner import Slowed, due
from chaos.timeline import levels, phases, smoothed
from chaos.verdict import (
    Interval,
    capacity,
    checkpoint_violations,
    fault_free_goodput,
    goodput,
    intervals,
    pace,
)
from elastic import event_types as ev
from elastic.events import read_events
from elastic.manifest import FORMAT, file_record
from launcher.agent.fault_helper import TargetNotFound

from .conftest import small_tmpfs


def test_a_random_campaign_replays_exactly_from_its_seed_and_differs_for_another() -> None:
    c = CampaignConfig(mtbf_s=60, count=20, seed=7)
    first, again = schedule(c), schedule(c)
    assert first == again
    assert schedule(CampaignConfig(mtbf_s=60, count=20, seed=8)) != first
    times = [f.at_s for f in first]
    assert times == sorted(times) and len(times) == 20
    assert 20 < sum(b - a for a, b in zip(times, times[1:], strict=False)) / 19 < 180  # ~60 s
    assert {f.kind for f in first} <= set(c.kinds)


def test_written_faults_come_first_in_step_order_then_by_time() -> None:
    c = CampaignConfig(
        faults=[
            FaultSpec(kind=FaultKind.freeze_node, at_s=3.0),
            FaultSpec(kind=FaultKind.kill_node, at_step=20),
            FaultSpec(kind=FaultKind.kill_worker, at_step=5),
        ]
    )
    assert [f.kind for f in schedule(c)] == [
        FaultKind.kill_worker,
        FaultKind.kill_node,
        FaultKind.freeze_node,
    ]


def test_a_fault_is_due_at_its_step_or_its_second() -> None:
    assert not due(FaultSpec(at_step=10), step=9, since_start=99.0)
    assert due(FaultSpec(at_step=10), step=10, since_start=0.0)
    assert not due(FaultSpec(at_s=5.0), step=99, since_start=4.9)
    assert due(FaultSpec(at_s=5.0), step=0, since_start=5.0)
    # A node struck before must be back: not before the job trains at 3 ranks again.
    assert not due(FaultSpec(at_step=10, min_world=3), step=40, since_start=9.0, world=2)
    assert due(FaultSpec(at_step=10, min_world=3), step=40, since_start=9.0, world=3)


def test_targets_are_picked_among_the_nodes_up_the_same_way_every_time() -> None:
    up = ["node0", "node1", "node2"]
    assert pick("rank0", up, "node1", 0, 1) == "node1"
    others = {pick("not_rank0", up, "node1", 0, n) for n in range(1, 30)}
    assert others == {"node0", "node2"}
    assert pick("not_rank0", up, "node1", 3, 4) == pick("not_rank0", up, "node1", 3, 4)
    assert pick("node2", up, "node0", 0, 1) == "node2"
    assert pick("node2", ["node0", "node1"], "node0", 0, 1) is None  # down: skipped
    assert pick("not_rank0", ["node0"], "node0", 0, 1) is None


def test_a_slow_node_is_lifted_by_a_naming_logged_after_it_was_slowed_only() -> None:
    """CI at 18f448f: node2 was named a straggler (by load) 0.27 s before the slowdown struck,
    that event was read after the strike and lifted the slowdown at once, so the slowdown was
    never named."""
    slow = Slowed(None, until=160.0, until_named=True, since=100.0)  # type: ignore[arg-type]
    named = {"event": ev.STRAGGLER.name, "node": "node2"}
    assert not slow.lifted_by({**named, "ts": 99.73})
    assert slow.lifted_by({**named, "ts": 104.0})
    assert not slow.lifted_by({"event": ev.STEP.name, "node": "node2", "ts": 104.0})
    assert not slow._replace(until_named=False).lifted_by({**named, "ts": 104.0})


def test_a_campaign_that_cannot_run_names_each_key_and_its_fix() -> None:
    bad = CampaignConfig(
        faults=[
            FaultSpec(at_step=3, at_s=2.0),
            FaultSpec(at_step=1, target="node7"),
            FaultSpec(kind=FaultKind.freeze_node, at_step=1, duration_s=0),
            FaultSpec(kind=FaultKind.fill_disk, at_step=1, duration_s=-1),
            FaultSpec(kind=FaultKind.freeze_node, at_step=1, until_named=True),
        ],
        etcd_members=2,
    )
    found = problems(bad, nodes=3)
    keys = [p.split("=")[0] for p in found]
    assert keys == [
        "campaign.faults[0].at_step/at_s",
        "campaign.faults[1].target",
        "campaign.faults[2].duration_s",
        "campaign.faults[3].duration_s",
        "campaign.faults[4].until_named",
        "campaign.etcd_members",
    ]
    assert all("Fix:" in p for p in found)
    empty = problems(CampaignConfig(), nodes=3)
    assert len(empty) == 1 and "no fault" in empty[0]


def test_campaign_overrides_are_told_from_the_jobs() -> None:
    ours, job = split(["campaign=random", "campaign.seed=3", "cluster.nodes=3", "trainer.epochs=2"])
    assert ours == ["campaign=random", "campaign.seed=3"]
    assert job == ["cluster.nodes=3", "trainer.epochs=2"]


def chaos(ts: float, event: str, kind: str, target: str, signal: str = "") -> dict:
    e = {"ts": ts, "event": event, "role": "chaos", "kind": kind, "target": target}
    return e | ({"signal": signal} if signal else {})


def test_the_nodes_up_follow_kills_freezes_thaws_and_restarts() -> None:
    events = [
        chaos(10.0, "fault_injected", "node", "node1", "SIGKILL"),
        chaos(13.0, "fault_cleared", "restart", "node1"),
        chaos(20.0, "fault_injected", "worker", "node2", "SIGKILL"),  # the node stays up
        chaos(30.0, "fault_injected", "node", "node2", "SIGSTOP"),
        chaos(34.0, "fault_cleared", "node", "node2", "SIGCONT"),
    ]
    segments = capacity(events, 3, 0.0, 50.0)
    assert segments == [(0.0, 10.0, 3), (10.0, 13.0, 2), (13.0, 30.0, 3), (30.0, 34.0, 2),
                        (34.0, 50.0, 3)]  # fmt: skip


def test_the_nodes_up_at_first_are_the_first_rounds_whatever_their_names() -> None:
    events = [
        {"ts": 1.0, "event": "round_formed", "members": ["gpu-a", "gpu-b"]},
        chaos(10.0, "fault_injected", "node", "gpu-b", "SIGKILL"),
    ]
    assert capacity(events, 2, 0.0, 20.0) == [(0.0, 10.0, 2), (10.0, 20.0, 1)]


def step(ts: float, samples: int, world: int, rnd: int = 1) -> dict:
    return {"event": "step", "ts": ts, "samples": samples, "world_size": world, "round": rnd}


def test_the_pace_leaves_out_stalls_and_scales_to_unseen_sizes() -> None:
    steps = [step(0.0, 0, 2), step(1.0, 20, 2), step(2.0, 40, 2), step(3.0, 60, 2)]
    steps += [step(9.0, 70, 1, 2), step(10.0, 80, 1, 2)]  # the 6 s stall between rounds is left out
    assert pace(steps, nodes=3) == {2: 20.0, 1: 10.0, 3: 30.0}  # 3 scaled from 2
    assert pace(steps[:1], nodes=3) == {}


def test_each_step_counts_at_the_world_size_that_trained_it_stall_included() -> None:
    steps = [step(0.0, 0, 3), step(1.0, 30, 3), step(4.0, 50, 2, 2), step(5.0, 40, 2, 3)]
    assert intervals(steps) == [
        Interval(0.0, 1.0, 3, 30),
        Interval(1.0, 4.0, 2, 20),  # the stall, at world 2
        Interval(4.0, 5.0, 2, 0),  # a rollback gains nothing
    ]


def test_goodput_charges_lost_time_but_not_the_capacity_of_dead_nodes() -> None:
    spans = [Interval(0.0, 10.0, 3, 300), Interval(10.0, 20.0, 2, 200)]
    rates = {3: 30.0, 2: 20.0}
    assert goodput(500, spans, rates, min_nodes=1) == (500.0, 1.0)  # all the pace allows
    assert goodput(450, spans, rates, min_nodes=1)[1] == pytest.approx(0.9)  # 50 redone
    stalled = [Interval(0.0, 10.0, 3, 300), Interval(10.0, 15.0, 2, 0), *spans[1:]]
    assert goodput(500, stalled, rates, min_nodes=1) == (600.0, pytest.approx(5 / 6))


def test_goodput_never_exceeds_one_a_fast_window_earning_no_credit_for_a_slow_one() -> None:
    rates = {2: 20.0}
    fast_and_slow = [Interval(0.0, 0.5, 2, 20), Interval(0.5, 2.0, 2, 20)]  # 0.5 s and 1.5 s
    reference, ratio = goodput(40, fast_and_slow, rates, min_nodes=1, window_s=0)  # each alone
    assert reference == 50.0 and ratio == 0.8  # not 40 / (20 x 2 s) = 1.0
    assert goodput(20, [Interval(0.0, 0.1, 2, 20)], rates, min_nodes=1)[1] == 1.0


def paced_steps(durations: list[float], t: float = 0.0) -> list[Interval]:
    """Steps of 20 samples at world size 2 that took ``durations``, from ``t``."""
    steps = []
    for d in durations:
        steps.append(Interval(t, t + d, 2, 20))
        t += d
    return steps


def test_within_a_window_the_jitter_of_steps_evens_out_and_a_stall_does_not() -> None:
    rates = {2: 20.0}
    steps = paced_steps([0.5, 1.5] * 10)  # 20 s of steps, a second apart on average
    assert goodput(400, steps, rates, min_nodes=1) == (400.0, 1.0)  # two windows, each even
    assert goodput(400, steps, rates, min_nodes=1, window_s=0)[1] == pytest.approx(400 / 500)
    stall = Interval(10.0, 15.0, 2, 20)  # 5 s to the first step of the next round
    stalled = [*steps[:10], stall, *paced_steps([0.5, 1.5] * 5, t=15.0)]
    reference, ratio = goodput(420, stalled, rates, min_nodes=1)
    assert reference == 500.0 and ratio == pytest.approx(420 / 500)  # the stall, charged


def test_goodput_of_the_nodes_up_counts_each_moment_at_the_pace_of_the_nodes_up() -> None:
    spans = [Interval(0.0, 10.0, 2, 200), Interval(10.0, 20.0, 2, 200)]
    up = [(0.0, 5.0, 3), (5.0, 20.0, 2)]  # a third node was up for the first 5 s
    rates = {3: 30.0, 2: 20.0}
    assert goodput(400, spans, rates, min_nodes=1, up=up) == (450.0, pytest.approx(400 / 450))
    assert goodput(400, spans, rates, min_nodes=3, up=up) == (400.0, 1.0)  # 2 cannot train


def test_the_fault_free_goodput_is_that_of_the_steps_before_the_first_fault() -> None:
    steps = [step(float(t), 10 * t, 1) for t in range(12)]
    steps += [step(12.5, 120, 1)]  # a slow step after the fault: not counted
    fault = {"event": "fault_injected", "ts": 11.5}
    spans = intervals(steps)
    assert fault_free_goodput([*steps, fault], spans, {1: 10.0}, min_nodes=1) == 1.0
    early = {"event": "fault_injected", "ts": 5.5}
    assert fault_free_goodput([*steps, early], spans, {1: 10.0}, min_nodes=1) is None


def test_a_loaded_checkpoint_must_be_committed_and_not_rejected() -> None:
    saved = {"event": "checkpoint_saved", "url": "a", "step": 5}
    loaded = {"event": "checkpoint_loaded", "url": "a", "step": 5}
    assert checkpoint_violations([saved, loaded]) == []
    rejected = {"event": "checkpoint_skipped", "url": "a", "reason": "hash"}
    assert "failed its manifest" in checkpoint_violations([saved, rejected, loaded])[0]
    assert "no rank committed" in checkpoint_violations([loaded])[0]


def test_a_recovery_is_drawn_as_consecutive_phases() -> None:
    breakdown = {
        "detected": 0.1,
        "round_formed": 0.3,
        "training_started": 0.6,
        "rebuild": 0.1,
        "sync": 0.2,
        "first_step": 0.4,
    }
    spans = phases(breakdown)
    assert [label for label, _, _ in spans] == [
        "detection", "rendezvous", "rebuild", "sync", "first step"
    ]  # fmt: skip
    ends = [0.1, 0.3, 0.4, 0.6, 1.0]
    assert [round(end, 6) for _, _, end in spans] == ends
    assert phases({"detected": 0.1}) == []  # training never started again: nothing to draw


def test_the_smoothed_rate_spans_its_window_and_a_rollback_is_no_negative_rate() -> None:
    times = [0.0, 1.0, 2.0, 3.0, 4.0]
    samples = [0, 10, 30, 60, 20]  # the last step after a rollback
    assert smoothed(times, samples, window_s=2.0) == [0.0, 10.0, 15.0, 25.0, 0.0]


def test_labels_close_together_are_stacked_and_never_overlap() -> None:
    spans = [(0.0, 10.0), (5.0, 15.0), (12.0, 20.0), (16.0, 25.0), (40.0, 50.0)]
    rows = levels(spans)
    assert rows == [0, 1, 0, 1, 0]
    for (a, b), r in zip(spans, rows, strict=True):
        for (c, d), q in zip(spans, rows, strict=True):
            assert (a, b) == (c, d) or r != q or b < c or d < a


def committed_checkpoint(root: Path, step: int, shard: bytes, commit: bool = True) -> Path:
    """A checkpoint folder whose manifest records its files as a save does."""
    folder = root / f"step_{step:09d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(shard)
    (folder / ".metadata").write_bytes(b"m")
    if commit:
        fs = fsspec.filesystem("file")
        files = {n: file_record(fs, str(folder / n)) for n in ("__0_0.distcp", ".metadata")}
        manifest = {"format": FORMAT, "step": step, "files": files}
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_corrupted_shard_is_the_largest_of_the_newest_committed_checkpoint_and_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    committed_checkpoint(root, 5, b"a" * 9)
    newest = committed_checkpoint(root, 10, b"b" * 9)
    committed_checkpoint(root, 15, b"c" * 9, commit=False)  # a save cut short: passed over
    corrupt_shard(tmp_path / "run", f"file://{root}")
    assert (newest / "__0_0.distcp").read_bytes() == b"bbbb" + bytes([ord("b") ^ 0xFF]) + b"bbbb"
    assert (root / "step_000000005" / "__0_0.distcp").read_bytes() == b"a" * 9
    hit, verified = read_events(tmp_path / "run")[-2:]
    assert hit["kind"] == "checkpoint" and hit["target"] == "step_000000010/__0_0.distcp"
    assert verified["event"] == "checkpoint_verified" and verified["target"] == hit["target"]
    assert verified["refused"] == "__0_0.distcp does not match its checksum"
    assert checkpoint_violations([hit, verified]) == []
    with pytest.raises(TargetNotFound, match="no committed checkpoint"):
        corrupt_shard(tmp_path / "run", f"file://{tmp_path / 'none'}")


def test_a_corrupted_shard_that_passed_or_missed_its_verification_is_a_violation() -> None:
    hit = {"event": "fault_injected", "kind": "checkpoint", "target": "step_000000010/a"}
    passed = {"event": "checkpoint_verified", "target": hit["target"], "refused": None}
    assert "verification passed it" in checkpoint_violations([hit, passed])[0]
    assert "never verified" in checkpoint_violations([hit])[0]


def test_a_disk_is_filled_only_where_it_is_small_and_its_ballast_goes_after(tmp_path: Path) -> None:
    with pytest.raises(TargetNotFound, match="campaign.fill_limit_gb"):
        fill_disk(tmp_path / "run", tmp_path, keep_mb=1, limit_gb=0.0001)  # this machine's disk
    with small_tmpfs(tmp_path / "small", size_mb=40) as small:
        ballast = fill_disk(tmp_path / "run", small, keep_mb=2, limit_gb=1)
        assert shutil.disk_usage(small).free <= 2 * 2**20
        clear_disk(tmp_path / "run", ballast)
        assert not ballast.exists() and shutil.disk_usage(small).free > 30 * 2**20
    kinds = [(e["event"], e["kind"]) for e in read_events(tmp_path / "run")]
    assert kinds == [("fault_injected", "disk"), ("fault_cleared", "disk")]


def test_a_job_that_never_trained_is_named_not_judged(tmp_path: Path) -> None:
    refused = {
        "event": "health_failed",
        "node": "node0",
        "failures": ["checkpoint_disk: /ckpt has 0.25 GB free, below the 1.00 GB needed"],
    }
    why = nothing_to_judge([refused], tmp_path)
    assert why is not None and "node0 failed checkpoint_disk: /ckpt" in why and str(tmp_path) in why
    steps = [{"event": "step", "step": 1}, {"event": "step", "step": 2}]
    assert nothing_to_judge([refused, *steps], tmp_path) is None
