"""Steady-state training throughput: this project's trainer next to a plain DDP loop.

Both run with and without checkpoints in the measured window.

What the runtime adds to every step (the elastic sampler's plans, the abortable comm hook, the
per-sample weights, heartbeats and step events) and what its background checkpoints take from a
busy trainer (staging, the DCP write and its sha256 hashing, on the trainer's own cores) must
cost next to nothing: the goal is an overhead of at most 2 % in samples/s against plain DDP with
the same model, batch and world size. This measures both runtimes in one run, pair by pair, and
prints each overhead with a 95 % confidence interval; it says whether the goal is met and does
not assert it.

The runtimes:

- Ours: a real job, ``python -m launcher`` (agents, embedded etcd, workers), on the CPU as
  ``cluster.nodes=<procs>`` simulated nodes of one worker each, on CUDA as one node with one worker
  per GPU. Its rank 0 writes a ``step`` event after every step; the time of step k is that event's
  timestamp. Checkpoints: ``checkpoint.every_steps`` at the interval of the row
  (``checkpoint.interval=fixed``), saved in the background as in any job.
- The peer: the training loop of torchvision's reference ``references/classification/train.py``:
  ``torch.multiprocessing`` processes in one gloo (CPU) or NCCL (CUDA) group, a DataLoader over an
  ImageFolder with a DistributedSampler, ``image.to(device)``, autocast (and a GradScaler for
  fp16), SGD, and ``loss.item()`` every step; no agent, no events. It sets ``cudnn.benchmark`` as
  the reference does, and skips the reference's accuracy metrics (which would only slow the
  peer). The time of step k is taken on rank 0 after it. Checkpoints as the reference saves
  them: rank 0 alone, synchronously, ``torch.save`` of the model's and the optimizer's state
  dicts (and the GradScaler's) to ``checkpoint.pth``, here followed by an fsync as in
  ``bench/checkpoint.py``, while the other ranks go on and wait in the next all-reduce. (The
  reference also writes ``model_<epoch>.pth`` each time; leaving that out only flatters the peer.)
  Each rank runs in a session of its own, as each of our workers does in its agent's: with
  autogroup scheduling (Linux's default) the CPU of a busy machine is shared among sessions.

DDP at parity: the peer's ``DistributedDataParallel`` gets every option ``DDPHook.wrap``
gives ours, so that the overhead measured is the runtime's and not a DDP setting's:
``forward_sync_buffers=False`` (DDP's default broadcasts the buffers, batch-norm statistics,
from rank 0 before every forward: a blocking collective per step that ours does not run),
``init_sync=False`` (no parameter broadcast at construction; every rank seeds its model alike
instead, as ours makes its replicas identical by its state sync; a one-time cost outside the
window either way) and ``gradient_as_bucket_view=True`` (no copy of the buckets back into the
gradients after the all-reduce). These are ``elastic.ddp_hook.DDP_OPTIONS``. Not its comm
hook: ours all-reduces through an abortable hook whose cost is part of what this measures; the
peer keeps DDP's built-in all-reduce.

The rows, each run ``--repeats`` times for both runtimes:

- no saves: neither runtime checkpoints in the window (ours checkpoints only after it);
- saves every N: ``checkpoint.every_steps`` of the job's configuration (conf/checkpoint/
  default.yaml: 20), ours in the background, the peer with its synchronous save;
- saves every ``--aggressive-every`` steps (default 5; 0 leaves the row out; ``--no-saves-only``
  leaves out both rows with saves): the same, at an
  interval where saves follow each other closely (on 2 cores a save may not finish before the
  next is due).

and the overheads printed: ours against the peer in the same row (like with like), and ours with
saves against the peer without (what fault tolerance costs against a job that never saves).

``--device-decode`` adds ours with ``data.decode=device`` to the no-saves row, once a repeat: the
loader processes only read the JPEGs and the training process decodes and augments them on its
device (nvJPEG on a GPU), against ours decoded by the loader, paired in the same repeat. On the
CPU it only shows the path works: the same cores decode either way.

``data.decode=once`` (an override) puts both runtimes on the training split decoded once into
memory (:class:`elastic.data.DecodedOnce`): a sample is its image's seeded flip, a batch is
copied as 8-bit pixels and normalised on the device. Then the step is measured, and not the
JPEG decoding, which on a GPU may be slower than the step: the H100's loader fed both runtimes
about 300 images/s (2026-11-28). The GPU proof runs it so.

The window. Only the steady state counts: the first ``--warmup-steps`` steps are skipped; samples/s
is the samples of the next ``--steps`` steps over the wall time from the end of the last skipped
step to the end of the window, the same window for every row. The warm-up holds start-up, the
first step's allocations and cudnn autotuning, DDP's bucket rebuild and the round's first save at
the default interval, which stages the whole state and plans the DCP write where later saves copy
only their share and replay the plan: it is more than the default interval (30 > 20). The window
is a multiple of both intervals, so that every row's window holds exactly ``steps / interval``
saves, and at least twice the default interval (40 steps: saves at steps 40 and 60 of 70).

CPU time per sample: the user + system CPU seconds of each runtime's whole process tree over the
same window (ours: the launcher, agents, etcd and workers; the peer: its training processes; both
with their loader processes), sampled every 0.25 s and interpolated at the window's edges, per
sample trained. Unlike wall time it does not grow when other processes take the cores, so it
varies less from run to run; its overhead is what ours costs in CPU, which on a machine whose
cores the workers fill is also what it costs in time. Ours is broken down into workers, launcher
and agents, and etcd: on such a machine the embedded etcd's CPU is taken from the trainers (on
bare metal etcd has machines of its own). Each runtime's training loops' involuntary context
switches a step are printed too: how often what runs beside them took their core.

The noise. Single runs on a shared 2-core VM spread by about +-10 %. Each row's two runtimes run
back to back, in alternating order from one repeat to the next, so that a slow minute hits both
runtimes of a pair. Each overhead is the mean of the per-pair overheads with a 95 % t interval
(``+1.2 % [-0.8, +3.2]``): the true overhead lies in it with 95 % confidence, assuming the pairs
are independent and their differences roughly normal. Ours with saves against the peer without
pairs the runs of one repeat, a minute or two apart rather than back to back: expect a wider
interval there. An interval wider than the goal resolves nothing: the goal counts as met only
where the whole interval lies at or below 2 %, missed only where it lies above. Each line also
says how many pairs an interval of +-``--target-ci-pct`` (default 2) would take at the spread
these pairs showed; rerun with that many ``--repeats``. Or let one sitting settle it:
``--repeats 40 --max-minutes 20`` stops once the no-saves goal is resolved, met or not, on 3 or
more pairs, or when the next pair would pass 20 minutes (:func:`settled`).

An earlier version also ran the peer beside an idle etcd, to separate the embedded etcd's share
on saturated cores. Its runs could not resolve that share against the run-to-run spread (the
overhead against it came out larger than against the plain peer), and they cost a third of the
runtime: the etcd's CPU share, printed for every row, now tells it at no cost.

    .venv/bin/python bench/throughput.py                                # CPU defaults
    .venv/bin/python bench/throughput.py --steps 20 --warmup-steps 12 --repeats 2 \\
        checkpoint.every_steps=10                                       # quick look, CPU
    .venv/bin/python bench/throughput.py --device cuda --model resnet50 --batch-size 128 \\
        --image-size 256 --crop-size 224 --loader-workers -1 --steps 100 --warmup-steps 30 \\
        data.decode=once

The CPU defaults (3 rows x 2 runtimes x 6 repeats, 70 steps each) take about 15 minutes on 2
quiet cores: a run of ours is about 15 s of start-up and shutdown besides its steps, one of the
peer about 4 s. Arguments after the options are Hydra overrides for both runtimes
(``data=imagenet data.root=/data/imagenet``, ``checkpoint.every_steps=50``). On a machine with
one GPU each runtime runs a single process.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import datasets, models

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic import config  # noqa: E402
from elastic import event_types as ev  # noqa: E402
from elastic.config import Config  # noqa: E402
from elastic.data import DecodedOnce, imagenet_transform, train_root  # noqa: E402
from elastic.ddp_hook import DDP_OPTIONS  # noqa: E402
from elastic.events import EventFollower, read_events  # noqa: E402
from elastic.model import build_model  # noqa: E402
from elastic.optim import build_optimizer  # noqa: E402
from elastic.pipeline import PREFETCH_FACTOR, Normalize, loader_workers  # noqa: E402
from elastic.replicas import checksum  # noqa: E402
from elastic.sampler import ElasticSampler, SamplerState  # noqa: E402
from elastic.state import TrainState  # noqa: E402
from elastic.synthetic import ensure_synthetic  # noqa: E402
from launcher.compose import UsageError, compose, validate_launch  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))  # its siblings, when loaded as a module (tests)
import step_profile  # noqa: E402
from pyspy_window import RATE_HZ, PyspyWindow  # noqa: E402

GOAL_PCT = 2.0
MIN_PAIRS = 3  # --max-minutes judges the goal on no fewer pairs
REPLICA_GOAL_PCT = 1.0  # the replica check's share of the step time, at its default interval
TIMEOUT_S = 1800.0  # one run of either runtime, start to exit
CPU_SAMPLE_S = 0.25  # how often the process trees' CPU times are read
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The 97.5th percentile of Student's t with 1..30 degrees of freedom (two-sided 95 %).
T975 = (
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228),
    *(2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086),
    *(2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
)
Z975 = statistics.NormalDist().inv_cdf(0.975)


# --- the statistics --------------------------------------------------------------------------


def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95 % interval.

    It takes the table up to 30 degrees of freedom, and past it the Cornish-Fisher expansion around
    the normal quantile (within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, not {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """The mean of paired differences with its 95 % t interval (``half`` None: one pair)."""

    mean: float
    half: float | None
    needed: int | None  # pairs for a half-width of the target at the observed spread

    def verdict(self, goal: float) -> str:
        """Met only if the whole interval lies at or below ``goal``, missed only above it."""
        if self.half is None:
            return "unresolved: one pair has no interval"
        if self.mean + self.half <= goal:
            return "met"
        if self.mean - self.half > goal:
            return "NOT met"
        return "unresolved: the interval straddles it"

    def __str__(self) -> str:
        if self.half is None:
            return f"{self.mean:+.1f} %"
        low, high = self.mean - self.half, self.mean + self.half
        return f"{self.mean:+.1f} % [{low:+.1f}, {high:+.1f}]"


def paired(differences: list[float], target: float) -> Interval:
    """The 95 % t interval of the mean of ``differences`` (one per pair of runs), and pairs needed.

    The pairs needed are how many would make it ``target`` wide on either side at their standard
    deviation."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return Interval(mean, None, None)
    sd = statistics.stdev(differences)
    half = t975(len(differences) - 1) * sd / math.sqrt(len(differences))
    needed = next(n for n in itertools.count(2) if t975(n - 1) * sd / math.sqrt(n) <= target)
    return Interval(mean, half, needed)


