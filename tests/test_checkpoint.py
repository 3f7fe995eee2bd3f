"""Sharded checkpoints with real gloo process groups: resharding, commit, damage, retention,
and a save that fails on one rank."""

from __future__ import annotations

import errno
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from elastic.checkpoint import CheckpointManager
from elastic.checkpoint_save import SaveFailed, save_failure_fix
from elastic.events import EventLog, read_events
from elastic.manifest import MANIFEST, file_record
from elastic.shard_io import ShardReader, ShardWriter, tensor_bytes
from elastic.state import TrainState
from tests.conftest import served_store


def make_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
    )
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for t in state.tensors().values():  # make every tensor, momentum included, distinctive
        if t.is_floating_point():
            t.copy_(torch.randn_like(t))
    return state


def _rank_main(
    rank: int,
    world: int,
    port: int,
    action: str,
    url: str,
    step: int | list[int],
    seed: int | list[int],
    out: str,
) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    events = EventLog(out, f"rank{rank}")
    manager = CheckpointManager(url, keep=2, events=events)
    if action == "save":  # one save, or one per step of a list (and seed of a list) in turn
        steps, seeds = (x if isinstance(x, list) else [x] for x in (step, seed))
        for one_step, one_seed in zip(steps, seeds, strict=True):
            try:
                tensors = make_state(one_seed).tensors()
                manager.save(one_step, tensors, {"progress": {"step": one_step}})
            except SaveFailed as exc:  # every rank learns of it; the test reads what each saw
                Path(out, f"failed{rank}.json").write_text(json.dumps([exc.reason, exc.fix]))
        dist.destroy_process_group()
        return
    assert isinstance(seed, int)
    tensors = make_state(seed).tensors()
    if action in ("load_with_scaler", "load_another_optimizer"):
        extra = "scaler.scale" if action == "load_with_scaler" else "optim.0.weight.square_avg"
        tensors[extra] = torch.full((1,), 65536.0)
        try:
            manager.restore(tensors)
            result = {"extra": tensors[extra].tolist(), "tensors": _plain(tensors, extra)}
        except ValueError as exc:
            result = {"error": str(exc)}
        Path(out, f"loaded{rank}.json").write_text(json.dumps(result))
    else:
        info = manager.restore(tensors)
        found = {
            "step": info.step if info else None,
            "tensors": {k: v.tolist() for k, v in tensors.items()},
        }
        Path(out, f"loaded{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _plain(tensors: dict[str, torch.Tensor], leave_out: str) -> dict[str, list]:
    return {k: v.tolist() for k, v in tensors.items() if k != leave_out}


def run_ranks(
    world: int,
    action: str,
    url: str,
    out: Path,
    step: int | list[int] = 0,
    seed: int | list[int] = 0,
) -> None:
    with served_store() as port:
        mp.spawn(
            _rank_main,
            args=(world, port, action, url, step, seed, str(out)),
            nprocs=world,
            join=True,
        )


def expected(seed: int) -> dict[str, list]:
    return {k: v.tolist() for k, v in make_state(seed).tensors().items()}


def loaded(out: Path, rank: int) -> dict:
    return json.loads((out / f"loaded{rank}.json").read_text())


def test_saved_at_two_ranks_loads_at_one_and_three(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    run_ranks(2, "save", url, tmp_path, step=7, seed=1)
    folder = tmp_path / "ckpt" / "step_000000007"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["progress"] == {"step": 7}
    assert ".metadata" in manifest["files"]
    assert len([f for f in manifest["files"] if f.endswith(".distcp")]) == 2  # one shard per rank
    for world in (1, 3):
        run_ranks(world, "load", url, tmp_path, seed=99)  # fresh state with other values
        for rank in range(world):
            got = loaded(tmp_path, rank)
            assert got["step"] == 7
            assert got["tensors"] == expected(1)


def test_an_interrupted_save_is_never_loaded(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    run_ranks(1, "save", url, tmp_path, step=[5, 10], seed=[1, 2])
    newest = tmp_path / "ckpt" / "step_000000010"
    (newest / MANIFEST).unlink()  # as if the job died before the commit record
    run_ranks(1, "load", url, tmp_path, seed=99)
    got = loaded(tmp_path, 0)
    assert got["step"] == 5 and got["tensors"] == expected(1)
    assert not newest.exists()  # the partial save was cleaned up
    skipped = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_skipped"]
    assert skipped and skipped[0]["reason"] == "incomplete"


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    run_ranks(1, "save", url, tmp_path, step=[1, 2, 3], seed=[1, 2, 3])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step_000000002",
        "step_000000003",
    ]


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_last_good_one(
    tmp_path: Path,
) -> None:
    """Rank 1 cannot write its shard (a directory stands where its file goes): DCP reports it to
    every rank through a collective that completes, so both raise SaveFailed, the half-written
    folder is removed with the one an abandoned save left, and the checkpoint before it still
    loads."""
    url = f"file://{tmp_path}/ckpt"
    run_ranks(2, "save", url, tmp_path, step=5, seed=1)
    abandoned = tmp_path / "ckpt" / "step_000000007"  # a save a round change left, unfinished
    abandoned.mkdir()
    (abandoned / "__0_0.distcp").write_bytes(bytes(1024))
    trap = tmp_path / "ckpt" / "step_000000010" / "__1_0.distcp"
    trap.mkdir(parents=True)
    run_ranks(2, "save", url, tmp_path, step=10, seed=2)
    seen = [json.loads((tmp_path / f"failed{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1]
    reason, fix = seen[0]
    assert reason.startswith("rank 1: IsADirectoryError") and "checkpoint.url" in fix
    assert not trap.parent.exists()
    assert not abandoned.exists()  # its space may be what the failed save lacked
    run_ranks(1, "load", url, tmp_path, seed=99)
    got = loaded(tmp_path, 0)
    assert got["step"] == 5 and got["tensors"] == expected(1)


def test_the_fix_for_a_failed_save_follows_the_errno_or_the_space_left() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert "free space" in save_failure_fix([full.errno])
    assert "writable" in save_failure_fix([denied.errno])
    # Space first: it is the usual cause.
    assert "free space" in save_failure_fix([denied.errno, full.errno])
    assert "reachable" in save_failure_fix([None])  # a store down, say
    # A short write on a full disk without an errno: less space left than needed.
    assert "free space" in save_failure_fix([None], free_bytes=4096, needed_bytes=10**6)
    assert "reachable" in save_failure_fix([None], free_bytes=10**9, needed_bytes=10**6)


def test_state_a_setting_added_since_the_save_starts_fresh_and_anything_else_is_refused(
    tmp_path: Path,
) -> None:
    """A job resumed with trainer.precision=fp16 from an fp32 checkpoint gets a fresh loss
    scaler and the saved weights; a checkpoint of another optimizer is refused by name."""
    url = f"file://{tmp_path}/ckpt"
    run_ranks(1, "save", url, tmp_path, step=3, seed=1)
    run_ranks(1, "load_with_scaler", url, tmp_path, seed=99)
    got = loaded(tmp_path, 0)
    assert got["extra"] == [65536.0] and got["tensors"] == expected(1)
    run_ranks(1, "load_another_optimizer", url, tmp_path, seed=99)
    error = loaded(tmp_path, 0)["error"]
    assert "has no optim.0.weight.square_avg" in error and "Fix: resume with" in error


def odd_state() -> dict[str, Any]:
    """Tensors of every kind a layout gets wrong first, and a non-tensor value."""
    torch.manual_seed(3)
    return {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "count": torch.arange(7),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(4, 6).t(),
        "note": {"lr": 0.1},
    }


def test_a_shard_is_the_states_bytes_hashed_as_written_and_every_kind_loads_back(
    tmp_path: Path,
) -> None:
    state = odd_state()
    writer = ShardWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer, no_dist=True)
    [(name, record)] = writer.written.items()  # one file for the one rank
    data = (tmp_path / name).read_bytes()
    assert record == file_record(fsspec.filesystem("file"), str(tmp_path / name))
    for key, value in state.items():  # each tensor's memory, as it is
        if isinstance(value, torch.Tensor):
            assert bytes(tensor_bytes(value)) in data, key
    fresh: dict[str, Any] = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"lr": 0.0}
        for k, v in state.items()
    }
    dcp.load(fresh, storage_reader=ShardReader(str(tmp_path)), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert fresh[key].dtype == value.dtype and torch.equal(fresh[key], value), key
    assert fresh["note"] == {"lr": 0.1}


def test_a_checkpoint_in_dcps_own_layout_still_loads(tmp_path: Path) -> None:
    """Manifest format 1: the shards as DCP's file writer lays them out (before this layout)."""
    state = {k: v for k, v in odd_state().items() if isinstance(v, torch.Tensor)}
    folder = tmp_path / "step_000000004"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    fs = fsspec.filesystem("file")
    whole = {"sha256": ""}  # format 1 hashed each file whole
    files = {p.name: file_record(fs, str(p), whole) for p in folder.iterdir()}
    manifest = {"format": 1, "step": 4, "files": files, "world_size": 1, "tensors": sorted(state)}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    manager = CheckpointManager(f"file://{tmp_path}", keep=2)
    info = manager.newest_valid()
    assert info is not None and info.step == 4
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    manager.load(info, fresh)
    assert all(torch.equal(fresh[k], v) for k, v in state.items())
