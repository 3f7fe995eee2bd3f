"""What a person watching a run sees: progress while it trains, a summary when it ends.

Both are read from the run's event files, so the display needs no channel of its own to the
workers, and a summary can be printed for any run directory after the fact.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from elastic.events import read_events


def describe(ev: dict[str, Any]) -> str | None:
    """One human line for an event worth showing, or None."""
    kind = ev["event"]
    if kind == "step":
        return (
            f"step {ev['step']:>6} | epoch {ev['epoch']} | loss {ev['loss']:.4f} | "
            f"{ev['samples_per_s']:7.1f} samples/s | world {ev['world_size']} | "
            f"lr {ev['lr']:.5f}"
        )
    if kind == "round_formed":
        return (
            f"round {ev['round']} formed: world size {ev['world_size']} "
            f"({', '.join(ev['members'])})"
        )
    if kind == "training_started":
        if ev["in_place"]:
            origin = f"state of step {ev['step']} kept in memory"
        elif ev["resumed_from"] is not None:
            origin = f"resumed from the checkpoint of step {ev['resumed_from']}"
        else:
            origin = "from scratch"
        return (
            f"training at world size {ev['world_size']}, {origin} "
            f"({ev['samples_seen']}/{ev['total_samples']} samples)"
        )
    if kind == "recovered":
        return (
            f"recovered in place at world size {ev['world_size']}: rendezvous "
            f"{ev['rendezvous_s']:.2f} s, rebuild {ev['rebuild_s']:.2f} s, state sync "
            f"{ev['sync_s']:.2f} s, first step {ev['first_step_s']:.2f} s"
        )
    if kind == "peer_evicted":
        return f"{ev['node']}: evicted {ev['peer']} ({ev['reason']})"
    if kind == "worker_frozen":
        return f"{ev['node']}: worker {ev['local_rank']} frozen ({ev['reason']})"
    if kind == "lr_changed":
        return (
            f"{ev['optimizer']} LR {ev['old_lr']:.5f} -> {ev['lr']:.5f} for world size "
            f"{ev['old_world_size']} -> {ev['world_size']} ({ev['policy']})"
        )
    if kind == "evaluated":
        return f"validation after epoch {ev['epoch']:g} (step {ev['step']}): " + accuracy(ev)
    if kind == "checkpoint_saved":
        return f"checkpoint of step {ev['step']} saved in {ev['seconds']:.2f} s"
    if kind == "checkpoint_failed":
        return (
            f"checkpoint of step {ev['step']} FAILED: {ev['reason']}. Fix: {ev['fix']}. "
            "Training goes on; the newest good checkpoint is kept"
        )
    if kind == "worker_failed":
        return f"{ev['node']}: worker rank {ev['rank']} failed: {ev['error']}"
    if kind == "checkpoint_skipped":
        return f"checkpoint {ev['url']} skipped: {ev['reason']}"
    if kind == "worker_exited" and ev["code"] not in (0, None) and not ev["stopped_by_agent"]:
        return f"{ev['node']}: worker {ev['local_rank']} exited with code {ev['code']}"
    if kind == "restart_limit":
        return (
            f"{ev['node']}: workers crashed {ev['crashes']} times "
            f"(cluster.max_restarts={ev['max_restarts']}); it leaves the job"
        )
    if kind == "failure_reported":
        return f"{ev['node']}: reported a failure ({ev['reason']})"
    if kind == "fenced":
        return f"{ev['node']}: fenced ({ev['reason']})"
    if kind == "health_checked" and ev["ok"]:
        counts = ", ".join(f"{n} {s}" for s, n in ev["counts"].items() if n)
        warned = "".join(f"; warning: {w}" for w in ev["warnings"])
        return f"{ev['node']}: health checks passed in {ev['seconds']:.1f} s ({counts}){warned}"
    if kind == "health_failed":
        until = ev["quarantined_until"]
        quarantine = (
            f"; quarantined until {time.strftime('%H:%M:%S', time.localtime(until))}"
            if until
            else ""
        )
        return (
            f"{ev['node']}: failed its health checks and does not join{quarantine}:\n  "
            + "\n  ".join(ev["failures"])
        )
    if kind == "quarantined":
        return (
            f"{ev['peer']} quarantined until "
            f"{time.strftime('%H:%M:%S', time.localtime(ev['until']))} by {ev['by']} "
            f"({'; '.join(ev['reasons'])})"
        )
    if kind == "quarantine_wait":
        return f"{ev['node']}: quarantined, waiting {ev['left_s']:.0f} s before checking again"
    if kind == "node_left":
        why = f": {ev['reason']}" if ev.get("reason") else ""
        return f"{ev['node']}: left the job (exit code {ev['code']}){why}"
    if kind == "etcd_unreachable":
        return (
            f"{ev['node']}: etcd does not answer ({ev['error']}); training goes on, retrying for "
            f"up to {ev['grace_s']:g} s"
        )
    if kind == "etcd_reachable":
        return f"{ev['node']}: etcd answers again after {ev['down_s']:.1f} s"
    if kind == "etcd_lost":
        return f"{ev['node']}: {ev['reason']}. Fix: {ev['fix']}"
    if kind == "training_done":
        return f"training done: step {ev['step']}, {ev['samples_seen']} samples"
    return None


def accuracy(ev: dict[str, Any]) -> str:
    """An ``evaluated`` event's figures, as the progress line and the summary print them."""
    return (
        f"top-1 {100 * ev['top1']:.2f} %, top-5 {100 * ev['top5']:.2f} %, loss {ev['loss']:.4f} "
        f"({ev['count']} images, {ev['seconds']:.1f} s)"
    )


