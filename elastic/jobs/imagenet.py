"""The default job: a torchvision classifier trained on an ImageFolder.

It is trained the way Goyal et al. train ResNet-50 on ImageNet.

Its settings are the ``model`` and ``data`` groups (and ``optim.label_smoothing``), where every
recipe and launch has always set them; it has no ``job.*`` keys. The data is ImageNet's layout
(:mod:`elastic.data`), or the small stand-in :meth:`ImageNetJob.prepare` generates
(``data.synthetic``); the model is ``model.name`` from torchvision (:mod:`elastic.model`), in
channels_last on CUDA; the loss is the cross-entropy with label smoothing; the evaluation is
top-1 and top-5 on ``data.val_dir`` after averaging the ranks' batch-norm statistics.

torch is imported inside the methods: the launcher imports this module to check the job, and a
launch must not pay torch's seconds before its nodes start.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.config import BNStats, Config, Decode
from elastic.config.training_rules import data_problems, model_problems, once_problems
from elastic.control import local_world_size
from elastic.job import Batch, EvalContext, Job, NoSettings

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.utils.data import Dataset

    from elastic.data import ValImageFolder
    from elastic.evaluate import EvalResult
    from elastic.pipeline import DeviceDecoder

log = logging.getLogger("elastic.jobs.imagenet")

IMAGENET_CLASSES = 1000  # the class count assumed of a data set not yet on disk


class ImageNetJob(Job[NoSettings]):
    """A torchvision classifier (``model.*``) on an ImageFolder (``data.*``)."""

    def __init__(self, cfg: Config, settings: NoSettings, device: torch.device) -> None:
        super().__init__(cfg, settings, device)
        from elastic.pipeline import DeviceDecoder, image_mover
        from elastic.precision import resolve_channels_last

        self.channels_last = resolve_channels_last(cfg.trainer.channels_last, device)
        self.decoder: DeviceDecoder | None = (
            DeviceDecoder(cfg.data.crop_size, device) if cfg.data.decode is Decode.device else None
        )
        self._move = image_mover(device, self.channels_last, self.decoder)
        self._val: ValImageFolder | None = None

    @classmethod
    def problems(cls, cfg: Config, settings: NoSettings) -> list[str]:
        """The data set's folders and counts, ``model.name``, and ``data.decode=once``'s size."""
        return [*data_problems(cfg), *model_problems(cfg), *once_problems(cfg)]

    @classmethod
    def prepare(cls, cfg: Config, settings: NoSettings) -> None:
        """Generate the synthetic ImageFolder once (``data.synthetic``)."""
        if not cfg.data.synthetic:
            return
        from elastic.synthetic import ensure_synthetic

        log.info("preparing the synthetic ImageFolder at %s", cfg.data.root)
        if ensure_synthetic(cfg.data):
            g = cfg.data.generate
            log.info("generated %d classes x %d JPEGs", g.classes, g.images_per_class)

    def num_classes(self) -> int:
        """The training split's class folders; before the data exists, what it will hold."""
        data = self.cfg.data
        train = Path(data.root) / data.train_dir
        if train.is_dir():
            return sum(1 for p in train.iterdir() if p.is_dir())
        return data.generate.classes if data.synthetic else IMAGENET_CLASSES

    def train_data(self) -> Dataset[Any]:
        import torch

        from elastic.data import DecodedOnce, SeededImageFolder, train_root

        data, seed = self.cfg.data, self.cfg.trainer.seed
        if data.decode is Decode.once:  # the decode pass takes this worker's share of the cores
            threads, node_workers = torch.get_num_threads(), local_world_size()
            return DecodedOnce(train_root(data), data.crop_size, seed, threads, node_workers)
        return SeededImageFolder(data, seed)

    def build_model(self) -> torch.nn.Module:
        import torch

        from elastic.evaluate import use_last_batch_stats
        from elastic.model import build_model

        model = build_model(self.cfg.model, self.num_classes()).to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.cfg.model.bn_stats == BNStats.last_batch:
            use_last_batch_stats(model)
        return model

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        import torch.nn.functional as F

        images, targets = batch
        smoothing = self.cfg.optim.label_smoothing
        return F.cross_entropy(model(images), targets, reduction="none", label_smoothing=smoothing)

    def collate(self) -> Callable[[list[Any]], Any] | None:
        return self.decoder.collate if self.decoder else None

    def to_device(self, batch: Any) -> Batch:
        return self._move(batch)

    def has_validation(self) -> bool:
        return bool(self.cfg.data.val_dir)

    def evaluate(self, model: torch.nn.Module, ctx: EvalContext) -> EvalResult:
        from elastic.data import ValImageFolder
        from elastic.evaluate import average_bn_stats
        from elastic.pipeline import image_mover

        if self._val is None:
            self._val = ValImageFolder(self.cfg.data)
        average_bn_stats(model, ctx.world_size, all_reduce=ctx.all_reduce)
        return ctx.evaluate(model, self._val, move=image_mover(ctx.device, self.channels_last))
