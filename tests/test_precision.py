"""Mixed precision and reduced-precision gradient all-reduce.

The decisions (which precision, which layout, which backend reduces which dtype) are pure and
tested as such. What involves a process group runs on real two-rank gloo groups: the
GradScaler's state through a checkpoint across a resize, a skipped fp16 step on every rank, and
the DDP hook reducing in bf16 and fp16. One job trains in fp16 through a node kill.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from chaos.injectors import kill_node, node_with_rank
from chaos.invariants import (
    history_violations,
    lr_violations,
    replica_violations,
    sample_violations,
)
from elastic import config
from elastic.checkpoint import CheckpointManager
from elastic.communicator import Communicator
from elastic.config import REDUCIBLE, ConfigError, GradDtype, Precision, grad_dtype_problem
from elastic.control import Assignment
from elastic.ddp_hook import DDPHook
from elastic.events import read_events
from elastic.precision import (
    MixedPrecision,
    dtype_of,
    resolve_channels_last,
    resolve_precision,
)
from elastic.state import TrainState
from tests.conftest import Gate, launch, output, served_store
from tests.test_e2e import wait_event, wait_exit

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)  # only a name here: the tests that use it never touch a GPU
ONE_SHAPE = re.compile(r"^[a-z_.]+='[^']*': .+\. Fix: .+\.$")


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch, so that the ranks' gradients differ."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def assignment(rank: int, port: int) -> Assignment:
    return Assignment(
        round=1, rank=rank, world_size=2, store_host="127.0.0.1", store_port=port, formed_at=0
    )


def spawn_with_store(fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(rank, port, *args)`` on two ranks that enter a round through a Communicator;
    the TCPStore master is the agent's, so it lives here."""
    with served_store() as port:
        mp.spawn(fn, args=(port, *args), nprocs=2, join=True)


# --- decisions -----------------------------------------------------------------------------------


def test_on_the_cpu_auto_is_fp32_and_every_explicit_precision_is_kept() -> None:
    assert resolve_precision(Precision.auto, CPU) is Precision.fp32
    for p in (Precision.fp32, Precision.bf16, Precision.fp16):
        assert resolve_precision(p, CPU) is p


def test_on_a_gpu_auto_is_bf16_only_where_the_gpu_has_it() -> None:
    assert resolve_precision(Precision.auto, GPU, bf16_supported=True) is Precision.bf16
    assert resolve_precision(Precision.auto, GPU, bf16_supported=False) is Precision.fp32
    assert resolve_precision(Precision.fp16, GPU, bf16_supported=False) is Precision.fp16
    assert resolve_precision(Precision.bf16, GPU, bf16_supported=True) is Precision.bf16


def test_bf16_on_a_gpu_without_it_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_precision(Precision.bf16, GPU, bf16_supported=False)
    message = str(refused.value)
    assert ONE_SHAPE.match(message), message
    assert message.startswith("trainer.precision='bf16': ")
    assert "trainer.precision=fp16" in message


def test_channels_last_defaults_to_on_for_cuda_only_and_an_explicit_choice_wins() -> None:
    assert resolve_channels_last(None, GPU) is True
    assert resolve_channels_last(None, CPU) is False
    assert resolve_channels_last(True, CPU) is True
    assert resolve_channels_last(False, GPU) is False


def test_gloo_and_nccl_reduce_every_grad_dtype_and_an_unknown_backend_is_refused() -> None:
    for backend in ("gloo", "nccl"):
        for g in GradDtype:
            assert g in REDUCIBLE[backend]
            assert grad_dtype_problem(backend, g) is None
    message = grad_dtype_problem("mpi", GradDtype.bf16)
    assert message is not None and ONE_SHAPE.match(message), message
    assert message.startswith("comm.grad_dtype='bf16': ") and "comm.grad_dtype=fp32" in message


def test_auto_has_no_dtype_until_resolved() -> None:
    with pytest.raises(ValueError, match="resolve"):
        dtype_of(Precision.auto)


