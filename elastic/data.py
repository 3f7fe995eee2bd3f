"""The ImageFolder pipeline and the small data sets that stand in for ImageNet.

No data set can be downloaded on the machines this is developed and tested on, so the default job
generates a small ImageFolder of JPEGs once (``data.generate.source``). ``stripes``: each class
has its own colour and stripe orientation, blurred by noise, which a ResNet learns in a few
epochs; its validation split is drawn from the same classes with a random stream of its own, so
no image is in both. ``digits``: scikit-learn's handwritten digits, real scans that no one here
made, in a fixed seeded split of each digit's images, upscaled to JPEGs a ResNet crop can take;
accuracy on them says more than on stripes that differ in colour. The real path is the same
code with ``data.root`` pointing at ImageNet's ``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG``.

Augmentation is seeded per sample from (seed, epoch, index): a sample gets the same crop whatever
the world size, the rank that draws it, or how many restarts came before.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from elastic.config import NO_SCIKIT_LEARN, DataConfig, DataSource, SyntheticDataConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SPEC_FILE = ".synthetic.json"


def train_root(cfg: DataConfig) -> Path:
    return Path(cfg.root) / cfg.train_dir


def val_root(cfg: DataConfig) -> Path | None:
    """The validation split's folder; None when ``data.val_dir`` is empty (no validation)."""
    return Path(cfg.root) / cfg.val_dir if cfg.val_dir else None


def ensure_synthetic(cfg: DataConfig) -> bool:
    """Generate the ImageFolder of ``cfg.generate`` (stripes or digits) at ``cfg.root`` unless
    it is already there.

    Returns True when it generated. The folder is built under a temporary name and renamed into
    place, so concurrent callers (several local nodes, or a killed run) never see half of it.
    """
    if cfg.val_dir == cfg.train_dir:
        raise ValueError(
            f"data.val_dir={cfg.val_dir!r} is the training split's folder (data.train_dir): set "
            'data.val_dir=val, or data.val_dir="" to train without validation'
        )
    root = Path(cfg.root)
    spec = _spec(cfg)
    spec_path = root / SPEC_FILE
    if spec_path.exists():
        if json.loads(spec_path.read_text()) == spec:
            return False
        shutil.rmtree(root)  # ours, generated with other settings
    elif root.exists() and any(root.iterdir()):
        raise FileExistsError(
            f"data.root={str(root)!r} exists and is not a generated data set: point data.root at "
            "an empty or missing folder, or set data.synthetic=false to train on it"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    try:
        if cfg.generate.source == DataSource.digits:
            _write_digits(tmp, cfg)
        else:
            _write_stripes(tmp, cfg)
        (tmp / SPEC_FILE).write_text(json.dumps(spec))
        if root.exists():
            root.rmdir()  # empty, checked above
        os.rename(tmp, root)
    except OSError:
        if spec_path.exists() and json.loads(spec_path.read_text()) == spec:
            return False  # another process won the race with the same data
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # whatever failed; renamed into place, it is gone
    return True


def _spec(cfg: DataConfig) -> dict[str, object]:
    """What the generated folder depends on; a cache with another spec is generated again."""
    g = cfg.generate
    return {
        "version": 2,  # 2: the validation split
        "source": str(g.source),
        "train_dir": cfg.train_dir,
        "classes": g.classes,
        "images_per_class": g.images_per_class,
        "image_size": g.image_size,
        "seed": g.seed,
        "val_dir": cfg.val_dir,
        # Without a validation split its size does not matter: changing it regenerates nothing.
        "val_images_per_class": g.val_images_per_class if cfg.val_dir else 0,
    }


def _write_stripes(tmp: Path, cfg: DataConfig) -> None:
    """The stripes' train split and, with ``data.val_dir``, their validation split under
    ``tmp``."""
    g = cfg.generate
    _draw_stripes(tmp / cfg.train_dir, g, g.images_per_class, np.random.default_rng(g.seed))
    if cfg.val_dir:
        # A stream of its own: the same classes, never the same image as in train.
        val_rng = np.random.default_rng([g.seed, 1])
        _draw_stripes(tmp / cfg.val_dir, g, g.val_images_per_class, val_rng)


def _draw_stripes(
    out: Path, g: SyntheticDataConfig, per_class: int, rng: np.random.Generator
) -> None:
    """``per_class`` JPEGs of each class under ``out/class_<c>/``; the class fixes the colour,
    the stripes' orientation and frequency, ``rng`` the jitter, phase and noise of each image."""
    size = g.image_size
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for c in range(g.classes):
        folder = out / f"class_{c:03d}"
        folder.mkdir(parents=True)
        hue = c / g.classes
        colour = np.array([np.cos(2 * np.pi * (hue + k / 3)) * 0.5 + 0.5 for k in range(3)])
        angle = np.pi * c / g.classes
        for i in range(per_class):
            theta = angle + rng.normal(0, 0.08)
            freq = 6 + 2 * (c % 3) + rng.normal(0, 0.3)
            phase = rng.uniform(0, 2 * np.pi)
            wave = np.sin(2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta)) + phase)
            img = 0.5 + 0.35 * wave[..., None] * colour[None, None, :] * 2 - 0.35 * colour
            img = img + rng.normal(0, 0.12, img.shape) + rng.uniform(-0.1, 0.1)
            pixels = (np.clip(img, 0, 1) * 255).astype(np.uint8)
            Image.fromarray(pixels, "RGB").save(folder / f"img_{i:05d}.jpg", quality=90)


