"""The worker: one process per GPU (or CPU slot), started by its node's agent for one round.

Read it top to bottom: join the round's process group; build data, model and optimizer; restore
the newest verified checkpoint at whatever world size this round has; then train step by step,
setting the LR from the policy for this world size, writing step events and a sharded checkpoint
every ``checkpoint.every_steps``, until ``trainer.epochs`` worth of samples is trained.

A failed collective means a peer went away: the worker exits with ``EXIT_PEER_LOST`` and its agent
takes part in the next round, whose workers resume from the newest checkpoint.
"""

from __future__ import annotations

import logging
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from elastic import config
from elastic.checkpoint import CheckpointManager
from elastic.communicator import (
    EXIT_PEER_LOST,
    Communicator,
    WorkerEnv,
    is_peer_failure,
    pick_device,
)
from elastic.data import SeededImageFolder
from elastic.events import EventLog
from elastic.lr_policy import LRSchedule
from elastic.model import build_model, build_optimizer
from elastic.sampler import ElasticSampler
from elastic.state import Progress, TrainState

log = logging.getLogger("elastic.trainer")


def train(cfg: config.Config, env: WorkerEnv, events: EventLog) -> Progress:
    t_start = time.perf_counter()
    rank, world = env.rank, env.world_size
    device = pick_device(cfg.cluster.device, env.local_rank)
    comm = Communicator(env, device, cfg.rendezvous.pg_timeout_s)
    comm.connect()

    dataset = SeededImageFolder(cfg.data, cfg.trainer.seed)
    sampler = ElasticSampler(len(dataset), cfg.data.batch_size, cfg.trainer.seed)
    schedule = LRSchedule.from_config(cfg.optim, samples_per_epoch=len(dataset))
    total = round(cfg.trainer.epochs * len(dataset))
    global_batch = world * cfg.data.batch_size  # rescale_lr: the per-worker batch is fixed

    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, dataset.num_classes).to(device)
    state = TrainState(model, build_optimizer(model, cfg.optim))
    tensors = state.tensors()
    ckpt = CheckpointManager(cfg.checkpoint.url, cfg.checkpoint.keep, events if rank == 0 else None)
    info = ckpt.restore(tensors)
    progress = Progress.from_dict(info.manifest["progress"]) if info else Progress()
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )

    lr = schedule.lr(progress.samples_seen, global_batch)
    if rank == 0:
        events.emit(
            "training_started",
            world_size=world,
            step=progress.step,
            samples_seen=progress.samples_seen,
            total_samples=total,
            resumed_from=info.step if info else None,
            lr=lr,
            init_s=time.perf_counter() - t_start,
        )
        if progress.world_size and progress.world_size != world:
            events.emit(
                "lr_changed",
                reason="world_size",
                old_world_size=progress.world_size,
                world_size=world,
                old_lr=progress.lr,
                lr=lr,
            )

    loader = DataLoader(
        dataset,
        batch_sampler=sampler.batches(progress.sampler, rank, world, total - progress.samples_seen),
        num_workers=cfg.data.loader_workers,
        pin_memory=device.type == "cuda",
    )
    last_saved, t_log, samples_log = progress.step, time.perf_counter(), progress.samples_seen
    for images, targets in loader:
        plan = sampler.plan(progress.sampler, rank, world, total - progress.samples_seen)
        lr = schedule.lr(progress.samples_seen, global_batch)
        state.set_lr(lr)
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        per_sample = F.cross_entropy(ddp(images), targets, reduction="none")
        # DDP averages gradients over ranks; scaling by world / global_count makes the result the
        # mean over the global batch (Goyal et al.), also when the last batch is split unevenly.
        loss = per_sample[: plan.real].sum() * (world / plan.global_count)
        state.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        state.optimizer.step()
        progress = progress.after(plan, sampler.advance(progress.sampler, plan), world, lr)

        if rank == 0 and progress.step % cfg.trainer.log_every == 0:
            now = time.perf_counter()
            events.emit(
                "step",
                step=progress.step,
                samples=progress.samples_seen,
                step_samples=plan.global_count,
                epoch=progress.sampler.epoch,
                loss=per_sample[: plan.real].mean().item(),
                lr=lr,
                world_size=world,
                samples_per_s=(progress.samples_seen - samples_log) / (now - t_log),
            )
            t_log, samples_log = now, progress.samples_seen
        if progress.step % cfg.checkpoint.every_steps == 0:
            ckpt.save(progress.step, tensors, {"progress": progress.to_dict(), "round": env.round})
            last_saved = progress.step

    if progress.step != last_saved:
        ckpt.save(progress.step, tensors, {"progress": progress.to_dict(), "round": env.round})
    if rank == 0:
        events.emit(
            "training_done",
            step=progress.step,
            samples_seen=progress.samples_seen,
            world_size=world,
        )
    comm.close()
    return progress


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    env = WorkerEnv.from_environ()
    cfg = config.load(env.config)
    torch.set_num_threads(env.threads)
    events = EventLog(env.run_dir, env.node_id, role="worker", rank=env.rank, round=env.round)
    try:
        train(cfg, env, events)
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        events.emit("worker_peer_lost", error=str(exc)[:300])
        log.warning("rank %d: a peer went away (%s); leaving round %d", env.rank, exc, env.round)
        return EXIT_PEER_LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
