"""What a person watching a run sees: progress while it trains, a summary when it ends.

Both are read from the run's event files, so the display needs no channel of its own to the
workers, and a summary can be printed for any run directory after the fact. The step lines carry
the estimated time left (:mod:`elastic.eta`); the summary says where the curves are
(``<run_dir>/tensorboard/``, :mod:`elastic.curves`; ``curves.png``, :mod:`launcher.curves_png`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from elastic import event_types as ev
from elastic.curves import TENSORBOARD_DIR
from elastic.eta import Pace, as_text
from elastic.event_types import accuracy, crashed, describe, lr_text
from elastic.events import read_events
from elastic.final_save import unsaved_steps
from launcher.curves_png import CURVES_PNG


class ProgressDisplay:
    """A progress bar on a terminal; elsewhere (logs, CI) plain lines, steps at most every few s."""

    def __init__(self, stream: IO[str] = sys.stdout, min_interval_s: float = 2.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.min_interval_s = min_interval_s
        self._last_step_line = 0.0
        self._bar: tqdm[Any] | None = None
        self._pace = Pace()  # rank 0's recent steps: the time left

    def handle(self, events: Iterable[dict[str, Any]]) -> None:
        for e in events:
            if ev.TRAINING_STARTED.matches(e):
                self._pace.total_samples = e["total_samples"]
                self._pace.add(e["ts"], e["samples_seen"])
                if self.tty:
                    self._open_bar(e["total_samples"], e["samples_seen"])
            if ev.STEP.matches(e):
                self._pace.add(e["ts"], e["samples"])
            if ev.STEP.matches(e) and self._bar is not None:
                self._bar.n = e["samples"]
                self._bar.set_postfix_str(
                    f"step {e['step']} loss {e['loss']:.3f} world {e['world_size']} "
                    f"{e['samples_per_s']:.0f}/s ETA {as_text(self._pace.eta_s())}",
                    refresh=True,
                )
                continue
            line = describe(e)
            if line is None:
                continue
            if ev.STEP.matches(e):
                now = time.monotonic()
                if now - self._last_step_line < self.min_interval_s:
                    continue
                self._last_step_line = now
                line += f" | ETA {as_text(self._pace.eta_s())}"
            self._write(f"[{time.strftime('%H:%M:%S', time.localtime(e['ts']))}] {line}")

    def _open_bar(self, total: int, done: int) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=total, initial=done, unit="sample", file=self.stream, dynamic_ncols=True
            )
        else:
            self._bar.reset(total=total)
            self._bar.n = done

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def not_saved(events: list[dict[str, Any]]) -> str | None:
    """The steps an unfinished run trained that no checkpoint holds, in words (None: none).

    A final save that failed names them (``final_save_failed``). A run stopped otherwise (a
    signal, a failure) trained at least to its last logged step, and whatever followed its
    newest checkpoint is gone with the workers."""
    failed = next((e for e in reversed(events) if ev.FINAL_SAVE_FAILED.matches(e)), None)
    if failed is not None:
        return (
            f"NOT SAVED: {unsaved_steps(failed['saved_step'], failed['step'])}: trained, but the "
            "final checkpoint could not be written within checkpoint.final_retry_s (the "
            "checkpoint_failed lines above say why); run again with the same job_id, once fixed, "
            "to train them again"
        )
    steps = ev.STEP.of(events)
    saved = [e["step"] for e in ev.CHECKPOINT_SAVED.of(events)] + [
        e["resumed_from"] for e in ev.TRAINING_STARTED.of(events) if e["resumed_from"] is not None
    ]
    newest = max(saved, default=None)
    if not steps or (newest is not None and steps[-1]["step"] <= newest):
        return None
    return (
        f"not saved: {unsaved_steps(newest, steps[-1]['step'])}, trained after the newest "
        "checkpoint (up to the last step logged); a run with the same job_id trains them again"
    )


def summary(run_dir: Path, checkpoint_url: str, job_id: str, since: float = 0.0) -> str:
    """Where a run's outputs are and how it went, from its events since ``since``."""
    events = [e for e in read_events(run_dir) if e["ts"] >= since]
    steps = ev.STEP.of(events)
    done = next((e for e in reversed(events) if ev.TRAINING_DONE.matches(e)), None)
    saved = ev.CHECKPOINT_SAVED.of(events)
    rounds = ev.ROUND_FORMED.of(events)
    failures = [e for e in events if crashed(e)]
    lines = []
    if done:
        took = done["ts"] - events[0]["ts"] if events else 0.0
        lines.append(
            f"job {job_id} finished: step {done['step']}, {done['samples_seen']} samples, "
            f"world size {done['world_size']}, {took:.1f} s"
        )
    else:
        lines.append(f"job {job_id} did not finish")
        lost = not_saved(events)
        if lost is not None:
            lines.append(lost)
    if steps:
        lines.append(
            f"last step {steps[-1]['step']}: loss {steps[-1]['loss']:.4f}, "
            f"lr {lr_text(steps[-1]['lr'])}"
        )
    evaluated = ev.EVALUATED.of(events)
    if evaluated:
        last = evaluated[-1]
        lines.append(f"validation at step {last['step']}: " + accuracy(last))
    failed_saves = sum(ev.CHECKPOINT_FAILED.matches(e) for e in events)
    lines.append(
        f"rounds formed: {len(rounds)}, worker failures seen: {len(failures)}, "
        f"checkpoints saved: {len(saved)}"
        + (f", checkpoints failed: {failed_saves}" if failed_saves else "")
    )
    unfit = sorted({e["node"] for e in ev.HEALTH_FAILED.of(events)})
    if unfit:
        lines.append(
            f"failed their health checks and stayed out: {', '.join(unfit)} (the reasons are "
            "above and in their logs; python -m launcher.commands.doctor runs the checks by hand)"
        )
    slow = ev.STRAGGLER.of(events)
    if slow:
        evicted = {
            e["peer"]
            for e in ev.QUARANTINED.of(events)
            if any("straggler" in r for r in e["reasons"])
        }
        named = sorted({e["node"] for e in slow})
        lines.append(
            "stragglers: "
            + ", ".join(
                f"{n} (up to {max(e['slowdown'] for e in slow if e['node'] == n):.1f}x"
                + (", evicted)" if n in evicted else ")")
                for n in named
            )
        )
    lines += [
        f"run directory: {run_dir}",
        f"logs:          {run_dir / 'logs'}",
        f"events:        {run_dir / 'events'}",
    ]
    if (run_dir / CURVES_PNG).is_file():
        lines.append(f"curves:        {run_dir / CURVES_PNG}")
    if (run_dir / TENSORBOARD_DIR).is_dir():
        lines.append(f"tensorboard:   tensorboard --logdir {run_dir / TENSORBOARD_DIR}")
    lines += [
        f"checkpoints:   {checkpoint_url}"
        + (f" (newest: step {saved[-1]['step']})" if saved else ""),
        f"resume or extend it: run again with job_id={job_id} and the same overrides, "
        "e.g. trainer.epochs=<more>",
    ]
    return "\n".join(lines)
