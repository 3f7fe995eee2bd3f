"""The ``optim`` section: the update rule, the LR schedule, and what a resize does to them.

The LR follows the linear scaling rule on the global batch whatever the rule; the shapes and the
policies are computed by :mod:`elastic.optim` and :mod:`elastic.lr_policy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.config.schema import Choice, bounded


class OptimizerName(Choice):
    """The update rule (:mod:`elastic.optim`)."""

    sgd = "sgd"  # momentum SGD (Goyal et al.)
    akiba = "akiba"  # RMSprop warm-up turning into momentum SGD (Akiba et al.)
    lars = "lars"  # layer-wise adaptive rate scaling (You et al.; MLPerf ResNet-50)
    adamw = "adamw"  # torch's AdamW: Adam with decoupled weight decay (language models)


class Schedule(Choice):
    """The LR's shape over samples seen, after warm-up (:mod:`elastic.lr_policy`)."""

    step = "step"  # multiplied by gamma at each milestone
    poly = "poly"  # polynomial decay to end_lr_factor of the peak at the end of training
    cosine = "cosine"  # half a cosine down to end_lr_factor of the peak at the end of training


class Policy(Choice):
    """What a change of world size does to the batch and the LR (:mod:`elastic.lr_policy`)."""

    rescale_lr = "rescale_lr"
    keep_global_batch = "keep_global_batch"


@dataclass
class AkibaConfig:
    """The RMSprop warm-up of Akiba et al. (arXiv:1711.04325).

    Each update blends an RMSprop step into the momentum-SGD step, and the SGD share ramps from
    0 to 1 in the shape of an ELU (:func:`elastic.optim.sgd_share`)."""

    # The ramp's middle (share 0.5) and its width, in epochs.
    center_epochs: float = bounded(10.0, ge=0, fix="set optim.akiba.center_epochs=10")
    period_epochs: float = bounded(5.0, gt=0, fix="set optim.akiba.period_epochs=5")
    # Decay of the squared-gradient average (RMSprop's alpha).
    rms_decay: float = bounded(0.99, gt=0, lt=1, fix="set optim.akiba.rms_decay=0.99")
    rms_eps: float = bounded(1e-8, gt=0, fix="set optim.akiba.rms_eps=1e-8")
    # The RMSprop step's LR as a fraction of the SGD LR (RMSprop steps are per element).
    rms_lr_ratio: float = bounded(1e-3, gt=0, fix="set optim.akiba.rms_lr_ratio=1e-3")


class WarmupStart(Choice):
    """Where the warm-up starts (:mod:`elastic.lr_policy`); it always ends at the peak LR."""

    reference = "reference"  # optim.lr, the LR of reference_batch samples (Goyal et al.)
    zero = "zero"  # 0, as language models warm up


@dataclass
class AdamWConfig:
    """torch's AdamW; its weight decay is ``optim.weight_decay``, decoupled from the gradient."""

    beta1: float = bounded(0.9, ge=0, lt=1, fix="set optim.adamw.beta1=0.9")
    beta2: float = bounded(0.95, ge=0, lt=1, fix="set optim.adamw.beta2=0.95")
    eps: float = bounded(1e-8, gt=0, fix="set optim.adamw.eps=1e-8")


@dataclass
class LarsConfig:
    """LARS (arXiv:1708.03888) as MLPerf's ResNet-50 uses it.

    A per-layer trust ratio, none on batch-norm parameters and biases."""

    trust_coefficient: float = bounded(0.001, gt=0, fix="set optim.lars.trust_coefficient=0.001")
    eps: float = bounded(0.0, ge=0, fix="set optim.lars.eps=0")


@dataclass
class OptimConfig:
    """The update rule and the LR schedule.

    The LR follows the linear scaling rule on the global batch whatever the rule."""

    name: OptimizerName = OptimizerName.sgd

    # The LR for ``reference_batch`` samples (0.1 per 256 in Goyal et al.).
    lr: float = bounded(0.1, gt=0, fix="set optim.lr, e.g. optim.lr=0.1")
    reference_batch: int = bounded(256, ge=1, fix="set optim.reference_batch=256 (Goyal et al.)")
    momentum: float = bounded(0.9, ge=0, lt=1, fix="set optim.momentum=0.9")
    nesterov: bool = False
    weight_decay: float = bounded(1e-4, ge=0, fix="set optim.weight_decay=1e-4")
    # Goyal et al. apply no weight decay to batch-norm parameters and biases.
    decay_bn_and_bias: bool = False
    warmup_epochs: float = bounded(5.0, ge=0, fix="set optim.warmup_epochs=0 to switch warm-up off")
    warmup_start: WarmupStart = WarmupStart.reference
    schedule: Schedule = Schedule.step
    # step: the LR is multiplied by gamma at each milestone.
    milestones_epochs: list[float] = field(default_factory=lambda: [30.0, 60.0, 80.0])
    gamma: float = bounded(0.1, gt=0, le=1, fix="set optim.gamma=0.1")
    # Akiba et al.'s slow start: the LR is this fraction of its peak for the first epochs.
    slow_start_epochs: float = bounded(0.0, ge=0, fix="set optim.slow_start_epochs=0 (off)")
    slow_start_factor: float = bounded(
        1.0, gt=0, le=1, fix="set optim.slow_start_factor to a fraction in (0, 1]"
    )
    # poly: (1 - progress)^power from the peak after warm-up down to end_lr_factor of it; cosine
    # ends at end_lr_factor of the peak too.
    poly_power: float = bounded(2.0, gt=0, fix="set optim.poly_power=2 (MLPerf)")
    end_lr_factor: float = bounded(0.0, ge=0, lt=1, fix="set optim.end_lr_factor=0")
    label_smoothing: float = bounded(0.0, ge=0, lt=1, fix="set optim.label_smoothing=0.1")
    akiba: AkibaConfig = field(default_factory=AkibaConfig)
    lars: LarsConfig = field(default_factory=LarsConfig)
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    # The gradients' global norm (over every rank's shard) is clipped to this before each step;
    # 0: no clipping.
    clip_grad_norm: float = bounded(0.0, ge=0, fix="set optim.clip_grad_norm=1.0, or 0 for none")
    # What a change of world size does: ``rescale_lr`` keeps the per-worker batch, so the global
    # batch and the LR follow the world size; ``keep_global_batch`` keeps the global batch (and
    # the LR) with gradient accumulation.
    policy: Policy = Policy.rescale_lr
    # rescale_lr: an LR increase after a resize is ramped in over this many epochs of samples.
    resize_warmup_epochs: float = bounded(
        0.1, ge=0, fix="set optim.resize_warmup_epochs=0 to apply LR increases at once"
    )
