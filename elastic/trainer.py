"""The worker: one process per GPU (or CPU slot), started once by its node's agent.

It is the runtime around a job (:mod:`elastic.job`: what to train, named by ``job._target_``).
A worker outlives rounds, so that a broken round costs at most the step in flight: the survivors
keep their state in memory and carry on from it.

Read it top to bottom. :func:`main` builds what does not depend on the round and loops over the
agent's assignments. :func:`train_round` is one round, :func:`train_steps` its loop, and
:func:`train_step` one optimizer step. What follows each step is an ordered list of checks
(:data:`elastic.step_checks.AFTER_STEP`).

A round ends in one of three ways, told apart by what the communicator recorded and the error's
type, never by an error's text (:func:`elastic.round_end.round_end`):

- the agent announced a new round;
- a collective failed: a peer died, and the worker tells its agent, which finds the dead peer;
- this worker failed by itself (neither of those, or a fault of its device): it exits with
  :data:`~elastic.control.EXIT_FAILED`.

A checkpoint that cannot be written ends nothing, except the final one. The end keeps the
trained state and retries it (:func:`elastic.saving.final_save`). A run that cannot save it ends
with :data:`~elastic.control.EXIT_UNSAVED`, never as if it had succeeded.

A round's entry is :mod:`elastic.round_entry`, the checks between steps :mod:`elastic.step_checks`,
the saves :mod:`elastic.saving`. The faults a chaos campaign asks for are
:mod:`elastic.chaos_hooks`, inert unless ``chaos.allow``.
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

import torch
from torch.distributed.checkpoint.api import CheckpointException

from elastic import config
from elastic import event_types as ev
from elastic.agent_link import AgentLink
from elastic.async_checkpoint import BackgroundSaver
from elastic.chaos_hooks import ChaosHooks
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
from elastic.events import EventLog, Rotation
from elastic.group_reaper import LAST_WAIT_S
from elastic.job import Batch, Loss
from elastic.job_target import build_job
from elastic.lr_policy import LRPolicy
from elastic.nonfinite import NonFiniteSteps
from elastic.optim import step_settings
from elastic.pipeline import Prefetcher, loader_workers, make_loader
from elastic.precision import MixedPrecision, dtype_of, resolve_precision
from elastic.round_end import RoundAborted, RoundEnd, release, round_end
from elastic.round_entry import enter_round
from elastic.sampler import ElasticSampler, StepPlan
from elastic.saving import final_save, save
from elastic.sched_policy import train_in_foreground
from elastic.sharding import judge_gradients, no_sync
from elastic.state import TrainState
from elastic.step_checks import AFTER_STEP, Action, StepDone, Steps, evaluate_if_due
from elastic.worker import Worker

log = logging.getLogger("elastic.trainer")


def main() -> int:
    """Run the worker: build what outlives rounds, then train in each round the agent assigns.

    It builds what does not depend on the round (the job's data, model and optimizer), then
    loops. It waits for the agent's assignment and trains in that round until the job is trained
    or the round breaks. When it breaks, it waits for the next assignment with everything still
    in memory."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # The agent decides when this worker stops (it closes the control channel). A SIGTERM sent
    # to the whole node (a scheduler's preemption, systemd) must reach the agent's planned leave
    # and let this worker finish its steps, not kill it in the middle of one.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = WorkerEnv.from_environ()
    cfg = config.load(env.config)
    train_in_foreground(cfg.cluster.yield_to_training)  # before any thread starts
    torch.set_num_threads(env.threads)
    rotation = Rotation.of_mb(cfg.trainer.events_rotate_mb, cfg.trainer.events_keep)
    events = EventLog(
        env.run_dir, env.node_id, log, rotation=rotation, role="worker", local_rank=env.local_rank
    )
    curves = Curves(events, env.run_dir, cfg.trainer.tensorboard)  # written while at rank 0
    w = build_worker(cfg, env, events)
    # All built so far lives as long as the worker (torch's modules included, about 350,000
    # objects): moved out of the collector's reach, a full collection no longer scans it, which
    # paused the training thread and a background save 0.16-0.19 s at random.
    gc.freeze()
    w.link.status["phase"] = "idle"
    w.link.channel.send("ready")

    last_round = 0
    while True:
        w.link.status["phase"] = "idle"
        assignment = w.link.next_assignment(after=last_round, timeout=cfg.rendezvous.join_timeout_s)
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
                w.link.channel.send("finished", round=assignment.round)  # the round the job names
            w.comm.close(wait_s=LAST_WAIT_S)  # the last group's shutdown, cleanly
            return 0 if saved else EXIT_UNSAVED  # rank 0's final_save_failed names the steps
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            end = round_end(w.comm.aborted, w.comm.failure, exc)
            if end is RoundEnd.LOCAL_FAULT:
                report_local_fault(w, assignment, exc)
                curves.close()
                raise
            leave_round(w, assignment, exc, end)


def build_worker(cfg: config.Config, env: WorkerEnv, events: EventLog) -> Worker:
    """Build everything that outlives a round.

    That is the communicator and the agent link, the job and its data, model and optimizer, and
    the runtime around them (sampler, LR policy, precision)."""
    device = pick_device(cfg.cluster.device, env.local_rank)
    comm = Communicator(device, cfg.rendezvous.pg_timeout_s, backend=str(cfg.comm.backend))
    hook = DDPHook(comm, dtype_of(cfg.comm.grad_dtype))
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
        link=AgentLink(Channel.from_environ(), comm, hook),
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
        chaos=ChaosHooks.install(cfg.chaos),
        nonfinite=NonFiniteSteps(cfg.health.nonfinite_rollback),
    )
    w.hold(state)
    return w


