"""How many steps apart checkpoints are: a pure function of the settings and the last save.

``checkpoint.interval=auto`` follows Young (1974) and Daly (2006): when a checkpoint costs C
seconds of training and failures come every M seconds on average, the interval that loses the
least time is about sqrt(2 C M) (:func:`choose_interval`). The figures come from the save itself:
each rank's step time, stall and write time are all-gathered by its last collective, and the
worst rank's are used (:class:`Measured`). Every rank thus computes the same interval from the
same numbers without a collective of its own, and saves at the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from elastic.config import CheckpointConfig, CheckpointInterval

LLAMA3_GPU_HOURS_PER_INTERRUPTION = 54 * 24 * 16_384 / 419


@dataclass(frozen=True)
class Measured:
    """What the last save measured, the worst rank's figures."""

    step_s: float  # mean seconds per training step since the save before
    stall_s: float  # how long the save held training
    write_s: float  # from the save's start until every rank had written and hashed

    @classmethod
    def worst(cls, gathered: list[dict[str, Any]]) -> Measured:
        return cls(
            step_s=max(g["step_s"] for g in gathered),
            stall_s=max(g["stall_s"] for g in gathered),
            write_s=max(g["write_s"] for g in gathered),
        )


@dataclass(frozen=True)
class Interval:
    steps: int
    reason: str  # said in the ``checkpoint_interval`` event


def job_mtbf_hours(cfg: CheckpointConfig, gpus: int) -> float:
    """``checkpoint.mtbf_hours``, or Llama 3's failure rate scaled to ``gpus``.

    Llama 3 saw 419 unexpected interruptions in 54 days on 16,384 GPUs, about 50,700 GPU-hours
    per interruption."""
    return cfg.mtbf_hours or LLAMA3_GPU_HOURS_PER_INTERRUPTION / max(1, gpus)


def choose_interval(cfg: CheckpointConfig, measured: Measured | None, gpus: int) -> Interval:
    """The steps between checkpoints, from the settings and the last save's figures.

    ``measured`` is None before the first save of a round has measured anything:
    ``every_steps`` until then.

    With ``interval=auto`` and background saves, the cost C of Young/Daly is the stall (the
    staging), and since a save starts only once the previous one is written, the interval is at
    least the time a save takes to write. ``interval=fixed`` saves every ``every_steps``, or
    every ``every_minutes`` converted to steps when that comes first.
    """
    fixed = Interval(cfg.every_steps, f"checkpoint.every_steps={cfg.every_steps}")
    if measured is None or measured.step_s <= 0:
        return fixed
    step_s = measured.step_s
    if cfg.interval == CheckpointInterval.auto:
        mtbf = job_mtbf_hours(cfg, gpus)
        optimum = math.sqrt(2 * measured.stall_s * mtbf * 3600)
        seconds = max(optimum, measured.write_s)
        steps = max(1, math.ceil(seconds / step_s))
        floor = (
            f", raised to the {measured.write_s:.2f} s a save takes to write"
            if measured.write_s > optimum
            else ""
        )
        return Interval(
            steps,
            f"Young/Daly: sqrt(2 x {measured.stall_s:.3f} s stall x {mtbf:.3g} h MTBF "
            f"({gpus} GPUs)) = {optimum:.0f} s{floor}; {steps} steps of {step_s:.3f} s",
        )
    if cfg.every_minutes > 0:
        by_time = max(1, math.ceil(cfg.every_minutes * 60 / step_s))
        if by_time < cfg.every_steps:
            return Interval(
                by_time,
                f"checkpoint.every_minutes={cfg.every_minutes:g}: {by_time} steps of "
                f"{step_s:.3f} s (before every_steps={cfg.every_steps})",
            )
    return fixed
