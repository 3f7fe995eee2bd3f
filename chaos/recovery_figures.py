"""The figures of one fault's recovery from a run's event log: stall, redone steps, time lost.

The definitions are the ones shared with the torchrun peer baseline
(``shared/bench/peer_torchrun``): the stall runs from the fault until a survivor completes a step
beyond the one that was in flight; redone steps are the steps trained twice because the job rolled
back, to a checkpoint or (in place) to the newest state a survivor held.

The stall counts the step in flight as lost even when it is not (a planned leave finishes it and
one more before the others switch rounds), so this project also reports the time lost: how much
later the first step after the recovery completed than the pace before the fault would have had
it, wherever in its step the fault landed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from elastic import event_types as ev

# The first sign of a fault, whichever process saw it: a survivor's failed collective, an agent's
# report of its own worker, a dead peer evicted, a frozen worker, or (a silent death) the round
# the leader formed once the lease expired.
DETECTION_EVENTS = (
    ev.WORKER_PEER_LOST.name,
    ev.FAILURE_REPORTED.name,
    ev.PEER_EVICTED.name,
    ev.WORKER_FROZEN.name,
    ev.ROUND_FORMED.name,
)


@dataclass(frozen=True)
class Recovery:
    fault_ts: float
    last_step_before: int
    resumed_from: int | None  # the step training went on from, None if it never did
    first_step_after: int | None
    stall_s: float | None  # None: no progress after the fault
    redone_steps: int
    breakdown: dict[str, float]  # seconds from the fault to each milestone of the recovery
    step_s: float  # the median step time before the fault
    lost_s: float | None  # the delay against that pace (see the module docstring)


def recovery(events: list[dict[str, Any]], fault_ts: float) -> Recovery:
    steps = ev.STEP.of(events)
    before = [e["step"] for e in steps if e["ts"] < fault_ts]
    last_before = max(before, default=0)
    restarted = next(
        (e for e in events if ev.TRAINING_STARTED.matches(e) and e["ts"] > fault_ts), None
    )
    progress = next(
        (
            e
            for e in steps
            if e["ts"] > fault_ts
            and (e["step"] > last_before + 1 or (restarted and e["ts"] > restarted["ts"]))
        ),
        None,
    )
    resumed_from = restarted["step"] if restarted else None
    times = sorted({e["step"]: e["ts"] for e in steps if e["ts"] < fault_ts}.values())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    step_s = statistics.median(gaps) if gaps else 0.0
    lost_s = None
    if progress is not None and before:
        last_ts = max(e["ts"] for e in steps if e["step"] == last_before and e["ts"] < fault_ts)
        lost_s = progress["ts"] - last_ts - (progress["step"] - last_before) * step_s
    milestones = {
        "detected": DETECTION_EVENTS,
        ev.ROUND_FORMED.name: (ev.ROUND_FORMED.name,),
        ev.TRAINING_STARTED.name: (ev.TRAINING_STARTED.name,),
    }
    breakdown = {}
    for name, kinds in milestones.items():
        first = next((e for e in events if e["event"] in kinds and e["ts"] >= fault_ts), None)
        if first is not None:
            breakdown[name] = first["ts"] - fault_ts
    recovered = next((e for e in events if ev.RECOVERED.matches(e) and e["ts"] > fault_ts), None)
    if recovered is not None:
        for part in ("rebuild_s", "sync_s", "first_step_s"):
            breakdown[part.removesuffix("_s")] = recovered[part]
    return Recovery(
        fault_ts=fault_ts,
        last_step_before=last_before,
        resumed_from=resumed_from,
        first_step_after=progress["step"] if progress else None,
        stall_s=progress["ts"] - fault_ts if progress else None,
        redone_steps=max(0, last_before - resumed_from) if resumed_from is not None else 0,
        breakdown=breakdown,
        step_s=step_s,
        lost_s=lost_s,
    )
