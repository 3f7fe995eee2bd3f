"""The rules a range cannot say about what the job trains: data, optimizer, gradients, model.

The gradients' rules are about their travel. One rule function per section, each yielding
:func:`~elastic.config.schema.problem` strings for :func:`elastic.config.validate`. The rules
that the runtime also applies to a configuration it may be handed unvalidated are functions of
their own, called there too, so that each is written once: :func:`grad_dtype_problem`
(:mod:`elastic.precision`), :func:`decay_warmup_problem` (:mod:`elastic.lr_policy`) and
:data:`NO_SCIKIT_LEARN` (:mod:`elastic.synthetic`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

from elastic.cache import cached
from elastic.config.cluster import ClusterMode, Device
from elastic.config.job import Config
from elastic.config.model_data import DIGITS_PER_CLASS, DataSource, Decode, SyntheticDataConfig
from elastic.config.optim import OptimConfig, Schedule
from elastic.config.schema import problem
from elastic.config.trainer import CommBackend, GradDtype, Precision, Shard

# Refused by validate and by elastic.data's writer alike (which a caller may reach unvalidated).
NO_SCIKIT_LEARN = problem(
    "data.generate.source",
    "digits",
    "the digits come with scikit-learn, which is not installed",
    "pip install '.[digits]' (scikit-learn), or use data.generate.source=stripes",
)


def data_problems(cfg: Config) -> Iterator[str]:
    """The problems of the ``data`` section.

    A real ImageFolder's splits must be directories this user can read; generated digits must
    fit the data set."""
    d = cfg.data
    if not d.synthetic:
        train = Path(d.root) / d.train_dir
        if not train.is_dir():
            yield problem(
                "data.root",
                d.root,
                f"{train} is not a directory",
                "point data.root at an ImageFolder whose train split is "
                "<data.root>/<data.train_dir>/<class>/<image>, or use data=synthetic",
            )
        elif not os.access(train, os.R_OK | os.X_OK):
            yield problem(
                "data.root",
                d.root,
                f"{train} cannot be read by this user",
                "grant read access to the data set, or point data.root at a readable copy",
            )
        if d.val_dir and not (Path(d.root) / d.val_dir).is_dir():
            yield problem(
                "data.val_dir",
                d.val_dir,
                f"{Path(d.root) / d.val_dir} is not a directory",
                'set data.val_dir="" to train without validation, or point it at the validation '
                "split sorted into class folders (<data.root>/<data.val_dir>/<class>/<image>)",
            )
    elif d.generate.source == DataSource.digits:
        yield from digits_problems(d.generate, d.val_dir)


# The share of the memory available that data.decode=once may take: the rest is for the model,
# the loader's batches and the node's other workers.
ONCE_MEMORY_SHARE = 0.5


def once_memory_problem(images: int, crop_size: int, available: int, copies: int = 1) -> str | None:
    """Why ``images`` pixels of ``crop_size`` squares cannot be held (``data.decode=once``), if so.

    ``available``: the bytes of memory available on this machine now; ``copies``: the workers
    that hold the split on it, each its own."""
    each = images * 3 * crop_size * crop_size
    if each * copies <= available * ONCE_MEMORY_SHARE:
        return None
    size = f"{images:,} images x 3 x {crop_size} x {crop_size} bytes = {each / 2**30:.1f} GiB"
    if copies > 1:
        size += f", {each * copies / 2**30:.1f} GiB for the {copies} workers on this machine,"
    return problem(
        "data.decode",
        "once",
        f"it holds the training split in each worker's memory, {size} and that is more than "
        f"{ONCE_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available",
        "use data.decode=host (or device on a GPU) for a data set of this size, or a smaller "
        "data.crop_size" + (", or fewer workers on a machine" if copies > 1 else ""),
    )


def workers_on_this_machine(cfg: Config) -> int:
    """The workers that will run on the launching machine, as far as the settings tell.

    A simulated cluster runs every node here; a bare-metal launch, this node. A GPU count that
    only CUDA knows (``workers_per_node=0`` on a GPU) counts as one a node: the workers check
    again themselves (:class:`elastic.data.DecodedOnce`)."""
    c = cfg.cluster
    per_node = c.workers_per_node or (c.cpu_workers if c.device is not Device.cuda else 1)
    return per_node * (c.nodes if c.mode is ClusterMode.local else 1)


def once_problems(cfg: Config) -> Iterator[str]:
    """``data.decode=once``: the training split must fit, counted at launch.

    The generated split's size is its settings'; a folder's is counted (its files, a second or
    two for ImageNet's 1.3 million), so that a split too large is refused before any worker
    starts and fails, against the memory this machine has available now, for each of the
    workers it will run (:func:`workers_on_this_machine`). Each worker checks again on its own
    machine (:class:`elastic.data.DecodedOnce`)."""
    d = cfg.data
    if d.decode is not Decode.once:
        return
    if d.synthetic:
        images = d.generate.classes * d.generate.images_per_class
    else:
        train = Path(d.root) / d.train_dir
        if not train.is_dir():
            return  # data_problems says so
        classes = [c.path for c in os.scandir(train) if c.is_dir()]
        images = sum(1 for c in classes for f in os.scandir(c) if f.is_file())
    available = psutil.virtual_memory().available
    if found := once_memory_problem(images, d.crop_size, available, workers_on_this_machine(cfg)):
        yield found


def digits_problems(g: SyntheticDataConfig, val_dir: str) -> list[str]:
    """What keeps ``data.generate`` from a balanced split of scikit-learn's digits.

    More classes than the 10 digits, more images of a digit than the scarcest digit has, or no
    scikit-learn."""
    problems = []
    if g.classes > 10:
        problems.append(
            problem(
                "data.generate.classes",
                g.classes,
                "the digits are 10 classes (0 to 9)",
                "set data.generate.classes=10 or fewer (the digits 0 to classes - 1)",
            )
        )
    wanted = g.images_per_class + (g.val_images_per_class if val_dir else 0)
    if wanted > DIGITS_PER_CLASS:
        held_out = f" and {g.val_images_per_class} held out" if val_dir else ""
        problems.append(
            problem(
                "data.generate.images_per_class",
                g.images_per_class,
                f"{g.images_per_class} images of each digit to train on{held_out} make "
                f"{wanted}, and the scarcest digit has {DIGITS_PER_CLASS}",
                "lower data.generate.images_per_class or data.generate.val_images_per_class "
                f"until they add up to {DIGITS_PER_CLASS} at most",
            )
        )
    if importlib.util.find_spec("sklearn") is None:
        problems.append(NO_SCIKIT_LEARN)
    return problems


def optim_problems(cfg: Config) -> Iterator[str]:
    o = cfg.optim
    if list(o.milestones_epochs) != sorted(o.milestones_epochs):
        yield problem(
            "optim.milestones_epochs",
            o.milestones_epochs,
            "must be in increasing order",
            "sort the milestones",
        )
    epochs = cfg.trainer.epochs
    if warmup := decay_warmup_problem(o, o.warmup_epochs, epochs, epochs):
        yield warmup
    if o.nesterov and o.name != "sgd":
        yield problem(
            "optim.nesterov",
            o.nesterov,
            f"optim.name={o.name} has no Nesterov form",
            "set optim.nesterov=false, or use optim=sgd",
        )


def decay_warmup_problem(o: OptimConfig, warmup: float, total: float, epochs: float) -> str | None:
    """The refusal when a decay to the end's (poly, cosine) warm-up lasts until the end of the job.

    The warm-up (``warmup``) lasting until the end (``total``) leaves the decay nothing;
    ``epochs`` is ``trainer.epochs``. Both in one unit: epochs here, samples as
    :class:`elastic.lr_policy.LRSchedule` rounds them."""
    if o.schedule not in (Schedule.poly, Schedule.cosine) or warmup < total:
        return None
    return problem(
        "optim.warmup_epochs",
        o.warmup_epochs,
        f"the {o.schedule} schedule decays after warm-up, and trainer.epochs={epochs:g}",
        "lower optim.warmup_epochs below trainer.epochs, or train longer",
    )


# What each backend's all_reduce sums, in torch 2.14. tests/test_precision.py all-reduces every
# dtype listed for gloo, so a torch that drops one fails there, not in a job's first backward.
REDUCIBLE: dict[str, frozenset[GradDtype]] = {
    "gloo": frozenset(GradDtype),
    "nccl": frozenset(GradDtype),
}


def grad_dtype_problem(backend: str, grad_dtype: GradDtype) -> str | None:
    """The refusal ``validate`` reports when ``backend`` cannot all-reduce ``grad_dtype``."""
    if grad_dtype in REDUCIBLE.get(backend, frozenset()):
        return None
    return problem(
        "comm.grad_dtype",
        str(grad_dtype),
        f"the {backend} backend cannot all-reduce {grad_dtype}",
        "set comm.grad_dtype=fp32",
    )


def comm_problems(cfg: Config) -> Iterator[str]:
    """gloo on CUDA only as the test aid it is, and a gradient dtype every backend can sum."""
    comm, device = cfg.comm, cfg.cluster.device
    if comm.backend == CommBackend.gloo and device != Device.cuda:
        yield problem(
            "comm.backend",
            comm.backend,
            f"gloo on CUDA tensors is a test aid for simulated nodes that share one GPU, and "
            f"cluster.device={device} (on the CPU the backend is gloo already)",
            "remove comm.backend=gloo, or set cluster.device=cuda for a test on one GPU",
        )
    backends = {"cpu": ["gloo"], "cuda": ["nccl"], "auto": ["gloo", "nccl"]}[str(device)]
    if comm.backend == CommBackend.gloo:
        backends = ["gloo"]
    yield from (p for b in backends if (p := grad_dtype_problem(b, comm.grad_dtype)))


# How to run a job that parallel.shard=node cannot take on NCCL (here, and in a worker whose
# cluster.device=auto found a GPU: elastic.sharded_entry).
SHARDED_ON_NCCL_FIX = (
    "use parallel.shard=none (DDP) on GPUs for now, or cluster.device=cpu (on one GPU, "
    "comm.backend=gloo runs it as a test aid)"
)


def parallel_problems(cfg: Config) -> Iterator[str]:
    """What ``parallel.shard=node`` cannot run with: it is recovered in place over gloo only."""
    if cfg.parallel.shard is not Shard.node:
        return
    if cfg.cluster.device is Device.cuda and cfg.comm.backend is not CommBackend.gloo:
        yield problem(
            "parallel.shard",
            Shard.node,
            "the sharded path recovers in place through gloo groups it can abort, and has not yet "
            "run on NCCL (issue 51's GPU part)",
            SHARDED_ON_NCCL_FIX,
        )
    if cfg.trainer.precision is Precision.fp16:
        yield problem(
            "trainer.precision",
            Precision.fp16,
            "fp16's loss scaler reads whole gradients, and parallel.shard=node keeps a shard each",
            "use trainer.precision=bf16, which needs no scaler, or parallel.shard=none",
        )
    if cfg.comm.grad_dtype is not GradDtype.fp32:
        yield problem(
            "comm.grad_dtype",
            cfg.comm.grad_dtype,
            "it is the DDP hook's wire dtype; FSDP2 reduces the gradients in their own dtype",
            "remove comm.grad_dtype (fp32), or use parallel.shard=none",
        )


def model_problems(cfg: Config) -> Iterator[str]:
    name = cfg.model.name
    if not name:
        yield problem("model.name", "", "empty", "use model=resnet18 or model=resnet50")
    elif name not in torchvision_models():
        yield problem(
            "model.name",
            name,
            "not a torchvision classification model",
            "use model=resnet18 or model=resnet50, or model.name=<one of "
            "torchvision.models.list_models()>",
        )


def torchvision_models() -> list[str]:
    """The names of torchvision's classification models (``model.name``'s choices).

    Learned once per torchvision version (:mod:`elastic.cache`)."""

    def learn() -> list[str]:
        from torchvision import models

        return models.list_models(module=models)

    def valid(found: object) -> bool:
        return isinstance(found, list) and all(isinstance(n, str) for n in found)

    version = importlib.metadata.version("torchvision")
    return cached(f"torchvision-{version}-models", valid, learn)
