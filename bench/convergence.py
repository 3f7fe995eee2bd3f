"""The digits job fault-free and with a node killed and started again, side by side.

Runs the job that ``tests/test_convergence.py`` runs (:mod:`chaos.convergence`: the real launcher
on scikit-learn's digits, same seed both times), then draws the held-out top-1 and rank 0's
training loss of both runs per epoch into one PNG, with the kill and the rejoin marked, and
prints both final top-1 and their difference. About 2.5 minutes on two cores::

    .venv/bin/python bench/convergence.py                    # -> docs/convergence-digits.png
    .venv/bin/python bench/convergence.py --work-dir /tmp/conv --seed 1 --out /tmp/conv.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.convergence import SAMPLES_PER_EPOCH, Trial, run  # noqa: E402
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd  # noqa: E402


def draw(fault_free: Trial, faulted: Trial, out: Path) -> None:
    """Draw top-1 per evaluation above and training loss per step below.

    The faulted run's stretch at world size 1 is shaded, from the kill to the rejoin."""
    assert faulted.killed is not None and faulted.rejoined is not None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for trial, label, colour in ((fault_free, "fault-free", "C0"), (faulted, "faulted", "C3")):
        evaluated = trial.evaluations
        top.plot(
            [e["epoch"] for e in evaluated],
            [100 * e["top1"] for e in evaluated],
            "o-",
            color=colour,
            label=f"{label}: final {100 * trial.final_top1:.1f} %",
        )
        steps = trial.steps
        bottom.plot(
            [e["samples"] / SAMPLES_PER_EPOCH for e in steps],
            [e["loss"] for e in steps],
            color=colour,
            linewidth=0.8,
            alpha=0.8,
            label=label,
        )
    killed, rejoined = faulted.epoch_at(faulted.killed), faulted.epoch_at(faulted.rejoined)
    for ax in (top, bottom):
        ax.axvspan(killed, rejoined, color="0.88", zorder=0, label="faulted run at world size 1")
        ax.axvline(killed, color="k", linestyle="--", linewidth=0.8)
        ax.axvline(rejoined, color="k", linestyle=":", linewidth=0.8)
        ax.grid(alpha=0.3)
    top.text(killed, 93, f" {faulted.victim} SIGKILLed", fontsize=8)
    top.text(rejoined, 60, " started again: rejoined", fontsize=8)
    top.axhline(10, color="0.5", linewidth=0.6)
    top.text(0, 11, "chance", fontsize=8, color="0.4")
    top.set_ylim(0, 100)
    top.set_ylabel("held-out top-1 (%)")
    top.legend(loc="upper left", fontsize=9)
    bottom.set_ylabel("training loss (rank 0)")
    bottom.set_xlabel(f"epoch (samples / {SAMPLES_PER_EPOCH:,})")
    bottom.legend(loc="upper right", fontsize=9)
    fig.suptitle("ResNet-18 on scikit-learn's digits: 2 nodes, akiba, bf16 all-reduce, fp32")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "convergence-digits.png")
    parser.add_argument("--work-dir", type=Path, help="keep both runs here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed of both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        work = args.work_dir or Path(tmp)
        seed = (f"trainer.seed={args.seed}",)
        with EmbeddedEtcd(work / "etcd", work / "etcd.log") as etcd:
            fault_free = run(work / "fault-free", etcd.endpoint, fault=False, overrides=seed)
            faulted = run(work / "faulted", etcd.endpoint, fault=True, overrides=seed)
        draw(fault_free, faulted, args.out)
    a, b = fault_free.final_top1, faulted.final_top1
    print(f"fault-free: final top-1 {100 * a:.2f} %")
    print(
        f"faulted:    final top-1 {100 * b:.2f} % ({faulted.victim} killed at epoch "
        f"{faulted.epoch_at(faulted.killed):.2f}, back at epoch "
        f"{faulted.epoch_at(faulted.rejoined):.2f})"
    )
    print(f"difference: {100 * (b - a):+.2f} points")
    print(f"figure:     {args.out}")


if __name__ == "__main__":
    main()
