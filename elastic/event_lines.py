"""What the progress display says for each event worth showing: one line per event.

Each line is keyed by the event's declaration (:mod:`elastic.event_types`), so that an event's
fields and its words sit one lookup apart and :func:`describe` is that lookup. An event absent
from :data:`LINES` is not shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic import event_types as ev
from elastic.control import EXIT_UNSAVED
from elastic.final_save import unsaved_steps

Event = Mapping[str, Any]

# A worker's exit codes that are no failure of its own: the job trained (its final state saved, or
# not: the final save's lines say so), or the exit not known.
ENDED = (0, None, EXIT_UNSAVED)


def describe(e: Event) -> str | None:
    """One line for a person for an event worth showing, or None."""
    line = _BY_NAME.get(e.get("event", ""))
    return line(e) if line is not None else None


def crashed(e: Event) -> bool:
    """Whether ``e`` is a worker's exit of its own failure.

    Not the job's end, not its agent's stop."""
    return ev.WORKER_EXITED.matches(e) and e["code"] not in ENDED and not e["stopped_by_agent"]


def accuracy(e: Event) -> str:
    """An ``evaluated`` event's figures, as the progress line and the summary print them."""
    return (
        f"top-1 {100 * e['top1']:.2f} %, top-5 {100 * e['top5']:.2f} %, loss {e['loss']:.4f} "
        f"({e['count']} evaluated, {e['seconds']:.1f} s)"
    )


def lr_text(lr: float) -> str:
    """An LR as the lines show it: five decimals (SGD's range), or three digits of a smaller one.

    AdamW's LRs (3e-4, less while warming up) would show as 0.00030 or 0.00000."""
    return f"{lr:.5f}" if lr == 0 or lr >= 1e-3 else f"{lr:.3g}"


def _step(e: Event) -> str:
    metrics = "".join(f"{name} {v:.4g} | " for name, v in e.get("metrics", {}).items())
    return (
        f"step {e['step']:>6} | epoch {e['epoch']} | loss {e['loss']:.4f} | {metrics}"
        f"{e['samples_per_s']:7.1f} samples/s | world {e['world_size']} | "
        f"lr {lr_text(e['lr'])}"
    )


def _round_formed(e: Event) -> str:
    return f"round {e['round']} formed: world size {e['world_size']} ({', '.join(e['members'])})"


def _training_started(e: Event) -> str:
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


def _recovered(e: Event) -> str:
    return (
        f"recovered in place at world size {e['world_size']}: rendezvous "
        f"{e['rendezvous_s']:.2f} s, rebuild {e['rebuild_s']:.2f} s, state sync "
        f"{e['sync_s']:.2f} s, first step {e['first_step_s']:.2f} s"
    )


def _straggler(e: Event) -> str:
    return (
        f"{e['node']}: rank {e['rank']} is a straggler at step {e['step']}, computing "
        f"{e['slowdown']:.1f}x slower than the median ({e['compute_s']:.3f} s a step against "
        f"{e['median_s']:.3f} s)"
    )


def _peer_evicted(e: Event) -> str:
    return f"{e['node']}: evicted {e['peer']} ({e['reason']})"


def _worker_frozen(e: Event) -> str:
    return f"{e['node']}: worker {e['local_rank']} frozen ({e['reason']})"


def _lr_changed(e: Event) -> str:
    return (
        f"{e['optimizer']} LR {lr_text(e['old_lr'])} -> {lr_text(e['lr'])} for world size "
        f"{e['old_world_size']} -> {e['world_size']} ({e['policy']})"
    )


def _evaluated(e: Event) -> str:
    return f"validation after epoch {e['epoch']:g} (step {e['step']}): " + accuracy(e)


def _checkpoint_saved(e: Event) -> str:
    return f"checkpoint of step {e['step']} saved in {e['seconds']:.2f} s"


def _checkpoint_failed(e: Event) -> str:
    return (
        f"checkpoint of step {e['step']} FAILED: {e['reason']}. Fix: {e['fix']}. "
        "Training goes on; the newest good checkpoint is kept"
    )


def _curves_off(e: Event) -> str:
    return f"{e['node']}: TensorBoard curves off ({e['reason']})"


def _metrics_served(e: Event) -> str:
    return f"{e['node']}: Prometheus metrics at {e['url']}"


def _metrics_off(e: Event) -> str:
    return f"{e['node']}: no Prometheus metrics: {e['reason']}"


def _worker_failed(e: Event) -> str:
    return f"{e['node']}: worker rank {e['rank']} failed: {e['error']}"


def _checkpoint_skipped(e: Event) -> str:
    return f"checkpoint {e['url']} skipped: {e['reason']}"


def _worker_exited(e: Event) -> str | None:
    if not crashed(e):
        return None
    return f"{e['node']}: worker {e['local_rank']} exited with code {e['code']}"


