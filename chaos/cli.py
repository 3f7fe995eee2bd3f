"""Run a chaos campaign against a job and judge it.

Usage: ``python -m chaos [campaign=<name>] [campaign.<key>=...] [job overrides...]``.

Overrides that start with ``campaign`` choose and tune the campaign (``conf/campaign/``, the
schema in :mod:`chaos.campaign`); every other override is the job's, as for ``python -m
launcher``. By default it launches a local job on an etcd of its own (so that it can start killed
nodes again), carries out the schedule (:mod:`chaos.runner`), judges the job's event log
(:mod:`chaos.verdict`) and writes ``report.json``, ``summary.txt`` and ``timeline.png`` to
``<run_dir>/chaos/``; the job it launches runs with ``chaos.allow=true`` (its faults include a
bit flipped in a worker's memory) unless the overrides say otherwise. With
``campaign.attach=true`` it joins the running job named by ``job_id``, ``cluster.etcd_endpoints``
and ``run_dir`` instead (started with ``chaos.allow=true`` and ``trainer.record_samples=true``)
and requests each fault from the node's agent through etcd. It exits 1 if an invariant broke, 2
on bad input.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from chaos import netns
from chaos.campaign import CampaignConfig, ChaosCommandConfig, problems
from chaos.runner import CampaignRunner
from chaos.timeline import draw
from chaos.verdict import judge, summary
from elastic import config
from elastic import event_types as ev
from elastic.config import ClusterMode, Config, ConfigError
from elastic.events import EventFollower, RunEnded, read_events
from launcher.compose import UsageError, compose, finalize, validate_launch
from launcher.rendezvous.embedded_etcd import HOST, EmbeddedEtcd
from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_security

ConfigStore.instance().store(name="chaos_schema", node=ChaosCommandConfig)

JOB_TIMEOUT_S = 6 * 3600.0  # a campaign's job that runs longer is stopped
RECORD_SAMPLES = "trainer.record_samples=true"  # the invariants need every rank's samples
ALLOW = "chaos.allow=true"  # a campaign's own job takes its faults (corrupt_replica), unless told
ANY = "0.0.0.0"  # etcd for nodes in namespaces: every address of this machine


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(campaign overrides, job overrides)``."""
    ours = [a for a in argv if a.split("=", 1)[0].split(".", 1)[0] == "campaign"]
    return ours, [a for a in argv if a not in ours]


def compose_campaign(overrides: list[str]) -> CampaignConfig:
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            dcfg = hydra_compose(config_name="chaos", overrides=overrides)
        chaos: ChaosCommandConfig = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as exc:
        cause = f"\n{exc.__cause__}" if exc.__cause__ is not None else ""
        raise UsageError(
            f"{exc}{cause}\nFix: choose a campaign from conf/campaign/ (campaign=scripted) and "
            "set its keys as campaign.<key>=<value> (the keys are in chaos/campaign.py)"
        ) from exc
    return chaos.campaign


