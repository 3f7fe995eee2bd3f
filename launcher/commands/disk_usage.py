"""A run directory's disk use by part, and what each part costs a trained step.

What a run leaves on disk grows with its length: the event files (rotated, ``trainer.
events_rotate_mb``), the TensorBoard scalars, the logs and the embedded etcd; the checkpoints are
pruned to ``checkpoint.keep``. :func:`usage` says how much each part holds, for the soak bench's
disk use per simulated day (bench/soak.py) and for a person asking where a disk went:

    .venv/bin/python -m launcher.commands.disk_usage /tmp/diskcheck/run

prints each part and, for the parts that grow with the steps, bytes per trained step and, at the
step rate the run's events show, per day. A short run's figures per step include its fixed costs
(a round, health checks); the difference of two runs of different lengths is the marginal cost.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from elastic import event_types as ev
from elastic.events import read_events

PARTS = ("events", "logs", "checkpoints", "tensorboard", "etcd")
# The parts that grow with the steps trained; the checkpoints are pruned, etcd is compacted and
# preallocates its WAL in 64 MB segments, and the rest is written once.
PER_STEP = ("events", "logs", "tensorboard")
OTHER = "other"  # the config, curves.png, chaos reports: whatever is under no part
DAY_S = 86_400


def usage(run_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Bytes of the files under each of :data:`PARTS` of ``run_dir``, and the rest as :data:`OTHER`.

    A file counts its own size (symlinks not followed); a part that is absent has 0. Checkpoints
    count where they are under the run directory, as with the default ``checkpoint.url``.

    Walks while the job runs: a file deleted under the walk (a checkpoint pruned, an event file
    rotated out) is not counted, and stops nothing.
    """
    out = dict.fromkeys((*PARTS, OTHER), 0)
    root = Path(run_dir)
    for folder, _, files in os.walk(root):
        part = Path(folder).relative_to(root).parts[:1]
        key = part[0] if part and part[0] in PARTS else OTHER
        for name in files:
            try:
                out[key] += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return out


def step_rate(events: Iterable[Mapping[str, Any]]) -> tuple[int, float | None]:
    """The newest step of a run's ``step`` events, and its steps a second.

    The rate is taken between its first and newest one (None with fewer than two)."""
    steps = sorted((float(e["ts"]), int(e["step"])) for e in ev.STEP.of(events))
    if not steps:
        return 0, None
    (t0, s0), (t1, s1) = steps[0], steps[-1]
    return s1, ((s1 - s0) / (t1 - t0) if t1 > t0 else None)


def report(run_dir: Path) -> str:
    """The table :func:`main` prints: each part's bytes, per trained step and per day.

    Only the parts of :data:`PER_STEP` get the figures per step and per day."""
    parts = usage(run_dir)
    steps, rate = step_rate(read_events(run_dir))
    day = f"MB/day at {rate:.2f} steps/s" if rate else ""
    lines = [
        f"{run_dir}: {steps} steps trained",
        f"{'part':<13}{'bytes':>14}{'bytes/step':>12}  {day}",
    ]
    for part, size in parts.items():
        line = f"{part:<13}{size:>14,}"
        if part in PER_STEP and steps:
            line += f"{size / steps:>12,.0f}"
            line += f"  {size / steps * rate * DAY_S / 1e6:>{len(day)},.1f}" if rate else ""
        lines.append(line)
    lines.append(f"{'total':<13}{sum(parts.values()):>14,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.commands.disk_usage", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"{args.run_dir} is no directory: give a job's run_dir", file=sys.stderr)
        return 2
    print(report(args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
