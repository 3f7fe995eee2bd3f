"""Test hook, loaded by every Python process started with this folder on ``PYTHONPATH``: the
wall clock (``time.time``) that this project's modules see runs ahead or behind by the seconds
written in the file ``$ELASTIC_TEST_CLOCK_SKEW_FILE``, re-read as the test changes it.

It steps the clock of one simulated node (its agent and workers) in the middle of a run, as NTP
or an operator stepping a machine's clock would. Stepping the real clock would step it for every
node on this machine and for the test itself. Only the project's modules (``elastic``,
``launcher``, ``chaos``) see the step: libraries such as gRPC turn ``time.time()`` into a deadline
for C code that reads the real clock, so stepping it for them alone would break what a real
step, seen by both, does not. The monotonic clock, which the fencing, the lease and the
watchdogs measure durations on, does not move on a real machine either.
"""

import builtins
import os
import time
import types

PACKAGES = ("elastic", "launcher", "chaos")
_PATH = os.environ.get("ELASTIC_TEST_CLOCK_SKEW_FILE")
_REREAD_S = 0.05
_skew = {"offset": 0.0, "next_read": 0.0}


def _stepped_time() -> float:
    now = time.monotonic()
    if now >= _skew["next_read"]:
        _skew["next_read"] = now + _REREAD_S
        try:
            with open(_PATH or "", encoding="utf-8") as f:
                _skew["offset"] = float(f.read() or 0)
        except (OSError, ValueError):
            pass  # being rewritten: keep the last offset
    return time.time() + _skew["offset"]


class _SteppedTime(types.ModuleType):
    """The ``time`` module, with a stepped ``time()``."""

    def __getattr__(self, name: str) -> object:
        return _stepped_time if name == "time" else getattr(time, name)


def _in_project(namespace: dict | None) -> bool:  # type: ignore[type-arg]
    spec = (namespace or {}).get("__spec__")
    name = spec.name if spec is not None else (namespace or {}).get("__name__", "")
    return name.split(".")[0] in PACKAGES


_import = builtins.__import__


def _import_stepped(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
    """``import time`` in a module of the project (``python -m launcher.agent`` included)."""
    module = _import(name, globals, locals, fromlist, level)
    if name == "time" and level == 0 and not fromlist and _in_project(globals):
        return _STEPPED
    return module


_STEPPED = _SteppedTime("time")
if _PATH:
    builtins.__import__ = _import_stepped
