"""The training state a job must not lose: weights, optimizer buffers and progress counters.

Weights and optimizer buffers travel as a flat dict of tensors (what DCP shards and what recovery
broadcasts). Progress is plain numbers kept in JSON: it goes into the checkpoint's manifest, so
resuming never has to unpickle anything to learn where the run was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from elastic.sampler import SamplerState, StepPlan


@dataclass(frozen=True)
class Progress:
    step: int = 0
    samples_seen: int = 0
    sampler: SamplerState = field(default_factory=SamplerState)
    world_size: int = 0  # the world size of the last step trained
    lr: float = 0.0  # the LR of the last step trained

    def after(self, plan: StepPlan, sampler: SamplerState, world_size: int, lr: float) -> Progress:
        return replace(
            self,
            step=self.step + 1,
            samples_seen=self.samples_seen + plan.global_count,
            sampler=sampler,
            world_size=world_size,
            lr=lr,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(**{**data, "sampler": SamplerState(**data["sampler"])})


class TrainState:
    """A model and its SGD optimizer, seen as named tensors.

    Only tensors go into checkpoints: ``torch.optim``'s own state dict carries Python objects that
    DCP would pickle. For SGD the per-parameter state is the momentum buffer, created here up
    front so that a fresh optimizer can receive a loaded one in place.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._names = {p: name for name, p in model.named_parameters()}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for group in self.optimizer.param_groups:
            if group.get("momentum", 0) == 0:
                continue
            for p in group["params"]:
                state = self.optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                out[f"optim.{self._names[p]}.momentum_buffer"] = state["momentum_buffer"]
        return out

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
