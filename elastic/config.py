"""The typed configuration schema shared by the launcher, the agents and the workers.

Hydra composes YAML from ``conf/`` on top of these dataclasses, so OmegaConf refuses a wrong type,
an unknown key, or a spelling outside a :class:`Choice` enum (``cluster.mode``,
``cluster.device``, ``optim.policy``) while composing, with the key's full name and, for an
enum, the allowed values. A numeric key's range is declared next to the key with
:func:`bounded`; :func:`validate` checks every declared range in one walk of the schema, then the
few checks a range cannot express (relations between keys, formats, paths, storage backends,
model names), and reports every problem at once, each with the key, the value and the fix.
The agents and workers read the same schema back from the resolved ``config.yaml`` in the run
directory, so every process of a job sees exactly the configuration the launcher checked.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from elastic.cache import cached

N = TypeVar("N", int, float)
G = TypeVar("G")

# Field metadata keys: a numeric key's Bound, and the sibling flag that switches a group's
# bounds on.
_BOUND = "bound"
_WHEN = "checked_when"


@dataclass(frozen=True)
class Bound:
    """The range a numeric key must lie in, with the reason and the fix :func:`validate` prints.

    ``ge``/``gt`` and ``le``/``lt`` are the lower and upper limit (at most one of each). An empty
    ``why`` is made from the limits ("must be at least 1", "must be in (0, 1]"), so that the
    message and the check cannot disagree; a custom ``why`` says what the limit protects.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""
    fix: str = ""

    def __post_init__(self) -> None:
        if (self.ge is not None and self.gt is not None) or (
            self.le is not None and self.lt is not None
        ):
            raise TypeError("a Bound takes at most one lower (ge/gt) and one upper (le/lt) limit")
        if self.ge is None and self.gt is None and self.le is None and self.lt is None:
            raise TypeError("a Bound needs a limit")
        if not self.fix:
            raise TypeError("a Bound needs the fix its message tells the user")
        if not self.why:
            object.__setattr__(self, "why", self._phrase())

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def _phrase(self) -> str:
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            return f"must be in {left}{low:g}, {high:g}{right}"
        if self.ge is not None:
            return "must not be negative" if self.ge == 0 else f"must be at least {self.ge:g}"
        if self.gt is not None:
            return "must be positive" if self.gt == 0 else f"must be more than {self.gt:g}"
        if self.le is not None:
            return f"must be at most {self.le:g}"
        return f"must be less than {self.lt:g}"


# Fixes shared by many keys; ``{key}`` is the key's full name.
SECONDS = "set {key} to a positive number of seconds"
ANY_MINIMUM = "set {key}=0 to accept any value, or a positive minimum"


def bounded(
    default: N,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str = "",
    fix: str,
) -> N:
    """A dataclass field with ``default`` whose range :func:`validate` checks (see :class:`Bound`);
    ``{key}`` in ``fix`` stands for the key's full name.

    Declared next to the key, so that the key's type, default, comment and range are read in one
    place, and a new key cannot be added without deciding its range and fix.
    """
    bound = Bound(ge=ge, gt=gt, le=le, lt=lt, why=why, fix=fix)
    return field(default=default, metadata={_BOUND: bound})


def checked_when(flag: str, factory: Callable[[], G]) -> G:
    """A group of keys whose bounds are checked only while the sibling bool ``flag`` is on: the
    settings of something that is not used cannot stop a job."""
    return field(default_factory=factory, metadata={_WHEN: flag})


class Choice(str, Enum):
    """A closed set of spellings for a key. OmegaConf refuses any other value when the config is
    composed, naming the key and the allowed values. Members are named as they are spelled in
    YAML (OmegaConf matches by name), compare equal to that string, and print as it."""

    def __str__(self) -> str:
        return str(self.value)


class ClusterMode(Choice):
    local = "local"  # simulated nodes on this machine
    bare_metal = "bare_metal"  # one agent per machine, an external etcd


class Device(Choice):
    auto = "auto"  # CUDA when a GPU is visible, else the CPU
    cpu = "cpu"
    cuda = "cuda"


class Precision(Choice):
    """The dtype the forward and backward compute in (autocast); weights stay fp32."""

    auto = "auto"  # bf16 on a GPU that has it, else fp32
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # with a GradScaler, whose state is part of the training state


class GradDtype(Choice):
    """The dtype gradients travel in through the all-reduce (ChainerMN's FP16 all-reduce)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class CommBackend(Choice):
    """The collective library of the training group."""

    auto = "auto"  # NCCL on CUDA, gloo on the CPU
    # gloo on CUDA tensors: a test aid, for simulated nodes that share one GPU (NCCL refuses two
    # ranks on one device); slow, and never for a real job.
    gloo = "gloo"


class Decode(Choice):
    """Where a training batch's JPEGs are decoded and augmented (:mod:`elastic.pipeline`)."""

    host = "host"  # in the loader processes (PIL), the batch copied to the device as pixels
    # On the device: the loader processes read the files and draw each sample's seeded crop and
    # flip; the training process decodes the batch there (nvJPEG on CUDA) and crops it. Frees the
    # host's cores where they cannot keep a GPU fed. Evaluation still decodes on the host.
    device = "device"


