"""HSDP for ``parallel.shard=node``: shard within a node, replicate across nodes, recover in place.

A node's k workers shard the model, its gradients and its optimizer state with FSDP2
(``fully_shard``) over the ``shard`` dim of a 2-D ``(replicate, shard)`` DeviceMesh; the nodes
are replicas of each other over the ``replicate`` dim. The unit of failure is a node, so a lost
node takes whole replicas with it and each survivor still holds a complete shard k. Recovery
therefore keeps the survivors' local tensors and only rebuilds the mesh (:func:`take_shards`,
then :func:`remesh` once the round's new default group exists); a joining node's worker k
copies shard k from worker k of a survivor (:func:`sync_shards`). Checkpoints are the runtime's
own (:mod:`elastic.checkpoint`): :class:`elastic.state.TrainState` names the DTensors, DCP saves
each shard once and reshards on load, so they load at another nodes x workers shape.

Everything goes through torch's public APIs: ``init_device_mesh``, ``fully_shard``, DTensor, and
DCP's ``state_dict`` helpers (which, unlike a module's own ``state_dict``, key the optimizer's
state by parameter name and can create it in a fresh optimizer). FSDP2 cannot move a sharded
module to another mesh, so :func:`remesh` builds the model again on the new mesh (on the meta
device: no full copy of the weights is ever made) and loads the kept local tensors into it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Placement

from elastic.state import broadcast_tensors, local

MESH_DIMS = ("replicate", "shard")  # dim 0: one entry per node; dim 1: a node's workers


def build_mesh(nodes: int, per_node: int, device_type: str) -> DeviceMesh:
    """The ``(replicate, shard)`` mesh over the current default group; a collective.

    Rank r is worker ``r % per_node`` of node ``r // per_node``, so the ``shard`` groups are the
    nodes and the ``replicate`` group of shard k holds worker k of every node, in node order.
    ``init_device_mesh`` creates the subgroups from the default group in the same order on every
    rank, and anew on each call: after a round replaces the default group, call it again.
    """
    world = dist.get_world_size()
    if nodes < 1 or per_node < 1 or nodes * per_node != world:
        raise ValueError(
            f"parallel.shard=node needs world size = nodes x workers per node, but the world "
            f"has {world} ranks for {nodes} node(s) x {per_node}: start the same number of "
            f"workers on every node"
        )
    return init_device_mesh(device_type, (nodes, per_node), mesh_dim_names=MESH_DIMS)


def shard(model: nn.Module, mesh: DeviceMesh, wrap: tuple[type[nn.Module], ...]) -> FSDPModule:
    """Apply ``fully_shard`` to each submodule of a ``wrap`` type, then to ``model``; returns it.

    Each wrapped submodule gathers its parameters for its own forward and backward only, which
    bounds the unsharded memory to one block. A 2-D mesh makes FSDP2 shard over dim 1 and
    replicate over dim 0 (HSDP); gradients are averaged over all ``nodes x per_node`` ranks.
    Submodules go children first: FSDP2 manages the parameters not yet taken by a descendant.
    """
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(
            f"shard needs a mesh with dims {MESH_DIMS}, got {mesh.mesh_dim_names}: build it "
            f"with build_mesh"
        )
    for module in reversed(list(model.modules())):  # reversed pre-order: descendants first
        if module is not model and isinstance(module, wrap):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@dataclass(frozen=True)
class _Local:
    """One DTensor without its mesh: the local shard and what rebuilds it on another mesh."""

    tensor: torch.Tensor
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Shards:
    """What one worker holds of a sharded model and its optimizer, detached from any mesh.

    ``model`` and ``optimizer`` are the state dicts of ``get_model_state_dict`` and
    ``get_optimizer_state_dict`` with each DTensor replaced by its local shard, so that nothing
    refers to the process groups of the round that ended.
    """

    model: dict[str, Any]
    optimizer: dict[str, Any]
    shard_index: int  # this worker's coordinate on the "shard" dim
    per_node: int


def take_shards(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> Shards:
    """This worker's shards of ``model`` and ``optimizer``, the tensors themselves (no copy).

    It communicates with no one, so it works after a node is lost and the old default group has
    been destroyed.
    """
    return Shards(
        model=_map(get_model_state_dict(model), _detach_mesh),
        optimizer=_map(get_optimizer_state_dict(model, optimizer), _detach_mesh),
        shard_index=_shard_index(mesh),
        per_node=mesh.size(1),
    )


def remesh(
    shards: Shards,
    mesh: DeviceMesh,
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    wrap: tuple[type[nn.Module], ...],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of ``shards`` on ``mesh``, every local tensor kept bit for bit.

    ``make_model`` builds the unsharded model (it runs on the meta device) and
    ``make_optimizer`` the optimizer over a model's parameters, with the same param groups as
    the one taken. ``mesh`` may have any number of replicas, but this worker must keep its
    shard index, and every node its worker count: each local shard then has the same bounds.
    """
    index = _shard_index(mesh)
    if (mesh.size(1), index) != (shards.per_node, shards.shard_index):
        raise ValueError(
            f"remesh keeps shard k on worker k: this worker held shard {shards.shard_index} of "
            f"{shards.per_node}, the new mesh makes it shard {index} of {mesh.size(1)}; keep "
            f"the workers per node and their order, or load a checkpoint (load_checkpoint) to "
            f"change them"
        )
    with torch.device("meta"):
        model = make_model()
    shard(model, mesh, wrap)
    model.to_empty(device=_device(mesh))
    optimizer = make_optimizer(model)
    # The optimizer first: a fresh optimizer's state is made by a step (zero gradients, LR 0),
    # which no optimizer promises leaves the weights alone; the weights are loaded after it.
    set_optimizer_state_dict(model, optimizer, _map(shards.optimizer, lambda v: _on(v, mesh)))
    set_model_state_dict(model, _map(shards.model, lambda v: _on(v, mesh)))
    return model, optimizer


