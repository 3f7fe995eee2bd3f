"""A real Prometheus scrapes a 3-node local job's agents through a node kill and its return.

It needs the ``prometheus`` server (Debian's ``prometheus`` package; ``.ci/run`` installs it when
it is absent) and skips cleanly without it. The kill is a chaos campaign's (a real SIGKILL of the
node's session, the node started again 2 s later); what is checked is read back with PromQL
from Prometheus' own store, never from the scrapes directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic import config
from elastic import event_types as ev
from elastic.events import read_events
from launcher.rendezvous.embedded_etcd import free_ports

from .conftest import FAST_JOB, Gate

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="no prometheus server on PATH (Debian's prometheus package; .ci/run installs it)",
)
NODES = 3
WAIT_S = 240.0  # the whole job takes about a minute here


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: list[str], port: int) -> Iterator[str]:
    """A Prometheus scraping ``targets`` every second; yields its URL, stopped on leaving."""
    conf = tmp_path / "prometheus.yml"
    conf.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "elastic", "static_configs": [{"targets": targets}]}
                ],
            }
        )
    )
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={conf}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        until(lambda: get(f"{url}/-/ready") is not None, 60, "Prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()
    except OSError:
        return None


def until(condition: Any, timeout_s: float, what: str) -> Any:
    """Poll ``condition`` until it is true (bounded), returning its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


def query(url: str, promql: str) -> float | None:
    """The value of an instant query, None when it has no result."""
    body = get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    result = json.loads(body or b"{}").get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def series(url: str, promql: str, start: float, end: float) -> list[float]:
    """A range query's values, one a second, with repeats collapsed."""
    args = {"query": promql, "start": start, "end": end, "step": "1"}
    body = get(f"{url}/api/v1/query_range?" + urllib.parse.urlencode(args))
    result = json.loads(body or b"{}")["data"]["result"]
    values = [float(v) for _, v in result[0]["values"]] if result else []
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_prometheus_sees_the_world_size_go_3_2_3_and_each_recovery_counted_once(
    tmp_path: Path, gate: Gate
) -> None:
    base = free_ports(NODES + 1)
    run_dir = tmp_path / "run"
    gate.hold_after(5)  # at world size 3 until Prometheus has seen it: the kill comes at step 8
    targets = [f"127.0.0.1:{base + i}" for i in range(NODES)]
    with prometheus(tmp_path, targets, base + NODES) as url:
        started = time.time()
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chaos",
                "job_id=watched",
                f"run_dir={run_dir}",
                *FAST_JOB,
                f"cluster.nodes={NODES}",
                "trainer.epochs=4",
                f"metrics.port={base}",
                "campaign.faults=[{kind:kill_node,at_step:8,target:not_rank0,restart_after_s:2}]",
            ],
            cwd=tmp_path,
            stdout=open(tmp_path / "chaos.out", "w"),  # noqa: SIM115 - the process's
            stderr=subprocess.STDOUT,
            env={**os.environ, **gate.env()},
        )
        try:
            until(
                lambda: query(url, "max(elastic_world_size)") == NODES,
                WAIT_S,
                "Prometheus to see the first round of 3",
            )
            gate.hold_end(3)  # the job waits, at world size 3 again, until it has seen it all

            def settled() -> list[dict[str, Any]]:
                """The recoveries logged, once every node (the restarted one too) joined a round
                of 3 after the restart and Prometheus has scraped that round and every recovery
                logged so far; [] until then."""
                assert job.poll() is None, (tmp_path / "chaos.out").read_text()[-3000:]
                events = read_events(run_dir)
                back = [e["ts"] for e in ev.FAULT_CLEARED.of(events)]
                joined = {
                    e["node"]
                    for e in ev.ROUND_JOINED.of(events)
                    if back and e["ts"] > back[0] and e["world_size"] == NODES
                }
                recovered = ev.RECOVERED.of(events)
                scraped = query(url, "max(elastic_world_size)") == NODES and query(
                    url, "sum(elastic_recoveries_total)"
                ) == len(recovered)
                return recovered if len(joined) == NODES and scraped else []

            recovered = until(settled, WAIT_S, "the node back in a round of 3, and scraped")
            stalls = sum(e["first_step_at"] - e["interrupted_at"] for e in recovered)
            # Up to a little past now: a range's points fall every second from its start.
            seen = series(url, "max(elastic_world_size)", started, time.time() + 2)
            counted = query(url, "sum(elastic_recovery_stall_seconds_count)")
            observed = query(url, "sum(elastic_recovery_stall_seconds_sum)")
            up = query(url, 'count(up{job="elastic"} == 1)')
            etcd = query(url, "min(elastic_etcd_requests_total)")  # every node's, restarted too
            endpoints = config.load(run_dir / "config.yaml").cluster.etcd_endpoints
            status = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "launcher.commands.status",
                    "job_id=watched",
                    f"cluster.etcd_endpoints=[{','.join(endpoints)}]",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            gate.open()
            code = job.wait(timeout=WAIT_S)
    out = (tmp_path / "chaos.out").read_text()
    assert code == 0, out[-3000:]
    # 3 -> 2 -> 3, in that order, among what Prometheus stored (0 before the first round).
    assert any(seen[i : i + 3] == [3.0, 2.0, 3.0] for i in range(len(seen))), seen
    assert counted == len(recovered), (counted, recovered)
    assert observed == pytest.approx(stalls, abs=1e-6)
    assert up == NODES
    assert etcd is not None and etcd > 0
    for i, target in enumerate(targets):  # each node's record in etcd names its endpoint
        assert f"node{i} metrics: http://{target}/metrics" in status.stdout, status


PROMTOOL = shutil.which("promtool")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "prometheus"


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool on PATH (Debian's prometheus package)")
@pytest.mark.parametrize(
    "args",
    [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],  # each alert fires when it should, and only then
    ],
)
def test_the_example_scrape_config_and_alert_rules_pass_promtool(args: list[str]) -> None:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], cwd=EXAMPLES, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
