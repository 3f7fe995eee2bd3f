"""The event contract: every kind of event a process of this project writes, declared once.

Each :class:`EventType` names an event, who writes it and the fields it carries beyond those of
every event (:data:`COMMON`: the time, the writer, and a worker's rank and round). Writers pass
the declared type to :meth:`elastic.events.EventLog.emit`, which refuses a name declared nowhere;
readers (the invariant checker, the recovery report, the verdict, the benchmarks, the progress
display) pick events with :meth:`EventType.of` and :meth:`EventType.matches`. The files keep their
format (one JSON object per line, its name under ``"event"``), so old run directories still read.
``tests/test_event_types.py`` holds every emitting call to the declaration of its event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# In every event: when, what, and who wrote it; a worker adds its local rank, rank and round.
COMMON = frozenset({"ts", "event", "node", "host", "pid", "role", "local_rank", "rank", "round"})


@dataclass(frozen=True)
class EventType:
    """One kind of event: its name, the process that writes it, its fields, and what it says.

    ``name`` is its name in the files; ``by`` the process that writes it (agent, launcher,
    worker, chaos or bench); ``fields`` its own fields; ``doc`` what it says."""

    name: str
    by: str
    fields: frozenset[str]
    doc: str

    def matches(self, event: Mapping[str, Any]) -> bool:
        return event.get("event") == self.name

    def of(self, events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The events of this kind among ``events``, in their order."""
        return [e for e in events if e.get("event") == self.name]


class UndeclaredEvent(ValueError):
    """An event whose name this module does not declare."""


DECLARED: dict[str, EventType] = {}


def declared(name: str) -> EventType:
    """The declaration of ``name``; :class:`UndeclaredEvent` if there is none."""
    try:
        return DECLARED[name]
    except KeyError:
        raise UndeclaredEvent(
            f"event {name!r} is not declared: declare it, with its fields, in "
            "elastic/event_types.py"
        ) from None


def _declare(name: str, by: str, fields: str, doc: str) -> EventType:
    kind = EventType(name, by, frozenset(fields.split()), doc)
    DECLARED[name] = kind
    return kind


# --- the agent ------------------------------------------------------------------------------------

