"""Checking a whole configuration before anything starts, every problem at once.

First every range declared with :func:`~elastic.config.schema.bounded`, then each section's
rules (:mod:`elastic.config.job_rules`, :mod:`elastic.config.training_rules`) in the order of
the sections, then the rules a caller adds (the launcher adds the job's, which import its class,
and the etcd credentials, which are its alone). The ``data`` and ``model`` rules are the
ImageNet job's (:meth:`elastic.jobs.imagenet.ImageNetJob.problems`): another job's launch does
not check a data set and a model it does not read. One launch attempt shows everything to fix,
each with the key, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from elastic.config.job import Config
from elastic.config.job_rules import (
    chaos_problems,
    checkpoint_problems,
    cluster_problems,
    job_id_problems,
    notify_problems,
    rendezvous_problems,
)
from elastic.config.schema import ConfigError, bound_problems
from elastic.config.training_rules import comm_problems, optim_problems, parallel_problems

Rule = Callable[[Config], Iterable[str]]

RULES: tuple[Rule, ...] = (
    bound_problems,
    cluster_problems,
    job_id_problems,
    rendezvous_problems,
    optim_problems,
    comm_problems,
    parallel_problems,
    checkpoint_problems,
    chaos_problems,
    notify_problems,
)


def validate(cfg: Config, *more: Rule) -> None:
    """Raise :class:`ConfigError` listing every value that cannot work, each with its fix.

    The problems of :data:`RULES` come first, then those of ``more``."""
    problems = [p for rule in (*RULES, *more) for p in rule(cfg)]
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
