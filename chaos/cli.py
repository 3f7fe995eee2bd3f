"""``python -m chaos [campaign=<name>] [campaign.<key>=...] [job overrides...]``: run a chaos
campaign against a local job and judge it.

Overrides that start with ``campaign`` choose and tune the campaign (``conf/campaign/``, the
schema in :mod:`chaos.campaign`); every other override is the job's, exactly as for ``python -m
launcher``. The command starts an etcd of its own for the job (so that it can start killed nodes
again), launches the job with ``trainer.record_samples=true`` (the invariants need every rank's
samples), carries out the schedule (:mod:`chaos.runner`), measures the fault-free rate at each
world size the job ran at (``campaign.baseline``), and writes ``report.json``, ``summary.txt``
and ``timeline.png`` to ``<run_dir>/chaos/``. It exits 1 if an invariant broke, 2 on bad input.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from chaos.campaign import CampaignConfig, ChaosConfig, problems
from chaos.runner import CampaignRunner
from chaos.timeline import draw
from chaos.verdict import fault_free_rate, judge, needed_sizes, summary
from elastic import config
from elastic.config import ClusterMode, Config, ConfigError
from elastic.events import read_events
from launcher.compose import UsageError, compose, finalize
from launcher.embedded_etcd import EmbeddedEtcd

ConfigStore.instance().store(name="chaos_schema", node=ChaosConfig)

JOB_TIMEOUT_S = 6 * 3600.0  # a campaign's job, or a fault-free run, that runs longer is stopped


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(campaign overrides, job overrides)``."""
    ours = [a for a in argv if a.split("=", 1)[0].split(".", 1)[0] == "campaign"]
    return ours, [a for a in argv if a not in ours]


def compose_campaign(overrides: list[str]) -> CampaignConfig:
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            dcfg = hydra_compose(config_name="chaos", overrides=overrides)
        chaos: ChaosConfig = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as exc:
        cause = f"\n{exc.__cause__}" if exc.__cause__ is not None else ""
        raise UsageError(
            f"{exc}{cause}\nFix: choose a campaign from conf/campaign/ (campaign=scripted) and "
            "set its keys as campaign.<key>=<value> (the keys are in chaos/campaign.py)"
        ) from exc
    return chaos.campaign


def launcher_argv(job: list[str], *more: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *job, *more]


def run_job(argv: list[str], out: Path) -> int:
    with open(out, "w") as f:
        return subprocess.run(
            argv, stdout=f, stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S
        ).returncode


def baseline_rates(
    cfg: Config,
    campaign: CampaignConfig,
    job: list[str],
    endpoint: str,
    sizes: list[int],
    samples_per_epoch: int,
    out_dir: Path,
) -> dict[int, float]:
    """The fault-free samples/s of the same job at each world size in ``sizes``: one short run
    each, on the same etcd under another job id, with checkpoints of its own."""
    rates = {}
    for world in sizes:
        run_dir = out_dir / f"baseline-{world}"
        epochs = campaign.baseline_steps * world * cfg.data.batch_size / samples_per_epoch
        print(
            f"chaos: fault-free run at {world} nodes ({campaign.baseline_steps} steps)", flush=True
        )
        code = run_job(
            launcher_argv(
                job,
                f"job_id={cfg.job_id}-baseline{world}",
                f"run_dir={run_dir}",
                f"cluster.nodes={world}",
                f"cluster.etcd_endpoints=[{endpoint}]",
                f"checkpoint.url=file://{run_dir / 'checkpoints'}",
                f"trainer.epochs={epochs}",
                "trainer.record_samples=true",  # as in the campaign: the same work per step
            ),
            out_dir / f"baseline-{world}.out",
        )
        if code != 0:
            raise RuntimeError(
                f"the fault-free run at {world} nodes exited with {code}; see "
                f"{out_dir / f'baseline-{world}.out'}"
            )
        rates[world] = fault_free_rate(read_events(run_dir))
    return rates


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    campaign_args, job = split(argv)
    try:
        campaign = compose_campaign(campaign_args)
        cfg = compose(job, need_job=False)
        config.validate(cfg)
    except (UsageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = finalize(cfg)
    found = problems(campaign, cfg.cluster.nodes)
    if cfg.cluster.mode is not ClusterMode.local:
        found.append(
            config.problem(
                "cluster.mode",
                str(cfg.cluster.mode),
                "python -m chaos launches a local job",
                "run it with cluster=local (attaching to a bare-metal job is not there yet)",
            )
        )
    if cfg.cluster.etcd_endpoints:
        found.append(
            config.problem(
                "cluster.etcd_endpoints",
                cfg.cluster.etcd_endpoints,
                "the campaign starts the job's etcd itself",
                "leave it empty",
            )
        )
    if found:
        print("error: the campaign cannot run:\n  " + "\n  ".join(found), file=sys.stderr)
        return 2

    run_dir = Path(cfg.run_dir)
    out_dir = Path(campaign.out_dir) if campaign.out_dir else run_dir / "chaos"
    out_dir.mkdir(parents=True, exist_ok=True)
    job = [*job, f"job_id={cfg.job_id}", f"run_dir={run_dir}"]
    print(
        f"chaos: campaign {campaign.name!r} (seed {campaign.seed}) on job {cfg.job_id}, "
        f"{cfg.cluster.nodes} nodes; the job's output: {out_dir / 'job.out'}",
        flush=True,
    )
    with EmbeddedEtcd(out_dir / "etcd", out_dir / "etcd.log") as etcd:
        argv_job = launcher_argv(
            job, f"cluster.etcd_endpoints=[{etcd.endpoint}]", "trainer.record_samples=true"
        )
        with open(out_dir / "job.out", "w") as f:
            proc = subprocess.Popen(argv_job, stdout=f, stderr=subprocess.STDOUT)
        runner = CampaignRunner(cfg, campaign, [etcd.endpoint])
        try:
            runner.run(proc)
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=60)
        print(f"chaos: the job exited with {proc.returncode}", flush=True)
        events = read_events(run_dir)
        job_cfg = config.load(run_dir / "config.yaml")
        rates = None
        if campaign.baseline:
            sizes = needed_sizes(events, job_cfg.cluster.nodes, job_cfg.cluster.min_nodes)
            started = next(e for e in events if e["event"] == "training_started")
            per_epoch = round(started["total_samples"] / job_cfg.trainer.epochs)
            rates = baseline_rates(job_cfg, campaign, job, etcd.endpoint, sizes, per_epoch, out_dir)
    verdict = judge(events, job_cfg, rates)
    (out_dir / "report.json").write_text(verdict.to_json())
    text = summary(verdict)
    (out_dir / "summary.txt").write_text(text + "\n")
    draw(events, verdict, out_dir / "timeline.png", f"campaign {campaign.name}")
    print(text)
    print(f"chaos: report {out_dir / 'report.json'}, picture {out_dir / 'timeline.png'}")
    return 0 if verdict.ok else 1
