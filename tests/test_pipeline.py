"""The input pipeline: loader sizing, and that neither loader processes nor the prefetcher change
which batches are trained, in which order, with which pixels (the exactly-once invariant and the
seeded augmentation rest on it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

from elastic.config import DataConfig, Decode, SyntheticDataConfig
from elastic.data import IMAGENET_STD, DecodedOnce, SeededImageFolder, train_root
from elastic.pipeline import (
    PREFETCH_FACTOR,
    Batch,
    DeviceDecoder,
    Normalize,
    Prefetcher,
    image_mover,
    loader_workers,
    make_loader,
)
from elastic.sampler import ElasticSampler, SamplerState
from elastic.synthetic import ensure_synthetic

CPU = torch.device("cpu")
STEPS = 7  # 4 images a step over 12 images: crosses two epoch boundaries


# One level of an 8-bit pixel after normalisation, at the smallest of ImageNet's stds.
LEVEL = 1 / 255 / min(IMAGENET_STD)


@pytest.fixture(scope="module")
def data_cfg(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    root = Path(tmp_path_factory.mktemp("pipeline")) / "data"
    cfg = DataConfig(
        root=str(root),
        generate=SyntheticDataConfig(classes=2, images_per_class=6, image_size=20),
        crop_size=16,
    )
    ensure_synthetic(cfg)
    return cfg


@pytest.fixture(scope="module")
def dataset(data_cfg: DataConfig) -> SeededImageFolder:
    return SeededImageFolder(data_cfg, seed=3)


@pytest.fixture(scope="module")
def encoded(data_cfg: DataConfig) -> SeededImageFolder:
    """The same samples, left for the device to decode (data.decode=device)."""
    return SeededImageFolder(dataclasses.replace(data_cfg, decode=Decode.device), seed=3)


def decoded_on(device: torch.device, encoded: SeededImageFolder, workers: int) -> list[Batch]:
    loader = make_loader(encoded, keys(encoded), workers, device, DeviceDecoder.collate)
    return list(Prefetcher(loader, device, image_mover(device, decoder=DeviceDecoder(16, device))))


def assert_same_crops(got: list[Batch], want: list[Batch], mean_levels: float = 1) -> None:
    """The same crops of the same images, flipped alike: the pixels differ by the decoders' and
    the resizes' rounding, at most ``mean_levels`` on average over a sample (0.3 measured on the
    CPU), where a sample of another crop, image or flip differs by 17 levels or more."""
    assert len(got) == len(want) == STEPS
    for (images, targets), (want_images, want_targets) in zip(got, want, strict=True):
        assert images.shape == want_images.shape and images.dtype == want_images.dtype
        assert torch.equal(targets.cpu(), want_targets)
        differences = (images.cpu() - want_images).abs()
        assert differences.mean(dim=(1, 2, 3)).max() <= mean_levels * LEVEL
        if images.device == CPU:  # libjpeg both ways: only the resizes round differently
            assert differences.max() <= 2 * LEVEL


def keys(dataset: SeededImageFolder) -> Iterator[list[tuple[int, int]]]:
    """Rank 0's batch keys of a 2-worker job, as the trainer hands them to its loader."""
    sampler = ElasticSampler(len(dataset), batch_size=2, seed=3)
    return sampler.batches(SamplerState(), rank=0, world_size=2, limit=STEPS * 4)


def plain(dataset: SeededImageFolder) -> list[Batch]:
    """What the trainer's loader gave before this module: no workers, no prefetching."""
    return list(DataLoader(dataset, batch_sampler=keys(dataset), num_workers=0))


def assert_same(got: list[Batch], want: list[Batch]) -> None:
    assert len(got) == len(want) == STEPS
    for (images, targets), (want_images, want_targets) in zip(got, want, strict=True):
        assert torch.equal(images.cpu(), want_images)
        assert torch.equal(targets.cpu(), want_targets)


@pytest.mark.parametrize(
    ("requested", "workers_on_node", "cores", "expected"),
    [
        (-1, 8, 128, 15),  # 16 cores per GPU: one for the training process
        (-1, 1, 16, 15),
        (-1, 2, 2, 0),  # one core per worker: it decodes by itself
        (-1, 4, 2, 0),  # fewer cores than workers
        (0, 8, 128, 0),  # asked for: taken as is
        (6, 8, 128, 6),
    ],
)
def test_loader_workers_leave_a_core_for_training_when_auto(
    requested: int, workers_on_node: int, cores: int, expected: int
) -> None:
    assert loader_workers(requested, workers_on_node, cores) == expected


def test_loader_processes_give_the_batches_of_a_loader_without_them(
    dataset: SeededImageFolder,
) -> None:
    loader = make_loader(dataset, keys(dataset), workers=2, device=CPU)
    assert loader.persistent_workers and loader.prefetch_factor == PREFETCH_FACTOR
    assert not loader.pin_memory  # pinning is for copies to a GPU
    assert_same(list(loader), plain(dataset))


def test_prefetcher_yields_the_loaders_batches_in_order(dataset: SeededImageFolder) -> None:
    got = list(Prefetcher(make_loader(dataset, keys(dataset), workers=0, device=CPU), CPU))
    assert_same(got, plain(dataset))
    assert all(images.is_contiguous() for images, _ in got)


def test_prefetcher_converts_images_to_channels_last_when_asked(
    dataset: SeededImageFolder,
) -> None:
    loader = make_loader(dataset, keys(dataset), workers=0, device=CPU)
    got = list(Prefetcher(loader, CPU, image_mover(CPU, channels_last=True)))
    assert_same(got, plain(dataset))
    for images, _ in got:
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert not images.is_contiguous()


