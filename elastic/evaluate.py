"""Validation over all ranks of a round, and the batch-norm statistics it evaluates with.

Each rank evaluates a contiguous shard of the validation set (:func:`shard`), so every sample is
counted exactly once whatever the world size. The evaluation's all-reduces run through the
communicator (``Communicator.all_reduce``): a peer lost there breaks the round like any other
collective, a new round announced meanwhile ends it at once, and a fault of this rank's own (an
unreadable JPEG) stays a local fault. DDP keeps batch-norm statistics per replica, so
:func:`average_bn_stats` averages them first and the replicas evaluate as one model. When an
evaluation is due is a pure function of the progress record (:func:`due_evaluation`), so one that
a broken round interrupted is redone in the next round, and a completed one is never counted twice.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset, Subset

from elastic.pipeline import Prefetcher
from elastic.round_end import RoundAborted

TOP_K = 5
# Sums a tensor over the round's ranks in place; ``what`` names it if it fails. The trainer's is
# Communicator.all_reduce, which an abort ends at once: a peer frozen in the middle of an
# evaluation must not hold the others until it thaws.
AllReduce = Callable[[torch.Tensor, str], None]
# The logits (samples, classes) and targets (samples,) of a batch on the device: a classifier's
# are its output and the batch's labels (:func:`classify`), a language model's one per token.
Predict = Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor]]


def classify(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A classifier's logits and labels for a batch of ``(images, labels)``."""
    images, targets = batch
    return model(images), targets


@dataclass(frozen=True)
class EvalResult:
    """The validation set's mean loss and top-1/top-5 accuracy over ``count`` samples."""

    loss: float
    top1: float
    top5: float
    count: int


