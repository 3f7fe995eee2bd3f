"""Fault requests through etcd: how ``python -m chaos campaign.attach=true`` reaches a node it
cannot signal (another machine, no ssh).

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
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from launcher.agent.decisions import FaultAnswer
from launcher.rendezvous.keys import JobKeys

log = logging.getLogger(__name__)


class FaultRequests:
    """This node's fault requests: read once, then watched; ``post(request_id, request)`` is
    called on the etcd client's thread for each new one, and must return at once."""

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
        """Start following, or start again after the watch broke (etcd away); the agent calls
        it on every pass of its loop, and it costs nothing while the watch runs. etcd errors
        propagate: the caller tries again on its next pass."""
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
        for ev in response.events:
            if type(ev).__name__ == "PutEvent":
                self._take(ev.key, ev.value)

    def _take(self, key: bytes, value: bytes) -> None:
        request_id = key.decode()[len(self._folder) :]
        try:
            request = json.loads(value)
        except ValueError:
            request = None
        self._post(request_id, request if isinstance(request, dict) else {"kind": None})
