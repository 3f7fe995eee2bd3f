"""The ``trainer``, ``comm`` and ``parallel`` sections: how a step computes, and what travels.

The dtypes the forward and backward compute in and the all-reduce carries
(:mod:`elastic.precision`), the collective library, the job's length and its evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config.schema import Choice, bounded


class Precision(Choice):
    """The dtype the forward and backward compute in (autocast); weights stay fp32."""

    auto = "auto"  # bf16 on a GPU that has it, else fp32
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # with a GradScaler, whose state is part of the training state


class GradDtype(Choice):
    """The dtype gradients travel in through the all-reduce (ChainerMN's FP16 all-reduce)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class CommBackend(Choice):
    """The collective library of the training group."""

    auto = "auto"  # NCCL on CUDA, gloo on the CPU
    # gloo on CUDA tensors: a test aid, for simulated nodes that share one GPU without NCCL (on
    # NCCL each passes for a host of its own: launcher.local_cluster); slow, never for a real job.
    gloo = "gloo"


@dataclass
class CommConfig:
    """How gradients travel."""

    # The all-reduce casts each bucket to this dtype and back, through the abortable hook.
    grad_dtype: GradDtype = GradDtype.fp32
    backend: CommBackend = CommBackend.auto  # gloo: a test aid on CUDA (see CommBackend)


class Shard(Choice):
    """What each worker holds of the model, its gradients and its optimizer state."""

    none = "none"  # all of them: plain data parallel (DDP)
    # 1/k of them over a node's k workers (FSDP2), the nodes replicas of each other (HSDP)
    node = "node"


@dataclass
class ParallelConfig:
    """How the model is laid out over the workers (docs/configuration.md, "Sharding")."""

    shard: Shard = Shard.none


@dataclass
class TrainerConfig:
    epochs: float = bounded(3.0, gt=0, fix="set trainer.epochs=1")
    seed: int = 0
    # Steps between step events (progress, stall measurement).
    log_every: int = bounded(1, ge=1, fix="set trainer.log_every=1")
    # Every rank logs the sample indices of every step it trains (``samples`` events), so a chaos
    # run can prove that each sample of an epoch was trained exactly once. Off for long runs.
    record_samples: bool = False
    precision: Precision = Precision.auto
    # NHWC memory layout for convolutions; null: on for CUDA, off on CPU.
    channels_last: bool | None = None
    # Validation every this many epochs (of samples seen) and at the end; 0: only at the end.
    eval_every_epochs: float = bounded(
        1.0, ge=0, fix="set trainer.eval_every_epochs=0 to evaluate only at the end"
    )
    # Rank 0 writes loss, accuracy, LR, samples/s, world size, recoveries and checkpoints as
    # TensorBoard scalars under <run_dir>/tensorboard/ (elastic/curves.py; needs the optional
    # tensorboard package, else the curves are off).
    tensorboard: bool = True
    # A node's event file past this size is renamed <node>.jsonl.<n> and a new one started
    # (elastic/events.py); readers read the rotated files first.
    events_rotate_mb: float = bounded(64.0, gt=0, fix="set trainer.events_rotate_mb=64")
    # Rotated event files kept per node, the oldest deleted first; 0 keeps every one, because the
    # invariant checker, curves.png and the goodput verdict read the whole log, and at 1 step/s
    # rank 0's node writes about 25 MB of events a day, the others a few kB
    # (docs/operations.md, "Disk use").
    # Set it to bound a node's events at (keep + 1) x events_rotate_mb, e.g. with record_samples.
    events_keep: int = bounded(0, ge=0, fix="set trainer.events_keep=0 to keep every file")
