"""The ImageFolder data sets a worker trains and evaluates on, and their transforms.

``data.root`` holds ``train/<class>/*.JPEG`` and ``val/<class>/*.JPEG``: ImageNet's layout, or
the small generated stand-in of :mod:`elastic.synthetic`.

Augmentation is seeded per sample from (seed, epoch, index): a sample gets the same crop whatever
the world size, the rank that draws it, or how many restarts came before.
"""

from __future__ import annotations

import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import psutil
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets, transforms
from torchvision.io import read_file

from elastic.config import DataConfig, Decode
from elastic.config.training_rules import once_memory_problem

log = logging.getLogger(__name__)

PROGRESS_S = 10.0  # how often a long decode-once pass says how far it got

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_root(cfg: DataConfig) -> Path:
    return Path(cfg.root) / cfg.train_dir


def val_root(cfg: DataConfig) -> Path | None:
    """The validation split's folder; None when ``data.val_dir`` is empty (no validation)."""
    return Path(cfg.root) / cfg.val_dir if cfg.val_dir else None


def imagenet_transform(crop_size: int, min_crop_scale: float = 0.08) -> transforms.Compose:
    """The standard ImageNet training transforms (random-resized crop, flip, normalise).

    The crop covers ``min_crop_scale`` to all of the image's area (``data.min_crop_scale``)."""
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(crop_size, scale=(min_crop_scale, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def eval_transform(crop_size: int) -> transforms.Compose:
    """The ImageNet evaluation transform of torchvision's reference scripts.

    The short side is resized to ``crop_size * 256 / 224`` (256 for 224), the centre
    ``crop_size`` square cut, and normalised. Deterministic, so every evaluation of a model gives
    the same numbers."""
    return transforms.Compose(
        [
            transforms.Resize(round(crop_size * 256 / 224)),
            transforms.CenterCrop(crop_size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def image_folder(root: Path) -> datasets.ImageFolder:
    """The training split's ImageFolder at ``root``: its files listed, none read."""
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is not a directory: data.root must hold <data.train_dir>/<class>/<image>"
        )
    return datasets.ImageFolder(str(root))


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s augmentation in ``epoch``: the same wherever it is read."""
    return (seed * 1_000_003 + epoch) * 100_000_007 + index


class Encoded(NamedTuple):
    """A training sample left for the device to decode (``data.decode=device``).

    Its JPEG's bytes, and the crop and flip its seed drew, exactly as the host transform would
    have."""

    jpeg: torch.Tensor  # uint8, the file as it is on disk
    box: tuple[int, int, int, int]  # top, left, height, width in the decoded image
    flip: bool
    target: int


class SeededImageFolder(Dataset[tuple[torch.Tensor, int] | Encoded]):
    """An ImageFolder indexed by ``(epoch, index)`` whose augmentation is seeded by both.

    With ``data.decode=host`` a sample is its augmented pixels; with ``device``, it is
    :class:`Encoded`: the same draws from the same seed, taken from the image's header alone, so
    that a sample gets the same crop and flip wherever it is decoded."""

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        self.folder = image_folder(train_root(cfg))
        self.transform = imagenet_transform(cfg.crop_size, cfg.min_crop_scale)
        self.seed = seed
        self.encoded = cfg.decode is Decode.device

    @property
    def num_classes(self) -> int:
        return len(self.folder.classes)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int] | Encoded:
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed also seeds every accelerator's, which
            # costs ~240 us a sample against ~3 us, and the transforms draw from the CPU's.
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            if self.encoded:
                return self._encoded(index)
            image, target = self.folder[index]
            return self.transform(image), target

    def _encoded(self, index: int) -> Encoded:
        """The draws of :func:`imagenet_transform` in its order (the crop, then the flip).

        They come from the image's size as its header gives it; nothing is decoded."""
        path, target = self.folder.samples[index]
        crop, flip = self.transform.transforms[:2]
        with Image.open(path) as image:
            box = crop.get_params(image, crop.scale, crop.ratio)
        flipped = bool(torch.rand(1) < flip.p)
        return Encoded(read_file(path), box, flipped, target)


class DecodedOnce(Dataset[tuple[torch.Tensor, int]]):
    """The training split decoded once into this worker's memory (``data.decode=once``).

    Indexed by ``(epoch, index)`` as :class:`SeededImageFolder` is. Each image is resized (short
    side) and centre-cropped to ``crop_size`` once, and kept as 8-bit pixels; a sample is its
    image, flipped where its seed draws a flip. There is no random-resized crop: that would need
    the whole image kept. The loader processes share the pixels with the worker (a fork copies
    no page it only reads). A batch is copied to the device as 8-bit pixels, a quarter of the
    bytes, and normalised there (:func:`elastic.pipeline.image_mover`). For a data set that fits
    in memory, and for measuring a step where decoding JPEGs would be slower than the GPU (the
    GPU proof's throughput part).

    ``copies``: the workers of this node, each holding pixels of its own; the memory check
    counts them all.
    """

    def __init__(
        self, root: Path, crop_size: int, seed: int, threads: int, copies: int = 1
    ) -> None:
        folder = image_folder(root)
        n = len(folder)
        available = psutil.virtual_memory().available
        if problem := once_memory_problem(n, crop_size, available, copies):
            raise MemoryError(problem)
        self.images = torch.empty((n, 3, crop_size, crop_size), dtype=torch.uint8)
        self.targets = torch.tensor(folder.targets, dtype=torch.int64)
        self.seed = seed
        pixels = transforms.Compose(
            [
                transforms.Resize(crop_size),
                transforms.CenterCrop(crop_size),
                transforms.PILToTensor(),
            ]
        )

        def decode(index: int) -> None:
            self.images[index] = pixels(datasets.folder.default_loader(folder.samples[index][0]))

        began = last = time.monotonic()
        with ThreadPoolExecutor(max(1, threads)) as pool:  # PIL lets go of the GIL as it decodes
            for done, _ in enumerate(pool.map(decode, range(n)), 1):
                if time.monotonic() - last >= PROGRESS_S and done < n:
                    last = time.monotonic()
                    log.info("data.decode=once: %d of %d training images decoded", done, n)
        log.info(
            "data.decode=once: %d training images decoded in %.1f s, %.0f MiB held",
            n,
            time.monotonic() - began,
            self.images.nbytes / 2**20,
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        image = self.images[index]
        if random.Random(sample_seed(self.seed, epoch, index)).random() < 0.5:
            image = image.flip(-1)
        return image, int(self.targets[index])


class ValImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """The validation split ``<data.root>/<data.val_dir>/<class>/<image>``, indexed by plain int.

    Its images go through :func:`eval_transform`.

    Labels are the training split's class indices (its sorted class folders, as
    :class:`SeededImageFolder` numbers them), not the validation folder's own: a split that lacks
    a class still labels the others as the model learned them, and a class the model was never
    trained on is refused.
    """

    def __init__(self, cfg: DataConfig) -> None:
        root = val_root(cfg)
        if root is None:
            raise ValueError('data.val_dir="": this job has no validation split')
        fix = (
            'Fix: set data.val_dir="" to train without validation, or point data.val_dir at the '
            "split, sorted into the training split's class folders: "
            "<data.root>/<data.val_dir>/<class>/<image>"
        )
        if not root.is_dir():
            raise FileNotFoundError(
                f"data.val_dir={cfg.val_dir!r}: {root} is not a directory. {fix}"
            )
        _, class_to_idx = datasets.folder.find_classes(str(train_root(cfg)))
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        unknown = [c for c in classes if c not in class_to_idx]
        if not classes or unknown:
            found = (
                f"classes not in {cfg.train_dir}: {unknown[:5]}" if unknown else "no class folders"
            )
            raise FileNotFoundError(f"data.val_dir={cfg.val_dir!r}: {root} has {found}. {fix}")
        self.samples = datasets.folder.make_dataset(
            str(root),
            {c: class_to_idx[c] for c in classes},
            datasets.folder.IMG_EXTENSIONS,
            allow_empty=True,
        )
        if not self.samples:
            raise FileNotFoundError(f"data.val_dir={cfg.val_dir!r}: {root} holds no images. {fix}")
        self.transform = eval_transform(cfg.crop_size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        return self.transform(datasets.folder.default_loader(path)), target
