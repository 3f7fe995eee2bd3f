"""What a node's ``/metrics`` says: Prometheus families, kept up to date from the node's events.

The agent already follows its node's event file (the workers' events and its own); each event
kind that changes a figure has a function in :data:`UPDATES`, as :mod:`elastic.curves` has one
per TensorBoard scalar. Nothing here talks to the workers or to etcd, so it is fed events in
tests as in the agent.

Every family carries the job and the node as labels (``job_id``: Prometheus sets ``job`` to the
scrape's own name). The round is a gauge, not a label: a label that changes at every recovery
would start every counter again as a new series, and ``rate()`` would see no recovery at all.
Names and units follow Prometheus' conventions (``_seconds``, ``_bytes``, ``_total``); a time of
day is a ``_timestamp_seconds`` gauge, so that an age is ``time() - x`` in PromQL.

Some figures are rank 0's (its worker writes ``step``, ``recovered``, ``checkpoint_saved``): the
node that holds rank 0 reports them, and a sum over nodes counts each once, wherever rank 0 was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from elastic import event_types as ev
from elastic.eta import Pace

Event = Mapping[str, Any]

NODE_LABELS = ("job_id", "node")
# Recoveries last from a fraction of a second (in place) to minutes (a node waited for).
STALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SAVE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
# The parts of a recovery the worker times (``recovered``): its agent's rendezvous, the group's
# rebuild, the state sync and the first step. Before them, ``detection``: from the last step
# trained to the round's end, the step the fault broke and the finding of the fault (the node
# does not know when the fault struck; chaos campaigns measure from that, docs/chaos.md).
PHASES = {
    "rendezvous": "rendezvous_s",
    "rebuild": "rebuild_s",
    "state_sync": "sync_s",
    "first_step": "first_step_s",
}


# Each family: the name it is served under (``elastic_`` added; a counter's ``_total`` added by
# prometheus-client), its kind, its help text and the labels beyond the node's. One declared with
# no labels of its own is used through the node's child (``NodeMetrics.f[name]``).
Stall = partial(Histogram, buckets=STALL_BUCKETS)
Save = partial(Histogram, buckets=SAVE_BUCKETS)
FAMILIES: dict[str, tuple[Any, str, tuple[str, ...]]] = {
    # the round and its size
    "round": (Gauge, "The round this node's workers train in.", ()),
    "world_size": (Gauge, "Workers in the round.", ()),
    "round_nodes": (Gauge, "Nodes in the round.", ()),
    "nodes_ready": (
        Gauge,
        "Nodes ready: the round's, or fewer while the job waits for nodes (the leader's).",
        (),
    ),
    "min_nodes": (Gauge, "cluster.min_nodes: with fewer nodes ready, the job waits.", ()),
    # progress (rank 0's node)
    "step": (Gauge, "The newest step trained.", ()),
    "step_timestamp_seconds": (Gauge, "When the newest step was trained.", ()),
    "samples": (Gauge, "Samples of the whole run trained so far.", ()),
    "samples_trained": (Counter, "Samples trained by the job while this agent ran.", ()),
    "samples_per_second": (Gauge, "The job's samples a second at its newest step.", ()),
    "loss": (Gauge, "The training loss of the newest step.", ()),
    "learning_rate": (Gauge, "The newest step's learning rate.", ()),
    "eta_seconds": (Gauge, "Seconds left until the job is trained.", ()),
    # recoveries (rank 0's node)
    "recoveries": (
        Counter,
        "Recoveries, by why the round ended: peer_lost (a collective failed) or left (the agent "
        "moved the workers to a new round).",
        ("cause",),
    ),
    "recovery_stall_seconds": (
        Stall,
        "A recovery's stall, from the round's end to the first step after it.",
        (),
    ),
    "recovery_phase_seconds": (Stall, "A recovery's phases, as the worker times them.", ("phase",)),
    "steps_redone": (Counter, "Steps trained again after a restart from a checkpoint.", ()),
    # checkpoints (rank 0's node)
    "checkpoint_step": (Gauge, "The step of the newest committed checkpoint.", ()),
    "checkpoint_timestamp_seconds": (Gauge, "When the newest checkpoint committed.", ()),
    "checkpoint_bytes": (Gauge, "The size of the newest committed checkpoint.", ()),
    "checkpoint_interval_steps": (Gauge, "The steps between two checkpoints now.", ()),
    "checkpoint_save_seconds": (Save, "A save's time, from its start to its commit.", ()),
    "checkpoint_stall_seconds": (Save, "What a save held the training loop for.", ()),
    "checkpoint_failures": (Counter, "Saves that failed.", ()),
    # faults found while training
    "stragglers": (Counter, "Straggler findings of a rank.", ()),
    "replica_repairs": (Counter, "Replicas repaired from the majority's state.", ()),
    "nonfinite_steps": (Counter, "Steps skipped on every rank for inf/NaN gradients.", ()),
    "rollbacks": (Counter, "Rollbacks to the newest checkpoint.", ()),
    "worker_failures": (Counter, "Workers that exited on a failure of their own.", ()),
    # the node
    "health_checks": (Counter, "The node's health checks, by result.", ("result",)),
    "strikes": (Counter, "Failures counted against this node.", ()),
    "quarantines": (Counter, "Quarantines this agent wrote.", ()),
    "etcd_unreachable": (Counter, "Times etcd stopped answering this agent.", ()),
    "etcd_no_space": (Counter, "etcd's NOSPACE alarms seen.", ()),
    "etcd_requests": (Counter, "Requests this agent sent etcd (a watch: one).", ()),
    "etcd_request_seconds": (Counter, "The wall time of those requests, summed.", ()),
    "etcd_request_errors": (Counter, "Those requests that failed.", ()),
    "gpu_memory_used_bytes": (Gauge, "Memory in use on each GPU of the node (NVML).", ("gpu",)),
    "process_resident_memory_bytes": (
        Gauge,
        "Resident memory of the agent and of each worker.",
        ("process",),
    ),
}


class EtcdCounts(Protocol):
    """What the agent's etcd client has counted (``launcher.rendezvous.etcd_client.EtcdLoad``)."""

    requests: int
    seconds: float
    errors: int


