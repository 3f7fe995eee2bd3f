"""Validation: shards, the sums over real gloo groups against values computed by hand, last-batch
batch-norm statistics averaged over ranks, and when an evaluation is due."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset

from elastic.evaluate import (
    average_bn_stats,
    due_evaluation,
    evaluate,
    shard,
    use_last_batch_stats,
)
from tests.conftest import served_store

# --- shards ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_samples", "world", "sizes"),
    [(7, 2, [4, 3]), (7, 3, [3, 2, 2]), (2, 3, [1, 1, 0]), (6, 3, [2, 2, 2]), (0, 2, [0, 0])],
)
def test_shards_are_contiguous_uneven_and_cover_every_sample_once(
    num_samples: int, world: int, sizes: list[int]
) -> None:
    shards = [shard(num_samples, rank, world) for rank in range(world)]
    assert [len(s) for s in shards] == sizes
    assert [i for s in shards for i in s] == list(range(num_samples))  # in order, each once
    assert all(s.step == 1 for s in shards)


# --- the evaluation's sums -------------------------------------------------------------------

# Seven samples of six classes. Sample i's logits are the logs of 6, 5, 4, 3, 2, 1 rotated by i,
# so its softmax is (6, 5, 4, 3, 2, 1) / 21 in some order, and its label is the class whose
# logit is ln(VALUES[i]): it is the top-1 class when that is 6, among the top 5 unless it is 1,
# and its cross-entropy is ln(21 / VALUES[i]).
VALUES = [6, 6, 5, 1, 2, 6, 1]
LOSS = math.log(21) - math.log(6 * 6 * 5 * 1 * 2 * 6 * 1) / 7
TOP1 = 3 / 7
TOP5 = 5 / 7


class Logits(Dataset[tuple[torch.Tensor, int]]):
    """The samples above, as (input, label); the model is the identity."""

    def __init__(self, count: int = len(VALUES)) -> None:
        self.rows: list[tuple[torch.Tensor, int]] = []
        for i, value in enumerate(VALUES[:count]):
            row = torch.tensor([6.0, 5, 4, 3, 2, 1]).roll(i)
            self.rows.append((row.log(), int((row == value).nonzero())))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.rows[index]


def identity_model() -> torch.nn.Module:
    model = torch.nn.Linear(6, 6)
    with torch.no_grad():
        model.weight.copy_(torch.eye(6))
        model.bias.zero_()
    return model


class Recorder:
    """An ``all_reduce`` (the process group's own) that notes which all-reduces ran."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, tensor: torch.Tensor, what: str) -> None:
        self.seen.append(what)
        dist.all_reduce(tensor)


def test_evaluate_on_one_process_matches_the_hand_computed_values() -> None:
    model, guard = identity_model(), Recorder()
    model.train()
    result = evaluate(model, Logits(), 0, 1, torch.device("cpu"), batch_size=2, all_reduce=guard)
    assert result.count == 7
    assert result.top1 == pytest.approx(TOP1) and result.top5 == pytest.approx(TOP5)
    assert result.loss == pytest.approx(LOSS, rel=1e-6)
    assert model.training  # back in training mode
    assert guard.seen == []  # one rank: nothing to all-reduce


def test_equal_batches_run_as_many_forwards_as_the_largest_share_and_count_only_its_own() -> None:
    """parallel.shard=node: a sharded forward gathers shards from the node's ranks, so every
    rank runs the same number. 7 samples over 3 ranks at 2 a batch: rank 0 has 3 (2 batches),
    rank 2 has 2 (1 batch), and pads with one forward it does not count."""
    forwards = []
    model = identity_model()
    model.register_forward_hook(lambda *_: forwards.append(1))
    summed = []
    for equal in (False, True):
        forwards.clear()
        result = evaluate(
            model,
            Logits(),
            2,
            3,
            torch.device("cpu"),
            batch_size=2,
            all_reduce=lambda t, _: summed.append(t.tolist()),
            equal_batches=equal,
        )
        assert (len(forwards), result.count) == (2 if equal else 1, 2)
    assert summed[0] == summed[1]  # the padding is counted nowhere


def test_top5_with_fewer_than_five_classes_counts_every_sample() -> None:
    class Two(Dataset[tuple[torch.Tensor, int]]):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            return torch.tensor([0.0, 1.0]), index % 2

    result = evaluate(
        torch.nn.Identity(),
        Two(),
        0,
        1,
        torch.device("cpu"),
        batch_size=2,
        all_reduce=Recorder(),
    )
    assert (result.top1, result.top5, result.count) == (pytest.approx(1 / 3), 1.0, 3)


def _rank_main(rank: int, world: int, port: int, action: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    guard = Recorder()
    found: dict[str, object] = {}
    if action == "evaluate":
        cpu = torch.device("cpu")
        for count in (7, 2):  # with two samples, the third of three ranks has an empty shard
            result = evaluate(
                identity_model(), Logits(count), rank, world, cpu, batch_size=2, all_reduce=guard
            )
            found[str(count)] = [result.loss, result.top1, result.top5, result.count]
    else:
        bn = torch.nn.BatchNorm1d(3)
        assert use_last_batch_stats(bn) == 1
        bn.train()
        bn(torch.randn(5, 3) * 10)  # an older minibatch: must leave no trace
        bn(torch.tensor(LAST_BATCHES[rank]))
        found["own"] = [bn.running_mean.tolist(), bn.running_var.tolist()]
        average_bn_stats(bn, world, all_reduce=guard)
        found["averaged"] = [bn.running_mean.tolist(), bn.running_var.tolist()]
    found["collectives"] = guard.seen
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def run_ranks(world: int, action: str, out: Path) -> list[dict]:
    with served_store() as port:
        mp.spawn(_rank_main, args=(world, port, action, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_evaluate_over_ranks_counts_each_sample_once_and_agrees_everywhere(
    world: int, tmp_path: Path
) -> None:
    found = run_ranks(world, "evaluate", tmp_path)
    for rank in found:
        loss, top1, top5, count = rank["7"]
        assert count == 7
        assert (top1, top5) == (pytest.approx(TOP1), pytest.approx(TOP5))
        assert loss == pytest.approx(LOSS, rel=1e-6)
        # The first two samples: labels of value 6, both top-1, losses ln(21/6).
        assert rank["2"] == [pytest.approx(math.log(21 / 6)), 1.0, 1.0, 2]
        assert rank["collectives"] == ["evaluation all-reduce"] * 2
    assert len({json.dumps(rank["7"]) for rank in found}) == 1  # bit for bit the same result


# --- batch norm without moving averages -------------------------------------------------------

# Each rank's last training minibatch: 4 samples of 3 channels.
LAST_BATCHES = [
    [[1.0, 2, 0], [2, 2, 0], [3, 2, 6], [4, 2, 6]],
    [[0.0, -1, 10], [0, 1, 10], [0, -1, 10], [4, 1, 10]],
]
# By channel: rank 0's means 2.5, 2, 3 and unbiased variances 5/3, 0, 12; rank 1's means 1, 0, 10
# and variances 4, 4/3, 0.
OWN = [[[2.5, 2, 3], [5 / 3, 0, 12]], [[1, 0, 10], [4, 4 / 3, 0]]]
AVERAGED = [[1.75, 1, 6.5], [17 / 6, 2 / 3, 6]]


def test_last_batch_stats_averaged_over_two_ranks(tmp_path: Path) -> None:
    found = run_ranks(2, "last_batch", tmp_path)
    for rank, got in enumerate(found):
        assert got["own"][0] == pytest.approx(OWN[rank][0])
        assert got["own"][1] == pytest.approx(OWN[rank][1])
        assert got["averaged"][0] == pytest.approx(AVERAGED[0])
        assert got["averaged"][1] == pytest.approx(AVERAGED[1])
        assert got["collectives"] == ["BN statistics all-reduce"]


def test_last_batch_stats_are_those_of_the_last_minibatch() -> None:
    """Momentum 1.0 leaves nothing of the earlier minibatches."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3, momentum=0.1))
    assert use_last_batch_stats(model) == 1
    for _ in range(3):
        x = torch.randn(8, 4)
        model(x)
    h = model[0](x).detach()
    assert torch.allclose(model[1].running_mean, h.mean(0), atol=1e-6)
    assert torch.allclose(model[1].running_var, h.var(0, unbiased=True), rtol=1e-6)


def test_bn_stats_on_one_rank_are_left_alone() -> None:
    bn = torch.nn.BatchNorm2d(2)
    bn.running_mean.fill_(3.0)
    guard = Recorder()
    average_bn_stats(bn, 1, all_reduce=guard)
    assert bn.running_mean.tolist() == [3.0, 3.0] and guard.seen == []


# --- when an evaluation is due ----------------------------------------------------------------


def run_job(steps: list[int], epoch: int, every: float, total: int) -> list[tuple[int, int]]:
    """Train steps of the given sizes, evaluating whenever one is due: (samples seen, number)."""
    seen, evaluated, done = 0, 0, []
    for size in steps:
        seen += size
        due = due_evaluation(seen, evaluated, epoch, every, total)
        if due is not None:
            done.append((seen, due))
            evaluated = due
        assert due_evaluation(seen, evaluated, epoch, every, total) is None  # never twice
    assert seen == total
    return done


def test_every_epoch_and_once_at_the_end() -> None:
    # 3 epochs of 10 samples in steps of 4: boundaries crossed at 12, 20 (exact), and the end.
    assert run_job([4] * 7 + [2], 10, 1.0, 30) == [(12, 1), (20, 2), (30, 3)]


def test_every_half_epoch() -> None:
    # Half an epoch of 7 is 3.5 samples: boundaries at 3.5, 7, 10.5, 14; the end is the 4th.
    assert run_job([2] * 7, 7, 0.5, 14) == [(4, 1), (8, 2), (12, 3), (14, 4)]


def test_every_two_epochs_and_an_end_between_boundaries() -> None:
    # 5 epochs of 10: boundaries at 20 and 40, then the end at 50 as the 3rd.
    assert run_job([10] * 5, 10, 2.0, 50) == [(20, 1), (40, 2), (50, 3)]


def test_only_at_the_end() -> None:
    assert run_job([3] * 5, 5, 0.0, 15) == [(15, 1)]


def test_the_end_is_due_even_when_the_run_is_shorter_than_the_interval() -> None:
    assert run_job([5, 5], 10, 2.0, 10) == [(10, 1)]


def test_a_step_over_several_boundaries_owes_only_the_newest() -> None:
    assert run_job([25, 5], 10, 0.5, 30) == [(25, 5), (30, 6)]


def test_an_interrupted_evaluation_is_due_again_until_recorded() -> None:
    # The round broke during evaluation 2: the record still says 1, at any later sample count.
    assert due_evaluation(20, 1, 10, 1.0, 30) == 2
    assert due_evaluation(24, 1, 10, 1.0, 30) == 2
    # A round that starts with nothing left to train still owes the end's evaluation.
    assert due_evaluation(30, 2, 10, 1.0, 30) == 3
    assert due_evaluation(30, 3, 10, 1.0, 30) is None


def test_a_decimal_interval_lands_on_epoch_ends() -> None:
    # 0.1 * 30 is 3.0000000000000004 in floating point, and 30 samples would be 9.99... tenths
    # of an epoch of 30; they are ten.
    assert due_evaluation(30, 9, 30, 0.1, 300) == 10