class OptimizerName(Choice):
    """The update rule (:mod:`elastic.optim`)."""

    sgd = "sgd"  # momentum SGD (Goyal et al.)
    akiba = "akiba"  # RMSprop warm-up turning into momentum SGD (Akiba et al.)
    lars = "lars"  # layer-wise adaptive rate scaling (You et al.; MLPerf ResNet-50)


class Schedule(Choice):
    """The LR's shape over samples seen, after warm-up (:mod:`elastic.lr_policy`)."""

    step = "step"  # multiplied by gamma at each milestone
    poly = "poly"  # polynomial decay to end_lr_factor of the peak at the end of training


class BNStats(Choice):
    """Which batch-norm statistics evaluation uses."""

    running = "running"  # the moving averages, averaged over the ranks before evaluating
    last_batch = "last_batch"  # the last training minibatch's, averaged over the ranks (Akiba)


# What each backend's all_reduce sums, in torch 2.14. tests/test_precision.py all-reduces every
# dtype listed for gloo, so a torch that drops one fails there, not in a job's first backward.
REDUCIBLE: dict[str, frozenset[GradDtype]] = {
    "gloo": frozenset(GradDtype),
    "nccl": frozenset(GradDtype),
}


def grad_dtype_problem(backend: str, grad_dtype: GradDtype) -> str | None:
    """The refusal ``validate`` reports when ``backend`` cannot all-reduce ``grad_dtype``."""
    if grad_dtype in REDUCIBLE.get(backend, frozenset()):
        return None
    return problem(
        "comm.grad_dtype",
        str(grad_dtype),
        f"the {backend} backend cannot all-reduce {grad_dtype}",
        "set comm.grad_dtype=fp32",
    )


class Policy(Choice):
    """What a change of world size does to the batch and the LR (:mod:`elastic.lr_policy`)."""

    rescale_lr = "rescale_lr"
    keep_global_batch = "keep_global_batch"


@dataclass
class ModelConfig:
    """A torchvision classification model, built with ``num_classes`` from the data set."""

    name: str = "resnet18"
    # Goyal et al.: the last BN gamma of each residual block starts at zero.
    zero_init_residual: bool = True
    # last_batch: batch norm keeps no moving averages; evaluation uses the statistics of the last
    # training minibatch, averaged over every rank (Akiba et al.).
    bn_stats: BNStats = BNStats.running


class DataSource(Choice):
    """What a generated ImageFolder (``data.synthetic``) holds (:mod:`elastic.data`)."""

    stripes = "stripes"  # drawn here: each class its own colour and stripe angle, learnt at once
    # scikit-learn's handwritten digits (load_digits: 1,797 real 8x8 scans), upscaled; needs
    # pip install '.[digits]'
    digits = "digits"


# The fewest images of one digit in scikit-learn's load_digits (174 to 183 per digit): a
# balanced split takes at most this many of each, train and validation together.
DIGITS_PER_CLASS = 174


@dataclass
class SyntheticDataConfig:
    """How the ImageFolder of JPEGs is generated (written once at ``data.root``) when
    ``data.synthetic`` is on: drawn, or a real small data set written out as JPEGs."""

    source: DataSource = DataSource.stripes
    # stripes: how many classes to draw; digits: the digits 0 to classes - 1 (at most 10).
    classes: int = bounded(
        10, ge=2, why="need two classes to learn", fix="set data.generate.classes=2 or more"
    )
    # digits: images_per_class + val_images_per_class of each digit, at most DIGITS_PER_CLASS.
    images_per_class: int = bounded(64, ge=1, fix="set data.generate.images_per_class=1 or more")
    # The side of the square JPEGs (digits: the 8x8 scans upscaled bicubically to it).
    image_size: int = bounded(
        40, ge=16, why="too small", fix="set data.generate.image_size=16 or more"
    )
    # stripes: the images' random stream; digits: which images of each digit go to which split.
    seed: int = 0
    # The validation split (<root>/val/<class>/*.jpg): the same classes, never the same image.
    val_images_per_class: int = bounded(
        16, ge=1, fix="set data.generate.val_images_per_class=1 or more"
    )


