"""From ``job._target_`` and ``job.*`` to a job class and its typed settings, or the reasons not.

The launcher checks the job with every other key before anything starts
(:func:`job_problems`): a target that does not import, a class that is not a
:class:`~elastic.job.Job` or leaves part of the contract unwritten, a setting of the wrong type
or outside its declared range, each named with the value and the fix. A worker builds its job
with :func:`build_job`, from the configuration the launcher checked.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from dataclasses import is_dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from elastic.config import Config, ConfigError, bound_problems, problem
from elastic.job import Job

if TYPE_CHECKING:
    import torch

TARGET = "job._target_"
FIX_TARGET = (
    "set job._target_ to a class deriving elastic.job.Job as package.module.Class, importable "
    "here and on every node (install the package, or add its folder to PYTHONPATH), or pick a "
    "built-in job: job=imagenet or job=lm"
)


def job_class(target: str) -> type[Job[Any]]:
    """The class ``target`` names; :class:`ConfigError` saying what is missing otherwise."""
    module_name, _, class_name = str(target).rpartition(".")
    if not module_name or not class_name:
        raise ConfigError(problem(TARGET, target, "is not a module.Class path", FIX_TARGET))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            why = f"no module named {missing!r} can be imported"
        else:
            why = f"module {module_name!r} imports {missing!r}, which is not installed"
        raise ConfigError(problem(TARGET, target, why, FIX_TARGET)) from exc
    except Exception as exc:  # the user's module fails as it is imported
        why = f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        raise ConfigError(problem(TARGET, target, why, FIX_TARGET)) from exc
    found = getattr(module, class_name, None)
    if found is None:
        why = f"module {module_name!r} has no {class_name!r}"
        raise ConfigError(problem(TARGET, target, why, FIX_TARGET))
    if not (inspect.isclass(found) and issubclass(found, Job)):
        why = f"{class_name} is not a class deriving elastic.job.Job"
        raise ConfigError(problem(TARGET, target, why, FIX_TARGET))
    missing_methods = sorted(getattr(found, "__abstractmethods__", ()))
    if missing_methods:
        why = f"{class_name} does not implement {', '.join(missing_methods)} of elastic.job.Job"
        fix = f"define {', '.join(m + '()' for m in missing_methods)} in {class_name}"
        raise ConfigError(problem(TARGET, target, why, fix))
    if not is_dataclass(found.Settings):
        why = f"{class_name}.Settings is not a dataclass"
        raise ConfigError(problem(TARGET, target, why, "declare Settings with @dataclass"))
    return found


def job_settings(cls: type[Job[Any]], section: dict[str, Any]) -> Any:
    """``job.*`` but ``_target_`` as an instance of ``cls.Settings``, its defaults filled in.

    Raises :class:`ConfigError` naming a key the job does not have, or a value of the wrong
    type."""
    given = {k: v for k, v in section.items() if k != "_target_"}
    schema = OmegaConf.structured(cls.Settings)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, given))
    except OmegaConfBaseException as exc:
        name = str(exc.key) if exc.key is not None else ""
        known = ", ".join(f"job.{k}" for k in schema) or "none"
        if isinstance(exc, ConfigKeyError):
            why = f"{cls.__name__} has no such setting"
            fix = f"drop it, or use a key {cls.__name__}.Settings declares ({known})"
        else:  # a value of the wrong type
            declared = OmegaConf.get_type(schema, name) if name in schema else None
            kind = getattr(declared, "__name__", "the declared type")
            why = f"is not of the type {cls.__name__}.Settings declares ({kind})"
            fix = f"set job.{name} to a value of type {kind}"
        raise ConfigError(problem(f"job.{name}", given.get(name), why, fix)) from exc


def resolve(cfg: Config) -> tuple[type[Job[Any]], Any]:
    """The job class ``cfg`` names and its settings; :class:`ConfigError` otherwise."""
    cls = job_class(cfg.job.get("_target_", ""))
    return cls, job_settings(cls, cfg.job)


def job_problems(cfg: Config) -> Iterator[str]:
    """Every problem of the ``job`` section: a rule of :func:`elastic.config.validate`."""
    try:
        cls, settings = resolve(cfg)
    except ConfigError as exc:
        yield str(exc)
        return
    yield from bound_problems(settings, "job.")
    yield from cls.problems(cfg, settings)


def build_job(cfg: Config, device: torch.device) -> Job[Any]:
    """A worker's job, from the configuration the launcher checked."""
    cls, settings = resolve(cfg)
    return cls(cfg, settings, device)


def prepare_job(cfg: Config) -> None:
    """The job's :meth:`~elastic.job.Job.prepare`: the launcher's, once, before any node starts."""
    cls, settings = resolve(cfg)
    cls.prepare(cfg, settings)
