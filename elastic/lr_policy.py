"""The learning rate as a function of samples seen and the global batch.

Goyal et al. (arXiv:1706.02677): the LR grows linearly with the global batch
(``lr = optim.lr * global_batch / optim.reference_batch``), reached by a gradual warm-up from the
reference LR, then divided by ten at the milestones. Everything is keyed on samples seen, never on
steps: when the world size changes, the step count per epoch changes but the schedule does not
move. Under ``rescale_lr`` the per-worker batch is fixed, so the global batch (and the LR) follow
the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config import OptimConfig


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
