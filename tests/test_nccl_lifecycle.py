"""The group life cycle bench on the CPU (bench/nccl_lifecycle.py): the form a GPU machine runs
with NCCL, here on gloo, so that it cannot rot before a GPU comes, and so that a group that
leaves something behind at every round shows here first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import REPO, load_bench

ROUNDS = 8  # rounds 3-4 are the baseline: four rounds after them show a leak of one fd a round
lifecycle = load_bench("nccl_lifecycle")


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
    assert all(r["teardown_s"] >= 0 for r in rounds[1:])  # each old group shut down, beside
    assert report["grew"] == [] and report["errors"] == [] and report["ok"]
    assert "probe" in report["shrink"]  # shrink_group was asked, and refused a one-rank group
    assert done.stdout.strip().splitlines()[-1] == report["verdict"]
    assert report["verdict"].startswith(f"OK: {ROUNDS} round(s)")


def measured(rss_mib: list[float]) -> list[dict[str, float]]:
    return [{"round": i + 1, "fds": 73, "rss_mib": rss} for i, rss in enumerate(rss_mib)]


def test_memory_that_settles_between_two_levels_has_not_grown_but_a_leak_has() -> None:
    """What NCCL's rounds did on an H200 (host memory warming up until round 6, then two levels
    31 MiB apart) passes; 4 MiB more a round fails, over a run of the same length."""
    h200 = [1009, 1014, 1018, 1052, 1054, 1086, 1120, 1089, 1089, 1120]
    h200 += [1089, 1089, 1120, 1089, 1089, 1120, 1089, 1120, 1090, 1090]
    assert lifecycle.grown(measured(h200)) == []
    leak = [1000 + 4 * i for i in range(20)]
    assert lifecycle.grown(measured(leak)) == [
        "rss_mib 1036 -> 1076 (rounds 3-10's highest -> round 20)"
    ]
    assert lifecycle.grown(measured([1000])) == []  # one round shows no growth
    assert lifecycle.grown(measured([1000, 1040])) == [
        "rss_mib 1000 -> 1040 (rounds 1-1's highest -> round 2)"
    ]
