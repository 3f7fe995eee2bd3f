"""The checks a worker runs between steps, each on every rank alike: a non-finite step skipped
and a run of them rolled back (:mod:`elastic.nonfinite`), the replicas compared and a minority
repaired (:mod:`elastic.replicas`), and this rank's compute compared with its peers'
(:mod:`elastic.stragglers`)."""

from __future__ import annotations

import logging
import math
import statistics

import torch
import torch.distributed as dist

from elastic import config
from elastic import event_types as ev
from elastic.checkpoint import CheckpointManager
from elastic.control import Assignment
from elastic.nonfinite import Verdict, first_producer
from elastic.replicas import checksum, judge
from elastic.round_entry import fit_world
from elastic.state import Progress
from elastic.stragglers import StragglerWatch
from elastic.worker import Worker


def skip_nonfinite(w: Worker, a: Assignment, loss: float, step: int) -> Verdict:
    """A step whose averaged gradients were not finite, skipped on every rank: find the first
    rank whose loss was not finite (one small all-reduce), count it, and say so (rank 0). After
    ``health.nonfinite_rollback`` in a row, the rank that produced every one of them has its
    node struck (:mod:`elastic.nonfinite`)."""
    flags = torch.zeros(a.world_size, dtype=torch.float64, device=w.device)
    flags[a.rank] = 0.0 if math.isfinite(loss) else 1.0
    w.comm.all_reduce(flags, "non-finite step")
    producer = first_producer(flags.tolist())
    verdict = w.nonfinite.update(False, producer)
    if a.rank == 0:
        who = f"rank {producer}'s loss" if producer >= 0 else "the gradients (no rank's loss)"
        w.events.emit(
            ev.STEP_NONFINITE,
            f"step {step}: {who} not finite; the optimizer step was skipped on every rank "
            f"({w.nonfinite.streak} in a row, {w.nonfinite.skipped} in all)",
            level=logging.WARNING,
            step=step,
            producer=producer,
            streak=w.nonfinite.streak,
            skipped=w.nonfinite.skipped,
        )
    if verdict is Verdict.ROLL_BACK and w.nonfinite.blamed() == a.rank:
        w.link.channel.send(
            "strike", reason=f"rank {a.rank} produced {w.nonfinite.streak} non-finite steps"
        )
    return verdict


def roll_back(
    w: Worker, a: Assignment, ckpt: CheckpointManager, progress: Progress, why: str
) -> Progress | None:
    """Load the newest checkpoint on every rank (a collective) because of ``why``; the progress
    to train on from, or None (and training goes on) when there is no checkpoint yet."""
    w.saver.wait(lambda: w.comm.aborted)  # a save in flight is the newest checkpoint
    info = ckpt.restore(w.tensors)
    w.nonfinite.rolled_back()
    to_step = info.step if info else None
    where = f"back to the checkpoint of step {to_step}" if info else "no checkpoint yet"
    w.events.emit(  # by every rank: the invariants tell its attempts of a step apart by it
        ev.ROLLED_BACK,
        f"step {progress.step}: {why}; {where}" if a.rank == 0 else None,
        level=logging.WARNING,
        step=progress.step,
        to_step=to_step,
        reason=why,
    )
    if info is None:
        return None
    restored = Progress.from_dict(info.manifest["progress"])
    w.progress = fit_world(w, a, restored)
    return w.progress


def check_replicas(w: Worker, a: Assignment) -> bool:
    """Compare every rank's checksum of its parameters and optimizer state (one all-reduce of
    one integer per rank, :mod:`elastic.replicas`); a minority takes the state of a majority
    rank (a broadcast) and its node gets a strike. False when no majority agrees: the caller
    rolls back."""
    replicated = w.state.replicated()
    names = sorted(replicated)
    sums = torch.zeros(a.world_size, dtype=torch.int64, device=w.device)
    sums[a.rank] = checksum(replicated, names)
    w.comm.all_reduce(sums, "replica check")
    verdict = judge(sums.tolist())
    if verdict.agree:
        return True
    if verdict.roll_back:
        return False
    with w.comm.collective("replica repair"):
        dist._broadcast_coalesced(  # DDP's own bucketed broadcast, as a state sync
            dist.distributed_c10d._get_default_group(),
            [replicated[n] for n in names],
            64 * 1024 * 1024,
            verdict.source,
        )
    if a.rank in verdict.corrupt:
        w.events.emit(
            ev.REPLICA_REPAIRED,
            f"rank {a.rank}'s parameters or optimizer state differed from the majority's; "
            f"repaired from rank {verdict.source}",
            level=logging.ERROR,
            step=w.progress.step if w.progress else 0,
            source=verdict.source,
            corrupt=list(verdict.corrupt),
        )
        w.link.channel.send("strike", reason=f"rank {a.rank}'s replica was corrupt")
    return True


def straggler_watch(cfg: config.HealthConfig, world: int) -> StragglerWatch | None:
    """A round's comparisons of compute times, or None when they are off or a rank is alone."""
    if cfg.straggler is config.StragglerPolicy.off or world < 2:
        return None
    return StragglerWatch(cfg.straggler_factor, cfg.straggler_windows)


def compare_compute(
    w: Worker, a: Assignment, watch: StragglerWatch, computed: list[float], step: int
) -> None:
    """Share this rank's mean compute time per step since the last comparison with the round's
    ranks (one all-reduce, a collective) and, if the comparison makes it a straggler, say so,
    in an event and to the agent, which acts on ``health.straggler``."""
    times = torch.zeros(a.world_size, dtype=torch.float64, device=w.device)
    times[a.rank] = sum(computed) / len(computed)
    w.comm.all_reduce(times, "straggler comparison")
    compute_s = times.tolist()
    found = watch.update(compute_s)
    if a.rank in found:
        median = statistics.median(compute_s)
        w.events.emit(
            ev.STRAGGLER,
            f"rank {a.rank} computes {found[a.rank]:.1f}x slower than the median rank "
            f"({compute_s[a.rank]:.3f} s a step against {median:.3f} s)",
            level=logging.WARNING,
            step=step,
            slowdown=round(found[a.rank], 3),
            compute_s=round(compute_s[a.rank], 4),
            median_s=round(median, 4),
        )
        w.link.channel.send("straggler", step=step, slowdown=found[a.rank])  # the agent decides
