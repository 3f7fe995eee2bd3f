"""What a worker does after each step, on every rank alike and in one order.

That is :data:`AFTER_STEP`, an ordered list of small checks; some are collectives. Each
check reads the step just trained (:class:`StepDone`) and the round's training (:class:`Steps`).
It returns an :class:`Action` the loop acts on, the way torch elastic's rendezvous operations
return an ``_Action``.

The checks: a non-finite step skipped and a run of them rolled back (:mod:`elastic.nonfinite`),
this rank's compute compared with its peers' (:mod:`elastic.stragglers`), the replicas
compared and a minority repaired (:mod:`elastic.replicas`), the step reported, a due
evaluation run (:func:`evaluate_if_due`) and a due checkpoint started (:mod:`elastic.saving`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum, auto

import torch

from elastic import config
from elastic import event_types as ev
from elastic.checkpoint import CheckpointManager
from elastic.control import Assignment
from elastic.evaluate import due_evaluation
from elastic.job import EvalContext
from elastic.nonfinite import Verdict, first_producer
from elastic.replicas import checksum, judge_shards
from elastic.round_entry import RoundStart, fit_world, report_recovery
from elastic.sampler import StepPlan
from elastic.saving import checkpoint_every, save
from elastic.sharding import reshard
from elastic.state import Progress, broadcast_tensors, local
from elastic.stragglers import StragglerWatch
from elastic.worker import Worker


def skip_nonfinite(w: Worker, a: Assignment, loss: float, step: int) -> Verdict:
    """Handle a step skipped on every rank because its averaged gradients were not finite.

    Find the first rank whose loss was not finite (one small all-reduce), count the step, and say
    so (rank 0). After ``health.nonfinite_rollback`` in a row, the rank that produced every one of
    them has its node struck (:mod:`elastic.nonfinite`)."""
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
    """Load the newest checkpoint on every rank (a collective) because of ``why``.

    Returns the progress to train on from, or None (and training goes on) when there is no
    checkpoint yet."""
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
    """Compare every rank's checksum of its parameters and optimizer state, and repair a minority.

    The comparison is one all-reduce of one integer per rank (:mod:`elastic.replicas`), judged
    for each shard's replicas under ``parallel.shard=node``. A minority takes the state of a
    majority rank (a broadcast, over its shard's replicate group) and its node gets a strike.
    False when some shard has no majority: every rank rolls back."""
    replicated = w.state.replicated()
    names = sorted(replicated)
    sums = torch.zeros(a.world_size, dtype=torch.int64, device=w.device)
    sums[a.rank] = checksum(replicated, names)
    w.comm.all_reduce(sums, "replica check")
    per_node = w.env.local_world_size if w.mesh is not None else 1
    verdicts = judge_shards(sums.tolist(), per_node)
    if any(v.roll_back for v in verdicts):
        return False
    verdict = verdicts[a.rank % per_node]
    if verdict.agree:
        return True  # another shard's replicas, if any, repair among themselves
    group = w.mesh.get_group("replicate") if w.mesh is not None else None
    with w.comm.collective("replica repair"):
        tensors = [local(replicated[n]) for n in names]
        broadcast_tensors(tensors, verdict.source // per_node, w.device, group)
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
    """Compare this rank's compute time with its peers', and say so if it became a straggler.

    It shares this rank's mean compute time per step since the last comparison with the round's
    ranks (one all-reduce, a collective). If the comparison makes it a straggler, it says so in
    an event and to the agent, which acts on ``health.straggler``."""
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


class Action(Enum):
    """What the loop does after a check."""

    GO_ON = auto()  # the next check, then the next step
    ROLL_BACK = auto()  # train again from Steps.progress, a checkpoint's (every rank alike)


@dataclass(frozen=True)
class StepDone:
    """The step just trained, as the checks after it read it."""

    plan: StepPlan
    lr: float
    loss: float  # this rank's mean over its real samples
    metrics: dict[str, float]  # the job's, the same way
    taken: bool  # whether the optimizer stepped
    finite: bool  # whether the averaged gradients were finite


@dataclass
class Steps:
    """One round's training as the loop and the checks share it.

    It holds where the training stands, the last save, and the counters the reports and
    comparisons keep between steps."""

    a: Assignment
    ckpt: CheckpointManager
    start: RoundStart
    progress: Progress
    saved: Progress  # the newest progress a checkpoint holds (or was started for)
    first_step: bool = True  # of the round: its recovery is reported after it
    watch: StragglerWatch | None = None
    computed: list[float] = field(default_factory=list)  # compute times since the comparison
    t_log: float = 0.0  # when the last step event was written, and the samples seen then
    samples_log: int = 0
    t_saved: float = 0.0  # when the last save started, and its step
    step_saved: int = 0

    def restart(self, cfg: config.HealthConfig) -> None:
        """Begin a stretch of steps (the round's, or after a rollback).

        Its comparisons and rates count from here."""
        self.watch, self.computed = straggler_watch(cfg, self.a.world_size), []
        self.t_log = self.t_saved = time.perf_counter()
        self.samples_log, self.step_saved = self.progress.samples_seen, self.progress.step


def nonfinite(w: Worker, s: Steps, done: StepDone) -> Action:
    """A step with non-finite gradients was skipped: count it, and roll back after a run."""
    if done.finite:
        w.nonfinite.update(True)
        return Action.GO_ON
    if skip_nonfinite(w, s.a, done.loss, s.progress.step) is Verdict.ROLL_BACK:
        return rolled_back(w, s, "non-finite steps in a row")
    return Action.GO_ON


def stragglers(w: Worker, s: Steps, done: StepDone) -> Action:
    """Keep this step's compute time; compare every ``health.straggler_every`` steps."""
    if s.watch is not None:
        s.computed.append(w.hook.timing.last_compute_s)
        if s.progress.step % w.cfg.health.straggler_every == 0:
            compare_compute(w, s.a, s.watch, s.computed, s.progress.step)
            s.computed = []
    return Action.GO_ON


def replicas(w: Worker, s: Steps, done: StepDone) -> Action:
    """Every ``health.replica_check_every`` steps, compare the replicas.

    Roll back when no majority agrees."""
    every = w.cfg.health.replica_check_every
    if not every or s.a.world_size < 2 or s.progress.step % every:
        return Action.GO_ON
    if check_replicas(w, s.a):
        return Action.GO_ON
    return rolled_back(w, s, "replicas differ, and no majority agrees")


def rolled_back(w: Worker, s: Steps, why: str) -> Action:
    """Roll back to the newest checkpoint (:func:`roll_back`), or go on if there is none."""
    back = roll_back(w, s.a, s.ckpt, s.progress, why)
    if back is None:
        return Action.GO_ON
    s.progress = s.saved = back
    return Action.ROLL_BACK


def fp16_skipped(w: Worker, s: Steps, done: StepDone) -> Action:
    """Say (rank 0) that fp16's loss scaler skipped the step."""
    if s.a.rank == 0 and not done.taken and done.finite:
        w.events.emit(
            ev.STEP_SKIPPED,
            f"step {s.progress.step}: inf/nan in the fp16 gradients; the optimizer step was "
            "skipped on every rank and the loss scale lowered",
            level=logging.WARNING,
            step=s.progress.step,
            scale=w.precision.scaler.get_scale(),
        )
    return Action.GO_ON


def recovery(w: Worker, s: Steps, done: StepDone) -> Action:
    """After a round's first step, say (rank 0) how long the recovery that began it took."""
    if s.a.rank == 0 and s.first_step and w.interrupted_at is not None:
        report_recovery(w, s.a, s.start, s.progress.step)
    s.first_step = False
    return Action.GO_ON


def step_event(w: Worker, s: Steps, done: StepDone) -> Action:
    """Every ``trainer.log_every`` steps, rank 0 writes the step's event (loss, LR, rate)."""
    if s.a.rank or s.progress.step % w.cfg.trainer.log_every:
        return Action.GO_ON
    now, p = time.perf_counter(), s.progress
    scaler = w.precision.scaler  # fp16: the loss scale, a run's health
    w.events.emit(
        ev.STEP,
        step=p.step,
        samples=p.samples_seen,
        step_samples=done.plan.global_count,
        global_batch=p.global_batch,
        epoch=p.sampler.epoch,
        loss=done.loss,
        lr=done.lr,
        world_size=s.a.world_size,
        samples_per_s=(p.samples_seen - s.samples_log) / (now - s.t_log),
        **({"loss_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
        **({"metrics": done.metrics} if done.metrics else {}),
    )
    s.t_log, s.samples_log = now, p.samples_seen
    return Action.GO_ON


def evaluation(w: Worker, s: Steps, done: StepDone) -> Action:
    """Run the evaluation due after this step, before the save, which records it."""
    s.progress = evaluate_if_due(w, s.a, s.progress)
    return Action.GO_ON


def checkpoint(w: Worker, s: Steps, done: StepDone) -> Action:
    """Start the checkpoint due after this step.

    None starts within a run of non-finite steps, whose state may be spoiled (batch norm)."""
    due = s.progress.step % checkpoint_every(w.cfg.checkpoint, s.progress) == 0
    if due and w.nonfinite.streak == 0:
        now = time.perf_counter()
        step_s = (now - s.t_saved) / max(1, s.progress.step - s.step_saved)
        s.progress = s.saved = w.progress = save(w, s.ckpt, s.progress, s.a, step_s)
        s.t_saved, s.step_saved = now, s.progress.step
    return Action.GO_ON


Check = Callable[[Worker, Steps, StepDone], Action]
# In this order on every rank: the collectives among them must meet.
AFTER_STEP: tuple[Check, ...] = (
    nonfinite,
    stragglers,
    replicas,
    fp16_skipped,
    recovery,
    step_event,
    evaluation,
    checkpoint,
)


def evaluate_if_due(w: Worker, a: Assignment, progress: Progress) -> Progress:
    """Run the validation that is due after ``progress`` (a collective), if any.

    Returns the progress that records it.

    Which evaluation is due is a pure function of the progress record
    (:func:`elastic.evaluate.due_evaluation`), which travels with the state: an evaluation a
    broken round cut short is due again in the next round, and a completed one is never redone.
    Every rank evaluates its shard of the validation set; one all-reduce adds them up.
    """
    cfg = w.cfg
    due = due_evaluation(
        progress.samples_seen,
        progress.evaluated,
        len(w.dataset),
        cfg.trainer.eval_every_epochs,
        w.total,
    )
    if due is None or not w.job.has_validation():
        return progress
    w.link.status["phase"] = "evaluate"
    if a.rank == 0:
        w.events.emit(ev.EVALUATION_STARTED, evaluation=due, step=progress.step)
    t0 = time.perf_counter()
    ctx = EvalContext(
        a.rank,
        a.world_size,
        w.device,
        cfg.data.batch_size,
        w.loader_workers,
        all_reduce=w.comm.all_reduce,
        autocast=w.precision.autocast,
        stop=lambda: w.comm.aborted,
        equal_batches=w.mesh is not None,
    )
    try:
        result = w.job.evaluate(w.state.model, ctx)
    finally:
        reshard(w.state.model)  # a sharded model's root keeps its gathered weights after forward
    if a.rank == 0:
        w.events.emit(
            ev.EVALUATED,
            evaluation=due,
            epoch=round(progress.samples_seen / len(w.dataset), 4),
            step=progress.step,
            top1=result.top1,
            top5=result.top5,
            loss=result.loss,
            count=result.count,
            seconds=time.perf_counter() - t0,
        )
    w.link.status["phase"] = "step"
    w.progress = replace(progress, evaluated=due)
    return w.progress
