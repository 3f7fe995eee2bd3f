"""Silent corruption across replicas, found by comparing a checksum while the job trains.

The ranks compare a checksum of their parameters and optimizer state every
``health.replica_check_every`` steps.

Data-parallel replicas are equal bit for bit after every step. A bit flipped in one replica's
memory (a GPU's or host's silent data corruption) changes no loss visibly and persists, and its
gradients keep leaking into everyone's update. The checksum is exact integer arithmetic over the
tensors' bytes on their own device (a sum of their words per tensor, each tensor weighted by its
place), so equal replicas agree whatever the reduction order and one flipped bit changes it. One
all-reduce of two integers tells whether all ranks agree; only when they do not, an all-gather of
one integer per rank finds the minority (:func:`judge`, pure). A minority takes the majority's
state from one of its ranks, as a rejoining node does, and its node gets a strike; without a
majority (two replicas, or a tie) every rank loads the newest checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from elastic.state import local

WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """An int64 checksum of the named tensors' bytes (a DTensor's local shard), a scalar.

    It covers ``tensors[n]`` for ``n`` in ``names``, in that order. It is equal for equal bytes,
    and changed by any single flipped bit."""
    total = None
    for place, name in enumerate(names, 1):
        t = local(tensors[name]).detach()
        words = t.contiguous().view(WORD[t.element_size()]).reshape(-1)
        part = words.sum(dtype=torch.int64) * (2 * place + 1)  # wraps, alike on every rank
        total = part if total is None else total + part
    assert total is not None, "no tensor to check"
    return total


@dataclass(frozen=True)
class ReplicaVerdict:
    """What to do about the replicas: repair some ranks, roll every rank back, or nothing.

    ``corrupt``: the ranks to repair from ``source`` (a rank of the majority). ``roll_back``: no
    majority, every rank loads the newest checkpoint."""

    corrupt: tuple[int, ...] = ()
    source: int = -1
    roll_back: bool = False

    @property
    def agree(self) -> bool:
        return not self.corrupt and not self.roll_back


def judge(sums: Sequence[int]) -> ReplicaVerdict:
    """The verdict on the ranks' checksums.

    They are all equal, or a strict majority and the others, or there is no majority."""
    counts = Counter(sums)
    if len(counts) == 1:
        return ReplicaVerdict()
    value, votes = counts.most_common(1)[0]
    if 2 * votes <= len(sums):
        return ReplicaVerdict(roll_back=True)
    corrupt = tuple(rank for rank, s in enumerate(sums) if s != value)
    return ReplicaVerdict(corrupt=corrupt, source=sums.index(value))


def judge_shards(sums: Sequence[int], per_node: int = 1) -> list[ReplicaVerdict]:
    """The verdict on each shard's replicas, its ranks named as in ``sums`` (every rank's).

    Under ``parallel.shard=node`` rank ``r`` holds shard ``r % per_node``, and only the workers
    of one shard hold equal state; with whole replicas (``per_node`` 1) this is :func:`judge`."""
    verdicts = []
    for k in range(per_node):
        v = judge(sums[k::per_node])
        ranks = tuple(i * per_node + k for i in v.corrupt)
        source = v.source * per_node + k if v.source >= 0 else -1
        verdicts.append(ReplicaVerdict(ranks, source, v.roll_back))
    return verdicts
