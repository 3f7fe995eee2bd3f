"""The learning rate as a function of samples seen and the global batch.

Goyal et al. (arXiv:1706.02677): the LR grows linearly with the global batch (``peak = optim.lr
* global_batch / optim.reference_batch``, for every optimizer, LARS too), reached by a gradual
warm-up from the reference LR; then the ``optim.schedule`` shape takes over
(:class:`LRSchedule`). Everything is keyed on samples seen, never on steps: when the world size
changes, the steps per epoch change but the schedule does not move. What a change of world size
does to the LR is the policy's choice (:class:`LRPolicy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.config import (
    ConfigError,
    OptimConfig,
    Policy,
    Schedule,
    WarmupStart,
    decay_warmup_problem,
)


@dataclass(frozen=True)
class LRSchedule:
    """The LR's shape over the samples of the job.

    After warm-up, ``step`` multiplies it by ``gamma`` at each milestone (Goyal et al.: /10 at
    epochs 30, 60, 80). ``poly`` is ``end + (peak - end) * (1 - progress) ** poly_power`` from
    the end of warm-up to the end of training, ``end = end_lr_factor * peak`` (the MLPerf
    ResNet-50 LARS schedule). ``cosine`` is ``end + (peak - end) * (1 + cos(pi * progress)) / 2``
    over the same span, as language models train. Akiba et al.'s slow start (arXiv:1711.04325)
    multiplies the LR by ``slow_start_factor`` for the first ``slow_start_epochs``, whatever the
    shape."""

    base_lr: float  # the LR for reference_batch samples
    reference_batch: int
    warmup_samples: int
    warmup_start: WarmupStart  # warm-up from base_lr (Goyal et al.) or from 0
    schedule: Schedule
    milestones: tuple[int, ...]  # step: samples seen at which the LR is multiplied by gamma
    gamma: float
    slow_start_samples: int  # the LR is slow_start_factor of itself before this many samples
    slow_start_factor: float
    total_samples: int  # poly, cosine: the samples the job trains (0 with step: none needed)
    poly_power: float
    end_lr_factor: float  # poly, cosine: the LR at the end, as a fraction of the peak

    @classmethod
    def from_config(
        cls, cfg: OptimConfig, samples_per_epoch: int, total_samples: int | None = None
    ) -> LRSchedule:
        """The schedule of ``optim`` settings ``cfg``, its epochs turned into samples.

        ``total_samples`` (the job's, ``trainer.epochs`` of samples) is needed by ``poly`` and
        ``cosine``, which decay to the end of training; ``step`` does without. Warm-up must end
        before the job does (:func:`elastic.config.decay_warmup_problem`, which ``validate``
        checks in epochs), here in the samples this schedule rounds both to."""
        warmup_samples = round(cfg.warmup_epochs * samples_per_epoch)
        if cfg.schedule in (Schedule.poly, Schedule.cosine):
            if total_samples is None:
                raise ValueError(
                    f"optim.schedule={cfg.schedule} decays until the end of training. Fix: pass "
                    "total_samples (trainer.epochs of samples) to LRSchedule.from_config / "
                    "LRPolicy.from_config."
                )
            epochs = total_samples / samples_per_epoch
            if refused := decay_warmup_problem(cfg, warmup_samples, total_samples, epochs):
                raise ConfigError(refused)
        return cls(
            base_lr=cfg.lr,
            reference_batch=cfg.reference_batch,
            warmup_samples=warmup_samples,
            warmup_start=WarmupStart(cfg.warmup_start),
            schedule=Schedule(cfg.schedule),
            milestones=tuple(round(m * samples_per_epoch) for m in cfg.milestones_epochs),
            gamma=cfg.gamma,
            slow_start_samples=round(cfg.slow_start_epochs * samples_per_epoch),
            slow_start_factor=cfg.slow_start_factor,
            total_samples=total_samples or 0,
            poly_power=cfg.poly_power,
            end_lr_factor=cfg.end_lr_factor,
        )

    def target(self, global_batch: int) -> float:
        """The linear scaling rule: the peak LR, once warm-up is over and before any decay."""
        return self.base_lr * global_batch / self.reference_batch

    def lr(self, samples_seen: int, global_batch: int) -> float:
        """The LR after ``samples_seen`` samples at ``global_batch``.

        It is the warmed-up LR times the shape's decay, times the slow-start factor while it
        lasts."""
        lr = self._warmed(samples_seen, self.target(global_batch)) * self._decay(samples_seen)
        if samples_seen < self.slow_start_samples:
            lr *= self.slow_start_factor
        return lr

    def _warmed(self, samples_seen: int, peak: float) -> float:
        """Linear over warm-up to the peak, from 0 or the reference LR (the peak, if lower)."""
        if samples_seen >= self.warmup_samples:
            return peak
        start = 0.0 if self.warmup_start is WarmupStart.zero else min(self.base_lr, peak)
        return start + (peak - start) * samples_seen / self.warmup_samples

    def _decay(self, samples_seen: int) -> float:
        """The shape's factor on the peak.

        With ``step`` it is gamma per milestone passed (a milestone inside warm-up counts too).
        With ``poly`` and ``cosine`` it is their curve from 1 at the end of warm-up to
        ``end_lr_factor`` at the end of training."""
        if self.schedule == Schedule.step:
            return self.gamma ** sum(samples_seen >= m for m in self.milestones)
        if samples_seen < self.warmup_samples:
            return 1.0
        decay_samples = self.total_samples - self.warmup_samples
        left = max(0.0, 1 - (samples_seen - self.warmup_samples) / decay_samples)
        if self.schedule == Schedule.cosine:
            shape = (1 - math.cos(math.pi * left)) / 2  # 1 at the start of the decay, 0 at its end
        else:
            shape = left**self.poly_power
        return self.end_lr_factor + (1 - self.end_lr_factor) * shape


@dataclass(frozen=True)
class Ramp:
    """An LR increase being ramped in: from ``from_lr`` at ``start`` samples seen."""

    start: int
    from_lr: float


@dataclass(frozen=True)
class LRPolicy:
    """What a change of world size from N to M does to the LR.

    ``rescale_lr``: the per-worker batch is fixed, so the global batch becomes M/N of what it
    was, and the LR follows the linear scaling rule for it. A decrease applies at once. An
    increase is ramped in linearly from the LR in use over ``optim.resize_warmup_epochs`` of
    samples (a sudden jump of the LR is what warm-up exists to avoid). ``keep_global_batch``: the
    global batch of the job's first round is kept with gradient accumulation, so the LR does not
    change at all."""

    schedule: LRSchedule
    policy: Policy
    batch_size: int  # per worker
    resize_warmup_samples: int

    @classmethod
    def from_config(
        cls,
        cfg: OptimConfig,
        batch_size: int,
        samples_per_epoch: int,
        total_samples: int | None = None,
    ) -> LRPolicy:
        """The policy of ``optim`` settings ``cfg`` for a per-worker batch of ``batch_size``.

        ``total_samples``: the job's, needed by ``optim.schedule=poly`` and ``cosine`` (see
        :meth:`LRSchedule.from_config`)."""
        return cls(
            schedule=LRSchedule.from_config(cfg, samples_per_epoch, total_samples),
            policy=cfg.policy,
            batch_size=batch_size,
            resize_warmup_samples=round(cfg.resize_warmup_epochs * samples_per_epoch),
        )

    def global_batch(self, world_size: int, first_global_batch: int) -> int:
        """The samples one step trains at ``world_size``.

        ``first_global_batch`` is the first round's (0 when this is the first round)."""
        if self.policy is Policy.keep_global_batch and first_global_batch:
            return first_global_batch
        return world_size * self.batch_size

    def after_resize(self, samples_seen: int, old_lr: float, global_batch: int) -> Ramp | None:
        """The ramp to start when the world size changed, or None when the new LR applies now."""
        if self.policy is not Policy.rescale_lr or old_lr <= 0 or self.resize_warmup_samples == 0:
            return None
        if self.schedule.lr(samples_seen, global_batch) <= old_lr:
            return None
        return Ramp(samples_seen, old_lr)

    def lr(self, samples_seen: int, global_batch: int, ramp: Ramp | None) -> float:
        scheduled = self.schedule.lr(samples_seen, global_batch)
        if ramp is None or samples_seen >= ramp.start + self.resize_warmup_samples:
            return scheduled
        done = (samples_seen - ramp.start) / self.resize_warmup_samples
        return ramp.from_lr + (scheduled - ramp.from_lr) * max(0.0, done)