def test_prefetcher_reads_at_most_one_batch_ahead() -> None:
    drawn = 0

    def source() -> Iterator[Batch]:
        nonlocal drawn
        for i in range(5):
            drawn += 1
            yield torch.full((2, 3, 4, 4), float(i)), torch.tensor([i, i])

    for received, (images, _) in enumerate(Prefetcher(source(), CPU), start=1):
        assert images[0, 0, 0, 0].item() == received - 1
        assert drawn <= received + 1  # the batch handed out, and the next one
    assert drawn == 5


def test_decoding_on_the_device_gives_the_hosts_crops_and_flips(
    dataset: SeededImageFolder, encoded: SeededImageFolder
) -> None:
    host = plain(dataset)
    assert_same_crops(decoded_on(CPU, encoded, workers=0), host)
    assert_same_crops(decoded_on(CPU, encoded, workers=2), host)  # encoded samples pickle
    flipped = [(images.flip(-1), targets) for images, targets in decoded_on(CPU, encoded, 0)]
    with pytest.raises(AssertionError):  # the check can fail: a flip is seen
        assert_same_crops(flipped, host)


@pytest.fixture(scope="module")
def once(data_cfg: DataConfig) -> DecodedOnce:
    """The same training split decoded once (data.decode=once), on two threads."""
    return DecodedOnce(train_root(data_cfg), data_cfg.crop_size, seed=3, threads=2)


def test_decoded_once_a_sample_is_its_centre_crop_flipped_as_its_seed_draws(
    data_cfg: DataConfig, once: DecodedOnce
) -> None:
    """Each image is held as its centre crop (the 20 px JPEG resized to 16), and a key gives it
    flipped or not by the key alone. Loader processes, the prefetcher and the normalisation on
    the device give the batches of a loader without processes, normalised by hand."""
    crop = transforms.Compose(
        [transforms.Resize(16), transforms.CenterCrop(16), transforms.PILToTensor()]
    )
    files = sorted(train_root(data_cfg).rglob("*.jpg"))  # ImageFolder's order
    assert len(once) == len(files) == 12 and once.images.dtype == torch.uint8
    for i, path in enumerate(files):
        with Image.open(path) as image:
            assert torch.equal(once.images[i], crop(image.convert("RGB")))
    flips = []
    for key in [(epoch, i) for epoch in (0, 1) for i in range(12)]:
        image, target = once[key]
        flips.append(torch.equal(image, once.images[key[1]].flip(-1)))
        assert flips[-1] or torch.equal(image, once.images[key[1]])
        assert target == once.targets[key[1]]
        assert torch.equal(once[key][0], image)  # the same key, the same sample
    assert 0 < sum(flips) < len(flips)  # both draws seen: the check can fail

    normalize = Normalize(CPU)
    want = [(normalize(images), targets) for images, targets in plain(once)]  # type: ignore[arg-type]
    assert all(-3 < images.min() < images.max() < 3 for images, _ in want)
    for workers in (0, 2):
        loader = make_loader(once, keys(once), workers, CPU)  # type: ignore[arg-type]
        assert_same(list(Prefetcher(loader, CPU, image_mover(CPU))), want)
    loader = make_loader(once, keys(once), 0, CPU)  # type: ignore[arg-type]
    got = list(Prefetcher(loader, CPU, image_mover(CPU, channels_last=True)))
    assert all(images.is_contiguous(memory_format=torch.channels_last) for images, _ in got)
    assert_same(got, want)


@pytest.mark.gpu
def test_decoded_once_pixels_are_normalised_on_a_gpu(once: DecodedOnce) -> None:
    """data.decode=once on CUDA: pinned 8-bit batches copied on the side stream and normalised
    there, in channels_last, give the pixels normalised on the host."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    want = [(Normalize(CPU)(images), targets) for images, targets in plain(once)]  # type: ignore[arg-type]
    loader = make_loader(once, keys(once), workers=2, device=device)  # type: ignore[arg-type]
    got = list(Prefetcher(loader, device, image_mover(device, channels_last=True)))
    assert len(got) == len(want) == STEPS
    for (images, targets), (want_images, want_targets) in zip(got, want, strict=True):
        assert images.device == device and images.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(images.cpu(), want_images)
        assert torch.equal(targets.cpu(), want_targets)


@pytest.mark.gpu
def test_decoding_on_a_gpu_gives_the_hosts_crops_and_flips(
    dataset: SeededImageFolder, encoded: SeededImageFolder
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    got = decoded_on(device, encoded, workers=2)
    assert all(images.device == device for images, _ in got)
    # nvJPEG's IDCT is not libjpeg's: 4.3 levels at worst on an H200 (CUDA 13), against 17 or more
    # for a wrong crop or flip
    assert_same_crops(got, plain(dataset), mean_levels=8)


@pytest.mark.gpu
def test_prefetcher_copies_on_a_side_stream_on_cuda(dataset: SeededImageFolder) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    loader = make_loader(dataset, keys(dataset), workers=2, device=device)
    assert loader.pin_memory
    prefetcher = Prefetcher(loader, device, image_mover(device, channels_last=True))
    got = []
    busy = torch.randn(4096, 4096, device=device)
    for images, targets in prefetcher:
        assert images.device == device and targets.device == device
        assert images.is_contiguous(memory_format=torch.channels_last)
        # Keep the current stream busy while the next batch is copied on the side stream; the
        # values checked below are read on the current stream, after it waited for each copy.
        for _ in range(4):
            busy = (busy @ busy).tanh_()
        got.append((images.clone(), targets.clone()))
    assert prefetcher._stream is not None and prefetcher._stream != torch.cuda.current_stream()
    torch.cuda.synchronize(device)
    assert_same(got, plain(dataset))