def shard(num_samples: int, rank: int, world_size: int) -> range:
    """This rank's contiguous share of ``range(num_samples)``.

    The first ``num_samples % world_size`` ranks get one sample more, so the shards cover every
    sample exactly once; a rank beyond ``num_samples`` gets an empty range (and still joins the
    all-reduce). No padding: a repeated sample would be counted twice.
    """
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def _batch_norms(model: torch.nn.Module) -> list[_BatchNorm]:
    """The batch-norm layers that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def use_last_batch_stats(model: torch.nn.Module) -> int:
    """Make every batch norm keep the last training minibatch's statistics; returns how many.

    This is ``model.bn_stats=last_batch`` (Akiba et al., arXiv:1711.04325).

    A batch norm updates ``running = (1 - momentum) * running + momentum * batch``; at momentum
    1.0 this is ``running = batch`` exactly (the old value is multiplied by zero), so after each
    training forward ``running_mean`` is that minibatch's mean and ``running_var`` its unbiased
    variance: the statistics Akiba et al. evaluate with, instead of a moving average. Kept in the
    model's own buffers, they travel with the model state wherever it goes (checkpoints, the
    in-place state sync), so they survive resizes, recovery and restarts with no state of their
    own. Momentum is an attribute, not state: call this on every model a process builds.
    """
    layers = _batch_norms(model)
    for bn in layers:
        bn.momentum = 1.0
    return len(layers)


def average_bn_stats(model: torch.nn.Module, world_size: int, *, all_reduce: AllReduce) -> None:
    """Average every batch norm's running mean and variance over the ranks; a collective.

    One all-reduce of all of them flattened into a single tensor (a model has a hundred small
    batch norms; one message each would cost a hundred latencies). The variance averaged is each
    rank's own (the mean of the per-rank variances, as Akiba et al. average them), not that of
    the union of the ranks' samples. Run before every evaluation: DDP keeps the statistics per
    replica (``broadcast_buffers=False``), and this makes the replicas one model to evaluate.
    """
    buffers = [b for bn in _batch_norms(model) for b in (bn.running_mean, bn.running_var)]
    if world_size == 1 or not buffers:
        return  # nothing to agree on
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    all_reduce(flat, "BN statistics all-reduce")
    flat.div_(world_size)
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


def evaluate(
    model: torch.nn.Module,
    dataset: Dataset[Any],
    rank: int,
    world_size: int,
    device: torch.device,
    batch_size: int,
    *,
    all_reduce: AllReduce,
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    predict: Predict = classify,
    move: Callable[[Any], tuple[torch.Tensor, ...]] | None = None,
    loader_workers: int = 0,
    stop: Callable[[], bool] = lambda: False,
    equal_batches: bool = False,
) -> EvalResult:
    """Evaluate ``model`` (the module itself, not its DDP wrapper) on ``dataset``; a collective.

    This rank runs its :func:`shard` in eval mode without gradients and sums the cross-entropy
    of ``predict``'s logits (no label smoothing: the number is comparable across recipes) and
    the top-1 and top-5 hits (``move``: how a batch reaches the device, see :class:`Prefetcher`);
    one all-reduce adds up ``[loss, top-1, top-5, count]`` in float64 (exact counts far beyond
    ImageNet's size). Call :func:`average_bn_stats` first. ``stop`` is asked before every batch:
    when the agent has moved this rank to another round, the evaluation ends at once with
    :class:`~elastic.round_end.RoundAborted` (the next round redoes it). The model is back in
    training mode afterwards, whatever happened. ``equal_batches``: every rank runs as many
    forward passes as the largest share needs (a sharded model's forward is a collective of its
    node), the extra ones on the set's first sample, counted nowhere.
    """
    num_samples = len(dataset)  # type: ignore[arg-type]
    if num_samples == 0:
        raise ValueError("the validation set is empty")
    loader = DataLoader(
        Subset(dataset, shard(num_samples, rank, world_size)),
        batch_size=batch_size,
        num_workers=loader_workers,
        pin_memory=device.type == "cuda",
    )
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in Prefetcher(loader, device, move):
                if stop():  # the agent moved this rank to another round: its peers are gone
                    raise RoundAborted("the evaluation's round was left")
                with autocast():
                    logits, targets = predict(model, batch)
                logits = logits.float()
                k = min(TOP_K, logits.shape[1])
                hits = logits.topk(k, dim=1).indices.eq(targets[:, None])
                totals += torch.stack(
                    [
                        F.cross_entropy(logits, targets, reduction="sum").double(),
                        hits[:, 0].sum().double(),
                        hits.any(dim=1).sum().double(),
                        torch.tensor(len(targets), dtype=torch.float64, device=device),
                    ]
                )
            missing = _padding(num_samples, world_size, batch_size, len(loader))
            if equal_batches and missing:  # forwards of the first sample, counted nowhere
                filler = next(iter(Prefetcher(DataLoader(Subset(dataset, range(1))), device, move)))
                for _ in range(missing):
                    with autocast():
                        predict(model, filler)
    finally:
        model.train(was_training)
    if world_size > 1:
        all_reduce(totals, "evaluation all-reduce")
    loss, top1, top5, count = totals.tolist()
    return EvalResult(loss / count, top1 / count, top5 / count, round(count))


def _padding(num_samples: int, world_size: int, batch_size: int, batches: int) -> int:
    """The forward passes a rank that ran ``batches`` lacks to match the largest share's."""
    largest = -(-num_samples // world_size)  # the first shards' size (see shard)
    return max(0, -(-largest // batch_size) - batches)


def _evaluations_reached(
    samples_seen: int, samples_per_epoch: int, every_epochs: float, total: int
) -> int:
    """The number of the newest evaluation point at or before ``samples_seen``.

    Points are at every ``every_epochs`` epochs of samples (numbered 1, 2, ... by the boundary),
    and the end of training is always one: the next number, unless it falls on a boundary. The
    interval is taken as the decimal the config spells (0.1 is 1/10, not the float nearest it),
    so boundaries fall exactly on epoch ends whenever they should.
    """
    if every_epochs <= 0:
        return 1 if samples_seen >= total else 0
    interval = Fraction(str(every_epochs)) * samples_per_epoch
    if samples_seen >= total:
        return math.ceil(total / interval)
    return math.floor(samples_seen / interval)


def due_evaluation(
    samples_seen: int, evaluated: int, samples_per_epoch: int, every_epochs: float, total: int
) -> int | None:
    """The number of the evaluation due now, or None; a pure function of the progress record.

    ``evaluated`` is the number of the last completed evaluation (0: none yet), which the trainer
    keeps in its progress record and sets to the returned number once the evaluation is done.
    Evaluations are due every ``every_epochs`` epochs of samples seen (0: only at the end) and
    always when ``samples_seen`` reaches ``total``. Asking again after a step, after a round
    broke mid-evaluation (the record still holds the old number: it is due again), or at the
    start of a round with nothing left to train (the end's evaluation) gives the right answer;
    a step that crosses several boundaries owes one evaluation, the newest.
    """
    reached = _evaluations_reached(samples_seen, samples_per_epoch, every_epochs, total)
    return reached if reached > evaluated else None
