"""The ``checkpoint``, ``health`` and ``chaos`` sections: how a job outlives its faults.

Where and how often the training state is saved, what a node must prove before it joins a round
and how one that keeps failing is kept out, and whether the agents carry out fault requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.config.schema import ANY_MINIMUM, SECONDS, Choice, bounded


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
    # The final weights are the run's product: a final checkpoint that fails is retried, the
    # trained state kept in memory, for up to this long (elastic/final_save.py); then the job
    # ends with EXIT_UNSAVED, naming the steps not saved. 0: no retry.
    final_retry_s: float = bounded(
        600.0, ge=0, fix="set checkpoint.final_retry_s to 0 (no retry) or the seconds to retry"
    )


class StragglerPolicy(Choice):
    """What a straggler (a rank that computes much slower than the others) leads to."""

    off = "off"
    warn = "warn"
    evict = "evict"


@dataclass
class HealthConfig:
    """What a node must prove to join a round, and how a node that keeps failing is kept out.

    The checks are in :mod:`launcher.health.checks` and
    :mod:`launcher.health.gpu`."""

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
    # The etcd client certificate and CA (cluster.etcd_tls) warn this many days before they
    # expire; an expired one fails.
    cert_warn_days: int = bounded(14, ge=0, fix="set health.cert_warn_days=14 (0: no warning)")
    # Free space where checkpoints go, at least this much and at least checkpoint.keep + 1
    # checkpoints of the model (a new one is written before the oldest is deleted).
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
    # Stragglers, while training: every straggler_every steps the ranks compare their compute
    # time per step (forward and backward, up to the gradient all-reduce, averaged since the last
    # comparison); a rank slower than the median by straggler_factor in straggler_windows
    # comparisons running is a straggler, and says so in a straggler event. warn: that is all.
    # evict: its node also leaves as planned and is quarantined for quarantine_s (unless the job
    # would fall below cluster.min_nodes), then checks itself again and rejoins. off: no
    # comparison (it costs one small all-reduce every straggler_every steps).
    straggler: StragglerPolicy = StragglerPolicy.warn
    straggler_every: int = bounded(10, ge=1, fix="set health.straggler_every=10 (steps)")
    straggler_factor: float = bounded(
        1.5, gt=1, fix="set health.straggler_factor=1.5 (times the median compute time)"
    )
    straggler_windows: int = bounded(
        3, ge=1, fix="set health.straggler_windows=3 (comparisons in a row)"
    )
    # Silent corruption: every replica_check_every steps the ranks compare a checksum of their
    # parameters and optimizer state (one all-reduce of an integer per rank); a minority is
    # repaired from the majority and struck, and without a majority the job rolls back to its
    # newest checkpoint (elastic/replicas.py). 0: off.
    replica_check_every: int = bounded(
        50, ge=0, fix="set health.replica_check_every=50 (steps; 0: off)"
    )
    # Non-finite steps (inf or NaN gradients) are skipped on every rank; this many in a row roll
    # the job back to its newest checkpoint and strike the node that produced them all
    # (elastic/nonfinite.py). fp16's loss scaler handles its own overflows.
    nonfinite_rollback: int = bounded(
        3, ge=1, fix="set health.nonfinite_rollback=3 (skipped steps in a row)"
    )
    # GPU health while training: every gpu_watch_s seconds the agent reads NVML (XIDs,
    # uncorrectable ECC errors, pages pending retirement or remapping, slowdown); a GPU that
    # broke makes the node leave as planned (launcher/health/gpu_watch.py). 0: off.
    gpu_watch_s: float = bounded(
        5.0, ge=0, fix="set health.gpu_watch_s=5 (seconds between readings; 0: off)"
    )
    quarantine_s: float = bounded(
        1800.0,
        ge=2,
        why="etcd does not keep leases shorter than 2 s",
        fix="set health.quarantine_s=2 or more",
    )


@dataclass
class ChaosConfig:
    """Whether this job's agents carry out fault requests (``python -m chaos campaign.attach``).

    Off by default: with it on, anyone who can write the job's etcd prefix can stop, freeze or
    kill this job's processes (docs/chaos.md, "Chaos on bare metal").
    """

    allow: bool = False
    # Test hooks, honoured only with allow=true: the loss of rank nan_rank is NaN at each of
    # these steps (once each; a rollback trains them again cleanly). python -m chaos's
    # corrupt_replica (SIGUSR1 to a worker) also needs allow=true.
    nan_steps: list[int] = field(default_factory=list)
    nan_rank: int = 0
    # Test hook, honoured only with allow=true: on node fail_collectives_node, a collective of
    # each step from fail_collectives_step on fails by itself, in every round, while every
    # peer answers, as an operation the backend lacks does (elastic.chaos_hooks).
    fail_collectives_node: str = ""
    fail_collectives_step: int = 0
