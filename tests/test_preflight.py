"""The launcher's checks of the places a job needs, before any agent starts: real files, a real
read-only mount, real etcd servers (one up, one port with none)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from elastic.config import Config
from launcher.health.checks import writable_dir_problem
from launcher.health.preflight import preflight
from launcher.rendezvous.embedded_etcd import free_port

from .conftest import small_tmpfs
from .test_config import composed


def with_(cfg: Config, group: str, **values: object) -> Config:
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **values)})


def test_a_fresh_directory_under_a_writable_one_passes_and_nothing_is_created(
    tmp_path: Path,
) -> None:
    target = tmp_path / "a" / "b" / "checkpoints"
    assert writable_dir_problem(target) == ""
    assert not (tmp_path / "a").exists()


def test_a_checkpoint_url_under_a_regular_file_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    cfg = with_(composed(), "checkpoint", url=f"file://{tmp_path}/file/ckpt")
    [found] = preflight(cfg)
    assert found.startswith(f"checkpoint.url='file://{tmp_path}/file/ckpt'")
    assert "is a regular file" in found and "Fix: point checkpoint.url" in found


def test_a_checkpoint_url_on_a_read_only_file_system_is_refused(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "ro", 1, read_only=True) as read_only:
        [found] = preflight(with_(composed(), "checkpoint", url=str(read_only / "ckpt")))
    assert "checkpoint.url=" in found and "read-only" in found


def test_a_remote_checkpoint_store_is_left_to_its_first_save() -> None:
    assert preflight(with_(composed(), "checkpoint", url="s3://bucket/job")) == []


def test_etcd_endpoints_that_do_not_answer_are_refused_quickly(etcd_endpoint: str) -> None:
    assert preflight(with_(composed(), "cluster", etcd_endpoints=[etcd_endpoint])) == []
    nobody = f"127.0.0.1:{free_port()}"
    cfg = with_(composed(), "cluster", etcd_endpoints=[nobody])
    [found] = preflight(with_(cfg, "health", etcd_timeout_s=1.0))
    assert found.startswith(f"cluster.etcd_endpoints=['{nobody}']")
    assert "Fix: start etcd" in found
