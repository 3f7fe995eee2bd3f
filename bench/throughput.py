"""Steady-state training throughput: this project's trainer next to a plain DDP loop, in one run.

What the runtime adds to every step (the elastic sampler's plans, the abortable comm hook, the
per-sample weights, heartbeats and step events) must cost next to nothing: the goal is an
overhead of at most 2 % in samples/s against plain DDP with the same model, batch and world size.
This prints both figures, measured on this machine in one run, and the overhead; it says whether
the goal is met and does not assert it.

- Ours: a real job, ``python -m launcher`` (agents, embedded etcd, workers), on the CPU as
  ``cluster.nodes=<procs>`` simulated nodes of one worker each, on CUDA as one node with one worker
  per GPU. Its rank 0 writes a ``step`` event after every step; the time of step k is that event's
  timestamp.
- The peer: the training loop of torchvision's reference ``references/classification/train.py``:
  ``torch.multiprocessing`` processes in one gloo (CPU) or NCCL (CUDA) group, a DataLoader over an
  ImageFolder with a DistributedSampler, ``image.to(device)``, autocast (and a GradScaler for
  fp16), ``DistributedDataParallel`` as the reference builds it (no comm hook), SGD, and
  ``loss.item()`` every step; no agent, no events. It also sets ``cudnn.benchmark`` as the
  reference does, and skips the reference's accuracy metrics (which would only slow the peer).
  The time of step k is taken on rank 0 after it.

- The peer again, with an idle etcd server running beside it (``--no-etcd-row`` leaves this out).
  Our local cluster runs its embedded etcd on the same cores as the workers, and etcd wakes up
  every 100 ms (raft ticks) even when nothing changes. On a machine whose cores the workers
  saturate (2 CPU workers on 2 cores), those wake-ups alone slow a synchronous job: measured
  here, an idle etcd slowed the plain loop by about 9 %. On bare metal etcd runs on its own
  machines, and GPU workers leave cores free, so the overhead that belongs to the trainer is
  ours against this row; both overheads are printed.

Both use the same model, per-worker batch, precision, channels_last, images, transforms, loader
processes and intra-op threads. Only the steady state counts: the first ``--warmup-steps`` steps
(start-up, the first step's allocations and cudnn autotuning, DDP's bucket rebuild) are skipped,
and samples/s is the samples of the next ``--steps`` steps over the wall time from the end of the
last skipped step to the end of the window, the same window for both. Our job checkpoints only
after the window (a checkpoint's stall is measured on its own) and evaluates only at the end.

    .venv/bin/python bench/throughput.py --steps 30 --warmup-steps 5 --repeats 1   # quick, CPU
    .venv/bin/python bench/throughput.py                                           # CPU defaults
    .venv/bin/python bench/throughput.py --device cuda --model resnet50 --batch-size 128 \\
        --image-size 256 --crop-size 224 --loader-workers -1 --steps 100 --warmup-steps 20

Arguments after the options are Hydra overrides for both runtimes (``data=imagenet
data.root=/data/imagenet``). On a machine with one GPU each runtime runs a single process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, models

from launcher.embedded_etcd import EmbeddedEtcd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic import config  # noqa: E402
from elastic.config import Config  # noqa: E402
from elastic.data import ensure_synthetic, imagenet_transform, train_root  # noqa: E402
from elastic.events import read_events  # noqa: E402
from elastic.pipeline import PREFETCH_FACTOR, loader_workers  # noqa: E402
from elastic.sampler import ElasticSampler, SamplerState  # noqa: E402
from launcher.compose import UsageError, compose  # noqa: E402

GOAL_PCT = 2.0
TIMEOUT_S = 1800.0
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Window:
    """One run's steady state: samples/s and seconds per step over the measured steps."""

    samples_per_s: float
    step_s: float


def window(ends: list[float], samples: list[int], warmup: int, steps: int) -> Window:
    """The steady state from the step end times and global samples of steps 1, 2, ...: steps
    ``warmup + 1`` to ``warmup + steps``, timed from the end of step ``warmup``."""
    last = warmup + steps
    if len(ends) < last:
        raise RuntimeError(f"only {len(ends)} steps were timed; {last} are needed")
    seconds = ends[last - 1] - ends[warmup - 1]
    return Window(sum(samples[warmup:last]) / seconds, seconds / steps)


