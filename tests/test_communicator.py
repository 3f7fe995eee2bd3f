"""The communicator's round bookkeeping: which aborts apply, when backward waits on peers (the
DDP hook's count), and which failures it records.

Mostly pure logic; one test builds a real two-rank gloo group and loses a peer at each point of
a step where DDP talks to it.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

from elastic import gloo_device
from elastic.communicator import Communicator
from elastic.control import Assignment
from elastic.ddp_hook import DDPHook
from elastic.group_setup import init_group
from elastic.nccl_group import REBUILD, SHRINK, agreed_to_shrink, can_shrink, must_abort
from elastic.nccl_settings import (
    ERROR_HANDLING,
    NO_FAILURE_DUMP,
    NONBLOCKING_TIMEOUT,
    apply,
    survivor_settings,
)
from elastic.round_end import (
    CollectiveFailure,
    RoundAborted,
    RoundEnd,
    is_device_fault,
    release,
    round_end,
)
from tests.conftest import served_store


def assignment(number: int) -> Assignment:
    return Assignment(
        round=number, rank=0, world_size=2, store_host="127.0.0.1", store_port=1, formed_at=0.0
    )


def comm() -> Communicator:
    return Communicator(torch.device("cpu"), timeout_s=5)


def test_an_announcement_of_the_round_already_entered_does_not_abort_it() -> None:
    c = comm()
    c.assignment = assignment(2)  # the training thread entered round 2 before the reader got here
    c.abort("round 2 was formed", before_round=2)
    assert not c.aborted


def test_an_announcement_of_a_newer_round_aborts_the_current_one() -> None:
    c = comm()
    c.assignment = assignment(2)
    c.abort("round 3 was formed", before_round=3)
    assert c.aborted


def test_entering_a_round_older_than_the_announced_one_is_refused() -> None:
    c = comm()
    c.abort("round 3 was formed", before_round=3)
    with pytest.raises(RoundAborted, match="round 3"):
        c.enter(assignment(2))  # refused before any group is built


def test_in_a_rounds_first_step_any_bucket_handed_over_counts_as_waiting() -> None:
    h = DDPHook(comm())
    h.begin_step()
    assert not h.waiting_for_peers  # still computing
    h.buckets_this_step = 1
    assert h.waiting_for_peers


def test_later_steps_wait_for_peers_only_once_every_bucket_is_handed_over() -> None:
    h = DDPHook(comm())
    h.begin_step()
    h.buckets_this_step = 3
    h.end_step()
    h.begin_step()
    h.buckets_this_step = 2
    assert not h.waiting_for_peers  # backward still running: a hang here is this worker's
    h.buckets_this_step = 3
    assert h.waiting_for_peers


def test_a_failure_inside_a_collective_block_is_recorded_once_and_raised() -> None:
    c = comm()
    with pytest.raises(RuntimeError), c.collective("state sync"):
        raise RuntimeError("Connection closed by peer")
    with pytest.raises(ValueError), c.collective("checkpoint save"):
        raise ValueError("a later failure of the same round")
    assert c.failure == CollectiveFailure("state sync", "RuntimeError: Connection closed by peer")


def test_a_group_counts_as_idle_only_outside_collective_blocks_with_its_works_done() -> None:
    """What decides between an NCCL group's abort and its destroy, on a real one-rank group."""
    with served_store() as port:
        c = comm()
        c.enter(replace(assignment(1), world_size=1, store_port=port))
        try:
            assert c._idle()
            with c.collective("state sync"):
                assert not c._idle()  # a collective of the block may be in flight
            c.all_reduce(torch.ones(4), "evaluation")
            assert c._idle() and c._works  # tracked, and completed
        finally:
            c.close()


def test_dcp_reporting_a_local_write_failure_through_the_collective_is_not_recorded() -> None:
    c = comm()
    with pytest.raises(CheckpointException), c.collective("checkpoint save"):
        raise CheckpointException("write", {1: (OSError(28, "No space left"), None)})
    assert c.failure is None


def test_round_end_prefers_the_agents_abort_then_a_failed_collective() -> None:
    failed = CollectiveFailure("gradient all-reduce", "RuntimeError: Connection reset")
    assert round_end(aborted=True, failure=failed) is RoundEnd.LEFT
    assert round_end(aborted=True, failure=None) is RoundEnd.LEFT
    assert round_end(aborted=False, failure=failed) is RoundEnd.PEER_LOST
    assert round_end(aborted=False, failure=None) is RoundEnd.LOCAL_FAULT