def _write_digits(tmp: Path, cfg: DataConfig) -> None:
    """scikit-learn's digits 0 to ``classes - 1`` under ``tmp/<split>/digit_<d>/``: of each
    digit, ``images_per_class`` images for training and ``val_images_per_class`` others for
    validation, picked by a permutation seeded with ``seed`` (the same split on every machine).

    Each 8x8 scan (16 grey levels) is upscaled bicubically to ``image_size`` and saved as a
    greyscale JPEG named by its index in ``load_digits``, so a split can be traced back to the
    source. A balanced split keeps every epoch's classes even, as ImageNet's nearly are.
    """
    try:
        from sklearn.datasets import load_digits  # an optional extra: only this source needs it
    except ImportError as exc:
        raise ImportError(NO_SCIKIT_LEARN) from exc
    g = cfg.generate
    digits = load_digits()
    splits = [(cfg.train_dir, g.images_per_class)]
    if cfg.val_dir:
        splits.append((cfg.val_dir, g.val_images_per_class))
    rng = np.random.default_rng(g.seed)
    for digit in range(g.classes):
        chosen = rng.permutation(np.flatnonzero(digits.target == digit))
        wanted = sum(n for _, n in splits)
        if wanted > len(chosen):
            raise ValueError(
                f"data.generate: {wanted} images of digit {digit} wanted (images_per_class + "
                f"val_images_per_class), scikit-learn has {len(chosen)}: lower them"
            )
        start = 0
        for split, count in splits:
            folder = tmp / split / f"digit_{digit}"
            folder.mkdir(parents=True)
            for index in chosen[start : start + count]:
                grey = (digits.images[index] * (255 / 16)).round().astype(np.uint8)
                image = Image.fromarray(grey, "L").resize(
                    (g.image_size, g.image_size), Image.Resampling.BICUBIC
                )
                image.save(folder / f"img_{index:05d}.jpg", quality=95)
            start += count


def imagenet_transform(crop_size: int, min_crop_scale: float = 0.08) -> transforms.Compose:
    """The standard ImageNet training transforms (random-resized crop, flip, normalise); the
    crop covers ``min_crop_scale`` to all of the image's area (``data.min_crop_scale``)."""
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(crop_size, scale=(min_crop_scale, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def eval_transform(crop_size: int) -> transforms.Compose:
    """The ImageNet evaluation transform of torchvision's reference scripts: the short side
    resized to ``crop_size * 256 / 224`` (256 for 224), the centre ``crop_size`` square,
    normalised. Deterministic, so every evaluation of a model gives the same numbers."""
    return transforms.Compose(
        [
            transforms.Resize(round(crop_size * 256 / 224)),
            transforms.CenterCrop(crop_size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


class SeededImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """An ImageFolder indexed by ``(epoch, index)`` whose augmentation is seeded by both."""

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        root = train_root(cfg)
        if not root.is_dir():
            raise FileNotFoundError(
                f"{root} is not a directory: data.root must hold <data.train_dir>/<class>/<image>"
            )
        self.folder = datasets.ImageFolder(str(root))
        self.transform = imagenet_transform(cfg.crop_size, cfg.min_crop_scale)
        self.seed = seed

    @property
    def num_classes(self) -> int:
        return len(self.folder.classes)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        image, target = self.folder[index]
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed also seeds every accelerator's, which
            # costs ~240 us a sample against ~3 us, and the transforms draw from the CPU's.
            torch.default_generator.manual_seed(
                (self.seed * 1_000_003 + epoch) * 100_000_007 + index
            )
            return self.transform(image), target


class ValImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """The validation split ``<data.root>/<data.val_dir>/<class>/<image>`` with
    :func:`eval_transform`, indexed by plain int.

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