class ProgressDisplay:
    """A progress bar on a terminal; elsewhere (logs, CI) plain lines, steps at most every few s."""

    def __init__(self, stream: IO[str] = sys.stdout, min_interval_s: float = 2.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.min_interval_s = min_interval_s
        self._last_step_line = 0.0
        self._bar: tqdm[Any] | None = None

    def handle(self, events: Iterable[dict[str, Any]]) -> None:
        for ev in events:
            if ev["event"] == "training_started" and self.tty:
                self._open_bar(ev["total_samples"], ev["samples_seen"])
            if ev["event"] == "step" and self._bar is not None:
                self._bar.n = ev["samples"]
                self._bar.set_postfix_str(
                    f"step {ev['step']} loss {ev['loss']:.3f} world {ev['world_size']} "
                    f"{ev['samples_per_s']:.0f}/s",
                    refresh=True,
                )
                continue
            line = describe(ev)
            if line is None:
                continue
            if ev["event"] == "step":
                now = time.monotonic()
                if now - self._last_step_line < self.min_interval_s:
                    continue
                self._last_step_line = now
            self._write(f"[{time.strftime('%H:%M:%S', time.localtime(ev['ts']))}] {line}")

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


def summary(run_dir: Path, checkpoint_url: str, job_id: str, since: float = 0.0) -> str:
    """Where a run's outputs are and how it went, from its events since ``since``."""
    events = [e for e in read_events(run_dir) if e["ts"] >= since]
    steps = [e for e in events if e["event"] == "step"]
    done = next((e for e in reversed(events) if e["event"] == "training_done"), None)
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    rounds = [e for e in events if e["event"] == "round_formed"]
    crashed = [
        e
        for e in events
        if e["event"] == "worker_exited"
        and e["code"] not in (0, None)
        and not e["stopped_by_agent"]
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
    if steps:
        lines.append(
            f"last step {steps[-1]['step']}: loss {steps[-1]['loss']:.4f}, lr {steps[-1]['lr']:.5f}"
        )
    evaluated = [e for e in events if e["event"] == "evaluated"]
    if evaluated:
        last = evaluated[-1]
        lines.append(f"validation at step {last['step']}: " + accuracy(last))
    failed_saves = sum(e["event"] == "checkpoint_failed" for e in events)
    lines.append(
        f"rounds formed: {len(rounds)}, worker failures seen: {len(crashed)}, "
        f"checkpoints saved: {len(saved)}"
        + (f", checkpoints failed: {failed_saves}" if failed_saves else "")
    )
    unfit = sorted({e["node"] for e in events if e["event"] == "health_failed"})
    if unfit:
        lines.append(
            f"failed their health checks and stayed out: {', '.join(unfit)} (the reasons are "
            "above and in their logs; python -m launcher.doctor runs the checks by hand)"
        )
    lines += [
        f"run directory: {run_dir}",
        f"logs:          {run_dir / 'logs'}",
        f"events:        {run_dir / 'events'}",
        f"checkpoints:   {checkpoint_url}"
        + (f" (newest: step {saved[-1]['step']})" if saved else ""),
        f"resume or extend it: run again with job_id={job_id} and the same overrides, "
        "e.g. trainer.epochs=<more>",
    ]
    return "\n".join(lines)