# --- one process ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [(Precision.fp32, torch.float32), (Precision.bf16, torch.bfloat16)],
)
def test_without_fp16_there_is_no_scaler_state_and_every_step_is_taken(
    precision: Precision, dtype: torch.dtype
) -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mixed = MixedPrecision(precision, CPU)
    x, y = batch(0)
    with mixed.autocast():
        out = model(x)
    assert out.dtype == dtype
    before = [p.detach().clone() for p in model.parameters()]
    mixed.backward(F.mse_loss(out.float(), y))
    assert mixed.step(opt)
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert mixed.tensors() == {}


def test_the_scaler_state_copied_into_a_fresh_one_is_the_state_it_scales_with() -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = MixedPrecision(Precision.fp16, CPU)
    x, y = batch(0)
    for factor, taken in ((float("inf"), False), (1.0, True)):  # moves the scale, then the tracker
        opt.zero_grad()
        with a.autocast():
            out = model(x)
        assert out.dtype == torch.float16
        a.backward(F.mse_loss(out.float(), y) * factor)
        assert a.step(opt) is taken
    assert a.scaler.get_scale() == 2.0**15 and a.scaler.state_dict()["_growth_tracker"] == 1

    b = MixedPrecision(Precision.fp16, CPU)
    assert b.tensors().keys() == {"scaler.scale", "scaler.growth_tracker"}
    for name, t in b.tensors().items():
        t.copy_(a.tensors()[name])
    assert b.scaler.state_dict() == a.scaler.state_dict()
    assert b.scaler.scale(torch.tensor(1.0)).item() == 2.0**15  # the live tensors, not copies


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.fp16])
def test_clipping_sees_the_unscaled_gradients_just_before_the_step(precision: Precision) -> None:
    """optim.clip_grad_norm runs on the true gradients: under fp16 the scaler unscales them
    first, so the same loss clips to the same norm in either precision."""
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a step that moves nothing
    mixed = MixedPrecision(precision, CPU)
    x, y = batch(0)
    with mixed.autocast():
        out = model(x)
    mixed.backward(F.mse_loss(out.float(), y))
    norms: list[float] = []

    def clip() -> None:
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item())

    assert mixed.step(opt, clip)
    assert len(norms) == 1 and norms[0] > 1e-3
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert after.item() == pytest.approx(1e-3, rel=1e-3)
    if precision is Precision.fp32:
        return
    plain = MixedPrecision(Precision.fp32, CPU)  # the same loss without a scaler
    model.zero_grad()
    plain.backward(F.mse_loss(model(x).float(), y))
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert norms[0] == pytest.approx(true_norm, rel=1e-2)  # fp16's forward, within its precision


# --- across a resize -----------------------------------------------------------------------------


