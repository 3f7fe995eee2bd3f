"""Checkpoint cost: the training stall of our background save against a plain ``torch.save``.

For the ResNet-50 training state (weights, batch-norm statistics and SGD momentum, about 205 MB)
at world 1 and 2 (gloo, one process per rank, all on this machine), each figure the median of
``--repeats`` saves measured in one run:

- our stall: how long :meth:`BackgroundSaver.start` holds the training thread (staging);
- until committed: from that call until the manifest is in place (every rank's shard written,
  fsynced and hashed, ``.metadata`` hashed, the manifest fsynced and renamed), as rank 0 saw
  it; the pruning of older checkpoints comes after the commit and is not counted;
- ``torch.save`` + fsync: rank 0 saving the same state to one file, the others waiting, which
  is the stall of a DDP job that checkpoints the usual way;
- DCP's ``async_save`` of the same tensors on the same group: the stall of its call and the time
  until its future says the checkpoint is written (torch's own background save, as a peer);
- ``dd``: ``dd bs=4M conv=fsync`` of as many bytes as the checkpoint, the disk's own speed;
- restore: our verify + load against ``torch.load(weights_only=True)`` and a copy into the model.

Each figure is given as the median and the best of the repeats. This machine's page cache has
slow spells (it is a VM's memory) that double a write's time, ours and dd's alike, in any of the
runs at random; the best is each figure without them. ``dd`` runs between our saves, its files
kept and removed as the checkpoints are, so that both meet the same memory and disk.

Goals (issue 14): our stall at most 10 % of ``torch.save`` + fsync, and the commit throughput
(bytes / time until committed) at least 80 % of ``dd``'s.

    .venv/bin/python bench/checkpoint.py --dir /var/tmp/ckpt-bench

``--copies 4`` saves the state four times over (819 MB, 1924 tensors). ``--device cuda`` keeps
the state in GPU memory (a GPU per rank; ours stages it through pinned host memory), as the GPU
proof runs it with ``--worlds 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic import event_types as ev  # noqa: E402
from elastic.async_checkpoint import BackgroundSaver  # noqa: E402
from elastic.checkpoint import CheckpointManager  # noqa: E402
from elastic.config import ModelConfig, OptimConfig  # noqa: E402
from elastic.events import EventLog, read_events  # noqa: E402
from elastic.model import build_model  # noqa: E402
from elastic.optim import build_optimizer  # noqa: E402
from elastic.state import TrainState  # noqa: E402
from launcher.rendezvous.embedded_etcd import free_port  # noqa: E402


def training_state(model_name: str) -> TrainState:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=model_name), 1000)
    return TrainState(model, build_optimizer(model, OptimConfig()))


def _rank(
    rank: int,
    world: int,
    port: int,
    root: str,
    repeats: int,
    copies: int,
    out: str,
    device: str,
    model_name: str,
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    one = training_state(model_name).tensors()
    where = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    tensors = {
        f"{name}#{i}": t.detach().clone().to(where)
        for i in range(copies)
        for name, t in one.items()
    }
    gc.freeze()  # as the trainer does once its state is built
    events = EventLog(f"{root}/events", f"rank{rank}")
    manager = CheckpointManager(f"file://{root}/ours", keep=2, events=events)
    saver = BackgroundSaver(events)
    stall, copied, dd_s = [], [], []
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    for step in range(1, repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        started = saver.start(manager, step, tensors, {}, group, 1, lambda: False)
        stall.append(time.perf_counter() - t0)  # the call, the thread's start included
        copied.append(started.copied_bytes)
        saver.wait(lambda: False)
        dist.barrier()
        if rank == 0:  # between our saves, so that both see the same memory and disk
            dd_s.append(dd(Path(root), size, step, keep=2))
        dist.barrier()
    plain = []
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            with open(f"{root}/plain_{i}.pt", "wb") as f:
                torch.save(tensors, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()
        plain.append(time.perf_counter() - t0)
    dcp_stall, dcp_done = dcp_async_saves(tensors, root, repeats, group, where)
    restore, load = [], []
    fresh = {k: torch.empty_like(v) for k, v in tensors.items()}
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        manager.restore(fresh)
        dist.barrier()
        restore.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loaded = torch.load(f"{root}/plain_{i}.pt", weights_only=True)
        for k, v in fresh.items():
            v.copy_(loaded[k])
        dist.barrier()
        load.append(time.perf_counter() - t0)
    if rank == 0:
        # From the start of a save until its manifest was in place, as rank 0 (the one that
        # commits) saw it: its stall, then its write, the gathering of every rank's hashes and
        # the commit. The pruning of older checkpoints comes after, and is not counted.
        committed = [
            e["stall_s"] + e["seconds"]
            for e in ev.CHECKPOINT_SAVED.of(read_events(f"{root}/events"))
        ]
        newest = json.loads(Path(root, "ours", f"step_{repeats:09d}", "manifest.json").read_text())
        figures = {
            "stall": stall,
            "committed": committed,
            "torch_save": plain,
            "dcp_stall": dcp_stall,
            "dcp_done": dcp_done,
            "restore": restore,
            "torch_load": load,
            "bytes": sum(f["size"] for f in newest["files"].values()),
            "staged_bytes": saver.staged_bytes,
            "copied_bytes": copied[-1],  # at a save after the round's first
            "dd": dd_s,
        }
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def dcp_async_saves(
    tensors: dict[str, torch.Tensor],
    root: str,
    repeats: int,
    group: dist.ProcessGroup,
    where: torch.device,
) -> tuple[list[float], list[float]]:
    """Save the same state through DCP's own background save, ``async_save``, and time it.

    It times how long the call holds training, and until its future says the checkpoint is
    written. Checkpoints are kept as ours are: the newest two."""
    from torch.distributed.checkpoint import async_save

    stall, done = [], []
    for i in range(repeats):
        dist.barrier()
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        t0 = time.perf_counter()
        pending = async_save(
            {"state": tensors}, checkpoint_id=f"{root}/dcp_{i}", process_group=group
        )
        stall.append(time.perf_counter() - t0)
        # Newer torch may answer with a response whose upload future ends the save.
        getattr(pending, "upload_completion", pending).result()
        done.append(time.perf_counter() - t0)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(f"{root}/dcp_{i - 2}", ignore_errors=True)
    return stall, done


def dd(root: Path, size: int, n: int, keep: int) -> float:
    """Seconds of ``dd bs=4M conv=fsync`` writing ``size`` bytes to its ``n``-th file.

    Its files are kept and removed as the checkpoints are (the newest ``keep``), so that the page
    cache churns as much for it as for them."""
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={root}/dd_{n}", "bs=4M", f"count={-(-size // (4 << 20))}"]
        + ["conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / f"dd_{n - keep}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument(
        "--copies", type=int, default=1, help="save the state this many times over (a bigger one)"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the state lives: cuda saves it from GPU memory (a GPU per rank)",
    )
    parser.add_argument(
        "--model",
        default="resnet50",
        help="the torchvision model whose training state is saved (default: resnet50)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    med = statistics.median
    rows = []
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda" and max(worlds) > torch.cuda.device_count():
        parser.error(
            f"--worlds {args.worlds}: {torch.cuda.device_count()} GPU(s) visible, one per rank; "
            f"e.g. --worlds 1"
        )
    for world in worlds:
        root = base / f"world{world}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        out = root / "figures.json"
        print(f"world {world}: {args.repeats} saves and restores of the {args.model} state ...")
        mp.spawn(
            _rank,
            args=(
                world,
                free_port(),
                str(root),
                args.repeats,
                args.copies,
                str(out),
                args.device,
                args.model,
            ),
            nprocs=world,
            join=True,
        )
        rows.append((world, json.loads(out.read_text())))
        shutil.rmtree(root, ignore_errors=True)
    if args.dir is None:
        base.rmdir()  # our own temporary folder, emptied world by world
    times = f"{args.copies} times over, " if args.copies > 1 else ""
    print(
        f"\n{args.model} training state in {args.device} memory, {times}median / best of "
        f"{args.repeats}, this machine:\n"
    )
    print("| | " + " | ".join(f"world {w}" for w, _ in rows) + " |")
    print("| --- |" + " --- |" * len(rows))

    def row(label: str, cells: list[str]) -> None:
        print(f"| {label} | " + " | ".join(cells) + " |")

    def seconds(key: str) -> list[str]:
        return [f"{med(f[key]):.3f} / {min(f[key]):.3f} s" for _, f in rows]

    def ratio(part: str, whole: str, digits: int) -> list[str]:
        return [
            f"{med(f[part]) / med(f[whole]):.{digits}%} / {min(f[part]) / min(f[whole]):.{digits}%}"
            for _, f in rows
        ]

    row("checkpoint size", [f"{f['bytes'] / 1e6:.0f} MB" for _, f in rows])
    row("staged copy (host memory)", [f"{f['staged_bytes'] / 1e6:.0f} MB" for _, f in rows])
    row("staged per save, rank 0's share", [f"{f['copied_bytes'] / 1e6:.0f} MB" for _, f in rows])
    row("our stall", seconds("stall"))
    row("`torch.save` + fsync (the stall)", seconds("torch_save"))
    row("stall ratio ours / torch.save (goal <= 10 %)", ratio("stall", "torch_save", 1))
    row("DCP `async_save`: stall", seconds("dcp_stall"))
    row("DCP `async_save`: until written", seconds("dcp_done"))
    row("stall ratio ours / DCP's", ratio("stall", "dcp_stall", 0))
    row("until committed", seconds("committed"))
    row("`dd bs=4M conv=fsync`, same bytes", seconds("dd"))
    row("commit throughput / dd's (goal >= 80 %)", ratio("dd", "committed", 0))
    row("our restore (verify + load)", seconds("restore"))
    row("`torch.load` + copy", seconds("torch_load"))


if __name__ == "__main__":
    main()
