"""Everything a worker keeps across rounds (:class:`Worker`).

That is what :func:`elastic.trainer.main` builds once, and the state and progress every round
trains on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
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
    entered_at: int | None = None  # the step this worker entered its round at (None: entering)
    interrupted_at: float | None = None  # when the previous round broke for this worker
    interrupted_by: RoundEnd | None = None  # and why
    nonfinite: NonFiniteSteps = field(default_factory=lambda: NonFiniteSteps(3))
    buffers: BufferBackup | None = None  # the model's buffers before the step in flight
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the model's, in order
    mesh: DeviceMesh | None = None  # parallel.shard=node: the mesh the state is sharded on

    @property
    def shard_index(self) -> int:
        """Which shard of the state this worker holds: its local rank when sharded, else 0.

        The state's digest is equal on the workers of the same shard index (the replicas)."""
        return self.env.local_rank if self.mesh is not None else 0

    def trained_in_round(self) -> int:
        """The steps this worker has trained in its round so far (0 while entering it)."""
        if self.entered_at is None or self.progress is None:
            return 0
        return max(0, self.progress.step - self.entered_at)  # a rollback goes below

    def hold(self, state: TrainState) -> None:
        """Train ``state`` from now on: the tensors synced and saved, the buffers kept, the params.

        Called once the worker is built, and when ``parallel.shard=node`` puts the state on a
        round's mesh (:mod:`elastic.sharded_entry`)."""
        self.state = state
        job = {f"job.{name}": t for name, t in self.job.state().items()}
        self.tensors = state.tensors() | self.precision.tensors() | job
        self.buffers = BufferBackup(state.model)
        self.params = list(state.model.parameters())
