"""Ask a node of a running job for a fault through etcd, and wait for its answer.

The other half of :mod:`launcher.agent.fault_requests`: the request goes under the job's
``.chaos/requests/<node>/`` folder with a lease of this process's, so that a request no agent
took vanishes when the lease runs out instead of striking a node that comes up much later. The
node's agent answers in ``.chaos/answers/<node>/<id>``: accepted (its helper carries the fault
out and ends it), or refused with the reason (``chaos.allow`` is off in the job, a bad value).
"""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from launcher.rendezvous.keys import JobKeys

ANSWER_TIMEOUT_S = 15.0  # an agent answers within a pass of its loop (about a second)
REQUEST_TTL_S = 60  # an untaken request vanishes after this


class NoAnswer(TimeoutError):
    """The node did not answer: it is not up, or its agent does not run."""


@dataclass(frozen=True)
class Answer:
    accepted: bool
    reason: str


def request_fault(
    client: Any,
    prefix: str,
    job_id: str,
    node_id: str,
    kind: str,
    *,
    duration_s: float = 0.0,
    restart_after_s: float = -1.0,
    local_rank: int = 0,
    timeout_s: float = ANSWER_TIMEOUT_S,
) -> Answer:
    """Request ``kind`` on ``node_id`` of job ``job_id`` and return its agent's answer.

    Raises :class:`NoAnswer` if none came within ``timeout_s`` (the request is withdrawn).
    """
    from etcd3.exceptions import WatchTimedOut  # imported with the client that was passed in

    request_id = uuid.uuid4().hex[:12]
    keys = JobKeys(prefix, job_id)
    key = keys.requests(node_id) + request_id
    body = {
        "kind": kind,
        "duration_s": duration_s,
        "restart_after_s": restart_after_s,
        "local_rank": local_rank,
        "by": f"chaos@{socket.gethostname()}",
    }
    lease = client.lease(REQUEST_TTL_S)
    put = client.put(key, json.dumps(body), lease=lease)
    answered = keys.answer(node_id, request_id)
    try:
        event = client.watch_once(
            answered, timeout=timeout_s, start_revision=put.header.revision + 1
        )
    except WatchTimedOut as exc:
        client.delete(key)
        raise NoAnswer(
            f"{node_id} did not answer a {kind} request within {timeout_s:.0f} s: is the node up "
            f"and its agent running in job {job_id!r}?"
        ) from exc
    finally:
        lease.revoke()
    client.delete(answered)
    answer = json.loads(event.value)
    return Answer(bool(answer["accepted"]), str(answer.get("reason", "")))
