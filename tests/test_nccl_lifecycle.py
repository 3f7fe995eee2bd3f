"""The group life cycle bench on the CPU (bench/nccl_lifecycle.py): the form a GPU machine runs
with NCCL, here on gloo, so that it cannot rot before a GPU comes, and so that a group that
leaves something behind at every round shows here first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 8  # round 3 is the baseline: five rounds after it, where a leak of one fd a round shows


def test_rebuilding_the_group_round_after_round_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "lifecycle.json"
    done = subprocess.run(
        [
            sys.executable,
            "bench/nccl_lifecycle.py",
            "--device=cpu",
            f"--rounds={ROUNDS}",
            f"--json={out}",
            "--timeout=30",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["backend"] == "gloo"
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert all(r["allreduce_ok"] for r in rounds)
    assert rounds[0]["rebuild_s"] is None and rounds[0]["enter_s"] > 0  # the first set-up
    assert all(r["rebuild_s"] > 0 for r in rounds[1:])
    assert report["grew"] == [] and report["errors"] == [] and report["ok"]
    assert "probe" in report["shrink"]  # shrink_group was asked, and refused a one-rank group
    assert done.stdout.strip().splitlines()[-1] == report["verdict"]
    assert report["verdict"].startswith(f"OK: {ROUNDS} round(s)")
