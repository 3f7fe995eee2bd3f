"""The events an agent writes (and the launcher's, beside it on a node), with their lines."""

from __future__ import annotations

import time

from elastic.control import EXIT_UNSAVED
from elastic.event_types.contract import Event, declare

# A worker's exit codes that are no failure of its own: the job trained (its final state saved, or
# not: the final save's lines say so), or the exit not known.
ENDED = (0, None, EXIT_UNSAVED)


def crashed(e: Event) -> bool:
    """Whether ``e`` is a worker's exit of its own failure.

    Not the job's end, not its agent's stop."""
    return WORKER_EXITED.matches(e) and e["code"] not in ENDED and not e["stopped_by_agent"]


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


AGENT_STARTED = declare("agent_started", "agent", "pgid slots device", "the agent began")
AGENT_RESUMED = declare(
    "agent_resumed", "agent", "away_s", "the agent did not run for a while (stopped or starved)"
)


def _health_checked(e: Event) -> str | None:
    if not e["ok"]:
        return None
    counts = ", ".join(f"{n} {s}" for s, n in e["counts"].items() if n)
    warned = "".join(f"; warning: {w}" for w in e["warnings"])
    return f"{e['node']}: health checks passed in {e['seconds']:.1f} s ({counts}){warned}"


HEALTH_CHECKED = declare(
    "health_checked",
    "agent",
    "ok seconds counts warnings",
    "the node's health checks ran",
    line=_health_checked,
)


def _health_failed(e: Event) -> str:
    until = e["quarantined_until"]
    quarantine = f"; quarantined until {_clock(until)}" if until else ""
    return (
        f"{e['node']}: failed its health checks and does not join{quarantine}:\n  "
        + "\n  ".join(e["failures"])
    )


HEALTH_FAILED = declare(
    "health_failed",
    "agent",
    "failures quarantined_until",
    "the node failed its checks",
    line=_health_failed,
)
STRIKE = declare("strike", "agent", "strikes max_strikes reason", "a failure of the node counted")


def _quarantined(e: Event) -> str:
    return (
        f"{e['peer']} quarantined until {_clock(e['until'])} by {e['by']} "
        f"({'; '.join(e['reasons'])})"
    )


QUARANTINED = declare(
    "quarantined",
    "agent",
    "peer until reasons by",
    "a node was quarantined for a cooldown",
    line=_quarantined,
)
QUARANTINE_WAIT = declare(
    "quarantine_wait",
    "agent",
    "left_s reasons by",
    "the node waits out its quarantine",
    line="{node}: quarantined, waiting {left_s:.0f} s before checking again",
)
QUARANTINE_OVER = declare("quarantine_over", "agent", "", "the node's quarantine ended")
NODE_REGISTERED = declare("node_registered", "agent", "lease ttl_s", "the node registered")
NODE_READY = declare("node_ready", "agent", "incarnation", "the node's workers wait for a round")
LEADER_ELECTED = declare("leader_elected", "agent", "registration", "this node leads")


def _round_formed(e: Event) -> str:
    return f"round {e['round']} formed: world size {e['world_size']} ({', '.join(e['members'])})"


ROUND_FORMED = declare(
    "round_formed",
    "agent",
    "round world_size members removed added store after_step",
    "the leader formed a round",
    line=_round_formed,
)
ROUND_JOINED = declare(
    "round_joined",
    "agent",
    "round world_size first_rank nodes etcd_requests keepalives watch_events watch_bytes "
    "read_bytes",
    "the node's workers were sent into a round (with what the node cost etcd since its last)",
)
BELOW_MIN_NODES = declare(
    "below_min_nodes",
    "agent",
    "ready min_nodes round",
    "the leader: a round lost members and fewer than cluster.min_nodes nodes are ready to form "
    "the next; the job waits for nodes",
)
STANDBY = declare("standby", "agent", "round after_step", "a round without this node")
WORKER_STARTED = declare(
    "worker_started", "agent", "local_rank worker_pid log", "a worker process started"
)


def _worker_exited(e: Event) -> str | None:
    if not crashed(e):
        return None
    return f"{e['node']}: worker {e['local_rank']} exited with code {e['code']}"


