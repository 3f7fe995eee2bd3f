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
from elastic.control import EXIT_UNSAVED
from elastic.curves import TENSORBOARD_DIR
from elastic.eta import Pace, as_text
from elastic.events import read_events
from elastic.final_save import unsaved_steps
from launcher.curves_png import CURVES_PNG

# A worker's exit codes that are no failure of its own: the job trained (its final state saved, or
# not: the final save's lines say so), or the exit not known.
ENDED = (0, None, EXIT_UNSAVED)


def describe(e: dict[str, Any]) -> str | None:
    """One human line for an event worth showing, or None."""
    if ev.STEP.matches(e):
        metrics = "".join(f"{name} {v:.4g} | " for name, v in e.get("metrics", {}).items())
        return (
            f"step {e['step']:>6} | epoch {e['epoch']} | loss {e['loss']:.4f} | {metrics}"
            f"{e['samples_per_s']:7.1f} samples/s | world {e['world_size']} | "
            f"lr {e['lr']:.5f}"
        )
    if ev.ROUND_FORMED.matches(e):
        return (
            f"round {e['round']} formed: world size {e['world_size']} ({', '.join(e['members'])})"
        )
    if ev.TRAINING_STARTED.matches(e):
        if e["in_place"]:
            origin = f"state of step {e['step']} kept in memory"
        elif e["resumed_from"] is not None:
            origin = f"resumed from the checkpoint of step {e['resumed_from']}"
        else:
            origin = "from scratch"
        return (
            f"training at world size {e['world_size']}, {origin} "
            f"({e['samples_seen']}/{e['total_samples']} samples)"
        )
    if ev.RECOVERED.matches(e):
        return (
            f"recovered in place at world size {e['world_size']}: rendezvous "
            f"{e['rendezvous_s']:.2f} s, rebuild {e['rebuild_s']:.2f} s, state sync "
            f"{e['sync_s']:.2f} s, first step {e['first_step_s']:.2f} s"
        )
    if ev.STRAGGLER.matches(e):
        return (
            f"{e['node']}: rank {e['rank']} is a straggler at step {e['step']}, computing "
            f"{e['slowdown']:.1f}x slower than the median ({e['compute_s']:.3f} s a step against "
            f"{e['median_s']:.3f} s)"
        )
    if ev.PEER_EVICTED.matches(e):
        return f"{e['node']}: evicted {e['peer']} ({e['reason']})"
    if ev.WORKER_FROZEN.matches(e):
        return f"{e['node']}: worker {e['local_rank']} frozen ({e['reason']})"
    if ev.LR_CHANGED.matches(e):
        return (
            f"{e['optimizer']} LR {e['old_lr']:.5f} -> {e['lr']:.5f} for world size "
            f"{e['old_world_size']} -> {e['world_size']} ({e['policy']})"
        )
    if ev.EVALUATED.matches(e):
        return f"validation after epoch {e['epoch']:g} (step {e['step']}): " + accuracy(e)
    if ev.CHECKPOINT_SAVED.matches(e):
        return f"checkpoint of step {e['step']} saved in {e['seconds']:.2f} s"
    if ev.CHECKPOINT_FAILED.matches(e):
        return (
            f"checkpoint of step {e['step']} FAILED: {e['reason']}. Fix: {e['fix']}. "
            "Training goes on; the newest good checkpoint is kept"
        )
    if ev.CURVES_OFF.matches(e):
        return f"{e['node']}: TensorBoard curves off ({e['reason']})"
    if ev.WORKER_FAILED.matches(e):
        return f"{e['node']}: worker rank {e['rank']} failed: {e['error']}"
    if ev.CHECKPOINT_SKIPPED.matches(e):
        return f"checkpoint {e['url']} skipped: {e['reason']}"
    if ev.WORKER_EXITED.matches(e) and e["code"] not in ENDED and not e["stopped_by_agent"]:
        return f"{e['node']}: worker {e['local_rank']} exited with code {e['code']}"
    if ev.RESTART_LIMIT.matches(e):
        return (
            f"{e['node']}: workers crashed {e['crashes']} times "
            f"(cluster.max_restarts={e['max_restarts']}); it leaves the job"
        )
    if ev.FAILURE_REPORTED.matches(e):
        return f"{e['node']}: reported a failure ({e['reason']})"
    if ev.FENCED.matches(e):
        return f"{e['node']}: fenced ({e['reason']})"
    if ev.HEALTH_CHECKED.matches(e) and e["ok"]:
        counts = ", ".join(f"{n} {s}" for s, n in e["counts"].items() if n)
        warned = "".join(f"; warning: {w}" for w in e["warnings"])
        return f"{e['node']}: health checks passed in {e['seconds']:.1f} s ({counts}){warned}"
    if ev.HEALTH_FAILED.matches(e):
        until = e["quarantined_until"]
        quarantine = (
            f"; quarantined until {time.strftime('%H:%M:%S', time.localtime(until))}"
            if until
            else ""
        )
        return (
            f"{e['node']}: failed its health checks and does not join{quarantine}:\n  "
            + "\n  ".join(e["failures"])
        )
    if ev.QUARANTINED.matches(e):
        return (
            f"{e['peer']} quarantined until "
            f"{time.strftime('%H:%M:%S', time.localtime(e['until']))} by {e['by']} "
            f"({'; '.join(e['reasons'])})"
        )
    if ev.QUARANTINE_WAIT.matches(e):
        return f"{e['node']}: quarantined, waiting {e['left_s']:.0f} s before checking again"
    if ev.NODE_LEFT.matches(e):
        why = f": {e['reason']}" if e.get("reason") else ""
        return f"{e['node']}: left the job (exit code {e['code']}){why}"
    if ev.ETCD_UNREACHABLE.matches(e):
        return (
            f"{e['node']}: etcd does not answer ({e['error']}); training goes on, retrying for "
            f"up to {e['grace_s']:g} s"
        )
    if ev.ETCD_REACHABLE.matches(e):
        return f"{e['node']}: etcd answers again after {e['down_s']:.1f} s"
    if ev.ETCD_LOST.matches(e):
        return f"{e['node']}: {e['reason']}. Fix: {e['fix']}"
    if ev.TRAINING_DONE.matches(e):
        return f"training done: step {e['step']}, {e['samples_seen']} samples"
    if ev.FINAL_SAVE_RETRY.matches(e):
        return (
            f"the final checkpoint (step {e['step']}) did not commit: the trained state is kept "
            f"and the save retried in {e['retry_in_s']:.0f} s, for up to {e['left_s']:.0f} s "
            "more (checkpoint.final_retry_s)"
        )
    if ev.FINAL_SAVE_FAILED.matches(e):
        return (
            f"the final checkpoint (step {e['step']}) could not be written in "
            f"{e['waited_s']:.0f} s: {unsaved_steps(e['saved_step'], e['step'])} NOT SAVED"
        )
    return None


