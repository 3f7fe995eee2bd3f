"""The events a worker writes (rank 0 unless its doc says every rank), with their lines."""

from __future__ import annotations

from elastic.event_types.contract import Event, declare
from elastic.final_save import unsaved_steps


def lr_text(lr: float) -> str:
    """An LR as the lines show it: five decimals (SGD's range), or three digits of a smaller one.

    AdamW's LRs (3e-4, less while warming up) would show as 0.00030 or 0.00000."""
    return f"{lr:.5f}" if lr == 0 or lr >= 1e-3 else f"{lr:.3g}"


def accuracy(e: Event) -> str:
    """An ``evaluated`` event's figures, as the progress line and the summary print them."""
    return (
        f"top-1 {100 * e['top1']:.2f} %, top-5 {100 * e['top5']:.2f} %, loss {e['loss']:.4f} "
        f"({e['count']} evaluated, {e['seconds']:.1f} s)"
    )


def _training_started(e: Event) -> str:
    if e["in_place"]:
        origin = f"state of step {e['step']} kept in memory"
    elif e["resumed_from"] is not None:
        origin = f"resumed from the checkpoint of step {e['resumed_from']}"
    else:
        origin = "from scratch"
    return (
        f"training at world size {e['world_size']}, {origin} "
        f"({e['samples_seen']}/{e['total_samples']} samples)"
    )


TRAINING_STARTED = declare(
    "training_started",
    "worker",
    "world_size step samples_seen total_samples resumed_from in_place global_batch lr",
    "a round began training",
    line=_training_started,
)


def _step(e: Event) -> str:
    metrics = "".join(f"{name} {v:.4g} | " for name, v in e.get("metrics", {}).items())
    return (
        f"step {e['step']:>6} | epoch {e['epoch']} | loss {e['loss']:.4f} | {metrics}"
        f"{e['samples_per_s']:7.1f} samples/s | world {e['world_size']} | lr {lr_text(e['lr'])}"
    )


STEP = declare(
    "step",
    "worker",
    "step samples step_samples global_batch epoch loss lr world_size samples_per_s loss_scale "
    "metrics",
    "a step trained (every trainer.log_every steps); metrics: the job's (elastic.job.Loss)",
    line=_step,
)
STEP_SKIPPED = declare(
    "step_skipped", "worker", "step scale", "fp16: a step with inf/nan gradients was skipped"
)


def _lr_changed(e: Event) -> str:
    return (
        f"{e['optimizer']} LR {lr_text(e['old_lr'])} -> {lr_text(e['lr'])} for world size "
        f"{e['old_world_size']} -> {e['world_size']} ({e['policy']})"
    )


LR_CHANGED = declare(
    "lr_changed",
    "worker",
    "reason optimizer policy old_world_size world_size old_lr lr ramp_samples",
    "the LR follows a new world size",
    line=_lr_changed,
)
EVALUATION_STARTED = declare(
    "evaluation_started", "worker", "evaluation step", "an evaluation began"
)


def _evaluated(e: Event) -> str:
    return f"validation after epoch {e['epoch']:g} (step {e['step']}): " + accuracy(e)


