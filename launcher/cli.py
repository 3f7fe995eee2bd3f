"""``python -m launcher``: the Hydra entry point for every launch.

It composes the configuration from ``conf/`` and the command-line overrides, fills in the
defaults that depend on the moment (job id, run directory, checkpoint URL), checks every value
(the job's class and settings too) and the places the job needs
(:mod:`launcher.health.preflight`: etcd, the checkpoint URL) before anything starts,
prepares the job's data, writes the resolved ``config.yaml`` that all agents and workers of the
job read, and then either simulates ``cluster.nodes`` nodes on this machine
(``cluster=local``) or runs this node's agent (``cluster=bare_metal``). When the job ends it draws
the run's ``curves.png`` (:mod:`launcher.curves_png`) and prints the summary. The events it
follows for the progress display also make the job's alerts (:mod:`launcher.notify`): on bare
metal, this node's events only, as every node runs a launcher.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from elastic import config
from elastic import event_types as ev
from elastic.config import ClusterMode, Config, ConfigError
from elastic.control import EXIT_UNSAVED
from elastic.events import EventFollower, read_events
from elastic.job_target import prepare_job
from elastic.sched_policy import yield_to_training
from launcher import alerts
from launcher.compose import finalize, validate_launch
from launcher.curves_png import CURVES_PNG, draw
from launcher.health.preflight import preflight
from launcher.local_cluster import run_local
from launcher.notify import Notifier
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
    if cfg.cluster.yield_to_training:  # etcd, the agents and this process; the workers train
        yield_to_training()
    run_dir = Path(cfg.run_dir)
    started = time.time()
    prepare_job(cfg)  # the job's data, generated once (the ImageNet job's synthetic ImageFolder)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config.save(cfg, config_path)
    log.info("job %s: run directory %s", cfg.job_id, run_dir)

    if cfg.cluster.mode is ClusterMode.local:
        notifier = Notifier(cfg, "launcher")
        try:
            code = run_local(cfg, config_path, notifier.follow)
            # The local launcher's code is 0 unless it was stopped; the job's end is in the
            # events: trained and saved, trained but its final state unsaved (whose event made
            # its alert), or neither.
            ended = [e for e in read_events(run_dir) if e["ts"] >= started]
            finished = any(ev.TRAINING_DONE.matches(e) for e in ended)
            unsaved = any(ev.FINAL_SAVE_FAILED.matches(e) for e in ended)
            code = code if code else (0 if finished else EXIT_UNSAVED if unsaved else 1)
            if not finished and not unsaved:
                why = _why(code, f"no node finished the job; see the logs in {run_dir / 'logs'}")
                notifier.send(alerts.failed(cfg.job_id, "launcher", code, why, time.time()))
        finally:
            notifier.close()
    else:
        # The agent's code says it (0: the job is trained; EXIT_UNSAVED: trained, but its
        # final state is not saved). The rank-0 node writes training_done, possibly a moment
        # after this node's agent has seen the job done.
        code = _run_bare_metal(cfg, config_path)
    try:
        draw(read_events(run_dir), run_dir / CURVES_PNG, f"job {cfg.job_id}")
    except Exception as exc:  # a picture that fails must not hide the summary
        log.warning("%s not drawn: %s: %s", run_dir / CURVES_PNG, type(exc).__name__, exc)
    print(summary(run_dir, cfg.checkpoint.url, cfg.job_id, since=started), flush=True)
    return code


def _run_bare_metal(cfg: Config, config_path: Path) -> int:
    """Run this node's agent in this process, with its progress and its alerts.

    The progress comes from this node's events, and the alerts from what this node wrote (each
    event is written by one node only)."""
    # Imported here: the agent needs torch (its TCPStore), which a local launch's process, whose
    # agents run in processes of their own, would pay for in seconds before any node starts.
    from launcher.agent.admission import EXIT_ETCD_LOST
    from launcher.agent.agent import Agent

    node_id = cfg.cluster.node_id or socket.gethostname()
    host = cfg.cluster.host or socket.getfqdn()
    agent = Agent(cfg, str(config_path), node_id, host, list(cfg.cluster.etcd_endpoints))
    display, done = ProgressDisplay(), threading.Event()
    follower = EventFollower(cfg.run_dir, only_new=True)
    notifier = Notifier(cfg, node_id)

    def show(events: list[dict[str, Any]]) -> None:
        display.handle(events)
        notifier.follow([e for e in events if e.get("node") == node_id])

    def follow() -> None:
        while not done.wait(0.5):
            show(follower.poll())

    thread = threading.Thread(target=follow, name="progress", daemon=True)
    thread.start()
    try:
        code = agent.run()
        if alerts.reports_failure(code, agent.others_led(), etcd_lost=code == EXIT_ETCD_LOST):
            why = _why(code, agent.leave_reason or f"see {node_id}'s log")
            notifier.send(alerts.failed(cfg.job_id, node_id, code, why, time.time()))
        return code
    finally:
        done.set()
        thread.join(timeout=5)
        show(follower.poll())
        display.close()
        notifier.close()


def _why(code: int, otherwise: str) -> str:
    """Why a launcher ended with ``code``: the signal that stopped it, or ``otherwise``."""
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"stopped by {signal.Signals(code - 128).name}"
    return otherwise


@dataclass(frozen=True)
class Ended:
    """One job this process launched, as a sweep's summary lists it."""

    job_id: str
    run_dir: str
    overrides: tuple[str, ...]
    code: int
    swept: bool  # one job of a --multirun sweep


