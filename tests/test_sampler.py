"""The elastic sampler: every sample of an epoch exactly once, across any sequence of resizes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from elastic.sampler import MIN_LOCAL_BATCH, ElasticSampler, SamplerState


def run_epoch(sampler: ElasticSampler, worlds: list[int]) -> Counter[int]:
    """Train one epoch, switching world size after each step as ``worlds`` says (last repeats)."""
    state, seen, step = SamplerState(), Counter(), 0
    while state.epoch == 0:
        world = worlds[min(step, len(worlds) - 1)]
        plans = [sampler.plan(state, r, world, limit=10**9) for r in range(world)]
        assert len({p.global_count for p in plans}) == 1
        assert sum(p.real for p in plans) == plans[0].global_count
        # Summed over the ranks (the comm hook sums), the weights are the global batch's mean.
        weights = torch.cat([p.weights() for p in plans])
        assert torch.allclose(weights.sum(), torch.tensor(1.0))
        assert set(weights.tolist()) <= {0.0, torch.tensor(1 / plans[0].global_count).item()}
        for p in plans:
            seen.update(p.indices[: p.real])
            assert len(p.indices) >= MIN_LOCAL_BATCH
        state = sampler.advance(state, plans[0])
        step += 1
    return seen


@pytest.mark.parametrize("worlds", [[1], [3], [3, 3, 2, 2, 2, 4, 1], [5, 2, 7]])
def test_every_sample_once_per_epoch_whatever_the_resizes(worlds: list[int]) -> None:
    sampler = ElasticSampler(num_samples=101, batch_size=4, seed=1)
    seen = run_epoch(sampler, worlds)
    assert sorted(seen) == list(range(101))
    assert set(seen.values()) == {1}


def test_position_moves_by_the_global_batch_and_wraps_into_the_next_epoch() -> None:
    sampler = ElasticSampler(num_samples=10, batch_size=3, seed=0)
    state = SamplerState()
    plan = sampler.plan(state, 0, 2, limit=100)
    assert plan.global_count == 6
    state = sampler.advance(state, plan)
    assert state == SamplerState(0, 6)
    last = sampler.plan(state, 1, 2, limit=100)
    assert last.global_count == 4 and last.real == 2
    assert sampler.advance(state, last) == SamplerState(1, 0)


def test_limit_caps_the_last_step_of_the_run() -> None:
    sampler = ElasticSampler(num_samples=100, batch_size=8, seed=0)
    plan = sampler.plan(SamplerState(), 0, 2, limit=5)
    assert plan.global_count == 5


def test_tiny_shares_are_padded_for_batch_norm() -> None:
    sampler = ElasticSampler(num_samples=9, batch_size=4, seed=0)
    plan = sampler.plan(SamplerState(0, 8), 0, 2, limit=100)  # one sample left for two ranks
    assert plan.real == 1 and len(plan.indices) == MIN_LOCAL_BATCH
    other = sampler.plan(SamplerState(0, 8), 1, 2, limit=100)
    assert other.real == 0 and len(other.indices) == MIN_LOCAL_BATCH


def test_batches_yield_exactly_what_plan_gives() -> None:
    sampler = ElasticSampler(num_samples=23, batch_size=4, seed=3)
    state = SamplerState(0, 8)
    got = list(sampler.batches(state, rank=1, world_size=2, limit=40))
    expected = []
    remaining = 40
    while remaining > 0:
        plan = sampler.plan(state, 1, 2, remaining)
        expected.append([(plan.epoch, i) for i in plan.indices])
        remaining -= plan.global_count
        state = sampler.advance(state, plan)
    assert got == expected


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    a, b = ElasticSampler(50, 4, seed=7), ElasticSampler(50, 8, seed=7)
    assert a.permutation(0).tolist() == b.permutation(0).tolist()
    assert a.permutation(0).tolist() != a.permutation(1).tolist()


@pytest.mark.parametrize("worlds", [[2], [2, 3, 1, 2]])
def test_a_global_batch_larger_than_world_times_batch_size_plans_every_sample_once(
    worlds: list[int],
) -> None:
    """keep_global_batch: 3 * batch_size per step at world 2 (and across resizes)."""
    sampler = ElasticSampler(num_samples=101, batch_size=4, seed=1)
    state, seen, shares, steps = SamplerState(), Counter[int](), [], 0
    while state.epoch == 0:
        world = worlds[min(steps, len(worlds) - 1)]
        plans = [sampler.plan(state, r, world, limit=10**9, global_batch=12) for r in range(world)]
        assert {p.global_count for p in plans} == {min(12, 101 - state.consumed)}
        assert sum(p.real for p in plans) == plans[0].global_count
        for p in plans:
            seen.update(p.indices[: p.real])
        shares.append([p.real for p in plans])
        state = sampler.advance(state, plans[0])
        steps += 1
    assert sorted(seen) == list(range(101))
    assert set(seen.values()) == {1}
    assert steps == 9  # ceil(101 / 12)
    if worlds == [2]:
        assert shares[:8] == [[6, 6]] * 8 and shares[8] == [3, 2]  # 6 > batch_size 4
    assert max(max(s) for s in shares) > sampler.batch_size
