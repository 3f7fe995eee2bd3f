"""The CUDA paths of elastic/ and launcher/, on a real GPU (``pytest -m gpu``).

Besides the GPU tests of tests/test_pipeline.py (the prefetcher's side stream) and
tests/test_health.py (the GPU probes): mixed precision and channels_last as the trainer sets
them, background saves of GPU state staged in pinned memory and restored onto the GPU, a round
on NCCL as the trainer runs it (DDP over the pinned loader and the prefetcher, a save on the
round's save group, a restore over NCCL), the order between the all-reduce and whoever waits on
the comm hook's future, an abort while steps run and the round after it, the shrink path, the
evaluation on CUDA, how many workers a GPU node runs, and a device-side assert
(``torch._assert_async``) taken for the worker's own fault.

CI has no GPU: every test here is marked ``gpu`` and skipped without CUDA. The work that builds
process groups runs in two child processes (:func:`run_child`), one per module-scoped fixture,
each killed after ``CHILD_TIMEOUT_S``: a hung NCCL call cannot be interrupted from Python, and
a rare GPU run must end with a verdict for every test. A child writes down what it found as it
goes, so that each test judges its own part and a failure names where the child stopped. The
groups time out after ``GROUP_TIMEOUT_S``, before the kill, so that a stuck collective fails
with its own error.

One GPU holds one NCCL rank (NCCL refuses two ranks of a group on one device): what only
several ranks show, a peer lost mid-step on NCCL or a shrink that removes a rank, is not shown
here (the multi-rank paths run on gloo in the rest of the suite).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback
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
from torch.utils.data import TensorDataset

from elastic.async_checkpoint import BackgroundSaver
from elastic.checkpoint import CheckpointManager
from elastic.communicator import Communicator, pick_device
from elastic.config import (
    Config,
    ConfigError,
    ModelConfig,
    OptimConfig,
    OptimizerName,
    Precision,
)
from elastic.control import Assignment
from elastic.ddp_hook import DDPHook
from elastic.evaluate import evaluate
from elastic.events import EventLog, read_events
from elastic.group_setup import shrink
from elastic.manifest import MANIFEST, folder
from elastic.model import build_model
from elastic.optim import build_optimizer
from elastic.pipeline import Prefetcher, image_mover, make_loader
from elastic.precision import MixedPrecision, resolve_channels_last, resolve_precision
from elastic.round_end import round_end
from elastic.state import TrainState, broadcast_tensors, sync_state
from launcher.agent.slots import local_slots
from tests.conftest import REPO, served_store
from tests.test_evaluate import LOSS, TOP1, TOP5, Logits, Recorder, identity_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

GROUP_TIMEOUT_S = 60  # every process group's: a stuck collective fails within a minute
CHILD_TIMEOUT_S = 100  # past this a child is killed, after any group's timeout had its say
# A child is the only rank, and the lent GPU machine has no network: NCCL's and gloo's sockets
# stay on the loopback, and a DNS lookup of a store peer's name gives up after a second instead
# of glibc's 5 s and a retry (see bench/nccl_lifecycle.py).
CHILD_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "RES_OPTIONS": "timeout:1 attempts:1",
}
SLEEP_CYCLES = 300_000_000  # torch.cuda._sleep: 0.15-0.3 s at a GPU's clock
BATCH = 8


# --- running a child -------------------------------------------------------------------------


class Findings:
    """What a child found, rewritten to its file with every entry (atomically): a child that
    dies or is killed still tells what it found before, and its output names each entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.found: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.found[key] = value
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.found))
        os.replace(partial, self.path)
        print(f"[{self.path.stem}] {key}: {json.dumps(value)[:300]}", flush=True)


