#!/usr/bin/env bash
# One entry point that sets itself up: creates .venv and installs the project on first use
# (and again whenever pyproject.toml changes), then
#   ./dev.sh run [overrides...]    the main job (python -m launcher with Hydra overrides)
#   ./dev.sh test [pytest args...] ruff, then the test suite, ELASTIC_TEST_PROCS (2) tests at a time,
#                                  each skip named with its reason
#                                  (what CI runs)
#   ./dev.sh bench [args...]       the recovery benchmark against the torchrun peer
#   ./dev.sh gpu-wheels [DIR]      the wheels the offline GPU machine lacks, into DIR (gpu-wheels)
#   ./dev.sh gpu-rehearsal [OUT]   here, before a loan: the GPU proof's reduced form and the
#                                  tests that reach torch.distributed, under the GPU machine's
#                                  torch in .venv-gpu/ (bench/gpu_rehearsal.py)
#   ./dev.sh gpu-proof [OUT]       on the GPU machine: the GPU proof with its own python3 and the
#                                  wheels of gpu-wheels/, no venv (bench/gpu_proof.py)
set -euo pipefail
cd "$(dirname "$0")"
venv=${ELASTIC_VENV:-.venv}
python=${PYTHON:-python3}

if [ "${1:-}" = gpu-proof ]; then  # offline: no venv, nothing downloaded
  shift
  exec "$python" bench/gpu_proof.py "$@"
fi

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "dev.sh: Python 3.10 or newer is needed (found $("$python" --version 2>&1))" >&2; exit 2; }
stamp="$venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "dev.sh: installing into $venv (the first time takes a minute or two: torch is large)" >&2
  "$python" -m venv "$venv"
  # Byte-compiled here once: with PYTHONDONTWRITEBYTECODE set (as on this machine), a venv
  # installed with --no-compile compiles torch again in every process (CI ran twice as slow).
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test]" 2>&1 \
    | grep -v '^WARNING: Location' >&2 || true
  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python "$venv/bin/python" -c 'import torch, torchvision, etcd3, hydra, launcher' \
    || { echo "dev.sh: installation failed; see the pip output above" >&2; exit 1; }
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
export PATH="$PWD/$venv/bin:$PATH"

command=${1:-run}
[ $# -gt 0 ] && shift
case "$command" in
  run) exec python -m launcher "$@" ;;
  # Two tests at a time (pytest-xdist): most of a test's time is its processes starting and
  # waiting on each other: two at once took 17-21 min of pytest on a clean clone on 2 cores. A
  # module whose costly fixture is shared is kept on one worker (pytest.mark.xdist_group).
  test) ruff check . && exec python -m pytest -q -rs -n "${ELASTIC_TEST_PROCS:-2}" --dist loadgroup "$@" ;;
  bench) exec python bench/recovery.py "$@" ;;
  gpu-wheels) exec python bench/gpu_wheels.py prepare "${1:-gpu-wheels}" ;;
  gpu-rehearsal) exec python bench/gpu_rehearsal.py "$@" ;;
  *) echo "usage: ./dev.sh run|test|bench|gpu-wheels|gpu-rehearsal|gpu-proof [args...]" >&2; exit 2 ;;
esac
