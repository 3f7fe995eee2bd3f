"""Why a worker's round ended, told from structure, never from an error's text.

A round ends because the agent moved the worker on (:class:`RoundAborted`), because a collective
of the round failed (:class:`CollectiveFailure`, which :class:`elastic.communicator.Communicator`
records as it happens), or because of the worker's own fault; a fault of the device itself is
the worker's own whatever else happened, since only a new process recovers from it. The agent
acts on the answer (:func:`round_end`): move on, evict the lost peer, or strike this node.
:func:`release` frees what the exception of a broken round holds.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from enum import Enum

import torch


class RoundAborted(RuntimeError):
    """The agent moved this worker out of its round (a new round was formed, or standby)."""


class RoundEnd(Enum):
    """Why a worker's round ended before the job was trained."""

    LEFT = "left"  # the agent moved it to a newer round, or to standby
    PEER_LOST = "peer_lost"  # a collective of the round failed: a peer died or the group broke
    LOCAL_FAULT = "local_fault"  # neither: the worker's own fault


@dataclass(frozen=True)
class CollectiveFailure:
    """A collective of the current round that failed: a peer died or the group broke."""

    what: str  # which collective: "gradient all-reduce", "group set-up", "state sync", ...
    error: str  # the exception, as the transport reported it (for people, never parsed)

    @classmethod
    def of(cls, what: str, exc: BaseException) -> CollectiveFailure:
        """The failure of collective ``what`` with ``exc``, its text cut to 300 characters."""
        return cls(what, f"{type(exc).__name__}: {exc}"[:300])

    def __str__(self) -> str:
        return f"the {self.what} failed ({self.error})"


def is_device_fault(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised from, an error of the device itself.

    That is torch's ``AcceleratorError``: a device-side assert, an illegal address. CUDA keeps
    such an error in the process's context, so every later call fails too: only a new process
    recovers."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.AcceleratorError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def release(error: BaseException) -> None:
    """Let go of the frames that ``error`` (and the exceptions it was raised from) hold.

    A collective that failed or was aborted under
    :meth:`elastic.communicator.Communicator.all_reduce` (an evaluation, the state sync, a
    barrier) raises the exception its future keeps:
    ``torch.futures.Future.set_exception`` stores the object and raises that same object at
    every wait, so the traceback it gathers on its way up holds every frame of the round: the
    DDP instance, its reducer and gradient buckets, the process group with its threads,
    sockets and store connection. The future holds the exception from C++, where Python's
    collector cannot see the cycle (frame, work, future, exception, traceback, frame), so
    nothing of such a round was ever freed: 3 threads, 5 descriptors and about 40 MB
    (ResNet-18) for each round a killed peer broke in an evaluation. Called once the round's end
    is recorded."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # the executing ones are left alone
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def round_end(
    aborted: bool, failure: CollectiveFailure | None, error: BaseException | None = None
) -> RoundEnd:
    """Why a round ended with ``error``, from its type and what the communicator recorded.

    A device fault is local whatever else happened (the worker must be replaced, its node
    struck). Then comes the agent's abort (the failure it causes is expected), then a failed
    collective. Anything else is local."""
    if is_device_fault(error):
        return RoundEnd.LOCAL_FAULT
    if aborted:
        return RoundEnd.LEFT
    if failure is not None:
        return RoundEnd.PEER_LOST
    return RoundEnd.LOCAL_FAULT
