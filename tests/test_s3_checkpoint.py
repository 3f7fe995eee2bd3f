"""Checkpoints on an object store: a real S3-compatible server (moto's, from the package
registry) started by the test, real gloo ranks writing to it through s3fs, and a process killed
in the middle of an upload. Skipped where no server can be started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.checkpoint import CheckpointManager
from elastic.events import EventLog, read_events
from elastic.manifest import MANIFEST
from launcher.rendezvous.embedded_etcd import free_port
from tests.conftest import served_store

BUCKET = "ckpt"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A moto S3 server on a free port; its endpoint in the environment, where s3fs (through
    fsspec's ``FSSPEC_S3_*`` variables) finds it in every process the test starts."""
    pytest.importorskip("s3fs")
    server = Path(sys.executable).parent / "moto_server"
    if not server.exists():
        pytest.skip("no moto_server next to this Python (pip install 'moto[s3]' flask flask-cors)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"moto_server did not start: {(tmp_path / 'moto.log').read_text()}")
                time.sleep(0.1)
        env = {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": endpoint,
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        import fsspec
        import s3fs

        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
        s3fs.S3FileSystem.clear_instance_cache()
        fsspec.filesystem("s3").mkdir(BUCKET)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def state(seed: int, numel: int = 50_000) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(numel), "b": torch.randn(100)}


def _rank(rank: int, world: int, port: int, url: str, out: str, action: str) -> None:
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    manager = CheckpointManager(url, keep=3, events=EventLog(out, f"rank{rank}"))
    if action == "load":
        tensors = {k: torch.zeros_like(v) for k, v in state(0).items()}
        info = manager.restore(tensors)
        found = {"step": info.step if info else None, "w": tensors["w"][:5].tolist()}
        Path(out, f"loaded{rank}.json").write_text(json.dumps(found))
    elif action == "big":  # one rank, 120 MB: more than s3fs's 50 MB parts
        manager.save(10, state(10, numel=30_000_000), {})
    else:
        manager.save(int(action), state(int(action)), {})
    dist.destroy_process_group()


def run(world: int, url: str, out: Path, action: str) -> None:
    with served_store() as port:
        mp.spawn(_rank, args=(world, port, url, str(out), action), nprocs=world, join=True)


def test_checkpoints_on_s3_commit_reshard_and_catch_a_flipped_byte(s3: str, tmp_path: Path) -> None:
    """Saved by two ranks, loaded by one; a damaged shard is set aside for the older one (saved
    by one rank, so that it also reshards from one to two)."""
    import fsspec

    url = f"s3://{BUCKET}/job"
    run(1, url, tmp_path, "5")
    run(2, url, tmp_path, "10")
    fs = fsspec.filesystem("s3")
    manifest = json.loads(fs.cat_file(f"{BUCKET}/job/step_000000010/{MANIFEST}"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= manifest["files"].keys()
    run(1, url, tmp_path, "load")
    loaded = json.loads((tmp_path / "loaded0.json").read_text())
    assert loaded["step"] == 10 and loaded["w"] == pytest.approx(state(10)["w"][:5].tolist())

    shard = f"{BUCKET}/job/step_000000010/__1_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    run(2, url, tmp_path, "load")
    for rank in (0, 1):
        loaded = json.loads((tmp_path / f"loaded{rank}.json").read_text())
        assert loaded["step"] == 5 and loaded["w"] == pytest.approx(state(5)["w"][:5].tolist())
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/job/step_000000010.corrupt/{MANIFEST}")
    skipped = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and "__1_0.distcp" in skipped[0]["reason"]


def test_a_process_killed_during_an_upload_leaves_nothing_that_loads(
    s3: str, tmp_path: Path
) -> None:
    """SIGKILL while a 120 MB shard is being uploaded (a multipart upload in progress on the
    server): the previous checkpoint is what loads, and the partial folder is removed."""
    import boto3

    url = f"s3://{BUCKET}/job"
    run(1, url, tmp_path, "5")
    client = boto3.client("s3", endpoint_url=s3)
    with served_store() as port:
        ctx = mp.spawn(_rank, args=(1, port, url, str(tmp_path), "big"), nprocs=1, join=False)
        saver = ctx.processes[0]
        try:
            deadline = time.monotonic() + 60
            while not client.list_multipart_uploads(Bucket=BUCKET).get("Uploads"):
                assert saver.is_alive() and time.monotonic() < deadline, "no upload was seen"
                time.sleep(0.02)
            os.kill(saver.pid, signal.SIGKILL)
            saver.join(10)
        finally:
            if saver.is_alive():
                saver.kill()
    assert saver.exitcode == -signal.SIGKILL
    run(1, url, tmp_path, "load")
    loaded = json.loads((tmp_path / "loaded0.json").read_text())
    assert loaded["step"] == 5 and loaded["w"] == pytest.approx(state(5)["w"][:5].tolist())
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/job/step_000000010/{MANIFEST}")
