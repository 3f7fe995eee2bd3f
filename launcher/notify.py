"""Sending the job's alerts (:mod:`launcher.alerts`) to ``notify.command`` and ``notify.webhook``.

The launcher hands every event it follows to :meth:`Notifier.follow`, and its own end to
:meth:`Notifier.send`; both return at once. A thread of its own delivers the alerts, one at a
time, each call bounded by ``notify.timeout_s``: a command that hangs or a webhook that refuses
or never answers costs that thread a timeout and the log one ``notify_failed`` event with the
reason, never training a wait. A delivered alert is a ``notified`` event. At its end the launcher
waits for what is still queued, at most one timeout per call (:meth:`Notifier.close`).

The command runs as ``/bin/sh -c <notify.command>`` in a session of its own (killed whole at the
timeout), with the alert's JSON on stdin and ELASTIC_ALERT_KIND, ELASTIC_ALERT_TEXT,
ELASTIC_ALERT_JOB and ELASTIC_ALERT_NODE in its environment. The webhook gets the same JSON as a
POST. The events name the setting, never the URL or the command, which may hold a token.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elastic import event_types as ev
from elastic.config import Config
from elastic.events import EventLog, Rotation
from launcher.alerts import Alert, AlertPolicy

log = logging.getLogger("launcher.notify")

CLEANUP_S = 1.0  # beyond notify.timeout_s, what a call may take to be killed and reaped


class NotDelivered(Exception):
    """A call that did not deliver its alert; the message is the reason its event gives."""


class Notifier:
    """The alerts of one launcher process, sent on a thread of its own.

    An :class:`AlertPolicy` decides them from the events it follows. ``node`` names this process
    in its delivery events (``launcher`` on ``cluster=local``, the node's id on bare metal). With
    neither ``notify.command`` nor ``notify.webhook`` set it does nothing: no thread, no file."""

    def __init__(self, cfg: Config, node: str) -> None:
        n = cfg.notify
        self._command, self._webhook, self._timeout = n.command, n.webhook, n.timeout_s
        calls: list[tuple[str, str, Callable[[Alert, bytes], None]]] = [
            ("notify.command", n.command, self._run),
            ("notify.webhook", n.webhook, self._post),
        ]
        self._targets = [(target, call) for target, setting, call in calls if setting]
        self._policy = AlertPolicy(cfg.job_id, n.recoveries_per_hour, n.below_min_nodes_s)
        self._queue: queue.Queue[Alert | None] = queue.Queue()
        self._unsent = 0  # queued or being sent, under _idle
        self._idle = threading.Condition()
        if not self._targets:
            return
        rotation = Rotation.of_mb(cfg.trainer.events_rotate_mb, cfg.trainer.events_keep)
        self._events = EventLog(cfg.run_dir, node, logger=log, rotation=rotation, role="launcher")
        self._thread = threading.Thread(target=self._deliver_all, name="notify", daemon=True)
        self._thread.start()

    def follow(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Take the events this launcher follows, in their order, and send the alerts they make.

        Call it on every pass, with no events too (an alert may fall due)."""
        if not self._targets:
            return
        now = time.monotonic()
        for e in events:
            self.send(self._policy.take(e, now))
        self.send(self._policy.due(now))

    def send(self, alert: Alert | None) -> None:
        """Queue ``alert`` (None: nothing to send) for delivery; returns at once."""
        if alert is None or not self._targets:
            return
        with self._idle:
            self._unsent += 1
        self._queue.put(alert)

    def close(self) -> None:
        """Wait until the queued alerts are delivered or failed, and stop the thread.

        It waits at most ``notify.timeout_s`` (and :data:`CLEANUP_S`) for each call still due."""
        if not self._targets:
            return
        with self._idle:
            bound = self._unsent * len(self._targets) * (self._timeout + CLEANUP_S)
            drained = self._idle.wait_for(lambda: self._unsent == 0, timeout=bound)
        self._queue.put(None)
        if drained:  # else the thread still writes; its file closes with the process
            self._thread.join()
            self._events.close()

    def _deliver_all(self) -> None:
        while (alert := self._queue.get()) is not None:
            self._deliver(alert)
            with self._idle:
                self._unsent -= 1
                self._idle.notify_all()

    def _deliver(self, alert: Alert) -> None:
        body = json.dumps(alert.payload()).encode()
        for target, call in self._targets:
            began = time.monotonic()
            try:
                call(alert, body)
            except Exception as exc:  # whatever a command or a URL does, training goes on
                reason = str(exc) if isinstance(exc, NotDelivered) else repr(exc)
                self._events.emit(
                    ev.NOTIFY_FAILED,
                    f"alert {alert.kind} not delivered to {target}: {reason}; training goes on",
                    level=logging.WARNING,
                    alert=alert.kind,
                    target=target,
                    reason=reason,
                )
            else:
                seconds = round(time.monotonic() - began, 3)
                self._events.emit(ev.NOTIFIED, alert=alert.kind, target=target, seconds=seconds)

    def _run(self, alert: Alert, body: bytes) -> None:
        env = {
            **os.environ,
            "ELASTIC_ALERT_KIND": alert.kind,
            "ELASTIC_ALERT_TEXT": alert.text,
            "ELASTIC_ALERT_JOB": alert.job_id,
            "ELASTIC_ALERT_NODE": alert.node,
        }
        with subprocess.Popen(
            ["/bin/sh", "-c", self._command],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # at the timeout, what it started dies with it
        ) as proc:
            try:
                _, err = proc.communicate(body, timeout=self._timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise NotDelivered(
                    f"the command did not end within notify.timeout_s={self._timeout:g}; killed"
                ) from None
        if proc.returncode:
            said = err.decode(errors="replace").strip()[-300:]
            raise NotDelivered(f"the command exited with code {proc.returncode}: {said}")

    def _post(self, alert: Alert, body: bytes) -> None:
        request = urllib.request.Request(
            self._webhook, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout):
                pass
        except urllib.error.HTTPError as exc:
            raise NotDelivered(f"the webhook answered HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:  # connecting failed: refused, no such host, ...
            raise NotDelivered(self._failure(exc.reason)) from None
        except OSError as exc:  # connected, then no answer in time or a reset
            raise NotDelivered(self._failure(exc)) from None

    def _failure(self, cause: object) -> str:
        if isinstance(cause, TimeoutError):
            return f"the webhook did not answer within notify.timeout_s={self._timeout:g}"
        return f"the webhook could not be reached: {cause}"