@dataclass
class DataConfig:
    """An ImageFolder (``<root>/<train_dir>/<class>/*.jpg``) with the ImageNet transforms."""

    root: str = "data/synthetic"
    train_dir: str = "train"
    # <root>/<val_dir>/<class>/*.jpg, evaluated every trainer.eval_every_epochs; "" = none.
    val_dir: str = "val"
    # Generate a small learnable ImageFolder at ``root`` once, instead of reading a real one.
    synthetic: bool = True
    # Checked only with ``synthetic`` on: a real ImageFolder generates nothing.
    generate: SyntheticDataConfig = checked_when("synthetic", SyntheticDataConfig)
    crop_size: int = bounded(
        224,
        ge=16,
        why="too small for a ResNet",
        fix="set data.crop_size to 16 or more (224 for ImageNet)",
    )
    # The random-resized crop's smallest share of the image's area (Inception's 0.08 on
    # ImageNet): an image whose class one stroke cannot tell (a digit) needs more of it.
    min_crop_scale: float = bounded(
        0.08, gt=0, le=1, fix="set data.min_crop_scale to a share in (0, 1], e.g. 0.08"
    )
    # Per worker.
    batch_size: int = bounded(32, ge=1, fix="set data.batch_size (per worker) to 1 or more")
    # Loader processes per worker; -1: this node's cores divided among its workers.
    loader_workers: int = bounded(
        0, ge=-1, fix="set data.loader_workers=-1 (auto), 0 (load in the worker) or more"
    )
    decode: Decode = Decode.host


@dataclass
class AkibaConfig:
    """The RMSprop warm-up of Akiba et al. (arXiv:1711.04325): each update blends an RMSprop
    step into the momentum-SGD step, and the SGD share ramps from 0 to 1 in the shape of an ELU
    (:func:`elastic.optim.sgd_share`)."""

    # The ramp's middle (share 0.5) and its width, in epochs.
    center_epochs: float = bounded(10.0, ge=0, fix="set optim.akiba.center_epochs=10")
    period_epochs: float = bounded(5.0, gt=0, fix="set optim.akiba.period_epochs=5")
    # Decay of the squared-gradient average (RMSprop's alpha).
    rms_decay: float = bounded(0.99, gt=0, lt=1, fix="set optim.akiba.rms_decay=0.99")
    rms_eps: float = bounded(1e-8, gt=0, fix="set optim.akiba.rms_eps=1e-8")
    # The RMSprop step's LR as a fraction of the SGD LR (RMSprop steps are per element).
    rms_lr_ratio: float = bounded(1e-3, gt=0, fix="set optim.akiba.rms_lr_ratio=1e-3")


@dataclass
class LarsConfig:
    """LARS (arXiv:1708.03888) as MLPerf's ResNet-50 uses it: a per-layer trust ratio, none on
    batch-norm parameters and biases."""

    trust_coefficient: float = bounded(0.001, gt=0, fix="set optim.lars.trust_coefficient=0.001")
    eps: float = bounded(0.0, ge=0, fix="set optim.lars.eps=0")


@dataclass
class OptimConfig:
    """The update rule and the LR schedule; the LR follows the linear scaling rule on the global
    batch whatever the rule."""

    name: OptimizerName = OptimizerName.sgd

    # The LR for ``reference_batch`` samples (0.1 per 256 in Goyal et al.).
    lr: float = bounded(0.1, gt=0, fix="set optim.lr, e.g. optim.lr=0.1")
    reference_batch: int = bounded(256, ge=1, fix="set optim.reference_batch=256 (Goyal et al.)")
    momentum: float = bounded(0.9, ge=0, lt=1, fix="set optim.momentum=0.9")
    nesterov: bool = False
    weight_decay: float = bounded(1e-4, ge=0, fix="set optim.weight_decay=1e-4")
    # Goyal et al. apply no weight decay to batch-norm parameters and biases.
    decay_bn_and_bias: bool = False
    warmup_epochs: float = bounded(5.0, ge=0, fix="set optim.warmup_epochs=0 to switch warm-up off")
    schedule: Schedule = Schedule.step
    # step: the LR is multiplied by gamma at each milestone.
    milestones_epochs: list[float] = field(default_factory=lambda: [30.0, 60.0, 80.0])
    gamma: float = bounded(0.1, gt=0, le=1, fix="set optim.gamma=0.1")
    # Akiba et al.'s slow start: the LR is this fraction of its peak for the first epochs.
    slow_start_epochs: float = bounded(0.0, ge=0, fix="set optim.slow_start_epochs=0 (off)")
    slow_start_factor: float = bounded(
        1.0, gt=0, le=1, fix="set optim.slow_start_factor to a fraction in (0, 1]"
    )
    # poly: (1 - progress)^power from the peak after warm-up down to end_lr_factor of it.
    poly_power: float = bounded(2.0, gt=0, fix="set optim.poly_power=2 (MLPerf)")
    end_lr_factor: float = bounded(0.0, ge=0, lt=1, fix="set optim.end_lr_factor=0")
    label_smoothing: float = bounded(0.0, ge=0, lt=1, fix="set optim.label_smoothing=0.1")
    akiba: AkibaConfig = field(default_factory=AkibaConfig)
    lars: LarsConfig = field(default_factory=LarsConfig)
    # What a change of world size does: ``rescale_lr`` keeps the per-worker batch, so the global
    # batch and the LR follow the world size; ``keep_global_batch`` keeps the global batch (and
    # the LR) with gradient accumulation.
    policy: Policy = Policy.rescale_lr
    # rescale_lr: an LR increase after a resize is ramped in over this many epochs of samples.
    resize_warmup_epochs: float = bounded(
        0.1, ge=0, fix="set optim.resize_warmup_epochs=0 to apply LR increases at once"
    )