# --- the measured window ---------------------------------------------------------------------

CpuSample = tuple[float, dict[str, float]]  # (time.time(), CPU seconds so far by role)


def cpu_at(samples: list[CpuSample], t: float) -> dict[str, float]:
    """The CPU seconds by role at time ``t``, interpolated between the samples around it."""
    times = [s[0] for s in samples]
    i = bisect.bisect_right(times, t)
    if not 0 < i < len(samples):
        raise RuntimeError(
            f"no CPU sample on both sides of {t:.3f} (sampled {times[0]:.3f}..{times[-1]:.3f})"
            if samples
            else "the process tree's CPU was never sampled"
        )
    (t0, before), (t1, after) = samples[i - 1], samples[i]
    f = (t - t0) / (t1 - t0)
    return {
        role: before.get(role, 0.0) + f * (after.get(role, 0.0) - before.get(role, 0.0))
        for role in before.keys() | after.keys()
    }


@dataclass(frozen=True)
class Window:
    """One run's steady state: samples/s, seconds per step, and CPU seconds per sample by role.

    The roles are the process tree's groups: ours has workers, launcher and agents, etcd."""

    samples_per_s: float
    step_s: float
    cpu: dict[str, float]
    switches: dict[str, float] = field(default_factory=dict)  # involuntary, per step, by role

    @property
    def cpu_per_sample(self) -> float:
        return sum(self.cpu.values())


