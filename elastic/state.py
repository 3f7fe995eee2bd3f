"""The training state a job must not lose: weights, optimizer buffers and progress counters.

Weights and optimizer buffers travel as a flat dict of tensors (what DCP shards and what recovery
broadcasts). Progress is plain numbers kept in JSON: it goes into the checkpoint's manifest, so
resuming never has to unpickle anything to learn where the run was.

:func:`sync_state` is the in-place recovery's state transfer: at the start of a round the ranks
agree on the newest state any of them holds, and it is broadcast from memory to the others.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic.lr_policy import Ramp
from elastic.optim import create_state
from elastic.sampler import SamplerState, StepPlan

PROGRESS_BYTES = 4096  # room for the progress JSON in the sync broadcast
BUCKET_BYTES = 64 * 1024 * 1024  # DDP's bucket for its own broadcast of the model


@dataclass(frozen=True)
class Progress:
    step: int = 0
    samples_seen: int = 0
    sampler: SamplerState = field(default_factory=SamplerState)
    world_size: int = 0  # the world size of the last step trained
    lr: float = 0.0  # the LR of the last step trained
    global_batch: int = 0  # the latest round's (keep_global_batch keeps the first)
    ramp_start: int = -1  # samples seen when an LR increase began to be ramped in; -1: none
    ramp_from: float = 0.0
    evaluated: int = 0  # the number of the last completed validation (0: none yet)
    # Steps between checkpoints as the ranks last agreed (elastic.checkpoint_interval); 0: not
    # measured yet. Travels with the state, so that every rank of a new round saves alike.
    checkpoint_every: int = 0

    @property
    def ramp(self) -> Ramp | None:
        return Ramp(self.ramp_start, self.ramp_from) if self.ramp_start >= 0 else None

    def with_ramp(self, ramp: Ramp | None) -> Progress:
        if ramp is None:
            return replace(self, ramp_start=-1, ramp_from=0.0)
        return replace(self, ramp_start=ramp.start, ramp_from=ramp.from_lr)

    def after(self, plan: StepPlan, sampler: SamplerState, world_size: int, lr: float) -> Progress:
        return replace(
            self,
            step=self.step + 1,
            samples_seen=self.samples_seen + plan.global_count,
            sampler=sampler,
            world_size=world_size,
            lr=lr,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(**{**data, "sampler": SamplerState(**data["sampler"])})


class TrainState:
    """A model and its optimizer, seen as named tensors.

    Only tensors go into checkpoints: ``torch.optim``'s own state dict carries Python objects that
    DCP would pickle. Every tensor of the optimizer's per-parameter state is one entry,
    ``optim.<param name>.<state key>`` (SGD's ``optim.<name>.momentum_buffer``, Akiba's
    ``square_avg`` besides). The state must exist before the first step, so that a fresh
    optimizer can receive a loaded or broadcast one in place: the optimizers of
    :mod:`elastic.optim` create theirs when built, and a torch SGD built elsewhere gets its
    momentum buffers here (:func:`elastic.optim.create_state`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._names = {p: name for name, p in model.named_parameters()}
        create_state(optimizer)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim.{self._names[p]}.{key}"] = value
        return out

    def apply(self, settings: dict[str, float]) -> None:
        """Set every key of ``settings`` in every param group.

        They are the LR and the other per-step settings (:func:`elastic.optim.step_settings`)."""
        for group in self.optimizer.param_groups:
            group.update(settings)

    def replicated(self) -> dict[str, torch.Tensor]:
        """The parameters and the optimizer state: what is equal on every replica, bit for bit.

        Batch-norm statistics are left out on purpose: DDP runs with ``broadcast_buffers=False``,
        so they are per replica between syncs.
        """
        return {
            name: t
            for name, t in self.tensors().items()
            if name.startswith("optim.") or name[len("model.") :] in self._param_names
        }

    def digest(self) -> str:
        """sha256 of :meth:`replicated`: the ``state_digest`` events' replica check.

        Of a sharded state, this rank's shards: equal on every replica of the same shard."""
        h = hashlib.sha256()
        for t in self.replicated().values():
            # reshape: a contiguous 1x1 convolution in channels_last keeps a last stride of C,
            # and a dtype view of another element size needs 1 (it failed on the first GPU)
            own = local(t).detach().cpu().contiguous().reshape(-1)
            h.update(own.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def fingerprint(self) -> str:
        """A CRC-32 of every parameter's bytes (hex); of a sharded model, this rank's shards.

        It is cheap enough to log before every step (``trainer.record_samples``; about 10 ms for
        ResNet-18 on a CPU core). It is equal on every replica of one history, so two worlds that
        train the same step from different states show up in the event log. Bytes, not a sum: a
        float sum depends on the reduction's order, which changes with the thread count, so
        equal replicas could differ."""
        crc = 0
        for p in self.model.parameters():
            crc = zlib.crc32(local(p).detach().reshape(-1).cpu().view(torch.uint8).numpy(), crc)
        return f"{crc:08x}"

    def flip_bit(self, bit: int) -> str:
        """Flip ``bit`` of the largest parameter's first element, as a memory fault would.

        This is chaos's corrupt_replica; it returns the parameter's name. The element is the
        first in the layout the parameter has: channels_last too."""
        name, param = max(self.model.named_parameters(), key=lambda np: np[1].numel())
        with torch.no_grad():
            words = local(param.data).view(torch.int32)  # fp32 parameters: same element size
            words[(0,) * words.dim()] ^= 1 << bit
        return name

    @property
    def _param_names(self) -> set[str]:
        return set(self._names.values())


def local(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds of ``t``: a DTensor's local shard (``parallel.shard=node``).

    Reading a DTensor as a whole would gather it from the other ranks, a collective."""
    return t.to_local() if isinstance(t, DTensor) else t


def sync_key(progress: Progress | None, trained_round: int) -> list[int]:
    """How a rank's state ranks in :func:`sync_state`.

    The key is the round it last trained in, its step, the evaluations it completed, and a
    fingerprint of its whole progress record.

    A replica that trained in a later round is on the job's current line of history, whatever
    its step count. At the same step, one that completed an evaluation the round's break cut
    short on a peer is newer: the evaluation averaged its batch-norm statistics, and a rank that
    kept its own record would evaluate again while its peers trained on, so that their
    collectives crossed (gloo aborts the process on the mismatch). The fingerprint makes
    "every rank holds the same state" mean the whole record (a cut save can leave
    ``checkpoint_every`` apart too), and breaks any remaining tie alike on every rank."""
    if progress is None:
        return [-1, -1, -1, -1]
    record = json.dumps(progress.to_dict(), sort_keys=True).encode()
    return [trained_round, progress.step, progress.evaluated, zlib.crc32(record)]


def sync_state(
    tensors: dict[str, torch.Tensor],
    progress: Progress | None,
    trained_round: int,
    device: torch.device,
    replicas: dist.ProcessGroup | None = None,
) -> tuple[Progress | None, int]:
    """Make every rank hold the newest state any rank of this round holds; a collective.

    States are ordered by :func:`sync_key`, and the source picked by :func:`pick_source`.
    Returns the progress and the rank it came from, or ``(None, -1)`` when no rank holds a state
    (a fresh job or a whole restart: the caller then loads the newest checkpoint). When every
    rank already holds the same state, nothing is sent: that is the common case of survivors
    after a shrink.

    ``replicas``: under ``parallel.shard=node``, this rank's group of the same shard on every
    node (:mod:`elastic.sharding`). A state is then a node's: its shards travel from the source
    node, each over its own group, and only a node whose every worker holds the state can be it.
    """
    key = torch.tensor(sync_key(progress, trained_round), dtype=torch.int64, device=device)
    keys = [torch.empty_like(key) for _ in range(dist.get_world_size())]
    dist.all_gather(keys, key)
    ranked = [tuple(k.tolist()) for k in keys]
    per_node = 1 if replicas is None else len(ranked) // replicas.size()
    source = pick_source(ranked, per_node)
    if source < 0:
        return None, -1
    if all(k == ranked[source] for k in ranked):
        return progress, source
    payload = torch.zeros(PROGRESS_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank() == source:
        assert progress is not None
        raw = json.dumps(progress.to_dict()).encode()
        payload[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(payload, src=source)
    ordered = [local(tensors[name]) for name in sorted(tensors)]
    if replicas is None:
        broadcast_tensors(ordered, source, device)
    else:  # the source node's worker k to worker k of every node
        broadcast_tensors(ordered, source // per_node, device, replicas)
    raw = bytes(payload.cpu().numpy()).rstrip(b"\0")
    return Progress.from_dict(json.loads(raw)), source


def pick_source(keys: list[tuple[int, ...]], per_node: int = 1) -> int:
    """The rank whose state every rank takes (:func:`sync_key` ranks them), or -1 if none has one.

    ``keys`` are every rank's, a node's ``per_node`` workers next to each other. A state is whole
    only on a node whose every worker holds it (each holds a shard under ``parallel.shard=node``;
    with one worker a node, any rank): the newest whole one wins, at its node's first rank."""
    best: tuple[int, ...] | None = None
    source = -1
    for first in range(0, len(keys), per_node):
        node = keys[first : first + per_node]
        if node[0][0] >= 0 and all(k == node[0] for k in node) and (best is None or node[0] > best):
            best, source = node[0], first
    return source


def broadcast_tensors(
    tensors: list[torch.Tensor],
    source: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Give every rank rank ``source``'s ``tensors``, copied into its own in place; a collective.

    They go in DDP's own bucketed broadcast, over ``group`` (the round's default group when
    None; ``source`` is a rank of ``group``). A tensor held off ``device`` (AdamW's step count
    stays on the CPU of a GPU worker) travels through a copy on it, since NCCL sends device
    memory only."""
    away = [t for t in tensors if t.device != device]
    wires = [t.to(device) for t in away]
    here = [t for t in tensors if t.device == device]
    group = group or dist.distributed_c10d._get_default_group()
    dist._broadcast_coalesced(group, here + wires, BUCKET_BYTES, source)
    for tensor, wire in zip(away, wires, strict=True):
        tensor.copy_(wire)
