"""Chaos campaigns' pure parts: the seeded schedule, target picks, the checks on a campaign, and
the goodput arithmetic, on literal inputs; and the faults of what nodes share (a corrupted
shard, a full disk) on real files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chaos.campaign import CampaignConfig, FaultKind, FaultSpec, pick, problems, schedule
from chaos.cli import nothing_to_judge, split
from chaos.injectors import TargetNotFound, clear_disk, corrupt_shard, fill_disk
from chaos.runner import due
from chaos.timeline import phases
from chaos.verdict import (
    capacity,
    checkpoint_violations,
    fault_free_rate,
    goodput,
    observed_rates,
    world_segments,
    world_sizes,
)
from elastic.events import read_events

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


def test_targets_are_picked_among_the_nodes_up_the_same_way_every_time() -> None:
    up = ["node0", "node1", "node2"]
    assert pick("rank0", up, "node1", 0, 1) == "node1"
    others = {pick("not_rank0", up, "node1", 0, n) for n in range(1, 30)}
    assert others == {"node0", "node2"}
    assert pick("not_rank0", up, "node1", 3, 4) == pick("not_rank0", up, "node1", 3, 4)
    assert pick("node2", up, "node0", 0, 1) == "node2"
    assert pick("node2", ["node0", "node1"], "node0", 0, 1) is None  # down: skipped
    assert pick("not_rank0", ["node0"], "node0", 0, 1) is None


def test_a_campaign_that_cannot_run_names_each_key_and_its_fix() -> None:
    bad = CampaignConfig(
        faults=[
            FaultSpec(at_step=3, at_s=2.0),
            FaultSpec(at_step=1, target="node7"),
            FaultSpec(kind=FaultKind.freeze_node, at_step=1, duration_s=0),
            FaultSpec(kind=FaultKind.fill_disk, at_step=1, duration_s=-1),
        ],
        etcd_members=2,
        baseline_steps=2,
    )
    found = problems(bad, nodes=3)
    keys = [p.split("=")[0] for p in found]
    assert keys == [
        "campaign.faults[0].at_step/at_s",
        "campaign.faults[1].target",
        "campaign.faults[2].duration_s",
        "campaign.faults[3].duration_s",
        "campaign.etcd_members",
        "campaign.baseline_steps",
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
    assert world_sizes(segments, min_nodes=1) == [3, 2]
    assert world_sizes(segments, min_nodes=3) == [3]


def test_the_nodes_up_at_first_are_the_first_rounds_whatever_their_names() -> None:
    events = [
        {"ts": 1.0, "event": "round_formed", "members": ["gpu-a", "gpu-b"]},
        chaos(10.0, "fault_injected", "node", "gpu-b", "SIGKILL"),
    ]
    assert capacity(events, 2, 0.0, 20.0) == [(0.0, 10.0, 2), (10.0, 20.0, 1)]


def test_rates_observed_in_the_campaign_leave_out_stalls_and_scale_to_unseen_sizes() -> None:
    def step(ts: float, samples: int, world: int, rnd: int) -> dict:
        return {"event": "step", "ts": ts, "samples": samples, "world_size": world, "round": rnd}

    steps = [step(0.0, 0, 2, 1), step(1.0, 20, 2, 1), step(2.0, 40, 2, 1), step(3.0, 60, 2, 1)]
    steps += [step(9.0, 70, 1, 2), step(10.0, 80, 1, 2)]  # the 6 s stall between rounds is left out
    assert observed_rates(steps, nodes=3) == {2: 20.0, 1: 10.0, 3: 30.0}  # 3 scaled from 2
    assert observed_rates(steps[:1], nodes=3) == {}


def test_goodput_charges_lost_time_but_not_the_capacity_of_dead_nodes() -> None:
    segments = [(0.0, 10.0, 3), (10.0, 20.0, 2)]
    rates = {3: 30.0, 2: 20.0}
    reference, ratio = goodput(500, segments, rates, min_nodes=1)
    assert reference == 500.0 and ratio == 1.0  # trained all a fault-free run would have
    assert goodput(450, segments, rates, min_nodes=1)[1] == pytest.approx(0.9)
    assert goodput(300, segments, rates, min_nodes=3) == (300.0, 1.0)  # 2 nodes cannot train


def test_each_step_counts_at_the_world_size_that_trained_it_stall_included() -> None:
    steps = [{"event": "step", "ts": t, "world_size": w} for t, w in ((0.0, 3), (1.0, 3), (4.0, 2))]
    assert world_segments(steps) == [(0.0, 1.0, 3), (1.0, 4.0, 2)]  # the stall, at world 2


def test_the_fault_free_rate_spans_the_run_from_its_first_step_to_its_last() -> None:
    steps = [{"event": "step", "ts": t, "samples": s} for t, s in ((1.0, 24), (2.0, 48), (5.0, 96))]
    assert fault_free_rate(steps) == pytest.approx(18.0)
    with pytest.raises(ValueError, match="two steps"):
        fault_free_rate(steps[:1])


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


def committed_checkpoint(root: Path, step: int, shard: bytes, commit: bool = True) -> Path:
    folder = root / f"step_{step:09d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(shard)
    (folder / ".metadata").write_bytes(b"m")
    if commit:
        files = {"__0_0.distcp": {"size": len(shard)}, ".metadata": {"size": 1}}
        (folder / "manifest.json").write_text(json.dumps({"step": step, "files": files}))
    return folder


def test_a_corrupted_shard_is_the_largest_of_the_newest_committed_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    committed_checkpoint(root, 5, b"a" * 9)
    newest = committed_checkpoint(root, 10, b"b" * 9)
    committed_checkpoint(root, 15, b"c" * 9, commit=False)  # a save cut short: passed over
    corrupt_shard(tmp_path / "run", f"file://{root}")
    assert (newest / "__0_0.distcp").read_bytes() == b"bbbb" + bytes([ord("b") ^ 0xFF]) + b"bbbb"
    assert (root / "step_000000005" / "__0_0.distcp").read_bytes() == b"a" * 9
    hit = read_events(tmp_path / "run")[-1]
    assert hit["kind"] == "checkpoint" and hit["target"] == "step_000000010/__0_0.distcp"
    with pytest.raises(TargetNotFound, match="no committed checkpoint"):
        corrupt_shard(tmp_path / "run", f"file://{tmp_path / 'none'}")


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
