"""The job's ``progress`` key in etcd: written by the agent whose node holds global rank 0.

``python -m launcher.commands.status`` reads it.

The rank-0 worker already logs every step to its node's event file (``step`` events, see
:mod:`elastic.events`); its agent follows that one file and, at most every
:data:`~launcher.agent.decisions.PROGRESS_EVERY_S` seconds
(:func:`launcher.agent.decisions.publishes_progress`), puts the newest step under
``<prefix>/<job_id>/progress``, bound to its own lease, so the key goes with the node, with the
estimated time left (:mod:`elastic.eta`, over the steps it read). No new channel to the workers,
and no watch carries the key: agents watch only ``round``, ``leader``, ``done`` and node keys.

The put runs on a thread of its own, one at a time, and only the newest record waits for it: an
etcd that is away (each put then waits out the client's timeout) never slows the agent's loop,
and a put that fails is dropped; the next step's replaces it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic import event_types as ev
from elastic.eta import Pace
from elastic.events import EventFollower
from launcher.agent import decisions as decide
from launcher.rendezvous.membership import Round

log = logging.getLogger(__name__)


def progress_record(
    step: dict[str, Any],
    total_samples: int,
    checkpoint_url: str,
    now: float,
    eta_s: float | None,
) -> dict[str, Any]:
    """The ``progress`` value for a rank-0 ``step`` event.

    It holds step, epoch, samples, LR, samples/s, world size and round as the worker logged
    them. ``logged_at`` (the event's time) and ``published_at`` (``now``) are both wall clock.
    ``total_samples`` is 0 when not known; ``eta_s`` is the seconds left as of ``logged_at``,
    None when not known."""
    return {
        "step": step["step"],
        "epoch": step["epoch"],
        "samples": step["samples"],
        "total_samples": total_samples,
        "eta_s": None if eta_s is None else round(eta_s, 1),
        "loss": step["loss"],
        "lr": step["lr"],
        "samples_per_s": step["samples_per_s"],
        "world_size": step["world_size"],
        "round": step.get("round", 0),
        "node": step.get("node", ""),
        "logged_at": step["ts"],
        "published_at": round(now, 3),
        "checkpoint_url": checkpoint_url,
    }


class ProgressPublisher:
    """Follows this node's event file and writes the ``progress`` key when it is due.

    It is due when :func:`launcher.agent.decisions.publishes_progress` says so. ``put(value)``
    writes the key under the node's lease and raises what etcd raises. :meth:`tick` never raises
    and never waits for etcd."""

    def __init__(
        self,
        run_dir: str,
        node_id: str,
        checkpoint_url: str,
        put: Callable[[str], None],
        every_s: float = decide.PROGRESS_EVERY_S,
    ) -> None:
        """``every_s``: the least time between two reads of the file, and two puts."""
        self._node_id = node_id
        self._every_s = every_s
        self._checkpoint_url = checkpoint_url
        self._put = put
        self._events = EventFollower(run_dir, only_new=True, pattern=f"{node_id}.jsonl")
        self._newest: dict[str, Any] | None = None
        self._pace = Pace()
        self._published_step = 0
        self._published_at = -float("inf")  # monotonic
        self._read_at = -float("inf")
        self._pending: str | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="progress-put", daemon=True)
        self._thread.start()

    def tick(self, current: Round | None) -> None:
        """Called on every pass of the agent's loop with the round its workers are in."""
        try:
            self._tick(current)
        except Exception as exc:  # reading a file: nothing here may stop the agent
            log.debug("progress not published: %s", exc)

    def _tick(self, current: Round | None) -> None:
        now = time.monotonic()
        member = current.member(self._node_id) if current else None
        if member is None or member.first_rank != 0 or now - self._read_at < self._every_s:
            return  # the file is read at most every every_s, and only while rank 0 is here
        self._read_at = now
        for e in self._events.poll():
            if ev.STEP.matches(e):
                self._newest = e
                self._pace.add(e["ts"], e["samples"])
            elif ev.TRAINING_STARTED.matches(e):
                self._pace.total_samples = e.get("total_samples", 0)
                self._pace.add(e["ts"], e.get("samples_seen", 0))
        step = self._newest["step"] if self._newest else 0
        if not decide.publishes_progress(
            current,
            self._node_id,
            step,
            self._published_step,
            now - self._published_at,
            self._every_s,
        ):
            return
        assert self._newest is not None
        value = json.dumps(
            progress_record(
                self._newest,
                self._pace.total_samples,
                self._checkpoint_url,
                time.time(),
                self._pace.eta_s(),
            )
        )
        self._published_step, self._published_at = step, now
        with self._cond:
            self._pending = value  # an older one not yet written is dropped
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                value, self._pending = self._pending, None
            try:
                self._put(value)  # type: ignore[arg-type]
            except Exception as exc:  # etcd away, the lease gone: skipped
                log.debug("progress not published (%s)", exc.__class__.__name__)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
