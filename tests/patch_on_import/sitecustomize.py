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
- ``$ELASTIC_TEST_GATE=path``: every rank, before each step, holds while the file says so
  (:class:`tests.conftest.Gate` writes it): ``end K``, within the job's last K steps; a number
  L, past step L; ``open`` or no file, never. A held rank says it waits for its peers (the
  watchdog does not take it for frozen), leaves as soon as its round is aborted, and goes on
  when a planned leave is due, so that a node can still leave between two steps. A test thus
  keeps a job from ending, however fast the machine, until what it waits for has happened.
"""

import builtins
import dataclasses
import os
import sys
import time

_DROP_AT = int(os.environ.get("ELASTIC_TEST_DROP_SAMPLE_AT", "0"))
_HOLD_STEP = int(os.environ.get("ELASTIC_TEST_HOLD_COMMIT_STEP", "0"))
_HOLD_PATH = os.environ.get("ELASTIC_TEST_HOLD_FILE", "")
_GATE_PATH = os.environ.get("ELASTIC_TEST_GATE", "")
_HOLD_S = 120.0  # bounded: a test that never starts the joiner fails on its own timeout
_GATE_S = 300.0  # bounded too: past it, a held rank trains on (the test has failed by then)
_POLL_S = 0.05
_import = builtins.__import__
_pending = []  # (module name, the attribute it must hold, the patch to apply to the module)
# This worker's DDP hook (its communicator says whether the round was left), whether it is held
# now, and the error that leaves a round.
_gate = {"hook": None, "held": False, "aborted": RuntimeError}
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


def _hold_the_commit(checkpoint_save: object) -> None:
    commit = checkpoint_save.CheckpointWriter.commit  # type: ignore[attr-defined]

    def holding(self, written, meta, guard=checkpoint_save.UNGUARDED):  # type: ignore[no-untyped-def,attr-defined]
        if written.step != _HOLD_STEP or os.path.exists(_HOLD_PATH):
            return commit(self, written, meta, guard)
        with open(_HOLD_PATH, "w") as f:
            f.write("held\n")
        deadline = time.monotonic() + _HOLD_S
        while not guard.abandoned and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return commit(self, written, meta, guard)  # raises SaveAbandoned once abandoned

    checkpoint_save.CheckpointWriter.commit = holding  # type: ignore[attr-defined]


def _gate_closed(step: int, left: int, size: int) -> bool:
    """Whether the gate file holds back ``step``, with ``left`` samples left before it and
    ``size`` in a step."""
    try:
        with open(_GATE_PATH) as f:
            words = f.read().split()
    except FileNotFoundError:
        return False
    if not words or words[0] == "open":
        return False
    if words[0] == "end":
        return left <= int(words[1]) * size
    return step > int(words[0])


def _hold(step: int, left: int, size: int, w: object) -> None:
    """Hold this rank before ``step`` while the gate is closed (at most :data:`_GATE_S`),
    saying meanwhile that it waits for its peers; :class:`RoundAborted` once its round is."""
    if not _gate_closed(step, left, size):
        return
    hook = _gate["hook"]
    deadline = time.monotonic() + _GATE_S
    _gate["held"] = True
    try:
        while _gate_closed(step, left, size) and time.monotonic() < deadline:
            if hook is not None and hook.comm.aborted:
                raise _gate["aborted"]("a new round was announced while held at the gate")
            if w.link._switch is not None:  # type: ignore[attr-defined]  # a planned leave
                return  # the steps it needs go through
            time.sleep(_POLL_S)
    finally:
        _gate["held"] = False


def _hold_at_the_gate(sampler: object) -> None:
    plan = sampler.ElasticSampler.plan  # type: ignore[attr-defined]

    def holding(self, state, rank, world_size, limit, global_batch=0):  # type: ignore[no-untyped-def]
        caller = sys._getframe(1)
        if caller.f_code.co_name == "train_steps":  # the step about to be trained, not prefetched
            step = caller.f_locals["progress"].step + 1
            _hold(step, limit, global_batch or world_size * self.batch_size, caller.f_locals["w"])
        return plan(self, state, rank, world_size, limit, global_batch)

    sampler.ElasticSampler.plan = holding  # type: ignore[attr-defined]


def _watch_the_hook(ddp_hook: object) -> None:
    cls = ddp_hook.DDPHook  # type: ignore[attr-defined]
    init, waiting = cls.__init__, cls.waiting_for_peers
    _gate["aborted"] = ddp_hook.RoundAborted  # type: ignore[attr-defined]

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        _gate["hook"] = self

    cls.__init__ = recording
    cls.waiting_for_peers = property(lambda self: _gate["held"] or waiting.fget(self))


def _importing(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
    module = _import(name, globals, locals, fromlist, level)
    for entry in list(_pending):
        target, attribute, patch = entry
        if hasattr(sys.modules.get(target), attribute):  # imported far enough to patch, once
            _pending.remove(entry)
            patch(sys.modules[target])
    return module


if _DROP_AT:
    _pending.append(("elastic.sampler", "ElasticSampler", _drop_a_sample))
if _HOLD_STEP and _HOLD_PATH:
    _pending.append(("elastic.checkpoint_save", "CheckpointWriter", _hold_the_commit))
if _GATE_PATH:
    _pending.append(("elastic.ddp_hook", "DDPHook", _watch_the_hook))
    _pending.append(("elastic.sampler", "ElasticSampler", _hold_at_the_gate))
if _pending:
    builtins.__import__ = _importing
