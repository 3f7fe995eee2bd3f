"""HSDP (shard within a node, replicate across nodes) with real gloo process groups: a step
equal to one process's, a lost node re-meshed in place, a joining node synced from a survivor,
and the runtime's checkpoints of the sharded state loaded at other nodes x workers shapes."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from elastic.abortable_group import RoundMesh
from elastic.async_checkpoint import BackgroundSaver
from elastic.checkpoint import CheckpointManager
from elastic.events import EventLog
from elastic.jobs.tiny_lm import TinyLM
from elastic.sharding import (
    build_mesh,
    check_layouts,
    gradient_norm,
    remesh,
    shard,
    take_shards,
)
from elastic.state import Progress, TrainState, sync_state
from elastic.step_timing import StepTiming

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

VOCAB, CONTEXT, BATCH = 32, 8, 8  # BATCH: the global batch, split evenly over the ranks
WRAP = (nn.TransformerEncoderLayer,)
CPU = torch.device("cpu")
GROUP_TIMEOUT = timedelta(seconds=60)  # bounds every collective and every rendezvous
RUN_DEADLINE_S = 150.0  # bounds a whole multi-process run
SLOW_S = 1.0  # how much slower a slow rank's step is
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered, on rank 0 only


def make_model() -> nn.Module:
    return TinyLM(vocab=VOCAB, context=CONTEXT, dim=16, heads=2, layers=2)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # eps well above rounding: the attention keys' bias has a zero gradient but for rounding,
    # which the default eps would turn into a whole step of either sign, unlike in one process.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


def backward(model: nn.Module, step: int, part: int, parts: int) -> None:
    """The loss of this rank's ``part`` of the step's global batch, backpropagated."""
    inputs, targets = (t.chunk(parts)[part] for t in global_batch(step))
    F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)).backward()


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, part: int, parts: int
) -> None:
    backward(model, step, part, parts)
    optimizer.step()
    optimizer.zero_grad()


def sharded(mesh: Any, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # every rank builds the same full model, then keeps its shard
    model = shard(make_model(), mesh, WRAP)
    return model, make_optimizer(model)


def join(tmp: str, name: str, rank: int, world: int) -> None:
    """Join round ``name``: a fresh default group on a fresh store, as each runtime round."""
    store = dist.FileStore(str(Path(tmp, name)), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every weight and optimizer tensor gathered whole (a collective; empty but on rank 0)."""
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL).get("state"),
    }


def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of this rank's local shards of the weights and the optimizer state."""
    out = {}
    for name, param in model.named_parameters():
        out[f"model.{name}"] = param.to_local().detach().clone()
        for key, value in optimizer.state[param].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            out[f"optim.{name}.{key}"] = local.clone()
    return out


def reference(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process training the whole model on each whole global batch."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(steps):
        train(model, optimizer, step, 0, 1)
    return model, optimizer


def assert_like_reference(got: dict[str, Any], steps: int) -> None:
    """``got`` (:func:`full_state`) holds the weights and AdamW state of :func:`reference`."""
    want, optimizer = reference(steps)
    torch.testing.assert_close(got["model"], want.state_dict(), rtol=1e-5, atol=1e-6)
    want_optim = get_optimizer_state_dict(want, optimizer)["state"]
    torch.testing.assert_close(got["optim"], want_optim, rtol=1e-4, atol=1e-8)


def assert_whole_batch_gradients(
    grads: dict[str, torch.Tensor], rtol: float, atol: float
) -> nn.Module:
    """``grads`` (gathered whole) are those of one process on step 0's whole batch; that model."""
    torch.manual_seed(0)
    model = make_model()
    backward(model, 0, 0, 1)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=rtol, atol=atol)
    return model


