"""The peers' step logs read into a stall and redone steps (bench/peer_job.py).

Both peers write the same lines; they differ in what follows a fault. torchrun's survivors
restart and resume from a checkpoint (a ``start`` line after the fault), and torchft's go on
in the same process with the failed step trained again (no ``start`` line). Neither peer, nor
torchft, is run here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import REPO, load_bench

sys.path.insert(0, str(REPO / "bench"))
peer_job = load_bench("peer_job")


def write(job: object, node: str, *lines: str) -> None:
    (job.logs / f"{node}.log").write_text("".join(line + "\n" for line in lines))


def test_a_restarted_job_recovers_at_its_first_step_and_redoes_back_to_its_checkpoint(
    tmp_path: Path,
) -> None:
    job = peer_job.PeerJob(tmp_path / "torchrun")
    before = [f"step {s} {10 + s / 10:.1f} 3" for s in range(1, 16)]
    for node in ("node0", "node1"):
        write(
            job,
            node,
            "start 9.0 world=3 rank=0 from_step=0 init_s=1.0",
            *before,
            "start 20.0 world=2 rank=0 from_step=10 init_s=2.0",
            "step 11 20.25 2",
        )
    write(job, "node2", "start 9.0 world=3 rank=2 from_step=0 init_s=1.0", *before)
    found = job.recovery(11.55, "node2")
    assert found.stall_s == pytest.approx(20.25 - 11.55)
    assert found.redone_steps == 5  # steps 11 to 15, trained again from the checkpoint of 10


def test_a_job_that_goes_on_recovers_once_a_step_beyond_the_one_in_flight_is_done(
    tmp_path: Path,
) -> None:
    job = peer_job.PeerJob(tmp_path / "torchft")
    before = [f"step {s} {10 + s / 10:.1f} 3" for s in range(1, 16)]
    survivor = [*before, "step 16 17.0 2", "step 17 17.5 2"]  # 16: the step in flight, again
    write(job, "node0", "start 9.0 world=3 rank=0 from_step=0 init_s=1.0", *survivor)
    write(job, "node1", "start 9.0 world=3 rank=1 from_step=0 init_s=1.0", *survivor)
    write(job, "node2", "start 9.0 world=3 rank=2 from_step=0 init_s=1.0", *before)
    found = job.recovery(11.55, "node2")
    assert (found.stall_s, found.redone_steps) == (pytest.approx(17.5 - 11.55), 0)
    assert job.pace()[3] == pytest.approx(32 * 3 / 0.1)
    # Until the step beyond the one in flight is done, no progress yet.
    write(job, "node0", "start 9.0 world=3 rank=0 from_step=0 init_s=1.0", *survivor[:-1])
    write(job, "node1", "start 9.0 world=3 rank=1 from_step=0 init_s=1.0", *survivor[:-1])
    assert job.recovery(11.55, "node2").stall_s is None
