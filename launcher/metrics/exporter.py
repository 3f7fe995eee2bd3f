"""The node's ``/metrics`` endpoint: Prometheus' text format, served by ``prometheus-client``.

A scrape does the work: it reads the events the node's file gained since the last scrape
(:class:`elastic.events.EventFollower`), moves the figures (:class:`NodeMetrics`), reads the
processes' memory, and answers. Between scrapes nothing runs, so a scrape every 15 s costs the
agent one short read of its own file, and the workers nothing (``bench/metrics_cost.py``).

Counters start at zero with the agent (the file's older events are not replayed): an agent
started again is a counter reset to Prometheus, which ``rate()`` and ``increase()`` handle.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.registry import Collector

from elastic import event_types as ev
from elastic.config import Config
from elastic.events import EventFollower, EventLog
from launcher.metrics.node_metrics import EtcdCounts, NodeMetrics

log = logging.getLogger(__name__)


disable_created_metrics()  # no ``_created`` series beside every counter: half the lines


class _OnScrape(Collector):
    """What the server collects: the node's figures, brought up to date first."""

    def __init__(self, refresh: Callable[[], None], figures: CollectorRegistry) -> None:
        self._refresh = refresh
        self._figures = figures

    def collect(self) -> Iterator[Any]:
        self._refresh()
        yield from self._figures.collect()


class MetricsServer:
    """Serves node ``node_id``'s figures on ``host:port`` until :meth:`close`.

    ``processes()`` names the node's processes whose memory is shown, with their pids (the
    agent's own and each running worker's)."""

    def __init__(
        self,
        metrics: NodeMetrics,
        run_dir: str,
        node_id: str,
        processes: Callable[[], Mapping[str, int]],
    ) -> None:
        self.metrics = metrics
        self._events = EventFollower(run_dir, only_new=True, pattern=f"{node_id}.jsonl")
        self._processes = processes
        self._lock = threading.Lock()  # two scrapes at once read the file once each
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_OnScrape(self.refresh, metrics.registry))
        self._server: Any = None
        self.etcd: EtcdCounts | None = None  # the agent's etcd client's counts, once it has one
        self._gpus = GpuMemory()
        self.url = ""  # once serving

    def serve(self, host: str, port: int) -> str:
        """Start answering on ``host:port`` (a thread of the server's); returns the URL.

        Raises OSError when the port cannot be bound."""
        self._server, _ = start_http_server(port, addr=host, registry=self._registry)
        self.url = f"http://{host}:{self._server.server_address[1]}/metrics"
        return self.url

    def refresh(self) -> None:
        """Read the node's new events and its processes' memory into the figures."""
        with self._lock:
            try:
                self.metrics.apply(self._events.poll())
                self.metrics.set_memory(resident_bytes(self._processes()))
                if self.etcd is not None:
                    self.metrics.count_etcd(self.etcd)
                self.metrics.set_gpu_memory(self._gpus.used())
            except Exception:  # a scrape must answer with what it has; never the agent's end
                log.exception("metrics: the figures were not brought up to date")

    def close(self) -> None:
        self._gpus.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class GpuMemory:
    """The memory in use on each GPU of the node, through NVML (nvidia-ml-py) where it is there.

    NVML is opened at the first reading and kept open; without it, or without a GPU, every
    reading is empty and the family is not served."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._tried = False

    def used(self) -> dict[str, int]:
        """Bytes in use on each GPU, by its NVML index."""
        if not self._tried:
            self._tried = True
            try:
                import pynvml  # the gpu extra's nvidia-ml-py

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as exc:  # not installed, no driver, no GPU: nothing to show
                log.debug("metrics: no GPU memory (%s)", exc)
        if self._nvml is None:
            return {}
        nvml = self._nvml
        return {
            str(i): nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used
            for i in range(nvml.nvmlDeviceGetCount())
        }

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


def resident_bytes(pids: Mapping[str, int]) -> dict[str, int]:
    """The resident memory of each process of ``pids`` still running."""
    found = {}
    for name, pid in pids.items():
        try:
            found[name] = psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return found


def start_metrics(
    cfg: Config,
    node_id: str,
    where: tuple[str, int],
    worker_pids: Callable[[], Mapping[str, int]],
    events: EventLog,
) -> MetricsServer | None:
    """Serve node ``node_id``'s metrics at ``where``, its address and port; None when the port is 0.

    ``metrics.host``, when set, replaces the address. The memory shown is the agent's (this
    process) and each worker's of ``worker_pids()``. A port that cannot be bound costs the
    metrics, never the node: the agent goes on, and says why in a ``metrics_off`` event."""
    host, port = cfg.metrics.host or where[0], where[1]
    if port == 0:
        return None
    server = MetricsServer(
        NodeMetrics(cfg.job_id, node_id, cfg.cluster.min_nodes, cfg.checkpoint.every_steps),
        cfg.run_dir,
        node_id,
        lambda: {"agent": os.getpid(), **worker_pids()},
    )
    try:
        url = server.serve(host, port)
    except OSError as exc:
        reason = (
            f"metrics.port={port}: {host}:{port} cannot be bound ({exc.strerror or exc}); "
            "fix: a free port, or metrics.host=<an address of this node>"
        )
        events.emit(
            ev.METRICS_OFF,
            f"{node_id}: no Prometheus metrics: {reason}",
            level=logging.ERROR,
            reason=reason,
        )
        return None
    events.emit(ev.METRICS_SERVED, url=url)
    return server
