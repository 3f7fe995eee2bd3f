"""The configuration of a launch, composed by Hydra from ``conf/`` and the command line.

Every command of the project reads its configuration the same way: ``python -m launcher`` (through
``@hydra.main``), and the commands beside it (the doctor, the quarantine command) through
:func:`compose`, so that they see the thresholds, job and etcd of the launch they are given the
overrides of. :func:`finalize` fills in the values that default to "now" or "here", and
:func:`validate_launch` checks every value, the launcher's own rules included.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elastic import config
from elastic.config import ClusterMode, Config
from elastic.job_target import job_problems
from launcher.rendezvous.credentials import etcd_security_problems

# conf/config.yaml starts from this schema: types and defaults come from elastic/config/.
ConfigStore.instance().store(name="schema", node=Config)


class UsageError(ValueError):
    """Overrides that do not compose into a configuration, or miss what a command needs."""


def finalize(cfg: Config) -> Config:
    """Fill in the values that default to "now" or "here", as absolute paths."""
    job_id = cfg.job_id or (
        time.strftime("%Y%m%d-%H%M%S") if cfg.cluster.mode is ClusterMode.local else ""
    )
    run_dir = Path(cfg.run_dir or f"runs/{job_id}").expanduser().resolve()
    url = cfg.checkpoint.url or f"file://{run_dir / 'checkpoints'}"
    return dataclasses.replace(
        cfg,
        job_id=job_id,
        run_dir=str(run_dir),
        checkpoint=dataclasses.replace(cfg.checkpoint, url=url),
        data=dataclasses.replace(cfg.data, root=str(Path(cfg.data.root).expanduser().resolve())),
    )


def validate_launch(cfg: Config) -> None:
    """Validate ``cfg`` with :func:`elastic.config.validate` and the launcher's own rules.

    Only the launcher applies these rules. They cover the job class and its ``job.*`` settings
    (:func:`elastic.job_target.job_problems`, which imports the job's module). They cover the
    etcd credentials too (:func:`launcher.rendezvous.credentials.etcd_security_problems`), which
    a worker never reads. Raises :class:`~elastic.config.ConfigError` listing every problem."""
    config.validate(cfg, job_problems, lambda c: etcd_security_problems(c.cluster))


def compose(overrides: list[str], need_job: bool = False) -> Config:
    """The configuration a launch with ``overrides`` would run.

    Finalized (see :func:`finalize`) only with ``need_job``: the doctor needs to tell whether a
    job id was given.
    """
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            dcfg = hydra_compose(config_name="config", overrides=overrides)
        cfg: Config = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as exc:
        # Hydra says only which override failed ("Error merging override cluster.device=gpu");
        # OmegaConf's error under it names the full key and, for an enum, the allowed values.
        cause = f"\n{exc.__cause__}" if exc.__cause__ is not None else ""
        raise UsageError(
            f"{exc}{cause}\nFix: pass overrides as key=value with the keys of conf/config.yaml "
            "(every key is documented in elastic/config/)"
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