def accuracy(e: dict[str, Any]) -> str:
    """An ``evaluated`` event's figures, as the progress line and the summary print them."""
    return (
        f"top-1 {100 * e['top1']:.2f} %, top-5 {100 * e['top5']:.2f} %, loss {e['loss']:.4f} "
        f"({e['count']} evaluated, {e['seconds']:.1f} s)"
    )


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
    """For a run that did not finish: the steps it trained that no checkpoint holds, in words
    (None: none). A final save that failed names them (``final_save_failed``); a run stopped
    otherwise (a signal, a failure) trained at least to its last logged step, and whatever
    followed its newest checkpoint is gone with the workers."""
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
    crashed = [
        e
        for e in events
        if ev.WORKER_EXITED.matches(e) and e["code"] not in ENDED and not e["stopped_by_agent"]
    ]
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
            f"last step {steps[-1]['step']}: loss {steps[-1]['loss']:.4f}, lr {steps[-1]['lr']:.5f}"
        )
    evaluated = ev.EVALUATED.of(events)
    if evaluated:
        last = evaluated[-1]
        lines.append(f"validation at step {last['step']}: " + accuracy(last))
    failed_saves = sum(ev.CHECKPOINT_FAILED.matches(e) for e in events)
    lines.append(
        f"rounds formed: {len(rounds)}, worker failures seen: {len(crashed)}, "
        f"checkpoints saved: {len(saved)}"
        + (f", checkpoints failed: {failed_saves}" if failed_saves else "")
    )
    unfit = sorted({e["node"] for e in ev.HEALTH_FAILED.of(events)})
    if unfit:
        lines.append(
            f"failed their health checks and stayed out: {', '.join(unfit)} (the reasons are "
            "above and in their logs; python -m launcher.doctor runs the checks by hand)"
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
