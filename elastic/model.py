"""Building the model and its optimizer the way Goyal et al. train ResNets."""

from __future__ import annotations

import torch
from torchvision import models

from elastic.config import ModelConfig, OptimConfig

RESIDUAL_FAMILIES = ("resnet", "resnext", "wide_resnet")


def build_model(cfg: ModelConfig, num_classes: int) -> torch.nn.Module:
    kwargs: dict[str, object] = {"num_classes": num_classes}
    if cfg.name.startswith(RESIDUAL_FAMILIES):
        kwargs["zero_init_residual"] = cfg.zero_init_residual
    return models.get_model(cfg.name, weights=None, **kwargs)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.SGD:
    """SGD with momentum; batch-norm parameters and biases get no weight decay unless asked.

    The LR set here is a placeholder: the trainer sets it from the LR policy before every step.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 and not cfg.decay_bn_and_bias else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(
        [g for g in groups if g["params"]], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
    )