@dataclass
class CommConfig:
    """How gradients travel."""

    # The all-reduce casts each bucket to this dtype and back, through the abortable hook.
    grad_dtype: GradDtype = GradDtype.fp32
    backend: CommBackend = CommBackend.auto  # gloo: a test aid on CUDA (see CommBackend)


@dataclass
class EtcdTlsConfig:
    """TLS to an external etcd (``cluster.etcd_endpoints``); the embedded etcd is plaintext.

    ``ca`` alone: the servers are verified, the client shows no certificate. ``cert`` and ``key``
    as well: the client shows its certificate (etcd ``--client-cert-auth``). Paths to PEM files.
    """

    ca: str = ""  # the CA that signed the etcd members' certificates; "" = plaintext
    cert: str = ""  # this node's client certificate (with key)
    key: str = ""  # its private key
    # The name every member's certificate must carry (a SAN): gRPC checks one name for all the
    # members of a channel. "" = the host of the first cluster.etcd_endpoints entry.
    server_name: str = ""


@dataclass
class ClusterConfig:
    """Where the nodes come from: simulated on this machine, or one agent per bare-metal node."""

    mode: ClusterMode = ClusterMode.local
    # local: nodes to start; bare_metal: the usual size (max_nodes defaults to it).
    nodes: int = bounded(
        2, ge=1, why="a job needs at least one node", fix="set cluster.nodes to 1 or more"
    )
    min_nodes: int = bounded(1, ge=1, fix="set cluster.min_nodes=1 or more")
    # 0: the same as nodes.
    max_nodes: int = bounded(
        0, ge=0, fix="set cluster.max_nodes=0 (same as cluster.nodes) or a positive count"
    )
    node_id: str = ""  # bare_metal: defaults to the host name
    host: str = ""  # address peers reach this node at; "" = 127.0.0.1 (local) or the FQDN
    device: Device = Device.auto
    # 0: one per visible GPU, or cpu_workers on CPU.
    workers_per_node: int = bounded(0, ge=0, fix="use 0 (one per GPU) or a positive count")
    cpu_workers: int = bounded(1, ge=1, fix="set cluster.cpu_workers=1 or more")
    # 0: this machine's cores shared among its workers.
    threads_per_worker: int = bounded(
        0, ge=0, fix="use 0 (share this machine's cores) or a positive count"
    )
    etcd_endpoints: list[str] = field(default_factory=list)  # empty (local): embedded etcd
    etcd_tls: EtcdTlsConfig = field(default_factory=EtcdTlsConfig)
    # etcd user authentication: the user, and a file holding its password (else the password is
    # read from the ELASTIC_ETCD_PASSWORD environment variable; never from the command line).
    etcd_user: str = ""
    etcd_password_file: str = ""
    # local, no etcd_endpoints: members of the embedded etcd; 3 survive the loss of one member.
    embedded_etcd_members: int = bounded(
        1, ge=1, le=3, fix="set cluster.embedded_etcd_members=1 or 3"
    )
    # Worker crashes a node survives before it leaves the job.
    max_restarts: int = bounded(10, ge=0, fix="set cluster.max_restarts=0 or more")


@dataclass
class RendezvousConfig:
    """Membership in etcd: leases, round formation, and how long each wait may take."""

    prefix: str = "/elastic"
    lease_ttl_s: int = bounded(
        3,
        ge=2,
        why="etcd does not keep leases shorter than 2 s",
        fix="set rendezvous.lease_ttl_s=2 or more",
    )
    settle_s: float = bounded(1.0, ge=0, fix=SECONDS)
    # The first round of a job waits up to this long for max_nodes, so that nodes that start a
    # few seconds apart do not cause a restart right after the job began.
    first_round_wait_s: float = bounded(30.0, ge=0, fix=SECONDS)
    join_timeout_s: float = bounded(600.0, gt=0, fix=SECONDS)
    pg_timeout_s: float = bounded(120.0, gt=0, fix=SECONDS)
    resync_s: float = bounded(30.0, gt=0, fix=SECONDS)
    # A worker whose heartbeat stops, or that computes one step this long without handing its
    # gradients to the network, is taken for frozen (SIGSTOP, a hung GPU) and its node evicted.
    watchdog_s: float = bounded(10.0, gt=0, fix=SECONDS)
    # After a failed collective, a peer agent that refuses a TCP connection within this long is
    # dead (its machine is up but the node's processes are gone) and is dropped at once,
    # without waiting for its lease to expire.
    probe_timeout_s: float = bounded(0.5, gt=0, fix=SECONDS)
    # etcd may be away this long (a restart, a leader election, a network blip) while the job
    # trains on; past it every node stops cleanly and the newest checkpoint is kept.
    etcd_grace_s: float = bounded(60.0, gt=0, fix=SECONDS)


