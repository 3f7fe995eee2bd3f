"""A worker's checkpoints: when to save, each save started in the background, and the final save.

When to save is :func:`checkpoint_every`; each save starts in the background
(:mod:`elastic.async_checkpoint`). The end waits for the final save and retries it, since the
trained state is the run's product (its words: :mod:`elastic.final_save`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from elastic import config
from elastic import event_types as ev
from elastic.async_checkpoint import WAIT_POLL_S, Started
from elastic.checkpoint import CheckpointManager
from elastic.checkpoint_interval import Measured, choose_interval
from elastic.control import (
    Assignment,
)
from elastic.final_save import retry_in, unsaved_steps
from elastic.manifest import newest_manifest
from elastic.round_end import RoundAborted
from elastic.state import Progress
from elastic.worker import Worker

log = logging.getLogger("elastic.trainer")


def final_save(w: Worker, a: Assignment, ckpt: CheckpointManager, progress: Progress) -> bool:
    """Whether the final state, ``progress``'s, is in a committed checkpoint, as every rank agrees.

    A collective, once its save was started (or found unneeded).

    The final weights are the run's product, so a save of them that failed (a full disk, a store
    that is down) is not the end: every rank keeps the state in memory, and the ranks save it
    again together after :func:`elastic.final_save.retry_in`'s pauses, rank 0 saying so at each
    (``final_save_retry``, which the owner's alert follows), until it commits or
    ``checkpoint.final_retry_s`` is spent; then rank 0 names the steps not saved
    (``final_save_failed``). Rank 0 commits, so its answer and its clock go to every rank in one
    all-reduce per attempt: the ranks decide alike and retry together.
    """
    began = time.monotonic()
    limit_s = w.cfg.checkpoint.final_retry_s
    failed = 0
    while True:
        committed = w.saver.wait(lambda: w.comm.aborted) == progress.step
        saved_step = None
        if a.rank == 0 and not committed:
            # Or it was committed before this round: a state resumed or rolled back to.
            saved_step = newest_saved(ckpt.url)
            committed = saved_step == progress.step
        word = torch.zeros(2, dtype=torch.float64, device=w.device)
        if a.rank == 0:
            word[0], word[1] = float(committed), time.monotonic() - began
        w.comm.all_reduce(word, "final save")
        if word[0].item():
            return True
        failed += 1
        elapsed_s = word[1].item()
        pause_s = retry_in(failed, elapsed_s, limit_s)
        if a.rank == 0:
            report_unsaved(w, progress.step, saved_step, failed, elapsed_s, pause_s)
        if pause_s is None:
            return False
        pause(w, pause_s)
        start_save(w, ckpt, progress, a, 0.0)


def report_unsaved(
    w: Worker,
    step: int,
    saved_step: int | None,
    failed: int,
    elapsed_s: float,
    pause_s: float | None,
) -> None:
    """Report, on rank 0, that the final state is not saved: a retry, or giving up.

    The final state, of ``step``, is not saved after ``failed`` attempts over ``elapsed_s``; the
    newest checkpoint is ``saved_step``'s. Either the save is retried in ``pause_s``
    (``final_save_retry``), or (None) the run gives up (``final_save_failed``)."""
    limit_s = w.cfg.checkpoint.final_retry_s
    lost = unsaved_steps(saved_step, step)
    newest = "none" if saved_step is None else f"the checkpoint of step {saved_step}"
    if pause_s is None:
        w.events.emit(
            ev.FINAL_SAVE_FAILED,
            f"the final checkpoint, of step {step}, could not be written in {failed} "
            f"attempt(s) over {elapsed_s:.0f} s (checkpoint.final_retry_s={limit_s:g}): {lost} "
            f"were trained but are not saved; the newest saved is {newest}. Fix: what the "
            "checkpoint_failed events name, then run again with the same job_id to train them "
            "again",
            level=logging.ERROR,
            step=step,
            saved_step=saved_step,
            attempts=failed,
            waited_s=round(elapsed_s, 3),
        )
        return
    w.events.emit(
        ev.FINAL_SAVE_RETRY,
        f"the final checkpoint, of step {step}, did not commit: {lost} are not saved (the "
        f"newest saved is {newest}). The state is kept in memory; retry {failed} in "
        f"{pause_s:.0f} s, for up to {limit_s - elapsed_s:.0f} s more "
        "(checkpoint.final_retry_s). Fix: what the checkpoint_failed events name",
        level=logging.ERROR,
        step=step,
        saved_step=saved_step,
        attempt=failed,
        retry_in_s=round(pause_s, 3),
        left_s=round(limit_s - elapsed_s, 3),
    )


def newest_saved(url: str) -> int | None:
    """The step of the newest committed checkpoint at ``url`` (rank 0, at the end).

    None when there is none, or when the store cannot be listed, which is then what failed the
    save."""
    try:
        newest = newest_manifest(url)
    except Exception as exc:  # any fsspec backend's error: the store is what is down
        log.warning("could not list the checkpoints at %s: %s: %s", url, type(exc).__name__, exc)
        return None
    return int(newest["step"]) if newest is not None else None


def checkpoint_every(cfg: config.CheckpointConfig, progress: Progress) -> int:
    """Steps between checkpoints: ``every_steps``, or the interval the ranks last agreed on.

    The agreed interval is used when it depends on measurements (``every_minutes``,
    ``interval=auto``)."""
    measured = cfg.interval == config.CheckpointInterval.auto or cfg.every_minutes > 0
    return progress.checkpoint_every if measured and progress.checkpoint_every else cfg.every_steps


def save(
    w: Worker, ckpt: CheckpointManager, progress: Progress, a: Assignment, step_s: float
) -> Progress:
    """Checkpoint this step in the background (:mod:`elastic.async_checkpoint`).

    Training is held only while the state is copied. A save that fails is reported by the saver,
    and training goes on: the newest good checkpoint stays, and the next interval tries again.

    Returns the progress with the interval to the next checkpoint, chosen from what the previous
    save measured on every rank (:func:`elastic.checkpoint_interval.choose_interval`), the same
    on every rank; ``step_s`` is this rank's mean step time since that save.
    """
    w.link.status["phase"] = "checkpoint"
    started = start_save(w, ckpt, progress, a, step_s)
    w.link.status["phase"] = "step"
    if started.previous is None:
        return progress
    interval = choose_interval(w.cfg.checkpoint, Measured.worst(started.previous), a.world_size)
    if interval.steps == checkpoint_every(w.cfg.checkpoint, progress):
        return progress
    if a.rank == 0:
        w.events.emit(
            ev.CHECKPOINT_INTERVAL,
            f"checkpoints every {interval.steps} steps from step {progress.step}: "
            f"{interval.reason}",
            step=progress.step,
            steps=interval.steps,
            reason=interval.reason,
        )
    return replace(progress, checkpoint_every=interval.steps)


def start_save(
    w: Worker, ckpt: CheckpointManager, progress: Progress, a: Assignment, step_s: float
) -> Started:
    """Start the background save of ``progress``'s state (:meth:`BackgroundSaver.start`)."""
    assert w.comm.saves.group is not None  # set up with the round
    return w.saver.start(
        ckpt,
        progress.step,
        w.tensors,
        {"progress": progress.to_dict(), "round": a.round},
        w.comm.saves.group,
        a.round,
        lambda: w.comm.aborted,
        {"step_s": step_s},
    )


def pause(w: Worker, seconds: float) -> None:
    """Wait ``seconds`` between two attempts of the final save, or until the round is left.

    Leaving raises :class:`RoundAborted`; the next round keeps the state and saves it again."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if w.comm.aborted:
            raise RoundAborted("the round was left while the final save waited to be retried")
        time.sleep(min(left, WAIT_POLL_S))
