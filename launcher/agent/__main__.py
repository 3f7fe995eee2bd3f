"""Run one node's agent: ``python -m launcher.agent --config ... --node-id ...``.

The launcher starts it so on each node (:class:`launcher.agent.agent.Agent`)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from elastic import config
from elastic.sched_policy import yield_to_training
from launcher.agent.agent import Agent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.agent", description="Run one node's agent for a resolved config."
    )
    parser.add_argument("--config", required=True, help="resolved config.yaml of the job")
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address peers reach this node at")
    parser.add_argument("--etcd", required=True, help="comma-separated etcd endpoints host:port")
    parser.add_argument(
        "--nodes-on-machine",
        type=int,
        default=1,
        help="agents sharing this machine's cores (local simulation)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="where this node serves /metrics (default: metrics.port)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [{args.node_id}] %(name)s: %(message)s"
    )
    cfg = config.load(args.config)
    if cfg.cluster.yield_to_training:  # and its threads and processes, but for the workers
        yield_to_training()
    agent = Agent(
        cfg,
        args.config,
        args.node_id,
        args.host or socket.getfqdn(),
        args.etcd.split(","),
        args.nodes_on_machine,
        args.metrics_port,
    )
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
