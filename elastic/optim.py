"""The update rules the seeds train with (``optim.name``), and what each needs set per step.

``sgd`` is torch's momentum SGD, as Goyal et al. (arXiv:1706.02677) train ResNets; ``akiba`` is
the RMSprop warm-up of Akiba et al. (:class:`Akiba`); ``lars`` is :class:`LARS` as the MLPerf
ResNet-50 reference applies it; ``adamw`` is torch's AdamW, as language models train. Every
optimizer built here holds all of its per-parameter state from the moment it is built, as
zeros: a checkpoint restore and the in-place recovery copy a state into the tensors that
:meth:`elastic.state.TrainState.tensors` returns, so those tensors must exist before the first
step (:func:`create_state`). The LR itself is not set here: the trainer sets ``lr`` from
:mod:`elastic.lr_policy` before every step, and the other per-step settings from
:func:`step_settings`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from elastic.config import OptimConfig, OptimizerName

# A param group key: the group is stepped without LARS's trust ratio (batch norm, biases).
LARS_EXCLUDE = "lars_exclude"


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names, over ``model``'s trainable parameters.

    Batch-norm parameters and biases (every parameter with at most one dimension) get no weight
    decay unless ``optim.decay_bn_and_bias`` (Goyal et al.), and with LARS no trust ratio either
    (the MLPerf convention); with ``decay_bn_and_bias`` they are treated like weights in every
    respect. The LR given here is a placeholder: the trainer sets it before every step.
    """
    groups = _param_groups(model, cfg)
    if cfg.name == OptimizerName.akiba:
        a = cfg.akiba
        return Akiba(
            groups,
            lr=cfg.lr,
            momentum=cfg.momentum,
            sgd_share=sgd_share(0.0, a.center_epochs, a.period_epochs),
            rms_decay=a.rms_decay,
            rms_eps=a.rms_eps,
            rms_lr_ratio=a.rms_lr_ratio,
        )
    if cfg.name == OptimizerName.lars:
        return LARS(
            groups,
            lr=cfg.lr,
            momentum=cfg.momentum,
            trust_coefficient=cfg.lars.trust_coefficient,
            eps=cfg.lars.eps,
        )
    if cfg.name == OptimizerName.adamw:
        w = cfg.adamw
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(w.beta1, w.beta2), eps=w.eps
        )
    else:
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    create_state(optimizer)
    return optimizer


