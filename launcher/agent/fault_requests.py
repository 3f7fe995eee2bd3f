"""Fault requests through etcd: how a chaos campaign reaches a node it cannot signal.

The campaign is ``python -m chaos campaign.attach=true``; the node is on another machine, with
no ssh.

A requester writes a JSON request under ``<prefix>/<job_id>.chaos/requests/<node_id>/<id>``,
under a lease of its own, so that a request nobody took vanishes with its requester. The node's
agent follows its own folder (:class:`FaultRequests`, one small watch), decides
(:func:`launcher.agent.decisions.answer_fault_request`: only a job started with ``chaos.allow=true``
takes any), writes its answer to ``.../answers/<node_id>/<id>``, deletes the request, and, when
it accepted, starts ``python -m launcher.agent.fault_helper`` in a session of its own: the helper
strikes and ends the fault (thaws the node, starts it again), so it outlives the agent it stops or
kills. The keys sit beside the job's prefix, not under it, so the rendezvous's watch never
carries them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elastic import event_types as ev
from elastic.events import EventLog
from launcher.agent.decisions import FaultAnswer, answer_fault_request
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.keys import JobKeys

log = logging.getLogger(__name__)


class FaultRequests:
    """This node's fault requests: read once, then watched.

    ``post(request_id, request)`` is called on the etcd client's thread for each new one, and
    must return at once."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        job_id: str,
        node_id: str,
        post: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self._client = client
        self._keys, self._node_id = JobKeys(prefix, job_id), node_id
        self._folder = self._keys.requests(node_id)
        self._post = post
        self._watch_id: int | None = None

    def follow(self) -> None:
        """Start following, or start again after the watch broke (etcd away).

        The agent calls it on every pass of its loop, and it costs nothing while the watch runs.
        etcd errors propagate: the caller tries again on its next pass."""
        if self._watch_id is not None:
            return
        resp = self._client.get_prefix_response(self._folder)
        for kv in resp.kvs:
            self._take(kv.key, kv.value)
        self._watch_id = self._client.add_watch_prefix_callback(
            self._folder, self._on_watch, start_revision=resp.header.revision + 1
        )

    def answer(self, request_id: str, answer: FaultAnswer) -> None:
        """Write this node's answer and remove the request, in one transaction."""
        key = self._keys.answer(self._node_id, request_id)
        self._client.transaction(
            compare=[],
            success=[
                self._client.transactions.put(key, json.dumps(asdict(answer))),
                self._client.transactions.delete(self._folder + request_id),
            ],
            failure=[],
        )

    def stop(self) -> None:
        if self._watch_id is not None:
            try:
                self._client.cancel_watch(self._watch_id)
            except Exception as exc:  # the channel may be gone at exit; nothing to undo
                log.debug("cancel_watch: %s", exc)
            self._watch_id = None

    def _on_watch(self, response: Any) -> None:
        if isinstance(response, Exception):
            self._watch_id = None  # follow() starts again on the agent's next pass
            return
        for change in response.events:
            if type(change).__name__ == "PutEvent":
                self._take(change.key, change.value)

    def _take(self, key: bytes, value: bytes) -> None:
        request_id = key.decode()[len(self._folder) :]
        try:
            request = json.loads(value)
        except ValueError:
            request = None
        self._post(request_id, request if isinstance(request, dict) else {"kind": None})


class FaultAnswerer:
    """Answers each of this node's fault requests once, and starts the helper for each accepted.

    Answering once matters because a re-read repeats the requests. ``worker_pid(local_rank)`` is
    that worker's pid (0: none)."""

    def __init__(
        self,
        requests: FaultRequests,
        node_id: str,
        run_dir: Path,
        allow: bool,
        slots: int,
        events: EventLog,
        worker_pid: Callable[[int], int],
    ) -> None:
        self.requests, self._node_id, self._run_dir = requests, node_id, run_dir
        self._allow, self._slots, self._events = allow, slots, events
        self._worker_pid = worker_pid
        self._taken: set[str] = set()

    def take(self, request_id: str, request: dict[str, Any]) -> None:
        """Answer a fault request; if accepted, hand it to the fault helper.

        The helper is ``python -m launcher.agent.fault_helper``, in a session of its own, so
        that it outlives this agent when it stops or kills it."""
        if request_id in self._taken:
            return
        self._taken.add(request_id)
        answer = answer_fault_request(request, self._allow, self._slots)
        kind, by = request.get("kind"), request.get("by", "?")
        if answer.accepted:
            self._events.emit(
                ev.FAULT_REQUEST_ACCEPTED,
                f"{self._node_id}: carrying out {kind} requested by {by}",
                request=request_id,
                kind=kind,
                by=by,
            )
        else:
            self._events.emit(
                ev.FAULT_REFUSED,
                f"{self._node_id}: refused a {kind} request from {by}: {answer.reason}",
                level=logging.WARNING,
                request=request_id,
                kind=kind,
                by=by,
                reason=answer.reason,
            )
        try:
            self.requests.answer(request_id, answer)
        except etcd_errors() as exc:  # the requester then times out and says so
            log.warning(
                "%s: could not answer fault request %s (%s)", self._node_id, request_id, exc
            )
        if not answer.accepted:
            return
        local_rank = int(request.get("local_rank", 0))
        argv = [
            sys.executable,
            "-m",
            "launcher.agent.fault_helper",
            f"--run-dir={self._run_dir}",
            f"--node={self._node_id}",
            f"--agent-pid={os.getpid()}",
            f"--kind={kind}",
            f"--duration-s={float(request.get('duration_s', 0))}",
            f"--restart-after-s={float(request.get('restart_after_s', -1))}",
            f"--worker-pid={self._worker_pid(local_rank)}",
            f"--local-rank={local_rank}",
        ]
        with open(self._run_dir / "logs" / f"{self._node_id}.chaos.log", "ab") as out:
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