def report_local_fault(w: Worker, a: Assignment, exc: BaseException) -> None:
    """Record that this worker failed by itself in round ``a``; its traceback goes to the log."""
    error = f"{type(exc).__name__}: {exc}"
    w.events.emit(
        ev.WORKER_FAILED,
        f"rank {a.rank} failed in round {a.round}: {error}",
        level=logging.ERROR,
        error=error[:500],
        step=w.progress.step if w.progress else 0,
    )


def leave_round(w: Worker, a: Assignment, exc: BaseException, end: RoundEnd) -> None:
    """Leave round ``a``, which a new round or a lost peer ended (``end``).

    The state stays in memory for the next one."""
    w.interrupted_at, w.interrupted_by = time.time(), end
    w.link.left_round()
    w.saver.abandon()
    failure = w.comm.failure
    if end is RoundEnd.PEER_LOST and failure is not None:
        # A collective failed before the agent knew anything: tell it, so that it checks which
        # peer is gone and drops it without waiting for the lease to expire.
        trained = w.trained_in_round()  # none, in rounds in a row: its agent may stop the node
        w.link.channel.send("peer_lost", round=a.round, error=failure.error, trained=trained)
        w.events.emit(
            ev.WORKER_PEER_LOST,
            f"rank {a.rank} left round {a.round}: {failure}",
            level=logging.WARNING,
            what=failure.what,
            error=failure.error,
        )
    else:
        log.info("rank %d left round %d for the next one", a.rank, a.round)
    release(exc)  # else torch's futures would keep the round (its DDP, group) alive


def train_round(w: Worker, a: Assignment) -> bool:
    """Train in round ``a`` until the job is trained, and save the final state; a collective.

    It enters round ``a`` (:func:`enter_round`: its group, the newest state any rank holds, the
    LR for its world size) and wraps DDP (a sharded model needs no wrapper). Then it trains step by
    step from where the state says until the job is trained, and saves the final state
    (:func:`final_save`). A rollback starts the steps again from the checkpoint it loaded.
    Returns whether the final state is saved, the same on every rank."""
    cfg, events, rank, world = w.cfg, w.events, a.rank, a.world_size
    ckpt = CheckpointManager(cfg.checkpoint.url, cfg.checkpoint.keep, events, w.comm.collective)
    w.entered_at = None
    start = enter_round(w, a, ckpt)
    w.entered_at = start.progress.step
    # An evaluation the previous round broke off, or the end's when nothing is left to train.
    progress = evaluate_if_due(w, a, start.progress)
    steps = Steps(a, ckpt, start, progress=progress, saved=progress)
    # DDP, or the sharded model itself: FSDP2 reduces its gradients (parallel.shard=node).
    model = w.hook.wrap(w.state.model) if w.mesh is None else w.state.model
    while train_steps(w, steps, model) is Action.ROLL_BACK:
        pass
    progress = steps.progress

    trained = progress.step > start.progress.step
    # A round that trained nothing, on a state received from memory, may follow one that was
    # left while it wrote its last checkpoint (abandoned): then that step is saved here.
    if progress != steps.saved or (
        not trained and start.source >= 0 and not ckpt.committed(progress.step)
    ):
        save(w, ckpt, progress, a, 0.0)
    w.link.status["phase"] = "finishing"  # waits for the last save and the peers: not frozen
    # The replica as trained, before the final save's collectives: a peer held in them (rank 0
    # still committing) has recorded its end, and saving changes nothing of it.
    events.emit(ev.STATE_DIGEST, step=progress.step, digest=w.state.digest(), shard=w.shard_index)
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


