"""The input pipeline from JPEG files to the device: how many loader processes, the DataLoader of a
round, and the copy of the next batch to the GPU while the current one trains.

A GPU that waits for data wastes what the rest of the runtime saves. Three things keep it busy:

- enough loader processes to decode and augment a batch in less time than a step takes
  (:func:`loader_workers`), each working ahead of the training loop (:func:`make_loader`);
- pinned host memory, so that a host-to-device copy is a DMA the CPU does not wait for;
- the copy of batch k+1 issued on a side stream while the GPU computes batch k
  (:class:`Prefetcher`), so that the step never starts with a copy.

None of this changes what is trained. The DataLoader is driven by the sampler's batch keys
(:meth:`elastic.sampler.ElasticSampler.batches`), and the augmentation is seeded per sample by
``(seed, epoch, index)`` (:class:`elastic.data.SeededImageFolder`), so the batches, their order and
their pixels are the same whatever the number of loader processes and however far ahead they work;
the exactly-once invariant rests on that.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

AUTO = -1  # data.loader_workers: size the loader from this node's cores

# Batches each loader process keeps decoded ahead of the training loop (PyTorch's default, made
# explicit). ``workers * PREFETCH_FACTOR`` batches are in flight, which with auto-sized workers
# already absorbs the jitter of JPEG decoding; each one is a shared-memory tensor (19 MB at
# 32 x 3 x 224 x 224 fp32), so a deeper queue costs /dev/shm (health.min_shm_mb) on every worker.
PREFETCH_FACTOR = 2

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]


def loader_workers(requested: int, workers_on_node: int, cores: int) -> int:
    """Loader processes for one training worker: ``requested``, or with ``-1`` (auto) this
    worker's share of the node's ``cores`` minus one.

    The core left over is for the training process itself: it runs the Python loop that launches
    the kernels, DDP's hooks and the optimizer, and the pin-memory thread. It is the one process
    that must never wait for a core: if loader processes took all of them, the GPU would idle
    between kernel launches however fast the data came. With one core per worker (a CPU node, or
    simulated nodes sharing a small machine) that leaves no loader process: the training process
    decodes itself, as a separate process would only compete with it for the same core.

    ``workers_on_node``: the training workers sharing these cores (at least one); ``cores``: the
    cores they share.
    """
    if requested != AUTO:
        return requested
    return max(0, cores // workers_on_node - 1)


def make_loader(
    dataset: Dataset[T],
    batch_sampler: Iterable[Sequence[Any]],
    workers: int,
    device: torch.device,
) -> DataLoader[T]:
    """The DataLoader of one round, over the sampler's batch keys for this rank.

    ``batch_sampler`` is :meth:`ElasticSampler.batches` as before, so the sample order and the
    per-sample seeded augmentation are exactly those of a loader without workers.

    ``pin_memory`` on CUDA: batches arrive in page-locked memory, which the :class:`Prefetcher`
    copies to the GPU asynchronously. With ``workers`` > 0, each worker keeps
    :data:`PREFETCH_FACTOR` batches ready, and ``persistent_workers`` keeps the processes for the
    loader's lifetime instead of for one pass. What that buys here is small, and it is worth
    knowing why: the trainer builds one loader per round and iterates it once (the batch sampler
    runs across epoch boundaries, so there is no per-epoch restart to save, which is what
    persistence is for in an epoch loop). The worker processes are started again with every
    round's loader: after a recovery the first step also waits for the new workers to fork and
    decode their first batches, and the old loader's workers are shut down when the old round's
    frame is released. Persistence only matters for a loader iterated more than once; keeping
    workers across rounds would take one loader for the worker's life, fed by a batch sampler
    re-pointed at each round.
    """
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
        worker_init_fn=ignore_sigterm if workers > 0 else None,
    )


def ignore_sigterm(_worker_id: int) -> None:
    """Loader processes outlive a SIGTERM sent to the whole node, like the training worker that
    owns them (it finishes its steps in a planned leave); they end with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Prefetcher:
    """Batches of ``(images, targets)`` on ``device``, the next one copied while this one trains.

    On CUDA, batch k+1 is copied on a side stream (``non_blocking`` from the loader's pinned
    memory) as soon as batch k is handed out, so the copy overlaps batch k's forward and backward.
    Before batch k+1 is handed out, the current stream waits for its copy (an event on the GPU, not
    a host sync), and ``record_stream`` tells the caching allocator that the current stream uses
    its memory, so that the memory is not reused before that work is done even though it was
    allocated on the side stream. Images are converted to channels_last on the way when asked (on
    the side stream too). On the CPU it moves and converts synchronously.

    The order and contents are the loader's. It holds two batches at most: the one handed out, and
    the one being copied (so the source is read at most one batch ahead of the consumer).
    """

    def __init__(
        self, batches: Iterable[Batch], device: torch.device, channels_last: bool = False
    ) -> None:
        self.batches = batches
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.preserve_format
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __iter__(self) -> Iterator[Batch]:
        source = iter(self.batches)
        ahead = self._start_copy(next(source, None))
        while ahead is not None:
            batch = self._handed_out(ahead)
            ahead = self._start_copy(next(source, None))
            yield batch

    def _start_copy(self, batch: Batch | None) -> Batch | None:
        if batch is None:
            return None
        (images, targets), layout = batch, self.memory_format
        if self._stream is None:
            return images.to(self.device, memory_format=layout), targets.to(self.device)
        with torch.cuda.stream(self._stream):
            return (
                images.to(self.device, non_blocking=True, memory_format=layout),
                targets.to(self.device, non_blocking=True),
            )

    def _handed_out(self, batch: Batch) -> Batch:
        """``batch``, safe to use on the current stream."""
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            for tensor in batch:
                tensor.record_stream(current)
        return batch
