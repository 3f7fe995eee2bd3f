"""Test hook, loaded by every Python process started with this folder on ``PYTHONPATH``: rank 0
records the first sample of its ``$ELASTIC_TEST_DROP_SAMPLE_AT``-th step as its second (the
plan the trainer records, not the one its data loader prefetched), so that the run's record
trains one sample twice and another never. A campaign run with it must fail
its samples invariant and say so: the verdict has to be able to fail.
"""

import builtins
import dataclasses
import os
import sys

_AT = int(os.environ.get("ELASTIC_TEST_DROP_SAMPLE_AT", "0"))
_import = builtins.__import__
_state = {"patched": False, "calls": 0}


def _patch(sampler: object) -> None:
    plan = sampler.ElasticSampler.plan  # type: ignore[attr-defined]

    def dropping(self, state, rank, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = plan(self, state, rank, *args, **kwargs)
        if rank == 0 and sys._getframe(1).f_code.co_name != "batches":  # the trainer's record
            _state["calls"] += 1
            if _state["calls"] == _AT and result.real > 1:
                indices = (result.indices[1], *result.indices[1:])
                return dataclasses.replace(result, indices=indices)
        return result

    sampler.ElasticSampler.plan = dropping  # type: ignore[attr-defined]


def _importing(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
    module = _import(name, globals, locals, fromlist, level)
    loaded = sys.modules.get("elastic.sampler")
    if not _state["patched"] and hasattr(loaded, "ElasticSampler"):
        _state["patched"] = True
        _patch(loaded)
    return module


if _AT:
    builtins.__import__ = _importing