def train_steps(w: Worker, s: Steps, model: torch.nn.Module) -> Action:
    """Train from ``s.progress`` to the end of the job, running the checks after each step.

    The checks are :data:`~elastic.step_checks.AFTER_STEP`. Returns ``ROLL_BACK`` if one rolled
    the ranks back (the steps start again from ``s.progress``), else ``GO_ON`` at the end."""
    cfg, rank, world = w.cfg, s.a.rank, s.a.world_size
    s.restart(cfg.health)
    global_batch = s.progress.global_batch
    remaining = w.total - s.progress.samples_seen
    batches = w.sampler.batches(s.progress.sampler, rank, world, remaining, global_batch)
    loader = make_loader(w.dataset, batches, w.loader_workers, w.device, w.job.collate())
    for batch in Prefetcher(loader, w.device, w.job.to_device):
        progress = s.progress
        if w.comm.aborted or not w.link.begin_step(progress.step + 1):
            raise RoundAborted("a new round was announced")
        w.chaos.before_step(w.state, w.events, progress.step)
        w.chaos.fail_collectives(w.comm, w.env.node_id, progress.step + 1)
        plan = w.sampler.plan(
            progress.sampler, rank, world, w.total - progress.samples_seen, global_batch
        )
        if cfg.trainer.record_samples:
            w.events.emit(
                ev.SAMPLES,
                step=progress.step + 1,
                epoch=plan.epoch,
                world_size=world,
                indices=list(plan.indices[: plan.real]),
                before=w.state.fingerprint(),
                shard=w.shard_index,
            )
        lr = w.policy.lr(progress.samples_seen, global_batch, progress.ramp)
        w.state.apply({"lr": lr, **step_settings(cfg.optim, progress.samples_seen, len(w.dataset))})
        poison = w.chaos.poison(rank, progress.step + 1)
        loss, metrics, taken, finite = train_step(w, model, batch, plan, poison)
        sampler = w.sampler.advance(progress.sampler, plan)
        s.progress = w.progress = progress.after(plan, sampler, world, lr)
        done = StepDone(plan, lr, loss, metrics, taken, finite)
        # After the step is recorded: an abort in these collectives loses nothing.
        for check in AFTER_STEP:
            if check(w, s, done) is Action.ROLL_BACK:
                return Action.ROLL_BACK
    return Action.GO_ON


def train_step(
    w: Worker,
    model: torch.nn.Module,
    batch: Batch,
    plan: StepPlan,
    poison: bool = False,
) -> tuple[float, dict[str, float], bool, bool]:
    """One optimizer step on this rank's share of the global batch.

    ``model`` is DDP's wrapper, or the sharded model (``parallel.shard=node``). The job's loss of
    each sample (:meth:`elastic.job.Job.loss`) is weighted and back-propagated. Returns its mean
    loss, the mean of each of the job's metrics over the same samples, whether the optimizer
    stepped, and whether the averaged gradients were finite. A step with inf/nan gradients is
    skipped on every rank alike: by fp16's loss scaler (:class:`elastic.precision.MixedPrecision`),
    else by :func:`elastic.sharding.judge_gradients`. ``poison`` (chaos.nan_steps) makes this
    rank's loss NaN.

    The share is split into micro-batches of at most ``data.batch_size`` (more than one only under
    ``keep_global_batch`` on a smaller world); gradients accumulate locally and are all-reduced
    once, with the last micro-batch, summed over the ranks: each sample weighs
    :meth:`~elastic.sampler.StepPlan.weights`, so the sum is the mean over the global batch.
    """
    n = max(1, math.ceil(plan.real / w.cfg.data.batch_size))
    weight = plan.weights(w.device)
    w.state.optimizer.zero_grad(set_to_none=True)
    assert w.buffers is not None
    w.buffers.save()
    w.hook.begin_step()
    total = 0.0
    sums: dict[str, torch.Tensor] = {}  # each metric's sum over the real samples
    micro = zip(*(t.tensor_split(n) for t in batch), strict=True)  # (part of each tensor)
    parts = zip(micro, weight.tensor_split(n), strict=True)
    for i, (part, wt) in enumerate(parts):
        with no_sync(model) if i < n - 1 else contextlib.nullcontext():
            with w.precision.autocast():
                per_sample, metrics = per_sample_loss(w.job.loss(model, part))
            if poison:
                per_sample = per_sample * float("nan")
            w.precision.backward((per_sample * wt).sum())
        real = wt > 0
        total += (per_sample.detach().float() * real).sum().item()
        for name, values in metrics.items():
            sums[name] = sums.get(name, 0) + (values.detach().float() * real).sum()
    scaled = w.precision.scaler.is_enabled()  # then the scaler judges the gradients
    finite, clip = judge_gradients(w.params, w.mesh, w.cfg.optim.clip_grad_norm, scaled)
    taken = finite and w.precision.step(w.state.optimizer, clip)
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
