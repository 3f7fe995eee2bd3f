"""The GPU proof rehearsed on the CPU under the GPU machine's torch, before a loan.

The lent machine runs torch 2.11 under Python 3.12; this project is developed on torch 2.14
under 3.11. A collective, argument or binding that 2.11 lacks fails only there, within the
15 minutes a loan lasts: on 2026-11-30 the coalesced all-gather that DTensor's ``full_tensor``
calls on an abortable gloo mesh did (``elastic.abortable_group.PER_PAIR``). A venv of the
machine's versions (:data:`GPU_TORCH`, under ``.venv-gpu/``, made once) runs here:

1. the tests that reach torch.distributed, DTensor, FSDP2, DCP and the data pipeline
   (:data:`TESTS`), on the CPU: their GPU tests skip;
2. the proof's reduced form (``bench/gpu_proof.py --device cpu``), with the project's other
   packages installed from the GPU wheels (``./dev.sh gpu-wheels``), as on the machine.

    ./dev.sh gpu-rehearsal [OUT]      # about 5 minutes the first time (torch 2.11), 4 after
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, loaded as a module too

from gpu_wheels import PYTHON  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-gpu"
# The machine's torch and torchvision, as the proof's environment part found them (2026-11-28).
GPU_TORCH = ("torch==2.11.0", "torchvision==0.26.0")
TESTS = (
    "tests/test_sharding.py",
    "tests/test_abortable_group.py",
    "tests/test_communicator.py",
    "tests/test_nccl_lifecycle.py",
    "tests/test_state.py",
    "tests/test_checkpoint.py",
    "tests/test_async_checkpoint.py",
    "tests/test_pipeline.py",
    "tests/test_precision.py",
    "tests/test_jobs.py",
    "tests/test_gpu.py",
)
# Tests of torch 2.14's own ways rather than of the runtime, left out under the machine's torch.
_FREED = "test_a_round_that_a_peer_broke_is_freed_once_its_end_is_recorded"
NOT_THERE = {
    f"tests/test_communicator.py::{_FREED}": "counts gloo's transport thread by the name torch "
    "2.14 gives it (2.11 leaves it unnamed)",
}
INSTALL_TIMEOUT_S = 1200  # torch 2.11 and its CUDA libraries: a few GB from the registry


def stamp() -> Path:
    """The file that says the venv holds :data:`GPU_TORCH` and this ``pyproject.toml``'s needs."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + str(GPU_TORCH).encode())
    return VENV / f".installed-{digest.hexdigest()[:16]}"


def version_of(python: str) -> str | None:
    """``python``'s major.minor, or None where it does not run.

    Absent, or a pyenv shim of a version not selected: such a shim is on PATH all the same."""
    try:
        found = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def ensure_venv(python: str) -> Path:
    """The venv's interpreter, made and installed first where :func:`stamp` is missing."""
    if not stamp().exists():
        version = version_of(python)
        if version is None:
            raise SystemExit(
                f"gpu-rehearsal: {python} does not run here. Fix: install Python {PYTHON}, the "
                f"GPU machine's, or pass --python PATH (a pyenv version's bin/python, say)"
            )
        if version != PYTHON:
            print(f"gpu-rehearsal: Python {version}, not the GPU machine's {PYTHON}", flush=True)
        print(f"gpu-rehearsal: installing {', '.join(GPU_TORCH)} into {VENV}", flush=True)
        subprocess.run([python, "-m", "venv", "--clear", str(VENV)], check=True)
        pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run(
            [*pip, "--disable-pip-version-check", "-e", ".[test]", *GPU_TORCH],
            cwd=REPO,
            check=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        stamp().touch()
    return VENV / "bin" / "python"


def pytest_argv(python: Path) -> list[str]:
    """The tests of :data:`TESTS` under ``python``, two at a time, less :data:`NOT_THERE`."""
    left_out = [arg for test in NOT_THERE for arg in ("--deselect", test)]
    return [str(python), "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", *TESTS, *left_out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="the proof's report folder")
    parser.add_argument("--python", default=f"python{PYTHON}", help="the GPU machine's Python")
    args = parser.parse_args()
    out = args.out or Path(f"gpu-rehearsal-{time.strftime('%Y%m%d-%H%M%S')}")
    python = ensure_venv(args.python)
    for test, why in NOT_THERE.items():
        print(f"gpu-rehearsal: left out {test}: {why}")
    tests = subprocess.run(pytest_argv(python), cwd=REPO).returncode
    wheels = REPO / "gpu-wheels"
    prepare = [sys.executable, "bench/gpu_wheels.py", "prepare", str(wheels)]
    proved = subprocess.run(prepare, cwd=REPO).returncode
    if proved == 0:
        proof = [str(python), "bench/gpu_proof.py", "--device", "cpu", "--wheels", str(wheels)]
        proved = subprocess.run([*proof, str(out)], cwd=REPO).returncode
    verdict = {True: "passed", False: "FAILED"}
    print(
        f"gpu-rehearsal under {', '.join(GPU_TORCH)}: the tests {verdict[tests == 0]}, "
        f"the proof's reduced form {verdict[proved == 0]} ({out / 'report.md'})"
    )
    return 0 if tests == proved == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
