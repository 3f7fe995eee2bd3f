"""An elastic distributed sampler whose position survives resizes and restarts.

Each epoch is one seeded permutation of the data set. The position is ``(epoch, consumed)``:
how many samples of this epoch's permutation the whole job has trained. A step takes the next
``world_size * batch_size`` samples of the permutation and splits them among the ranks, so after a
resize the new world size simply carries on from ``consumed``; every sample of an epoch is trained
exactly once whatever happened in between. The last step of an epoch is smaller; ranks whose share
is too small to train batch norm on are padded with samples of weight zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

MIN_LOCAL_BATCH = 2  # batch norm needs more than one value per channel in training


@dataclass(frozen=True)
class SamplerState:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch's permutation already trained, across all ranks


@dataclass(frozen=True)
class StepPlan:
    """What one rank trains in one step."""

    epoch: int
    indices: tuple[int, ...]  # this rank's samples; the first ``real`` count, the rest is padding
    real: int
    global_count: int  # samples the whole job trains in this step

    def weights(self, device: torch.device | None = None) -> torch.Tensor:
        """Each of this rank's samples' weight in the step's mean over the global batch.

        ``1 / global_count`` for a real sample, 0 for padding: summed over every rank (the comm
        hook's all-reduce), the weighted gradients are the mean over the global batch, also for
        an uneven last step, at any world size (Goyal et al.)."""
        real = torch.arange(len(self.indices), device=device) < self.real
        return real.float() / self.global_count


class ElasticSampler:
    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the data set is empty")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed

    @lru_cache(maxsize=2)  # noqa: B019 - one sampler per worker; two epochs are live at a boundary
    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def plan(
        self, state: SamplerState, rank: int, world_size: int, limit: int, global_batch: int = 0
    ) -> StepPlan:
        """The next step for ``rank``; ``limit`` caps the samples left in the whole run.

        A step takes ``global_batch`` samples (default: ``batch_size`` per rank); a rank's share
        may then exceed ``batch_size``, and the trainer accumulates it in micro-batches.
        """
        perm = self.permutation(state.epoch)
        step = global_batch or world_size * self.batch_size
        count = min(step, self.num_samples - state.consumed, limit)
        if count <= 0:
            raise ValueError(f"no samples left to plan (state={state}, limit={limit})")
        base, extra = divmod(count, world_size)
        start = state.consumed + rank * base + min(rank, extra)
        mine = tuple(perm[start : start + base + (1 if rank < extra else 0)].tolist())
        padding = (int(perm[0]),) * max(0, MIN_LOCAL_BATCH - len(mine))
        return StepPlan(state.epoch, mine + padding, len(mine), count)

    def advance(self, state: SamplerState, plan: StepPlan) -> SamplerState:
        consumed = state.consumed + plan.global_count
        if consumed >= self.num_samples:
            return SamplerState(state.epoch + 1, 0)
        return SamplerState(state.epoch, consumed)

    def batches(
        self, state: SamplerState, rank: int, world_size: int, limit: int, global_batch: int = 0
    ) -> Iterator[list[tuple[int, int]]]:
        """This rank's batches from ``state`` on, as ``(epoch, index)`` keys for a DataLoader.

        A DataLoader with workers draws ahead of training; the plans are a pure function of the
        state, so what it prefetches is exactly what :meth:`plan` gives the trainer later.
        """
        while limit > 0:
            plan = self.plan(state, rank, world_size, limit, global_batch)
            yield [(plan.epoch, i) for i in plan.indices]
            limit -= plan.global_count
            state = self.advance(state, plan)
