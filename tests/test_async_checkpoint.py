"""Background checkpoint saves with real gloo groups and real signals: a process killed at each
phase of a save never leaves a checkpoint that loads wrong, a peer frozen in the middle of a save
holds only the save, and the per-rank hashes catch a flipped byte in any rank's shard."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

from elastic import async_checkpoint, checkpoint_save
from elastic.async_checkpoint import BackgroundSaver, copy_host
from elastic.checkpoint import CheckpointManager
from elastic.checkpoint_save import _ShardWriter
from elastic.events import EventLog, read_events
from elastic.manifest import MANIFEST
from tests.conftest import START_S, rank_started, ranks_started, served_store

GROUP_TIMEOUT = timedelta(seconds=30)


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(300, 200), "b": torch.randn(200), "step": torch.tensor([seed])}


def _join(rank: int, port: int) -> dist.ProcessGroup:
    """The ranks meet (each may take up to START_S to start), say so, and save over a group of
    GROUP_TIMEOUT."""
    start = timedelta(seconds=START_S)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=start)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=start)
    group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    rank_started(store, rank)
    return group


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _phase_main(rank: int, port: int, url: str, out: str, phase: str) -> None:
    """Both ranks save step 5, then step 10 in the background, with one rank killed at
    ``phase`` of the second save."""
    group = _join(rank, port)
    events = EventLog(out, f"rank{rank}")
    manager = CheckpointManager(url, keep=3, events=events)
    saver = BackgroundSaver(events)
    tensors = state(5)
    saver.start(manager, 5, tensors, {}, group, 1, lambda: False)
    assert saver.wait(lambda: False) == (5 if rank == 0 else None)  # rank 0 committed it
    if phase == "staging" and rank == 1:
        saver._stage = lambda *args: _die()  # type: ignore[method-assign]
    if phase == "write" and rank == 1:
        async_checkpoint._Save.reading = lambda self: _die()  # type: ignore[method-assign,assignment]
    if phase in ("before_manifest", "after_manifest") and rank == 0:
        commit = manager.store.put_manifest

        def dying_commit(path: str, manifest: dict) -> None:  # type: ignore[type-arg]
            if phase == "after_manifest":
                commit(path, manifest)
            _die()

        manager.store.put_manifest = dying_commit  # type: ignore[method-assign]
    for name, value in state(10).items():
        tensors[name].copy_(value)
    saver.start(manager, 10, tensors, {}, group, 1, lambda: False)
    for t in tensors.values():
        t.zero_()  # training goes on: what is written is the staged copy
    # The survivor did not commit step 10: rank 0's save failed, or rank 1 commits nothing.
    assert saver.wait(lambda: False) is None
    Path(out, f"survivor{rank}").write_text("done")
    os._exit(0)


@pytest.mark.parametrize("phase", ["staging", "write", "before_manifest", "after_manifest"])
def test_a_process_killed_at_each_phase_of_a_background_save_never_leaves_a_wrong_checkpoint(
    tmp_path: Path, phase: str
) -> None:
    """The newest checkpoint that loads is step 10 only when the kill came after its commit,
    and it holds what was staged, not what training wrote afterwards; otherwise step 5. The
    saver's ``wait`` tells rank 0, which commits, the step it committed; no one a failed one."""
    url = f"file://{tmp_path}/ckpt"
    survivor = 0 if phase in ("staging", "write") else 1
    with served_store() as port:
        ranks = mp.spawn(_phase_main, args=(port, url, str(tmp_path), phase), nprocs=2, join=False)
        ranks_started(port, 2)
        for p in ranks.processes:
            p.join(60)
    codes = [p.exitcode for p in ranks.processes]
    assert codes[survivor] == 0 and codes[1 - survivor] == -signal.SIGKILL, codes
    assert (tmp_path / f"survivor{survivor}").exists()

    manager = CheckpointManager(url, keep=3)
    info = manager.newest_valid()
    assert info is not None
    expected = 10 if phase == "after_manifest" else 5
    assert info.step == expected
    loaded = {k: torch.zeros_like(v) for k, v in state(0).items()}
    manager.load(info, loaded)
    assert all(torch.equal(loaded[k], v) for k, v in state(expected).items())
    if phase in ("staging", "write"):  # the survivor, rank 0, says why the save failed
        failed = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_failed"]
        assert [e["step"] for e in failed] == [10] and "collectives" in failed[0]["reason"]


