"""The ``metrics`` section: each agent's Prometheus endpoint (:mod:`launcher.metrics`).

Clusters that run long unattended jobs are watched by Prometheus; an agent that serves
``/metrics`` puts the job on the dashboards and alerts its operators already have. Off by
default: a port opened on every node is the operator's choice (docs/bare-metal.md#security).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config.schema import bounded


@dataclass
class MetricsConfig:
    """Where each agent serves ``/metrics``; ``port`` 0: nowhere."""

    # The TCP port of every node's endpoint. Simulated nodes (cluster=local) share one host:
    # node i serves on port + i.
    port: int = bounded(
        0, ge=0, le=65535, fix="set metrics.port=9464 (Prometheus' exporter range), or 0: off"
    )
    # The address it binds to; "" = the node's cluster.host (the cluster network), as every
    # other port of the runtime. 0.0.0.0 opens it on every network of the machine.
    host: str = ""
