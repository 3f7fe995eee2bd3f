"""``timeline.png``: a campaign at a glance.

Samples/s of training and the world size over time; each fault a red marker; each recovery a
shaded span split into its phases (detection, rendezvous, rebuild, sync, first step), so that
which part of a recovery costs the time can be seen as well as read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chaos.verdict import Verdict

PHASES = (  # (label, colour): from the fault to the first step after it
    ("detection", "#f4a261"),
    ("rendezvous", "#e9c46a"),
    ("rebuild", "#2a9d8f"),
    ("sync", "#8ab17d"),
    ("first step", "#a8dadc"),
)


def phases(breakdown: dict[str, float]) -> list[tuple[str, float, float]]:
    """``(phase, start, end)`` seconds after the fault, from a recovery's breakdown (milestones
    from the fault, and the durations the worker measured once it had its assignment).
    Rendezvous runs from the detection until the rebuild starts: the round forming, and the
    workers leaving the old round for it."""
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


def draw(events: list[dict[str, Any]], verdict: Verdict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    steps = [e for e in events if e["event"] == "step"]
    t0 = steps[0]["ts"]
    fig, rate_ax = plt.subplots(figsize=(11, 4.5), dpi=90)
    rate_ax.plot(
        [e["ts"] - t0 for e in steps],
        [e["samples_per_s"] for e in steps],
        color="#264653",
        linewidth=0.8,
        label="samples/s",
    )
    rate_ax.set_xlabel("seconds since the first step")
    rate_ax.set_ylabel("samples/s")
    world_ax = rate_ax.twinx()
    world_ax.step(
        [e["ts"] - t0 for e in steps],
        [e["world_size"] for e in steps],
        where="post",
        color="#6d597a",
        linewidth=1.5,
        label="world size",
    )
    world_ax.set_ylabel("world size")
    world_ax.set_ylim(0, max(e["world_size"] for e in steps) + 1)
    seen: set[str] = set()
    for f in verdict.faults:
        x = f.ts - t0
        rate_ax.axvline(x, color="#d62828", linewidth=1)
        rate_ax.annotate(
            f"{f.number}: {f.kind}\n{f.target}",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="top",
            ha="left",
            color="#d62828",
        )
        colours = dict(PHASES)
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
    rate_ax.set_title(f"{title}: goodput {goodput}, {'PASS' if verdict.ok else 'FAIL'}")
    handles, labels = rate_ax.get_legend_handles_labels()
    more, more_labels = world_ax.get_legend_handles_labels()
    rate_ax.legend(handles + more, labels + more_labels, fontsize=7, loc="lower left", ncol=4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
