"""Hydra's ``--multirun`` on ``python -m launcher``: every job of a sweep runs, with its own job
id, run directory and exit status, and the sweep's outcome is summarised at the end (the task
function's ``sys.exit`` once ended a sweep after its first job). A sweep that trains is in the
docs/configuration.md (``./dev.sh run --multirun trainer.epochs=1 optim.lr=0.1,0.2``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.cli import Ended, of_sweep, outcome


def test_every_job_of_a_sweep_runs_and_the_outcome_names_each(tmp_path: Path) -> None:
    """Three jobs whose values the launch refuses (at once: no job trains, CI's time is short):
    each is composed, launched and given its own exit status, and the sweep goes on after the
    first, where it used to end."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--multirun",
            "job_id=sweep",
            f"run_dir={tmp_path / 'run'}",
            "optim.lr=-1,-2,-3",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    for n, lr in enumerate(("-1", "-2", "-3")):
        assert f"optim.lr={float(lr)}: must be positive" in out
        assert (
            f"sweep-{n}                  exit 2   optim.lr={lr}  ({tmp_path / 'run' / str(n)})"
            in out
        )
    assert "sweep: 3 job(s), 3 failed" in out
    assert not (tmp_path / "run").exists()  # refused before anything started
    assert list((tmp_path / "runs").glob("sweep-*/multirun.yaml"))  # Hydra's record of it


def test_a_swept_job_gets_its_own_job_id_and_run_directory() -> None:
    given = OmegaConf.create({"job_id": "exp", "run_dir": "/r/exp", "optim": {"lr": 0.1}})
    job = of_sweep(given, 2, began="20261127-110000")
    assert (job.job_id, job.run_dir, job.optim.lr) == ("exp-2", "/r/exp/2", 0.1)
    assert (given.job_id, given.run_dir) == ("exp", "/r/exp")  # the sweep's own, untouched
    unnamed = of_sweep(OmegaConf.create({"job_id": "", "run_dir": ""}), 0, "20261127-110000")
    assert (unnamed.job_id, unnamed.run_dir) == ("20261127-110000-0", "")  # runs/<job id>


def test_a_single_job_exits_with_its_own_code_and_a_sweep_with_1_if_any_failed(capsys) -> None:
    one = Ended("a", "/r/a", ("optim.lr=0.1",), 3, swept=False)
    assert outcome([one]) == 3 and capsys.readouterr().out == ""
    ok = Ended("s-0", "/r/0", ("x=1", "optim.lr=0.1"), 0, swept=True)
    bad = Ended("s-1", "/r/1", ("x=1", "optim.lr=0.2"), 2, swept=True)
    assert outcome([ok]) == 0
    assert outcome([ok, bad]) == 1
    printed = capsys.readouterr().out
    assert "optim.lr=0.2  (/r/1)" in printed and "x=1" not in printed  # what the sweep varied


@pytest.mark.parametrize(
    ("flags", "printed"),
    [
        (["--help"], "Powered by Hydra"),
        (["--cfg", "job"], "rendezvous:"),
        (["--cfg", "job", "--resolve", "job_id=x"], "job_id: x"),
        (["--info"], "Config search path"),
        (["cluster.min_nodes=9"], "cluster.min_nodes=9: more than the most nodes"),
    ],
)
def test_hydras_own_flags_exit_0_and_a_bad_config_2(
    flags: list[str], printed: str, tmp_path: Path
) -> None:
    """A script that composes the config to check it reads the exit code (Hydra's flags launch
    no job, which the sweep's outcome once took for a failure)."""
    done = subprocess.run(
        [sys.executable, "-m", "launcher", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == (2 if flags[0].startswith("cluster") else 0), done.stderr[-2000:]
    assert printed in done.stdout + done.stderr
