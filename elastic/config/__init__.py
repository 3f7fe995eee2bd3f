"""The typed configuration schema shared by the launcher, the agents and the workers.

Hydra composes YAML from ``conf/`` on top of these dataclasses, so OmegaConf refuses a wrong type,
an unknown key, or a spelling outside a :class:`Choice` enum while composing. Each section lives
in its own module, its numeric ranges declared next to its keys (:mod:`.schema`); what a range
cannot express is checked by each section's rules (:mod:`.job_rules`, :mod:`.training_rules`),
all run by :func:`validate` (:mod:`.validation`). Every process of a job reads back the resolved
``config.yaml`` the launcher wrote (:mod:`.io`). This module re-exports every public name, so
that ``from elastic.config import X`` and ``config.X`` name them wherever they live.
"""

from elastic.config.cluster import (
    ClusterConfig,
    ClusterMode,
    Device,
    EtcdTlsConfig,
    RendezvousConfig,
)
from elastic.config.io import load, save
from elastic.config.job import Config, max_nodes
from elastic.config.job_rules import JOB_ID
from elastic.config.metrics import MetricsConfig
from elastic.config.model_data import (
    DIGITS_PER_CLASS,
    BNStats,
    DataConfig,
    DataSource,
    Decode,
    ModelConfig,
    SyntheticDataConfig,
)
from elastic.config.notify import NotifyConfig
from elastic.config.optim import (
    AdamWConfig,
    AkibaConfig,
    LarsConfig,
    OptimConfig,
    OptimizerName,
    Policy,
    Schedule,
    WarmupStart,
)
from elastic.config.resilience import (
    ChaosConfig,
    CheckpointConfig,
    CheckpointInterval,
    HealthConfig,
    StragglerPolicy,
)
from elastic.config.schema import (
    ANY_MINIMUM,
    SECONDS,
    Bound,
    Choice,
    ConfigError,
    bound_problems,
    bounded,
    checked_when,
    problem,
)
from elastic.config.trainer import (
    CommBackend,
    CommConfig,
    GradDtype,
    ParallelConfig,
    Precision,
    Shard,
    TrainerConfig,
)
from elastic.config.training_rules import (
    NO_SCIKIT_LEARN,
    REDUCIBLE,
    decay_warmup_problem,
    digits_problems,
    grad_dtype_problem,
    torchvision_models,
)
from elastic.config.validation import RULES, Rule, validate

__all__ = [
    "ANY_MINIMUM",
    "DIGITS_PER_CLASS",
    "JOB_ID",
    "NO_SCIKIT_LEARN",
    "REDUCIBLE",
    "RULES",
    "SECONDS",
    "AdamWConfig",
    "AkibaConfig",
    "BNStats",
    "Bound",
    "ChaosConfig",
    "CheckpointConfig",
    "CheckpointInterval",
    "Choice",
    "ClusterConfig",
    "ClusterMode",
    "CommBackend",
    "CommConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "Decode",
    "Device",
    "EtcdTlsConfig",
    "GradDtype",
    "HealthConfig",
    "LarsConfig",
    "ModelConfig",
    "MetricsConfig",
    "NotifyConfig",
    "OptimConfig",
    "OptimizerName",
    "ParallelConfig",
    "Policy",
    "Precision",
    "RendezvousConfig",
    "Rule",
    "Schedule",
    "Shard",
    "SyntheticDataConfig",
    "TrainerConfig",
    "WarmupStart",
    "bound_problems",
    "bounded",
    "checked_when",
    "digits_problems",
    "grad_dtype_problem",
    "load",
    "max_nodes",
    "decay_warmup_problem",
    "problem",
    "save",
    "torchvision_models",
    "validate",
    "StragglerPolicy",
]
