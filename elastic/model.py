"""Building the model the way Goyal et al. train ResNets (the optimizer: :mod:`elastic.optim`)."""

from __future__ import annotations

import torch
from torchvision import models

from elastic.config import ModelConfig

RESIDUAL_FAMILIES = ("resnet", "resnext", "wide_resnet")


def build_model(cfg: ModelConfig, num_classes: int) -> torch.nn.Module:
    kwargs: dict[str, object] = {"num_classes": num_classes}
    if cfg.name.startswith(RESIDUAL_FAMILIES):
        kwargs["zero_init_residual"] = cfg.zero_init_residual
    return models.get_model(cfg.name, weights=None, **kwargs)