AGENT_STARTED = _declare("agent_started", "agent", "pgid slots device", "the agent began")
AGENT_RESUMED = _declare(
    "agent_resumed", "agent", "away_s", "the agent did not run for a while (stopped or starved)"
)
HEALTH_CHECKED = _declare(
    "health_checked", "agent", "ok seconds counts warnings", "the node's health checks ran"
)
HEALTH_FAILED = _declare(
    "health_failed", "agent", "failures quarantined_until", "the node failed its checks"
)
STRIKE = _declare("strike", "agent", "strikes max_strikes reason", "a failure of the node counted")
QUARANTINED = _declare(
    "quarantined", "agent", "peer until reasons by", "a node was quarantined for a cooldown"
)
QUARANTINE_WAIT = _declare(
    "quarantine_wait", "agent", "left_s reasons by", "the node waits out its quarantine"
)
QUARANTINE_OVER = _declare("quarantine_over", "agent", "", "the node's quarantine ended")
NODE_REGISTERED = _declare("node_registered", "agent", "lease ttl_s", "the node registered")
NODE_READY = _declare("node_ready", "agent", "incarnation", "the node's workers wait for a round")
LEADER_ELECTED = _declare("leader_elected", "agent", "registration", "this node leads")
ROUND_FORMED = _declare(
    "round_formed",
    "agent",
    "round world_size members removed added store after_step",
    "the leader formed a round",
)
ROUND_JOINED = _declare(
    "round_joined",
    "agent",
    "round world_size first_rank nodes etcd_requests keepalives watch_events watch_bytes "
    "read_bytes",
    "the node's workers were sent into a round (with what the node cost etcd since its last)",
)
BELOW_MIN_NODES = _declare(
    "below_min_nodes",
    "agent",
    "ready min_nodes round",
    "the leader: a round lost members and fewer than cluster.min_nodes nodes are ready to form "
    "the next; the job waits for nodes",
)
STANDBY = _declare("standby", "agent", "round after_step", "a round without this node")
WORKER_STARTED = _declare(
    "worker_started", "agent", "local_rank worker_pid log", "a worker process started"
)
WORKER_EXITED = _declare(
    "worker_exited", "agent", "local_rank worker_pid code stopped_by_agent", "a worker exited"
)
WORKER_FROZEN = _declare(
    "worker_frozen", "agent", "local_rank reason", "the watchdog killed a frozen worker"
)
FAILURE_REPORTED = _declare(
    "failure_reported", "agent", "incarnation reason", "the node left its round at once"
)
PEER_EVICTED = _declare("peer_evicted", "agent", "peer reason", "a dead peer's key was deleted")
PEERS_UNREACHABLE = _declare(
    "peers_unreachable", "agent", "peers", "the node cannot reach members of the round"
)
FENCED = _declare("fenced", "agent", "reason", "the node lost its place in the job")
ETCD_UNREACHABLE = _declare(
    "etcd_unreachable", "agent", "error grace_s", "etcd does not answer; training goes on"
)
ETCD_REACHABLE = _declare("etcd_reachable", "agent", "down_s", "etcd answers again")
ETCD_LOST = _declare(
    "etcd_lost", "agent", "reason fix waited_s", "etcd stayed away past the grace period"
)
ETCD_NO_SPACE = _declare(
    "etcd_no_space",
    "agent",
    "reason fix",
    "etcd refuses writes: its space quota is exceeded (NOSPACE alarm); rounds cannot change",
)
RESTART_LIMIT = _declare(
    "restart_limit", "agent", "crashes max_restarts", "workers crashed too often: the node leaves"
)
NODE_DRAINING = _declare("node_draining", "agent", "reason", "a planned leave began")
NODE_LEAVING = _declare(
    "node_leaving", "agent", "after_step", "the step after which the node leaves"
)
JOIN_TIMEOUT = _declare(
    "join_timeout", "agent", "waited_s", "the node was placed in no round in time"
)
FAULT_REQUEST_ACCEPTED = _declare(
    "fault_request_accepted", "agent", "request kind by", "a requested fault is carried out"
)
FAULT_REFUSED = _declare(
    "fault_refused", "agent", "request kind by reason", "a fault request was refused"
)
GPU_WATCH_OFF = _declare(
    "gpu_watch_off",
    "agent",
    "reason",
    "GPU health while training is off, and why (launcher/health/gpu_watch.py)",
)
GPU_WARNING = _declare(
    "gpu_warning",
    "agent",
    "gpu reason",
    "a GPU throttles, saw an application XID, or an NVML reading failed; training goes on",
)
GPU_FAULT = _declare(
    "gpu_fault", "agent", "gpus reasons", "a GPU broke while training: the node must leave"
)
METRICS_SERVED = _declare(
    "metrics_served", "agent", "url", "the agent serves Prometheus metrics (launcher/metrics/)"
)
METRICS_OFF = _declare(
    "metrics_off", "agent", "reason", "metrics.port is set but nothing serves it, and why"
)
NODE_LEFT = _declare("node_left", "agent", "code signal reason", "the agent ends")

# --- the launcher ---------------------------------------------------------------------------------

NOTIFIED = _declare(
    "notified",
    "launcher",
    "alert target seconds",
    "an alert was delivered to notify.command or notify.webhook (launcher/notify.py)",
)
NOTIFY_FAILED = _declare(
    "notify_failed",
    "launcher",
    "alert target reason",
    "an alert could not be delivered; training goes on",
)

# --- a worker (rank 0 unless its doc says every rank) ---------------------------------------------

