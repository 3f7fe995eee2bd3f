"""Test hook, loaded by every Python process started with this folder on ``PYTHONPATH``: rank 0
holds the commit of the checkpoint of step ``$ELASTIC_TEST_HOLD_COMMIT_STEP`` (the last one)
until its round is left, and the save is then abandoned, as when a new round comes while the
last checkpoint is written. The file ``$ELASTIC_TEST_HOLD_FILE`` says that it held (once). Its
peers meanwhile have trained the same last step, so a node started then joins the job at its
very end.
"""

import builtins
import os
import sys
import time

_STEP = int(os.environ.get("ELASTIC_TEST_HOLD_COMMIT_STEP", "0"))
_PATH = os.environ.get("ELASTIC_TEST_HOLD_FILE", "")
_HOLD_S = 120.0  # bounded: a test that never starts the joiner fails on its own timeout
_POLL_S = 0.05
_import = builtins.__import__
_state = {"patched": False}


def _patch(checkpoint: object) -> None:
    commit = checkpoint.CheckpointManager.commit  # type: ignore[attr-defined]

    def holding(self, written, meta, guard=checkpoint.UNGUARDED):  # type: ignore[no-untyped-def,attr-defined]
        if written.step != _STEP or os.path.exists(_PATH):
            return commit(self, written, meta, guard)
        with open(_PATH, "w") as f:
            f.write("held\n")
        deadline = time.monotonic() + _HOLD_S
        while not guard.abandoned and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return commit(self, written, meta, guard)  # raises SaveAbandoned once abandoned

    checkpoint.CheckpointManager.commit = holding  # type: ignore[attr-defined]


def _importing(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
    module = _import(name, globals, locals, fromlist, level)
    loaded = sys.modules.get("elastic.checkpoint")
    if not _state["patched"] and hasattr(loaded, "CheckpointManager"):
        _state["patched"] = True
        _patch(loaded)
    return module


if _STEP and _PATH:
    builtins.__import__ = _importing
