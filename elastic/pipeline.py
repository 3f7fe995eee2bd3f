"""The input pipeline from JPEG files to the device, built so that the GPU never waits for data.

Enough loader processes decode and augment ahead of the training loop (:func:`loader_workers`,
:func:`make_loader`), the batches arrive in pinned memory, and batch k+1 is copied on a side
stream while batch k trains (:class:`Prefetcher`). Where the host's cores cannot decode as fast
as the GPU trains (ResNet-50 in bf16 wants thousands of images a second), ``data.decode=device``
decodes on the GPU (:class:`DeviceDecoder`). None of this changes what is trained: the
DataLoader is driven by the sampler's batch keys and each sample's augmentation is seeded
(:class:`elastic.data.SeededImageFolder`), so the batches and their pixels are the same however
many loader processes work and however far ahead; the exactly-once invariant rests on that.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import resized_crop

from elastic.data import IMAGENET_MEAN, IMAGENET_STD, Encoded

AUTO = -1  # data.loader_workers: size the loader from this node's cores

# Batches each loader process keeps decoded ahead of the training loop (PyTorch's default, made
# explicit). ``workers * PREFETCH_FACTOR`` batches are in flight, which with auto-sized workers
# already absorbs the jitter of JPEG decoding; each one is a shared-memory tensor (19 MB at
# 32 x 3 x 224 x 224 fp32), so a deeper queue costs /dev/shm (health.min_shm_mb) on every worker.
PREFETCH_FACTOR = 2

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]


def loader_workers(requested: int, workers_on_node: int, cores: int) -> int:
    """The number of loader processes for one training worker.

    It is ``requested``, or with ``-1`` (auto) this worker's share of the node's ``cores`` minus
    one.

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
    collate_fn: Callable[[list[T]], Any] | None = None,
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

    ``collate_fn``: how samples make a batch (:meth:`DeviceDecoder.collate` for encoded ones);
    None stacks them (PyTorch's default).
    """
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
        worker_init_fn=ignore_sigterm if workers > 0 else None,
    )


def ignore_sigterm(_worker_id: int) -> None:
    """Make a loader process ignore SIGTERM (the loader's ``worker_init_fn``).

    Loader processes outlive a SIGTERM sent to the whole node, like the training worker that owns
    them (it finishes its steps in a planned leave); they end with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class EncodedBatch(NamedTuple):
    """A batch of :class:`Encoded` samples: the JPEGs in one tensor, their draws as tensors.

    The JPEGs lie end to end in one tensor because a loader process hands a batch over as one
    shared-memory block, and the pinned copy is one."""

    jpegs: torch.Tensor  # uint8: the files one after the other
    lengths: list[int]  # of each file in ``jpegs``
    boxes: torch.Tensor  # (batch, 4) int64: top, left, height, width
    flips: torch.Tensor  # (batch,) bool
    targets: torch.Tensor


class Normalize:
    """8-bit pixel values (0 to 255) to what the host transform gives: scaled, normalised floats.

    On ``device``, as :class:`DeviceDecoder` and :func:`image_mover` run it there."""

    def __init__(self, device: torch.device) -> None:
        std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
        self.scale = 1 / (255 * std)
        self.shift = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) / std

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels * self.scale - self.shift


class DeviceDecoder:
    """Decodes an :class:`EncodedBatch` on ``device`` into the pixels the host transform gives.

    The host transform is :func:`imagenet_transform <elastic.data.imagenet_transform>`. Each image
    is decoded as RGB (nvJPEG on CUDA, libjpeg on the CPU). Its box is resized to ``crop_size``
    square (bilinear, antialiased), flipped where drawn, scaled to [0, 1] and normalised with
    ImageNet's mean and std.

    The loader processes only read the files and draw each sample's crop and flip, the host
    transform's draws from the same seeds (:class:`~elastic.data.Encoded`), so the samples are the
    same crops of the same images; the pixels differ only by the decoder's and the resize's
    rounding."""

    def __init__(self, crop_size: int, device: torch.device) -> None:
        self.size = [crop_size, crop_size]
        self.device = device
        self.normalize = Normalize(device)

    @staticmethod
    def collate(samples: Sequence[Encoded]) -> EncodedBatch:
        return EncodedBatch(
            torch.cat([s.jpeg for s in samples]),
            [len(s.jpeg) for s in samples],
            torch.tensor([s.box for s in samples], dtype=torch.int64),
            torch.tensor([s.flip for s in samples], dtype=torch.bool),
            torch.tensor([s.target for s in samples], dtype=torch.int64),
        )

    def __call__(self, batch: EncodedBatch) -> Batch:
        jpegs = list(batch.jpegs.split(batch.lengths))
        images = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device)
        crops = torch.stack(
            [
                resized_crop(image.float(), *box, self.size, antialias=True)
                for image, box in zip(images, batch.boxes.tolist(), strict=True)
            ]
        )
        flips = batch.flips.to(self.device, non_blocking=True).view(-1, 1, 1, 1)
        crops = torch.where(flips, crops.flip(-1), crops)
        return self.normalize(crops), batch.targets.to(self.device, non_blocking=True)


class Prefetcher:
    """A loader's batches on ``device``, the next one moved while this one trains.

    ``move`` puts a loader batch on the device as a tuple of tensors (a job's
    :meth:`~elastic.job.Job.to_device`; :func:`image_mover` for images); by default each tensor
    is copied. On CUDA, batch k+1 is moved on a side stream (``non_blocking`` from the loader's
    pinned memory) as soon as batch k is handed out, so the copy overlaps batch k's forward and
    backward. Before batch k+1 is handed out, the current stream waits for its copy (an event on
    the GPU, not a host sync), and ``record_stream`` tells the caching allocator that the current
    stream uses its memory, so that the memory is not reused before that work is done even though
    it was allocated on the side stream. On the CPU it moves synchronously.

    The order and contents are the loader's. It holds two batches at most: the one handed out, and
    the one being copied (so the source is read at most one batch ahead of the consumer).
    """

    def __init__(
        self,
        batches: Iterable[Any],
        device: torch.device,
        move: Callable[[Any], tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        self.batches = batches
        self.device = device
        self.move = move or (lambda batch: tuple(t.to(device, non_blocking=True) for t in batch))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        source = iter(self.batches)
        ahead = self._start_copy(next(source, None))
        while ahead is not None:
            batch = self._handed_out(ahead)
            ahead = self._start_copy(next(source, None))
            yield batch

    def _start_copy(self, batch: Any) -> tuple[torch.Tensor, ...] | None:
        if batch is None:
            return None
        with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
            return self.move(batch)

    def _handed_out(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``batch``, safe to use on the current stream."""
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            for tensor in batch:
                tensor.record_stream(current)
        return batch


def image_mover(
    device: torch.device, channels_last: bool = False, decoder: DeviceDecoder | None = None
) -> Callable[[Any], Batch]:
    """How a :class:`Prefetcher` moves a batch of ``(images, targets)`` to ``device``.

    The batch is copied, or decoded on the device by ``decoder`` (``data.decode=device``). 8-bit
    pixels (``data.decode=once``) are copied as they are, a quarter of the bytes of floats, and
    normalised there. The images are converted to channels_last on the way when asked."""
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    normalize = Normalize(device)

    def move(batch: Any) -> Batch:
        images, targets = decoder(batch) if decoder else batch
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        if images.dtype == torch.uint8:
            images = normalize(images)
            if channels_last:  # the product keeps it; made sure of, since the model wants it
                images = images.contiguous(memory_format=torch.channels_last)
        return images, targets.to(device, non_blocking=True)

    return move