class CheckpointInterval(Choice):
    """How far apart checkpoints are (:mod:`elastic.checkpoint_interval`)."""

    fixed = "fixed"  # every_steps, or every_minutes when that comes first
    auto = "auto"  # Young/Daly: sqrt(2 x the measured save cost x the MTBF)


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints to an fsspec URL, committed by a JSON manifest."""

    url: str = ""  # "" = file://<run_dir>/checkpoints
    every_steps: int = bounded(
        50, ge=1, fix="set checkpoint.every_steps to the steps between checkpoints"
    )
    # Also at most this many minutes apart, converted to steps from the measured step time at
    # each save; 0: by steps alone.
    every_minutes: float = bounded(
        0.0, ge=0, fix="set checkpoint.every_minutes to 0 (off) or the minutes between checkpoints"
    )
    interval: CheckpointInterval = CheckpointInterval.fixed
    # The job's mean time between failures, for interval=auto; 0: Llama 3's rate (419
    # interruptions in 54 days on 16,384 GPUs) scaled to the job's GPUs (its world size).
    mtbf_hours: float = bounded(
        0.0, ge=0, fix="set checkpoint.mtbf_hours to 0 (derived) or the job's MTBF in hours"
    )
    keep: int = bounded(3, ge=1, why="must keep at least one", fix="set checkpoint.keep=1 or more")


@dataclass
class HealthConfig:
    """What a node must prove before it joins a round, and how a node that keeps failing is kept
    out. The checks are in :mod:`launcher.health.checks` and :mod:`launcher.health.gpu`."""

    enabled: bool = True
    # NCCL opens several descriptors per peer and channel, and the data loader one per shared
    # batch: ChainerMN hit "unhandled system error" at 192 GPUs with the default 1024. The soft
    # limit is raised to the hard one; below this the node fails.
    min_open_files: int = bounded(4096, ge=0, fix=ANY_MINIMUM)
    # Deep call chains in NCCL's and MPI's progress threads segfaulted ChainerMN at 944 GPUs with
    # a small stack. A lower soft limit is raised to this; a hard limit below it fails.
    min_stack_mb: int = bounded(8, ge=0, fix=ANY_MINIMUM)
    # NCCL's intra-node transport and the data loader's workers pass tensors through /dev/shm
    # (Docker gives 64 MB unless told --shm-size). Fails on GPU nodes or with loader workers,
    # warns otherwise.
    min_shm_mb: int = bounded(512, ge=0, fix=ANY_MINIMUM)
    # Free space where checkpoints go, at least this much and at least checkpoint.keep + 1
    # checkpoints of the model (a new one is written before the oldest is deleted).
    # The etcd client certificate and CA (cluster.etcd_tls) warn this many days before they
    # expire; an expired one fails.
    cert_warn_days: int = bounded(14, ge=0, fix="set health.cert_warn_days=14 (0: no warning)")
    min_checkpoint_free_gb: float = bounded(
        1.0,
        ge=0,
        fix="set health.min_checkpoint_free_gb=0 to check only the estimated checkpoint size",
    )
    etcd_timeout_s: float = bounded(3.0, gt=0, fix=SECONDS)
    # The node's wall clock against the etcd server's: event times and round ages compare
    # clocks across nodes.
    max_clock_skew_s: float = bounded(2.0, gt=0, fix=SECONDS)
    # GPUs this node must see; 0: cluster.workers_per_node, or at least one.
    expected_gpus: int = bounded(0, ge=0, fix=ANY_MINIMUM)
    max_gpu_temp_c: int = 85
    # Hardware slowdown (thermal, power brake) is a warning unless this is on.
    fail_on_throttle: bool = False
    # The share of each GPU's free memory the allocation probe fills and reads back.
    gpu_memory_fraction: float = bounded(
        0.9, gt=0, le=0.99, fix="set health.gpu_memory_fraction=0.9"
    )
    # The matmul, memory and all-reduce probes run in a child process with this time limit: a
    # hung GPU fails the check instead of hanging the agent.
    gpu_probe_timeout_s: float = bounded(120.0, gt=0, fix=SECONDS)
    # Quarantine: this many failures (failed checks, worker crashes, fencing) within
    # strike_window_s keep the node out of the job for quarantine_s.
    max_strikes: int = bounded(
        3, ge=1, fix="set health.max_strikes=3 (failures before a node is quarantined)"
    )
    strike_window_s: float = bounded(3600.0, gt=0, fix=SECONDS)
    quarantine_s: float = bounded(
        1800.0,
        ge=2,
        why="etcd does not keep leases shorter than 2 s",
        fix="set health.quarantine_s=2 or more",
    )


@dataclass
class TrainerConfig:
    epochs: float = bounded(3.0, gt=0, fix="set trainer.epochs=1")
    seed: int = 0
    # Steps between step events (progress, stall measurement).
    log_every: int = bounded(1, ge=1, fix="set trainer.log_every=1")
    # Every rank logs the sample indices of every step it trains (``samples`` events), so a chaos
    # run can prove that each sample of an epoch was trained exactly once. Off for long runs.
    record_samples: bool = False
    precision: Precision = Precision.auto
    # NHWC memory layout for convolutions; null: on for CUDA, off on CPU.
    channels_last: bool | None = None
    # Validation every this many epochs (of samples seen) and at the end; 0: only at the end.
    eval_every_epochs: float = bounded(
        1.0, ge=0, fix="set trainer.eval_every_epochs=0 to evaluate only at the end"
    )


@dataclass
class ChaosConfig:
    """Whether this job's agents carry out fault requests (``python -m chaos campaign.attach``).

    Off by default: with it on, anyone who can write the job's etcd prefix can stop, freeze or
    kill this job's processes (README, "Chaos on bare metal").
    """

    allow: bool = False


@dataclass
class Config:
    job_id: str = ""  # local: a timestamp when empty; bare_metal: required, the same on every node
    run_dir: str = ""  # "" = runs/<job_id>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


def load(path: str | os.PathLike[str]) -> Config:
    """Read a resolved ``config.yaml`` back into the typed schema."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def save(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` to ``path`` atomically: on bare metal every node's launcher writes the
    same file in the shared run directory while other nodes' agents may be reading it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    OmegaConf.save(OmegaConf.structured(cfg), partial)
    os.replace(partial, path)


