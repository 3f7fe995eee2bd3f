"""Process groups whose collectives a thread can abandon at once, for FSDP2 on gloo.

FSDP2 issues its own collectives (all-gather in forward, reduce-scatter and the HSDP all-reduce
in backward) and waits on them on the training thread. On gloo nothing ends such a wait early:
neither ``ProcessGroup.abort()`` nor ``.shutdown()`` from another thread unblocks a collective
that a frozen peer never joins (torch 2.14), so the step would hang until the group's timeout.

An :class:`AbortableGroup` is a Python ``ProcessGroup`` over a real gloo backend. Each collective
runs on the backend, asynchronously; the caller gets an :class:`AbortableWork` whose wait ends
when the backend's work does, or raises :class:`elastic.round_end.RoundAborted` as soon as
:meth:`AbortableGroup.abort` is called from any thread. The backend's work is left to end on its
own: :meth:`AbortableGroup.in_flight` is what a reaper waits for before it shuts the group down
(:mod:`elastic.group_reaper`).

On CUDA tensors (gloo as a test aid on one GPU, ``comm.backend=gloo``) gloo copies the inputs to
host memory on streams of its own that wait for the caller's, and copies the result back on
others; what it leaves on the waiting thread's stream is made to precede the caller's next work
by an event (:meth:`AbortableWork.wait`), as NCCL's works do on a stream.

The groups are made by torch itself, as a backend registered under :data:`BACKEND`, so that they
are in torch's tables (group ranks, names) that DeviceMesh, DTensor and FSDP2 resolve them from:
``init_device_mesh(..., backend_override=...)`` (:func:`build_abortable_mesh`) makes every dim of
a mesh abortable, and :class:`RoundMesh` abandons every collective on it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic import gloo_device
from elastic.round_end import CollectiveFailure, RoundAborted

BACKEND = "abortable_gloo"  # the name torch knows the backend by (dist.Backend.register_backend)

# Every collective a ProcessGroup offers that returns a Work, under the names torch's Python
# collectives (dist.all_reduce, dist.all_gather_single, ...) and its C++ trampoline call them.
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "all_gather_single",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
)

# Coalesced collectives that torch's C++ side may call on this group, but that the gloo
# backend's Python binding lacks (both in torch 2.14; torch 2.11, the GPU machine's, calls the
# all-gather for DTensor's full_tensor): run as their base collective, once per tensor pair.
PER_PAIR = {
    "allgather_into_tensor_coalesced": "_allgather_base",
    "reduce_scatter_tensor_coalesced": "_reduce_scatter_base",
}


class AbortableWork(dist.Work):
    """A collective in flight on an :class:`AbortableGroup`.

    It ends with the backend's work, or fails with :class:`RoundAborted` when the group is
    aborted, whichever comes first."""

    def __init__(
        self,
        future: torch.futures.Future[Any],
        blocked: Callable[[float], None] = lambda seconds: None,
        ready: Callable[[], torch.cuda.Event | None] = lambda: None,
    ) -> None:
        super().__init__()
        self._future = future
        self._blocked = blocked  # told how long each wait blocked its caller
        self._ready = ready  # on CUDA: reached once the result is in place on the device

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the collective, raising its error or the abort's.

        ``timeout`` is not applied here: the backend's work fails at the group's own timeout,
        and this wait with it. On CUDA the caller's current stream then waits for the result's
        copy back to the device, as it would for an NCCL work's."""
        began = time.perf_counter()
        try:
            self._future.wait()
        finally:
            self._blocked(time.perf_counter() - began)
        if (ready := self._ready()) is not None:
            ready.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future that completes (with None) or fails as :meth:`wait` returns or raises."""
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


@dataclass
class _Launched:
    """A collective begun on the backend, as the group's waiter thread sees it."""

    work: dist.Work  # the backend's
    ours: torch.futures.Future[Any]  # what the caller's AbortableWork waits for
    end: torch.futures.Future[None]  # done when ``work`` ends, however (in_flight)
    device: torch.device | None = None  # the CUDA device of its tensors; None on the CPU
    ready: torch.cuda.Event | None = None  # CUDA: recorded after the work's copies back