TRAINING_STARTED = _declare(
    "training_started",
    "worker",
    "world_size step samples_seen total_samples resumed_from in_place global_batch lr",
    "a round began training",
)
STEP = _declare(
    "step",
    "worker",
    "step samples step_samples global_batch epoch loss lr world_size samples_per_s loss_scale "
    "metrics",
    "a step trained (every trainer.log_every steps); metrics: the job's (elastic.job.Loss)",
)
STEP_SKIPPED = _declare(
    "step_skipped", "worker", "step scale", "fp16: a step with inf/nan gradients was skipped"
)
LR_CHANGED = _declare(
    "lr_changed",
    "worker",
    "reason optimizer policy old_world_size world_size old_lr lr ramp_samples",
    "the LR follows a new world size",
)
EVALUATION_STARTED = _declare(
    "evaluation_started", "worker", "evaluation step", "an evaluation began"
)
EVALUATED = _declare(
    "evaluated",
    "worker",
    "evaluation epoch step top1 top5 loss count seconds",
    "an evaluation's figures",
)
RECOVERED = _declare(
    "recovered",
    "worker",
    "step world_size cause interrupted_at formed_at assigned_at pg_ready_at synced_at "
    "first_step_at rendezvous_s rebuild_s sync_s first_step_s in_place",
    "the first step after a fault, with why the round ended (cause: a RoundEnd's value) and the "
    "recovery's breakdown",
)
CHECKPOINT_SAVED = _declare(
    "checkpoint_saved", "worker", "step round url bytes seconds stall_s", "a checkpoint committed"
)
CHECKPOINT_INTERVAL = _declare(
    "checkpoint_interval", "worker", "step steps reason", "the steps between checkpoints changed"
)
CHECKPOINT_FAILED = _declare(
    "checkpoint_failed", "worker", "step round reason fix", "a save failed; training goes on"
)
CHECKPOINT_LOADED = _declare(
    "checkpoint_loaded",
    "worker",
    "step url seconds world_size saved_world_size",
    "a checkpoint was loaded",
)
CHECKPOINT_SKIPPED = _declare(
    "checkpoint_skipped", "worker", "url reason", "a checkpoint failed verification"
)
TRAINING_DONE = _declare(
    "training_done",
    "worker",
    "step samples_seen world_size",
    "the job is trained, and its final checkpoint committed",
)
FINAL_SAVE_RETRY = _declare(
    "final_save_retry",
    "worker",
    "step saved_step attempt retry_in_s left_s",
    "the job is trained but its final checkpoint did not commit (saved_step: the newest that "
    "did, None if none): the state is kept and the save retried (elastic/final_save.py)",
)
FINAL_SAVE_FAILED = _declare(
    "final_save_failed",
    "worker",
    "step saved_step attempts waited_s",
    "the final checkpoint could not be written within checkpoint.final_retry_s: the steps after "
    "saved_step up to step are not saved, and the job ends with EXIT_UNSAVED",
)
CURVES_OFF = _declare(
    "curves_off",
    "worker",
    "reason",
    "rank 0 writes no TensorBoard curves, and why (elastic/curves.py)",
)
STATE_SYNCED = _declare(
    "state_synced",
    "worker",
    "step source digest rss_mib device_used_mib",
    "every rank: the state a round starts from, and the memory in use then",
)
STATE_DIGEST = _declare(
    "state_digest", "worker", "step digest", "every rank: a hash of its replica"
)
WORKER_PEER_LOST = _declare(
    "worker_peer_lost", "worker", "what error", "every rank: a collective of the round failed"
)
WORKER_FAILED = _declare(
    "worker_failed", "worker", "step error", "every rank: a fault of the worker's own"
)
STRAGGLER = _declare(
    "straggler",
    "worker",
    "step slowdown compute_s median_s",
    "every rank that computes much slower than the others says so (elastic/stragglers.py)",
)
STEP_NONFINITE = _declare(
    "step_nonfinite",
    "worker",
    "step producer streak skipped",
    "rank 0: a step with inf/NaN gradients was skipped on every rank (producer: the first rank "
    "whose loss was not finite, -1 if none)",
)
ROLLED_BACK = _declare(
    "rolled_back",
    "worker",
    "step to_step reason",
    "every rank loaded the newest checkpoint (non-finite steps, or replicas without a "
    "majority); to_step is None when there was none",
)
REPLICA_REPAIRED = _declare(
    "replica_repaired",
    "worker",
    "step source corrupt",
    "a rank whose replica differed from the majority's took the state of rank source",
)
BIT_FLIPPED = _declare(
    "bit_flipped",
    "worker",
    "step param index bit",
    "chaos's corrupt_replica: this worker flipped one bit of a parameter (chaos.allow)",
)
STRAGGLER_KEPT = _declare(
    "straggler_kept",
    "agent",
    "reason step slowdown",
    "a straggler's node stays in the job (health.straggler=warn, or too few nodes without it)",
)
SAMPLES = _declare(
    "samples",
    "worker",
    "step epoch world_size indices before",
    "every rank, with trainer.record_samples: the samples of a step and the state before it",
)

# --- faults ---------------------------------------------------------------------------------------

FAULT_INJECTED = _declare(
    "fault_injected",
    "chaos",
    "kind target signal pids link rate_mbit free_mb factor how",
    "a fault was struck (written before its signal is sent)",
)
FAULT_CLEARED = _declare(
    "fault_cleared", "chaos", "kind target signal pids link", "a fault ended, or a node restarted"
)
FAULT_SKIPPED = _declare(
    "fault_skipped", "chaos", "kind target reason", "a fault due could not be carried out"
)
CHECKPOINT_VERIFIED = _declare(
    "checkpoint_verified",
    "chaos",
    "kind target refused",
    "a corrupted checkpoint was verified at once",
)