_ENDED: list[Ended] = []  # in launch order: Hydra's basic launcher runs a sweep's jobs in turn
_SWEEP_BEGAN: dict[str, str] = {}  # "at": when a sweep's first job began, its jobs' id prefix


def of_sweep(dcfg: DictConfig, num: int, began: str) -> DictConfig:
    """Give job ``num`` of a sweep its own job id and run directory.

    The id is ``<job_id>-<num>`` (or ``<the sweep's start>-<num>``); the run directory is
    ``<run_dir>/<num>`` if a run directory was given. Thus no job resumes from another's
    checkpoints or shares its event log."""
    job = dcfg.copy()
    job.job_id = f"{dcfg.job_id or began}-{num}"
    if dcfg.run_dir:
        job.run_dir = str(Path(dcfg.run_dir) / str(num))
    return job


def outcome(ended: list[Ended]) -> int:
    """The process's exit code: a single job's own, or a sweep's, after a line per job.

    A sweep's is 0 when every job ended 0, and 1 otherwise. No job at all: Hydra answered a flag
    of its own (``--help``, ``--cfg job``, ``--info``) and launched nothing, which is no failure.
    A config it cannot compose, or a job that raised, ends the process in Hydra with 1."""
    if not any(e.swept for e in ended):
        return ended[-1].code if ended else 0
    failed = [e for e in ended if e.code]
    shared = set.intersection(*(set(e.overrides) for e in ended))
    print(f"\nsweep: {len(ended)} job(s), {len(failed)} failed")
    for e in ended:
        status = "ok" if e.code == 0 else f"exit {e.code}"
        swept = " ".join(o for o in e.overrides if o not in shared) or "-"
        print(f"  {e.job_id:24} {status:8} {swept}  ({e.run_dir})")
    return 1 if failed else 0


@hydra.main(version_base=None, config_path="pkg://conf", config_name="config")
def _job(dcfg: DictConfig) -> int:
    """Run one job: the whole launch, or one of a ``--multirun`` sweep.

    Hydra runs a sweep's jobs in turn, and a job must not end the process: a ``sys.exit`` here
    ended the sweep after its first."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    hydra_cfg = HydraConfig.get()
    swept = hydra_cfg.mode == RunMode.MULTIRUN
    if swept:
        began = _SWEEP_BEGAN.setdefault("at", time.strftime("%Y%m%d-%H%M%S"))
        dcfg = of_sweep(dcfg, hydra_cfg.job.num, began)
    cfg = finalize(OmegaConf.to_object(dcfg))  # type: ignore[arg-type]
    code = launch(cfg)
    _ENDED.append(Ended(cfg.job_id, cfg.run_dir, tuple(hydra_cfg.overrides.task), code, swept))
    return code


def main() -> None:
    """``python -m launcher [--multirun] [overrides]``; exits with :func:`outcome`."""
    _job()
    sys.exit(outcome(_ENDED))