def launcher_argv(job: list[str], *more: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *job, *more]


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    campaign_args, job = split(argv)
    try:
        campaign = compose_campaign(campaign_args)
        if not campaign.attach and not any(a.split("=", 1)[0] == "chaos.allow" for a in job):
            job = [*job, ALLOW]
        cfg = compose(job, need_job=campaign.attach)
        validate_launch(cfg)
    except (UsageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = finalize(cfg)
    return attach(cfg, campaign) if campaign.attach else launch(cfg, campaign, job)


def refuse(found: list[str]) -> int:
    print("error: the campaign cannot run:\n  " + "\n  ".join(found), file=sys.stderr)
    return 2


def nothing_to_judge(events: list[dict[str, Any]], out_dir: Path) -> str | None:
    """Say why a campaign's job cannot be judged, or None when it can.

    It cannot when it trained fewer than two steps: a node refused by its health checks, a bad
    setting."""
    if sum(ev.STEP.matches(e) for e in events) >= 2:
        return None
    refused = next((e for e in events if ev.HEALTH_FAILED.matches(e)), None)
    why = f": {refused['node']} failed {'; '.join(refused['failures'])}" if refused else ""
    return (
        f"the job trained fewer than two steps, so there is nothing to judge{why}. The nodes' "
        f"output is in {out_dir}"
    )


def launch_problems(cfg: Config, campaign: CampaignConfig) -> list[str]:
    """What keeps ``campaign`` from launching job ``cfg`` itself: the key, the value and the fix."""
    found = problems(campaign, cfg.cluster.nodes)
    if cfg.cluster.mode is not ClusterMode.local:
        found.append(
            config.problem(
                "cluster.mode",
                str(cfg.cluster.mode),
                "python -m chaos launches a local job",
                "run it with cluster=local, or attach to the running job with campaign.attach=true",
            )
        )
    if cfg.cluster.etcd_endpoints:
        found.append(
            config.problem(
                "cluster.etcd_endpoints",
                cfg.cluster.etcd_endpoints,
                "the campaign starts the job's etcd itself",
                "leave it empty, or attach to a running job with campaign.attach=true",
            )
        )
    if campaign.netns and (why := netns.available()):
        found.append(
            config.problem(
                "campaign.netns",
                True,
                f"this host cannot make network namespaces ({why})",
                "run as root with iproute2, or leave it false (network faults are then skipped)",
            )
        )
    return found


def launch(cfg: Config, campaign: CampaignConfig, job: list[str]) -> int:
    """Launch a local job on an etcd of our own, run the campaign on it, and judge it.

    The job records every rank's samples (``trainer.record_samples=true``): the invariants need
    them."""
    if found := launch_problems(cfg, campaign):
        return refuse(found)

    run_dir = Path(cfg.run_dir)
    out_dir = Path(campaign.out_dir) if campaign.out_dir else run_dir / "chaos"
    out_dir.mkdir(parents=True, exist_ok=True)
    job = [*job, f"job_id={cfg.job_id}", f"run_dir={run_dir}"]
    print(
        f"chaos: campaign {campaign.name!r} (seed {campaign.seed}) on job {cfg.job_id}, "
        f"{cfg.cluster.nodes} nodes; the job's output: {out_dir / 'job.out'}",
        flush=True,
    )
    etcd_dir, members = out_dir / "etcd", campaign.etcd_members
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(netns.LocalNetwork(cfg.cluster.nodes)) if campaign.netns else None
        etcd = stack.enter_context(
            EmbeddedEtcd(
                etcd_dir, out_dir / "etcd.log", members=members, listen_host=ANY if net else HOST
            )
        )
        endpoints = etcd.endpoints
        start_node, procs = None, []
        if net is None:
            argv_job = launcher_argv(
                job, f"cluster.etcd_endpoints=[{','.join(endpoints)}]", RECORD_SAMPLES
            )
            with open(out_dir / "job.out", "w") as f:
                procs.append(subprocess.Popen(argv_job, stdout=f, stderr=subprocess.STDOUT))
        else:
            ports = [int(e.rsplit(":", 1)[1]) for e in endpoints]

            def start_node(node: str) -> subprocess.Popen[bytes]:
                """Node ``node``'s bare-metal launcher, in its namespace."""
                argv = net.launcher(int(node.removeprefix("node")), ports, *job, RECORD_SAMPLES)
                with open(out_dir / f"{node}.out", "ab") as f:
                    return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)

            procs.append(start_node("node0"))  # it prepares the data before its agent starts
            with contextlib.suppress(RunEnded):  # node0 ended first: the verdict says how
                EventFollower(run_dir).wait_for(
                    ev.AGENT_STARTED.matches,
                    timeout_s=JOB_TIMEOUT_S,
                    running=lambda: procs[0].poll() is None,
                )
            procs += [start_node(f"node{i}") for i in range(1, cfg.cluster.nodes)]
        runner = CampaignRunner(cfg, campaign, endpoints, etcd=etcd, net=net, start_node=start_node)
        try:
            # Nodes in namespaces are launchers of their own: the job runs while any does.
            runner.run(lambda: any(p.poll() is None for p in procs + runner.started()))
            for p in procs:
                p.wait(timeout=JOB_TIMEOUT_S)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(timeout=60)
        codes = ", ".join(str(p.returncode) for p in procs)
        print(f"chaos: the job exited with {codes}", flush=True)
        events = read_events(run_dir)
        job_cfg = config.load(run_dir / "config.yaml")
        if untrained := nothing_to_judge(events, out_dir):
            return refuse([untrained])
    return report(events, job_cfg, out_dir, campaign)


def attach(cfg: Config, campaign: CampaignConfig) -> int:
    """Run the campaign on the running job ``cfg`` names, through fault requests, and judge it.

    It is judged from its event log. ``run_dir`` is where the job's config and events are (a shared
    file system, or this machine); the job must have been started with ``chaos.allow=true`` and
    ``trainer.record_samples=true``."""
    run_dir = Path(cfg.run_dir)
    if not (run_dir / "config.yaml").exists():
        return refuse(
            [
                config.problem(
                    "run_dir",
                    str(run_dir),
                    "no config.yaml of a running job there",
                    "point run_dir at the job's run directory (shared, or on this machine)",
                )
            ]
        )
    job_cfg = config.load(run_dir / "config.yaml")
    found = problems(campaign, job_cfg.cluster.nodes)
    if not job_cfg.chaos.allow:
        found.append(
            config.problem(
                "chaos.allow",
                False,
                f"job {cfg.job_id} was started without it, and its agents refuse fault requests",
                "start the job with chaos.allow=true",
            )
        )
    if not job_cfg.trainer.record_samples:
        found.append(
            config.problem(
                "trainer.record_samples",
                False,
                "the job does not log its samples, so exactly-once cannot be checked",
                "start the job with trainer.record_samples=true",
            )
        )
    if found:
        return refuse(found)
    try:
        client = connect(
            cfg.cluster.etcd_endpoints,
            timeout_s=cfg.health.etcd_timeout_s,
            security=etcd_security(cfg.cluster),
        )
    except EtcdUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(campaign.out_dir) if campaign.out_dir else run_dir / "chaos"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos: campaign {campaign.name!r} (seed {campaign.seed}) attached to job "
        f"{cfg.job_id} through etcd {','.join(cfg.cluster.etcd_endpoints)}",
        flush=True,
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    runner = CampaignRunner(job_cfg, campaign, cfg.cluster.etcd_endpoints, remote=client)
    runner.run(lambda: time.monotonic() < deadline)
    events = read_events(run_dir)
    if untrained := nothing_to_judge(events, out_dir):
        return refuse([untrained])
    return report(events, job_cfg, out_dir, campaign)


def report(
    events: list[dict[str, Any]], job_cfg: Config, out_dir: Path, campaign: CampaignConfig
) -> int:
    """Judge the campaign, write its report, summary and picture, and return the exit code.

    Its job must have trained (:func:`nothing_to_judge`)."""
    verdict = judge(events, job_cfg)
    (out_dir / "report.json").write_text(verdict.to_json())
    text = summary(verdict)
    (out_dir / "summary.txt").write_text(text + "\n")
    draw(events, verdict, out_dir / "timeline.png", f"campaign {campaign.name}")
    print(text)
    print(f"chaos: report {out_dir / 'report.json'}, picture {out_dir / 'timeline.png'}")
    return 0 if verdict.ok else 1
