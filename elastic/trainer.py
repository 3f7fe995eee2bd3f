"""The worker: one process per GPU (or CPU slot), started once by its node's agent, the runtime
around a job (:mod:`elastic.job`: what to train, named by ``job._target_``).

A worker outlives rounds, so that a broken round costs at most the step in flight: the survivors
keep their state in memory and carry on from it. Read it top to bottom: :func:`main` builds what
does not depend on the round and loops over the agent's assignments, :func:`train_round` is one
round, and :func:`train_step` one optimizer step. A round ends in one of three ways, told apart by
what the communicator recorded and the error's type (:func:`elastic.round_end.round_end`), never
by an error's text: the agent announced a new round, a collective failed (a peer died: the worker
tells its agent, which finds the dead peer), or this worker failed by itself (neither of those, or a
fault of its device): it exits with :data:`~elastic.control.EXIT_FAILED`. A checkpoint that cannot
be written ends nothing, but the final one: the end keeps the trained state and retries it
(:func:`final_save`), and a run that cannot save it ends with :data:`~elastic.control.EXIT_UNSAVED`,
never as if it had succeeded.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elastic import config
from elastic import event_types as ev
from elastic.agent_link import AgentLink
from elastic.async_checkpoint import WAIT_POLL_S, BackgroundSaver, Started
from elastic.checkpoint import CheckpointManager
from elastic.checkpoint_interval import Measured, choose_interval
from elastic.communicator import Communicator, pick_device
from elastic.control import (
    EXIT_FAILED,
    EXIT_PEER_LOST,
    EXIT_UNSAVED,
    Assignment,
    Channel,
    WorkerEnv,
)
from elastic.curves import Curves
from elastic.evaluate import due_evaluation
from elastic.events import EventLog, Rotation
from elastic.final_save import retry_in, unsaved_steps
from elastic.job import Batch, EvalContext, Job, Loss
from elastic.job_target import build_job
from elastic.lr_policy import LRPolicy
from elastic.manifest import newest_manifest
from elastic.nonfinite import (
    BufferBackup,
    NonFiniteSteps,
    Verdict,
    first_producer,
    gradients_finite,
)
from elastic.optim import step_settings
from elastic.pipeline import Prefetcher, loader_workers, make_loader
from elastic.precision import MixedPrecision, dtype_of, resolve_precision
from elastic.replicas import checksum, judge
from elastic.round_end import RoundAborted, RoundEnd, release, round_end
from elastic.sampler import ElasticSampler, StepPlan
from elastic.state import Progress, TrainState, sync_state
from elastic.stragglers import StragglerWatch

log = logging.getLogger("elastic.trainer")


@dataclass
class Worker:
    """Everything that outlives a round."""

    cfg: config.Config
    env: WorkerEnv
    events: EventLog
    device: torch.device
    comm: Communicator
    link: AgentLink
    job: Job[Any]
    dataset: Dataset[Any]  # the job's training set
    sampler: ElasticSampler
    policy: LRPolicy
    total: int  # samples the whole run trains
    state: TrainState
    precision: MixedPrecision
    loader_workers: int  # per training worker (data.loader_workers resolved)
    saver: BackgroundSaver
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    progress: Progress | None = None  # None until this process holds a state
    trained_round: int = -1  # the round this state was last trained or synced in
    interrupted_at: float | None = None  # when the previous round broke for this worker
    nonfinite: NonFiniteSteps = field(default_factory=lambda: NonFiniteSteps(3))
    flip_bit: threading.Event = field(default_factory=threading.Event)  # chaos: SIGUSR1
    poisoned: set[int] = field(default_factory=set)  # chaos.nan_steps already made NaN
    buffers: BufferBackup | None = None  # the model's buffers before the step in flight
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the model's, in order


def main() -> int:
    """Build what does not depend on the round (the job's data, model and optimizer), then loop:
    wait for the agent's assignment, train in that round until the job is trained or the round
    breaks, and when it breaks wait for the next assignment with everything still in memory."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # The agent decides when this worker stops (it closes the control channel). A SIGTERM sent
    # to the whole node (a scheduler's preemption, systemd) must reach the agent's planned leave
    # and let this worker finish its steps, not kill it in the middle of one.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = WorkerEnv.from_environ()
    cfg = config.load(env.config)
    torch.set_num_threads(env.threads)
    rotation = Rotation.of_mb(cfg.trainer.events_rotate_mb, cfg.trainer.events_keep)
    events = EventLog(
        env.run_dir, env.node_id, log, rotation=rotation, role="worker", local_rank=env.local_rank
    )
    curves = Curves(events, env.run_dir, cfg.trainer.tensorboard)  # written while at rank 0
    device = pick_device(cfg.cluster.device, env.local_rank)
    comm = Communicator(
        device,
        cfg.rendezvous.pg_timeout_s,
        dtype_of(cfg.comm.grad_dtype),
        backend=str(cfg.comm.backend),
    )
    link = AgentLink(Channel.from_environ(), comm)
    precision = MixedPrecision(resolve_precision(cfg.trainer.precision, device), device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: pick the fastest kernels once

    job = build_job(cfg, device)
    dataset = job.train_data()
    torch.manual_seed(cfg.trainer.seed)  # every rank builds the same model
    model = job.build_model()
    state = TrainState(model, job.build_optimizer(model))
    total = round(cfg.trainer.epochs * len(dataset))
    w = Worker(
        cfg=cfg,
        env=env,
        events=events,
        device=device,
        comm=comm,
        link=link,
        job=job,
        dataset=dataset,
        sampler=ElasticSampler(len(dataset), cfg.data.batch_size, cfg.trainer.seed),
        policy=LRPolicy.from_config(cfg.optim, cfg.data.batch_size, len(dataset), total),
        total=total,
        state=state,
        precision=precision,
        # env.threads is this worker's share of the node's cores, as its agent divided them.
        loader_workers=loader_workers(
            cfg.data.loader_workers, env.local_world_size, env.threads * env.local_world_size
        ),
        saver=BackgroundSaver(events),
        tensors=state.tensors()
        | precision.tensors()
        | {f"job.{name}": t for name, t in job.state().items()},
    )
    w.nonfinite = NonFiniteSteps(cfg.health.nonfinite_rollback)
    w.buffers = BufferBackup(model)
    w.params = list(model.parameters())
    if cfg.chaos.allow:  # python -m chaos's corrupt_replica: flip a bit between two steps
        signal.signal(signal.SIGUSR1, lambda signum, frame: w.flip_bit.set())
    # All built so far lives as long as the worker (torch's modules included, about 350,000
    # objects): moved out of the collector's reach, a full collection no longer scans it, which
    # paused the training thread and a background save 0.16-0.19 s at random.
    gc.freeze()
    link.status["phase"] = "idle"
    link.channel.send("ready")

    last_round = 0
    while True:
        link.status["phase"] = "idle"
        assignment = link.next_assignment(after=last_round, timeout=cfg.rendezvous.join_timeout_s)
        if assignment is None:
            log.error("no round assigned within rendezvous.join_timeout_s; leaving")
            curves.close()
            return EXIT_PEER_LOST
        last_round = assignment.round
        events.update(rank=assignment.rank, round=assignment.round)
        curves.follow(assignment.rank)
        try:
            saved = train_round(w, assignment)
            curves.close()  # before the agent may stop this worker
            if saved:
                link.channel.send("finished", round=assignment.round)  # the round the job names
            comm.close()
            return 0 if saved else EXIT_UNSAVED  # rank 0's final_save_failed names the steps
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            end = round_end(comm.aborted, comm.failure, exc)
            if end is RoundEnd.LOCAL_FAULT:
                error = f"{type(exc).__name__}: {exc}"
                events.emit(
                    ev.WORKER_FAILED,
                    f"rank {assignment.rank} failed in round {assignment.round}: {error}",
                    level=logging.ERROR,
                    error=error[:500],
                    step=w.progress.step if w.progress else 0,
                )
                curves.close()
                raise
            w.interrupted_at = time.time()
            w.saver.abandon()
            failure = comm.failure
            if end is RoundEnd.PEER_LOST and failure is not None:
                # A collective failed before the agent knew anything: tell it, so that it checks
                # which peer is gone and drops it without waiting for the lease to expire.
                link.channel.send("peer_lost", round=assignment.round, error=failure.error)
                events.emit(
                    ev.WORKER_PEER_LOST,
                    f"rank {assignment.rank} left round {assignment.round}: {failure}",
                    level=logging.WARNING,
                    what=failure.what,
                    error=failure.error,
                )
            else:
                log.info("rank %d left round %d for the next one", assignment.rank, last_round)
            release(exc)  # else torch's futures would keep the round (its DDP, group) alive


@dataclass(frozen=True)
class RoundStart:
    """Where a round begins: the state every rank now holds, the global batch for this world
    size, and when each step of entering it ended (for the recovery breakdown)."""

    progress: Progress
    global_batch: int
    source: int  # the rank whose memory the state came from; -1: a checkpoint or scratch
    assigned_at: float
    pg_ready_at: float
    synced_at: float


def train_round(w: Worker, a: Assignment) -> bool:
    """Enter round ``a`` (:func:`enter_round`: its group, the newest state any rank holds, the
    LR for its world size), wrap DDP, then train step by step from where the state says until
    the job is trained, and save the final state (:func:`final_save`); a collective. A rollback
    (:func:`roll_back`) starts the steps again from the checkpoint it loaded. Returns whether
    the final state is saved, the same on every rank."""
    cfg, events, rank, world = w.cfg, w.events, a.rank, a.world_size
    ckpt = CheckpointManager(cfg.checkpoint.url, cfg.checkpoint.keep, events, w.comm.collective)
    start = enter_round(w, a, ckpt)
    # An evaluation the previous round broke off, or the end's when nothing is left to train.
    progress = saved = maybe_evaluate(w, a, start.progress)
    ddp = w.comm.wrap(w.state.model)
    first_step = True
    while True:
        progress, saved, first_step, rolled_back = train_steps(
            w, a, ddp, ckpt, start, progress, saved, first_step
        )
        if not rolled_back:
            break

    trained = progress.step > start.progress.step
    # A round that trained nothing, on a state received from memory, may follow one that was
    # left while it wrote its last checkpoint (abandoned): then that step is saved here.
    if progress != saved or (
        not trained and start.source >= 0 and not ckpt.committed(progress.step)
    ):
        save(w, ckpt, progress, a, 0.0)
    w.link.status["phase"] = "finishing"  # waits for the last save and the peers: not frozen
    # The replica as trained, before the final save's collectives: a peer held in them (rank 0
    # still committing) has recorded its end, and saving changes nothing of it.
    events.emit(ev.STATE_DIGEST, step=progress.step, digest=w.state.digest())
    saved = final_save(w, a, ckpt, progress)
    if rank == 0 and saved:
        events.emit(
            ev.TRAINING_DONE,
            step=progress.step,
            samples_seen=progress.samples_seen,
            world_size=world,
        )
    # No rank ends before every rank has got here, rank 0 with its record of the end: a rank
    # that ended while a peer was pulled into a newer round (a node joining at the last step)
    # would have its node mark the job done, and the job would end unrecorded and the last
    # checkpoint uncommitted. Past this point, the job's end is written.
    w.comm.barrier("the end of training")
    return saved


def final_save(w: Worker, a: Assignment, ckpt: CheckpointManager, progress: Progress) -> bool:
    """Whether the final state, ``progress``'s, is in a committed checkpoint, as every rank
    agrees; a collective, once its save was started (or found unneeded).

    The final weights are the run's product, so a save of them that failed (a full disk, a store
    that is down) is not the end: every rank keeps the state in memory, and the ranks save it
    again together after :func:`elastic.final_save.retry_in`'s pauses, rank 0 saying so at each
    (``final_save_retry``, which the owner's alert follows), until it commits or
    ``checkpoint.final_retry_s`` is spent; then rank 0 names the steps not saved
    (``final_save_failed``). Rank 0 commits, so its answer and its clock go to every rank in one
    all-reduce per attempt: the ranks decide alike and retry together.
    """
    began = time.monotonic()
    limit_s = w.cfg.checkpoint.final_retry_s
    failed = 0
    while True:
        committed = w.saver.wait(lambda: w.comm.aborted) == progress.step
        saved_step = None
        if a.rank == 0 and not committed:
            # Or it was committed before this round: a state resumed or rolled back to.
            saved_step = newest_saved(ckpt.url)
            committed = saved_step == progress.step
        word = torch.zeros(2, dtype=torch.float64, device=w.device)
        if a.rank == 0:
            word[0], word[1] = float(committed), time.monotonic() - began
        w.comm.all_reduce(word, "final save")
        if word[0].item():
            return True
        failed += 1
        elapsed_s = word[1].item()
        pause_s = retry_in(failed, elapsed_s, limit_s)
        if a.rank == 0:
            report_unsaved(w, progress.step, saved_step, failed, elapsed_s, pause_s)
        if pause_s is None:
            return False
        pause(w, pause_s)
        start_save(w, ckpt, progress, a, 0.0)


def report_unsaved(
    w: Worker,
    step: int,
    saved_step: int | None,
    failed: int,
    elapsed_s: float,
    pause_s: float | None,
) -> None:
    """Rank 0: the final state, of ``step``, is not saved after ``failed`` attempts over
    ``elapsed_s``; the newest checkpoint is ``saved_step``'s. Either the save is retried in
    ``pause_s`` (``final_save_retry``), or (None) the run gives up (``final_save_failed``)."""
    limit_s = w.cfg.checkpoint.final_retry_s
    lost = unsaved_steps(saved_step, step)
    newest = "none" if saved_step is None else f"the checkpoint of step {saved_step}"
    if pause_s is None:
        w.events.emit(
            ev.FINAL_SAVE_FAILED,
            f"the final checkpoint, of step {step}, could not be written in {failed} "
            f"attempt(s) over {elapsed_s:.0f} s (checkpoint.final_retry_s={limit_s:g}): {lost} "
            f"were trained but are not saved; the newest saved is {newest}. Fix: what the "
            "checkpoint_failed events name, then run again with the same job_id to train them "
            "again",
            level=logging.ERROR,
            step=step,
            saved_step=saved_step,
            attempts=failed,
            waited_s=round(elapsed_s, 3),
        )
        return
    w.events.emit(
        ev.FINAL_SAVE_RETRY,
        f"the final checkpoint, of step {step}, did not commit: {lost} are not saved (the "
        f"newest saved is {newest}). The state is kept in memory; retry {failed} in "
        f"{pause_s:.0f} s, for up to {limit_s - elapsed_s:.0f} s more "
        "(checkpoint.final_retry_s). Fix: what the checkpoint_failed events name",
        level=logging.ERROR,
        step=step,
        saved_step=saved_step,
        attempt=failed,
        retry_in_s=round(pause_s, 3),
        left_s=round(limit_s - elapsed_s, 3),
    )


def newest_saved(url: str) -> int | None:
    """The step of the newest committed checkpoint at ``url`` (rank 0, at the end); None when
    there is none, or when the store cannot be listed, which is then what failed the save."""
    try:
        newest = newest_manifest(url)
    except Exception as exc:  # any fsspec backend's error: the store is what is down
        log.warning("could not list the checkpoints at %s: %s: %s", url, type(exc).__name__, exc)
        return None
    return int(newest["step"]) if newest is not None else None


def pause(w: Worker, seconds: float) -> None:
    """Wait ``seconds`` between two attempts of the final save, leaving as soon as the round
    is left (:class:`RoundAborted`; the next round keeps the state and saves it again)."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if w.comm.aborted:
            raise RoundAborted("the round was left while the final save waited to be retried")
        time.sleep(min(left, WAIT_POLL_S))


def train_steps(
    w: Worker,
    a: Assignment,
    ddp: DistributedDataParallel,
    ckpt: CheckpointManager,
    start: RoundStart,
    progress: Progress,
    saved: Progress,
    first_step: bool,
) -> tuple[Progress, Progress, bool, bool]:
    """Train from ``progress`` to the end of the job; returns the progress, the last saved one,
    whether the first step is still to come, and whether the ranks rolled back (then the steps
    start again from the progress returned)."""
    cfg, events, rank, world = w.cfg, w.events, a.rank, a.world_size
    global_batch = progress.global_batch
    remaining = w.total - progress.samples_seen
    batches = w.sampler.batches(progress.sampler, rank, world, remaining, global_batch)
    loader = make_loader(w.dataset, batches, w.loader_workers, w.device, w.job.collate())
    t_log, samples_log = time.perf_counter(), progress.samples_seen
    t_saved, step_saved = t_log, progress.step  # for the step time the next save reports
    watch, computed = straggler_watch(cfg.health, world), []
    for batch in Prefetcher(loader, w.device, w.job.to_device):
        if w.comm.aborted or w.link.switch_due(progress.step):
            raise RoundAborted("a new round was announced")
        if w.flip_bit.is_set():
            flip_one_bit(w, progress.step)
        plan = w.sampler.plan(
            progress.sampler, rank, world, w.total - progress.samples_seen, global_batch
        )
        if cfg.trainer.record_samples:
            events.emit(
                ev.SAMPLES,
                step=progress.step + 1,
                epoch=plan.epoch,
                world_size=world,
                indices=list(plan.indices[: plan.real]),
                before=w.state.fingerprint(),
            )
        lr = w.policy.lr(progress.samples_seen, global_batch, progress.ramp)
        w.state.apply({"lr": lr, **step_settings(cfg.optim, progress.samples_seen, len(w.dataset))})
        w.link.status.update(phase="step", step=progress.step + 1)
        poison = poisoned(w, rank, progress.step + 1)
        loss, metrics, taken, finite = train_step(w, ddp, batch, plan, world, poison)
        progress = progress.after(plan, w.sampler.advance(progress.sampler, plan), world, lr)
        w.progress = progress
        # After the step is recorded: an abort in these collectives loses nothing.
        if finite:
            w.nonfinite.update(True)
        elif skip_nonfinite(w, a, loss, progress.step) is Verdict.ROLL_BACK:
            back = roll_back(w, a, ckpt, progress, "non-finite steps in a row")
            if back is not None:
                return back, back, first_step, True
        if watch is not None:
            computed.append(w.comm.last_compute_s)
            if progress.step % cfg.health.straggler_every == 0:
                compare_compute(w, a, watch, computed, progress.step)
                computed = []
        every = cfg.health.replica_check_every
        if every and world > 1 and progress.step % every == 0 and not check_replicas(w, a):
            back = roll_back(w, a, ckpt, progress, "replicas differ, and no majority agrees")
            if back is not None:
                return back, back, first_step, True
        if rank == 0 and not taken and finite:
            events.emit(
                ev.STEP_SKIPPED,
                f"step {progress.step}: inf/nan in the fp16 gradients; the optimizer step was "
                "skipped on every rank and the loss scale lowered",
                level=logging.WARNING,
                step=progress.step,
                scale=w.precision.scaler.get_scale(),
            )

        if rank == 0 and first_step and w.interrupted_at is not None:
            report_recovery(w, a, start, progress.step)
        first_step = False
        if rank == 0 and progress.step % cfg.trainer.log_every == 0:
            now = time.perf_counter()
            scaled = w.precision.scaler.is_enabled()  # fp16: the loss scale, a run's health
            events.emit(
                ev.STEP,
                step=progress.step,
                samples=progress.samples_seen,
                step_samples=plan.global_count,
                global_batch=global_batch,
                epoch=progress.sampler.epoch,
                loss=loss,
                lr=lr,
                world_size=world,
                samples_per_s=(progress.samples_seen - samples_log) / (now - t_log),
                **({"loss_scale": w.precision.scaler.get_scale()} if scaled else {}),
                **({"metrics": metrics} if metrics else {}),
            )
            t_log, samples_log = now, progress.samples_seen
        progress = maybe_evaluate(w, a, progress)  # before the save, which records it
        # No save within a run of non-finite steps: its state may be spoiled (batch norm).
        due = progress.step % checkpoint_every(cfg.checkpoint, progress) == 0
        if due and w.nonfinite.streak == 0:
            now = time.perf_counter()
            step_s = (now - t_saved) / max(1, progress.step - step_saved)
            progress = w.progress = save(w, ckpt, progress, a, step_s)
            saved, t_saved, step_saved = progress, now, progress.step
    return progress, saved, first_step, False


def enter_round(w: Worker, a: Assignment, ckpt: CheckpointManager) -> RoundStart:
    """The recovery steps of ARCHITECTURE.md that make a round trainable: build its group, agree
    on the newest state any rank holds (a checkpoint only when none does), and set the LR the
    policy gives for this world size, ramped when it grew."""
    assigned_at = time.time()
    w.link.status.update(phase="joining", round=a.round)
    w.comm.enter(a)
    pg_ready_at = time.time()

    with w.comm.collective("state sync"):
        progress, source = sync_state(w.tensors, w.progress, w.trained_round, w.device)
    resumed_from = None
    if progress is None:
        info = ckpt.restore(w.tensors)
        progress = Progress.from_dict(info.manifest["progress"]) if info else Progress()
        resumed_from = info.step if info else None
    w.progress, w.trained_round = progress, a.round
    w.nonfinite.rolled_back()  # skipped steps in a row count within a round: every rank alike
    synced_at = time.time()
    w.events.emit(ev.STATE_SYNCED, step=progress.step, source=source, digest=w.state.digest())

    progress = fit_world(w, a, progress)
    global_batch = progress.global_batch
    lr = w.policy.lr(progress.samples_seen, global_batch, progress.ramp)
    if a.rank == 0:
        w.events.emit(
            ev.TRAINING_STARTED,
            world_size=a.world_size,
            step=progress.step,
            samples_seen=progress.samples_seen,
            total_samples=w.total,
            resumed_from=resumed_from,
            in_place=source >= 0,
            lr=lr,
            global_batch=global_batch,
        )
    return RoundStart(progress, global_batch, source, assigned_at, pg_ready_at, synced_at)


def fit_world(w: Worker, a: Assignment, progress: Progress) -> Progress:
    """``progress`` with the global batch the LR policy gives round ``a``'s world size, ramped
    (and the change logged) when that world differs from the one the state last trained in."""
    global_batch = w.policy.global_batch(a.world_size, progress.global_batch)
    resized = bool(progress.global_batch) and progress.global_batch != global_batch
    progress = replace(progress, global_batch=global_batch)
    if not resized:
        return progress
    progress = progress.with_ramp(
        w.policy.after_resize(progress.samples_seen, progress.lr, global_batch)
    )
    if a.rank == 0:
        w.events.emit(
            ev.LR_CHANGED,
            reason="world_size",
            optimizer=str(w.cfg.optim.name),
            old_world_size=progress.world_size,
            world_size=a.world_size,
            old_lr=progress.lr,
            lr=w.policy.lr(progress.samples_seen, global_batch, progress.ramp),
            ramp_samples=w.policy.resize_warmup_samples if progress.ramp else 0,
            policy=w.policy.policy,
        )
    return progress


def report_recovery(w: Worker, a: Assignment, start: RoundStart, step: int) -> None:
    """The first step after a round broke: how long detection, rendezvous, rebuild, state sync
    and the first step took (rank 0's ``recovered`` event)."""
    assert w.interrupted_at is not None
    now = time.time()
    w.events.emit(
        ev.RECOVERED,
        step=step,
        world_size=a.world_size,
        interrupted_at=w.interrupted_at,
        formed_at=a.formed_at,
        assigned_at=start.assigned_at,
        pg_ready_at=start.pg_ready_at,
        synced_at=start.synced_at,
        first_step_at=now,
        rendezvous_s=max(0.0, a.formed_at - w.interrupted_at),
        rebuild_s=start.pg_ready_at - max(a.formed_at, w.interrupted_at),
        sync_s=start.synced_at - start.pg_ready_at,
        first_step_s=now - start.synced_at,
        in_place=start.source >= 0,
    )


def maybe_evaluate(w: Worker, a: Assignment, progress: Progress) -> Progress:
    """Run the validation that is due after ``progress`` (a collective), if any; the progress
    that records it.

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
    )
    result = w.job.evaluate(w.state.model, ctx)
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


def train_step(
    w: Worker,
    ddp: DistributedDataParallel,
    batch: Batch,
    plan: StepPlan,
    world: int,
    poison: bool = False,
) -> tuple[float, dict[str, float], bool, bool]:
    """One optimizer step on this rank's share of the global batch, the job's loss of each
    sample (:meth:`elastic.job.Job.loss`) weighted and back-propagated; returns its mean loss,
    the mean of each of the job's metrics over the same samples, whether the optimizer stepped,
    and whether the averaged gradients were finite. A step with inf/nan gradients is skipped on
    every rank alike: by fp16's loss scaler (:class:`elastic.precision.MixedPrecision`), else by
    :mod:`elastic.nonfinite`. ``poison`` (chaos.nan_steps) makes this rank's loss NaN.

    The share is split into micro-batches of at most ``data.batch_size`` (more than one only under
    ``keep_global_batch`` on a smaller world); gradients accumulate locally and are all-reduced
    once, with the last micro-batch. Weighting every sample by ``world / global_count`` makes the
    DDP average the mean over the global batch (Goyal et al.), also for an uneven last step;
    padding samples get weight zero.
    """
    n = max(1, math.ceil(plan.real / w.cfg.data.batch_size))
    weight = (torch.arange(len(plan.indices), device=w.device) < plan.real).float()
    weight *= world / plan.global_count
    w.state.optimizer.zero_grad(set_to_none=True)
    assert w.buffers is not None
    w.buffers.save()
    w.comm.begin_step()
    total = 0.0
    sums: dict[str, torch.Tensor] = {}  # each metric's sum over the real samples
    micro = zip(*(t.tensor_split(n) for t in batch), strict=True)  # (part of each tensor)
    parts = zip(micro, weight.tensor_split(n), strict=True)
    for i, (part, wt) in enumerate(parts):
        with ddp.no_sync() if i < n - 1 else contextlib.nullcontext():
            with w.precision.autocast():
                per_sample, metrics = per_sample_loss(w.job.loss(ddp, part))
            if poison:
                per_sample = per_sample * float("nan")
            w.precision.backward((per_sample * wt).sum())
        real = wt > 0
        total += (per_sample.detach().float() * real).sum().item()
        for name, values in metrics.items():
            sums[name] = sums.get(name, 0) + (values.detach().float() * real).sum()
    scaled = w.precision.scaler.is_enabled()  # then the scaler judges the gradients
    finite = scaled or gradients_finite(w.params)
    taken = finite and w.precision.step(w.state.optimizer)
    if taken:
        w.job.after_step(w.state.model)
    else:
        w.buffers.restore()  # a skipped step leaves no trace, batch-norm statistics included
    w.comm.end_step()
    means = torch.stack(list(sums.values())).div(plan.real).tolist() if sums else []
    return total / plan.real, dict(zip(sums, means, strict=True)), taken, finite


def per_sample_loss(out: torch.Tensor | Loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A job's :meth:`~elastic.job.Job.loss`, bare or with its metrics."""
    return (out, {}) if isinstance(out, torch.Tensor) else (out.per_sample, out.metrics)


def poisoned(w: Worker, rank: int, step: int) -> bool:
    """Whether chaos.nan_steps makes this rank's loss NaN at ``step``: each listed step once,
    on rank chaos.nan_rank, so that the steps a rollback trains again are clean."""
    c = w.cfg.chaos
    if rank != c.nan_rank or step not in c.nan_steps or step in w.poisoned:
        return False
    w.poisoned.add(step)
    return True


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


FLIPPED_BIT = 20  # a mantissa bit: seen by a checksum, harmless to training


def flip_one_bit(w: Worker, step: int) -> None:
    """chaos's corrupt_replica (SIGUSR1, only with chaos.allow), between two steps, so that no
    collective sees half of it (:meth:`TrainState.flip_bit`)."""
    w.flip_bit.clear()
    name = w.state.flip_bit(FLIPPED_BIT)
    w.events.emit(ev.BIT_FLIPPED, step=step, param=name, index=0, bit=FLIPPED_BIT)


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


def checkpoint_every(cfg: config.CheckpointConfig, progress: Progress) -> int:
    """Steps between checkpoints: ``every_steps``, or the interval the ranks last agreed on
    when it depends on measurements (``every_minutes``, ``interval=auto``)."""
    measured = cfg.interval == config.CheckpointInterval.auto or cfg.every_minutes > 0
    return progress.checkpoint_every if measured and progress.checkpoint_every else cfg.every_steps


def save(
    w: Worker, ckpt: CheckpointManager, progress: Progress, a: Assignment, step_s: float
) -> Progress:
    """Checkpoint this step in the background (:mod:`elastic.async_checkpoint`): training is
    held only while the state is copied. A save that fails is reported by the saver, and
    training goes on: the newest good checkpoint stays, and the next interval tries again.

    Returns the progress with the interval to the next checkpoint, chosen from what the previous
    save measured on every rank (:func:`elastic.checkpoint_interval.choose_interval`), the same
    on every rank; ``step_s`` is this rank's mean step time since that save.
    """
    w.link.status["phase"] = "checkpoint"
    started = start_save(w, ckpt, progress, a, step_s)
    w.link.status["phase"] = "step"
    if started.previous is None:
        return progress
    interval = choose_interval(w.cfg.checkpoint, Measured.worst(started.previous), a.world_size)
    if interval.steps == checkpoint_every(w.cfg.checkpoint, progress):
        return progress
    if a.rank == 0:
        w.events.emit(
            ev.CHECKPOINT_INTERVAL,
            f"checkpoints every {interval.steps} steps from step {progress.step}: "
            f"{interval.reason}",
            step=progress.step,
            steps=interval.steps,
            reason=interval.reason,
        )
    return replace(progress, checkpoint_every=interval.steps)


def start_save(
    w: Worker, ckpt: CheckpointManager, progress: Progress, a: Assignment, step_s: float
) -> Started:
    """Start the background save of ``progress``'s state (:meth:`BackgroundSaver.start`)."""
    assert w.comm.save_group is not None  # set up with the round
    return w.saver.start(
        ckpt,
        progress.step,
        w.tensors,
        {"progress": progress.to_dict(), "round": a.round},
        w.comm.save_group,
        a.round,
        lambda: w.comm.aborted,
        {"step_s": step_s},
    )


if __name__ == "__main__":
    faulthandler.enable()  # a native crash leaves its stack in the worker's log
    try:
        code = main()
    except (Exception, CheckpointException):  # a local fault: its traceback goes to the log
        traceback.print_exc()
        code = EXIT_FAILED
    # Leave without interpreter finalization. A gloo group retired with a collective still
    # blocked on a dead peer cannot be torn down cleanly (gloo cannot abort it), and destroying it
    # during finalization can crash the process (SIGSEGV) after the job is done, which the agent
    # would take for a worker failure. Events are unbuffered writes; flush the rest first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
