"""What the job's owner is told, and when: pure decisions over the events the job writes.

Nobody watches a job that runs for days; these pick, from what the processes already write, the
few things that need a person. Each occurrence is written once, by one process, so an alert
follows each occurrence once, not once per node:

- ``node_quarantined``: the ``quarantined`` event of the node that quarantined itself (its
  strikes, a straggler, a broken GPU); an operator's ``quarantine add`` writes none, as whoever
  typed it knows;
- ``below_min_nodes``: the leader's ``below_min_nodes``, once the job has waited
  ``notify.below_min_nodes_s`` with no round formed since (a node back sooner is no news);
- ``recoveries``: rank 0's ``recovered``, ``notify.recoveries_per_hour`` of them within an hour;
- ``job_done``: rank 0's ``training_done``;
- ``final_save_failing``: rank 0's first ``final_save_retry``: the job is trained but its final
  checkpoint does not commit, and a person has ``checkpoint.final_retry_s`` to fix the store
  (the reason and fix of the ``checkpoint_failed`` before it come along);
- ``job_failed``: rank 0's ``final_save_failed`` (trained, the steps it names not saved), or the
  launcher's end without the job trained (:func:`failed`); on bare metal, where every node runs a
  launcher, only the one :func:`reports_failure` names.

The launcher follows the events (``cluster=local``: every node's; ``bare_metal``: its own
node's) and :mod:`launcher.notify` sends the alerts. Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from elastic import event_types as ev
from elastic.control import EXIT_UNSAVED
from elastic.final_save import unsaved_steps

QUARANTINED = "node_quarantined"
BELOW_MIN_NODES = "below_min_nodes"
RECOVERIES = "recoveries"
JOB_DONE = "job_done"
FINAL_SAVE_FAILING = "final_save_failing"
JOB_FAILED = "job_failed"
HOUR_S = 3600.0


@dataclass(frozen=True)
class Alert:
    """One alert: its kind, job, node, text, time and the fields of the event behind it.

    ``kind`` is one of the kinds above. ``node`` is the node it is about (or that sends it).
    ``text`` is one line, for a mail's subject; ``ts`` is when, on the wall clock."""

    kind: str
    job_id: str
    node: str
    text: str
    ts: float
    fields: Mapping[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        """What a webhook receives and a command reads on its stdin, as JSON."""
        return {
            **self.fields,
            "kind": self.kind,
            "job_id": self.job_id,
            "node": self.node,
            "text": self.text,
            "ts": self.ts,
        }


class AlertPolicy:
    """The alerts of one job's events, taken in their order.

    ``now`` is the reader's monotonic time as it takes an event. How long the job has waited for
    nodes, and how many recoveries fell within the last hour, are measured on it."""

    def __init__(self, job_id: str, recoveries_per_hour: int, below_min_nodes_s: float) -> None:
        self._job_id = job_id
        self._per_hour = recoveries_per_hour
        self._wait_s = below_min_nodes_s
        self._recoveries: deque[float] = deque()  # when the recent recoveries were read
        self._short: tuple[Mapping[str, Any], float] | None = None  # below_min_nodes, read at
        self._save_failure = ""  # the newest checkpoint_failed's reason and fix, in words

    def take(self, e: Mapping[str, Any], now: float) -> Alert | None:
        """The alert ``e`` makes now, if any (see also :meth:`due`)."""
        if ev.QUARANTINED.matches(e):
            return self._alert(
                QUARANTINED,
                e,
                f"{e['peer']} quarantined for {_span(e['until'] - e['ts'])} by {e['by']} "
                f"({'; '.join(e['reasons'])})",
                node=e["peer"],
            )
        if ev.BELOW_MIN_NODES.matches(e):
            self._short = (e, now)
            return self.due(now)
        if ev.ROUND_FORMED.matches(e):
            self._short = None
        elif ev.TRAINING_DONE.matches(e):
            self._short = None
            return self._alert(
                JOB_DONE, e, f"done: step {e['step']}, {e['samples_seen']} samples trained"
            )
        elif ev.RECOVERED.matches(e):
            return self._recovered(e, now)
        elif ev.CHECKPOINT_FAILED.matches(e):
            self._save_failure = f": {e['reason']}. Fix: {e['fix']}"
        elif ev.FINAL_SAVE_RETRY.matches(e) and e["attempt"] == 1:
            return self._alert(
                FINAL_SAVE_FAILING,
                e,
                f"trained, but the final checkpoint (step {e['step']}) does not commit"
                f"{self._save_failure}; the state is kept and the save retried for "
                f"{_span(e['left_s'])} (checkpoint.final_retry_s), newest saved: "
                f"{_saved(e['saved_step'])}",
            )
        elif ev.FINAL_SAVE_FAILED.matches(e):
            return self._alert(
                JOB_FAILED,
                e,
                f"ended without its final checkpoint (exit code {EXIT_UNSAVED}): "
                f"{unsaved_steps(e['saved_step'], e['step'])} were trained but are not saved"
                f"{self._save_failure}; newest saved: {_saved(e['saved_step'])}",
            )
        return None

    def due(self, now: float) -> Alert | None:
        """The ``below_min_nodes`` alert, once the job has waited ``below_min_nodes_s`` for nodes.

        Ask on every pass, events or not."""
        if self._short is None or now - self._short[1] < self._wait_s:
            return None
        e, since = self._short
        self._short = None
        return self._alert(
            BELOW_MIN_NODES,
            e,
            f"waiting for nodes for {now - since:.0f} s: {e['ready']} ready, fewer than "
            f"cluster.min_nodes={e['min_nodes']} (round {e['round']} lost members)",
        )

    def _recovered(self, e: Mapping[str, Any], now: float) -> Alert | None:
        """Every ``recoveries_per_hour``-th recovery within an hour; counting starts again."""
        recent = self._recoveries
        recent.append(now)
        while recent[0] <= now - HOUR_S:
            recent.popleft()
        if len(recent) < self._per_hour:
            return None
        recent.clear()
        return self._alert(
            RECOVERIES,
            e,
            f"{self._per_hour} {'recovery' if self._per_hour == 1 else 'recoveries'} within an "
            f"hour (notify.recoveries_per_hour), the newest at step {e['step']} at world size "
            f"{e['world_size']}",
        )

    def _alert(self, kind: str, e: Mapping[str, Any], text: str, node: str = "") -> Alert:
        fields = {k: v for k, v in e.items() if k not in ("ts", "node")}
        return Alert(
            kind, self._job_id, node or e["node"], f"{self._job_id}: {text}", e["ts"], fields
        )


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _saved(step: int | None) -> str:
    return "none" if step is None else f"step {step}"


def failed(job_id: str, node: str, code: int, why: str, ts: float) -> Alert:
    """The ``job_failed`` alert of a launcher that ended with ``code`` without the job trained.

    ``why`` says why, in words."""
    return Alert(
        JOB_FAILED,
        job_id,
        node,
        f"{job_id}: ended without finishing (exit code {code}): {why}",
        ts,
        {"code": code, "reason": why},
    )


def reports_failure(code: int, others: Set[str] | None, etcd_lost: bool) -> bool:
    """Whether a bare-metal node's launcher, its agent ended with ``code``, says the job failed.

    ``others``: the other nodes live in its view as it ended if it led the job, else None (its
    view then does not hold every node). Of the nodes of a job, the leader alone speaks, and
    only if no other node carries the job on (they speak in turn as they end), or if etcd was
    lost, which ends every node at once. A job trained but unsaved (:data:`EXIT_UNSAVED`) was
    said by rank 0's ``final_save_failed``, on whichever node it ran.
    """
    return code not in (0, EXIT_UNSAVED) and others is not None and (not others or etcd_lost)
