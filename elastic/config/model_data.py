"""The ``model`` and ``data`` sections: what a worker trains, and on which images.

A torchvision classification model, and an ImageFolder of JPEGs read with the ImageNet
transforms, or a small learnable one generated once (``data.synthetic``).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config.schema import Choice, bounded, checked_when


class BNStats(Choice):
    """Which batch-norm statistics evaluation uses."""

    running = "running"  # the moving averages, averaged over the ranks before evaluating
    last_batch = "last_batch"  # the last training minibatch's, averaged over the ranks (Akiba)


@dataclass
class ModelConfig:
    """A torchvision classification model, built with ``num_classes`` from the data set."""

    name: str = "resnet18"
    # Goyal et al.: the last BN gamma of each residual block starts at zero.
    zero_init_residual: bool = True
    # last_batch: batch norm keeps no moving averages; evaluation uses the statistics of the last
    # training minibatch, averaged over every rank (Akiba et al.).
    bn_stats: BNStats = BNStats.running


class Decode(Choice):
    """Where a training batch's JPEGs are decoded and augmented (:mod:`elastic.pipeline`)."""

    host = "host"  # in the loader processes (PIL), the batch copied to the device as pixels
    # On the device: the loader processes read the files and draw each sample's seeded crop and
    # flip; the training process decodes the batch there (nvJPEG on CUDA) and crops it. Frees the
    # host's cores where they cannot keep a GPU fed. Evaluation still decodes on the host.
    device = "device"
    # Once, before the first step: each worker holds every training image, resized and cropped to
    # data.crop_size, as 8-bit pixels (elastic.data.DecodedOnce); a sample is its seeded flip, with
    # no random-resized crop. For a data set that fits in memory, or a step measured without JPEG
    # decoding (bench/throughput.py on a GPU). Evaluation still decodes on the host.
    once = "once"


class DataSource(Choice):
    """What a generated ImageFolder (``data.synthetic``) holds (:mod:`elastic.data`)."""

    stripes = "stripes"  # drawn here: each class its own colour and stripe angle, learnt at once
    # scikit-learn's handwritten digits (load_digits: 1,797 real 8x8 scans), upscaled; needs
    # pip install '.[digits]'
    digits = "digits"


# The fewest images of one digit in scikit-learn's load_digits (174 to 183 per digit): a
# balanced split takes at most this many of each, train and validation together.
DIGITS_PER_CLASS = 174


@dataclass
class SyntheticDataConfig:
    """How the ImageFolder of JPEGs is generated when ``data.synthetic`` is on.

    It is written once at ``data.root``: drawn, or a real small data set written out as JPEGs."""

    source: DataSource = DataSource.stripes
    # stripes: how many classes to draw; digits: the digits 0 to classes - 1 (at most 10).
    classes: int = bounded(
        10, ge=2, why="need two classes to learn", fix="set data.generate.classes=2 or more"
    )
    # digits: images_per_class + val_images_per_class of each digit, at most DIGITS_PER_CLASS.
    images_per_class: int = bounded(64, ge=1, fix="set data.generate.images_per_class=1 or more")
    # The side of the square JPEGs (digits: the 8x8 scans upscaled bicubically to it).
    image_size: int = bounded(
        40, ge=16, why="too small", fix="set data.generate.image_size=16 or more"
    )
    # stripes: the images' random stream; digits: which images of each digit go to which split.
    seed: int = 0
    # The validation split (<root>/val/<class>/*.jpg): the same classes, never the same image.
    val_images_per_class: int = bounded(
        16, ge=1, fix="set data.generate.val_images_per_class=1 or more"
    )


@dataclass
class DataConfig:
    """An ImageFolder (``<root>/<train_dir>/<class>/*.jpg``) with the ImageNet transforms."""

    root: str = "data/synthetic"
    train_dir: str = "train"
    # <root>/<val_dir>/<class>/*.jpg, evaluated every trainer.eval_every_epochs; "" = none.
    val_dir: str = "val"
    # Generate a small learnable ImageFolder at ``root`` once, instead of reading a real one.
    synthetic: bool = True
    # Checked only with ``synthetic`` on: a real ImageFolder generates nothing.
    generate: SyntheticDataConfig = checked_when("synthetic", SyntheticDataConfig)
    crop_size: int = bounded(
        224,
        ge=16,
        why="too small for a ResNet",
        fix="set data.crop_size to 16 or more (224 for ImageNet)",
    )
    # The random-resized crop's smallest share of the image's area (Inception's 0.08 on
    # ImageNet): an image whose class one stroke cannot tell (a digit) needs more of it.
    min_crop_scale: float = bounded(
        0.08, gt=0, le=1, fix="set data.min_crop_scale to a share in (0, 1], e.g. 0.08"
    )
    # Per worker.
    batch_size: int = bounded(32, ge=1, fix="set data.batch_size (per worker) to 1 or more")
    # Loader processes per worker; -1: this node's cores divided among its workers.
    loader_workers: int = bounded(
        0, ge=-1, fix="set data.loader_workers=-1 (auto), 0 (load in the worker) or more"
    )
    decode: Decode = Decode.host
