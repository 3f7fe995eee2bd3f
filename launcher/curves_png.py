"""``curves.png``: a run's learning curves, drawn by the launcher when the job ends.

The TensorBoard scalars (:mod:`elastic.curves`) are for watching a run; this picture is the run at
a glance beside its summary, with nothing to install: the training loss and the LR over steps,
top-1/top-5 of each evaluation, the world size, and a mark at each recovery and rollback. It is
drawn from the run's event log (rank 0's ``step``, ``evaluated`` and ``recovered`` events, and
the ``rolled_back`` every rank writes). A step trained more than once (after a rollback, or a
resume from an older checkpoint) is drawn as last trained: the curve the final model went
through.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from elastic import event_types as ev

CURVES_PNG = "curves.png"  # in the run directory
RECOVERY_COLOUR = "#d62828"
ROLLBACK_COLOUR = "#f77f00"


def last_per_step(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The newest event of each step, in the order of the steps."""
    newest = {e["step"]: e for e in events}
    return [newest[s] for s in sorted(newest)]


def draw(events: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Draw the curves of ``events`` (a run's, in time order) into ``path``, a PNG file.

    False, nothing written, if no step was trained. The PNG is replaced whole, never half drawn."""
    steps = last_per_step(ev.STEP.of(events))
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    evaluated = last_per_step(ev.EVALUATED.of(events))
    recoveries = [e["step"] for e in ev.RECOVERED.of(events)]
    rollbacks = sorted({e["step"] for e in ev.ROLLED_BACK.of(events)})  # one per rank
    x = [e["step"] for e in steps]
    fig, (loss_ax, acc_ax, world_ax) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 8), dpi=90, height_ratios=(3, 2, 1)
    )
    loss_ax.plot(x, [e["loss"] for e in steps], color="#264653", linewidth=1, label="loss")
    if evaluated:
        loss_ax.plot(
            [e["step"] for e in evaluated],
            [e["loss"] for e in evaluated],
            "o--",
            color="#2a9d8f",
            markersize=4,
            label="validation loss",
        )
    loss_ax.set_ylabel("loss")
    lr_ax = loss_ax.twinx()
    lr_ax.plot(x, [e["lr"] for e in steps], color="#e76f51", linewidth=1.2, label="LR")
    lr_ax.set_ylabel("LR")

    for key, colour in (("top1", "#264653"), ("top5", "#8ab17d")):
        acc_ax.plot(
            [e["step"] for e in evaluated],
            [100 * e[key] for e in evaluated],
            "o-",
            color=colour,
            markersize=4,
            label=f"top-{key[3:]}",
        )
    acc_ax.set_ylabel("validation accuracy (%)")
    acc_ax.set_ylim(0, 105)
    if not evaluated:
        acc_ax.text(0.5, 0.5, "no evaluation", transform=acc_ax.transAxes, ha="center")

    world_ax.step(x, [e["world_size"] for e in steps], where="post", color="#6d597a")
    world_ax.set_ylim(0, max(e["world_size"] for e in steps) + 1)
    world_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    world_ax.set_ylabel("world size")
    world_ax.set_xlabel("step")
    world_ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    marks = [(s, RECOVERY_COLOUR, "recovery") for s in recoveries]
    marks += [(s, ROLLBACK_COLOUR, "rollback") for s in rollbacks]
    seen: set[str] = set()
    for step, colour, label in marks:
        for ax in (loss_ax, acc_ax, world_ax):
            named = ax is loss_ax and label not in seen
            ax.axvline(
                step, color=colour, linewidth=0.8, linestyle="--", label=label if named else None
            )
        seen.add(label)
    handles, labels = loss_ax.get_legend_handles_labels()
    more, more_labels = lr_ax.get_legend_handles_labels()
    loss_ax.legend(handles + more, labels + more_labels, fontsize=7, loc="upper right")
    if evaluated:
        acc_ax.legend(fontsize=7, loc="upper left")
    loss_ax.set_title(
        f"{title}: {len(steps)} steps; recoveries: {len(recoveries)}, rollbacks: {len(rollbacks)}"
    )
    fig.tight_layout()
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fig.savefig(partial, format="png")
    plt.close(fig)
    os.replace(partial, path)
    return True
