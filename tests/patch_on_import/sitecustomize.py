"""Test hooks, loaded by every Python process started with this folder on ``PYTHONPATH``. Each
patches one class of the project once its module is imported, and only when its environment
says so:

- ``$ELASTIC_TEST_DROP_SAMPLE_AT=N``: rank 0 records the first sample of its N-th step as its
  second (the plan the trainer records, not the one its data loader prefetched), so that the
  run's record trains one sample twice and another never. A campaign run with it must fail its
  samples invariant and say so: the verdict has to be able to fail.
- ``$ELASTIC_TEST_HOLD_COMMIT_STEP=S`` and ``$ELASTIC_TEST_HOLD_FILE=path``: rank 0 holds the
  commit of the checkpoint of step S (the last one) until its round is left, and the save is then
  abandoned, as when a new round comes while the last checkpoint is written. The file says that
  it held (once). Its peers meanwhile have trained the same last step, so a node started then
  joins the job at its very end.
"""

import builtins
import dataclasses
import os
import sys
import time

_DROP_AT = int(os.environ.get("ELASTIC_TEST_DROP_SAMPLE_AT", "0"))
_HOLD_STEP = int(os.environ.get("ELASTIC_TEST_HOLD_COMMIT_STEP", "0"))
_HOLD_PATH = os.environ.get("ELASTIC_TEST_HOLD_FILE", "")
_HOLD_S = 120.0  # bounded: a test that never starts the joiner fails on its own timeout
_POLL_S = 0.05
_import = builtins.__import__
_pending = {}  # module name -> (the class it must hold, the patch to apply to the module)
_drops = {"calls": 0}


def _drop_a_sample(sampler: object) -> None:
    plan = sampler.ElasticSampler.plan  # type: ignore[attr-defined]

    def dropping(self, state, rank, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = plan(self, state, rank, *args, **kwargs)
        if rank == 0 and sys._getframe(1).f_code.co_name != "batches":  # the trainer's record
            _drops["calls"] += 1
            if _drops["calls"] == _DROP_AT and result.real > 1:
                indices = (result.indices[1], *result.indices[1:])
                return dataclasses.replace(result, indices=indices)
        return result

    sampler.ElasticSampler.plan = dropping  # type: ignore[attr-defined]


def _hold_the_commit(checkpoint: object) -> None:
    commit = checkpoint.CheckpointManager.commit  # type: ignore[attr-defined]

    def holding(self, written, meta, guard=checkpoint.UNGUARDED):  # type: ignore[no-untyped-def,attr-defined]
        if written.step != _HOLD_STEP or os.path.exists(_HOLD_PATH):
            return commit(self, written, meta, guard)
        with open(_HOLD_PATH, "w") as f:
            f.write("held\n")
        deadline = time.monotonic() + _HOLD_S
        while not guard.abandoned and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return commit(self, written, meta, guard)  # raises SaveAbandoned once abandoned

    checkpoint.CheckpointManager.commit = holding  # type: ignore[attr-defined]


def _importing(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
    module = _import(name, globals, locals, fromlist, level)
    for target, (cls, patch) in list(_pending.items()):
        if hasattr(sys.modules.get(target), cls):  # imported far enough to patch, once
            del _pending[target]
            patch(sys.modules[target])
    return module


if _DROP_AT:
    _pending["elastic.sampler"] = ("ElasticSampler", _drop_a_sample)
if _HOLD_STEP and _HOLD_PATH:
    _pending["elastic.checkpoint"] = ("CheckpointManager", _hold_the_commit)
if _pending:
    builtins.__import__ = _importing
