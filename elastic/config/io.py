"""The resolved ``config.yaml`` in the run directory: written by the launcher, read by the job.

It is written once by the launcher and read back by every agent and worker of the job, so that
all of them run the configuration it checked."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from elastic.config.job import Config


def load(path: str | os.PathLike[str]) -> Config:
    """Read a resolved ``config.yaml`` back into the typed schema."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def save(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` to ``path`` atomically.

    Atomically because on bare metal every node's launcher writes the same file in the shared
    run directory while other nodes' agents may be reading it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    OmegaConf.save(OmegaConf.structured(cfg), partial)
    os.replace(partial, path)
