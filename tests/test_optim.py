"""The seeds' update rules against hand-computed steps, and their state as named tensors."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from elastic.config import AkibaConfig, LarsConfig, OptimConfig, OptimizerName
from elastic.optim import (
    LARS,
    LARS_EXCLUDE,
    Akiba,
    build_optimizer,
    gradient_clip,
    sgd_share,
    step_settings,
    trust_ratio,
)
from elastic.state import TrainState

# Two steps on p = [1, 2] with lr 0.1, momentum 0.9 and no weight decay. The gradients are chosen
# so that the RMSprop denominators come out exact with rms_decay 0.75 and rms_eps 0:
#   step 1, g = [2, -1]:   square_avg = 0.25 * [4, 1]                    = [1, 0.25]
#                          g / sqrt(square_avg) = [2 / 1, -1 / 0.5]       = [2, -2]
#   step 2, g = [1, -0.5]: square_avg = 0.75 * [1, 0.25] + 0.25 * [1, 0.25] = [1, 0.25]
#                          g / sqrt(square_avg) = [1 / 1, -0.5 / 0.5]     = [1, -1]
# With rms_lr_ratio 0.5, u = s * g + (1 - s) * 0.5 * g / sqrt(square_avg).
P0 = [1.0, 2.0]
GRADS = ([2.0, -1.0], [1.0, -0.5])
HAND = {
    # s = 0: u1 = 0.5 * [2, -2] = [1, -1]; buf = [1, -1]; p = [1, 2] - 0.1 * [1, -1] = [0.9, 2.1]
    #        u2 = 0.5 * [1, -1] = [0.5, -0.5]; buf = 0.9 * [1, -1] + u2 = [1.4, -1.4]
    #        p = [0.9, 2.1] - 0.1 * [1.4, -1.4] = [0.76, 2.24]
    0.0: ([0.9, 2.1], [0.76, 2.24]),
    # s = 0.5: u1 = 0.5 * [2, -1] + 0.25 * [2, -2] = [1.5, -1]; p = [1 - 0.15, 2 + 0.1]
    #          u2 = 0.5 * [1, -0.5] + 0.25 * [1, -1] = [0.75, -0.5]
    #          buf = 0.9 * [1.5, -1] + u2 = [2.1, -1.4]; p = [0.85 - 0.21, 2.1 + 0.14]
    0.5: ([0.85, 2.1], [0.64, 2.24]),
    # s = 1: plain momentum SGD. buf = [2, -1]; p = [0.8, 2.1]
    #        buf = 0.9 * [2, -1] + [1, -0.5] = [2.8, -1.4]; p = [0.8 - 0.28, 2.1 + 0.14]
    1.0: ([0.8, 2.1], [0.52, 2.24]),
}


def run_steps(opt: torch.optim.Optimizer, p: torch.nn.Parameter, grads) -> list[list[float]]:
    seen = []
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        seen.append(p.detach().tolist())
    return seen


@pytest.mark.parametrize("share", sorted(HAND))
def test_akiba_two_steps_by_hand(share: float) -> None:
    p = torch.nn.Parameter(torch.tensor(P0))
    opt = Akiba(
        [p], lr=0.1, momentum=0.9, sgd_share=share, rms_decay=0.75, rms_eps=0.0, rms_lr_ratio=0.5
    )
    after = run_steps(opt, p, GRADS)
    for got, want in zip(after, HAND[share], strict=True):
        assert got == pytest.approx(want)
    assert opt.state[p]["square_avg"].tolist() == pytest.approx([1.0, 0.25])


def test_akiba_at_share_one_is_torch_sgd_with_weight_decay() -> None:
    p = torch.nn.Parameter(torch.tensor(P0))
    q = torch.nn.Parameter(torch.tensor(P0))
    akiba = Akiba([p], lr=0.1, momentum=0.9, weight_decay=0.01, sgd_share=1.0)
    sgd = torch.optim.SGD([q], lr=0.1, momentum=0.9, weight_decay=0.01)
    assert run_steps(akiba, p, GRADS) == run_steps(sgd, q, GRADS)


def test_sgd_share_ramp() -> None:
    center, period = 10.0, 5.0
    assert sgd_share(-1000.0, center, period) == 0.0  # (e^-202 - 1 + 1) / 2 rounds to 0
    assert sgd_share(0.0, center, period) == pytest.approx(math.exp(-2) / 2)  # (e^-2 - 1 + 1) / 2
    assert sgd_share(center, center, period) == 0.5
    assert sgd_share(12.5, center, period) == pytest.approx(0.75)  # ((2.5 / 5) + 1) / 2
    assert sgd_share(center + period, center, period) == 1.0
    assert sgd_share(90.0, center, period) == 1.0
    epochs = [i / 100 for i in range(0, 3001)]
    shares = [sgd_share(e, center, period) for e in epochs]
    assert all(a <= b for a, b in pairwise(shares))  # monotone
    assert max(abs(a - b) for a, b in pairwise(shares)) <= 0.01 / period  # continuous
    assert sgd_share(center - 1e-9, center, period) == pytest.approx(0.5)  # no jump at the centre


def test_step_settings_follow_samples_seen() -> None:
    akiba = OptimConfig(
        name=OptimizerName.akiba, akiba=AkibaConfig(center_epochs=2, period_epochs=1)
    )
    assert step_settings(akiba, samples_seen=2000, samples_per_epoch=1000) == {"sgd_share": 0.5}
    assert step_settings(akiba, 2500, 1000) == {"sgd_share": 0.75}  # ((0.5 / 1) + 1) / 2
    assert step_settings(OptimConfig(name=OptimizerName.sgd), 2000, 1000) == {}
    assert step_settings(OptimConfig(name=OptimizerName.lars), 2000, 1000) == {}


def test_lars_trust_ratio_by_hand() -> None:
    # ||p|| = ||[3, 4]|| = 5, ||g|| = ||[0.6, 0.8]|| = 1, weight decay 0.2, coefficient 0.01:
    #   tr = 0.01 * 5 / (1 + 0.2 * 5 + 0) = 0.05 / 2 = 0.025
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    g = torch.tensor([0.6, 0.8])
    assert trust_ratio(p, g, 0.2, 0.01, 0.0).item() == pytest.approx(0.025)
    assert trust_ratio(torch.zeros(2), g, 0.2, 0.01, 0.0).item() == 1.0  # ||p|| = 0
    assert trust_ratio(p, torch.zeros(2), 0.0, 0.01, 0.0).item() == 1.0  # ||g|| = 0

    opt = LARS([p], lr=2.0, momentum=0.9, weight_decay=0.2, trust_coefficient=0.01)
    # g + wd * p = [0.6 + 0.6, 0.8 + 0.8] = [1.2, 1.6]; buf = 2 * 0.025 * [1.2, 1.6] = [0.06, 0.08]
    # p = [3 - 0.06, 4 - 0.08] = [2.94, 3.92] = 0.98 * [3, 4]
    (first, second) = run_steps(opt, p, ([0.6, 0.8], [0.6, 0.8]))
    assert first == pytest.approx([2.94, 3.92])
    # step 2: ||p|| = 0.98 * 5 = 4.9; tr = 0.01 * 4.9 / (1 + 0.2 * 4.9)
    #         buf = 0.9 * [0.06, 0.08] + 2 * tr * ([0.6, 0.8] + 0.2 * [2.94, 3.92])
    tr = 0.01 * 4.9 / (1 + 0.2 * 4.9)
    buf = [0.9 * 0.06 + 2 * tr * (0.6 + 0.2 * 2.94), 0.9 * 0.08 + 2 * tr * (0.8 + 0.2 * 3.92)]
    assert second == pytest.approx([2.94 - buf[0], 3.92 - buf[1]])


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )


def config(name: str, **kw) -> OptimConfig:
    return OptimConfig(name=OptimizerName(name), weight_decay=0.01, **kw)


def test_build_optimizer_groups_with_batch_norm() -> None:
    model = small_model()
    weights = [model[0].weight, model[3].weight]
    exempt = [model[0].bias, model[1].weight, model[1].bias, model[3].bias]  # ndim <= 1
    for name, kind in (("sgd", torch.optim.SGD), ("akiba", Akiba), ("lars", LARS)):
        opt = build_optimizer(model, config(name))
        assert isinstance(opt, kind)
        decayed, plain = opt.param_groups
        assert decayed["params"] == weights and decayed["weight_decay"] == 0.01
        assert plain["params"] == exempt and plain["weight_decay"] == 0.0
        if name == "lars":
            assert not decayed[LARS_EXCLUDE] and plain[LARS_EXCLUDE]
    (everything,) = build_optimizer(model, config("sgd", decay_bn_and_bias=True)).param_groups
    assert len(everything["params"]) == 6 and everything["weight_decay"] == 0.01


def test_lars_excluded_groups_get_neither_trust_ratio_nor_weight_decay() -> None:
    model = small_model()
    opt = build_optimizer(model, config("lars", lars=LarsConfig(trust_coefficient=0.001)))
    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = 2.0
    bias, w = model[3].bias, model[3].weight
    bias_before, w_before = bias.detach().clone(), w.detach().clone()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    # the bias, excluded: plain SGD's first step, buf = lr * g = 2 * 0.5 = 1, whatever its norm
    assert torch.equal(bias.detach(), bias_before - 1.0)
    # the weight: buf = lr * tr * (g + 0.01 * w), tr = 0.001 * ||w|| / (||g|| + 0.01 * ||w||)
    g = torch.full_like(w, 0.5)
    tr = 0.001 * w_before.norm() / (g.norm() + 0.01 * w_before.norm())
    assert torch.allclose(opt.state[w]["momentum_buffer"], 2.0 * tr * (g + 0.01 * w_before))


STATE_KEYS = {
    "sgd": ["momentum_buffer"],
    "lars": ["momentum_buffer"],
    "akiba": ["momentum_buffer", "square_avg"],
    "adamw": ["exp_avg", "exp_avg_sq", "step"],
}


@pytest.mark.parametrize("name", sorted(STATE_KEYS))
def test_state_is_created_when_built(name: str) -> None:
    model = small_model()
    opt = build_optimizer(model, config(name))
    for p in model.parameters():
        assert sorted(opt.state[p]) == STATE_KEYS[name]
        for key, t in opt.state[p].items():
            zeros = torch.zeros(()) if key == "step" else torch.zeros_like(p)
            assert torch.equal(t, zeros), key


def test_adamw_with_its_state_made_up_front_steps_as_torchs_own() -> None:
    """create_state makes what AdamW's first step would (a CPU float32 step count, zero
    averages), so the steps are torch's, bit for bit."""
    ours, theirs = small_model(), small_model()
    made = build_optimizer(ours, config("adamw"))
    lazy = torch.optim.AdamW(
        [
            {"params": [p for p in theirs.parameters() if p.ndim > 1], "weight_decay": 0.01},
            {"params": [p for p in theirs.parameters() if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=0.1,
        betas=(0.9, 0.95),
    )
    for seed in (1, 2, 3):
        for model, opt in ((ours, made), (theirs, lazy)):
            seeded_grads(model, seed)
            opt.step()
    for mine, torchs in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, torchs)
    assert made.state[ours[0].weight]["step"].item() == 3.0


@pytest.mark.parametrize("name", sorted(STATE_KEYS))
def test_train_state_names_every_state_tensor(name: str) -> None:
    model = small_model()
    state = TrainState(model, build_optimizer(model, config(name)))
    optim_names = sorted(k for k in state.tensors() if k.startswith("optim."))
    params = ["0.bias", "0.weight", "1.bias", "1.weight", "3.bias", "3.weight"]
    assert optim_names == sorted(f"optim.{p}.{k}" for p in params for k in STATE_KEYS[name])


def test_train_state_gives_a_plain_torch_sgd_its_momentum_buffers() -> None:
    model = small_model()
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert "optim.3.weight.momentum_buffer" in state.tensors()


def seeded_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("name", sorted(STATE_KEYS))
def test_state_round_trip_into_a_fresh_optimizer(name: str) -> None:
    """Copying the named tensors into a fresh model and optimizer (what the checkpoint restore
    and the in-place recovery do) makes both take the same next step, bit for bit."""
    cfg = config(name, akiba=AkibaConfig(rms_lr_ratio=0.1))
    source = TrainState(m := small_model(), build_optimizer(m, cfg))
    source.apply({"sgd_share": 0.3} if name == "akiba" else {})
    for seed in (1, 2):
        seeded_grads(source.model, seed)
        source.optimizer.step()

    fresh = TrainState(m := small_model(), build_optimizer(m, cfg))
    fresh.apply({"sgd_share": 0.3} if name == "akiba" else {})
    theirs = fresh.tensors()
    assert fresh.digest() != source.digest()
    with torch.no_grad():
        for key, t in source.tensors().items():
            theirs[key].copy_(t)
    assert fresh.digest() == source.digest()

    for state in (source, fresh):
        seeded_grads(state.model, 3)
        state.optimizer.step()
    assert fresh.digest() == source.digest()
    for key, t in source.tensors().items():
        assert torch.equal(fresh.tensors()[key], t), key


def test_gradient_clip_scales_the_gradients_to_the_norm_or_is_none() -> None:
    model = small_model()
    params = list(model.parameters())
    assert gradient_clip(params, 0.0) is None
    seeded_grads(model, 1)
    before = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    clip = gradient_clip(params, 0.5)
    assert clip is not None and before > 0.5
    assert clip().item() == pytest.approx(before.item())  # it returns the norm before
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert after.item() == pytest.approx(0.5, rel=1e-4)


def test_apply_sets_every_group() -> None:
    model = small_model()
    state = TrainState(model, build_optimizer(model, config("akiba")))
    state.apply({"sgd_share": 0.25, "rms_lr_ratio": 0.5})
    assert [(g["sgd_share"], g["rms_lr_ratio"]) for g in state.optimizer.param_groups] == [
        (0.25, 0.5),
        (0.25, 0.5),
    ]