class NodeMetrics:
    """The node's metric families in a registry of their own, and the events that move them."""

    def __init__(
        self, job_id: str, node_id: str, min_nodes: int = 1, checkpoint_every_steps: int = 0
    ) -> None:
        """The figures of ``node_id`` in ``job_id``, with two of the job's settings.

        ``min_nodes`` and ``checkpoint_every_steps`` are what the alert rules compare with
        (examples/prometheus/alerts.yml)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"job_id": job_id, "node": node_id}
        self._pace = Pace()
        self._last_step = 0  # the newest step this node saw trained (rank 0's step events)
        self._last_step_at: float | None = None  # and when
        self._etcd: dict[str, float] = {}  # count_etcd's last totals
        self.f: dict[str, Any] = {}  # each family, or the node's child of one without labels
        for name, (kind, doc, extra) in FAMILIES.items():
            family = kind(f"elastic_{name}", doc, (*NODE_LABELS, *extra), registry=self.registry)
            self.f[name] = family if extra else family.labels(**self._labels)
        self.f["min_nodes"].set(min_nodes)
        self.f["checkpoint_interval_steps"].set(checkpoint_every_steps)

    def labelled(self, name: str, **labels: str) -> Any:
        """Family ``name``'s child for this node with ``labels`` added."""
        return self.f[name].labels(**self._labels, **labels)

    def apply(self, events: list[dict[str, Any]]) -> None:
        """Move the figures by ``events``, in their order."""
        for e in events:
            update = UPDATES.get(e.get("event", ""))
            if update is not None:
                update(self, e)
        self.f["eta_seconds"].set(_or_nan(self._pace.eta_s()))

    def set_memory(self, rss_by_process: Mapping[str, int]) -> None:
        """Each process's resident bytes now; one gone since the last call is dropped."""
        self.f["process_resident_memory_bytes"].clear()
        for process, rss in rss_by_process.items():
            self.labelled("process_resident_memory_bytes", process=process).set(rss)

    def set_gpu_memory(self, used_by_gpu: Mapping[str, int]) -> None:
        """Each GPU's bytes in use now (none without NVML)."""
        for gpu, used in used_by_gpu.items():
            self.labelled("gpu_memory_used_bytes", gpu=gpu).set(used)

    def count_etcd(self, load: EtcdCounts) -> None:
        """Bring the etcd counters up to ``load``, the agent's counts since it started."""
        for name, total in (
            ("etcd_requests", load.requests),
            ("etcd_request_seconds", load.seconds),
            ("etcd_request_errors", load.errors),
        ):
            self.f[name].inc(max(0.0, total - self._etcd.get(name, 0.0)))
            self._etcd[name] = total

    def set(self, **values: float) -> None:
        """Set the gauges named by the keywords."""
        for name, value in values.items():
            self.f[name].set(value)

    # --- one function per event kind ----------------------------------------------------------

    def _round_joined(self, e: Event) -> None:
        self.set(
            round=e["round"],
            world_size=e["world_size"],
            round_nodes=e["nodes"],
            nodes_ready=e["nodes"],
        )

    def _training_started(self, e: Event) -> None:
        self.set(world_size=e["world_size"])
        self._pace.total_samples = e["total_samples"]
        self._pace.add(e["ts"], e["samples_seen"])
        if not e["in_place"] and e["step"] < self._last_step:
            self.f["steps_redone"].inc(self._last_step - e["step"])
        self._last_step = e["step"]

    def _step(self, e: Event) -> None:
        self._last_step, self._last_step_at = e["step"], e["ts"]
        self.set(
            step=e["step"],
            step_timestamp_seconds=e["ts"],
            samples=e["samples"],
            samples_per_second=e["samples_per_s"],
            world_size=e["world_size"],
            loss=e["loss"],
            learning_rate=e["lr"],
        )
        self.f["samples_trained"].inc(e["step_samples"])
        self._pace.add(e["ts"], e["samples"])

    def _recovered(self, e: Event) -> None:
        self.labelled("recoveries", cause=e["cause"]).inc()
        if self._last_step_at is not None:
            detection = max(0.0, e["interrupted_at"] - self._last_step_at)
            self.labelled("recovery_phase_seconds", phase="detection").observe(detection)
        self.f["recovery_stall_seconds"].observe(e["first_step_at"] - e["interrupted_at"])
        for phase, key in PHASES.items():
            self.labelled("recovery_phase_seconds", phase=phase).observe(max(0.0, e[key]))

    def _checkpoint_saved(self, e: Event) -> None:
        self.set(
            checkpoint_step=e["step"],
            checkpoint_timestamp_seconds=e["ts"],
            checkpoint_bytes=e["bytes"],
        )
        self.f["checkpoint_save_seconds"].observe(e["seconds"])
        self.f["checkpoint_stall_seconds"].observe(e["stall_s"])

    def _health_checked(self, e: Event) -> None:
        self.labelled("health_checks", result="ok" if e["ok"] else "failed").inc()


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _count(name: str) -> Callable[[NodeMetrics, Event], None]:
    """An update that adds one to counter ``name``."""
    return lambda m, e: m.f[name].inc()