class AbortableGroup(dist.ProcessGroup):
    """A gloo process group whose collectives fail at once on :meth:`abort`, from any thread.

    The backend's works are waited for on a thread of the group's, in launch order: gloo's
    ``reduce_scatter_single`` work, which FSDP2's backward uses, has no future to be told by
    (``Work::getFuture not implemented``, torch 2.14). Every rank enters a group's collectives
    in launch order, so none can end before those begun ahead of it could: waiting in that
    order tells a work late only by what gloo's worker threads reorder."""

    def __init__(self, backend: dist.ProcessGroupGloo, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._backend = backend
        self._lock = threading.Lock()
        self._reason: str | None = None  # set by abort()
        self._pending: list[_Launched] = []  # ours not yet completed
        # One per backend work the waiter has not seen end: done once it has (in_flight).
        self._ends: list[torch.futures.Future[None]] = []
        self._queue: queue.SimpleQueue[_Launched | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None  # started with the first collective
        self._name: str | None = None  # torch's name for the group (_set_group_name)
        self.failure: Exception | None = None  # the first of the backend's works to fail
        # Seconds callers spent blocked in waits on this group's collectives: time a rank
        # waited for its peers, which is not its own compute (elastic.step_timing).
        self.blocked_s = 0.0

    # torch keeps a group's name on its backends, and this group has none of torch's (a
    # backend registered on it would be what torch's C++ collectives use, not abortable):
    # the name is kept here, as torch names the group in new_group.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        if self._name is None:
            raise RuntimeError("the AbortableGroup was not made by torch's new_group")
        return self._name

    def abort(self, reason: str = "the process group was aborted") -> None:
        """Fail every collective in flight, and every later one, with :class:`RoundAborted`.

        Callable from any thread. The backend's works keep running until they end (a frozen
        peer's: at the group's timeout); :meth:`in_flight` lists them."""
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            pending, self._pending = self._pending, []
            self._queue.put(None)  # the waiter ends after the works in flight: no more come
        for launched in pending:
            # One the backend has ended is the waiter's to complete: failed here, a worker
            # whose peer saw it succeed would end its step one short of the peer's.
            if not launched.ours.done() and not launched.work.is_completed():
                launched.ours.set_exception(RoundAborted(f"collective abandoned: {reason}"))

    def in_flight(self) -> list[dist.Work]:
        """A work per backend work not yet ended: shut the group down only once they have.

        Each completes (never fails) as the backend's work ends, and says so in
        ``is_completed()``, which gloo's own ``reduce_scatter_single`` work never does: a reaper
        polling the backend's works would wait for it forever (:mod:`elastic.group_reaper`)."""
        with self._lock:
            return [AbortableWork(end) for end in self._ends]

    def shutdown(self) -> None:
        """Shut the backend down (torch's ``destroy_process_group`` does); aborts first.

        With works still in flight (:meth:`in_flight`) a gloo shutdown may crash the process:
        wait for them first, as :mod:`elastic.group_reaper` does."""
        self.abort("the process group was shut down")
        self._backend.shutdown()

    def _launch(self, name: str, *args: Any, **kwargs: Any) -> AbortableWork:
        """Start collective ``name`` on the backend and hand back its abortable work.

        Under the lock: :meth:`abort` sees every collective begun before it, and none begins
        after it (one begun on a group its peers left would only wait for the timeout)."""
        with self._lock:
            if self._reason is not None:
                raise RoundAborted(f"{name} on an aborted group: {self._reason}")
            work = start(self._backend, name, args, kwargs)
            device = cuda_device(args)
            launched = _Launched(work, torch.futures.Future(), torch.futures.Future(), device)
            self._pending = [p for p in self._pending if not p.ours.done()]
            self._pending.append(launched)
            self._ends.append(launched.end)
            if self._waiter is None:
                self._waiter = threading.Thread(
                    target=self._wait_all, name=f"abortable-{self._name}", daemon=True
                )
                self._waiter.start()
            self._queue.put(launched)
        return AbortableWork(launched.ours, self._add_blocked, lambda: launched.ready)

    def _add_blocked(self, seconds: float) -> None:
        with self._lock:
            self.blocked_s += seconds

    def _wait_all(self) -> None:
        """Complete each of our futures as the backend's work ends, unless aborted first."""
        while (launched := self._queue.get()) is not None:
            ours = launched.ours
            try:
                self._wait_for(launched)
            except Exception as exc:  # the backend's own failure: a peer died, a timeout
                # Without its traceback, whose frames would hold this thread's last work.
                error: Exception | None = exc.with_traceback(None)
            else:
                error = None
            with self._lock:
                self._ends.remove(launched.end)
                launched.end.set_result(None)
                self.failure = self.failure or error
                if ours.done():
                    continue  # abort() failed it
                if error is None:
                    ours.set_result(None)
                else:
                    ours.set_exception(error)

    @staticmethod
    def _wait_for(launched: _Launched) -> None:
        """Wait for the backend's work to end; on CUDA, record the event the caller waits on.

        A gloo work on CUDA tensors ends by making this thread's current stream wait for its
        copies back to the device (a reduce-scatter also copies its share out on it): the event
        recorded after that is what the caller's stream must wait for."""
        if launched.device is None:
            launched.work.wait()  # releases the GIL
            return
        with torch.cuda.device(launched.device):
            launched.work.wait()
            ready = torch.cuda.Event()
            ready.record()
            launched.ready = ready


def start(backend: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dist.Work:
    """Begin collective ``name`` on ``backend``: its own, or per tensor pair (:data:`PER_PAIR`)."""
    if name not in PER_PAIR or hasattr(backend, name):  # a dict lookup first: every collective
        return getattr(backend, name)(*args, **kwargs)
    outputs, inputs, *options = args
    base = getattr(backend, PER_PAIR[name])
    return Works([base(o, i, *options, **kwargs) for o, i in zip(outputs, inputs, strict=True)])


class Works(dist.Work):
    """Several of the backend's works as one, which ends once all of them have."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def cuda_device(args: tuple[Any, ...]) -> torch.device | None:
    """The device of a collective's first tensor (in its arguments, lists included) if CUDA."""
    tensor = next(_tensors(args), None)
    return tensor.device if tensor is not None and tensor.is_cuda else None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _forward(name: str) -> Callable[..., AbortableWork]:
    def collective(self: AbortableGroup, *args: Any, **kwargs: Any) -> AbortableWork:
        return self._launch(name, *args, **kwargs)

    collective.__name__ = name
    collective.__doc__ = f"``{name}`` on the gloo backend, abortable (:meth:`_launch`)."
    return collective


for _name in COLLECTIVES:
    setattr(AbortableGroup, _name, _forward(_name))


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> AbortableGroup:
    """torch's backend creator: gloo on the group's own prefixed store and the process's device."""
    return AbortableGroup(gloo_device.create(store, rank, size, timeout), rank, size)


def register() -> None:
    """Make :data:`BACKEND` a backend name torch can create groups of; again is harmless."""
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def build_abortable_mesh(
    shape: tuple[int, ...], mesh_dim_names: tuple[str, ...], device_type: str = "cpu"
) -> DeviceMesh:
    """A mesh over the default group whose every dim is an :class:`AbortableGroup`.

    A collective of every rank, as ``init_device_mesh`` is; the default group itself stays
    plain gloo. ``device_type``: where the tensors are (gloo on CUDA: a test aid)."""
    register()
    return init_device_mesh(
        device_type,
        shape,
        mesh_dim_names=mesh_dim_names,
        backend_override=dict.fromkeys(mesh_dim_names, BACKEND),
    )


def mesh_groups(mesh: DeviceMesh) -> list[AbortableGroup]:
    """This rank's group of each dim of ``mesh``; an error names a dim that is not abortable."""
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    for dim, group in enumerate(groups):
        if not isinstance(group, AbortableGroup):
            raise TypeError(
                f"mesh dim {dim} is a {type(group).__name__}, not an AbortableGroup: build the "
                f"mesh with build_abortable_mesh"
            )
    return groups  # type: ignore[return-value]


class RoundMesh:
    """The abortable groups of a round's mesh, as the round's communicator keeps them.

    They are aborted with the round, the first failure of their collectives is the round's, and
    they are retired with its group (:meth:`elastic.communicator.Communicator.close`)."""

    def __init__(self) -> None:
        self._groups: list[AbortableGroup] = []

    def adopt(self, mesh: DeviceMesh) -> None:
        """Make ``mesh``'s groups this round's; an error names a dim that is not abortable."""
        self._groups = mesh_groups(mesh)

    def abort(self, reason: str) -> None:
        """Fail every collective in flight on the mesh, and every later one; from any thread."""
        for group in self._groups:
            group.abort(reason)

    def failure(self) -> CollectiveFailure | None:
        """The first collective on the mesh that failed (a peer died), if one did."""
        error = next((g.failure for g in self._groups if g.failure is not None), None)
        if error is None:
            return None
        return CollectiveFailure.of("sharded collective", error)

    def blocked_s(self) -> float:
        """Seconds this rank has waited on the round's mesh collectives, summed over its groups."""
        return sum(group.blocked_s for group in self._groups)

    def retire(self) -> list[dist.Work]:
        """Let go of the groups; what of theirs is still in flight, for the group reaper."""
        groups, self._groups = self._groups, []
        return [work for group in groups for work in group.in_flight()]
