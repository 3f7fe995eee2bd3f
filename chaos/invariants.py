"""Invariants a run must keep whatever the faults, judged from its event log and config."""

from __future__ import annotations

import math
from typing import Any

from elastic.config import Config
from elastic.lr_policy import LRSchedule


def lr_violations(events: list[dict[str, Any]], cfg: Config, samples_per_epoch: int) -> list[str]:
    """Steps whose LR is not what the policy gives for that step's samples and world size."""
    schedule = LRSchedule.from_config(cfg.optim, samples_per_epoch)
    bad = []
    for e in events:
        if e["event"] != "step":
            continue
        before = e["samples"] - e["step_samples"]
        want = schedule.lr(before, e["world_size"] * cfg.data.batch_size)
        if not math.isclose(e["lr"], want, rel_tol=1e-9):
            bad.append(f"step {e['step']} (world {e['world_size']}): lr {e['lr']} != {want}")
    return bad
