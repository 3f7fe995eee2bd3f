"""A job of your own: an MLP fitting a noisy wave, with an average of its weights kept as state."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from elastic.config import bounded
from elastic.job import Batch, Job


@dataclass
class WaveSettings:  # job.* keys, typed and bounded: checked before anything starts
    samples: int = bounded(4096, ge=1, fix="set job.samples to 1 or more")
    hidden: int = bounded(64, ge=1, fix="set job.hidden to 1 or more")
    ema_decay: float = bounded(0.99, ge=0, lt=1, fix="set job.ema_decay in [0, 1)")


class Wave:
    """Sample ``(epoch, i)``: x in [-pi, pi] and sin(3x) + noise.

    Seeded by i alone, so it is the same sample on any rank, in any round, after any restart."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(key[1])
        x = torch.rand(1, generator=g) * 2 * math.pi - math.pi
        return x, torch.sin(3 * x) + 0.05 * torch.randn(1, generator=g)


class WaveJob(Job[WaveSettings]):
    Settings = WaveSettings

    def train_data(self) -> Wave:
        return Wave(self.settings.samples)

    def build_model(self) -> nn.Module:
        h = self.settings.hidden
        layers = nn.Linear(1, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1)
        model = nn.Sequential(*layers).to(self.device)
        self.ema = {name: p.detach().clone() for name, p in model.named_parameters()}
        return model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return (model(x) - y).square().squeeze(1)  # one loss per sample

    def after_step(self, model: nn.Module) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                self.ema[name].lerp_(p, 1 - self.settings.ema_decay)

    def state(self) -> dict[str, torch.Tensor]:  # checkpointed, and synced to joining ranks
        return {f"ema.{name}": t for name, t in self.ema.items()}
