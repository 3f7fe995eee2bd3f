"""Test hook, loaded by every Python process started with this folder on ``PYTHONPATH``: rank 0,
having trained the last step, holds before its end (in the wait for its last save) and writes
the file ``$ELASTIC_TEST_HOLD_END_FILE``; when the agent then moves it to a newer round, it
leaves its round as if the save were still being written. Its peers meanwhile have trained the
same last step, so a node started then joins the job at its very end.
"""

import builtins
import os
import sys
import time

_PATH = os.environ.get("ELASTIC_TEST_HOLD_END_FILE", "")
_HOLD_S = 120.0  # bounded: a test that never starts the joiner fails on its own timeout
_POLL_S = 0.05
_import = builtins.__import__
_state = {"patched": False}


def _patch(saver_module: object, communicator: object) -> None:
    wait = saver_module.BackgroundSaver.wait  # type: ignore[attr-defined]

    def holding(self, aborted):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        if dist.get_rank() != 0 or os.path.exists(_PATH):
            return wait(self, aborted)
        with open(_PATH, "w") as f:
            f.write("holding\n")
        deadline = time.monotonic() + _HOLD_S
        while not aborted() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        raise communicator.RoundAborted("the round was left while the last save was written")  # type: ignore[attr-defined]

    saver_module.BackgroundSaver.wait = holding  # type: ignore[attr-defined]


def _importing(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
    module = _import(name, globals, locals, fromlist, level)
    saver = sys.modules.get("elastic.async_checkpoint")
    communicator = sys.modules.get("elastic.communicator")
    if not _state["patched"] and hasattr(saver, "BackgroundSaver") and communicator is not None:
        _state["patched"] = True
        _patch(saver, communicator)
    return module


if _PATH:
    builtins.__import__ = _importing
