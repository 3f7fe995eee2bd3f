"""HSDP for ``parallel.shard=node``: shard within a node, replicate across nodes, recover in place.

A node's k workers shard the model, its gradients and its optimizer state with FSDP2
(``fully_shard``) over the ``shard`` dim of a 2-D ``(replicate, shard)`` DeviceMesh; the nodes
are replicas of each other over the ``replicate`` dim. The unit of failure is a node, so a lost
node takes whole replicas with it and each survivor still holds a complete shard k. Recovery
therefore keeps the survivors' local tensors and only rebuilds the mesh (:func:`take_shards`,
then :func:`remesh` once the round's new default group exists); a joining node's worker k
copies shard k from worker k of a survivor (:func:`elastic.state.sync_state` over the replicate
groups, once :func:`check_layouts` found them alike). Checkpoints are the runtime's
own (:mod:`elastic.checkpoint`): :class:`elastic.state.TrainState` names the DTensors, DCP saves
each shard once and reshards on load, so they load at another nodes x workers shape.

Everything goes through torch's public APIs: ``init_device_mesh``, ``fully_shard``, DTensor, and
DCP's ``state_dict`` helpers (which, unlike a module's own ``state_dict``, key the optimizer's
state by parameter name and can create it in a fresh optimizer). FSDP2 cannot move a sharded
module to another mesh, so :func:`remesh` builds the model again on the new mesh (on the meta
device: no full copy of the weights is ever made) and loads the kept local tensors into it.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
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
from torch.nn.utils import clip_grads_with_norm_

from elastic.abortable_group import build_abortable_mesh
from elastic.nonfinite import gradients_finite
from elastic.optim import gradient_clip
from elastic.state import local

MESH_DIMS = ("replicate", "shard")  # dim 0: one entry per node; dim 1: a node's workers


def build_mesh(nodes: int, per_node: int, device_type: str, backend: str) -> DeviceMesh:
    """The ``(replicate, shard)`` mesh over the current default group; a collective.

    Rank r is worker ``r % per_node`` of node ``r // per_node``, so the ``shard`` groups are the
    nodes and the ``replicate`` group of shard k holds worker k of every node, in node order.
    ``init_device_mesh`` creates the subgroups from the default group in the same order on every
    rank, and anew on each call: after a round replaces the default group, call it again.
    On gloo (the CPU's, or CUDA tensors' as a test aid) every dim is a group a round's abort ends
    at once (FSDP2 waits on them); ``backend``: the default group's.
    """
    world = dist.get_world_size()
    if nodes < 1 or per_node < 1 or nodes * per_node != world:
        raise ValueError(
            f"parallel.shard=node needs world size = nodes x workers per node, but the world "
            f"has {world} ranks for {nodes} node(s) x {per_node}: start the same number of "
            f"workers on every node"
        )
    if backend == "gloo":
        return build_abortable_mesh((nodes, per_node), MESH_DIMS, device_type)
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


def sum_gradients(model: nn.Module) -> None:
    """Make every FSDP2 unit of ``model`` sum the gradients over the ranks instead of averaging.

    The trainer weighs each sample by its share of the global batch, so the sum is the mean
    (as its DDP hook sums)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def gradient_norm(params: list[nn.Parameter], mesh: DeviceMesh) -> torch.Tensor:
    """The 2-norm of all of ``params``' gradients, equal on every rank; a collective of a node.

    Every gradient is sharded over the ``shard`` dim and replicated over ``replicate``, so the
    squares of a rank's shards, summed over its node, are the whole. It judges a step's
    gradients finite and clips them (``optim.clip_grad_norm``): one rank's shards alone could
    be finite where another's are not."""
    shards = [local(p.grad) for p in params if p.grad is not None]
    mine = torch.nn.utils.get_total_norm(shards) if shards else torch.zeros(())
    squares = mine.to(_device(mesh), torch.float64).square()
    dist.all_reduce(squares, group=mesh.get_group("shard"))
    return squares.sqrt().float()


def judge_gradients(
    params: list[nn.Parameter], mesh: DeviceMesh | None, max_norm: float, scaled: bool
) -> tuple[bool, Callable[[], torch.Tensor] | None]:
    """Whether a step's gradients are finite, and what clips them to ``max_norm`` (0: nothing).

    Under fp16 (``scaled``) the loss scaler judges them and skips the step itself. Whole
    gradients (``mesh`` None) are judged by :func:`elastic.nonfinite.gradients_finite`; sharded
    ones by their :func:`gradient_norm`, which the clip then reuses."""
    if mesh is None:
        return scaled or gradients_finite(params), gradient_clip(params, max_norm)
    norm = gradient_norm(params, mesh)
    clip = partial(clip_grads_with_norm_, params, max_norm, norm) if max_norm else None
    return bool(torch.isfinite(norm)), clip


def reshard(model: nn.Module) -> None:
    """Free the gathered weights a forward without backward leaves (an evaluation); local.

    FSDP2 keeps the root unit's weights whole after its forward, for the backward that follows
    in training. Left so, the state would be read whole (digests, checkpoints) and torch refuses
    to free them once another reader has pinned their storage. A whole model is left alone."""
    if isinstance(model, FSDPModule):
        model.reshard()


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them, for every micro-batch but a step's last.

    DDP's own ``no_sync``, or FSDP2's gradient sync turned off meanwhile."""
    if not isinstance(model, FSDPModule):
        with model.no_sync():  # type: ignore[operator]
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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


def check_layouts(
    tensors: dict[str, torch.Tensor], group: dist.ProcessGroup, device: torch.device
) -> None:
    """Raise on every replica alike unless all hold tensors of the same shapes and dtypes.

    ``tensors`` are a worker's state, ``group`` its shard's replicate group: the group a joining
    node's worker receives its shards over. A replica built with another model or optimizer
    would otherwise receive tensors of other sizes, or wait in a broadcast its peers never
    make. One small all-gather."""
    shown = [local(tensors[name]) for name in sorted(tensors)]
    layout = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in shown)
    mine = torch.tensor([zlib.crc32(layout.encode())], dtype=torch.int64, device=device)
    seen = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(seen, mine, group=group)
    if len({int(t.item()) for t in seen}) > 1:
        raise ValueError(
            f"the replicas' states differ in layout ({len(shown)} tensors here): every node "
            f"must build the same model and optimizer (the same job.* and optim.*)"
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
