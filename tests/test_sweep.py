"""Hydra's ``--multirun`` on ``python -m launcher``: every job of a sweep runs, with its own job
id, run directory and exit status, and the sweep's outcome is summarised at the end (the task
function's ``sys.exit`` once ended a sweep after its first job)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from elastic import event_types as ev
from elastic.events import read_events
from launcher.cli import Ended, outcome

from .conftest import FAST_JOB


def test_every_job_of_a_sweep_runs_in_its_own_run_directory_and_the_outcome_names_each(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--multirun",
            "job_id=sweep",
            f"run_dir={run_dir}",
            *FAST_JOB,
            "cluster.nodes=1",
            "trainer.epochs=1",
            "optim.lr=-1,0.1",  # the first job is refused, the second trains
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]  # one job of two failed
    assert "optim.lr=-1.0: must be positive" in out
    summary = out[out.index("sweep: 2 job(s), 1 failed") :]
    assert f"sweep-0                  exit 2   optim.lr=-1  ({run_dir / '0'})" in summary
    assert f"sweep-1                  ok       optim.lr=0.1  ({run_dir / '1'})" in summary
    assert not (run_dir / "0").exists()  # refused before anything started
    events = read_events(run_dir / "1")
    assert "job_id: sweep-1\n" in (run_dir / "1" / "config.yaml").read_text()
    assert any(ev.TRAINING_DONE.matches(e) for e in events)
    assert list((tmp_path / "runs").glob("sweep-*/multirun.yaml"))  # Hydra's record of it


def test_a_single_job_exits_with_its_own_code_and_a_sweep_with_1_if_any_failed(capsys) -> None:
    one = Ended("a", "/r/a", ("optim.lr=0.1",), 3, swept=False)
    assert outcome([one]) == 3 and capsys.readouterr().out == ""
    ok = Ended("s-0", "/r/0", ("x=1", "optim.lr=0.1"), 0, swept=True)
    bad = Ended("s-1", "/r/1", ("x=1", "optim.lr=0.2"), 2, swept=True)
    assert outcome([ok]) == 0
    assert outcome([ok, bad]) == 1
    printed = capsys.readouterr().out
    assert "optim.lr=0.2  (/r/1)" in printed and "x=1" not in printed  # what the sweep varied
