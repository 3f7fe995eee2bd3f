"""The learning rate as a function of samples seen and the global batch.

Goyal et al. (arXiv:1706.02677): the LR grows linearly with the global batch
(``lr = optim.lr * global_batch / optim.reference_batch``), reached by a gradual warm-up from the
reference LR, then divided by ten at the milestones. Everything is keyed on samples seen, never on
steps: when the world size changes, the step count per epoch changes but the schedule does not
move.

What a change of world size from N to M does is the policy's choice (:class:`LRPolicy`):

- ``rescale_lr``: the per-worker batch is fixed, so the global batch becomes M/N of what it was and
  the LR follows the linear scaling rule for it. A decrease applies at once; an increase is ramped
  in linearly from the LR in use over ``optim.resize_warmup_epochs`` of samples (a sudden jump of
  the LR is what warm-up exists to avoid).
- ``keep_global_batch``: the global batch of the job's first round is kept with gradient
  accumulation, so the LR does not change at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config import OptimConfig, Policy


@dataclass(frozen=True)
class LRSchedule:
    base_lr: float  # the LR for reference_batch samples
    reference_batch: int
    warmup_samples: int
    milestones: tuple[int, ...]  # samples seen at which the LR is multiplied by gamma
    gamma: float

    @classmethod
    def from_config(cls, cfg: OptimConfig, samples_per_epoch: int) -> LRSchedule:
        return cls(
            base_lr=cfg.lr,
            reference_batch=cfg.reference_batch,
            warmup_samples=round(cfg.warmup_epochs * samples_per_epoch),
            milestones=tuple(round(m * samples_per_epoch) for m in cfg.milestones_epochs),
            gamma=cfg.gamma,
        )

    def target(self, global_batch: int) -> float:
        """The linear scaling rule: the LR once warm-up is over, before any decay."""
        return self.base_lr * global_batch / self.reference_batch

    def lr(self, samples_seen: int, global_batch: int) -> float:
        target = self.target(global_batch)
        decay = self.gamma ** sum(samples_seen >= m for m in self.milestones)
        if samples_seen < self.warmup_samples:
            start = min(self.base_lr, target)
            target = start + (target - start) * samples_seen / self.warmup_samples
        return target * decay


@dataclass(frozen=True)
class Ramp:
    """An LR increase being ramped in: from ``from_lr`` at ``start`` samples seen."""

    start: int
    from_lr: float


@dataclass(frozen=True)
class LRPolicy:
    schedule: LRSchedule
    policy: Policy
    batch_size: int  # per worker
    resize_warmup_samples: int

    @classmethod
    def from_config(cls, cfg: OptimConfig, batch_size: int, samples_per_epoch: int) -> LRPolicy:
        return cls(
            schedule=LRSchedule.from_config(cfg, samples_per_epoch),
            policy=cfg.policy,
            batch_size=batch_size,
            resize_warmup_samples=round(cfg.resize_warmup_epochs * samples_per_epoch),
        )

    def global_batch(self, world_size: int, first_global_batch: int) -> int:
        """The samples one step trains at ``world_size``; ``first_global_batch`` is the first
        round's (0 when this is the first round)."""
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
