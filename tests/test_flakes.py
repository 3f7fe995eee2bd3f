"""The flake hunt's own logic (bench/flakes.py): a failure's timeline and its settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import load_bench

flakes = load_bench("flakes")


def test_a_failures_timeline_merges_every_jobs_events_in_time_order(tmp_path: Path) -> None:
    for job, node, events in (
        ("run", "node0", [(10.0, "round_joined"), (12.5, "strike")]),
        ("run", "node1", [(11.0, "peer_evicted")]),
        ("other", "node0", [(9.0, "agent_started")]),
    ):
        folder = tmp_path / "test0" / job / "events"
        folder.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"ts": ts, "node": node, "event": kind, "round": 2}) for ts, kind in events
        ]
        (folder / f"{node}.jsonl").write_text("\n".join([*lines, "{torn"]) + "\n")
    rows = flakes.timeline(tmp_path).splitlines()
    assert [r.split()[3] for r in rows] == [
        "agent_started",
        "round_joined",
        "peer_evicted",
        "strike",
    ]
    assert rows[0].split()[:3] == ["0.00", "other", "node0"]
    assert rows[-1].split()[:3] == ["3.50", "run", "node0"]
    assert '"round": 2' in rows[-1]


def test_an_unknown_load_is_named_with_the_ones_there_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        flakes.parse(["--load", "cpu+disk"])
    assert "--load cpu+disk: unknown ['disk']; use idle, cpu, io, net" in capsys.readouterr().err
    assert flakes.parse([]).load == ["idle"]