def run_child(tmp: Path, main: Callable[[Path, Findings], None]) -> dict[str, Any]:
    """``main(tmp, findings)`` in a fresh process; what it found, with ``stopped`` saying why
    it stopped early (its traceback, its exit code, or the time limit)."""
    path = tmp / f"{main.__name__.strip('_')}.json"
    child = mp.get_context("spawn").Process(target=_child, args=(main, tmp, path))
    child.start()
    child.join(CHILD_TIMEOUT_S)
    killed = child.is_alive()
    if killed:
        child.kill()
        child.join()
    found: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if killed:
        found["stopped"] = f"still running after {CHILD_TIMEOUT_S} s, killed"
    elif child.exitcode != 0 and "stopped" not in found:
        found["stopped"] = f"died with exit code {child.exitcode}"
    return found


def _child(main: Callable[[Path, Findings], None], tmp: Path, path: Path) -> None:
    for name, value in CHILD_ENV.items():
        os.environ.setdefault(name, value)
    findings = Findings(path)
    try:
        main(tmp, findings)
    except BaseException:
        findings["stopped"] = traceback.format_exc()
    os._exit(0)  # no teardown: a group a failure left behind must not hold the exit


def need(found: dict[str, Any], key: str) -> Any:
    """What the child found under ``key``; the test fails with why the child stopped first."""
    if key not in found:
        why = found.get("stopped", "it finished without it")
        pytest.fail(f"the child never found {key!r}: {why}", pytrace=False)
    return found[key]


# --- what the children share -----------------------------------------------------------------


def resnet(device: torch.device) -> TrainState:
    """The trainer's model and optimizer (``model`` and ``optim`` at their defaults) on
    ``device``, in channels_last, as the trainer builds them on CUDA."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(), num_classes=10).to(device)
    model = model.to(memory_format=torch.channels_last)
    state = TrainState(model, build_optimizer(model, OptimConfig()))
    state.apply({"lr": 0.01})  # the trainer sets the LR before every step
    return state


def batch(device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (BATCH,), generator=generator)
    return images.to(device, memory_format=torch.channels_last), labels.to(device)


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in tensors.items()}


def mismatched(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in tensors.items() if not torch.equal(t.detach().cpu(), expected[n])]


def off_layout(model: nn.Module) -> list[str]:
    """The 4-d parameters, or their gradients, that are not channels_last."""
    return [
        name
        for name, p in model.named_parameters()
        if p.dim() == 4
        and not (
            p.is_contiguous(memory_format=torch.channels_last)
            and p.grad is not None
            and p.grad.stride() == p.stride()
        )
    ]


def scaler_state(precision: MixedPrecision) -> list[float]:
    """The loss scale and the good steps since it last changed, from the scaler's own tensors."""
    tensors = precision.tensors()
    return [tensors["scaler.scale"].item(), tensors["scaler.growth_tracker"].item()]


def step_alone(
    state: TrainState,
    precision: MixedPrecision,
    images: torch.Tensor,
    labels: torch.Tensor,
    overflow: bool = False,
) -> tuple[float, bool, torch.dtype]:
    """One step through :class:`MixedPrecision` as the trainer's ``train_step`` takes it, without
    DDP; with ``overflow``, an inf in a gradient as an fp16 overflow leaves one. The loss,
    whether the optimizer stepped, and the dtype the forward computed in."""
    state.optimizer.zero_grad(set_to_none=True)
    with precision.autocast():
        logits = state.model(images)
        loss = F.cross_entropy(logits, labels)
    precision.backward(loss)
    if overflow:
        state.model.fc.bias.grad[0] = math.inf
    return loss.item(), precision.step(state.optimizer), logits.dtype


def gloo_alone() -> dist.ProcessGroup:
    """This process as a world of one on gloo, and a save group beside it as a worker has."""
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


# --- the GPU state: mixed precision, channels_last, pinned background saves ------------------


