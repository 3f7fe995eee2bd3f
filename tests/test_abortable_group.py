"""HSDP over abortable gloo groups (:mod:`elastic.abortable_group`), with real processes: a step
equals the plain groups' step bit for bit, and a frozen rank (SIGSTOP) no longer holds its peers'
FSDP2 collectives once they are aborted from a thread."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic.abortable_group import RoundMesh, build_abortable_mesh, cuda_device, mesh_groups
from elastic.round_end import RoundAborted
from elastic.sharding import MESH_DIMS, shard
from tests.test_sharding import WRAP, join, local_tensors, make_model, make_optimizer, train

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

WORLD, FROZEN = 4, 3  # 2 nodes x 2 workers; rank 3 freezes after the first step
FAULT_S = 1.0  # how long the freeze goes unnoticed: the survivors' abort comes this much later
ABORT_BOUND_S = 1.0  # how soon after the abort a blocked step must raise
RUN_DEADLINE_S = 60.0  # bounds each wait of the run, and the whole run


def _signals(tmp: str) -> dist.FileStore:
    """The store the survivors and the test tell each other on (the ranks' groups cannot)."""
    return dist.FileStore(str(Path(tmp, "signals")), WORLD)


def _sharded(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shard(make_model(), mesh, WRAP)
    return model, make_optimizer(model)


def _freeze(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    join(tmp, "round1", rank, world)
    plain_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)  # gloo's own groups
    plain = _sharded(plain_mesh)
    mesh = build_abortable_mesh((2, 2), MESH_DIMS)
    with pytest.raises(TypeError, match="mesh dim 0 is a ProcessGroup"):
        mesh_groups(plain_mesh)
    model, optimizer = _sharded(mesh)
    train(*plain, 0, rank, world)
    train(model, optimizer, 0, rank, world)
    torch.save(
        {
            "plain": local_tensors(*plain),
            "abortable": local_tensors(model, optimizer),
            # DTensor's own collectives (C++ functional ones) reach the group too
            "gathered": {n: p.full_tensor() for n, p in model.named_parameters()},
            "gathered_plain": {n: p.full_tensor() for n, p in plain[0].named_parameters()},
            "coalesced": _coalesced(mesh.get_group("shard"), rank),
        },
        Path(tmp, f"step{rank}.pt"),
    )
    if rank == FROZEN:
        os.kill(os.getpid(), signal.SIGSTOP)  # never enters the next step; the test kills it
        return
    signals = _signals(tmp)
    found: dict[str, object] = {}
    try:
        _aborted_step(mesh, model, optimizer, rank, world, found)
    finally:  # told even on an error, so that the test does not wait out its deadline
        torch.save(found, Path(tmp, f"aborted{rank}.pt"))
        signals.set(f"raised{rank}", "1")
    # A survivor that left now would close its sockets, and one still blocked would then fail
    # from that instead of from its abort: each leaves once all have raised and the frozen rank
    # is gone, when the abandoned works fail too (what a reaper waits for).
    signals.wait(["killed"], timedelta(seconds=RUN_DEADLINE_S))
    for group in mesh_groups(mesh):
        for work in group.in_flight():
            work.wait()  # ends when the backend's does: here, as the killed peer's sockets close
    assert not any(group.in_flight() for group in mesh_groups(mesh))
    dist.destroy_process_group()


def _coalesced(group: dist.ProcessGroup, rank: int) -> list[torch.Tensor]:
    """The coalesced all-gather and reduce-scatter, which gloo's binding lacks (PER_PAIR), of
    two tensors each on a node's shard group."""
    gathered = [torch.empty(4), torch.empty(2)]
    group.allgather_into_tensor_coalesced(
        gathered, [torch.full((2,), float(rank)), torch.full((1,), 10.0 + rank)]
    ).wait()
    reduced = [torch.empty(2), torch.empty(1)]
    group.reduce_scatter_tensor_coalesced(
        reduced, [torch.arange(4.0) + rank, torch.arange(2.0) + 10 * rank]
    ).wait()
    return gathered + reduced


def _aborted_step(
    mesh: DeviceMesh,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world: int,
    found: dict[str, object],
) -> None:
    """Train a step that the frozen rank holds, aborted from a thread after :data:`FAULT_S`."""
    abort_at: list[float] = []
    groups = RoundMesh()  # as the communicator keeps a round's mesh
    groups.adopt(mesh)

    def agent() -> None:
        time.sleep(FAULT_S)  # the fault's duration, not a synchronisation
        abort_at.append(time.monotonic())
        groups.abort("rank 3 froze")

    thread = threading.Thread(target=agent)
    started = time.monotonic()
    thread.start()
    try:
        train(model, optimizer, 1, rank, world)
    except RoundAborted as exc:
        found["error"] = str(exc)
    else:
        found["error"] = "the step completed"
    raised = time.monotonic()
    thread.join(RUN_DEADLINE_S)
    found["blocked_s"] = raised - started
    found["after_abort_s"] = raised - abort_at[0]
    found["in_flight"] = sum(len(g.in_flight()) for g in mesh_groups(mesh))
    try:
        dist.barrier(group=mesh.get_group("shard"))
    except RoundAborted as exc:
        found["later"] = str(exc)


def test_frozen_rank_no_longer_holds_fsdp_collectives(tmp_path: Path) -> None:
    """At 2 nodes x 2 workers, a step over abortable groups equals the plain groups' bit for bit.
    Then rank 3 is SIGSTOPped: rank 2 blocks in the forward all-gather (shard dim), ranks 0 and 1
    in the backward all-reduce (replicate dim); each raises RoundAborted within a second of its
    abort from a thread, the gloo works left in flight, and later collectives are refused. The
    coalesced collectives gloo's binding lacks run per tensor pair."""
    mp.set_forkserver_preload(["torch._dynamo", "tests.test_sharding"])
    context = mp.start_processes(
        _freeze, args=(WORLD, str(tmp_path)), nprocs=WORLD, join=False, start_method="forkserver"
    )
    try:
        survivors = [r for r in range(WORLD) if r != FROZEN]
        signals = _signals(str(tmp_path))
        signals.wait([f"raised{r}" for r in survivors], timedelta(seconds=RUN_DEADLINE_S))
        context.processes[FROZEN].kill()  # SIGKILL ends a stopped process too
        signals.set("killed", "1")
        deadline = time.monotonic() + RUN_DEADLINE_S
        for rank in survivors:
            context.processes[rank].join(max(0.0, deadline - time.monotonic()))
            assert context.processes[rank].exitcode == 0, f"rank {rank} failed or hung"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    for rank in range(WORLD):
        step = torch.load(tmp_path / f"step{rank}.pt", weights_only=True)
        assert step["plain"].keys() == step["abortable"].keys()
        for key, tensor in step["plain"].items():
            assert torch.equal(step["abortable"][key], tensor), (rank, key)
        for name, tensor in step["gathered_plain"].items():
            assert torch.equal(step["gathered"][name], tensor), (rank, name)
        first, k = rank - rank % 2, rank % 2  # the node's first rank; this rank's share
        gathered_a, gathered_b, reduced_a, reduced_b = step["coalesced"]
        assert gathered_a.tolist() == [first, first, first + 1, first + 1]
        assert gathered_b.tolist() == [10 + first, 11 + first]
        assert reduced_a.tolist() == [2 * i + 2 * first + 1 for i in (2 * k, 2 * k + 1)]
        assert reduced_b.tolist() == [2 * k + 10 * (2 * first + 1)]
    for rank in survivors:
        found = torch.load(tmp_path / f"aborted{rank}.pt", weights_only=True)
        assert found["error"].startswith("collective abandoned: rank 3 froze"), found
        assert found["blocked_s"] >= FAULT_S, found  # held by the frozen rank until the abort
        assert found["after_abort_s"] < ABORT_BOUND_S, found
        assert found["in_flight"] >= 1, found  # the gloo work itself still waits
        assert "on an aborted group" in found["later"], found


def test_a_collective_is_on_cuda_by_its_first_tensor_found_in_its_arguments() -> None:
    """What decides whether a collective's caller waits for a device event (gloo on CUDA)."""
    cpu = torch.zeros(2)
    assert cuda_device((cpu, cpu)) is None
    assert cuda_device(([[cpu]], [cpu], object())) is None
    assert cuda_device((object(), [])) is None  # a barrier: no tensor
    meta = torch.zeros(2, device="meta")
    assert cuda_device(([meta],)) is None
    if torch.cuda.is_available():
        gpu = torch.zeros(2, device="cuda")
        assert cuda_device(([[gpu]], [gpu])) == gpu.device
        assert cuda_device((cpu, gpu)) is None  # the first tensor decides