EVALUATED = declare(
    "evaluated",
    "worker",
    "evaluation epoch step top1 top5 loss count seconds",
    "an evaluation's figures",
    line=_evaluated,
)
RECOVERED = declare(
    "recovered",
    "worker",
    "step world_size cause interrupted_at formed_at assigned_at pg_ready_at synced_at "
    "first_step_at rendezvous_s rebuild_s sync_s first_step_s in_place",
    "the first step after a fault, with why the round ended (cause: a RoundEnd's value) and the "
    "recovery's breakdown",
    line=(
        "recovered in place at world size {world_size}: rendezvous {rendezvous_s:.2f} s, rebuild "
        "{rebuild_s:.2f} s, state sync {sync_s:.2f} s, first step {first_step_s:.2f} s"
    ),
)
CHECKPOINT_SAVED = declare(
    "checkpoint_saved",
    "worker",
    "step round url bytes seconds stall_s",
    "a checkpoint committed",
    line="checkpoint of step {step} saved in {seconds:.2f} s",
)
CHECKPOINT_INTERVAL = declare(
    "checkpoint_interval", "worker", "step steps reason", "the steps between checkpoints changed"
)
CHECKPOINT_FAILED = declare(
    "checkpoint_failed",
    "worker",
    "step round reason fix",
    "a save failed; training goes on",
    line=(
        "checkpoint of step {step} FAILED: {reason}. Fix: {fix}. Training goes on; the newest "
        "good checkpoint is kept"
    ),
)
CHECKPOINT_LOADED = declare(
    "checkpoint_loaded",
    "worker",
    "step url seconds world_size saved_world_size",
    "a checkpoint was loaded",
)
CHECKPOINT_SKIPPED = declare(
    "checkpoint_skipped",
    "worker",
    "url reason",
    "a checkpoint failed verification",
    line="checkpoint {url} skipped: {reason}",
)
TRAINING_DONE = declare(
    "training_done",
    "worker",
    "step samples_seen world_size",
    "the job is trained, and its final checkpoint committed",
    line="training done: step {step}, {samples_seen} samples",
)
FINAL_SAVE_RETRY = declare(
    "final_save_retry",
    "worker",
    "step saved_step attempt retry_in_s left_s",
    "the job is trained but its final checkpoint did not commit (saved_step: the newest that "
    "did, None if none): the state is kept and the save retried (elastic/final_save.py)",
    line=(
        "the final checkpoint (step {step}) did not commit: the trained state is kept and the "
        "save retried in {retry_in_s:.0f} s, for up to {left_s:.0f} s more "
        "(checkpoint.final_retry_s)"
    ),
)


def _final_save_failed(e: Event) -> str:
    return (
        f"the final checkpoint (step {e['step']}) could not be written in "
        f"{e['waited_s']:.0f} s: {unsaved_steps(e['saved_step'], e['step'])} NOT SAVED"
    )


FINAL_SAVE_FAILED = declare(
    "final_save_failed",
    "worker",
    "step saved_step attempts waited_s",
    "the final checkpoint could not be written within checkpoint.final_retry_s: the steps after "
    "saved_step up to step are not saved, and the job ends with EXIT_UNSAVED",
    line=_final_save_failed,
)
CURVES_OFF = declare(
    "curves_off",
    "worker",
    "reason",
    "rank 0 writes no TensorBoard curves, and why (elastic/curves.py)",
    line="{node}: TensorBoard curves off ({reason})",
)
STATE_SYNCED = declare(
    "state_synced",
    "worker",
    "step source digest shard state_mib rss_mib device_used_mib",
    "every rank: the state a round starts from (of its shard: 0 unless parallel.shard=node), the "
    "size of what it holds of the weights and optimizer state, and the memory in use then",
)
STATE_DIGEST = declare(
    "state_digest",
    "worker",
    "step digest shard",
    "every rank: a hash of its replica (of its shard: 0 unless parallel.shard=node)",
)
WORKER_PEER_LOST = declare(
    "worker_peer_lost", "worker", "what error", "every rank: a collective of the round failed"
)
WORKER_FAILED = declare(
    "worker_failed",
    "worker",
    "step error",
    "every rank: a fault of the worker's own",
    line="{node}: worker rank {rank} failed: {error}",
)
STRAGGLER = declare(
    "straggler",
    "worker",
    "step slowdown compute_s median_s",
    "every rank that computes much slower than the others says so (elastic/stragglers.py)",
    line=(
        "{node}: rank {rank} is a straggler at step {step}, computing {slowdown:.1f}x slower "
        "than the median ({compute_s:.3f} s a step against {median_s:.3f} s)"
    ),
)
STEP_NONFINITE = declare(
    "step_nonfinite",
    "worker",
    "step producer streak skipped",
    "rank 0: a step with inf/NaN gradients was skipped on every rank (producer: the first rank "
    "whose loss was not finite, -1 if none)",
)
ROLLED_BACK = declare(
    "rolled_back",
    "worker",
    "step to_step reason",
    "every rank loaded the newest checkpoint (non-finite steps, or replicas without a "
    "majority); to_step is None when there was none",
)
REPLICA_REPAIRED = declare(
    "replica_repaired",
    "worker",
    "step source corrupt",
    "a rank whose replica differed from the majority's took the state of rank source",
)
BIT_FLIPPED = declare(
    "bit_flipped",
    "worker",
    "step param index bit",
    "chaos's corrupt_replica: this worker flipped one bit of a parameter (chaos.allow)",
)
SAMPLES = declare(
    "samples",
    "worker",
    "step epoch world_size indices before shard",
    "every rank, with trainer.record_samples: the samples of a step and the state before it",
)