def max_nodes(cfg: Config) -> int:
    return cfg.cluster.max_nodes or cfg.cluster.nodes


# A job id is one path segment and one etcd key segment. Without '/' and '.', the job's keys
# (<prefix>/<job_id>/ and <prefix>/<job_id>.health/) are never under another job's prefix.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def problem(key: str, value: object, why: str, fix: str) -> str:
    """The one shape of a refusal: the key as typed on the command line, its value, why it
    cannot work, and what to write instead."""
    return f"{key}={value!r}: {why}. Fix: {fix}."


def _bound_problems(node: Any, prefix: str = "") -> Iterator[str]:
    """Every declared :class:`Bound` that ``node`` (a schema dataclass) or a group in it breaks.

    Walks the fields in declaration order and recurses into groups with the dotted prefix, so
    the keys are named as on the command line. A group declared with :func:`checked_when` is
    skipped while its flag is off.
    """
    for f in fields(node):
        value = getattr(node, f.name)
        key = prefix + f.name
        if is_dataclass(value):
            flag = f.metadata.get(_WHEN)
            if flag is None or getattr(node, flag):
                yield from _bound_problems(value, key + ".")
            continue
        bound: Bound | None = f.metadata.get(_BOUND)
        if bound is not None and not bound.holds(value):
            yield problem(key, value, bound.why, bound.fix.format(key=key))


ETCD_PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"


def credential_problems(
    ca: str,
    cert: str,
    key: str,
    server_name: str,
    user: str,
    password_file: str,
    name: Callable[[str], str],
) -> list[str]:
    """What is wrong with a set of etcd credentials, before any connection: a file that cannot
    be read, a certificate without its key, TLS settings without the CA, a password without a
    user, a user without a password source. ``name`` spells each setting as the user wrote it
    (``ca`` is ``cluster.etcd_tls.ca`` to the launcher, ``rdzv_conf ca`` under torchrun), so
    that both front ends share one set of rules and each names its own keys."""
    problems: list[str] = []
    for setting, path in (("ca", ca), ("cert", cert), ("key", key)):
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            problems.append(
                problem(
                    name(setting),
                    path,
                    "not a readable file",
                    f"point {name(setting)} at the PEM file (readable by this user)",
                )
            )
    if bool(cert) != bool(key):
        have, missing = ("cert", "key") if cert else ("key", "cert")
        problems.append(
            problem(
                name(have),
                cert or key,
                f"a client certificate needs both cert and key, and {name(missing)} is not set",
                f"set {name(missing)} too, or neither (server-auth TLS with {name('ca')} alone)",
            )
        )
    if (cert or server_name) and not ca:
        problems.append(
            problem(
                name("ca"),
                "",
                "TLS to etcd needs the CA that signed the etcd members' certificates",
                f"set {name('ca')}=/path/to/ca.pem",
            )
        )
    if password_file and not user:
        problems.append(
            problem(
                name("password_file"),
                password_file,
                f"a password without {name('user')}",
                f"set {name('user')}=<the etcd user>",
            )
        )
    if (
        user
        and password_file
        and not (os.path.isfile(password_file) and os.access(password_file, os.R_OK))
    ):
        problems.append(
            problem(
                name("password_file"),
                password_file,
                "not a readable file",
                f"point {name('password_file')} at a file holding the etcd user's password "
                "(chmod 600), readable by this user",
            )
        )
    elif user and not password_file and not os.environ.get(ETCD_PASSWORD_ENV):
        problems.append(
            problem(
                name("password_file"),
                "",
                f"{name('user')}={user!r} needs a password, and neither this setting nor "
                f"${ETCD_PASSWORD_ENV} is set",
                f"set {name('password_file')}=/path/to/password (chmod 600), or export "
                f"{ETCD_PASSWORD_ENV} in the launcher's environment",
            )
        )
    return problems


