"""The torchrun recovery bench's pure parts: progress lines into a recovery time and redone
steps, and which node each backend's run kills."""

from __future__ import annotations

import sys

import pytest

from .conftest import REPO, load_bench

sys.path.insert(0, str(REPO / "bench"))  # the bench imports peer_job as its neighbour
bench = load_bench("torchrun_recovery")


def lines(*rows: str) -> list:
    return bench.parse_progress("".join(row + "\n" for row in rows))


def test_a_line_being_written_or_foreign_is_left_out() -> None:
    parsed = bench.parse_progress("start 0 3 10.0 0\nstep 1 3 10.5\nnoise\nstep 2 3 11")
    assert parsed == [bench.Line("start", 0, 3, 10.0, 0), bench.Line("step", 1, 3, 10.5)]
    assert bench.parse_progress("step 2 3 11.25\n") == [bench.Line("step", 2, 3, 11.25)]


def test_recovery_runs_from_the_kill_to_the_first_step_at_world_2() -> None:
    progress = lines(
        "start 0 2 1.0 0",  # a first round that formed before the third node joined
        "step 1 2 1.5",
        "start 0 3 2.0 0",  # a membership change: not a failure, no restart counted
        *(f"step {s} 3 {2 + s / 10}" for s in range(1, 46)),
        "start 40 2 20.0 2",  # resumed from the checkpoint of step 40, after a failed retry
        "step 41 2 21.25",
        "step 42 2 21.5",
    )
    got = bench.survivor_recovery(progress, kill_ts=8.0)
    assert got.recovery_s == pytest.approx(13.25)
    assert (got.redone, got.restarts) == (5, 2)
    # Not yet trained at world 2 after the kill: no figure, whatever came before it.
    assert bench.survivor_recovery(progress[:-3], kill_ts=8.0) == bench.Survivor(None, None)


def test_the_job_recovers_when_its_later_survivor_does() -> None:
    run = bench.Run("c10d", "tuned", "", {})
    # node0 restarted for the membership change (uncounted), node1 for its failed worker
    run.survivors = {"node0": bench.Survivor(7.5, 5, 0), "node1": bench.Survivor(7.75, 5, 1)}
    assert (run.recovery_s, run.redone, run.retries) == (7.75, 5, 0)
    run.survivors["node0"] = bench.Survivor(7.5, 5, 1)  # node0's world-2 worker failed too
    assert run.retries == 0
    run.survivors["node1"] = bench.Survivor(7.75, 5, 2)  # a world-2 attempt failed first
    assert run.retries == 1
    run.survivors["node1"] = bench.Survivor(None, None)
    assert run.recovery_s is None


def test_each_backend_kills_its_node() -> None:
    found = {
        1: {"node": "node0", "rank": 1, "world": 3},
        2: {"node": "node1", "rank": 0, "world": 3},
        3: {"node": "node2", "rank": 2, "world": 3},
    }
    assert bench.choose_victim("etcd-v3", found) == ("node1", 0)
    # c10d: never node0 (its store) nor a node that had rank 0 (the shared workers' store).
    assert bench.choose_victim("c10d", found) == ("node2", 2)
    found[4] = {"node": "node2", "rank": 0, "world": 2}  # rank 0 of an earlier round
    assert bench.choose_victim("c10d", found) is None


def test_a_run_that_did_not_recover_counts_as_the_longest_in_the_median() -> None:
    assert bench.median_recovery([80.5, None, 45.5]) == 80.5
    assert bench.median_recovery([5.0, None, None]) is None  # the median run did not recover
    assert bench.median_recovery([]) is None