def window(
    ends: list[float],
    samples: list[int],
    warmup: int,
    steps: int,
    cpu: list[CpuSample],
    switches: list[CpuSample] | None = None,
) -> Window:
    """The steady state from the step end times (time.time()) and global samples of steps 1, 2, ...

    It spans steps ``warmup + 1`` to ``warmup + steps``, timed from the end of step ``warmup``, and
    the process tree's CPU over the same span."""
    last = warmup + steps
    if len(ends) < last:
        raise RuntimeError(f"only {len(ends)} steps were timed; {last} are needed")
    start, end = ends[warmup - 1], ends[last - 1]
    count = sum(samples[warmup:last])
    before, after = cpu_at(cpu, start), cpu_at(cpu, end)
    used = {role: (after[role] - before.get(role, 0.0)) / count for role in after}
    switched = {}
    if switches:
        before, after = cpu_at(switches, start), cpu_at(switches, end)
        switched = {role: (after[role] - before.get(role, 0.0)) / steps for role in after}
    return Window(count / (end - start), (end - start) / steps, used, switched)


class TreeCPU:
    """The user + system CPU seconds of the process trees under ``roots``, summed by role.

    The role is ``role(process)``. They are read every :data:`CPU_SAMPLE_S` in a thread while in
    the ``with`` block.

    A process is found at the first reading after it starts and counted at its last reading
    after it exits; the window's processes live through it. Its role is asked at every reading,
    so a process that execs (the lifeline's) is counted under what it became.

    Beside the CPU it reads each process's involuntary context switches (:attr:`switches`): on
    Linux those of its main thread, which is the training loop's. Each is a time the kernel took
    the core from a runnable loop for another task, the cost of what runs beside it."""

    def __init__(self, roots: list[int], role: Callable[[psutil.Process], str]) -> None:
        self.samples: list[CpuSample] = []
        self.switches: list[CpuSample] = []  # involuntary context switches so far, by role
        self._last_switches: dict[int, tuple[str, float]] = {}
        self._roots = roots
        self._role = role
        self._procs: dict[int, psutil.Process] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)

    def __enter__(self) -> TreeCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * CPU_SAMPLE_S)

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(CPU_SAMPLE_S):
                return

    def _sample(self) -> None:
        t0 = time.time()
        for pid in self._roots:
            with contextlib.suppress(psutil.Error):
                root = self._procs.get(pid) or psutil.Process(pid)
                for proc in (root, *root.children(recursive=True)):
                    self._procs.setdefault(proc.pid, proc)
        for pid, proc in self._procs.items():
            with contextlib.suppress(psutil.Error):
                times, role = proc.cpu_times(), self._role(proc)
                self._last[pid] = (role, times.user + times.system)
                self._last_switches[pid] = (role, proc.num_ctx_switches().involuntary)
        t = (t0 + time.time()) / 2
        self.samples.append((t, by_role(self._last.values())))
        self.switches.append((t, by_role(self._last_switches.values())))