UPDATES: dict[str, Callable[[NodeMetrics, Event], None]] = {
    ev.ROUND_JOINED.name: NodeMetrics._round_joined,
    ev.TRAINING_STARTED.name: NodeMetrics._training_started,
    ev.STEP.name: NodeMetrics._step,
    ev.RECOVERED.name: NodeMetrics._recovered,
    ev.CHECKPOINT_SAVED.name: NodeMetrics._checkpoint_saved,
    ev.CHECKPOINT_FAILED.name: _count("checkpoint_failures"),
    ev.CHECKPOINT_INTERVAL.name: lambda m, e: m.set(checkpoint_interval_steps=e["steps"]),
    ev.BELOW_MIN_NODES.name: lambda m, e: m.set(nodes_ready=e["ready"]),
    ev.STRAGGLER.name: _count("stragglers"),
    ev.REPLICA_REPAIRED.name: _count("replica_repairs"),
    ev.STEP_NONFINITE.name: _count("nonfinite_steps"),
    ev.STEP_SKIPPED.name: _count("nonfinite_steps"),
    ev.ROLLED_BACK.name: _count("rollbacks"),
    ev.QUARANTINED.name: _count("quarantines"),
    ev.STRIKE.name: _count("strikes"),
    ev.HEALTH_CHECKED.name: NodeMetrics._health_checked,
    ev.ETCD_UNREACHABLE.name: _count("etcd_unreachable"),
    ev.ETCD_NO_SPACE.name: _count("etcd_no_space"),
    ev.WORKER_FAILED.name: _count("worker_failures"),
}
