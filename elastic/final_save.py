"""The end of a run keeps its state: when a failed final checkpoint is retried, and until when.

That is, when a final checkpoint that failed is tried again, and when the run gives up on it.
Pure functions over numbers every rank agrees on.

The final weights are a run's product: a job that ended "finished" on a checkpoint some steps
older, because the last saves failed (a full disk, a store that is down), would discard what it
trained since. So at the end every rank keeps the trained state in memory, and the ranks retry
the save together after the pauses of :func:`retry_in`, for up to ``checkpoint.final_retry_s``;
each pause is decided from rank 0's clock, shared with every rank by the same all-reduce that
shares whether the save committed (:func:`elastic.saving.final_save`), so that no rank retries
alone. A run that still could not save it ends with :data:`elastic.control.EXIT_UNSAVED`, its
``final_save_failed`` naming :func:`unsaved_steps`.
"""

from __future__ import annotations

FIRST_PAUSE_S = 5.0  # before the first retry
MAX_PAUSE_S = 60.0  # the pauses double up to this


def backoff(attempt: int) -> float:
    """The pause before retry ``attempt`` (1, 2, ...): 5 s, doubling to at most a minute.

    What makes a final save fail (a full disk, a store that is down) is seldom fixed in seconds,
    and each retry writes the whole checkpoint again."""
    return min(MAX_PAUSE_S, FIRST_PAUSE_S * 2.0 ** (attempt - 1))


def retry_in(attempt: int, elapsed_s: float, limit_s: float) -> float | None:
    """The pause before retry ``attempt`` of a final save that did not commit; None to give up.

    ``elapsed_s`` is the time since training ended. None once ``limit_s``
    (``checkpoint.final_retry_s``) is spent: the run gives up. The pause that would end past the
    limit is cut short, so the last retry comes at the limit rather than a minute before it."""
    left = limit_s - elapsed_s
    if left <= 0:
        return None
    return min(backoff(attempt), left)


def unsaved_steps(saved_step: int | None, step: int) -> str:
    """The steps trained but in no checkpoint, in words.

    Those after ``saved_step`` (the newest committed checkpoint's; None when there is none) up
    to ``step``, the last one trained."""
    first = 1 if saved_step is None else saved_step + 1
    return f"step {step}" if first == step else f"steps {first}-{step}"