def _checkpoint_main(rank: int, world: int, port: int, action: str, url: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = tiny_model(seed=1 if action == "save" else 99)
    mixed = MixedPrecision(Precision.fp16, CPU)
    tensors = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)).tensors()
    tensors |= mixed.tensors()
    manager = CheckpointManager(url, keep=1)
    if action == "save":
        mixed.tensors()["scaler.scale"].fill_(1024.0)
        mixed.tensors()["scaler.growth_tracker"].fill_(7)
        manager.save(3, tensors, {"progress": {"step": 3}})
    else:
        info = manager.restore(tensors)
        got = {
            "step": info.step if info else None,
            "scaler": mixed.scaler.state_dict(),
            "model": {k: v.tolist() for k, v in model.state_dict().items()},
        }
        Path(out, f"loaded{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown of torch: seconds, and nothing left to do


def test_the_scaler_state_saved_at_two_ranks_loads_at_one(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    for world, action in ((2, "save"), (1, "load")):
        with served_store() as port:
            args = (world, port, action, url, str(tmp_path))
            mp.spawn(_checkpoint_main, args=args, nprocs=world, join=True)
    got = json.loads((tmp_path / "loaded0.json").read_text())
    assert got["step"] == 3
    assert got["scaler"]["scale"] == 1024.0 and got["scaler"]["_growth_tracker"] == 7
    assert got["model"] == {k: v.tolist() for k, v in tiny_model(seed=1).state_dict().items()}


# --- two ranks through the communicator ----------------------------------------------------------


def _skip_main(rank: int, port: int, folder: str) -> None:
    """Step 1: rank 1's loss is inf; step 2: both losses are finite."""
    c = Communicator(CPU, timeout_s=20)
    h = DDPHook(c)
    c.enter(assignment(rank, port))
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mixed = MixedPrecision(Precision.fp16, CPU)
    ddp = h.wrap(model)
    x, y = batch(rank)
    seen = {"params": [[p.detach().flatten().tolist() for p in model.parameters()]]}
    for step in (1, 2):
        opt.zero_grad()
        h.begin_step()
        with mixed.autocast():
            out = ddp(x)
        loss = F.mse_loss(out.float(), y)
        mixed.backward(loss * float("inf") if (step, rank) == (1, 1) else loss)
        seen.setdefault("taken", []).append(mixed.step(opt))
        h.end_step()
        seen.setdefault("scale", []).append(mixed.scaler.get_scale())
        seen["params"].append([p.detach().flatten().tolist() for p in model.parameters()])
    Path(folder, f"skip{rank}.json").write_text(json.dumps(seen))
    c.close()
    os._exit(0)  # skip the interpreter's teardown of torch: seconds, and nothing left to do


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """Gradients are all-reduced before the scaler looks at them, so rank 1's inf is every
    rank's inf: both skip, keep their (equal) parameters and halve their scale; the next, finite
    step is taken on both and leaves them equal."""
    spawn_with_store(_skip_main, str(tmp_path))
    seen = [json.loads((tmp_path / f"skip{rank}.json").read_text()) for rank in (0, 1)]
    for s in seen:
        assert s["taken"] == [False, True]
        assert s["scale"] == [2.0**15, 2.0**15]  # halved, then one good step (no growth yet)
        initial, after_skip, after_step = s["params"]
        assert after_skip == initial
        assert after_step != initial
    assert seen[0]["params"] == seen[1]["params"]


def _hook_main(rank: int, port: int, grad_dtype: str, out: str) -> None:
    """One backward through the DDP hook in ``grad_dtype``; then a bare all-reduce of
    that dtype, with values the dtype holds exactly."""
    dtype = dtype_of(GradDtype(grad_dtype))
    c = Communicator(CPU, timeout_s=20)
    h = DDPHook(c, grad_dtype=dtype)
    c.enter(assignment(rank, port))
    model = tiny_model(0)
    ddp = h.wrap(model)
    x, y = batch(rank)
    h.begin_step()
    # Each rank's share of the mean, as the trainer's sample weights make it: the hook sums.
    (F.mse_loss(ddp(x), y) / dist.get_world_size()).backward()
    h.end_step()
    bare = torch.tensor([1.5, -2.25, 3.0, 0.125], dtype=dtype) * (rank + 1)
    dist.all_reduce(bare)
    torch.save(
        {"grads": [p.grad for p in model.parameters()], "bare": bare}, Path(out, f"hook{rank}.pt")
    )
    c.close()
    os._exit(0)  # skip the interpreter's teardown of torch: seconds, and nothing left to do


def fp32_mean_grads() -> list[torch.Tensor]:
    """What DDP in fp32 would give: the mean over the two ranks' batches, computed here."""
    per_rank = []
    for rank in (0, 1):
        model = tiny_model(0)
        x, y = batch(rank)
        F.mse_loss(model(x), y).backward()
        per_rank.append([p.grad for p in model.parameters()])
    return [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("grad_dtype", list(GradDtype))
def test_gradients_reduced_in_a_smaller_dtype_are_the_fp32_mean_within_its_precision(
    tmp_path: Path, grad_dtype: GradDtype
) -> None:
    dtype = dtype_of(grad_dtype)
    assert grad_dtype in REDUCIBLE["gloo"]  # and the ranks below prove it
    spawn_with_store(_hook_main, str(grad_dtype), str(tmp_path))
    got = [torch.load(tmp_path / f"hook{rank}.pt") for rank in (0, 1)]

    assert got[0]["bare"].dtype == dtype
    assert got[0]["bare"].tolist() == [4.5, -6.75, 9.0, 0.375]
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for mine, theirs, exact in zip(
        got[0]["grads"], got[1]["grads"], fp32_mean_grads(), strict=True
    ):
        assert mine.dtype == torch.float32
        assert torch.equal(mine, theirs)  # identical replicas, bit for bit
        assert torch.equal(mine.to(dtype).float(), mine)  # it did travel in ``dtype``
        scale = exact.abs().max().item()
        torch.testing.assert_close(mine, exact, rtol=tolerance, atol=tolerance * scale)


# --- end to end ----------------------------------------------------------------------------------

# fp16 on a CPU is slow (oneDNN's reference kernel for a convolution's fp16 weight gradient:
# chaos/convergence.py; 2.5 s a step here), so this job trains the smallest crops a ResNet is
# allowed, one epoch of half the fast job's images: 8 steps at world size 2.
FP16_SAMPLES = 120
FP16_JOB = [
    f"data.generate.images_per_class={FP16_SAMPLES // 10}",
    "trainer.precision=fp16",
    "comm.grad_dtype=bf16",
    "optim=akiba",
    "optim.slow_start_epochs=0",
    "data.generate.image_size=16",
    "data.crop_size=16",
    "trainer.epochs=1",
    "trainer.record_samples=true",
    "rendezvous.lease_ttl_s=3",
]


def test_fp16_with_akiba_and_bf16_gradients_trains_through_a_node_kill(
    tmp_path: Path, gate: Gate
) -> None:
    """The precision and update of a 32k recipe (recipe=resnet50_32k_akiba: fp16, RMSprop warm-up,
    a reduced-precision all-reduce) end to end: a node SIGKILLed mid-run, the survivor trains on
    with its loss scale, and every invariant holds. (The job waits at the gate after step 5 of
    its 8 until the node is killed: a fast machine would train them all first.)"""
    run_dir = tmp_path / "run"
    gate.hold_after(5)
    proc = launch(run_dir, *FP16_JOB, env=gate.env())
    wait_event(run_dir, proc, lambda e: e["event"] == "step" and e["step"] >= 5)
    victim = next(f"node{i}" for i in range(2) if f"node{i}" != node_with_rank(run_dir, 0))
    fault = kill_node(run_dir, victim)
    gate.open()
    assert wait_exit(proc, run_dir) == 0, output(run_dir)[-3000:]

    events = read_events(run_dir)
    cfg = config.load(run_dir / "config.yaml")
    assert lr_violations(events, cfg, FP16_SAMPLES) == []
    assert sample_violations(events, FP16_SAMPLES, FP16_SAMPLES) == []
    assert replica_violations(events) == []
    assert history_violations(events) == []
    steps = [e for e in events if e["event"] == "step"]
    after = [e for e in steps if e["ts"] > fault]
    assert after and all(e["world_size"] == 1 for e in after)
    # Every step ran under the GradScaler (fp16 autocast), and its scale is a power of two it
    # reached by halving (overflowed steps) or doubling, never reset by the recovery to 2^16
    # unless it was there already.
    scales = [e["loss_scale"] for e in steps]
    assert all(s > 0 and float(s).is_integer() and (int(s) & (int(s) - 1)) == 0 for s in scales)
    before = [e["loss_scale"] for e in steps if e["ts"] < fault]
    assert after[0]["loss_scale"] in (before[-1], before[-1] / 2, before[-1] * 2), scales
    done = next(e for e in events if e["event"] == "training_done")
    assert done["samples_seen"] == FP16_SAMPLES