@dataclass(frozen=True)
class Setup:
    """What both runtimes train, resolved from the options and the job's configuration."""

    cfg: Config
    overrides: list[str]  # Hydra overrides of both (ours gets its job shape besides)
    device: str  # "cpu" or "cuda"
    procs: int
    threads: int  # intra-op threads per process, as the agent gives its workers
    loader_workers: int  # loader processes per training process, resolved (-1 = auto)
    precision: str  # resolved: fp32, bf16 or fp16
    channels_last: bool
    dataset_size: int
    warmup: int
    steps: int

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


# --- ours ------------------------------------------------------------------------------------


def run_ours(setup: Setup, work: Path) -> Window:
    """One job of this project, trained for exactly ``setup.total_steps`` steps."""
    run_dir = work / f"ours-{time.monotonic_ns()}"
    world = setup.procs
    # The job's length in samples: those of its first total_steps steps (the last step of an
    # epoch is smaller when the global batch does not divide the data set).
    sampler = ElasticSampler(setup.dataset_size, setup.cfg.data.batch_size, setup.cfg.trainer.seed)
    state, samples = SamplerState(), 0
    for _ in range(setup.total_steps):
        plan = sampler.plan(state, 0, world, limit=sys.maxsize)
        samples += plan.global_count
        state = sampler.advance(state, plan)
    shape = (
        [f"cluster.nodes={world}", "cluster.cpu_workers=1"]
        if setup.device == "cpu"
        else ["cluster.nodes=1", f"cluster.workers_per_node={world}"]
    )
    log_path = work / f"{run_dir.name}.log"
    with open(log_path, "wb") as log:
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "launcher",
                *setup.overrides,
                *shape,
                f"job_id={run_dir.name}",
                f"run_dir={run_dir}",
                f"trainer.epochs={samples / setup.dataset_size!r}",
                "trainer.log_every=1",
                "trainer.eval_every_epochs=0",
                f"checkpoint.every_steps={setup.total_steps + 1}",
            ],
            cwd=work,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT_S,
            env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
            check=False,
        ).returncode
    steps = sorted((e for e in read_events(run_dir) if e["event"] == "step"), key=lambda e: e["ts"])
    numbers = [e["step"] for e in steps]
    if code != 0 or numbers != list(range(1, setup.total_steps + 1)):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(
            f"our job exited with {code} after the steps {numbers[:3]}...{numbers[-3:]} (every "
            f"step 1..{setup.total_steps} once is needed); the end of its log:\n{tail}"
        )
    if {e["world_size"] for e in steps} != {world}:
        raise RuntimeError(f"our job did not train at world size {world} throughout")
    return window(
        [e["ts"] for e in steps], [e["step_samples"] for e in steps], setup.warmup, setup.steps
    )


# --- the peer: a plain DDP loop, as torchvision's reference train.py -------------------------


@dataclass(frozen=True)
class PlainJob:
    """What each process of the plain loop needs (picklable for torch.multiprocessing)."""

    root: str
    crop_size: int
    model: str
    batch_size: int
    seed: int
    loader_workers: int
    threads: int
    device: str
    precision: str
    channels_last: bool
    steps: int
    world: int
    store: str  # the FileStore the group bootstraps through
    result: str  # where rank 0 writes its step times


def plain_worker(rank: int, job: PlainJob) -> None:
    torch.set_num_threads(job.threads)
    cuda = job.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{job.store}",
        rank=rank,
        world_size=job.world,
    )
    try:
        torch.backends.cudnn.benchmark = True
        dataset = datasets.ImageFolder(job.root, imagenet_transform(job.crop_size))
        sampler = DistributedSampler(dataset, seed=job.seed)
        workers = job.loader_workers
        loader = DataLoader(
            dataset,
            batch_size=job.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=cuda,
            persistent_workers=workers > 0,
            prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
        )
        model = models.get_model(job.model, weights=None, num_classes=len(dataset.classes))
        model = model.to(device)
        layout = torch.channels_last if job.channels_last else torch.preserve_format
        if job.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        dtype = AUTOCAST[job.precision]
        scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
        ends: list[float] = []
        samples: list[int] = []
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for image, target in loader:
                image, target = image.to(device, memory_format=layout), target.to(device)
                autocast = (
                    torch.autocast(device.type, dtype=dtype)
                    if dtype is not None
                    else contextlib.nullcontext()
                )
                with autocast:
                    output = model(image)
                    loss = criterion(output, target)
                optimizer.zero_grad()
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    optimizer.step()
                loss.item()  # the reference logs the loss of every step: a host sync, as ours
                ends.append(time.perf_counter())
                samples.append(image.shape[0] * job.world)
                if len(ends) == job.steps:
                    break
            if len(ends) == job.steps:
                break
        if rank == 0:
            Path(job.result).write_text(json.dumps({"ends": ends, "samples": samples}))
    finally:
        dist.destroy_process_group()