_CLUSTER_NAMES = {
    "ca": "cluster.etcd_tls.ca",
    "cert": "cluster.etcd_tls.cert",
    "key": "cluster.etcd_tls.key",
    "server_name": "cluster.etcd_tls.server_name",
    "user": "cluster.etcd_user",
    "password_file": "cluster.etcd_password_file",
}


def etcd_security_problems(c: ClusterConfig) -> list[str]:
    """:func:`credential_problems` of ``cluster.etcd_tls`` and the etcd user, and TLS or a user
    set for the embedded etcd (which is plaintext and has no users)."""
    tls, external = c.etcd_tls, bool(c.etcd_endpoints)
    # A user for the embedded etcd is refused below; its password is then beside the point.
    user, password_file = (
        ("", "")
        if c.etcd_user and not external
        else (
            c.etcd_user,
            c.etcd_password_file,
        )
    )
    problems = credential_problems(
        tls.ca, tls.cert, tls.key, tls.server_name, user, password_file, _CLUSTER_NAMES.__getitem__
    )
    if not external and (tls.ca or c.etcd_user):
        key = "cluster.etcd_tls.ca" if tls.ca else "cluster.etcd_user"
        problems.append(
            problem(
                key,
                tls.ca or c.etcd_user,
                "without cluster.etcd_endpoints the job runs an embedded etcd, which is plaintext "
                "and has no users",
                "set cluster.etcd_endpoints to the secured etcd cluster, or unset "
                "cluster.etcd_tls.* and cluster.etcd_user",
            )
        )
    return problems


# Refused by validate and by elastic.data's writer alike (which a caller may reach unvalidated).
NO_SCIKIT_LEARN = problem(
    "data.generate.source",
    "digits",
    "the digits come with scikit-learn, which is not installed",
    "pip install '.[digits]' (scikit-learn), or use data.generate.source=stripes",
)


def digits_problems(g: SyntheticDataConfig, val_dir: str) -> list[str]:
    """What keeps ``data.generate`` from a balanced split of scikit-learn's digits: more classes
    than the 10 digits, more images of a digit than the scarcest digit has, no scikit-learn."""
    problems = []
    if g.classes > 10:
        problems.append(
            problem(
                "data.generate.classes",
                g.classes,
                "the digits are 10 classes (0 to 9)",
                "set data.generate.classes=10 or fewer (the digits 0 to classes - 1)",
            )
        )
    wanted = g.images_per_class + (g.val_images_per_class if val_dir else 0)
    if wanted > DIGITS_PER_CLASS:
        held_out = f" and {g.val_images_per_class} held out" if val_dir else ""
        problems.append(
            problem(
                "data.generate.images_per_class",
                g.images_per_class,
                f"{g.images_per_class} images of each digit to train on{held_out} make "
                f"{wanted}, and the scarcest digit has {DIGITS_PER_CLASS}",
                "lower data.generate.images_per_class or data.generate.val_images_per_class "
                f"until they add up to {DIGITS_PER_CLASS} at most",
            )
        )
    if importlib.util.find_spec("sklearn") is None:
        problems.append(NO_SCIKIT_LEARN)
    return problems