def _gpu_state_main(tmp: Path, found: Findings) -> None:
    """A few steps in bf16 and in fp16 (one of them overflowing), then two background saves of
    the fp16 worker's state while it trains on, restored into a fresh worker on the GPU."""
    device = pick_device("cuda", 0)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    found["choices"] = {
        "bf16_native": native,
        "auto": str(resolve_precision(Precision.auto, device)),
        "channels_last": resolve_channels_last(None, device),
    }
    images, labels = batch(device, seed=1)
    if native:
        state, bf16 = resnet(device), MixedPrecision(Precision.bf16, device)
        steps = [step_alone(state, bf16, images, labels) for _ in range(3)]
        found["bf16"] = {
            "computed_in": sorted({str(dtype) for _, _, dtype in steps}),
            "losses": [loss for loss, _, _ in steps],
            "taken": [taken for _, taken, _ in steps],
            "scaler_state": list(bf16.tensors()),
            "params": sorted({str(p.dtype) for p in state.model.parameters()}),
            "off_layout": off_layout(state.model),
        }
    else:
        try:
            resolve_precision(Precision.bf16, device)
            found["bf16_refused"] = ""
        except ConfigError as exc:
            found["bf16_refused"] = str(exc)

    state, fp16 = resnet(device), MixedPrecision(Precision.fp16, device)
    steps, scales = [], [scaler_state(fp16)]
    for i in range(4):
        steps.append(step_alone(state, fp16, images, labels, overflow=i == 1))
        scales.append(scaler_state(fp16))
    found["fp16"] = {
        "computed_in": sorted({str(dtype) for _, _, dtype in steps}),
        "losses": [loss for loss, _, _ in steps],
        "taken": [taken for _, taken, _ in steps],
        "scales": scales,  # before the first step, then after each
        "params": sorted({str(p.dtype) for p in state.model.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in state.model.parameters()}),
        "off_layout": off_layout(state.model),
    }

    group = gloo_alone()
    events = EventLog(tmp, "rank0")
    manager = CheckpointManager(f"file://{tmp}/ckpt", keep=2, events=events)
    saver = BackgroundSaver(events)
    tensors = state.tensors() | fp16.tensors()  # the trainer's Worker.tensors
    expected, saves, staged = {}, [], []
    next_images, next_labels = batch(device, seed=2)
    for step in (1, 2):
        expected[step] = snapshot(tensors)
        began = time.perf_counter()
        started = saver.start(manager, step, tensors, {}, group, 1, lambda: False)
        returned_s = time.perf_counter() - began
        writing = saver._current is not None and not saver._current.done.is_set()
        staged.append([t.data_ptr() for t in saver._staged.values()])
        # Training goes on while the save is written: what is written is the staged copy.
        _, taken, _ = step_alone(state, fp16, next_images, next_labels)
        saver.wait(lambda: False)
        saves.append(
            {
                "step": step,
                "returned_s": returned_s,
                "writing_when_returned": writing,
                "copied": started.copied_bytes,
                "trained_on": taken,
                "scaler_after_next_step": scaler_state(fp16),
            }
        )
    found["saves"] = {
        "saves": saves,
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "staged": len(saver._staged),
        "tensors": len(tensors),
        "unpinned": [name for name, t in saver._staged.items() if not t.is_pinned()],
        "staged_reused": staged[0] == staged[1],
        "saved": [e["step"] for e in read_events(tmp) if e["event"] == "checkpoint_saved"],
        "failed": [e["reason"] for e in read_events(tmp) if e["event"] == "checkpoint_failed"],
    }

    # A restarted worker builds its state afresh on the GPU and loads the newest checkpoint.
    fresh, fresh_fp16 = resnet(device), MixedPrecision(Precision.fp16, device)
    loaded = fresh.tensors() | fresh_fp16.tensors()
    layouts = {name: t.stride() for name, t in loaded.items()}
    before = scaler_state(fresh_fp16)
    restored = {}
    for step in (2, 1):
        info = manager.restore(loaded)
        restored[step] = {
            "step": info.step if info else None,
            "mismatched": mismatched(loaded, expected[step]),
            "off_gpu": [name for name, t in loaded.items() if t.device != device],
            "layout_changed": [n for n, t in loaded.items() if t.stride() != layouts[n]],
        }
        if step == 2:
            loaded_scaler = scaler_state(fresh_fp16)
            # It scales with what it loaded: the step the saving worker took after this save.
            _, taken, _ = step_alone(fresh, fresh_fp16, next_images, next_labels)
            after_next = [taken, scaler_state(fresh_fp16)]
            Path(folder(str(tmp / "ckpt"), 2), MANIFEST).unlink()  # the next restore: step 1
    found["restored"] = {
        "restored": restored,
        "fresh_scaler": before,
        "loaded_scaler": loaded_scaler,
        "saved_scaler": [expected[2][f"scaler.{k}"].item() for k in ("scale", "growth_tracker")],
        "after_next_step": after_next,
        "saving_worker_after_next_step": [
            saves[1]["trained_on"],
            saves[1]["scaler_after_next_step"],
        ],
    }


