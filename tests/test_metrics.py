"""The agent's Prometheus endpoint: each event moves the figure it should, and a real HTTP scrape
reads what the node's event file gained since the last one."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic import config
from elastic import event_types as ev
from elastic.events import EventLog, read_events
from launcher.metrics.exporter import MetricsServer, start_metrics
from launcher.metrics.node_metrics import NodeMetrics
from launcher.rendezvous.etcd_client import EtcdLoad

LABELS = {"job_id": "j", "node": "node1"}


def value(m: NodeMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**LABELS, **labels})


def event(kind: ev.EventType, **fields: Any) -> dict[str, Any]:
    return {"event": kind.name, "ts": 1000.0, "node": "node1", **fields}


def step(n: int, samples: int, ts: float = 1000.0) -> dict[str, Any]:
    return event(
        ev.STEP,
        ts=ts,
        step=n,
        samples=samples,
        step_samples=64,
        world_size=2,
        samples_per_s=100.0,
        loss=2.5,
        lr=0.1,
    )


def started(n: int, in_place: bool, ts: float = 1000.0) -> dict[str, Any]:
    return event(
        ev.TRAINING_STARTED,
        ts=ts,
        step=n,
        world_size=2,
        samples_seen=64 * n,
        total_samples=6400,
        in_place=in_place,
    )


RECOVERED = event(
    ev.RECOVERED,
    cause="peer_lost",
    interrupted_at=100.0,
    first_step_at=101.5,
    rendezvous_s=0.75,
    rebuild_s=0.25,
    sync_s=0.25,
    first_step_s=0.25,
)


def test_steps_set_the_progress_and_count_the_samples() -> None:
    m = NodeMetrics("j", "node1")
    m.apply([started(0, False, ts=1000.0), step(1, 64, ts=1001.0), step(2, 128, ts=1002.0)])
    assert value(m, "elastic_step") == 2
    assert value(m, "elastic_samples") == 128
    assert value(m, "elastic_samples_trained_total") == 128
    assert value(m, "elastic_world_size") == 2
    assert value(m, "elastic_learning_rate") == 0.1
    assert value(m, "elastic_eta_seconds") == pytest.approx(98.0)  # 6272 samples at 64 a second


def test_a_recovery_counts_once_by_its_cause_and_observes_its_stall_and_phases() -> None:
    m = NodeMetrics("j", "node1")
    m.apply([step(5, 320, ts=99.5), RECOVERED])  # the last step before the round broke at 100
    assert value(m, "elastic_recoveries_total", cause="peer_lost") == 1
    assert value(m, "elastic_recovery_phase_seconds_sum", phase="detection") == 0.5
    assert value(m, "elastic_recoveries_total", cause="left") is None
    assert value(m, "elastic_recovery_stall_seconds_count") == 1
    assert value(m, "elastic_recovery_stall_seconds_sum") == 1.5
    assert value(m, "elastic_recovery_stall_seconds_bucket", le="1.0") == 0
    assert value(m, "elastic_recovery_stall_seconds_bucket", le="2.5") == 1
    assert value(m, "elastic_recovery_phase_seconds_sum", phase="rendezvous") == 0.75
    assert value(m, "elastic_recovery_phase_seconds_sum", phase="first_step") == 0.25


def test_steps_after_the_checkpoint_count_as_redone_only_when_resumed_from_it() -> None:
    m = NodeMetrics("j", "node1")
    m.apply([step(7, 448), started(7, in_place=True)])  # kept in memory: nothing redone
    assert value(m, "elastic_steps_redone_total") == 0
    m.apply([step(9, 576), started(5, in_place=False)])  # the checkpoint of step 5
    assert value(m, "elastic_steps_redone_total") == 4


def test_checkpoints_give_their_step_time_and_size_and_failures_count() -> None:
    m = NodeMetrics("j", "node1")
    saved = event(ev.CHECKPOINT_SAVED, ts=1234.5, step=20, bytes=4096, seconds=0.5, stall_s=0.01)
    m.apply([saved, event(ev.CHECKPOINT_FAILED, step=40)])
    assert value(m, "elastic_checkpoint_step") == 20
    assert value(m, "elastic_checkpoint_timestamp_seconds") == 1234.5
    assert value(m, "elastic_checkpoint_bytes") == 4096
    assert value(m, "elastic_checkpoint_save_seconds_count") == 1
    assert value(m, "elastic_checkpoint_stall_seconds_sum") == 0.01
    assert value(m, "elastic_checkpoint_failures_total") == 1


def test_faults_found_while_training_and_the_nodes_health_are_counted() -> None:
    m = NodeMetrics("j", "node1")
    m.apply(
        [
            event(ev.ROUND_JOINED, round=4, world_size=3, nodes=3),
            event(ev.STRAGGLER),
            event(ev.REPLICA_REPAIRED),
            event(ev.STEP_NONFINITE),
            event(ev.STEP_SKIPPED),
            event(ev.ROLLED_BACK),
            event(ev.STRIKE),
            event(ev.QUARANTINED),
            event(ev.HEALTH_CHECKED, ok=True),
            event(ev.HEALTH_CHECKED, ok=False),
            event(ev.HEALTH_FAILED),  # follows the failed check: not counted twice
            event(ev.ETCD_UNREACHABLE),
            event(ev.ETCD_NO_SPACE),
            event(ev.WORKER_FAILED),
            {"event": "not_declared_here", "ts": 1.0},  # a newer writer's: ignored
        ]
    )
    assert (value(m, "elastic_round"), value(m, "elastic_round_nodes")) == (4, 3)
    for name in (
        "stragglers",
        "replica_repairs",
        "rollbacks",
        "strikes",
        "quarantines",
        "etcd_unreachable",
        "etcd_no_space",
        "worker_failures",
    ):
        assert value(m, f"elastic_{name}_total") == 1, name
    assert value(m, "elastic_nonfinite_steps_total") == 2  # a skip, by either finder
    assert value(m, "elastic_health_checks_total", result="ok") == 1
    assert value(m, "elastic_health_checks_total", result="failed") == 1


def test_memory_is_shown_for_the_processes_running_now() -> None:
    m = NodeMetrics("j", "node1")
    m.set_memory({"agent": 100, "worker0": 200})
    m.set_memory({"agent": 150})  # worker0 exited
    assert value(m, "elastic_process_resident_memory_bytes", process="agent") == 150
    assert value(m, "elastic_process_resident_memory_bytes", process="worker0") is None
    m.set_gpu_memory({"0": 2**30, "1": 2**31})
    assert value(m, "elastic_gpu_memory_used_bytes", gpu="1") == 2**31


def test_the_etcd_clients_counts_become_counters_that_only_move_by_what_was_added() -> None:
    m = NodeMetrics("j", "node1")
    load = EtcdLoad()
    load.requests, load.seconds, load.errors = 10, 0.5, 1
    m.count_etcd(load)
    load.requests, load.seconds = 14, 0.75
    m.count_etcd(load)
    m.count_etcd(load)  # nothing new
    assert value(m, "elastic_etcd_requests_total") == 14
    assert value(m, "elastic_etcd_request_seconds_total") == 0.75
    assert value(m, "elastic_etcd_request_errors_total") == 1


def scrape(url: str) -> dict[str, float]:
    """The samples of a real HTTP scrape of ``url``, by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def key(name: str, **labels: str) -> str:
    return name + str(sorted({**LABELS, **labels}.items()))


