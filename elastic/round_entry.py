"""A worker entering a round: its group, the newest state, a fitted batch and LR, and a report.

It builds the new group (:mod:`elastic.communicator`) and takes the newest state from a peer's
memory or a checkpoint (:mod:`elastic.state`). It fits the sampler, batch and LR to the round's
world size, and reports the recovery's breakdown once the first step is done."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import psutil
import torch

from elastic import event_types as ev
from elastic.checkpoint import CheckpointManager
from elastic.config import Shard
from elastic.control import Assignment
from elastic.sharded_entry import enter_mesh
from elastic.state import Progress, local, sync_state
from elastic.worker import Worker

MIB = 1 << 20


@dataclass(frozen=True)
class RoundStart:
    """Where a round begins: the state every rank holds, its global batch, and entry times.

    It holds the state every rank now holds, the global batch for this world size, and when each
    step of entering the round ended (for the recovery breakdown)."""

    progress: Progress
    global_batch: int
    source: int  # the rank whose memory the state came from; -1: a checkpoint or scratch
    assigned_at: float
    pg_ready_at: float
    synced_at: float


def memory_in_use(device: torch.device) -> dict[str, float | None]:
    """This process's host memory, and the GPU's used memory (every process's), in MiB.

    Recorded at every round's entry, so that a leak across recoveries shows in the event log
    (the GPU proof's NCCL campaign reads it). The GPU's figure is the device's, not this
    process's: NCCL's buffers are outside torch's allocator."""
    used = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = (total - free) / MIB
    return {"rss_mib": psutil.Process().memory_info().rss / MIB, "device_used_mib": used}


def enter_round(w: Worker, a: Assignment, ckpt: CheckpointManager) -> RoundStart:
    """Take the recovery steps of ARCHITECTURE.md that make a round trainable.

    They build its group and agree on the newest state any rank holds (a checkpoint only when
    none does). Then they set the LR the policy gives for this world size, ramped when it grew."""
    assigned_at = time.time()
    w.link.status.update(phase="joining", round=a.round)
    w.comm.enter(a)
    replicas = enter_mesh(w, a) if w.cfg.parallel.shard is Shard.node else None
    pg_ready_at = time.time()

    with w.comm.collective("state sync"):
        progress, source = sync_state(w.tensors, w.progress, w.trained_round, w.device, replicas)
    resumed_from = None
    if progress is None:
        info = ckpt.restore(w.tensors)
        progress = Progress.from_dict(info.manifest["progress"]) if info else Progress()
        resumed_from = info.step if info else None
    w.progress, w.trained_round = progress, a.round
    w.nonfinite.rolled_back()  # skipped steps in a row count within a round: every rank alike
    synced_at = time.time()
    w.events.emit(
        ev.STATE_SYNCED,
        step=progress.step,
        source=source,
        digest=w.state.digest(),
        shard=w.shard_index,
        state_mib=sum(local(t).nbytes for t in w.tensors.values()) / MIB,
        **memory_in_use(w.device),
    )

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
    """``progress`` with the global batch the LR policy gives round ``a``'s world size.

    Its LR ramp is set (and the change logged) when that world differs from the one the state
    last trained in."""
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
    """Report the recovery at the first step after a round broke (rank 0's ``recovered`` event).

    It says how long detection, rendezvous, rebuild, state sync and the first step took."""
    assert w.interrupted_at is not None and w.interrupted_by is not None
    now = time.time()
    w.events.emit(
        ev.RECOVERED,
        step=step,
        world_size=a.world_size,
        cause=w.interrupted_by.value,
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
