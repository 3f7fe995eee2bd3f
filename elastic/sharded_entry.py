"""A round's entry under ``parallel.shard=node``: its mesh, and the worker's state put on it.

Once the round's group is built, every worker builds the ``(replicate, shard)`` mesh over it
(:func:`elastic.sharding.build_mesh`); the communicator adopts its groups, so that an abort of
the round ends FSDP2's collectives too and a failed one is the round's. A worker that held
shards in the previous round keeps them and moves them to the new mesh (a survivor:
:func:`~elastic.sharding.take_shards`, :func:`~elastic.sharding.remesh`); a fresh process shards
the model the job built, the same on every rank. The state sync that follows
(:func:`elastic.state.sync_state` over the replicate groups) gives a joining node a survivor's
shards, worker k from worker k.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from elastic.config import ConfigError, problem
from elastic.config.training_rules import SHARDED_ON_NCCL_FIX
from elastic.control import Assignment
from elastic.round_end import RoundAborted
from elastic.sharding import (
    build_mesh,
    check_layouts,
    remesh,
    reshard,
    shard,
    sum_gradients,
    take_shards,
)
from elastic.state import TrainState
from elastic.worker import Worker


def enter_mesh(w: Worker, a: Assignment) -> dist.ProcessGroup:
    """Put the worker's state on round ``a``'s mesh; returns its replicate group (a collective).

    Raises :class:`RoundAborted` when a newer round was announced meanwhile."""
    if w.comm.backend != "gloo":  # cluster.device=auto found a GPU (cuda on NCCL is refused early)
        raise ConfigError(
            problem(
                "parallel.shard",
                "node",
                f"this worker computes on {w.device} over {w.comm.backend}, and the sharded path "
                "recovers in place through gloo groups it can abort; it has not yet run on NCCL",
                SHARDED_ON_NCCL_FIX,
            )
        )
    per_node = w.env.local_world_size
    with w.comm.collective("mesh set-up"):
        mesh = build_mesh(a.world_size // per_node, per_node, w.device.type, w.comm.backend)
    w.comm.mesh.adopt(mesh)
    if w.comm.aborted:  # an abort before the adoption did not reach the mesh's groups
        raise RoundAborted("a new round was announced")
    units = w.job.shard_units()
    if w.mesh is None:  # a fresh process: the model as the job built it, on every rank alike
        model = shard(w.state.model, mesh, units)
        optimizer = w.job.build_optimizer(model)
    else:
        reshard(w.state.model)  # a round left mid-forward may hold a unit's weights gathered
        shards = take_shards(w.state.model, w.state.optimizer, w.mesh)
        model, optimizer = remesh(
            shards, mesh, lambda: model_on_meta(w), w.job.build_optimizer, units
        )
    sum_gradients(model)
    w.hold(TrainState(model, optimizer))
    w.mesh = mesh
    replicas = mesh.get_group("replicate")
    with w.comm.collective("layout check"):
        check_layouts(w.tensors, replicas, w.device)
    return replicas


def model_on_meta(w: Worker) -> nn.Module:
    """The job's model built on the meta device: its shapes, no memory.

    The job builds it as ever (:meth:`elastic.job.Job.build_model` puts it on its
    :attr:`~elastic.job.Job.device`), with its device set to meta."""
    job = copy.copy(w.job)
    job.device = torch.device("meta")
    return job.build_model()
