"""The whole job's configuration: every section under its key, and the job's identity.

The root Hydra composes ``conf/config.yaml`` onto, and the type every process reads back from
the run directory's ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.config.cluster import ClusterConfig, RendezvousConfig
from elastic.config.metrics import MetricsConfig
from elastic.config.model_data import DataConfig, ModelConfig
from elastic.config.notify import NotifyConfig
from elastic.config.optim import OptimConfig
from elastic.config.resilience import ChaosConfig, CheckpointConfig, HealthConfig
from elastic.config.trainer import CommConfig, ParallelConfig, TrainerConfig

# The default job (conf/job/imagenet.yaml): a torchvision classifier on an ImageFolder.
IMAGENET_JOB = "elastic.jobs.imagenet.ImageNetJob"


@dataclass
class Config:
    # What to train: the job class (elastic/job.py's contract) as _target_, and its own settings
    # beside it, checked against the class's Settings (elastic/job_target.py).
    job: dict[str, Any] = field(default_factory=lambda: {"_target_": IMAGENET_JOB})
    job_id: str = ""  # local: a timestamp when empty; bare_metal: required, the same on every node
    run_dir: str = ""  # "" = runs/<job_id>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def max_nodes(cfg: Config) -> int:
    return cfg.cluster.max_nodes or cfg.cluster.nodes