def round_of_two(rank: int, port: int, **settings: Any) -> Communicator:
    """Rank ``rank`` of a real two-rank gloo round, through the store at ``port``."""
    c = Communicator(torch.device("cpu"), **settings)
    c.enter(
        Assignment(
            round=1, rank=rank, world_size=2, store_host="127.0.0.1", store_port=port, formed_at=0
        )
    )
    return c


def on_two_ranks(tmp_path: Path, main: Callable[..., None], *args: Any) -> dict[str, Any]:
    """``main(rank, port, *args, out)`` in two processes beside a store of their own; what
    rank 0 wrote to ``out``."""
    out = tmp_path / "rank0.json"
    with served_store() as port:
        mp.spawn(main, args=(port, *args, str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


def _survivor_main(rank: int, port: int, leaves_before: tuple[int, str], out: str) -> None:
    """Both ranks train until rank 1 exits before ``leaves_before`` (step, phase); rank 0 trains
    on until its step fails, and writes what it recorded."""
    c = round_of_two(rank, port, timeout_s=20)
    h = DDPHook(c)
    torch.manual_seed(0)
    ddp = h.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))

    def leave_if(step: int, phase: str) -> None:
        if rank == 1 and (step, phase) == tuple(leaves_before):
            os._exit(0)  # as a killed peer: no goodbye, its sockets just close

    result = {"failure": None, "error": None}
    for step in range(1, 5):
        try:
            h.begin_step()
            leave_if(step, "step")
            ddp(torch.ones(4, 8)).sum().backward()
            leave_if(step, "end_step")
            h.end_step()
        except RuntimeError as exc:
            result = {"failure": c.failure and c.failure.what, "error": type(exc).__name__}
            break
    Path(out).write_text(json.dumps(result | {"end": round_end(c.aborted, c.failure).value}))
    os._exit(0)  # the group is broken: tearing it down would only wait for its timeout


@pytest.mark.parametrize(
    ("leaves_before", "failed"),
    [
        ((1, "step"), "gradient all-reduce"),
        ((1, "end_step"), "DDP bucket rebuild"),
        ((3, "step"), "gradient all-reduce"),
    ],
)
def test_a_peer_lost_at_any_point_of_a_step_is_a_recorded_failure(
    tmp_path: Path, leaves_before: tuple[int, str], failed: str
) -> None:
    """The first all-reduce, DDP's one-time bucket rebuild (a broadcast from rank 0 that DDP
    would otherwise run inside the second forward) and a later all-reduce: wherever the peer
    vanishes, the survivor's error is a recorded collective failure, so its worker reports a
    lost peer instead of crashing as if it were at fault."""
    result = on_two_ranks(tmp_path, _survivor_main, leaves_before)
    assert result == {"failure": failed, "error": "RuntimeError", "end": "peer_lost"}


def _reduced_survivor_main(rank: int, port: int, out: str) -> None:
    """Both ranks send bf16 gradients; rank 1 vanishes before its second backward."""
    c = round_of_two(rank, port, timeout_s=20)
    h = DDPHook(c, grad_dtype=torch.bfloat16)
    torch.manual_seed(0)
    ddp = h.wrap(torch.nn.Linear(8, 1))
    result = {}
    for step in (1, 2):
        try:
            h.begin_step()
            if rank == 1 and step == 2:
                os._exit(0)
            ddp(torch.ones(4, 8)).sum().backward()
            h.end_step()
        except RuntimeError as exc:
            result = {"failure": c.failure and c.failure.what, "error": type(exc).__name__}
            break
    Path(out).write_text(json.dumps(result | {"end": round_end(c.aborted, c.failure).value}))
    os._exit(0)


def test_a_peer_lost_while_gradients_travel_in_bf16_is_a_recorded_failure(tmp_path: Path) -> None:
    """The cast to the network's dtype and back keeps the all-reduce inside the recorded
    collective and the failure on our future: the survivor reports a lost peer."""
    result = on_two_ranks(tmp_path, _reduced_survivor_main)
    assert result == {"failure": "gradient all-reduce", "error": "RuntimeError", "end": "peer_lost"}


