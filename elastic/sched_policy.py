"""Run what is not training beside it without taking its cores: Linux's ``SCHED_BATCH``.

On two shared cores each training loop of ours lost its core about 400 times a second, against
225 in plain DDP: every wake-up of the launcher, an agent, etcd or a helper thread of the worker
preempted it (docs/benchmarks.md, "Who takes the training loop's core"). A ``SCHED_BATCH`` task
keeps its fair share of the CPU, but when it wakes it does not preempt the task running: it
waits for that task's slice to end, a few milliseconds, sooner than anything of ours needs.
A thread or process started from a ``SCHED_BATCH`` thread inherits the policy.

``cluster.yield_to_training`` turns it on (the default). Where the policy does not exist (not
Linux) or the call is refused (a seccomp profile), everything runs as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

AVAILABLE = hasattr(os, "SCHED_BATCH")
_yielding = {"on": False}  # process-wide: whether this worker's helper threads yield


def _set(policy: int) -> None:
    """Give the calling thread ``policy`` (its nice value stays)."""
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        log.debug("scheduling policy %d not set: %s", policy, exc)


def yield_to_training() -> None:
    """This thread, and the threads and processes it starts from now on, yield to training."""
    if AVAILABLE:
        _set(os.SCHED_BATCH)


def train_in_foreground(yield_helpers: bool) -> None:
    """A worker's main thread, at its start: it trains at the default policy.

    Its agent yields (:func:`yield_to_training`), and a process inherits its parent's policy.
    With ``yield_helpers``, the threads made by :func:`helper_thread` and inside
    :func:`helpers_yield` yield."""
    _yielding["on"] = yield_helpers and AVAILABLE
    if _yielding["on"]:
        _set(os.SCHED_OTHER)


def helper_thread(
    target: Callable[..., object], name: str, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """A daemon thread (not started) that runs ``target(*args)`` beside the training loop.

    It yields to training when the worker's helpers do (:func:`train_in_foreground`)."""
    yields = _yielding["on"]

    def run() -> None:
        if yields:
            _set(os.SCHED_BATCH)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


@contextlib.contextmanager
def helpers_yield() -> Iterator[None]:
    """The threads a library starts inside this block (gloo's) yield, as :func:`helper_thread`'s.

    The calling thread yields meanwhile, and gets its policy back at the end."""
    if not _yielding["on"]:
        yield
        return
    before = os.sched_getscheduler(0)
    _set(os.SCHED_BATCH)
    try:
        yield
    finally:
        _set(before)