def sync_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, source: int
) -> None:
    """Make every replica's shards those of replica ``source``; a collective of the whole mesh.

    Worker k of each node receives the parameters, buffers and optimizer state of worker k of
    node ``source`` over its ``replicate`` group, which is how a joining node gets a survivor's
    state with no checkpoint. A fresh optimizer gets its state created first. Only tensors
    travel, as in :func:`elastic.state.sync_state` and by its broadcast. The param groups' LR
    and other settings are the trainer's to set each step from its progress record, and are not
    sent.
    """
    replicas = mesh.size(0)
    if not 0 <= source < replicas:
        raise ValueError(f"sync_shards source replica {source} is not in 0..{replicas - 1}")
    group = mesh.get_group("replicate")
    device = _device(mesh)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    with torch.no_grad():  # local: the local tensor itself, received into in place
        tensors = [local(v) for v in _leaves(state) if isinstance(v, torch.Tensor)]
        _check_layouts(tensors, group, replicas, device)
        broadcast_tensors(tensors, source, device, group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _check_layouts(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, replicas: int, device: torch.device
) -> None:
    """Raise on every replica alike unless all hold tensors of the same shapes and dtypes.

    A replica built with another model or optimizer would otherwise receive tensors of other
    sizes, or wait in a broadcast its peers never make."""
    layout = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    mine = torch.tensor([zlib.crc32(layout.encode())], dtype=torch.int64, device=device)
    seen = [torch.empty_like(mine) for _ in range(replicas)]
    dist.all_gather(seen, mine, group=group)
    if len({int(t.item()) for t in seen}) > 1:
        raise ValueError(
            f"sync_shards: the replicas' states differ in layout ({len(tensors)} tensors here): "
            f"every node must build the same model and optimizer (the same job.* and optim.*)"
        )


def _device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``: its current one for an accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def _shard_index(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the ``shard`` dim, known without its (maybe destroyed) group."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank is not in {mesh}: build the mesh with build_mesh")
    return coordinate[1]


def _detach_mesh(value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    return _Local(value.to_local(), tuple(value.placements), value.shape, value.stride())


def _on(value: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(value, _Local):
        return value
    return DTensor.from_local(
        value.tensor,
        mesh,
        value.placements,
        run_check=False,  # the shards are those of the same tensor, sharded alike
        shape=value.shape,
        stride=value.stride,
    )


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``tree`` (dicts and lists, as state dicts are) with ``fn`` applied to every leaf."""
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return fn(tree)


def _leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree``, in an order equal on every rank (sorted keys)."""
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree, key=str) for leaf in _leaves(tree[k])]
    if isinstance(tree, list):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [tree]