def _left_alone(rank: int, port: int, out: str, wait: Callable[[Communicator], None]) -> None:
    """Both ranks meet at a barrier; then rank 1 stays away from rank 0's ``wait`` (moved on to
    a newer round, or frozen), alive, until rank 0 is through with it."""
    c = round_of_two(rank, port, timeout_s=30)
    c.barrier("the first")
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    if rank == 1:
        store.wait(["rank0 through"], timedelta(seconds=60))
        os._exit(0)
    threading.Timer(0.5, c.abort, ("a newer round was announced",)).start()  # the agent's
    started = time.monotonic()
    try:
        wait(c)
        error = None
    except RoundAborted as exc:
        error = str(exc)
    took = time.monotonic() - started
    store.set("rank0 through", b"1")
    Path(out).write_text(
        json.dumps({"error": error, "took": took, "end": round_end(c.aborted, c.failure).value})
    )
    os._exit(0)  # a collective still in flight: tearing the group down would wait for its timeout


def _barrier_main(rank: int, port: int, out: str) -> None:
    _left_alone(rank, port, out, lambda c: c.barrier("the end of training"))


def _evaluation_main(rank: int, port: int, out: str) -> None:
    _left_alone(rank, port, out, lambda c: c.all_reduce(torch.ones(4), "evaluation all-reduce"))


def test_a_barrier_is_left_when_the_round_is_aborted_not_after_the_groups_timeout(
    tmp_path: Path,
) -> None:
    """The end of training waits for every rank at a barrier; a peer that the agent moved on to
    a newer round never comes, and gloo cannot interrupt a barrier: ours gives way to the
    abort at once instead of holding the rank for the group's whole timeout (30 s here)."""
    result = on_two_ranks(tmp_path, _barrier_main)
    assert result["error"] == "a newer round was announced"
    assert result["end"] == "left"
    assert 0.4 < result["took"] < 10


def test_an_evaluation_all_reduce_is_left_when_the_round_is_aborted(tmp_path: Path) -> None:
    """A peer frozen in the middle of an evaluation: the others' all-reduce of its totals gives
    way to the new round at once, as a step's does, instead of waiting for the peer to thaw."""
    result = on_two_ranks(tmp_path, _evaluation_main)
    assert result["error"] == "a newer round was announced"
    assert result["end"] == "left"
    assert 0.4 < result["took"] < 10


def _after_a_failed_set_up_main(rank: int, port: int, out: str) -> None:
    """Rank 0 alone tries to build round 1, whose peer never comes, and fails; then both ranks
    enter round 2 and all-reduce."""
    if rank == 0:
        lonely = Assignment(
            round=1, rank=0, world_size=2, store_host="127.0.0.1", store_port=port, formed_at=0
        )
        with pytest.raises(dist.DistError):  # past the meet: as when the peer vanished after it
            init_group(lonely, "gloo", torch.device("cpu"), timedelta(seconds=2))
    c = Communicator(torch.device("cpu"), timeout_s=30)  # a slow start of the other's is no fault
    c.enter(
        Assignment(
            round=2, rank=rank, world_size=2, store_host="127.0.0.1", store_port=port, formed_at=0
        )
    )
    total = torch.ones(1)
    c.all_reduce(total, "a sum")
    if rank == 0:
        Path(out).write_text(json.dumps({"sum": total.item()}))
    os._exit(0)


def test_a_set_up_that_failed_on_one_rank_does_not_keep_it_from_the_next_rounds_group(
    tmp_path: Path,
) -> None:
    """torch names groups from a per-process count that a failed set-up advances on that rank
    alone: found by the soak, every later round's set-up of such a rank waited out its timeout
    for keys under another name than its peers', and the job never trained again (here: round
    2's set-up fails after 30 s)."""
    assert on_two_ranks(tmp_path, _after_a_failed_set_up_main) == {"sum": 2.0}


def _teardown_beside_main(rank: int, port: int, out: str) -> None:
    """Rank 0 leaves round 1 with an all-reduce that rank 1 never joins, and trains on alone."""
    c = round_of_two(rank, port, timeout_s=4)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    if rank == 1:
        store.wait(["rank0-done"])  # alive, so the all-reduce waits out the group's timeout
        os._exit(0)
    work = c.launch(torch.ones(1), "an all-reduce rank 1 never joins")
    started = time.monotonic()
    c.close()
    closed_s = time.monotonic() - started
    c.enter(replace(assignment(2), world_size=1, store_port=port))
    total = torch.ones(1)
    c.all_reduce(total, "round 2's first all-reduce")
    result = {
        "closed_s": closed_s,
        "round2_s": time.monotonic() - started,
        "round2_sum": total.item(),
        "old_work_done_by_then": work is not None and work.is_completed(),
        "drained": c.reaper.drain(30),
        "round2_group_live": dist.is_initialized(),
        "teardowns": len(c.reaper.teardown_s),
    }
    Path(out).write_text(json.dumps(result))
    store.set("rank0-done", "1")
    os._exit(0)