WORKER_EXITED = declare(
    "worker_exited",
    "agent",
    "local_rank worker_pid code stopped_by_agent",
    "a worker exited",
    line=_worker_exited,
)
WORKER_FROZEN = declare(
    "worker_frozen",
    "agent",
    "local_rank reason",
    "the watchdog killed a frozen worker",
    line="{node}: worker {local_rank} frozen ({reason})",
)
FAILURE_REPORTED = declare(
    "failure_reported",
    "agent",
    "incarnation reason",
    "the node left its round at once",
    line="{node}: reported a failure ({reason})",
)
PEER_EVICTED = declare(
    "peer_evicted",
    "agent",
    "peer reason",
    "a dead peer's key was deleted",
    line="{node}: evicted {peer} ({reason})",
)
PEERS_UNREACHABLE = declare(
    "peers_unreachable", "agent", "peers", "the node cannot reach members of the round"
)
FENCED = declare(
    "fenced",
    "agent",
    "reason",
    "the node lost its place in the job",
    line="{node}: fenced ({reason})",
)
ETCD_UNREACHABLE = declare(
    "etcd_unreachable",
    "agent",
    "error grace_s",
    "etcd does not answer; training goes on",
    line=(
        "{node}: etcd does not answer ({error}); training goes on, retrying for up to {grace_s:g} s"
    ),
)
ETCD_REACHABLE = declare(
    "etcd_reachable",
    "agent",
    "down_s",
    "etcd answers again",
    line="{node}: etcd answers again after {down_s:.1f} s",
)
ETCD_LOST = declare(
    "etcd_lost",
    "agent",
    "reason fix waited_s",
    "etcd stayed away past the grace period",
    line="{node}: {reason}. Fix: {fix}",
)
ETCD_NO_SPACE = declare(
    "etcd_no_space",
    "agent",
    "reason fix",
    "etcd refuses writes: its space quota is exceeded (NOSPACE alarm); rounds cannot change",
)
RESTART_LIMIT = declare(
    "restart_limit",
    "agent",
    "crashes max_restarts",
    "workers crashed too often: the node leaves",
    line=(
        "{node}: workers crashed {crashes} times (cluster.max_restarts={max_restarts}); it "
        "leaves the job"
    ),
)
NODE_DRAINING = declare("node_draining", "agent", "reason", "a planned leave began")
NODE_LEAVING = declare(
    "node_leaving", "agent", "after_step", "the step after which the node leaves"
)
JOIN_TIMEOUT = declare(
    "join_timeout", "agent", "waited_s", "the node was placed in no round in time"
)
FAULT_REQUEST_ACCEPTED = declare(
    "fault_request_accepted", "agent", "request kind by", "a requested fault is carried out"
)
FAULT_REFUSED = declare(
    "fault_refused", "agent", "request kind by reason", "a fault request was refused"
)
GPU_WATCH_OFF = declare(
    "gpu_watch_off",
    "agent",
    "reason",
    "GPU health while training is off, and why (launcher/health/gpu_watch.py)",
)
GPU_WARNING = declare(
    "gpu_warning",
    "agent",
    "gpu reason",
    "a GPU throttles, saw an application XID, or an NVML reading failed; training goes on",
)
GPU_FAULT = declare(
    "gpu_fault", "agent", "gpus reasons", "a GPU broke while training: the node must leave"
)
METRICS_SERVED = declare(
    "metrics_served",
    "agent",
    "url",
    "the agent serves Prometheus metrics (launcher/metrics/)",
    line="{node}: Prometheus metrics at {url}",
)
METRICS_OFF = declare(
    "metrics_off",
    "agent",
    "reason",
    "metrics.port is set but nothing serves it, and why",
    line="{node}: no Prometheus metrics: {reason}",
)


def _node_left(e: Event) -> str:
    why = f": {e['reason']}" if e.get("reason") else ""
    return f"{e['node']}: left the job (exit code {e['code']}){why}"


NODE_LEFT = declare("node_left", "agent", "code signal reason", "the agent ends", line=_node_left)
STRAGGLER_KEPT = declare(
    "straggler_kept",
    "agent",
    "reason step slowdown",
    "a straggler's node stays in the job (health.straggler=warn, or too few nodes without it)",
)

# --- the launcher ---------------------------------------------------------------------------------

NOTIFIED = declare(
    "notified",
    "launcher",
    "alert target seconds",
    "an alert was delivered to notify.command or notify.webhook (launcher/notify.py)",
)
NOTIFY_FAILED = declare(
    "notify_failed",
    "launcher",
    "alert target reason",
    "an alert could not be delivered; training goes on",
)