def by_role(values: Iterable[tuple[str, float]]) -> dict[str, float]:
    """The values summed by role."""
    totals: dict[str, float] = {}
    for role, value in values:
        totals[role] = totals.get(role, 0.0) + value
    return totals


# --- the job both runtimes train -------------------------------------------------------------


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
    intervals: tuple[int, ...]  # the rows' checkpoint intervals in steps; 0: no saves
    device_decode: bool  # ours also with data.decode=device, no saves
    profile: Path | None = None  # where each run's py-spy stacks of its window go (--profile)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


DECODED = "ours, no saves, decoded on the device"


def row_name(every: int) -> str:
    """A row by its checkpoint interval, as the output names it."""
    return f"saves every {every} steps" if every else "no saves"


# --- ours ------------------------------------------------------------------------------------


def our_role(proc: psutil.Process) -> str:
    """The part of our job a process of its tree is.

    That is a worker (and its loader processes, which share its command line), etcd, or the
    launcher and its agents."""
    if proc.name() == "etcd":
        return "etcd"
    return "workers" if "elastic.trainer" in proc.cmdline() else "launcher and agents"


def run_ours(setup: Setup, work: Path, every: int, extra: tuple[str, ...] = ()) -> Window:
    """Run one job of this project for exactly ``setup.total_steps`` steps.

    It checkpoints every ``every`` steps (0: only at its end, after the window), with the Hydra
    overrides ``extra`` besides the setup's."""
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
    argv = [
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
        f"checkpoint.every_steps={every or setup.total_steps + 1}",
        "checkpoint.interval=fixed",
        "checkpoint.every_minutes=0",
        *extra,
    ]
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env)
        last_step = LastStep(run_dir)
        profile = profiled(
            setup,
            proc.pid,
            f"{row_name(every)}-ours",
            started=lambda: last_step() >= setup.warmup,
            ended=lambda: last_step() >= setup.total_steps,
        )
        try:
            with TreeCPU([proc.pid], our_role) as cpu, profile:
                code = proc.wait(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:  # timed out: its agents and workers die with it (lifeline)
                proc.kill()
                proc.wait(timeout=60)
    steps = sorted(ev.STEP.of(read_events(run_dir)), key=lambda e: e["ts"])
    numbers = [e["step"] for e in steps]
    if code != 0 or numbers != list(range(1, setup.total_steps + 1)):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(
            f"our job exited with {code} after the steps {numbers[:3]}...{numbers[-3:]} (every "
            f"step 1..{setup.total_steps} once is needed); the end of its log:\n{tail}"
        )
    if {e["world_size"] for e in steps} != {world}:
        raise RuntimeError(f"our job did not train at world size {world} throughout")
    ends, counts = [e["ts"] for e in steps], [e["step_samples"] for e in steps]
    return window(ends, counts, setup.warmup, setup.steps, cpu.samples, cpu.switches)


class LastStep:
    """The last step our job has reported; 0 before the first.

    Each look reads only what was appended since the last: the profiler's window asks 10 times a
    second, and reading the whole run each time took CPU from the window it profiles."""

    def __init__(self, run_dir: Path) -> None:
        self._follower = EventFollower(run_dir)
        self._step = 0

    def __call__(self) -> int:
        self._step = max((e["step"] for e in ev.STEP.of(self._follower.poll())), default=self._step)
        return self._step


def profiled(
    setup: Setup, pid: int, name: str, started: Callable[[], bool], ended: Callable[[], bool]
) -> contextlib.AbstractContextManager[object]:
    """py-spy over ``pid``'s tree during the window, with ``--profile``; else nothing."""
    if setup.profile is None:
        return contextlib.nullcontext()
    out = setup.profile / f"{name.replace(' ', '-')}-{time.monotonic_ns()}.txt"
    return PyspyWindow(pid, out, started, ended, TIMEOUT_S)


# --- the peer: a plain DDP loop, as torchvision's reference train.py -------------------------


@dataclass(frozen=True)
class PlainJob:
    """What each process of the plain loop needs (picklable for torch.multiprocessing)."""

    root: str
    crop_size: int
    decode_once: bool  # data.decode=once: the split held as pixels, as ours holds it
    model: str
    batch_size: int
    seed: int
    loader_workers: int
    threads: int
    device: str
    precision: str
    channels_last: bool
    steps: int
    warmup: int  # after this many steps rank 0 touches ``warm`` (the window begins), if profiled
    world: int
    save_every: int  # rank 0 saves after every this many steps; 0: never
    checkpoint: str  # the file it saves to
    store: str  # the FileStore the group bootstraps through
    result: str  # where rank 0 writes its step times
    warm: str  # "": not profiled


def plain_save(state: dict[str, object], path: str) -> None:
    """The reference's ``utils.save_on_master``, on rank 0, made durable.

    It is made durable as bench/checkpoint.py makes its ``torch.save`` figure."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class FlippedPixels(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The peer's data set under ``data.decode=once``: our decoded-once pixels.

    Each sample is flipped at random, as the reference's ``RandomHorizontalFlip`` flips it, in
    the loader processes as ours are; the batch is normalised on the device, as ours is."""

    def __init__(self, once: DecodedOnce) -> None:
        self.images, self.targets = once.images, once.targets

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        return (image.flip(-1) if torch.rand(1).item() < 0.5 else image), self.targets[index]


def plain_worker(rank: int, job: PlainJob) -> None:
    # A session of its own, as each of our workers runs in its agent's: under the kernel's
    # autogroup scheduling (on by default) sessions are what the CPU is shared among, and ranks
    # left in the bench's one session would get half our workers' share of a busy machine.
    os.setsid()
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
        classes, _ = datasets.folder.find_classes(job.root)
        normalize = Normalize(device) if job.decode_once else None
        dataset: Dataset[Any] = (
            FlippedPixels(DecodedOnce(Path(job.root), job.crop_size, job.seed, job.threads))
            if job.decode_once
            else datasets.ImageFolder(job.root, imagenet_transform(job.crop_size))
        )
        sampler = DistributedSampler(dataset, seed=job.seed)  # type: ignore[arg-type]
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
        torch.manual_seed(job.seed)  # identical replicas without DDP's init_sync broadcast
        model = models.get_model(job.model, weights=None, num_classes=len(classes))
        model = model.to(device)
        layout = torch.channels_last if job.channels_last else torch.preserve_format
        if job.channels_last:
            model = model.to(memory_format=torch.channels_last)
        # DDPHook.wrap's options (the module docstring says why), without its comm hook.
        ddp = DistributedDataParallel(
            model,
            device_ids=[rank] if cuda else None,
            **DDP_OPTIONS,
        )
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        dtype = AUTOCAST[job.precision]
        scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
        ends: list[float] = []
        samples: list[int] = []
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for image, target in loader:
                image, target = image.to(device, memory_format=layout), target.to(device)
                if normalize is not None:  # pixels: normalised on the device, as ours are
                    image = normalize(image)
                    if job.channels_last:
                        image = image.contiguous(memory_format=torch.channels_last)
                autocast = (
                    torch.autocast(device.type, dtype=dtype)
                    if dtype is not None
                    else contextlib.nullcontext()
                )
                with autocast:
                    output = ddp(image)
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
                ends.append(time.time())  # the clock of our step events and TreeCPU's samples
                samples.append(image.shape[0] * job.world)
                if len(ends) == job.steps:
                    break
                if rank == 0 and job.warm and len(ends) == job.warmup:
                    Path(job.warm).touch()
                if rank == 0 and job.save_every and len(ends) % job.save_every == 0:
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    if scaler is not None:
                        state["scaler"] = scaler.state_dict()
                    plain_save({**state, "epoch": epoch, "step": len(ends)}, job.checkpoint)
            if len(ends) == job.steps:
                break
        if rank == 0:
            Path(job.result).write_text(json.dumps({"ends": ends, "samples": samples}))
    finally:
        dist.destroy_process_group()


def run_plain(setup: Setup, work: Path, every: int) -> Window:
    """One run of the plain loop, rank 0 saving every ``every`` steps (0: never)."""
    name = f"plain-{time.monotonic_ns()}"
    cfg = setup.cfg
    job = PlainJob(
        root=str(train_root(cfg.data)),
        crop_size=cfg.data.crop_size,
        decode_once=cfg.data.decode is config.Decode.once,
        model=cfg.model.name,
        batch_size=cfg.data.batch_size,
        seed=cfg.trainer.seed,
        loader_workers=setup.loader_workers,
        threads=setup.threads,
        device=setup.device,
        precision=setup.precision,
        channels_last=setup.channels_last,
        steps=setup.total_steps,
        warmup=setup.warmup,
        world=setup.procs,
        save_every=every,
        checkpoint=str(work / f"{name}.pth"),
        store=str(work / f"{name}.store"),
        result=str(work / f"{name}.json"),
        warm=str(work / f"{name}.warm") if setup.profile is not None else "",
    )
    profile = profiled(
        setup,
        os.getpid(),  # the ranks are this process's children
        f"{row_name(every)}-plain",
        started=lambda: Path(job.warm).exists(),
        ended=lambda: Path(job.result).exists(),
    )
    context = mp.spawn(plain_worker, args=(job,), nprocs=setup.procs, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        with TreeCPU([p.pid for p in context.processes], lambda proc: "workers") as cpu, profile:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the plain loop did not finish within {TIMEOUT_S:.0f} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=60)
    Path(job.checkpoint).unlink(missing_ok=True)
    result = json.loads(Path(job.result).read_text())
    return window(
        result["ends"], result["samples"], setup.warmup, setup.steps, cpu.samples, cpu.switches
    )


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
        validate_launch(cfg)
    except (UsageError, config.ConfigError) as exc:
        parser.error(str(exc))
    if args.device_decode and cfg.data.decode is config.Decode.once:
        parser.error(
            "--device-decode compares ours decoded on the device against ours decoded by the "
            "loader, and data.decode=once decodes neither way: leave one of them out"
        )
    if args.image_size is not None and not cfg.data.synthetic:
        parser.error("--image-size sizes the generated images: it needs data.synthetic=true")
    every, aggressive = cfg.checkpoint.every_steps, args.aggressive_every
    if problem := window_problem(args.steps, args.warmup_steps, every, aggressive):
        parser.error(problem)
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
        intervals=(0,)
        if args.no_saves_only
        else (0, every, aggressive)
        if aggressive
        else (0, every),
        device_decode=args.device_decode,
        profile=args.profile,
    )