def _param_groups(model: torch.nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """The parameter groups: weights in one, batch-norm parameters and biases in another.

    Under ``decay_bn_and_bias`` they all go in the weights' group. Empty groups are left out (torch
    refuses them)."""
    weights, exempt = [], []
    for p in model.parameters():
        if p.requires_grad:
            (exempt if p.ndim <= 1 and not cfg.decay_bn_and_bias else weights).append(p)
    groups = [
        {"params": weights, "weight_decay": cfg.weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]
    if cfg.name == OptimizerName.lars:
        groups[1][LARS_EXCLUDE] = True
    return [g for g in groups if g["params"]]


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state torch's SGD and AdamW would only create at their first step.

    SGD's momentum buffers are zeros: with dampening 0 (all we use) a zero buffer gives the same
    first step as torch's lazy one (``buf = momentum * 0 + g``). AdamW's are what its first step
    makes (a step count of 0 as a float32 scalar on the CPU, zero averages), which it then takes
    as its own. State that exists is kept; other optimizers are left alone (:class:`Akiba` and
    :class:`LARS` create their state when built).
    """
    if isinstance(optimizer, torch.optim.AdamW):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not optimizer.state[p]:
                    optimizer.state[p].update(_adamw_state(p, group["amsgrad"]))
        return
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = _zeros(p)


def _adamw_state(p: torch.Tensor, amsgrad: bool) -> dict[str, torch.Tensor]:
    """The state torch's AdamW (neither fused nor capturable) makes for ``p`` at its first step."""
    state = {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "exp_avg": _zeros(p),
        "exp_avg_sq": _zeros(p),
    }
    if amsgrad:
        state["max_exp_avg_sq"] = _zeros(p)
    return state


def step_settings(cfg: OptimConfig, samples_seen: int, samples_per_epoch: int) -> dict[str, float]:
    """The param-group settings besides the LR for the step after ``samples_seen`` samples.

    Keyed on samples, like the LR, so that a change of world size does not move the ramp.
    """
    if cfg.name == OptimizerName.akiba:
        epoch = samples_seen / samples_per_epoch
        return {"sgd_share": sgd_share(epoch, cfg.akiba.center_epochs, cfg.akiba.period_epochs)}
    return {}


def gradient_clip(
    params: list[torch.nn.Parameter], max_norm: float
) -> Callable[[], torch.Tensor] | None:
    """What clips ``params``' gradients to a 2-norm of ``max_norm`` over all of them; None for 0.

    The gradients are the all-reduced ones, equal on every rank, so each rank clips alike."""
    if max_norm == 0:
        return None
    return partial(torch.nn.utils.clip_grad_norm_, params, max_norm)


def sgd_share(epoch: float, center: float, period: float) -> float:
    """The share of the momentum-SGD step in an :class:`Akiba` update at ``epoch``.

    ``clamp((elu((epoch - center) / period) + 1) / 2, 0, 1)`` with ``elu(x) = x`` for ``x > 0``
    and ``exp(x) - 1`` otherwise: near 0 (pure RMSprop) well before ``center``, rising
    exponentially to 0.5 at ``center``, then linearly to 1 (pure SGD) at ``center + period``.
    This is our reading of the ELU-shaped ramp of Akiba et al. with its centre and period
    parameters; continuous, and monotone in ``epoch``.
    """
    x = (epoch - center) / period
    elu = x if x > 0 else math.expm1(x)
    return min(1.0, max(0.0, (elu + 1.0) / 2.0))


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


class _EagerState(torch.optim.Optimizer):
    """An optimizer whose per-parameter state is created as soon as a parameter joins it.

    The state is ``STATE_KEYS``, zeros, so that a loaded or broadcast state can be copied into it
    in place."""

    STATE_KEYS: tuple[str, ...] = ()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            for key in self.STATE_KEYS:
                self.state[p][key] = _zeros(p)


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Akiba(_EagerState):
    """RMSprop warm-up (Akiba et al., arXiv:1711.04325): momentum SGD on a blend of SGD and RMSprop.

    The blend of the SGD step and an RMSprop step is set by the group's ``sgd_share`` (s). The
    SGD share ramps from 0 to 1 over the first epochs, so that the first steps at a 32k batch do
    not diverge.

    Per parameter, with g the gradient plus ``weight_decay * p`` (as SGD adds it)::

        square_avg = rms_decay * square_avg + (1 - rms_decay) * g^2
        u          = s * g + (1 - s) * rms_lr_ratio * g / (sqrt(square_avg) + rms_eps)
        buf        = momentum * buf + u
        p         -= lr * buf

    At s = 1 this is exactly ``torch.optim.SGD`` (dampening 0, no Nesterov); at s = 0 it is
    RMSprop with LR ``lr * rms_lr_ratio`` under the same momentum. The RMSprop LR is a fraction
    of the SGD LR because its steps are per element, already of unit scale. The trainer moves
    ``sgd_share`` along :func:`sgd_share` every step (:func:`step_settings`).
    """

    STATE_KEYS = ("square_avg", "momentum_buffer")

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        sgd_share: float = 0.0,
        rms_decay: float = 0.99,
        rms_eps: float = 1e-8,
        rms_lr_ratio: float = 1e-3,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            sgd_share=sgd_share,
            rms_decay=rms_decay,
            rms_eps=rms_eps,
            rms_lr_ratio=rms_lr_ratio,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            share, decay = group["sgd_share"], group["rms_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                square_avg = state["square_avg"].mul_(decay).addcmul_(g, g, value=1 - decay)
                rms = square_avg.sqrt().add_(group["rms_eps"])
                u = g.div(rms).mul_((1 - share) * group["rms_lr_ratio"]).add_(g, alpha=share)
                buf = state["momentum_buffer"].mul_(group["momentum"]).add_(u)
                p.add_(buf, alpha=-group["lr"])
        return loss


class LARS(_EagerState):
    """Layer-wise adaptive rate scaling (You et al., arXiv:1708.03888), as in the MLPerf reference.

    Its form is the MLPerf ResNet-50 reference's (mlcommons/training,
    image_classification/tensorflow2/lars_optimizer.py).

    Per parameter tensor of a group that is not ``lars_exclude``, with g its raw gradient::

        tr  = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
              (1 where ||p|| or ||g|| is 0)
        buf = momentum * buf + lr * tr * (g + weight_decay * p)
        p  -= buf

    The LR sits inside the momentum buffer, as in the reference (not outside it as in torch's
    SGD): after an LR change the buffer still carries the earlier steps at their own LR, and
    decays them. A group with ``lars_exclude`` (batch norm and biases from
    :func:`build_optimizer`) is stepped as plain momentum SGD in the same form, with tr = 1 and
    no weight decay, as the reference's skip list does.
    """

    STATE_KEYS = ("momentum_buffer",)

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            **{LARS_EXCLUDE: False},
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group[LARS_EXCLUDE]:
                    scaled = p.grad.mul(group["lr"])
                else:
                    wd = group["weight_decay"]
                    tr = trust_ratio(p, p.grad, wd, group["trust_coefficient"], group["eps"])
                    scaled = p.grad.add(p, alpha=wd).mul_(tr * group["lr"])
                buf = self.state[p]["momentum_buffer"].mul_(group["momentum"]).add_(scaled)
                p.sub_(buf)
        return loss


def trust_ratio(
    p: torch.Tensor, grad: torch.Tensor, weight_decay: float, coefficient: float, eps: float
) -> torch.Tensor:
    """LARS's per-layer trust ratio, a 0-d tensor on ``p``'s device (no host sync per layer).

    It is ``coefficient * ||p|| / (||grad|| + weight_decay * ||p|| + eps)``, or 1 where either
    norm is 0 (a layer that starts at zero, or gets no gradient, still moves at the plain LR)."""
    w_norm = torch.linalg.vector_norm(p)
    g_norm = torch.linalg.vector_norm(grad)
    ratio = coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
    return torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