def _frozen_main(rank: int, port: int, url: str, out: str) -> None:
    """Rank 1 freezes before its save; rank 0 starts its own, leaves the round (abandons it),
    and reports; the test then thaws rank 1, whose save goes on into an abandoned one."""
    group = _join(rank, port)
    events = EventLog(out, f"rank{rank}")
    manager = CheckpointManager(url, keep=1, events=events)
    saver = BackgroundSaver(events)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.perf_counter()
    held = saver.start(manager, 5, state(5), {}, group, 1, lambda: False).stall_s
    returned = time.perf_counter() - t0
    if rank == 0:
        saver.abandon()  # the agent moved this rank to a round without the frozen one
        # Renamed into place: the test reads it as soon as it exists (written in place, it was
        # once read empty, between its creation and its write).
        Path(out, "rank0.tmp").write_text(json.dumps({"held": held, "returned": returned}))
        os.replace(Path(out, "rank0.tmp"), Path(out, "rank0.json"))
    saver.wait(lambda: False)
    Path(out, f"done{rank}").write_text("done")
    os._exit(0)


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def test_a_peer_frozen_mid_save_holds_only_the_save_and_an_abandoned_save_never_commits(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/ckpt"
    with served_store() as port:
        ranks = mp.spawn(_frozen_main, args=(port, url, str(tmp_path)), nprocs=2, join=False)
        frozen = ranks.processes[1]
        try:
            ranks_started(port, 2)
            report = tmp_path / "rank0.json"
            deadline = time.monotonic() + 20
            while not report.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert report.exists(), "rank 0 was held by its frozen peer"
            assert json.loads(report.read_text())["returned"] < 2.0
            # Rank 1 stops itself, maybe after rank 0 has reported: a SIGCONT sent before that is
            # lost, and rank 1 then stays stopped.
            deadline = time.monotonic() + 20
            while not _stopped(frozen.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _stopped(frozen.pid), "rank 1 never froze"
            os.kill(frozen.pid, signal.SIGCONT)
            for p in ranks.processes:
                p.join(40)
            assert [p.exitcode for p in ranks.processes] == [0, 0]
        finally:
            for p in ranks.processes:
                if p.is_alive():
                    p.kill()
    assert not list((tmp_path / "ckpt").rglob(MANIFEST))  # never committed
    names = {e["event"] for e in read_events(tmp_path)}
    assert not names & {"checkpoint_saved", "checkpoint_failed"}  # abandoned is neither


def _flip_main(rank: int, port: int, url: str, out: str, action: str) -> None:
    group = _join(rank, port)
    manager = CheckpointManager(url, keep=3, events=EventLog(out, f"rank{rank}"))
    if action == "save":
        for step in (5, 10, 15):
            manager.save(step, state(step), {}, group)
    else:
        tensors = {k: torch.zeros_like(v) for k, v in state(0).items()}
        info = manager.restore(tensors)
        Path(out, f"loaded{rank}.json").write_text(
            json.dumps({"step": info.step if info else None, "w": tensors["w"].sum().item()})
        )
    dist.destroy_process_group()


def test_the_per_rank_hashes_catch_a_flipped_byte_in_any_ranks_shard(tmp_path: Path) -> None:
    """Rank 0 verifies ``.metadata`` and rank 1's shard, rank 1 rank 0's: a byte flipped in
    rank 1's shard of step 15 and in rank 0's of step 10 sets both aside for step 5."""
    url = f"file://{tmp_path}/ckpt"
    for action in ("save", "load"):
        if action == "load":
            for step, shard in ((10, "__0_0.distcp"), (15, "__1_0.distcp")):
                path = tmp_path / "ckpt" / f"step_{step:09d}" / shard
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        with served_store() as port:
            mp.spawn(_flip_main, args=(port, url, str(tmp_path), action), nprocs=2, join=True)
    manifest = json.loads((tmp_path / "ckpt" / "step_000000005" / MANIFEST).read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= manifest["files"].keys()
    for rank in (0, 1):
        loaded = json.loads((tmp_path / f"loaded{rank}.json").read_text())
        assert loaded["step"] == 5
        assert loaded["w"] == pytest.approx(state(5)["w"].sum().item())
    for step in (10, 15):
        assert (tmp_path / "ckpt" / f"step_{step:09d}.corrupt").is_dir()
    skipped = [e["reason"] for e in read_events(tmp_path) if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 2 and "__1_0.distcp" in skipped[0] and "__0_0.distcp" in skipped[1]


def grown(step: int) -> dict[str, torch.Tensor]:
    return {"momentum": torch.full((50,), float(step))}


def _share_main(rank: int, port: int, url: str, out: str) -> None:
    """Three saves in round 1, four in round 2, each of another state, of which rank 1 cannot
    write the second (a folder stands where its shard goes) and the last has one tensor more (an
    optimizer's state appears after its first step); what each staged, and which steps DCP
    planned."""
    group = _join(rank, port)
    manager = CheckpointManager(url, keep=7)
    saver = BackgroundSaver(EventLog(out, f"rank{rank}"))
    planned = []
    dcp_save = checkpoint_save.dcp.save

    def counted_save(*args: Any, **kwargs: Any) -> Any:
        planned.append(step)
        return dcp_save(*args, **kwargs)

    checkpoint_save.dcp.save = counted_save  # type: ignore[assignment]
    tensors = state(1)
    copied = []
    for step, round_ in ((1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2), (7, 2)):
        for name, value in state(step).items():
            tensors[name].copy_(value)
        if step == 7:
            tensors = tensors | grown(step)
        if step == 5 and rank == 1:
            trap = Path(url.removeprefix("file://"), f"step_{step:09d}", "__1_0.distcp")
            trap.mkdir(parents=True)
        started = saver.start(manager, step, tensors, {}, group, round_, lambda: False)
        copied.append(started.copied_bytes)
        saver.wait(lambda: False)
    Path(out, f"copied{rank}.json").write_text(json.dumps({"copied": copied, "planned": planned}))
    dist.destroy_process_group()


def test_a_rounds_later_saves_stage_only_each_ranks_share_replay_dcps_plan_and_stay_whole(
    tmp_path: Path,
) -> None:
    """After a round's first save, each rank stages only the tensors DCP gave it to write, and
    writes them without DCP, as DCP planned them then; a replayed save that fails on one rank
    fails on both, and the next save plans anew, as does a save of a state that grew. Every save
    loads to its step's values."""
    url = f"file://{tmp_path}/ckpt"
    with served_store() as port:
        mp.spawn(_share_main, args=(port, url, str(tmp_path)), nprocs=2, join=True)
    whole = sum(t.numel() * t.element_size() for t in state(0).values())
    seen = [json.loads((tmp_path / f"copied{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        copied = seen[rank]["copied"]
        assert copied[0] == whole and copied[3] == whole  # a round's first save
        assert 0 < copied[1] == copied[2] == copied[4] < whole
        assert copied[5] == whole  # after the failed save
        assert copied[6] == whole + 50 * 4  # all of a state that grew
        assert seen[rank]["planned"] == [1, 4, 6, 7]
    assert seen[0]["copied"][1] + seen[1]["copied"][1] == whole  # the shares split the state
    failed = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [5]
    assert failed[0]["reason"].startswith("rank 1: IsADirectoryError")
    root = tmp_path / "ckpt"
    assert not (root / "step_000000005").exists()
    metadata = (root / "step_000000001" / ".metadata").read_bytes()
    assert all((root / f"step_{s:09d}" / ".metadata").read_bytes() == metadata for s in (2, 3))
    manager = CheckpointManager(url, keep=7)
    for step in (7, 6, 4, 3, 2):  # every tensor holds its step's value
        info = manager.newest_valid()
        assert info is not None and info.step == step
        expected = state(step) | (grown(step) if step == 7 else {})
        loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
        manager.load(info, loaded)
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        (root / f"step_{step:09d}" / MANIFEST).unlink()


class _NothingRefilled:
    abandoned = False

    def reading(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def refilled(self, tensor: torch.Tensor) -> bool:
        return False


def test_a_save_asked_to_write_a_tensor_it_did_not_stage_fails(tmp_path: Path) -> None:
    """What a rank would write if DCP split the tensors otherwise than at the round's last save:
    the save fails (on every rank, through DCP) rather than commit an older step's values."""
    writer = _ShardWriter(str(tmp_path), _NothingRefilled())
    with pytest.raises(CheckpointException, match="not staged for this save"):
        dcp.save(state(1), storage_writer=writer, no_dist=True)


@pytest.mark.parametrize("threads", [1, 3])
def test_staging_copies_host_tensors_of_every_layout_exactly(threads: int) -> None:
    """Contiguous tensors of every size and dtype go by memmove, shared among ``threads``
    threads; transposed, strided and channels-last ones by copy_; the staged copy equals the
    sources in every case, and a mismatched pair is refused rather than copied."""
    torch.manual_seed(0)
    sources = [
        torch.randn(1000, 300),
        torch.randn(300, 1000).t(),
        torch.randn(64, 3, 3, 3).to(memory_format=torch.channels_last),
        torch.randn(20)[::2],
        torch.arange(7),
        torch.rand(5) > 0.5,
        torch.empty(0),
        torch.tensor(3.5, dtype=torch.float64),
    ]
    staged = [torch.zeros(s.shape, dtype=s.dtype) for s in sources]
    pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
    copy_host(staged, sources, pool, threads)
    assert all(torch.equal(d, s) for d, s in zip(staged, sources, strict=True))
    with pytest.raises(ValueError, match=r"staging \(6,\) torch.float32 into \(4,\)"):
        copy_host([torch.zeros(4)], [torch.ones(6)], pool, threads)
    if pool:
        pool.shutdown()


def test_a_tensor_whose_shape_changed_under_the_same_name_is_staged_anew(tmp_path: Path) -> None:
    """A name whose tensor changed shape (or dtype) makes the whole staged copy new, and all of
    it refilled, even when the save asks for one rank's share only."""
    saver = BackgroundSaver(EventLog(tmp_path, "rank0"))
    saver._stage({"w": torch.ones(4), "b": torch.zeros(2)}, None)
    fresh, replaced, copied = saver._stage(
        {"w": torch.ones(6), "b": torch.ones(2)}, frozenset({"w"})
    )
    assert replaced and len(fresh) == 2 and copied == 32
    assert torch.equal(saver._staged["w"], torch.ones(6))
    assert torch.equal(saver._staged["b"], torch.ones(2))
    _, replaced, copied = saver._stage({"w": torch.ones(6), "b": torch.ones(2)}, frozenset({"w"}))
    assert not replaced and copied == 24