def test_a_scrape_reads_the_events_written_since_the_last_one(tmp_path: Path) -> None:
    """A real server on a free port, fed by a real event log: what was in the file before it
    started is not replayed (counters start with the agent), what came after is counted once."""
    log = EventLog(tmp_path, "node1")
    log.emit(ev.RECOVERED, **{k: v for k, v in RECOVERED.items() if k not in ("event", "ts")})
    server = MetricsServer(NodeMetrics("j", "node1"), str(tmp_path), "node1", lambda: {})
    url = server.serve("127.0.0.1", 0)
    try:
        assert scrape(url).get(key("elastic_recoveries_total", cause="peer_lost")) is None
        log.emit(ev.RECOVERED, **{k: v for k, v in RECOVERED.items() if k not in ("event", "ts")})
        log.emit(ev.STRIKE, strikes=1, max_strikes=3, reason="test")
        first = scrape(url)
        assert first[key("elastic_recoveries_total", cause="peer_lost")] == 1
        assert first[key("elastic_strikes_total")] == 1
        assert scrape(url)[key("elastic_recoveries_total", cause="peer_lost")] == 1  # not again
    finally:
        server.close()


def test_a_port_in_use_costs_the_metrics_not_the_node_and_says_the_fix(tmp_path: Path) -> None:
    cfg = config.Config(job_id="j", run_dir=str(tmp_path))
    log = EventLog(tmp_path, "node1")
    assert start_metrics(cfg, "node1", ("127.0.0.1", 0), dict, log) is None  # 0: off
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert start_metrics(cfg, "node1", ("127.0.0.1", port), dict, log) is None
    off = ev.METRICS_OFF.of(read_events(tmp_path))
    assert len(off) == 1 and f"metrics.port={port}" in off[0]["reason"], off
    assert "fix:" in off[0]["reason"]


EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "prometheus"


def test_every_metric_the_dashboard_and_the_alerts_query_is_in_a_scrape() -> None:
    """What a node serves once it has seen one of each event (histograms' series included)."""
    m = NodeMetrics("j", "node1")
    m.apply([RECOVERED, started(0, False), step(1, 64)])
    m.set_memory({"agent": 1})
    m.set_gpu_memory({"0": 1})
    served = {
        s.name
        for f in text_string_to_metric_families(generate_latest(m.registry).decode())
        for s in f.samples
    }
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append((EXAMPLES / "alerts.yml").read_text())
    queried = {name for e in exprs for name in re.findall(r"\belastic_[a-z_]+", e)}
    assert len(queried) >= 15 and queried <= served, sorted(queried - served)


def test_a_port_out_of_range_is_refused_at_launch_naming_the_key_and_the_fix() -> None:
    cfg = config.Config(job_id="j")
    cfg.metrics.port = 70000
    with pytest.raises(config.ConfigError, match=r"metrics\.port.*70000.*metrics\.port=9464"):
        config.validate(cfg)
