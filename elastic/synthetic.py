"""The small data sets that stand in for ImageNet, generated once as an ImageFolder of JPEGs.

No data set can be downloaded on the machines this is developed and tested on, so the default job
generates one (``data.generate.source``): ``stripes``, whose classes differ in colour and stripe
orientation, which a ResNet learns in a few epochs, or ``digits``, scikit-learn's handwritten
digits, real scans that no one here made, on which accuracy says more. The real path reads
ImageNet's ``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG`` instead (:mod:`elastic.data`).
Only numpy and PIL: the launcher prepares the data before any node starts, and must not pay for
importing torch to do it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from elastic.config import NO_SCIKIT_LEARN, DataConfig, DataSource, SyntheticDataConfig

SPEC_FILE = ".synthetic.json"


def ensure_synthetic(cfg: DataConfig) -> bool:
    """Generate the ImageFolder of ``cfg.generate`` (stripes or digits) at ``cfg.root`` if missing.

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
    """Write the stripes' splits under ``tmp``: train, and validation with ``data.val_dir``.

    Each class has its own colour and stripe orientation, blurred by noise. The validation split
    is drawn from the same classes with a random stream of its own, so no image is in both."""
    g = cfg.generate
    _draw_stripes(tmp / cfg.train_dir, g, g.images_per_class, np.random.default_rng(g.seed))
    if cfg.val_dir:
        # A stream of its own: the same classes, never the same image as in train.
        val_rng = np.random.default_rng([g.seed, 1])
        _draw_stripes(tmp / cfg.val_dir, g, g.val_images_per_class, val_rng)


def _draw_stripes(
    out: Path, g: SyntheticDataConfig, per_class: int, rng: np.random.Generator
) -> None:
    """Draw ``per_class`` JPEGs of each class under ``out/class_<c>/``.

    The class fixes the colour, the stripes' orientation and frequency; ``rng`` fixes the
    jitter, phase and noise of each image."""
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
    """Write scikit-learn's digits 0 to ``classes - 1`` under ``tmp/<split>/digit_<d>/``.

    Of each digit, ``images_per_class`` images are for training and ``val_images_per_class``
    others for validation. They are picked by a permutation seeded with ``seed`` (the same split
    on every machine).

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