def run_ranks(fn: Callable[[int, int, str], None], world: int, tmp: Path) -> None:
    """Run ``fn(rank, world, tmp)`` in ``world`` fresh processes; fail on error or timeout.

    They are forked from multiprocessing's fork server, a clean process that imports torch, and
    torch._dynamo (which a DeviceMesh's first sub-mesh imports), once for every test: 4 ranks
    importing them at once took 11 s of the 2 cores each time."""
    mp.set_forkserver_preload(["torch._dynamo", __name__])  # only read as the server starts
    context = mp.start_processes(
        fn, args=(world, str(tmp)), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + RUN_DEADLINE_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish within {RUN_DEADLINE_S} s")


def _hsdp_step(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    join(tmp, "round1", rank, world)
    mesh = build_mesh(2, 2, "cpu", "gloo")
    model, optimizer = sharded(mesh, seed=0)
    backward(model, 0, rank, world)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    norm = gradient_norm(list(model.parameters()), mesh)  # over this rank's node
    optimizer.step()
    state = full_state(model, optimizer)
    timed = slow_step(model, mesh, rank, world)
    if rank == 0:
        torch.save({"grads": grads, "norm": norm, "timed": timed, **state}, Path(tmp, "hsdp.pt"))
    dist.destroy_process_group()


def slow_step(model: nn.Module, mesh: Any, rank: int, world: int) -> list[list[float]]:
    """A backward in which rank 3 is slow by SLOW_S, timed as the trainer times a sharded step:
    every rank's [compute, blocked on the mesh] seconds."""
    round_mesh = RoundMesh()
    round_mesh.adopt(mesh)
    timing = StepTiming(CPU, round_mesh.blocked_s)
    blocked_before = round_mesh.blocked_s()
    timing.begin()
    if rank == 3:
        time.sleep(SLOW_S)  # a slow rank, not synchronisation: its peers wait in collectives
    backward(model, 1, rank, world)
    timing.end()
    mine = torch.tensor([timing.last_compute_s, round_mesh.blocked_s() - blocked_before])
    every = [torch.zeros(2, dtype=mine.dtype) for _ in range(world)]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def test_hsdp_step_equals_one_process_step(tmp_path: Path) -> None:
    """At 2 nodes x 2 workers, each rank on a quarter of the batch, the gradients are the whole
    batch's (fully_shard averages over all 4 ranks, the replicate dim included), their norm read
    from a node's shards is theirs, and the step leaves the weights and AdamW state of one
    process that trained on the whole batch. A slow rank's next step is its compute, and not
    its peers'."""
    run_ranks(_hsdp_step, 4, tmp_path)
    got = torch.load(tmp_path / "hsdp.pt", weights_only=True)
    model = assert_whole_batch_gradients(got["grads"], rtol=1e-5, atol=1e-7)
    # The clip's and the finiteness check's norm, from the shards: the whole gradients' norm.
    whole = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(got["norm"], whole, rtol=1e-5, atol=0)
    assert_like_reference(got, 1)
    # The straggler comparison's compute time: rank 3's own slowness is its compute, and its
    # peers' wait for it (in the gathers of its node, the replicas' all-reduce) is not theirs.
    compute, blocked = zip(*got["timed"], strict=True)
    assert compute[3] >= SLOW_S, got["timed"]
    assert max(compute[:3]) < SLOW_S / 2 <= min(blocked[:3]), got["timed"]


def _hsdp_on_cuda(rank: int, world: int, tmp: str) -> None:
    torch.cuda.set_device(0)  # every rank on the one GPU: gloo, unlike NCCL, takes them
    join(tmp, "round1", rank, world)
    mesh = build_mesh(1, world, "cuda", "gloo")  # abortable gloo groups on CUDA tensors
    torch.manual_seed(0)
    model = shard(make_model().cuda(), mesh, WRAP)
    optimizer = make_optimizer(model)
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(8):  # the stream busy as the collectives' results are copied back
        busy = (busy @ busy).tanh_()
    inputs, targets = (t.chunk(world)[rank].cuda() for t in global_batch(0))
    F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    grads = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}
    optimizer.step()
    state = full_state(model, optimizer)
    if rank == 0:
        torch.save({"grads": grads, **state}, Path(tmp, "cuda.pt"))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_sharded_step_on_cuda_over_abortable_gloo_groups(tmp_path: Path) -> None:
    """comm.backend=gloo on CUDA, the test aid for ranks sharing one GPU: 2 ranks shard the
    model over an abortable gloo mesh on CUDA tensors (all-gathers, reduce-scatters copied to
    the host and back), and the gradients and the step are one process's on the whole batch."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    run_ranks(_hsdp_on_cuda, 2, tmp_path)
    got = torch.load(tmp_path / "cuda.pt", weights_only=True)
    assert_whole_batch_gradients(got["grads"], rtol=1e-4, atol=1e-6)
    want, _ = reference(1)
    torch.testing.assert_close(got["model"], want.state_dict(), rtol=1e-4, atol=1e-5)


def _lost_node(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    join(tmp, "round1", rank, world)
    mesh = build_mesh(2, 2, "cpu", "gloo")
    model, optimizer = sharded(mesh, seed=0)
    train(model, optimizer, 0, rank, world)
    dist.destroy_process_group()  # node 1 (ranks 2 and 3) is lost: the round ends
    if rank >= 2:
        return
    before = local_tensors(model, optimizer)
    shards = take_shards(model, optimizer, mesh)  # with no group left: it is local
    del model, optimizer
    join(tmp, "round2", rank, 2)
    model, optimizer = remesh(
        shards, build_mesh(1, 2, "cpu", "gloo"), make_model, make_optimizer, WRAP
    )
    after = local_tensors(model, optimizer)
    train(model, optimizer, 1, rank, 2)
    state = full_state(model, optimizer)
    torch.save({"before": before, "after": after}, Path(tmp, f"locals{rank}.pt"))
    if rank == 0:
        torch.save(state, Path(tmp, "trained.pt"))
    dist.destroy_process_group()


def test_lost_node_is_remeshed_in_place(tmp_path: Path) -> None:
    """After one step at 2x2, node 1 is lost; ranks 0 and 1 form a new world of 2, re-mesh at
    1x2 keeping every local shard bit for bit, and their next step equals one process's."""
    run_ranks(_lost_node, 4, tmp_path)
    for rank in (0, 1):
        found = torch.load(tmp_path / f"locals{rank}.pt", weights_only=True)
        assert found["before"].keys() == found["after"].keys()
        assert any(k.endswith(".exp_avg_sq") for k in found["after"])
        for key, tensor in found["before"].items():
            assert torch.equal(found["after"][key], tensor), key
    assert_like_reference(torch.load(tmp_path / "trained.pt", weights_only=True), 2)


def _rejoin(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    if rank < 2:  # node 0 trains alone for a step, while node 1 is still to come
        join(tmp, "round1", rank, 2)
        mesh = build_mesh(1, 2, "cpu", "gloo")
        model, optimizer = sharded(mesh, seed=0)
        train(model, optimizer, 0, rank, 2)
        shards = take_shards(model, optimizer, mesh)
        dist.destroy_process_group()
        join(tmp, "round2", rank, world)
        mesh = build_mesh(2, 2, "cpu", "gloo")
        model, optimizer = remesh(shards, mesh, make_model, make_optimizer, WRAP)
    else:  # the joining node: other weights, no optimizer state, another LR
        join(tmp, "round2", rank, world)
        mesh = build_mesh(2, 2, "cpu", "gloo")
        model, optimizer = sharded(mesh, seed=1)
        optimizer.param_groups[0]["lr"] = 0.5
    # As a round's entry syncs: node 0 holds the newest state, node 1 none; over the replicas.
    held = (Progress(step=1), 1) if rank < 2 else (None, -1)
    replicas = mesh.get_group("replicate")
    tensors = TrainState(model, optimizer).tensors()
    check_layouts(tensors, replicas, CPU)
    progress, source = sync_state(tensors, *held, CPU, replicas)
    assert progress is not None and progress.step == 1 and source == 0
    synced = {"tensors": local_tensors(model, optimizer), "lr": optimizer.param_groups[0]["lr"]}
    for group in optimizer.param_groups:  # the trainer sets the LR each step, from its progress
        group["lr"] = 1e-2
    torch.save(synced, Path(tmp, f"synced{rank}.pt"))
    train(model, optimizer, 1, rank, world)
    state = full_state(model, optimizer)
    if rank == 0:
        torch.save(state, Path(tmp, "trained.pt"))
    dist.destroy_process_group()


def test_joining_node_takes_the_survivors_shards(tmp_path: Path) -> None:
    """Node 0 trains a step at 1x2; node 1 joins (2x2): node 0 re-meshes in place and the
    state sync gives node 1's worker k worker k's weights and AdamW state bit for bit (not its
    LR, which the trainer sets each step); the four then train a step equal to one process's."""
    run_ranks(_rejoin, 4, tmp_path)
    synced = [torch.load(tmp_path / f"synced{rank}.pt", weights_only=True) for rank in range(4)]
    for source, joiner in ((0, 2), (1, 3)):
        assert (synced[source]["lr"], synced[joiner]["lr"]) == (1e-2, 0.5)  # settings stay
        assert synced[joiner]["tensors"].keys() == synced[source]["tensors"].keys()
        for key, tensor in synced[source]["tensors"].items():
            assert torch.equal(synced[joiner]["tensors"][key], tensor), key
    got = torch.load(tmp_path / "trained.pt", weights_only=True)
    want, _ = reference(2)
    torch.testing.assert_close(got["model"], want.state_dict(), rtol=1e-5, atol=1e-6)


def _checkpoint(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    url = f"file://{tmp}/ckpt"
    join(tmp, "round1", rank, world)
    model, optimizer = sharded(build_mesh(2, 2, "cpu", "gloo"), seed=0)
    train(model, optimizer, 0, rank, world)
    # As the trainer saves: the state's tensors (DTensors here), staged and written in the
    # background on a group beside the training group, then committed by rank 0.
    tensors = TrainState(model, optimizer).tensors()
    saver = BackgroundSaver(EventLog(Path(tmp), f"rank{rank}"))
    saver.start(CheckpointManager(url, keep=2), 1, tensors, {}, dist.new_group(), 1, lambda: False)
    committed = saver.wait(lambda: False)
    state = full_state(model, optimizer)
    if rank == 0:
        assert committed == 1, "rank 0 commits the save"
        torch.save(state, Path(tmp, "saved.pt"))
    dist.destroy_process_group()
    for nodes, per_node in ((1, 2), (3, 1)):  # then 1 node x 2 workers, then 3 x 1
        if rank >= nodes * per_node:
            continue
        join(tmp, f"{nodes}x{per_node}", rank, nodes * per_node)
        model, optimizer = sharded(build_mesh(nodes, per_node, "cpu", "gloo"), seed=1)
        info = CheckpointManager(url, keep=2).restore(TrainState(model, optimizer).tensors())
        assert info is not None and info.step == 1
        state = full_state(model, optimizer)
        if rank == 0:
            torch.save(state, Path(tmp, f"loaded{nodes}x{per_node}.pt"))
        dist.destroy_process_group()


def test_checkpoint_loads_at_other_shapes(tmp_path: Path) -> None:
    """The runtime's checkpoint of a sharded state (the background save, verified and committed
    as always) saved at 2 nodes x 2 workers loads at 1x2 and at 3x1 into models built from
    other weights: every weight and AdamW tensor equals the saved one exactly."""
    run_ranks(_checkpoint, 4, tmp_path)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    torch.manual_seed(1)  # the weights the loading ranks built, which the load replaces
    assert not torch.equal(make_model().state_dict()["head.weight"], saved["model"]["head.weight"])
    for shape in ("1x2", "3x1"):
        loaded = torch.load(tmp_path / f"loaded{shape}.pt", weights_only=True)
        torch.testing.assert_close(loaded, saved, rtol=0, atol=0)


def _mismatched(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    join(tmp, "round1", rank, world)
    mesh = build_mesh(2, 1, "cpu", "gloo")
    torch.manual_seed(0)
    model = shard(make_model(), mesh, WRAP)
    optimizer = (
        make_optimizer(model) if rank == 0 else torch.optim.SGD(model.parameters(), momentum=0.9)
    )
    try:
        check_layouts(TrainState(model, optimizer).tensors(), mesh.get_group("replicate"), CPU)
    except ValueError as exc:
        Path(tmp, f"refused{rank}").write_text(str(exc))
    dist.destroy_process_group()


def test_a_replica_of_another_layout_is_refused_on_every_rank(tmp_path: Path) -> None:
    """A joiner built with another optimizer (SGD's momentum against AdamW's two moments) is
    refused by every replica alike, instead of receiving tensors of other sizes or hanging."""
    run_ranks(_mismatched, 2, tmp_path)
    for rank in (0, 1):
        assert (
            "every node must build the same model and optimizer"
            in (tmp_path / f"refused{rank}").read_text()
        )
