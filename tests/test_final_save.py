"""The end keeps its state: when a final checkpoint that failed is retried and when the run gives
up (elastic/final_save.py), and how the steps it could not save are said (launcher/progress.py).
The worker's side, all ranks retrying together and ending with EXIT_UNSAVED, runs end to end in
tests/test_e2e.py (a checkpoint store that fills up)."""

from __future__ import annotations

from typing import Any

import pytest

from elastic import event_types as ev
from elastic.event_types import describe
from elastic.final_save import backoff, retry_in, unsaved_steps
from launcher.progress import not_saved


def event(kind: ev.EventType, **fields: Any) -> dict[str, Any]:
    return {"ts": 1000.0, "event": kind.name, "node": "node0", **fields}


def test_the_pauses_double_from_five_seconds_to_a_minute() -> None:
    assert [backoff(n) for n in range(1, 8)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]


def test_retries_go_on_until_the_limit_the_last_pause_cut_short_to_end_at_it() -> None:
    assert retry_in(1, elapsed_s=0.5, limit_s=600.0) == 5.0
    assert retry_in(6, elapsed_s=100.0, limit_s=600.0) == 60.0
    assert retry_in(9, elapsed_s=570.0, limit_s=600.0) == pytest.approx(30.0)  # at the limit
    assert retry_in(10, elapsed_s=600.0, limit_s=600.0) is None  # spent: give up
    assert retry_in(1, elapsed_s=0.2, limit_s=2.0) == pytest.approx(1.8)
    assert retry_in(1, elapsed_s=0.0, limit_s=0.0) is None  # final_retry_s=0: no retry


def test_the_unsaved_steps_are_those_after_the_newest_checkpoint() -> None:
    assert unsaved_steps(50, 103) == "steps 51-103"
    assert unsaved_steps(102, 103) == "step 103"
    assert unsaved_steps(None, 7) == "steps 1-7"


def test_a_run_that_did_not_finish_names_the_steps_no_checkpoint_holds() -> None:
    step = [event(ev.STEP, step=s) for s in (44, 45, 46)]
    saved = event(ev.CHECKPOINT_SAVED, step=45)
    failed = event(ev.FINAL_SAVE_FAILED, step=103, saved_step=45, attempts=2, waited_s=2.4)
    assert (not_saved([*step, saved, failed]) or "").startswith("NOT SAVED: steps 46-103: ")
    # Stopped (a signal): what followed the newest checkpoint went with the workers.
    assert not_saved([saved, *step]) == (
        "not saved: step 46, trained after the newest checkpoint (up to the last step logged); a "
        "run with the same job_id trains them again"
    )
    assert not_saved([*step[:2], saved]) is None  # stopped right at a checkpoint
    resumed = event(ev.TRAINING_STARTED, resumed_from=46)  # a checkpoint of an earlier launch
    assert not_saved([resumed, *step]) is None
    assert (not_saved(step) or "").startswith("not saved: steps 1-46")  # no checkpoint at all
    assert not_saved([]) is None
    assert describe(failed) == (
        "the final checkpoint (step 103) could not be written in 2 s: steps 46-103 NOT SAVED"
    )
    retry = event(
        ev.FINAL_SAVE_RETRY, step=103, saved_step=45, attempt=1, retry_in_s=5.0, left_s=599.2
    )
    assert describe(retry) == (
        "the final checkpoint (step 103) did not commit: the trained state is kept and the save "
        "retried in 5 s, for up to 599 s more (checkpoint.final_retry_s)"
    )
