"""``python -m launcher``: the Hydra entry point for every launch.

It composes the configuration from ``conf/`` and the command-line overrides, fills in the
defaults that depend on the moment (job id, run directory, checkpoint URL), checks every value
before anything starts, prepares the data, writes the resolved ``config.yaml`` that all agents and
workers of the job read, and then either simulates ``cluster.nodes`` nodes on this machine
(``cluster=local``) or runs this node's agent (``cluster=bare_metal``).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from elastic import config
from elastic.config import Config, ConfigError
from elastic.events import EventFollower, read_events
from launcher.progress import ProgressDisplay, summary

log = logging.getLogger("launcher")

ConfigStore.instance().store(name="schema", node=Config)


def finalize(cfg: Config) -> Config:
    """Fill in the values that default to "now" or "here", as absolute paths."""
    job_id = cfg.job_id or (time.strftime("%Y%m%d-%H%M%S") if cfg.cluster.mode == "local" else "")
    run_dir = Path(cfg.run_dir or f"runs/{job_id}").expanduser().resolve()
    url = cfg.checkpoint.url or f"file://{run_dir / 'checkpoints'}"
    return dataclasses.replace(
        cfg,
        job_id=job_id,
        run_dir=str(run_dir),
        checkpoint=dataclasses.replace(cfg.checkpoint, url=url),
        data=dataclasses.replace(cfg.data, root=str(Path(cfg.data.root).expanduser().resolve())),
    )


class UsageError(ValueError):
    """Overrides that do not compose into a configuration, or miss what a command needs."""


def compose(overrides: list[str], need_job: bool = False) -> Config:
    """The configuration a launch with ``overrides`` would run, for the commands beside the
    launcher (doctor, quarantine), so that they read the same thresholds, job and etcd.
    Finalized (see :func:`finalize`) only with ``need_job``: the doctor needs to tell whether a
    job id was given."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_module(config_module="conf", version_base=None):
            dcfg = hydra_compose(config_name="config", overrides=overrides)
        cfg: Config = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(
            f"{exc}\nFix: pass overrides as key=value with the keys of conf/config.yaml "
            "(every key is documented in elastic/config.py)"
        ) from exc
    if need_job and not cfg.job_id:
        raise UsageError("job_id is empty. Fix: pass job_id=<the job's id>")
    if need_job and not cfg.cluster.etcd_endpoints:
        raise UsageError(
            "cluster.etcd_endpoints is empty. Fix: pass the job's etcd, e.g. "
            "cluster.etcd_endpoints=[10.0.0.1:2379] (a local run logs its embedded etcd's "
            "address at start)"
        )
    return finalize(cfg) if need_job else cfg


def launch(cfg: Config) -> int:
    try:
        config.validate(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from elastic.data import ensure_synthetic  # torch and torchvision: not for compose()'s users

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

    if cfg.cluster.mode == "local":
        from launcher.local_cluster import run_local

        code = run_local(cfg, config_path)
    else:
        code = _run_bare_metal(cfg, config_path)
    print(summary(run_dir, cfg.checkpoint.url, cfg.job_id, since=started), flush=True)
    finished = any(
        e["event"] == "training_done" and e["ts"] >= started for e in read_events(run_dir)
    )
    return code if code else (0 if finished else 1)


def _run_bare_metal(cfg: Config, config_path: Path) -> int:
    """This node's agent in this process, with progress from this node's events."""
    from launcher.agent import Agent

    node_id = cfg.cluster.node_id or socket.gethostname()
    host = cfg.cluster.host or socket.getfqdn()
    agent = Agent(cfg, str(config_path), node_id, host, list(cfg.cluster.etcd_endpoints))
    display, follower, done = ProgressDisplay(), EventFollower(cfg.run_dir), threading.Event()

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