def test_the_next_round_does_not_wait_for_the_old_groups_teardown(tmp_path: Path) -> None:
    """A round's old groups are shut down beside the next round (elastic.group_reaper): on NCCL
    the shutdown costs 0.5 s (an H200), all of it a rebuild's before. Shown on gloo by a group
    whose all-reduce hangs on a live peer that never joins: the next round trains at once, and
    the old group is shut down only once its all-reduce has ended (the group's 4 s timeout)."""
    r = on_two_ranks(tmp_path, _teardown_beside_main)
    assert r["round2_sum"] == 1.0 and r["round2_group_live"]
    assert not r["old_work_done_by_then"], "the hung all-reduce ended before round 2 trained"
    assert r["closed_s"] < 2 and r["round2_s"] < 3  # sanity bounds; the timeout is 4 s
    assert r["drained"] and r["teardowns"] == 1


def test_gloo_groups_share_the_devices_torch_would_make_for_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One per interface GLOO_SOCKET_IFNAME lists (two threads each), as torch makes a group's,
    and made once: every group after the first shares them (the thread counts below)."""
    monkeypatch.setattr(gloo_device, "_devices", [])
    monkeypatch.setenv(gloo_device.IFNAME_ENV, "lo,lo")
    first = gloo_device.options(timedelta(seconds=5))
    assert (len(first._devices), first._threads) == (2, 4)
    gloo_device.options(timedelta(seconds=9))
    assert len(gloo_device._devices) == 2


def gloo_threads() -> dict[str, int]:
    """This process's gloo threads by name: each live gloo group runs two ``pt_gloo_runloop``,
    and every group shares the process's one transport thread (elastic.gloo_device)."""
    names = [Path(t, "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    return {name: names.count(name) for name in ("pt_gloo_runloop", "gloo_tcp_loop")}


def _broken_round(c: Communicator, rank: int, breaks: str, kept: list[Any]) -> None:
    """A round as the trainer runs one (its DDP, a step, an evaluation's all-reduce) that rank 1
    leaves, as a killed node, before rank 0's ``breaks`` ("gradient" or "evaluation")."""
    h = DDPHook(c)
    ddp = h.wrap(torch.nn.Linear(8, 1))
    kept.append(weakref.ref(ddp))
    for step in (1, 2):
        h.begin_step()
        if rank == 1 and (step, breaks) == (2, "gradient"):
            os._exit(0)
        ddp(torch.ones(4, 8)).sum().backward()
        h.end_step()
        if rank == 1 and (step, breaks) == (2, "evaluation"):
            os._exit(0)
        c.all_reduce(torch.ones(4), "evaluation all-reduce")


def _released_main(rank: int, port: int, breaks: str, out: str) -> None:
    c = round_of_two(rank, port, timeout_s=20)
    kept: list[Any] = []
    failure = None  # a round that did not break writes none, and the assertion names it
    try:
        _broken_round(c, rank, breaks, kept)
    except RuntimeError as exc:
        failure = c.failure and c.failure.what
        release(exc)
    # A later bucket's all-reduce may still be failing on the group's threads: the group is
    # shut down and let go once it has.
    c.close(wait_s=20)
    assert not c.reaper._threads, "the dead peer's collectives never ended"
    gc.collect()
    Path(out).write_text(
        json.dumps({"failure": failure, "ddp_alive": kept[0]() is not None, "gloo": gloo_threads()})
    )
    os._exit(0)


@pytest.mark.parametrize("breaks", ["gradient", "evaluation"])
def test_a_round_that_a_peer_broke_is_freed_once_its_end_is_recorded(
    tmp_path: Path, breaks: str
) -> None:
    """An all-reduce of ours raises the exception its torch future stores, the same object at
    every wait, and the traceback it gathers holds the round's frames from C++, where the
    collector cannot reach: found by the soak's same-node pattern, every round a killed peer
    broke in an evaluation kept its DDP, gradient buckets and process group (3 threads, 5
    descriptors, about 40 MB for ResNet-18) for the worker's life. Released, nothing of the
    round is left once the group is closed, wherever the peer broke it (without the release the
    evaluation's case keeps 3 gloo threads and the DDP)."""
    result = on_two_ranks(tmp_path, _released_main, breaks)
    failed = "gradient all-reduce" if breaks == "gradient" else "evaluation all-reduce"
    assert result == {
        "failure": failed,
        "ddp_alive": False,
        "gloo": {"pt_gloo_runloop": 0, "gloo_tcp_loop": 1},
    }


def test_a_device_fault_is_local_whatever_else_the_round_saw() -> None:
    """A sticky CUDA error (torch's AcceleratorError, as a device-side assert raises) poisons
    the worker's CUDA context: it is the worker's own fault, to be restarted with a strike, even
    when it surfaced in a collective or came with the agent's abort; wrapped, it is still one."""
    failed = CollectiveFailure("gradient all-reduce", "AcceleratorError: device-side assert")
    fault = torch.AcceleratorError("CUDA error: device-side assert triggered")
    assert round_end(aborted=False, failure=failed, error=fault) is RoundEnd.LOCAL_FAULT
    assert round_end(aborted=True, failure=None, error=fault) is RoundEnd.LOCAL_FAULT
    try:
        try:
            raise fault
        except torch.AcceleratorError as exc:
            raise RuntimeError("the state sync failed") from exc
    except RuntimeError as wrapped:
        assert is_device_fault(wrapped)
        assert round_end(aborted=False, failure=failed, error=wrapped) is RoundEnd.LOCAL_FAULT
    # A peer lost is no device fault: the round ends as before.
    lost = RuntimeError("Connection reset by peer")
    assert not is_device_fault(lost) and not is_device_fault(None)
    assert round_end(aborted=False, failure=failed, error=lost) is RoundEnd.PEER_LOST


def test_only_a_live_nccl_communicator_of_a_round_that_only_lost_ranks_is_shrunk() -> None:
    assert can_shrink("nccl", [2], live=True, supported=True)
    assert not can_shrink("nccl", [2], live=False, supported=True)  # aborted: freed by NCCL
    assert not can_shrink("nccl", None, live=True, supported=True)  # a rank added or moved
    assert not can_shrink("nccl", [2], live=True, supported=False)
    assert not can_shrink("gloo", [2], live=True, supported=True)


def test_the_ranks_shrink_only_when_every_one_offered_to() -> None:
    """One survivor whose group was aborted (a collective was in flight) builds anew: its peers
    must too, or they would wait in the shrink for it forever."""
    assert agreed_to_shrink([SHRINK, SHRINK], 2)
    assert not agreed_to_shrink([SHRINK, REBUILD], 2)
    assert not agreed_to_shrink([SHRINK], 2)  # the meet was left (aborted): no offers read


def test_an_nccl_group_is_destroyed_without_an_abort_only_when_idle_and_healthy() -> None:
    """The abort costs 0.5-1 s (NCCL's proxy polls every 500 ms); a destroy of a group whose
    collective failed may wait for it forever."""
    assert not must_abort("nccl", aborted=False, idle=True, healthy=True)
    assert must_abort("nccl", aborted=False, idle=False, healthy=True)  # a kernel may be stuck
    assert must_abort("nccl", aborted=False, idle=True, healthy=False)  # a peer lost
    assert not must_abort("nccl", aborted=True, idle=False, healthy=False)  # once is enough
    assert not must_abort("gloo", aborted=False, idle=False, healthy=False)  # gloo has none


def test_nccl_is_set_so_that_survivors_live_and_a_users_setting_that_ends_them_is_named() -> None:
    add, warnings = survivor_settings({}, 120.0)
    assert add == {ERROR_HANDLING: "0", NONBLOCKING_TIMEOUT: "120", **NO_FAILURE_DUMP}
    assert warnings == []
    users = {ERROR_HANDLING: "2", NONBLOCKING_TIMEOUT: "60", **dict.fromkeys(NO_FAILURE_DUMP, "9")}
    add, warnings = survivor_settings(users, 120.0)
    assert add == {} and warnings == []  # the user's own, and survivable: kept
    add, warnings = survivor_settings({ERROR_HANDLING: "3"}, 0.4)
    assert add == {NONBLOCKING_TIMEOUT: "1", **NO_FAILURE_DUMP}  # the handling kept, and named
    [warning] = warnings
    assert f"{ERROR_HANDLING}=3" in warning and "Fix: unset" in warning
    environ: dict[str, str] = {}
    wanted = {ERROR_HANDLING: "0", NONBLOCKING_TIMEOUT: "30", **NO_FAILURE_DUMP}
    assert apply(30.0, environ) == environ == wanted
