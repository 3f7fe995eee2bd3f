"""The pure parts of elastic/nonfinite.py and elastic/replicas.py: verdicts, checksums, backups."""

from __future__ import annotations

import torch
import torchvision

from elastic.nonfinite import (
    SENTINEL_ELEMENTS,
    BufferBackup,
    NonFiniteSteps,
    Verdict,
    first_producer,
    gradients_finite,
    leading_view,
)
from elastic.replicas import ReplicaVerdict, checksum, judge, judge_shards
from elastic.state import TrainState


def test_non_finite_steps_are_skipped_and_a_run_of_them_rolls_back() -> None:
    steps = NonFiniteSteps(rollback_after=3)
    assert steps.update(False, producer=1) is Verdict.SKIP
    assert steps.update(True) is Verdict.TRAIN and steps.streak == 0  # a good step ends a run
    assert [steps.update(False, 2) for _ in range(3)] == [
        Verdict.SKIP,
        Verdict.SKIP,
        Verdict.ROLL_BACK,
    ]
    assert steps.skipped == 4 and steps.blamed() == 2
    steps.rolled_back()
    assert steps.streak == 0 and steps.blamed() == -1
    steps.update(False, 2)
    steps.update(False, 0)
    assert steps.blamed() == -1  # two ranks: no one is blamed
    steps.rolled_back()
    steps.update(False, -1)
    assert steps.blamed() == -1  # the gradients alone: no rank named


def test_the_first_producer_is_the_first_rank_whose_loss_was_not_finite() -> None:
    assert first_producer([0.0, 1.0, 1.0]) == 1
    assert first_producer([0.0, 0.0]) == -1


def test_gradients_are_finite_until_one_holds_a_nan_or_an_inf() -> None:
    model = torch.nn.Linear(4, 2)
    model(torch.ones(1, 4)).sum().backward()
    assert gradients_finite(list(model.parameters()))
    assert model.bias.grad is not None
    model.bias.grad[0] = float("inf")
    assert not gradients_finite(list(model.parameters()))
    model.bias.grad[0] = float("nan")
    assert not gradients_finite(list(model.parameters()))


def test_a_nan_anywhere_above_the_first_layer_reaches_its_gradient() -> None:
    """gradients_finite reads the two ends of the model only: a NaN loss, or a NaN weight deep
    inside, still shows, since it spoils every gradient below it."""
    layers = [torch.nn.Linear(300, 300) for _ in range(4)]  # each more than both ends read
    model = torch.nn.Sequential(*layers)
    model(torch.ones(2, 300)).sum().backward()
    params = list(model.parameters())
    assert gradients_finite(params)
    model.zero_grad()
    (model(torch.ones(2, 300)).sum() * float("nan")).backward()  # a NaN loss
    assert not gradients_finite(params)
    model.zero_grad()
    with torch.no_grad():
        layers[2].weight[0, 0] = float("nan")  # a corrupt weight in the middle
    model(torch.ones(2, 300)).sum().backward()
    assert not gradients_finite(params)


def test_a_gradient_larger_than_the_budget_is_read_in_part_without_a_copy() -> None:
    """The tensor that crosses SENTINEL_ELEMENTS is read only as far as the budget goes, from its
    first element in memory, as a view: channels_last too."""
    flat = torch.zeros(SENTINEL_ELEMENTS * 3)
    part = leading_view(flat, 10)
    assert part.numel() == 10 and part.data_ptr() == flat.data_ptr()
    conv = torch.zeros(64, 32, 3, 3).to(memory_format=torch.channels_last)
    part = leading_view(conv, 100)
    assert part.numel() == 100 and part.data_ptr() == conv.data_ptr()
    small = torch.zeros(5)
    assert leading_view(small, 10) is small


def test_a_skipped_step_puts_the_batch_norm_statistics_back() -> None:
    model = torch.nn.BatchNorm1d(3)
    backup = BufferBackup(model)
    before = [b.clone() for b in model.buffers()]
    backup.save()
    model(torch.full((4, 3), float("nan")))  # a forward through a NaN spoils them
    assert torch.isnan(model.running_mean).all()
    backup.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))


def test_the_checksum_is_equal_for_equal_bytes_and_changed_by_one_flipped_bit() -> None:
    tensors = {
        "w": torch.randn(1000),
        "h": torch.randn(10).half(),
        "n": torch.tensor(7, dtype=torch.int64),
    }
    names = sorted(tensors)
    copy = {k: v.clone() for k, v in tensors.items()}
    assert checksum(tensors, names) == checksum(copy, names)
    copy["w"].view(torch.int32)[123] ^= 1 << 20
    assert checksum(tensors, names) != checksum(copy, names)
    # Two tensors swapped are another state, and another checksum.
    swapped = {"a": torch.ones(3), "b": torch.zeros(3)}
    assert checksum(swapped, ["a", "b"]) != checksum(swapped, ["b", "a"])


def test_a_minority_is_repaired_from_the_majority_and_no_majority_rolls_back() -> None:
    assert judge([5, 5, 5]).agree
    assert judge([5, 9, 5, 5]) == ReplicaVerdict(corrupt=(1,), source=0)
    assert judge([9, 5, 5]) == ReplicaVerdict(corrupt=(0,), source=1)
    assert judge([5, 9]).roll_back  # two replicas: no telling which is right
    assert judge([5, 5, 9, 9]).roll_back


def test_each_shards_replicas_are_judged_apart_and_named_by_rank() -> None:
    """parallel.shard=node, 3 nodes x 2 workers: ranks 0, 2, 4 hold shard 0 and 1, 3, 5 shard 1.
    Shards differ from each other by nature; only a shard's replicas are compared."""
    assert all(v.agree for v in judge_shards([5, 7, 5, 7, 5, 7], per_node=2))
    shard0, shard1 = judge_shards([5, 7, 5, 8, 5, 7], per_node=2)
    assert shard0.agree and shard1 == ReplicaVerdict(corrupt=(3,), source=1)
    assert judge_shards([5, 7, 6, 7], per_node=2)[0].roll_back  # two replicas of shard 0
    assert judge_shards([5, 9, 5, 5]) == [judge([5, 9, 5, 5])]  # whole replicas: judge's


def test_a_channels_last_replica_has_a_digest_a_fingerprint_and_a_bit_to_flip() -> None:
    """A ResNet in channels_last, as CUDA workers train it: its 1x1 convolutions are contiguous
    with a last stride of C, which a byte view refuses (the first GPU run's workers all failed
    at their first state digest). Equal replicas digest alike; a flipped bit changes both."""

    def replica() -> TrainState:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=4).to(memory_format=torch.channels_last)
        return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    one, two = replica(), replica()
    assert one.model.layer2[0].downsample[0].weight.stride()[-1] != 1  # the 1x1 case
    assert (one.digest(), one.fingerprint()) == (two.digest(), two.fingerprint())
    name = two.flip_bit(20)
    assert name == "layer4.0.conv2.weight"  # the first of the largest
    assert two.model.get_parameter(name).is_contiguous(memory_format=torch.channels_last)
    assert one.digest() != two.digest() and one.fingerprint() != two.fingerprint()
