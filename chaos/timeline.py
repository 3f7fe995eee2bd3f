"""``timeline.png``: a campaign at a glance.

Samples/s of training and the world size over time; each fault a red marker; each recovery a
shaded span split into its phases (detection, rendezvous, rebuild, sync, first step), so that
which part of a recovery costs the time can be seen as well as read.

The rate of single steps jumps several-fold on shared cores (a step that waited on a save next
to one that did not), which hides the dips faults cause: the picture draws it faintly and, over
it, the rate over the last ``SMOOTH_S`` seconds. Faults are labelled by number above the plot,
stacked where they would touch, and named in a key under it, so no two labels overlap however
close the faults are.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from chaos.verdict import Verdict, steps_of

PHASES = (  # (label, colour): from the fault to the first step after it
    ("detection", "#f4a261"),
    ("rendezvous", "#e9c46a"),
    ("rebuild", "#2a9d8f"),
    ("sync", "#8ab17d"),
    ("first step", "#a8dadc"),
)
SMOOTH_S = 5.0  # the smoothed rate's window
KEY_COLUMNS = 3


def phases(breakdown: dict[str, float]) -> list[tuple[str, float, float]]:
    """Split a recovery into ``(phase, start, end)`` seconds after the fault.

    It reads the recovery's breakdown: milestones from the fault, and the durations the worker
    measured once it had its assignment. Rendezvous runs from the detection until the rebuild
    starts: the round forming, and the workers leaving the old round for it."""
    detected = breakdown.get("detected")
    started = breakdown.get("training_started")
    if detected is None or started is None:
        return []
    rebuild_at = max(detected, started - breakdown.get("rebuild", 0.0) - breakdown.get("sync", 0.0))
    spans = [("detection", 0.0, detected), ("rendezvous", detected, rebuild_at)]
    t = rebuild_at
    for label, key in (("rebuild", "rebuild"), ("sync", "sync"), ("first step", "first_step")):
        length = breakdown.get(key, 0.0)
        spans.append((label, t, t + length))
        t += length
    return spans


def smoothed(times: list[float], samples: list[int], window_s: float) -> list[float]:
    """Samples/s at each step over the last ``window_s`` seconds.

    The rate is from the first step at or after the window's start; the first step's own rate is
    0. A rollback's lost samples count as none trained, never as a negative rate."""
    rates = []
    for i, t in enumerate(times):
        j = min(bisect.bisect_left(times, t - window_s), i)
        gained = samples[i] - samples[j]
        rates.append(max(0.0, gained / (t - times[j])) if t > times[j] else 0.0)
    return rates


def levels(spans: list[tuple[float, float]]) -> list[int]:
    """The row of each label, so that no two labels overlap.

    Labels come as their ``(left, right)`` extent in the order of ``left``. Each goes to the
    lowest row whose labels all end before it starts."""
    ends: list[float] = []  # the right edge of the last label in each row
    rows = []
    for left, right in spans:
        row = next((r for r, end in enumerate(ends) if end < left), len(ends))
        if row == len(ends):
            ends.append(right)
        else:
            ends[row] = right
        rows.append(row)
    return rows


def draw(events: list[dict[str, Any]], verdict: Verdict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = steps_of(events)
    t0 = steps[0]["ts"]
    times = [e["ts"] - t0 for e in steps]
    fig, rate_ax = plt.subplots(figsize=(11, 5), dpi=90)
    rate_ax.plot(
        times,
        [e["samples_per_s"] for e in steps],
        color="#264653",
        alpha=0.25,
        linewidth=0.6,
        label="samples/s, each step",
    )
    rate_ax.plot(
        times,
        smoothed(times, [e["samples"] for e in steps], SMOOTH_S),
        color="#264653",
        linewidth=1.6,
        label=f"samples/s, last {SMOOTH_S:g} s",
    )
    rate_ax.set_xlabel("seconds since the first step")
    rate_ax.set_ylabel("samples/s")
    world_ax = rate_ax.twinx()
    world_ax.step(
        times,
        [e["world_size"] for e in steps],
        where="post",
        color="#6d597a",
        linewidth=1.5,
        label="world size",
    )
    world_ax.set_ylabel("world size")
    world_ax.set_ylim(0, max(e["world_size"] for e in steps) + 1)
    world_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    seen: set[str] = set()
    colours = dict(PHASES)
    for f in verdict.faults:
        x = f.ts - t0
        rate_ax.axvline(x, color="#d62828", linewidth=1)
        for label, start, end in phases(f.breakdown):
            rate_ax.axvspan(
                x + start,
                x + end,
                color=colours[label],
                alpha=0.5,
                linewidth=0,
                label=None if label in seen else label,
            )
            seen.add(label)
    goodput = "-" if verdict.goodput is None else f"{100 * verdict.goodput:.1f} %"
    handles, labels = rate_ax.get_legend_handles_labels()
    more, more_labels = world_ax.get_legend_handles_labels()
    rate_ax.legend(handles + more, labels + more_labels, fontsize=7, loc="lower left", ncol=4)
    key = [f"{f.number}: {f.kind} {f.target}" for f in verdict.faults]
    rows = -(-len(key) // KEY_COLUMNS)
    for c in range(KEY_COLUMNS if key else 0):
        text = "\n".join(key[c * rows : (c + 1) * rows])
        fig.text(0.06 + c * 0.3, 0.01, text, fontsize=7, va="bottom", color="#d62828")
    numbers = _fault_numbers(rate_ax, [(f.number, f.ts - t0) for f in verdict.faults])
    for _ in range(2):  # lay out, stack the numbers, make room for them; again on the new layout
        fig.tight_layout(rect=(0, 0.03 + 0.025 * rows, 1, 1))
        height = _stack(fig, numbers)
        rate_ax.set_title(
            f"{title}: goodput {goodput}, {'PASS' if verdict.ok else 'FAIL'}", pad=6 + height
        )
    fig.savefig(path)
    plt.close(fig)


def _fault_numbers(ax: Any, faults: list[tuple[int, float]]) -> list[Any]:
    """Each fault's number, above the plot at its marker."""
    return [
        ax.annotate(
            str(number),
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 2),
            textcoords="offset points",
            fontsize=7,
            ha="center",
            va="bottom",
            color="#d62828",
            annotation_clip=False,
        )
        for number, x in faults
    ]


def _stack(fig: Any, texts: list[Any]) -> float:
    """Put the numbers in rows (:func:`levels`) and return the rows' height, in points.

    The rows are measured on the figure as laid out, so that the numbers of faults close together
    stack instead of overlapping."""
    if not texts:
        return 0.0
    renderer = fig.canvas.get_renderer()
    for t in texts:
        t.set_position((0, 2))
    extents = [t.get_window_extent(renderer) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: extents[i].x0)
    rows = levels([(extents[i].x0 - 1, extents[i].x1 + 1) for i in order])
    row_pt = max(e.height for e in extents) * 72 / fig.dpi + 1
    for i, row in zip(order, rows, strict=True):
        texts[i].set_position((0, 2 + row * row_pt))
    return (max(rows) + 1) * row_pt + 2