def torchvision_models() -> list[str]:
    """The names of torchvision's classification models (``model.name``'s choices), learned
    once per torchvision version (:mod:`elastic.cache`)."""

    def learn() -> list[str]:
        from torchvision import models

        return models.list_models(module=models)

    def valid(found: object) -> bool:
        return isinstance(found, list) and all(isinstance(n, str) for n in found)

    version = importlib.metadata.version("torchvision")
    return cached(f"torchvision-{version}-models", valid, learn)


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` listing every value that cannot work, each with its fix.

    First every range declared with :func:`bounded`, then what a range cannot express:
    relations between keys, formats (etcd endpoints, the rendezvous prefix, sorted milestones),
    and what the machine must have (a directory, a storage backend, a torchvision model). All
    problems are reported at once, so that one launch attempt shows everything to fix.
    """
    problems: list[str] = list(_bound_problems(cfg))

    def need(ok: bool, key: str, value: object, why: str, fix: str) -> None:
        if not ok:
            problems.append(problem(key, value, why, fix))

    c = cfg.cluster
    need(
        c.min_nodes <= max_nodes(cfg),
        "cluster.min_nodes",
        c.min_nodes,
        f"more than the most nodes a round may hold ({max_nodes(cfg)})",
        "lower cluster.min_nodes or raise cluster.max_nodes / cluster.nodes",
    )
    need(
        c.embedded_etcd_members in (1, 3),
        "cluster.embedded_etcd_members",
        c.embedded_etcd_members,
        "etcd needs an odd number of members, and a 3-member cluster is the one that survives "
        "the loss of a member",
        "set cluster.embedded_etcd_members=1 or 3",
    )
    if c.mode == "bare_metal":
        need(
            bool(cfg.job_id),
            "job_id",
            cfg.job_id,
            "bare_metal nodes find each other by job id",
            "pass job_id=<name>, the same on every node",
        )
        need(
            bool(c.etcd_endpoints),
            "cluster.etcd_endpoints",
            c.etcd_endpoints,
            "bare_metal nodes need a shared etcd cluster",
            "pass cluster.etcd_endpoints=[host1:2379,host2:2379,host3:2379]",
        )
    problems += etcd_security_problems(c)
    for ep in c.etcd_endpoints:
        host, _, port = ep.rpartition(":")
        need(
            bool(host) and port.isdigit(),
            "cluster.etcd_endpoints",
            ep,
            "an endpoint is host:port",
            "write each endpoint as host:port, e.g. 10.0.0.1:2379",
        )

    need(
        not cfg.job_id or JOB_ID.fullmatch(cfg.job_id) is not None,
        "job_id",
        cfg.job_id,
        "it names the run directory and the job's etcd keys, so it must be one safe path "
        "segment that no other job id extends (no '/', '.', spaces)",
        "use letters, digits, '-' and '_', at most 128, starting with a letter or digit "
        "(e.g. job_id=resnet50-run1)",
    )
    r = cfg.rendezvous
    need(
        r.prefix.startswith("/") and not r.prefix.endswith("/"),
        "rendezvous.prefix",
        r.prefix,
        "must start with '/' and not end with one",
        "use e.g. rendezvous.prefix=/elastic",
    )

    d = cfg.data
    if not d.synthetic:
        train = Path(d.root) / d.train_dir
        need(
            train.is_dir(),
            "data.root",
            d.root,
            f"{train} is not a directory",
            "point data.root at an ImageFolder whose train split is "
            "<data.root>/<data.train_dir>/<class>/<image>, or use data=synthetic",
        )
        if d.val_dir:
            val = Path(d.root) / d.val_dir
            need(
                val.is_dir(),
                "data.val_dir",
                d.val_dir,
                f"{val} is not a directory",
                'set data.val_dir="" to train without validation, or point it at the validation '
                "split sorted into class folders (<data.root>/<data.val_dir>/<class>/<image>)",
            )
    elif d.generate.source == DataSource.digits:
        problems += digits_problems(d.generate, d.val_dir)

    o = cfg.optim
    need(
        list(o.milestones_epochs) == sorted(o.milestones_epochs),
        "optim.milestones_epochs",
        o.milestones_epochs,
        "must be in increasing order",
        "sort the milestones",
    )

    need(
        o.schedule != "poly" or o.warmup_epochs < cfg.trainer.epochs,
        "optim.warmup_epochs",
        o.warmup_epochs,
        f"the poly schedule decays after warm-up, and trainer.epochs={cfg.trainer.epochs:g}",
        "lower optim.warmup_epochs below trainer.epochs, or train longer",
    )
    need(
        not (o.nesterov and o.name != "sgd"),
        "optim.nesterov",
        o.nesterov,
        f"optim.name={o.name} has no Nesterov form",
        "set optim.nesterov=false, or use optim=sgd",
    )

    need(
        cfg.comm.backend != CommBackend.gloo or c.device == Device.cuda,
        "comm.backend",
        cfg.comm.backend,
        f"gloo on CUDA tensors is a test aid for simulated nodes that share one GPU, and "
        f"cluster.device={c.device} (on the CPU the backend is gloo already)",
        "remove comm.backend=gloo, or set cluster.device=cuda for a test on one GPU",
    )
    backends = {"cpu": ["gloo"], "cuda": ["nccl"], "auto": ["gloo", "nccl"]}[str(c.device)]
    if cfg.comm.backend == CommBackend.gloo:
        backends = ["gloo"]
    problems += [p for b in backends if (p := grad_dtype_problem(b, cfg.comm.grad_dtype))]

    k = cfg.checkpoint
    if k.url:
        import fsspec

        protocol = k.url.split("://", 1)[0] if "://" in k.url else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            need(
                False,
                "checkpoint.url",
                k.url,
                f"fsspec cannot write there ({exc})",
                "use a file:// URL or install the fsspec backend for that scheme",
            )

    if cfg.model.name:
        need(
            cfg.model.name in torchvision_models(),
            "model.name",
            cfg.model.name,
            "not a torchvision classification model",
            "use model=resnet18 or model=resnet50, or model.name=<one of "
            "torchvision.models.list_models()>",
        )
    else:
        need(False, "model.name", "", "empty", "use model=resnet18 or model=resnet50")

    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
