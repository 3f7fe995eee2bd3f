"""The job contract: what a training job writes, and what the runtime keeps for itself.

A job is a class deriving from :class:`Job`, named by ``job._target_`` (``conf/job/``). It says
what to train: the data set, the model, the optimizer, the loss of a batch, the evaluation and any
extra state. The runtime (:mod:`elastic.trainer`) owns everything else, the same for every job:
the process group and its rebuilds, DDP and the comm hook, the sampler and its exactly-once
bookkeeping, the LR policy and its rescaling to the world size, precision, the state sync from
peers, checkpoints, events and invariants. ``elastic/jobs/`` holds the built-in jobs: the
ImageNet classifier (the default) and a small language model.

The contract keeps what the runtime's guarantees rest on:

- The data set is indexed by ``(epoch, index)`` keys from the sampler, and a key must give the
  same sample wherever and whenever it is read (seed any randomness from the key): a sample
  redone after a recovery is then the same sample, and every one is trained exactly once.
- A batch, as :meth:`Job.to_device` hands it to :meth:`Job.loss`, is a tuple of tensors whose
  first dimension is the sample (by default a sample is a tuple of tensors, and the loader
  stacks them); the runtime splits a batch into micro-batches along it.
- :meth:`Job.loss` returns one loss per sample: the runtime weights them so that DDP's average is
  the mean over the global batch, whatever the world size and however the last step falls short.
- State other than the model's and the optimizer's (:meth:`Job.state`) is a dict of tensors the
  job updates in place (in :meth:`Job.after_step`): it is checkpointed, restored with the rest on
  a rollback or a resume, and broadcast to a rank that joins.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeAlias, TypeVar

from elastic.config import Config

# torch only for the type checker: the launcher imports a job's class to check ``job.*`` before
# anything starts, and must not pay torch's seconds for it (a job's methods run in workers).
if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from elastic.evaluate import AllReduce, EvalResult, Predict

Batch: TypeAlias = "tuple[torch.Tensor, ...]"


class Loss(NamedTuple):
    """What :meth:`Job.loss` may return instead of the bare per-sample losses: those, and metrics.

    The metrics are of the step, each a tensor of one value per sample (token accuracy, a loss
    term). The runtime averages each over the step's samples as it does the loss; rank 0 logs
    them in its ``step`` event and to TensorBoard (``train/<name>``)."""

    per_sample: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass
class NoSettings:
    """The ``job.*`` settings of a job that has none of its own."""


S = TypeVar("S")


@dataclass(frozen=True)
class EvalContext:
    """What an evaluation needs from the runtime: rank, all-reduce, autocast, and a stop check.

    This rank's place in the round; the round's all-reduce (which a lost peer or a new round
    breaks, as any collective); the precision's autocast; and ``stop``, which says the round was
    left (raise :class:`~elastic.round_end.RoundAborted`; the next round redoes the
    evaluation)."""

    rank: int
    world_size: int
    device: torch.device
    batch_size: int
    loader_workers: int
    all_reduce: AllReduce
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    stop: Callable[[], bool] = lambda: False
    # Every rank runs as many forward passes (parallel.shard=node: each gathers shards).
    equal_batches: bool = False

    def evaluate(
        self,
        model: torch.nn.Module,
        dataset: Dataset[Any],
        predict: Predict | None = None,
        move: Callable[[Any], Batch] | None = None,
    ) -> EvalResult:
        """The mean loss and top-1/top-5 accuracy of ``predict``'s logits over ``dataset``.

        ``predict`` is by default a classifier's: ``model(batch[0])`` against ``batch[1]``. Each
        rank evaluates its share, summed over the round (:func:`elastic.evaluate.evaluate`)."""
        from elastic.evaluate import classify, evaluate

        return evaluate(
            model,
            dataset,
            self.rank,
            self.world_size,
            self.device,
            self.batch_size,
            all_reduce=self.all_reduce,
            autocast=self.autocast,
            predict=predict or classify,
            move=move,
            loader_workers=self.loader_workers,
            stop=self.stop,
            equal_batches=self.equal_batches,
        )


class Job(ABC, Generic[S]):
    """One training job, built once per worker before the first round.

    It is built with the whole configuration, its own ``job.*`` settings (an instance of
    :attr:`Settings`, checked like every key: types, ranges declared with
    :func:`elastic.config.bounded`, :meth:`problems`) and the worker's device.

    Subclasses implement :meth:`train_data`, :meth:`build_model` and :meth:`loss`; the rest has
    defaults.
    """

    # The dataclass of this job's ``job.*`` keys (its defaults are the job's).
    Settings: ClassVar[type] = NoSettings

    def __init__(self, cfg: Config, settings: S, device: torch.device) -> None:
        self.cfg = cfg
        self.settings = settings
        self.device = device

    @classmethod
    def problems(cls, cfg: Config, settings: S) -> list[str]:
        """What the settings' types and ranges cannot say is wrong.

        Each as :func:`elastic.config.problem` words it (key, value, fix); checked before
        anything starts, with every other key."""
        return []

    @classmethod
    def prepare(cls, cfg: Config, settings: S) -> None:
        """Run once by the launcher before any node starts: generate or fetch the data."""

    @abstractmethod
    def train_data(self) -> Dataset[Any]:
        """The training set: ``len()`` samples an epoch, each read by an ``(epoch, index)`` key.

        The same key gives the same sample."""

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """The model, on :attr:`device`.

        The runtime seeds torch with ``trainer.seed`` first, so every rank builds the same one."""

    def shard_units(self) -> tuple[type[torch.nn.Module], ...]:
        """The module types ``parallel.shard=node`` shards one by one (FSDP2's units).

        Each instance gathers its parameters for its own forward and backward only, so a
        worker holds one unit's whole weights at a time; what no unit takes is sharded as one
        unit with the model. By default none: the model is one unit. A transformer names its
        block type."""
        return ()

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer; by default the ``optim`` group's (SGD, LARS, Akiba's RMSprop warm-up).

        The runtime sets every param group's ``lr`` before each step, as the LR policy says."""
        from elastic.optim import build_optimizer

        return build_optimizer(model, self.cfg.optim)

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor | Loss:
        """The loss of each sample of ``batch``, or a :class:`Loss` with the step's metrics.

        The losses have shape ``(len(batch[0]),)``, from ``model``'s forward (DDP's wrapper:
        call it, do not reach into it). Runs under the precision's autocast; the runtime
        weights, sums and back-propagates."""

    def after_step(self, model: torch.nn.Module) -> None:
        """Update :meth:`state` after each optimizer step taken, on every rank alike.

        The state may be an average of the weights, a counter. ``model`` is the module, not DDP's
        wrapper."""

    def collate(self) -> Callable[[list[Any]], Any] | None:
        """How the loader makes a batch of samples; None: stacked (PyTorch's default)."""
        return None

    def to_device(self, batch: Any) -> Batch:
        """A loader batch on :attr:`device`; by default each tensor copied.

        It runs on a side stream while the previous step trains
        (:class:`elastic.pipeline.Prefetcher`)."""
        return tuple(t.to(self.device, non_blocking=True) for t in batch)

    def has_validation(self) -> bool:
        """Whether :meth:`evaluate` has data to evaluate (``trainer.eval_every_epochs``)."""
        return False

    def evaluate(self, model: torch.nn.Module, ctx: EvalContext) -> EvalResult:
        """Evaluate ``model`` on this rank's share of the validation set, summed over the round.

        ``model`` is the module, not DDP's wrapper. The sum uses ``ctx.all_reduce``: a
        collective."""
        raise NotImplementedError(f"{type(self).__name__} has no validation")

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors the job keeps besides the model's and the optimizer's, updated in place.

        They are checkpointed with them, and sent to a rank that joins."""
        return {}
