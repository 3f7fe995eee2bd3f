"""The training the runtime protects still learns, on real data that no one here made:
scikit-learn's handwritten digits (1,000 scans to train on, 740 others held out), trained by the
real job with Akiba et al.'s RMSprop warm-up and bf16 gradients in the all-reduce, in fp32 (on a
CPU fp16 is twenty times slower and bf16 went NaN: :mod:`chaos.convergence` says why).

A run with a node SIGKILLed halfway and started again (it rejoins, the state sent from the
survivor's memory) is compared with a fault-free run of the same seed: both must reach a stated
top-1 on the held-out split, and their final top-1 must agree within a stated tolerance, while
every invariant of a chaos run holds for the faulted one. ``bench/convergence.py`` draws both
runs' curves (docs/convergence-digits.png).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos import convergence
from chaos.convergence import EPOCHS, SAMPLES_PER_EPOCH, VAL_IMAGES, Trial
from chaos.invariants import (
    history_violations,
    lr_violations,
    replica_violations,
    sample_violations,
)
from elastic import config

from .conftest import Gate, back_after_restart

# Under pytest-xdist (--dist loadgroup) this module stays on one worker: the fault-free run,
# a module fixture, is computed once.
pytestmark = pytest.mark.xdist_group("test_convergence")

# The top-1 both runs must reach on the 740 held-out scans after 8 epochs (chance: 10 %), and
# how far apart their final top-1 may be. Measured on a 2-core machine (2026-11-26), final top-1
# of the fault-free run / of the run with a node killed at epoch 4 and back 0.7-0.9 epochs
# later, for trainer.seed 0, 1, 2: 0.957 / 0.934, 0.938 / 0.931, 0.947 / 0.947, differences of
# 2.3, 0.7 and 0.0 points; the seeds' own spread is 1.9 points. TOLERANCE is 1.7 points above
# the largest difference, THRESHOLD 3.1 points below the lowest top-1. Broken by hand, a
# recovery that lost what the model had learnt (its weights redrawn, the same on every rank, at
# each state sync from memory, which no invariant notices) ended at 0.888: 6.9 points below
# its fault-free run, and below THRESHOLD.
THRESHOLD = 0.90
TOLERANCE = 0.04


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, etcd_endpoint: str) -> Trial:
    return convergence.run(
        tmp_path_factory.mktemp("fault-free") / "run", etcd_endpoint, fault=False
    )


def test_a_fault_free_run_of_the_digits_job_learns(fault_free: Trial) -> None:
    evaluated = fault_free.evaluations
    assert [e["evaluation"] for e in evaluated] == list(range(1, EPOCHS + 1))
    assert all(e["count"] == VAL_IMAGES for e in evaluated)
    assert fault_free.final_top1 >= THRESHOLD, [round(e["top1"], 3) for e in evaluated]


def test_a_node_killed_and_started_again_learns_as_much_as_the_fault_free_run(
    tmp_path: Path,
    etcd_endpoint: str,
    fault_free: Trial,
    gate: Gate,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The last 3 steps wait at the gate for the node to be back: on a fast machine the job
    # would otherwise end first (here it is back 0.7-0.9 epochs after the kill, of 4 left).
    gate.hold_end(3)
    for name, value in gate.env().items():
        monkeypatch.setenv(name, value)  # the trial's launcher inherits it
    gate.open_on(tmp_path / "run", back_after_restart(1))
    run = convergence.run(tmp_path / "run", etcd_endpoint, fault=True)
    events = run.events
    cfg = config.load(run.run_dir / "config.yaml")
    assert lr_violations(events, cfg, SAMPLES_PER_EPOCH) == []
    assert sample_violations(events, SAMPLES_PER_EPOCH, EPOCHS * SAMPLES_PER_EPOCH) == []
    assert replica_violations(events) == []
    assert history_violations(events) == []

    # The survivor trained alone after the kill, the node started again took the state from
    # its memory (not from a checkpoint), and both trained to the end.
    alone = [e for e in run.steps if e["world_size"] == 1]
    assert alone and all(e["ts"] > run.killed for e in alone)
    synced = [
        e
        for e in events
        if e["event"] == "state_synced" and e["node"] == run.victim and e["ts"] > run.rejoined
    ]
    assert synced and synced[0]["step"] > 0 and synced[0]["source"] >= 0
    done = next(e for e in events if e["event"] == "training_done")
    assert done["world_size"] == 2 and done["samples_seen"] == EPOCHS * SAMPLES_PER_EPOCH
    evaluated = run.evaluations
    assert [e["evaluation"] for e in evaluated] == list(range(1, EPOCHS + 1))  # none twice
    assert all(e["count"] == VAL_IMAGES for e in evaluated)

    curves = {
        "fault-free": [round(e["top1"], 3) for e in fault_free.evaluations],
        "faulted": [round(e["top1"], 3) for e in evaluated],
    }
    print(f"top-1 per epoch: {curves}")
    assert run.final_top1 >= THRESHOLD, curves
    assert abs(run.final_top1 - fault_free.final_top1) <= TOLERANCE, curves
