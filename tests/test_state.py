"""The state sync at a round's start: every rank of the round ends with the same progress record
and tensors, also when the ranks differ only in what a broken round let each of them finish; and
the replica checks of a sharded state."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elastic.config import OptimConfig, OptimizerName
from elastic.optim import build_optimizer
from elastic.replicas import checksum
from elastic.state import Progress, TrainState, pick_source, sync_key, sync_state
from tests.conftest import served_store

AT_STEP_11 = Progress(step=11, samples_seen=240, evaluated=0, checkpoint_every=5)


def test_a_rank_that_completed_the_cut_evaluation_holds_the_newer_state() -> None:
    done = replace(AT_STEP_11, evaluated=1)
    assert sync_key(done, 3) > sync_key(AT_STEP_11, 3)
    assert sync_key(AT_STEP_11, 4) > sync_key(done, 3)  # a later round first, as before
    assert sync_key(replace(AT_STEP_11), 3) == sync_key(AT_STEP_11, 3)  # equal records agree
    # A record that differs elsewhere (a save the break cut) is no longer "the same state".
    assert sync_key(replace(AT_STEP_11, checkpoint_every=7), 3) != sync_key(AT_STEP_11, 3)
    assert sync_key(None, -1) < sync_key(AT_STEP_11, 0)


def test_the_source_is_the_newest_state_a_whole_node_holds() -> None:
    """Whole replicas: the first rank of the newest key. Sharded (2 workers a node): a node
    whose worker restarted holds half a state and cannot be the source, however new."""
    old, new, none = (3, 11, 0, 7), (4, 12, 0, 9), (-1, -1, -1, -1)
    assert pick_source([old, new, new]) == 1
    assert pick_source([none, none]) == -1
    assert pick_source([new, none, old, old], per_node=2) == 2  # node 0 lost a worker
    assert pick_source([new, new, old, old], per_node=2) == 0
    assert pick_source([new, none, none, old], per_node=2) == -1  # no node whole: a checkpoint


def _rank_main(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    # Rank 1 completed the evaluation (its batch-norm statistics averaged); rank 0's was cut.
    progress = replace(AT_STEP_11, evaluated=rank)
    tensors = {"bn.running_mean": torch.full((4,), 1.0 + rank), "w": torch.ones(3)}
    synced, source = sync_state(tensors, progress, 3, torch.device("cpu"))
    assert synced is not None
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "source": source,
                "evaluated": synced.evaluated,
                "running_mean": tensors["bn.running_mean"].tolist(),
            }
        )
    )
    dist.destroy_process_group()


def test_ranks_at_the_same_step_that_differ_in_an_evaluation_all_take_the_one_that_finished_it(
    tmp_path: Path,
) -> None:
    """Before, ranks at the same round and step sent nothing and each kept its own record: the
    one whose evaluation was cut evaluated again while the other trained, their collectives
    crossed and gloo aborted the worker (issue 47's unexplained strike)."""
    with served_store() as port:
        mp.spawn(_rank_main, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"source": 1, "evaluated": 1, "running_mean": [2.0] * 4}, (rank, seen)


def test_a_sharded_states_digest_fingerprint_and_checksum_read_this_ranks_shards() -> None:
    """Under parallel.shard=node the parameters and AdamW's state are DTensors: the replica
    checks read each one's local shard (here, on a mesh of one rank, the whole tensor), never
    the DTensor as a whole, which would gather it from the other ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        states = []
        for sharded in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            if sharded:
                fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            optimizer = build_optimizer(model, OptimConfig(name=OptimizerName.adamw))
            states.append(TrainState(model, optimizer))
        plain, shards = states
        assert isinstance(shards.tensors()["model.0.weight"], DTensor)
        assert isinstance(shards.tensors()["optim.0.weight.exp_avg"], DTensor)
        assert shards.digest() == plain.digest()
        assert shards.fingerprint() == plain.fingerprint()
        names = sorted(plain.replicated())
        assert checksum(shards.replicated(), names) == checksum(plain.replicated(), names)
        shards.flip_bit(3)
        assert shards.digest() != plain.digest()
    finally:
        dist.destroy_process_group()
