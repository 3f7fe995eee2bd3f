"""``python -m launcher``: the Hydra entry point for every launch.

It composes the configuration from ``conf/`` and the command-line overrides, fills in the
defaults that depend on the moment (job id, run directory, checkpoint URL), checks every value
and the places the job needs (:mod:`launcher.health.preflight`: etcd, the checkpoint URL, the data)
before anything starts, prepares the data, writes the resolved ``config.yaml`` that all agents and
workers of the job read, and then either simulates ``cluster.nodes`` nodes on this machine
(``cluster=local``) or runs this node's agent (``cluster=bare_metal``).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from elastic import config
from elastic import event_types as ev
from elastic.config import ClusterMode, Config, ConfigError
from elastic.events import EventFollower, read_events
from elastic.synthetic import ensure_synthetic
from launcher.compose import finalize, validate_launch
from launcher.health.preflight import preflight
from launcher.local_cluster import run_local
from launcher.progress import ProgressDisplay, summary

log = logging.getLogger("launcher")


def launch(cfg: Config) -> int:
    try:
        validate_launch(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = preflight(cfg)
    if problems:
        print("error: the job cannot start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    started = time.time()
    if cfg.data.synthetic:
        log.info("preparing the synthetic ImageFolder at %s", cfg.data.root)
        if ensure_synthetic(cfg.data):
            log.info(
                "generated %d classes x %d JPEGs",
                cfg.data.generate.classes,
                cfg.data.generate.images_per_class,
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config.save(cfg, config_path)
    log.info("job %s: run directory %s", cfg.job_id, run_dir)

    if cfg.cluster.mode is ClusterMode.local:
        code = run_local(cfg, config_path)
        # The local launcher's code is 0 unless it was stopped; the job's end is in the events.
        finished = any(
            ev.TRAINING_DONE.matches(e) and e["ts"] >= started for e in read_events(run_dir)
        )
        code = code if code else (0 if finished else 1)
    else:
        # The agent's code says it (0: the job is trained). The rank-0 node writes
        # training_done, possibly a moment after this node's agent has seen the job done.
        code = _run_bare_metal(cfg, config_path)
    print(summary(run_dir, cfg.checkpoint.url, cfg.job_id, since=started), flush=True)
    return code


def _run_bare_metal(cfg: Config, config_path: Path) -> int:
    """This node's agent in this process, with progress from this node's events."""
    # Imported here: the agent needs torch (its TCPStore), which a local launch's process, whose
    # agents run in processes of their own, would pay for in seconds before any node starts.
    from launcher.agent.agent import Agent

    node_id = cfg.cluster.node_id or socket.gethostname()
    host = cfg.cluster.host or socket.getfqdn()
    agent = Agent(cfg, str(config_path), node_id, host, list(cfg.cluster.etcd_endpoints))
    display, done = ProgressDisplay(), threading.Event()
    follower = EventFollower(cfg.run_dir, only_new=True)

    def follow() -> None:
        while not done.wait(0.5):
            display.handle(follower.poll())

    thread = threading.Thread(target=follow, name="progress", daemon=True)
    thread.start()
    try:
        return agent.run()
    finally:
        done.set()
        thread.join(timeout=5)
        display.handle(follower.poll())
        display.close()


@hydra.main(version_base=None, config_path="pkg://conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = finalize(OmegaConf.to_object(dcfg))  # type: ignore[arg-type]
    sys.exit(launch(cfg))
