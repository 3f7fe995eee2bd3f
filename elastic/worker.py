"""Everything a worker keeps across rounds (:class:`Worker`).

That is what :func:`elastic.trainer.main` builds once, and the state and progress every round
trains on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from elastic import config
from elastic.agent_link import AgentLink
from elastic.async_checkpoint import BackgroundSaver
from elastic.chaos_hooks import ChaosHooks
from elastic.communicator import Communicator
from elastic.control import WorkerEnv
from elastic.ddp_hook import DDPHook
from elastic.events import EventLog
from elastic.job import Job
from elastic.lr_policy import LRPolicy
from elastic.nonfinite import BufferBackup, NonFiniteSteps
from elastic.precision import MixedPrecision
from elastic.round_end import RoundEnd
from elastic.sampler import ElasticSampler
from elastic.state import Progress, TrainState


@dataclass
class Worker:
    """Everything that outlives a round."""

    cfg: config.Config
    env: WorkerEnv
    events: EventLog
    device: torch.device
    comm: Communicator
    hook: DDPHook  # DDP over comm's group, and each step's buckets and compute time
    link: AgentLink
    job: Job[Any]
    dataset: Dataset[Any]  # the job's training set
    sampler: ElasticSampler
    policy: LRPolicy
    total: int  # samples the whole run trains
    state: TrainState
    precision: MixedPrecision
    loader_workers: int  # per training worker (data.loader_workers resolved)
    saver: BackgroundSaver
    chaos: ChaosHooks  # inert unless chaos.allow
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    progress: Progress | None = None  # None until this process holds a state
    trained_round: int = -1  # the round this state was last trained or synced in
    interrupted_at: float | None = None  # when the previous round broke for this worker
    interrupted_by: RoundEnd | None = None  # and why
    nonfinite: NonFiniteSteps = field(default_factory=lambda: NonFiniteSteps(3))
    buffers: BufferBackup | None = None  # the model's buffers before the step in flight
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the model's, in order