def window_problem(steps: int, warmup: int, every: int, aggressive: int) -> str | None:
    """What keeps this window from holding whole checkpoint intervals; None when nothing does.

    The window must hold the default interval at least twice, with the round's first save at the
    default interval in the warm-up (see the module docstring)."""
    if not (aggressive == 0 or 1 <= aggressive < every):
        return (
            f"--aggressive-every {aggressive}: give a checkpoint interval in steps shorter than "
            f"checkpoint.every_steps ({every}), e.g. --aggressive-every {max(1, every // 4)}, "
            "or 0 for no such row"
        )
    lcm = math.lcm(every, aggressive or every)
    if steps % lcm or steps < 2 * every:
        fit = max(lcm, -(-2 * every // lcm) * lcm)
        return (
            f"--steps {steps}: the window must be a multiple of both checkpoint intervals "
            f"(checkpoint.every_steps={every}, --aggressive-every {aggressive}) and at least "
            f"twice checkpoint.every_steps, so that every row holds whole intervals; e.g. "
            f"--steps {fit}"
        )
    if warmup <= every:
        return (
            f"--warmup-steps {warmup}: the warm-up must hold the first save at "
            f"checkpoint.every_steps={every} (a round's first save stages the whole state and "
            f"plans the write; later ones do not): give more than {every}, e.g. "
            f"--warmup-steps {every + every // 2}"
        )
    return None


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
        *([f"--max-minutes={args.max_minutes:g}"] if args.max_minutes is not None else []),
        f"--aggressive-every={args.aggressive_every}",
        *(["--no-saves-only"] if args.no_saves_only else []),
        f"--target-ci-pct={args.target_ci_pct:g}",
        f"--model={cfg.model.name}",
        f"--batch-size={cfg.data.batch_size}",
        f"--precision={cfg.trainer.precision}",
        "--channels-last" if setup.channels_last else "--no-channels-last",
        f"--loader-workers={cfg.data.loader_workers}",
        f"--crop-size={cfg.data.crop_size}",
    ]
    if cfg.data.synthetic:
        words.append(f"--image-size={cfg.data.generate.image_size}")
    if setup.device_decode:
        words.append("--device-decode")
    overrides = list(args.overrides)
    if not any(o.startswith("checkpoint.every_steps=") for o in overrides):
        overrides.append(f"checkpoint.every_steps={cfg.checkpoint.every_steps}")
    return shlex.join([*words, *overrides])


@dataclass(frozen=True)
class Runs:
    """Every run, by row (its checkpoint interval) and runtime, in repeat order."""

    ours: dict[int, list[Window]]
    plain: dict[int, list[Window]]
    decoded: list[Window]  # ours, data.decode=device, no saves (--device-decode)


def measure(setup: Setup, repeats: int, work: Path, max_s: float | None = None) -> Runs:
    """Run every row's pair of runs, ``repeats`` times at most.

    Within a pair the runtime that goes first alternates from one repeat to the next. With
    ``max_s`` (``--max-minutes``) it stops sooner, once :func:`settled` says the goal is
    resolved or the next repeat would not fit in ``max_s``."""
    runs = Runs({e: [] for e in setup.intervals}, {e: [] for e in setup.intervals}, [])
    runtimes = (("ours", run_ours, runs.ours), ("plain", run_plain, runs.plain))
    began = time.monotonic()

    def timed(i: int, what: str, run: Callable[..., Window], *args: Any) -> Window:
        """``run(*args)``, its figures printed as repeat ``i``'s run of ``what``."""
        t0 = time.monotonic()
        w = run(*args)
        print(
            f"repeat {i + 1}/{repeats}, {what}: {w.samples_per_s:.1f} samples/s, "
            f"{w.cpu_per_sample * 1000:.1f} CPU ms/sample ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        return w

    for i in range(repeats):
        for every in setup.intervals:
            for label, run, into in runtimes if i % 2 == 0 else runtimes[::-1]:
                what = f"{row_name(every)}, {label}"
                into[every].append(timed(i, what, run, setup, work, every))
        if setup.device_decode:
            on_device = ("data.decode=device",)
            runs.decoded.append(timed(i, DECODED, run_ours, setup, work, 0, on_device))
        done = time.monotonic() - began
        if max_s is not None:
            why = settled(no_saves_overhead(runs), i + 1, done, max_s)
            if why:
                print(f"stopping after {i + 1} pairs: {why}", flush=True)
                return runs
        if i + 1 < repeats:
            left = done / (i + 1) * (repeats - i - 1)
            print(f"{done / 60:.1f} min so far, about {left / 60:.0f} min left", flush=True)
    return runs


def slower_pct(ours: list[Window], plain: list[Window], target: float) -> Interval:
    """How much slower ours ran than plain DDP in samples/s, pair by pair, with its interval."""
    pairs = zip(ours, plain, strict=True)
    return paired([(1 - o.samples_per_s / p.samples_per_s) * 100 for o, p in pairs], target)


def no_saves_overhead(runs: Runs) -> Interval:
    """Ours against plain DDP without saves, in samples/s: the row the goal is judged on."""
    return slower_pct(runs.ours[0], runs.plain[0], GOAL_PCT)


def settled(overhead: Interval, pairs: int, spent_s: float, max_s: float) -> str:
    """Why ``--max-minutes`` stops after ``pairs`` pairs ('' to go on); pure.

    It stops once the goal is resolved, met or not, by at least :data:`MIN_PAIRS` pairs, or
    when another repeat, as long as the mean one so far, would pass ``max_s``. (A sequential
    stop makes the 95 % interval a little optimistic; the pairs it took are printed.)"""
    if pairs >= MIN_PAIRS and not overhead.verdict(GOAL_PCT).startswith("unresolved"):
        return f"the goal is {overhead.verdict(GOAL_PCT)} ({overhead})"
    if spent_s / pairs * (pairs + 1) > max_s:
        return f"another pair would pass {max_s / 60:g} minutes ({overhead} so far)"
    return ""


def replica_check_s(setup: Setup, calls: int = 20) -> tuple[float, int]:
    """Seconds per replica check's checksum (:mod:`elastic.replicas`), and the bytes it reads.

    The checksum is of this job's model and optimizer state on its device. The check's all-reduce
    of one integer per rank is left out: a few bytes, next to the gradients' megabytes."""
    cfg, device = setup.cfg, torch.device(setup.device)
    classes = len(datasets.ImageFolder(str(train_root(cfg.data))).classes)
    model = build_model(cfg.model, classes).to(device)
    state = TrainState(model, build_optimizer(model, cfg.optim))
    model(torch.randn(2, 3, cfg.data.crop_size, cfg.data.crop_size, device=device)).sum().backward()
    state.optimizer.step()  # the optimizer's state (momentum) exists from the first step
    replicated = state.replicated()
    names = sorted(replicated)
    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads)  # a worker's share of the cores, as in the job
    try:
        checksum(replicated, names)  # warm
        began = time.perf_counter()
        for _ in range(calls):
            checksum(replicated, names).item()  # .item(): waits for the device, as the check does
        seconds = (time.perf_counter() - began) / calls
    finally:
        torch.set_num_threads(threads)
    return seconds, sum(t.numel() * t.element_size() for t in replicated.values())


def report(args: argparse.Namespace, setup: Setup, runs: Runs) -> None:
    """The medians of every row, ours' CPU by process, and each overhead with its interval."""
    cfg = setup.cfg
    print(
        f"\nsteady state: steps {setup.warmup + 1}-{setup.total_steps} (the first {setup.warmup} "
        f"skipped), {setup.procs} processes x {cfg.data.batch_size} images, {cfg.model.name}, "
        f"{cfg.data.crop_size} px crops of {setup.dataset_size} images, {setup.precision}, "
        f"channels_last {'on' if setup.channels_last else 'off'}, {setup.device}, "
        f"{setup.loader_workers} loader processes and {setup.threads} threads per process; "
        f"medians of {len(runs.ours[0])} runs"
    )
    print(f"{'row':44}{'samples/s':>10}{'ms/step':>9}{'CPU ms/sample':>15}   runs (samples/s)")
    rows = [
        (f"{label}, {row_name(every)}", by_row[every])
        for every in setup.intervals
        for label, by_row in (("ours", runs.ours), ("plain DDP", runs.plain))
    ]
    if runs.decoded:
        rows.append((DECODED, runs.decoded))
    for name, each in rows:
        rate = statistics.median(w.samples_per_s for w in each)
        step_ms = statistics.median(w.step_s for w in each) * 1000
        cpu_ms = statistics.median(w.cpu_per_sample for w in each) * 1000
        runs_text = " ".join(f"{w.samples_per_s:.1f}" for w in each)
        print(f"{name:44}{rate:>10.1f}{step_ms:>9.1f}{cpu_ms:>15.2f}   {runs_text}")

    print("\nours' CPU ms per sample by process (medians):")
    for every in setup.intervals:
        parts = (
            f"{role} {statistics.median(w.cpu.get(role, 0.0) for w in runs.ours[every]) * 1000:.2f}"
            for role in ("workers", "launcher and agents", "etcd")
        )
        print(f"- {row_name(every)}: " + ", ".join(parts))

    print("\ninvoluntary context switches per step, the training loops' (medians, all processes):")
    for every in setup.intervals:
        ours, plain = (
            statistics.median(w.switches.get("workers", 0.0) for w in each)
            for each in (runs.ours[every], runs.plain[every])
        )
        print(f"- {row_name(every)}: ours {ours:.1f}, plain DDP {plain:.1f}")

    target = args.target_ci_pct
    print(
        f"\noverhead of ours: mean of the {len(runs.ours[0])} per-pair overheads [95 % t "
        "interval]; "
        f"pairs a +-{target:g} % interval needs at this spread; goal <= {GOAL_PCT:g} % in "
        "samples/s"
    )
    comparisons = [(every, every) for every in setup.intervals]
    comparisons += [(every, 0) for every in setup.intervals if every]
    for mine, theirs in comparisons:
        pairs = list(zip(runs.ours[mine], runs.plain[theirs], strict=True))
        wall = slower_pct(runs.ours[mine], runs.plain[theirs], target)
        cpu = paired([(o.cpu_per_sample / p.cpu_per_sample - 1) * 100 for o, p in pairs], target)
        cost = ", what fault tolerance costs" if mine and not theirs else ""
        print(f"- ours ({row_name(mine)}) against plain DDP ({row_name(theirs)}{cost}):")
        print(f"    samples/s: {wall}{needs(wall)}; goal: {wall.verdict(GOAL_PCT)}")
        print(f"    CPU time per sample: {cpu}{needs(cpu)}")
    if runs.decoded:
        pairs = list(zip(runs.decoded, runs.ours[0], strict=True))
        gain = paired([(d.samples_per_s / h.samples_per_s - 1) * 100 for d, h in pairs], target)
        cpu = paired([(d.cpu_per_sample / h.cpu_per_sample - 1) * 100 for d, h in pairs], target)
        print("- ours decoded on the device against ours decoded by the loader (no saves):")
        print(f"    samples/s: {gain}{needs(gain)}")
        print(f"    CPU time per sample: {cpu}{needs(cpu)}")
    every = cfg.health.replica_check_every
    if every:
        seconds, size = replica_check_s(setup)
        step_s = statistics.median(w.step_s for w in runs.ours[0])
        share = 100 * seconds / every / step_s
        print(
            f"- the replica check (health.replica_check_every={every}): {seconds * 1000:.2f} ms "
            f"per check over {size / 2**20:.0f} MiB of parameters and optimizer state, "
            f"{share:.3f} % of ours' step time ({step_s * 1000:.0f} ms); goal <= "
            f"{REPLICA_GOAL_PCT:g} %: {'met' if share <= REPLICA_GOAL_PCT else 'NOT met'}"
        )
    print(f"reproduce (from the repository root): {reproduce(args, setup)}")


def needs(interval: Interval) -> str:
    """The pairs the target width needs, where the pairs so far give a spread to judge by."""
    return "" if interval.needed is None else f", {interval.needed} pairs for the target"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The defaults are the main job's (conf/config.yaml, conf/data/synthetic.yaml, "
        "conf/checkpoint/default.yaml).",
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
        "--steps",
        type=int,
        default=40,
        help="steps measured, after the warm-up: a multiple of both checkpoint intervals and at "
        "least twice checkpoint.every_steps (default: 40)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=30,
        help="steps trained first and not measured: start-up, first-step costs, the round's "
        "first save; more than checkpoint.every_steps (default: 30)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=6,
        help="pairs of runs of each row, the runtime that goes first alternating (default: 6)",
    )
    parser.add_argument(
        "--aggressive-every",
        type=int,
        default=5,
        help="the aggressive row's checkpoint interval in steps; the other row's is "
        "checkpoint.every_steps; 0: no aggressive row (default: 5)",
    )
    parser.add_argument(
        "--no-saves-only",
        action="store_true",
        help="only the no-saves row: the step's own cost, twice the pairs in the same time",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="stop sooner than --repeats once the no-saves goal is resolved (met or not, on 3 "
        "or more pairs) or the next pair would pass this many minutes",
    )
    parser.add_argument(
        "--target-ci-pct",
        type=float,
        default=GOAL_PCT,
        help="the half-width of the 95 %% interval for which the bench tells how many pairs "
        f"are needed (default: {GOAL_PCT:g})",
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
        "--device-decode",
        action="store_true",
        help="also run ours with data.decode=device (no saves): the GPU-side pipeline against "
        "the CPU loader",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="also sample each run's window with py-spy into this folder, and print ours' and "
        "the peer's CPU per step split by part (bench/step_profile.py); py-spy takes CPU too, "
        "so such a run's samples/s is no measure of the goal",
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
    if args.target_ci_pct <= 0:
        parser.error("--target-ci-pct must be above 0, e.g. --target-ci-pct 2")
    if args.max_minutes is not None and args.max_minutes <= 0:
        parser.error("--max-minutes must be above 0, e.g. --max-minutes 20")
    setup = resolve(args, parser)
    if setup.profile is not None:
        setup.profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        max_s = None if args.max_minutes is None else args.max_minutes * 60
        runs = measure(setup, args.repeats, Path(tmp), max_s)
    report(args, setup, runs)
    if setup.profile is not None:
        for every in setup.intervals:
            ours, plain = (
                step_profile.mean_split(
                    sorted(setup.profile.glob(f"{row_name(every).replace(' ', '-')}-{who}-*.txt")),
                    RATE_HZ,
                    setup.steps,
                )
                for who in ("ours", "plain")
            )
            print(f"\nprofile, {row_name(every)} (means of {len(runs.ours[0])} runs' windows):")
            print(step_profile.compare(ours, plain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