def _restart_limit(e: Event) -> str:
    return (
        f"{e['node']}: workers crashed {e['crashes']} times "
        f"(cluster.max_restarts={e['max_restarts']}); it leaves the job"
    )


def _failure_reported(e: Event) -> str:
    return f"{e['node']}: reported a failure ({e['reason']})"


def _fenced(e: Event) -> str:
    return f"{e['node']}: fenced ({e['reason']})"


def _health_checked(e: Event) -> str | None:
    if not e["ok"]:
        return None
    counts = ", ".join(f"{n} {s}" for s, n in e["counts"].items() if n)
    warned = "".join(f"; warning: {w}" for w in e["warnings"])
    return f"{e['node']}: health checks passed in {e['seconds']:.1f} s ({counts}){warned}"


def _health_failed(e: Event) -> str:
    until = e["quarantined_until"]
    quarantine = (
        f"; quarantined until {time.strftime('%H:%M:%S', time.localtime(until))}" if until else ""
    )
    return (
        f"{e['node']}: failed its health checks and does not join{quarantine}:\n  "
        + "\n  ".join(e["failures"])
    )


def _quarantined(e: Event) -> str:
    return (
        f"{e['peer']} quarantined until "
        f"{time.strftime('%H:%M:%S', time.localtime(e['until']))} by {e['by']} "
        f"({'; '.join(e['reasons'])})"
    )


def _quarantine_wait(e: Event) -> str:
    return f"{e['node']}: quarantined, waiting {e['left_s']:.0f} s before checking again"


def _node_left(e: Event) -> str:
    why = f": {e['reason']}" if e.get("reason") else ""
    return f"{e['node']}: left the job (exit code {e['code']}){why}"


def _etcd_unreachable(e: Event) -> str:
    return (
        f"{e['node']}: etcd does not answer ({e['error']}); training goes on, retrying for "
        f"up to {e['grace_s']:g} s"
    )


def _etcd_reachable(e: Event) -> str:
    return f"{e['node']}: etcd answers again after {e['down_s']:.1f} s"


def _etcd_lost(e: Event) -> str:
    return f"{e['node']}: {e['reason']}. Fix: {e['fix']}"


def _training_done(e: Event) -> str:
    return f"training done: step {e['step']}, {e['samples_seen']} samples"


def _final_save_retry(e: Event) -> str:
    return (
        f"the final checkpoint (step {e['step']}) did not commit: the trained state is kept "
        f"and the save retried in {e['retry_in_s']:.0f} s, for up to {e['left_s']:.0f} s "
        "more (checkpoint.final_retry_s)"
    )


def _final_save_failed(e: Event) -> str:
    return (
        f"the final checkpoint (step {e['step']}) could not be written in "
        f"{e['waited_s']:.0f} s: {unsaved_steps(e['saved_step'], e['step'])} NOT SAVED"
    )


LINES: dict[ev.EventType, Callable[[Event], str | None]] = {
    ev.STEP: _step,
    ev.ROUND_FORMED: _round_formed,
    ev.TRAINING_STARTED: _training_started,
    ev.RECOVERED: _recovered,
    ev.STRAGGLER: _straggler,
    ev.PEER_EVICTED: _peer_evicted,
    ev.WORKER_FROZEN: _worker_frozen,
    ev.LR_CHANGED: _lr_changed,
    ev.EVALUATED: _evaluated,
    ev.CHECKPOINT_SAVED: _checkpoint_saved,
    ev.CHECKPOINT_FAILED: _checkpoint_failed,
    ev.CURVES_OFF: _curves_off,
    ev.METRICS_SERVED: _metrics_served,
    ev.METRICS_OFF: _metrics_off,
    ev.WORKER_FAILED: _worker_failed,
    ev.CHECKPOINT_SKIPPED: _checkpoint_skipped,
    ev.WORKER_EXITED: _worker_exited,
    ev.RESTART_LIMIT: _restart_limit,
    ev.FAILURE_REPORTED: _failure_reported,
    ev.FENCED: _fenced,
    ev.HEALTH_CHECKED: _health_checked,
    ev.HEALTH_FAILED: _health_failed,
    ev.QUARANTINED: _quarantined,
    ev.QUARANTINE_WAIT: _quarantine_wait,
    ev.NODE_LEFT: _node_left,
    ev.ETCD_UNREACHABLE: _etcd_unreachable,
    ev.ETCD_REACHABLE: _etcd_reachable,
    ev.ETCD_LOST: _etcd_lost,
    ev.TRAINING_DONE: _training_done,
    ev.FINAL_SAVE_RETRY: _final_save_retry,
    ev.FINAL_SAVE_FAILED: _final_save_failed,
}
_BY_NAME = {kind.name: line for kind, line in LINES.items()}
