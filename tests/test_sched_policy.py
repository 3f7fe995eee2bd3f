"""What yields to training: helper threads, and threads a library starts inside
``helpers_yield``; the training thread keeps the default policy (real threads, real policies)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from elastic import sched_policy

pytestmark = pytest.mark.skipif(not sched_policy.AVAILABLE, reason="no SCHED_BATCH here (Linux)")


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    """Each test leaves this thread, and the module's switch, as it found them."""
    before, on = os.sched_getscheduler(0), sched_policy._yielding["on"]
    yield
    os.sched_setscheduler(0, before, os.sched_param(0))
    sched_policy._yielding["on"] = on


def policy_of_thread(start: object) -> int:
    """The policy a thread has when it runs, the thread made by ``start(target)``."""
    seen: list[int] = []
    thread = start(lambda: seen.append(os.sched_getscheduler(0)))  # type: ignore[operator]
    thread.join(10)
    return seen[0]


def test_a_worker_trains_at_the_default_policy_and_its_helpers_yield() -> None:
    sched_policy.yield_to_training()  # as the agent that started the worker
    sched_policy.train_in_foreground(yield_helpers=True)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER

    def helper(target):  # type: ignore[no-untyped-def]
        thread = sched_policy.helper_thread(target, "helper")
        thread.start()
        return thread

    assert policy_of_thread(helper) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own is untouched


def test_threads_a_library_starts_inside_the_block_yield_and_the_caller_gets_its_policy_back() -> (
    None
):
    sched_policy.train_in_foreground(yield_helpers=True)

    def library(target):  # type: ignore[no-untyped-def]
        with sched_policy.helpers_yield():
            thread = threading.Thread(target=target)  # as gloo's threads, started inside
            thread.start()
        return thread

    assert policy_of_thread(library) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_turned_off_nothing_changes_policy() -> None:
    sched_policy.yield_to_training()  # e.g. the user ran the whole job under chrt -b
    sched_policy.train_in_foreground(yield_helpers=False)
    assert os.sched_getscheduler(0) == os.SCHED_BATCH  # left as the user set it

    def helper(target):  # type: ignore[no-untyped-def]
        thread = sched_policy.helper_thread(target, "helper")
        thread.start()
        return thread

    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    assert policy_of_thread(helper) == os.SCHED_OTHER
