"""Configuration: Hydra composition, overrides, and refusal of bad values before anything starts."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from elastic.config import Config, ConfigError, validate
from launcher.compose import finalize

from .conftest import REPO


def composed(*overrides: str) -> Config:
    with initialize_config_module(config_module="conf", version_base=None):
        return finalize(OmegaConf.to_object(compose("config", overrides=list(overrides))))


def test_defaults_are_valid() -> None:
    cfg = composed()
    validate(cfg)
    assert cfg.cluster.mode == "local" and cfg.cluster.nodes == 2
    assert cfg.model.name == "resnet18" and cfg.data.synthetic
    assert cfg.checkpoint.url == f"file://{cfg.run_dir}/checkpoints"


def test_overrides_from_the_issue_compose(tmp_path: Path) -> None:
    cfg = composed("cluster.nodes=3", "optim.lr=0.2", f"data.root={tmp_path}", "model=resnet50")
    assert (cfg.cluster.nodes, cfg.optim.lr, cfg.model.name) == (3, 0.2, "resnet50")
    assert cfg.data.root == str(tmp_path)


def test_imagenet_presets_compose() -> None:
    cfg = composed("model=resnet50", "data=imagenet", "optim=goyal", "cluster=bare_metal")
    assert cfg.data.crop_size == 224 and cfg.optim.milestones_epochs == [30, 60, 80]
    assert cfg.cluster.mode == "bare_metal"


def test_health_presets_compose() -> None:
    assert composed().health.min_open_files == 4096
    strict = composed("health=strict").health
    assert (strict.min_open_files, strict.fail_on_throttle, strict.max_gpu_temp_c) == (
        65536,
        True,
        80,
    )
    assert strict.gpu_probe_timeout_s == 120.0  # the rest comes from health/default


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["cluster.min_nodes=5", "cluster.nodes=3"], "cluster.min_nodes"),
        (["optim.lr=-1"], "optim.lr"),
        (["optim.momentum=1.5"], "optim.momentum"),
        (["data.batch_size=0"], "data.batch_size"),
        (["rendezvous.lease_ttl_s=1"], "rendezvous.lease_ttl_s"),
        (["model.name=resnet9000"], "model.name"),
        (["cluster.mode=cloud"], "cluster.mode"),
        (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
        (["cluster=bare_metal"], "job_id"),
        (["cluster=bare_metal", "job_id=x"], "cluster.etcd_endpoints"),
        (["cluster.etcd_endpoints=[nohostport]"], "cluster.etcd_endpoints"),
        (["data=imagenet", "data.root=/nonexistent/imagenet"], "data.root"),
        (["health.min_open_files=-1"], "health.min_open_files"),
        (["health.gpu_memory_fraction=1.5"], "health.gpu_memory_fraction"),
        (["health.quarantine_s=1"], "health.quarantine_s"),
        (["health.max_strikes=0"], "health.max_strikes"),
        (["optim.milestones_epochs=[60,30]"], "optim.milestones_epochs"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(composed(*overrides))
    assert f"{key}=" in str(err.value) and "Fix:" in str(err.value)


def run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "job_id=refused",
            f"run_dir={tmp_path / 'run'}",
            *overrides,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("cluster.min_nodes=9", "cluster.min_nodes=9"),  # a value that cannot work
        ("cluster.nodes=abc", "cluster.nodes"),  # a type error, caught by the schema
        ("cluster.nodez=3", "nodez"),  # an unknown key
        ("model=resnet9000", "model"),  # an unknown preset
    ],
)
def test_launcher_refuses_bad_config_before_anything_starts(
    tmp_path: Path, override: str, expected: str
) -> None:
    result = run_cli(tmp_path, override)
    assert result.returncode != 0
    assert expected in result.stderr
    assert not (tmp_path / "run").exists()  # no run directory, no etcd, no node started


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", *args], check=True, timeout=300, capture_output=True
    )


def test_configs_ship_in_the_wheel(tmp_path: Path) -> None:
    """Hydra finds conf/ through pkg://conf, so the YAML files must be package data."""
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO))
    wheel = next(tmp_path.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped and shipped <= names
    # Installed without -e, from a folder that is not the checkout, composition still works.
    site = tmp_path / "site"
    pip("install", "--no-deps", "-q", "--target", str(site), str(wheel))
    probe = (
        "from hydra import compose, initialize_config_module; import launcher.cli, conf; "
        f"assert conf.__file__.startswith({str(site)!r}), conf.__file__; "
        "initialize_config_module(config_module='conf', version_base=None); "
        "print(compose('config', overrides=['model=resnet50']).model.name)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(site)},
    )
    assert result.stdout.strip() == "resnet50", result.stderr