def run_plain(setup: Setup, work: Path) -> Window:
    name = f"plain-{time.monotonic_ns()}"
    cfg = setup.cfg
    job = PlainJob(
        root=str(train_root(cfg.data)),
        crop_size=cfg.data.crop_size,
        model=cfg.model.name,
        batch_size=cfg.data.batch_size,
        seed=cfg.trainer.seed,
        loader_workers=setup.loader_workers,
        threads=setup.threads,
        device=setup.device,
        precision=setup.precision,
        channels_last=setup.channels_last,
        steps=setup.total_steps,
        world=setup.procs,
        store=str(work / f"{name}.store"),
        result=str(work / f"{name}.json"),
    )
    mp.spawn(plain_worker, args=(job,), nprocs=setup.procs, join=True)
    result = json.loads(Path(job.result).read_text())
    return window(result["ends"], result["samples"], setup.warmup, setup.steps)


# --- the command -----------------------------------------------------------------------------


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Setup:
    """The job both runtimes train: the options as Hydra overrides, composed like a launch."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    procs = args.procs or (torch.cuda.device_count() if args.device == "cuda" else 2)
    options = {
        "model.name": args.model,
        "data.batch_size": args.batch_size,
        "trainer.precision": args.precision,
        "trainer.channels_last": args.channels_last,
        "data.loader_workers": args.loader_workers,
        "data.generate.image_size": args.image_size,
        "data.crop_size": args.crop_size,
    }
    overrides = [f"cluster.device={args.device}", *args.overrides]
    overrides += [
        f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in options.items()
        if value is not None
    ]
    try:
        cfg = compose(overrides)
        config.validate(cfg)
    except (UsageError, config.ConfigError) as exc:
        parser.error(str(exc))
    if args.image_size is not None and not cfg.data.synthetic:
        parser.error("--image-size sizes the generated images: it needs data.synthetic=true")
    if cfg.data.synthetic:
        ensure_synthetic(cfg.data)
    cores = os.cpu_count() or 1
    # Ours on the CPU: simulated nodes that share this machine, one worker each; on CUDA one node.
    workers_on_node, node_cores = (1, cores // procs) if args.device == "cpu" else (procs, cores)
    precision = str(cfg.trainer.precision)
    if precision == "auto":
        bf16 = args.device == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16 else "fp32"
    channels_last = cfg.trainer.channels_last
    return Setup(
        cfg=cfg,
        overrides=overrides,
        device=args.device,
        procs=procs,
        threads=cfg.cluster.threads_per_worker or max(1, cores // procs),
        loader_workers=loader_workers(cfg.data.loader_workers, workers_on_node, node_cores),
        precision=precision,
        channels_last=args.device == "cuda" if channels_last is None else channels_last,
        dataset_size=len(datasets.ImageFolder(str(train_root(cfg.data)))),
        warmup=args.warmup_steps,
        steps=args.steps,
    )


def reproduce(args: argparse.Namespace, setup: Setup) -> str:
    """The command line that runs this benchmark again with every setting spelled out."""
    cfg = setup.cfg
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.relative_to(REPO)
    words = [
        str(python),
        "bench/throughput.py",
        f"--device={setup.device}",
        f"--procs={setup.procs}",
        f"--steps={setup.steps}",
        f"--warmup-steps={setup.warmup}",
        f"--repeats={args.repeats}",
        f"--model={cfg.model.name}",
        f"--batch-size={cfg.data.batch_size}",
        f"--precision={cfg.trainer.precision}",
        "--channels-last" if setup.channels_last else "--no-channels-last",
        f"--loader-workers={cfg.data.loader_workers}",
        f"--crop-size={cfg.data.crop_size}",
        "--etcd-row" if args.etcd_row else "--no-etcd-row",
    ]
    if cfg.data.synthetic:
        words.append(f"--image-size={cfg.data.generate.image_size}")
    return shlex.join([*words, *args.overrides])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The defaults are the main job's (conf/config.yaml, conf/data/synthetic.yaml).",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: simulated nodes of one CPU worker; cuda: one process per GPU (default: cpu)",
    )
    parser.add_argument(
        "--procs",
        type=int,
        default=0,
        help="training processes of each runtime (default: 2 on cpu, one per visible GPU)",
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="steps measured, after the warm-up (default: 40)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=10,
        help="steps trained first and not measured: start-up, first-step costs (default: 10)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each runtime, alternating; the table shows the medians (default: 3)",
    )
    parser.add_argument("--model", help="any torchvision classification model (model.name)")
    parser.add_argument("--batch-size", type=int, help="images per process and step")
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="autocast dtype (trainer.precision); auto: bf16 on a GPU that has it, else fp32",
    )
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="NHWC model and images (trainer.channels_last; default: on for cuda, off on cpu)",
    )
    parser.add_argument(
        "--loader-workers",
        type=int,
        help="loader processes per training process (data.loader_workers); -1: auto, this "
        "process's share of the cores minus one",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        help="side of the generated synthetic JPEGs (data.generate.image_size; 256 for a GPU "
        "run at 224 px)",
    )
    parser.add_argument(
        "--crop-size", type=int, help="random-resized crop the model sees (data.crop_size)"
    )
    parser.add_argument(
        "--etcd-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the plain loop beside an idle etcd server, as ours runs beside its "
        "embedded one (default: on)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides for both runtimes, e.g. data=imagenet data.root=/data/imagenet",
    )
    args = parser.parse_args()
    for name in ("steps", "warmup_steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    setup = resolve(args, parser)
    cfg = setup.cfg

    ours: list[Window] = []
    plain: list[Window] = []
    beside: list[Window] = []
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        for i in range(args.repeats):
            ours.append(run_ours(setup, Path(tmp)))
            plain.append(run_plain(setup, Path(tmp)))
            line = (
                f"run {i + 1}: ours {ours[-1].samples_per_s:.1f} samples/s, "
                f"plain DDP {plain[-1].samples_per_s:.1f} samples/s"
            )
            if args.etcd_row:
                etcd_dir = Path(tmp) / f"etcd-{i}"
                with EmbeddedEtcd(etcd_dir / "data", etcd_dir / "etcd.log"):
                    beside.append(run_plain(setup, Path(tmp)))
                line += f", plain DDP beside an idle etcd {beside[-1].samples_per_s:.1f}"
            print(line, flush=True)

    def rate(runs: list[Window]) -> float:
        return statistics.median(w.samples_per_s for w in runs)

    def overhead(label: str, peer: list[Window]) -> str:
        pct = (rate(peer) - rate(ours)) / rate(peer) * 100
        verdict = "met" if pct <= GOAL_PCT else "NOT met"
        return f"overhead of ours{label}: {pct:+.1f} % (goal <= {GOAL_PCT:g} %: {verdict})"

    print(
        f"\nsteady state: steps {setup.warmup + 1}-{setup.total_steps} (the first {setup.warmup} "
        f"skipped), {setup.procs} processes x {cfg.data.batch_size} images, {cfg.model.name}, "
        f"{cfg.data.crop_size} px crops of {setup.dataset_size} images, {setup.precision}, "
        f"channels_last {'on' if setup.channels_last else 'off'}, {setup.device}, "
        f"{setup.loader_workers} loader processes and {setup.threads} threads per process; "
        f"median of {args.repeats} runs"
    )
    print(f"{'runtime':32}{'samples/s':>11}{'ms/step':>10}   runs (samples/s)")
    rows = [("elastic (ours)", ours), ("plain DDP (torchvision style)", plain)]
    if beside:
        rows.append(("plain DDP beside an idle etcd", beside))
    for label, runs in rows:
        step_ms = statistics.median(w.step_s for w in runs) * 1000
        each = " ".join(f"{w.samples_per_s:.1f}" for w in runs)
        print(f"{label:32}{rate(runs):>11.1f}{step_ms:>10.1f}   {each}")
    print(overhead("", plain))
    if beside:
        label = " against the plain loop beside an idle etcd (the trainer's own share)"
        print(overhead(label, beside))
    print(f"reproduce (from the repository root): {reproduce(args, setup)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
