"""The typed configuration schema shared by the launcher, the agents and the workers.

Hydra composes YAML from ``conf/`` on top of these dataclasses, so a wrong type or an unknown key
is refused by OmegaConf with the key's full name. :func:`validate` adds the checks that types
cannot express (ranges, relations between keys, paths) and names the key and the fix for each.
The agents and workers read the same schema back from the resolved ``config.yaml`` in the run
directory, so every process of a job sees exactly the configuration the launcher checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from omegaconf import OmegaConf


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


@dataclass
class SyntheticDataConfig:
    """How the stand-in ImageFolder of JPEGs is generated when ``data.synthetic`` is on."""

    classes: int = 10
    images_per_class: int = 64
    image_size: int = 40
    seed: int = 0


@dataclass
class DataConfig:
    """An ImageFolder (``<root>/<train_dir>/<class>/*.jpg``) with the ImageNet transforms."""

    root: str = "data/synthetic"
    train_dir: str = "train"
    # Generate a small learnable ImageFolder at ``root`` once, instead of reading a real one.
    synthetic: bool = True
    generate: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    crop_size: int = 224
    batch_size: int = 32  # per worker
    loader_workers: int = 0


@dataclass
class OptimConfig:
    """SGD with momentum; the LR follows the linear scaling rule on the global batch."""

    lr: float = 0.1  # the LR for ``reference_batch`` samples (0.1 per 256 in Goyal et al.)
    reference_batch: int = 256
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    # Goyal et al. apply no weight decay to batch-norm parameters and biases.
    decay_bn_and_bias: bool = False
    warmup_epochs: float = 5.0
    milestones_epochs: list[float] = field(default_factory=lambda: [30.0, 60.0, 80.0])
    gamma: float = 0.1
    # What a change of world size does: ``rescale_lr`` keeps the per-worker batch, so the global
    # batch and the LR follow the world size; ``keep_global_batch`` keeps the global batch (and
    # the LR) with gradient accumulation.
    policy: Policy = Policy.rescale_lr
    # rescale_lr: an LR increase after a resize is ramped in over this many epochs of samples.
    resize_warmup_epochs: float = 0.1


@dataclass
class ClusterConfig:
    """Where the nodes come from: simulated on this machine, or one agent per bare-metal node."""

    mode: ClusterMode = ClusterMode.local
    nodes: int = 2  # local: nodes to start; bare_metal: the usual size (max_nodes defaults to it)
    min_nodes: int = 1
    max_nodes: int = 0  # 0: the same as nodes
    node_id: str = ""  # bare_metal: defaults to the host name
    host: str = ""  # address peers reach this node at; "" = 127.0.0.1 (local) or the FQDN
    device: Device = Device.auto
    workers_per_node: int = 0  # 0: one per visible GPU, or cpu_workers on CPU
    cpu_workers: int = 1
    threads_per_worker: int = 0  # 0: this machine's cores shared among its workers
    etcd_endpoints: list[str] = field(default_factory=list)  # empty (local): embedded etcd
    max_restarts: int = 10  # worker crashes a node survives before it leaves the job


@dataclass
class RendezvousConfig:
    """Membership in etcd: leases, round formation, and how long each wait may take."""

    prefix: str = "/elastic"
    lease_ttl_s: int = 3
    settle_s: float = 1.0
    # The first round of a job waits up to this long for max_nodes, so that nodes that start a
    # few seconds apart do not cause a restart right after the job began.
    first_round_wait_s: float = 30.0
    join_timeout_s: float = 600.0
    pg_timeout_s: float = 120.0
    resync_s: float = 30.0
    # A worker whose heartbeat stops, or that computes one step this long without handing its
    # gradients to the network, is taken for frozen (SIGSTOP, a hung GPU) and its node evicted.
    watchdog_s: float = 10.0
    # After a failed collective, a peer agent that refuses a TCP connection within this long is
    # dead (its machine is up but the node's processes are gone) and is dropped at once,
    # without waiting for its lease to expire.
    probe_timeout_s: float = 0.5


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints to an fsspec URL, committed by a JSON manifest."""

    url: str = ""  # "" = file://<run_dir>/checkpoints
    every_steps: int = 50
    keep: int = 3


@dataclass
class HealthConfig:
    """What a node must prove before it joins a round, and how a node that keeps failing is kept
    out. The checks are in :mod:`launcher.health` and :mod:`launcher.gpu_health`."""

    enabled: bool = True
    # NCCL opens several descriptors per peer and channel, and the data loader one per shared
    # batch: ChainerMN hit "unhandled system error" at 192 GPUs with the default 1024. The soft
    # limit is raised to the hard one; below this the node fails.
    min_open_files: int = 4096
    # Deep call chains in NCCL's and MPI's progress threads segfaulted ChainerMN at 944 GPUs with
    # a small stack. A lower soft limit is raised to this; a hard limit below it fails.
    min_stack_mb: int = 8
    # NCCL's intra-node transport and the data loader's workers pass tensors through /dev/shm
    # (Docker gives 64 MB unless told --shm-size). Fails on GPU nodes or with loader workers,
    # warns otherwise.
    min_shm_mb: int = 512
    # Free space where checkpoints go, at least this much and at least checkpoint.keep + 1
    # checkpoints of the model (a new one is written before the oldest is deleted).
    min_checkpoint_free_gb: float = 1.0
    etcd_timeout_s: float = 3.0
    # The node's wall clock against the etcd server's: event times and round ages compare
    # clocks across nodes.
    max_clock_skew_s: float = 2.0
    # GPUs this node must see; 0: cluster.workers_per_node, or at least one.
    expected_gpus: int = 0
    max_gpu_temp_c: int = 85
    # Hardware slowdown (thermal, power brake) is a warning unless this is on.
    fail_on_throttle: bool = False
    # The share of each GPU's free memory the allocation probe fills and reads back.
    gpu_memory_fraction: float = 0.9
    # The matmul, memory and all-reduce probes run in a child process with this time limit: a
    # hung GPU fails the check instead of hanging the agent.
    gpu_probe_timeout_s: float = 120.0
    # Quarantine: this many failures (failed checks, worker crashes, fencing) within
    # strike_window_s keep the node out of the job for quarantine_s.
    max_strikes: int = 3
    strike_window_s: float = 3600.0
    quarantine_s: float = 1800.0


@dataclass
class TrainerConfig:
    epochs: float = 3.0
    seed: int = 0
    log_every: int = 1  # steps between step events (progress, stall measurement)
    # Every rank logs the sample indices of every step it trains (``samples`` events), so a chaos
    # run can prove that each sample of an epoch was trained exactly once. Off for long runs.
    record_samples: bool = False


@dataclass
class Config:
    job_id: str = ""  # local: a timestamp when empty; bare_metal: required, the same on every node
    run_dir: str = ""  # "" = runs/<job_id>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


def load(path: str | os.PathLike[str]) -> Config:
    """Read a resolved ``config.yaml`` back into the typed schema."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def save(cfg: Config, path: str | os.PathLike[str]) -> None:
    OmegaConf.save(OmegaConf.structured(cfg), path)


def max_nodes(cfg: Config) -> int:
    return cfg.cluster.max_nodes or cfg.cluster.nodes


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` listing every value that cannot work, each with its fix."""
    problems: list[str] = []

    def need(ok: bool, key: str, value: object, why: str, fix: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r}: {why}. Fix: {fix}.")

    c = cfg.cluster
    need(
        c.nodes >= 1,
        "cluster.nodes",
        c.nodes,
        "a job needs at least one node",
        "set cluster.nodes to 1 or more",
    )
    need(
        c.min_nodes >= 1,
        "cluster.min_nodes",
        c.min_nodes,
        "must be at least 1",
        "set cluster.min_nodes=1 or more",
    )
    need(
        c.max_nodes >= 0,
        "cluster.max_nodes",
        c.max_nodes,
        "must not be negative",
        "set cluster.max_nodes=0 (same as cluster.nodes) or a positive count",
    )
    need(
        c.min_nodes <= max_nodes(cfg),
        "cluster.min_nodes",
        c.min_nodes,
        f"more than the most nodes a round may hold ({max_nodes(cfg)})",
        "lower cluster.min_nodes or raise cluster.max_nodes / cluster.nodes",
    )
    need(
        c.workers_per_node >= 0,
        "cluster.workers_per_node",
        c.workers_per_node,
        "must not be negative",
        "use 0 (one per GPU) or a positive count",
    )
    need(
        c.cpu_workers >= 1,
        "cluster.cpu_workers",
        c.cpu_workers,
        "must be at least 1",
        "set cluster.cpu_workers=1 or more",
    )
    need(
        c.threads_per_worker >= 0,
        "cluster.threads_per_worker",
        c.threads_per_worker,
        "must not be negative",
        "use 0 (share this machine's cores) or a positive count",
    )
    need(
        c.max_restarts >= 0,
        "cluster.max_restarts",
        c.max_restarts,
        "must not be negative",
        "set cluster.max_restarts=0 or more",
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
    for ep in c.etcd_endpoints:
        host, _, port = ep.rpartition(":")
        need(
            bool(host) and port.isdigit(),
            "cluster.etcd_endpoints",
            ep,
            "an endpoint is host:port",
            "write each endpoint as host:port, e.g. 10.0.0.1:2379",
        )

    r = cfg.rendezvous
    need(
        r.prefix.startswith("/") and not r.prefix.endswith("/"),
        "rendezvous.prefix",
        r.prefix,
        "must start with '/' and not end with one",
        "use e.g. rendezvous.prefix=/elastic",
    )
    need(
        r.lease_ttl_s >= 2,
        "rendezvous.lease_ttl_s",
        r.lease_ttl_s,
        "etcd does not keep leases shorter than 2 s",
        "set rendezvous.lease_ttl_s=2 or more",
    )
    for key in (
        "settle_s",
        "first_round_wait_s",
        "join_timeout_s",
        "pg_timeout_s",
        "resync_s",
        "watchdog_s",
        "probe_timeout_s",
    ):
        value = getattr(r, key)
        need(
            value >= 0 if key in ("settle_s", "first_round_wait_s") else value > 0,
            f"rendezvous.{key}",
            value,
            "must be positive",
            f"set rendezvous.{key} to a positive number of seconds",
        )

    d = cfg.data
    need(
        d.batch_size >= 1,
        "data.batch_size",
        d.batch_size,
        "must be at least 1",
        "set data.batch_size (per worker) to 1 or more",
    )
    need(
        d.crop_size >= 16,
        "data.crop_size",
        d.crop_size,
        "too small for a ResNet",
        "set data.crop_size to 16 or more (224 for ImageNet)",
    )
    need(
        d.loader_workers >= 0,
        "data.loader_workers",
        d.loader_workers,
        "must not be negative",
        "set data.loader_workers=0 (load in the worker) or more",
    )
    if d.synthetic:
        g = d.generate
        need(
            g.classes >= 2,
            "data.generate.classes",
            g.classes,
            "need two classes to learn",
            "set data.generate.classes=2 or more",
        )
        need(
            g.images_per_class >= 1,
            "data.generate.images_per_class",
            g.images_per_class,
            "must be at least 1",
            "set data.generate.images_per_class=1 or more",
        )
        need(
            g.image_size >= 16,
            "data.generate.image_size",
            g.image_size,
            "too small",
            "set data.generate.image_size=16 or more",
        )
    else:
        train = Path(d.root) / d.train_dir
        need(
            train.is_dir(),
            "data.root",
            d.root,
            f"{train} is not a directory",
            "point data.root at an ImageFolder whose train split is "
            "<data.root>/<data.train_dir>/<class>/<image>, or use data=synthetic",
        )

    o = cfg.optim
    need(o.lr > 0, "optim.lr", o.lr, "must be positive", "set optim.lr, e.g. optim.lr=0.1")
    need(
        o.reference_batch >= 1,
        "optim.reference_batch",
        o.reference_batch,
        "must be at least 1",
        "set optim.reference_batch=256 (Goyal et al.)",
    )
    need(
        0 <= o.momentum < 1,
        "optim.momentum",
        o.momentum,
        "must be in [0, 1)",
        "set optim.momentum=0.9",
    )
    need(
        o.weight_decay >= 0,
        "optim.weight_decay",
        o.weight_decay,
        "must not be negative",
        "set optim.weight_decay=1e-4",
    )
    need(
        o.warmup_epochs >= 0,
        "optim.warmup_epochs",
        o.warmup_epochs,
        "must not be negative",
        "set optim.warmup_epochs=0 to switch warm-up off",
    )
    need(
        list(o.milestones_epochs) == sorted(o.milestones_epochs),
        "optim.milestones_epochs",
        o.milestones_epochs,
        "must be in increasing order",
        "sort the milestones",
    )
    need(0 < o.gamma <= 1, "optim.gamma", o.gamma, "must be in (0, 1]", "set optim.gamma=0.1")
    need(
        o.resize_warmup_epochs >= 0,
        "optim.resize_warmup_epochs",
        o.resize_warmup_epochs,
        "must not be negative",
        "set optim.resize_warmup_epochs=0 to apply LR increases at once",
    )

    k = cfg.checkpoint
    need(
        k.every_steps >= 1,
        "checkpoint.every_steps",
        k.every_steps,
        "must be at least 1",
        "set checkpoint.every_steps to the steps between checkpoints",
    )
    need(
        k.keep >= 1,
        "checkpoint.keep",
        k.keep,
        "must keep at least one",
        "set checkpoint.keep=1 or more",
    )
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

    h = cfg.health
    for key in ("min_open_files", "min_stack_mb", "min_shm_mb", "expected_gpus"):
        value = getattr(h, key)
        need(
            value >= 0,
            f"health.{key}",
            value,
            "must not be negative",
            f"set health.{key}=0 to accept any value, or a positive minimum",
        )
    need(
        h.min_checkpoint_free_gb >= 0,
        "health.min_checkpoint_free_gb",
        h.min_checkpoint_free_gb,
        "must not be negative",
        "set health.min_checkpoint_free_gb=0 to check only the estimated checkpoint size",
    )
    for key in (
        "etcd_timeout_s",
        "max_clock_skew_s",
        "gpu_probe_timeout_s",
        "strike_window_s",
    ):
        value = getattr(h, key)
        need(
            value > 0,
            f"health.{key}",
            value,
            "must be positive",
            f"set health.{key} to a positive number of seconds",
        )
    need(
        0 < h.gpu_memory_fraction <= 0.99,
        "health.gpu_memory_fraction",
        h.gpu_memory_fraction,
        "must be in (0, 0.99]",
        "set health.gpu_memory_fraction=0.9",
    )
    need(
        h.max_strikes >= 1,
        "health.max_strikes",
        h.max_strikes,
        "must be at least 1",
        "set health.max_strikes=3 (failures before a node is quarantined)",
    )
    need(
        h.quarantine_s >= 2,
        "health.quarantine_s",
        h.quarantine_s,
        "etcd does not keep leases shorter than 2 s",
        "set health.quarantine_s=2 or more",
    )

    t = cfg.trainer
    need(t.epochs > 0, "trainer.epochs", t.epochs, "must be positive", "set trainer.epochs=1")
    need(
        t.log_every >= 1,
        "trainer.log_every",
        t.log_every,
        "must be at least 1",
        "set trainer.log_every=1",
    )

    if cfg.model.name:
        from torchvision import models

        names = models.list_models(module=models)
        need(
            cfg.model.name in names,
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