@pytest.fixture(scope="module")
def gpu_state(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_child(tmp_path_factory.mktemp("gpu_state"), _gpu_state_main)


def test_cuda_chooses_bf16_only_where_native_and_channels_last(gpu_state: dict[str, Any]) -> None:
    """precision.py's CUDA branches: ``auto`` is bf16 on a GPU with native bf16 and fp32
    otherwise, an explicit bf16 on a GPU without it is refused; channels_last is on for CUDA."""
    choices = need(gpu_state, "choices")
    assert choices["channels_last"] is True
    assert choices["auto"] == ("bf16" if choices["bf16_native"] else "fp32")
    if not choices["bf16_native"]:
        assert "no native bf16" in need(gpu_state, "bf16_refused")


def test_bf16_steps_compute_in_bf16_on_fp32_weights_without_a_scaler(
    gpu_state: dict[str, Any],
) -> None:
    if not need(gpu_state, "choices")["bf16_native"]:
        pytest.skip("this GPU has no native bf16")
    bf16 = need(gpu_state, "bf16")
    assert bf16["computed_in"] == ["torch.bfloat16"] and bf16["params"] == ["torch.float32"]
    assert bf16["taken"] == [True] * 3 and bf16["scaler_state"] == []
    assert all(math.isfinite(loss) for loss in bf16["losses"])
    assert bf16["off_layout"] == []  # weights and gradients channels_last, as the trainer sets


def test_fp16_skips_an_overflowing_step_and_halves_the_scale(gpu_state: dict[str, Any]) -> None:
    """The GradScaler on CUDA: the step with an inf is skipped, and so is any step whose fp16
    gradients overflowed by themselves (the first ones may, at the initial scale); what
    MixedPrecision.step reports agrees with the scaler's own update at every step: a skipped
    step halves the scale and restarts the count of good steps, a taken one adds to it."""
    fp16 = need(gpu_state, "fp16")
    assert fp16["computed_in"] == ["torch.float16"]
    assert fp16["params"] == fp16["grads"] == ["torch.float32"]
    assert fp16["taken"][1] is False and any(fp16["taken"]), fp16
    scales = fp16["scales"]
    assert scales[0] == [65536.0, 0]  # made before the first step, to be loaded into in place
    for i, taken in enumerate(fp16["taken"]):
        (scale, good), (after, good_after) = scales[i], scales[i + 1]
        assert (after, good_after) == ((scale, good + 1) if taken else (scale / 2, 0)), fp16
    assert all(math.isfinite(loss) for loss in fp16["losses"])
    assert fp16["off_layout"] == []


def test_a_background_save_of_gpu_state_stages_it_in_pinned_memory_and_returns_at_once(
    gpu_state: dict[str, Any],
) -> None:
    """async_checkpoint's CUDA branches: the staged copy of GPU tensors is pinned, allocated
    once and refilled by the next save; the copies are synchronised before the write, and the
    save returns while its thread still writes (training went on meanwhile)."""
    saves = need(gpu_state, "saves")
    assert saves["failed"] == [] and saves["saved"] == [1, 2], saves
    assert saves["staged"] == saves["tensors"] and saves["unpinned"] == []
    assert saves["staged_reused"]
    for save in saves["saves"]:
        assert save["writing_when_returned"], save
        assert save["copied"] == saves["state_bytes"]  # a world of one writes everything


def test_gpu_state_restores_exactly_onto_the_gpu_scaler_included(gpu_state: dict[str, Any]) -> None:
    """Each checkpoint holds the state when its save began, not what training wrote after; it
    loads into a fresh worker's tensors in place (on the GPU, channels_last kept), and the loaded
    scaler goes on as the saving worker's did."""
    found = need(gpu_state, "restored")
    for step, restored in found["restored"].items():
        assert restored["step"] == int(step), restored
        assert restored["mismatched"] == [] and restored["off_gpu"] == [], restored
        assert restored["layout_changed"] == [], restored
    assert found["loaded_scaler"] == found["saved_scaler"] != found["fresh_scaler"]
    assert found["after_next_step"] == found["saving_worker_after_next_step"]


# --- one rank on NCCL, as the trainer runs a round, then an abort and the next round ---------


def assignment(number: int, port: int, **changes: Any) -> Assignment:
    return Assignment(
        round=number,
        rank=0,
        world_size=1,
        store_host="127.0.0.1",
        store_port=port,
        formed_at=time.time(),
        **changes,
    )


def ddp_step(
    hook: DDPHook,
    ddp: nn.Module,
    state: TrainState,
    precision: MixedPrecision,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> float:
    """One step of the trainer's ``train_step`` with one micro-batch."""
    state.optimizer.zero_grad(set_to_none=True)
    hook.begin_step()
    with precision.autocast():
        loss = F.cross_entropy(ddp(images), labels)
    precision.backward(loss)
    precision.step(state.optimizer)
    hook.end_step()
    return loss.item()


def stream_order(comm: Communicator, device: torch.device) -> list[float]:
    """What a stream that waited on the communicator's future of an all-reduce reads: the current
    stream is kept busy before it writes what the all-reduce sends, so a future that completes
    before the all-reduce has run lets the reader see the old value (1), one that carries its
    CUDA event the reduced one (2, at a world of one)."""
    x = torch.ones(1 << 20, device=device)
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(2.0)
    with comm.collective("stream order check"):
        work = dist.all_reduce(x, async_op=True)
    future = comm.track(work, "stream order check", x, x)
    reader = torch.cuda.Stream(device)
    with torch.cuda.stream(reader):
        future.wait()
        seen = x.clone()
    torch.cuda.synchronize(device)
    return seen.unique().tolist()


def grads_through(hook: DDPHook, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """DDP's gradients when they travel in ``dtype`` (``comm.grad_dtype``) at a world of one:
    the fp32 gradient cast to ``dtype`` and back, read by DDP only after the cast back."""
    hook.grad_dtype = dtype
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)
    reference = copy.deepcopy(model)
    inputs = torch.randn(32, 64, device=device)
    ddp = hook.wrap(model)
    hook.begin_step()
    ddp(inputs).square().mean().backward()
    hook.end_step()
    reference(inputs).square().mean().backward()
    pairs = [
        (p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    hook.grad_dtype = torch.float32
    return {
        "in_dtype": all(torch.equal(g, g.to(dtype).float()) for g, _ in pairs),
        "relative_error": max(((g - r).abs().max() / r.abs().max()).item() for g, r in pairs),
    }


def shrink_probe(comm: Communicator, port: int) -> str:
    """What the communicator's shrink path does with a round that removed rank 1.

    One GPU holds one NCCL rank, so there is no rank 1 to remove: torch refuses to shrink a
    group of one before it touches the communicator. This shows that the path reaches
    ``torch.distributed.shrink_group`` with arguments it accepts; what a real shrink does (the
    survivors' communicator shrunk in place, their next all-reduce) needs two GPUs or more."""
    if not hasattr(dist, "shrink_group"):
        return "absent"
    current = comm.assignment
    assert current is not None
    shrunk = assignment(current.round + 1, port, shrinks_round=current.round, excluded_ranks=(1,))
    try:
        excluded = shrunk.shrink_of(current)
        assert excluded is not None and comm._can_shrink(excluded), "the path is not reached"
        return f"returned {shrink(excluded)}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def _nccl_main(tmp: Path, found: Findings) -> None:
    """Round 1 on NCCL as the trainer runs it, a save and a restore, the stream order, gradients
    in fp16 and bf16, then an abort from another thread while steps run, round 2, the shrink
    path, and the close."""
    device = pick_device("cuda", 0)
    torch.backends.cudnn.benchmark = True  # as the trainer sets it on CUDA
    with served_store() as port:
        comm = Communicator(device, GROUP_TIMEOUT_S)
        hook = DDPHook(comm)
        comm.enter(assignment(1, port))
        found["entered"] = {
            "device": [str(device), torch.cuda.current_device()],
            "backend": comm.backend,
            "default_group": dist.get_backend(),
            "save_group": dist.get_backend(comm.saves.group),
        }

        precision = MixedPrecision(resolve_precision(Precision.auto, device), device)
        channels_last = resolve_channels_last(None, device)
        state = resnet(device)
        tensors = state.tensors() | precision.tensors()
        events = EventLog(tmp, "rank0")
        ckpt = CheckpointManager(f"file://{tmp}/ckpt", 2, events, comm.collective)
        with comm.collective("state sync"):
            progress, source = sync_state(tensors, None, -1, device)
        found["fresh_job"] = [progress is None, source, ckpt.restore(tensors) is None]

        ddp = hook.wrap(state.model)
        dataset = TensorDataset(
            torch.randn(3 * BATCH, 3, 32, 32), torch.randint(0, 10, (3 * BATCH,))
        )
        keys = [list(range(i, i + BATCH)) for i in range(0, 3 * BATCH, BATCH)]
        loader = make_loader(dataset, keys, 0, device)
        losses, batches = [], []
        for images, labels in Prefetcher(loader, device, image_mover(device, channels_last)):
            batches.append(
                images.is_cuda and images.is_contiguous(memory_format=torch.channels_last)
            )
            losses.append(ddp_step(hook, ddp, state, precision, images, labels))
        found["trained"] = {
            "precision": str(precision.precision),
            "pin_memory": loader.pin_memory,
            "channels_last_batches": batches,
            "losses": losses,
            "buckets": hook.buckets_per_step,
            "compute_s": hook.timing.last_compute_s,  # timed by CUDA events
            "pending": len(comm._pending),
            "off_layout": off_layout(state.model),
            "failure": str(comm.failure) if comm.failure else None,
        }

        saver = BackgroundSaver(events)
        expected = snapshot(tensors)
        saver.start(ckpt, 3, tensors, {}, comm.saves.group, 1, lambda: comm.aborted)
        saver.wait(lambda: comm.aborted)
        committed = ckpt.committed(3)
        with torch.no_grad():
            for t in tensors.values():
                t.zero_()
        info = ckpt.restore(tensors)
        found["saved"] = {
            "committed": committed,
            "restored": info.step if info else None,
            "mismatched": mismatched(tensors, expected),
            "unpinned": [name for name, t in saver._staged.items() if not t.is_pinned()],
            "failed": [e["reason"] for e in read_events(tmp) if e["event"] == "checkpoint_failed"],
        }

        found["adamw_sync"] = adamw_sync(comm, device)
        found["stream_order"] = stream_order(comm, device)
        found["grad_dtypes"] = {
            str(dtype): grads_through(hook, device, dtype)
            for dtype in (torch.float16, torch.bfloat16)
        }

        # The agent link announces round 2 on its own thread while this one trains: the abort
        # lands anywhere in a step, or between two. With one rank no step waits on a peer.
        images, labels = batch(device, seed=3)

        def announce() -> None:
            time.sleep(0.2)
            comm.abort("round 2 was formed", before_round=2)

        link = threading.Thread(target=announce, name="agent-link")
        steps, interrupted = 0, None
        link.start()
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not comm.aborted and time.monotonic() < deadline:
            try:
                ddp_step(hook, ddp, state, precision, images, labels)
            except Exception as exc:  # the abort landed inside the step
                interrupted = f"{type(exc).__name__}: {exc}"[:300]
                break
            steps += 1
        link.join()
        try:
            ddp_step(hook, ddp, state, precision, images, labels)
            refused = None
        except Exception as exc:
            refused = f"{type(exc).__name__}: {exc}"[:300]
        found["aborted"] = {
            "steps": steps,
            "interrupted": interrupted,
            "refused": refused,
            "end": round_end(comm.aborted, comm.failure).value,
        }

        del ddp  # the trainer drops the round's DDP with the round
        comm.enter(assignment(2, port))
        ddp = hook.wrap(state.model)
        loss = ddp_step(hook, ddp, state, precision, images, labels)
        value = torch.full((4,), 3.0, device=device)
        with comm.collective("round 2 all-reduce"):
            dist.all_reduce(value)
        comm.barrier("round 2")
        found["round2"] = {
            "loss": loss,
            "all_reduce": value.tolist(),
            "aborted": comm.aborted,
            "failure": str(comm.failure) if comm.failure else None,
        }

        found["shrink"] = shrink_probe(comm, port)
        comm.close(wait_s=30)
        found["closed"] = not dist.is_initialized()


def adamw_sync(comm: Communicator, device: torch.device) -> dict[str, Any]:
    """An AdamW state sent as the state sync sends it (its step count stays on the CPU)."""
    model = nn.Linear(4, 2).to(device)
    state = TrainState(model, build_optimizer(model, OptimConfig(name=OptimizerName.adamw)))
    tensors = state.tensors()
    before = snapshot(tensors)
    try:
        with comm.collective("state sync"):
            broadcast_tensors(list(tensors.values()), 0, device)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {
        "devices": sorted({str(t.device.type) for t in tensors.values()}),
        "mismatched": mismatched(tensors, before),
    }


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_child(tmp_path_factory.mktemp("nccl"), _nccl_main)


def test_a_round_on_nccl_trains_from_the_pinned_loader_in_channels_last(
    nccl: dict[str, Any],
) -> None:
    """The CUDA branches of communicator.py, ddp_hook.py and step_timing.py: pick_device sets
    the worker's GPU, the round's group is NCCL bound to it (the save group gloo), DDP gets the
    device, CUDA events time the steps; the loader pins, the prefetcher hands out channels_last
    batches on the GPU, and the steps train under autocast."""
    entered = need(nccl, "entered")
    assert entered["device"] == ["cuda:0", 0]
    assert entered["backend"] == entered["default_group"] == "nccl"
    assert entered["save_group"] == "gloo"
    assert need(nccl, "fresh_job") == [True, -1, True]
    trained = need(nccl, "trained")
    assert trained["pin_memory"] and trained["channels_last_batches"] == [True] * 3
    assert trained["precision"] in ("bf16", "fp32")
    assert all(math.isfinite(loss) for loss in trained["losses"])
    assert trained["buckets"] >= 1 and trained["failure"] is None
    assert 0 < trained["compute_s"] < 10, trained  # the stragglers' compute time, on the GPU
    assert trained["off_layout"] == []  # DDP hands back gradients in the parameters' layout
    assert trained["pending"] <= trained["buckets"]  # the last step's; none kept from before


def test_an_adamw_state_with_its_step_count_on_the_cpu_is_sent_over_nccl(
    nccl: dict[str, Any],
) -> None:
    """NCCL sends device memory only: the CPU step count goes through a copy on the GPU."""
    assert need(nccl, "adamw_sync") == {"devices": ["cpu", "cuda"], "mismatched": []}


def test_a_save_on_the_rounds_save_group_restores_over_nccl(nccl: dict[str, Any]) -> None:
    saved = need(nccl, "saved")
    assert saved["failed"] == [] and saved["committed"], saved
    assert saved["restored"] == 3 and saved["mismatched"] == [] and saved["unpinned"] == []


def test_a_stream_waiting_on_the_hooks_future_reads_after_the_all_reduce(
    nccl: dict[str, Any],
) -> None:
    """The future the comm hook hands DDP completes on the GPU, not when NCCL has queued the
    all-reduce: a reader waiting on it sees the reduced value, and DDP reads gradients that
    travelled in fp16 or bf16 only once they were cast back (exactly representable in that
    dtype, and within one unit of its last place of the fp32 gradient)."""
    assert need(nccl, "stream_order") == [2.0]
    grads = need(nccl, "grad_dtypes")
    for dtype, bound in (("torch.float16", 2**-10), ("torch.bfloat16", 2**-7)):
        assert grads[dtype]["in_dtype"], grads
        assert grads[dtype]["relative_error"] <= bound, grads


def test_an_abort_from_another_thread_ends_the_round_and_the_next_round_trains(
    nccl: dict[str, Any],
) -> None:
    """abort() on NCCL aborts the group too: the round ends as left (whatever step it landed
    in), a step in the aborted round fails instead of training, and round 2 is built anew,
    trains, all-reduces and passes its barrier."""
    aborted = need(nccl, "aborted")
    assert aborted["end"] == "left" and aborted["refused"] is not None, aborted
    round2 = need(nccl, "round2")
    assert round2["all_reduce"] == [3.0] * 4 and math.isfinite(round2["loss"])
    assert not round2["aborted"] and round2["failure"] is None


def test_the_shrink_path_reaches_torch_and_the_group_closes(nccl: dict[str, Any]) -> None:
    """With one rank a shrink removes nothing (see :func:`shrink_probe`): torch, not the
    communicator, refuses it, and the group still closes."""
    shrink = need(nccl, "shrink")
    if shrink == "absent":
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.shrink_group")
    assert shrink == "returned False" or shrink.startswith(("ValueError", "RuntimeError")), shrink
    assert need(nccl, "closed")


# --- in this process: the evaluation, and the node's slots ----------------------------------


def test_the_evaluation_reads_through_pinned_memory_onto_the_gpu() -> None:
    """evaluate.py's pin_memory branch, with and without loader processes, and under the
    trainer's autocast on CUDA."""
    device = torch.device("cuda", torch.cuda.current_device())
    model, guard = identity_model().to(device), Recorder()
    for workers in (0, 2):
        result = evaluate(
            model, Logits(), 0, 1, device, batch_size=2, all_reduce=guard, loader_workers=workers
        )
        assert result.count == 7
        assert result.top1 == pytest.approx(TOP1) and result.top5 == pytest.approx(TOP5)
        assert result.loss == pytest.approx(LOSS, rel=1e-6)
    precision = MixedPrecision(resolve_precision(Precision.auto, device), device)
    result = evaluate(
        model, Logits(), 0, 1, device, batch_size=2, all_reduce=guard, autocast=precision.autocast
    )
    assert result.top1 == pytest.approx(TOP1) and result.top5 == pytest.approx(TOP5)
    assert result.loss == pytest.approx(LOSS, rel=1e-2)
    assert guard.seen == []  # one rank: nothing to all-reduce


def test_a_gpu_node_runs_one_worker_per_visible_gpu() -> None:
    """slots.py's CUDA branch, which the agent and the doctor take on a node with GPU device
    nodes: ``cluster.device=auto`` asks torch, and each visible GPU is a worker."""
    assert local_slots(Config()) == (torch.cuda.device_count(), "cuda")


# A device-side assert in a process of its own: it poisons that process's CUDA context for good.
DEVICE_ASSERT = """
import torch
from elastic.round_end import is_device_fault, round_end
try:
    torch._assert_async(torch.zeros((), device="cuda"))  # fails on the device: zero
    torch.cuda.synchronize()
    print("no error")
except Exception as exc:
    print(type(exc).__name__, is_device_fault(exc), round_end(False, None, exc).name)
    try:
        (torch.ones(1, device="cuda") + 1).cpu()
        print("later call: works")
    except Exception as again:
        print("later call:", is_device_fault(again))
"""


def test_a_device_side_assert_is_the_workers_own_fault_and_sticks() -> None:
    """torch._assert_async failing on the GPU surfaces at the next sync as an error of the
    device: the worker's own fault (it exits, its agent restarts it with a strike), never a
    round to recover in place, since every later CUDA call of the process fails too."""
    done = subprocess.run(
        [sys.executable, "-c", DEVICE_ASSERT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = done.stdout.splitlines()
    assert lines[:1] == ["AcceleratorError True LOCAL_FAULT"], (done.stdout, done.stderr[-2000:])
    assert lines[1:] == ["later call: True"], (done.stdout, done.stderr[-2000:])
