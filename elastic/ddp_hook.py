"""DDP over the round's group, with a comm hook of our own: how gradients travel, and in what.

Why a comm hook: DDP waits for its gradient all-reduce inside ``backward()``, and a collective
blocked on a frozen peer would hold the worker until the group's timeout. The hook hands DDP a
future of the communicator's that completes with the all-reduce, or fails as soon as
:meth:`elastic.communicator.Communicator.abort` is called (the agent announced a new round), so a
stuck step is abandoned at once. The hook sums: the trainer weights each sample by one over
the global batch, so each rank's gradient is already its share of the mean and the sum is the
mean, with no pass over the gradients to divide them. On the way the hook casts each bucket to a
narrower ``comm.grad_dtype`` (in a tensor it keeps per bucket), counts the buckets a step handed
over (whether a stall is this rank's or its peers', :attr:`DDPHook.waiting_for_peers`), and marks
when the step's compute ended (:class:`elastic.step_timing.StepTiming`).
"""

# No ``from __future__ import annotations`` here: DDP checks the comm hook's annotations at run
# time and wants the real GradBucket and Future types, not strings.
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic.communicator import Communicator
from elastic.round_end import RoundAborted
from elastic.step_timing import StepTiming

# DDP's keyword for buffers that stay per replica (no broadcast before every forward): torch
# 2.11's DDP has no forward_sync_buffers, and its broadcast_buffers=False means the same with
# init_sync=False; later torch deprecates broadcast_buffers for forward_sync_buffers.
BUFFERS_PER_REPLICA = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)

# What DDPHook.wrap gives DDP beside the hook (its docstring says why); bench/throughput.py gives
# the plain DDP peer the same, so that a DDP setting is not counted as the runtime's cost.
DDP_OPTIONS = {"init_sync": False, "gradient_as_bucket_view": True, **BUFFERS_PER_REPLICA}


class DDPHook:
    """Wraps a round's model in DDP whose gradients travel through the abortable all-reduce.

    The all-reduce is the communicator's, in :attr:`grad_dtype`. It counts and times each step's
    buckets."""

    def __init__(self, comm: Communicator, grad_dtype: torch.dtype = torch.float32) -> None:
        self.comm = comm
        self.grad_dtype = grad_dtype  # what gradients travel in (comm.grad_dtype)
        self.timing = StepTiming(comm.device, comm.mesh.blocked_s)
        self.buckets_this_step = 0  # hook calls since begin_step(): how far backward got
        self.buckets_per_step = 0  # hook calls of the last complete step
        self._kept: dict[tuple[Any, ...], torch.Tensor] = {}  # _wire's
        self._kept_at = comm.retired_busy  # the retired groups that may write into _kept
        self._ddp: DistributedDataParallel | None = None  # this round's, until its buckets settle

    def wrap(self, model: torch.nn.Module) -> DistributedDataParallel:
        """DDP over this round's group, with the abortable all-reduce.

        ``init_sync=False``: the replicas were made identical by the state sync just before, and
        DDP's own broadcast from rank 0 would be wrong when rank 0 is a newcomer.
        ``forward_sync_buffers=False``: buffers (batch-norm statistics) stay per replica between
        syncs, which saves a blocking collective in every forward.
        ``gradient_as_bucket_view=True``: the gradients the optimizer reads are the all-reduced
        buckets themselves, which saves copying every bucket back after its all-reduce.
        """
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.comm.device.index] if self.comm.device.type == "cuda" else None,
            **DDP_OPTIONS,
        )
        ddp.register_comm_hook(None, self._allreduce_hook)
        self._ddp = ddp
        self.buckets_per_step = 0  # DDP's buckets are rebuilt after its first step
        if self._kept_at != self.comm.retired_busy:
            # A group retired with all-reduces in flight may still write into the kept
            # tensors: new ones for this round.
            self._kept, self._kept_at = {}, self.comm.retired_busy
        return ddp

    def begin_step(self) -> None:
        """Before a step's forward: count its buckets, and time its compute, from here."""
        self.buckets_this_step = 0
        self.timing.begin()

    def end_step(self) -> None:
        """After the optimizer step. The first one of a round also settles DDP's buckets.

        DDP re-buckets the gradients once, in the forward after its first backward, and agrees
        on the new buckets with a broadcast from rank 0 that no hook sees: a peer lost then
        would surface from ``forward()`` as if the model itself had failed. Running that
        rebuild here, as a recorded collective, leaves the forward with nothing to exchange.
        """
        self.buckets_per_step = self.buckets_this_step
        self.timing.end()  # before the rebuild, a collective: no compute of the step's
        ddp, self._ddp = self._ddp, None
        if ddp is not None and torch.is_grad_enabled():
            with self.comm.collective("DDP bucket rebuild"):
                ddp.reducer._rebuild_buckets()  # a no-op at world size 1

    @property
    def waiting_for_peers(self) -> bool:
        """Whether backward handed all its buckets to the network (so a stall is not ours).

        In a round's first step the bucket count is not known yet, and any bucket handed over
        counts: a rank whose peers are still joining must not be taken for frozen.
        """
        return self.buckets_this_step > 0 and self.buckets_per_step <= self.buckets_this_step

    def _allreduce_hook(
        self, state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """Sum ``bucket`` over the ranks, in :attr:`grad_dtype` on the network.

        Each rank's bucket is its share of the mean (the trainer's sample weights), so the sum is
        the mean. That share lies a world size further from fp16's limit (65504) than the
        gradient, so a gradient or a sum whose mean fits does not turn into inf on the way
        (torch's ``fp16_compress_hook`` divides after its cast, where a large gradient has
        already overflowed). An inf would cost the whole step, which the GradScaler then skips;
        what it costs instead is that shares below fp16's smallest subnormal (6e-8) flush to
        zero, which the GradScaler's loss scale keeps rare. bf16 has fp32's range: for it the
        order changes nothing.

        Unless ``grad_dtype`` is narrower, the bucket is all-reduced itself, as DDP's own hook
        does: the future completes with the bucket. (A tensor of the hook's, kept per bucket,
        held twice the gradients' size for the worker's life, 90 MB for ResNet-18, and cost a
        pass over them every step.) A step that a lost peer broke keeps nothing of it: torch
        keeps its futures, but ours fails without a value, and the all-reduce's own future lets
        go of the bucket once its work has ended (:mod:`elastic.group_reaper` holds works still
        in flight).
        """
        self.buckets_this_step += 1
        self.timing.bucket_handed()
        if self.comm.aborted:
            return _failed(RoundAborted("the round was left"))
        buffer = bucket.buffer()
        wire = buffer if buffer.dtype == self.grad_dtype else self._wire(bucket.index(), buffer)
        if wire is not buffer:
            wire.copy_(buffer)
        work = self.comm.launch(wire, "gradient all-reduce")
        if work is None:
            return _failed(RoundAborted("the round was left"))
        return self.comm.track(work, "gradient all-reduce", buffer, wire)

    def _wire(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s kept tensor in the narrower ``grad_dtype``, that the network carries.

        A round's first step has buckets of other sizes (DDP rebuilds them after it), so two sets
        are kept, allocated once for the worker's life."""
        key = (index, buffer.numel(), buffer.dtype, self.grad_dtype)
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = torch.empty_like(buffer, dtype=self.grad_dtype)
        return kept


def _failed(exc: Exception) -> torch.futures.Future[torch.Tensor]:
    """A future that has already failed with ``exc``."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_exception(exc)
    return fut
