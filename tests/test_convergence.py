"""The training the runtime protects still learns: the seeds' large-batch recipes on real
learnable data, with a node killed mid-run, reach a stated validation accuracy while every
invariant of a chaos run holds.

The data is the synthetic ImageFolder (10 classes of 64 JPEGs, 16 more per class held out for
validation); the global batch is a tenth of the epoch, large for the data set as 32k is for
ImageNet. One job per optimizer, each killing one of its two nodes after a third of the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.injectors import kill_node, node_with_rank
from chaos.invariants import (
    history_violations,
    lr_violations,
    replica_violations,
    sample_violations,
)
from elastic import config
from elastic.events import read_events

from .conftest import launch, output
from .test_e2e import wait_event, wait_exit

SAMPLES_PER_EPOCH = 640
EPOCHS = 8
STEPS_PER_EPOCH = 10  # 2 nodes x 32 images
# The top-1 each recipe must reach on the 160 held-out images (chance: 10 %). Measured on a
# 2-core machine (2026-11-23), evaluations after epochs 2/4/6/8: goyal 0.669, 0.863, 0.963, 0.981
# (margin 8 points); lars 0.919, 0.988, 0.994, 1.000 (margin 10 points).
RECIPES = {
    "goyal": (
        0.90,
        [
            "optim=goyal",
            "optim.lr=0.4",  # 0.1 at the global batch of 64
            "optim.warmup_epochs=1",
            "optim.milestones_epochs=[6]",
        ],
    ),
    "lars": (
        0.90,
        [
            "optim=lars",
            "optim.lr=2.0",
            "optim.warmup_epochs=1",
            "optim.weight_decay=1e-4",
            "model.bn_stats=last_batch",  # Akiba's BN: evaluated with the last batch's statistics
        ],
    ),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_large_batch_recipe_learns_through_a_node_kill(tmp_path: Path, recipe: str) -> None:
    threshold, overrides = RECIPES[recipe]
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        "data.generate.images_per_class=64",
        "data.batch_size=32",
        f"trainer.epochs={EPOCHS}",
        "trainer.eval_every_epochs=2",
        "trainer.record_samples=true",
        "checkpoint.every_steps=20",
        *overrides,
    )
    kill_at = EPOCHS * STEPS_PER_EPOCH // 3
    wait_event(run_dir, proc, lambda e: e["event"] == "step" and e["step"] >= kill_at)
    victim = next(f"node{i}" for i in range(2) if f"node{i}" != node_with_rank(run_dir, 0))
    fault = kill_node(run_dir, victim)
    assert wait_exit(proc, run_dir) == 0, output(run_dir)[-3000:]

    events = read_events(run_dir)
    cfg = config.load(run_dir / "config.yaml")
    assert lr_violations(events, cfg, SAMPLES_PER_EPOCH) == []
    assert sample_violations(events, SAMPLES_PER_EPOCH, EPOCHS * SAMPLES_PER_EPOCH) == []
    assert replica_violations(events) == []
    assert history_violations(events) == []
    done = next(e for e in events if e["event"] == "training_done")
    assert done["world_size"] == 1 and done["ts"] > fault
    evaluated = [e for e in events if e["event"] == "evaluated"]
    assert [e["evaluation"] for e in evaluated] == [1, 2, 3, 4]  # every 2 epochs, none twice
    assert all(e["count"] == 160 for e in evaluated)  # every held-out image counted once
    final = evaluated[-1]
    print(f"{recipe}: top-1 {final['top1']:.4f} (threshold {threshold})")
    assert final["top1"] >= threshold, [round(e["top1"], 3) for e in evaluated]
