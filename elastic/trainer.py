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
(:func:`elastic.saving.final_save`), and a run that cannot save it ends with
:data:`~elastic.control.EXIT_UNSAVED`, never as if it had succeeded. What a round's entry, the
checks between steps and the saves do is in :mod:`elastic.round_entry`,
:mod:`elastic.step_checks` and :mod:`elastic.saving`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import replace

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel

from elastic import config
from elastic import event_types as ev
from elastic.agent_link import AgentLink
from elastic.async_checkpoint import BackgroundSaver
from elastic.chaos_hooks import flip_one_bit, poisoned
from elastic.checkpoint import CheckpointManager
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
from elastic.ddp_hook import DDPHook
from elastic.evaluate import due_evaluation
from elastic.events import EventLog, Rotation
from elastic.job import Batch, EvalContext, Loss
from elastic.job_target import build_job
from elastic.lr_policy import LRPolicy
from elastic.nonfinite import (
    BufferBackup,
    NonFiniteSteps,
    Verdict,
    gradients_finite,
)
from elastic.optim import step_settings
from elastic.pipeline import Prefetcher, loader_workers, make_loader
from elastic.precision import MixedPrecision, dtype_of, resolve_precision
from elastic.round_end import RoundAborted, RoundEnd, release, round_end
from elastic.round_entry import RoundStart, enter_round, report_recovery
from elastic.sampler import ElasticSampler, StepPlan
from elastic.saving import checkpoint_every, final_save, save
from elastic.state import Progress, TrainState
from elastic.step_checks import (
    check_replicas,
    compare_compute,
    roll_back,
    skip_nonfinite,
    straggler_watch,
)
from elastic.worker import Worker

log = logging.getLogger("elastic.trainer")


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
    comm = Communicator(device, cfg.rendezvous.pg_timeout_s, backend=str(cfg.comm.backend))
    hook = DDPHook(comm, dtype_of(cfg.comm.grad_dtype))
    link = AgentLink(Channel.from_environ(), comm, hook)
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
        hook=hook,
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
    ddp = w.hook.wrap(w.state.model)
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
            computed.append(w.hook.timing.last_compute_s)
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
    w.hook.begin_step()
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
    w.hook.end_step()
    means = torch.stack(list(sums.values())).div(plan.real).tolist() if sums else []
    return total / plan.real, dict(zip(sums, means, strict=True)), taken, finite


def per_sample_loss(out: torch.Tensor | Loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A job's :meth:`~elastic.job.Job.loss`, bare or with its metrics."""
    return (out, {}) if isinstance(out, torch.Tensor) else (out.per_sample, out.metrics)


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
