"""Keeping a node's lease alive, and what a keep-alive says about the node's place in the job.

:class:`LeaseKeeper` refreshes the lease every quarter TTL on a thread of its own and acts on
:func:`lease_verdict`. An unreachable etcd is not a lost lease: the lease lives on the server,
which restores it with a fresh TTL when it comes back, and no other node can form a round without
etcd. So only the server's word fences the node (a lease it says expired), and past
``rendezvous.etcd_grace_s`` without an answer the node gives up.

The etcd3 client's ``Lease.refresh()`` opens a new gRPC stream for every keep-alive and closes
it after one answer. A thousand nodes refreshing four times per TTL then cost etcd four thousand
stream set-ups and tear-downs per TTL. etcd's keep-alive is meant to be one long-lived
bidirectional stream per lease: :class:`KeepAliveStream` keeps one open, sends a request down it
at each refresh and waits, bounded, for the answer, which a reader thread takes off the stream.
A broken stream (etcd restarted, a member lost) is opened again at the next refresh.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from elastic import event_types as ev
from elastic.config import RendezvousConfig
from elastic.event_types import EventType
from launcher.rendezvous.etcd import etcd_errors

ETCD_LOST_FIX = (
    "bring etcd back (or check cluster.etcd_endpoints and the network to it), then launch the "
    "job again to resume from the newest checkpoint"
)


class Emit(Protocol):
    def __call__(
        self, event: EventType, message: str | None = None, /, *, level: int = ..., **fields: Any
    ) -> None: ...


class Lease(enum.Enum):
    """What a keep-alive round trip says about this node's place in the job."""

    ALIVE = "alive"  # refreshed
    EXPIRED = "expired"  # the server says the lease is gone: the node is out (fenced)
    OUTAGE = "outage"  # no answer: keep training, keep trying
    ETCD_LOST = "etcd_lost"  # no answer for longer than rendezvous.etcd_grace_s: stop


def lease_verdict(ttl: int | None, unreachable_s: float, grace_s: float) -> Lease:
    """The verdict on a keep-alive, from the server's answer and how long etcd was away.

    ``ttl`` is the TTL the server answered (None: no answer), ``unreachable_s`` how long etcd has
    not answered (monotonic), ``grace_s`` the grace period.

    Only the server can say a lease is gone: a node that cannot reach etcd does not know that
    the others can, and it need not: they can only replace it in a round that etcd forms, and
    then its old round's collectives fail.
    """
    if ttl is not None:
        return Lease.ALIVE if ttl > 0 else Lease.EXPIRED
    return Lease.ETCD_LOST if unreachable_s > grace_s else Lease.OUTAGE


_CLOSE = object()


class NoAnswer(TimeoutError):
    """etcd did not answer a keep-alive within the time given."""


class KeepAliveStream:
    """Keep-alives of one lease over one stream of ``client``'s channel."""

    def __init__(self, client: Any, lease_id: int) -> None:
        self._client = client
        self._lease_id = lease_id
        self._requests: queue.Queue[Any] | None = None
        self._answers: queue.Queue[Any] = queue.Queue()

    def refresh(self, timeout_s: float) -> int:
        """Refresh the lease; returns the TTL etcd granted, 0 if the lease is gone.

        Raises what the etcd client raises when the stream breaks twice running, or
        :class:`NoAnswer` after ``timeout_s``.

        A stream that ended (its etcd member died) is replaced by a new one, on a live member,
        and the refresh is sent again at once: one member's death is not an etcd outage."""
        etcd_errors()  # the protobuf mode the etcd client needs, before its import
        from etcd3 import etcdrpc

        answer: Any = None
        for _ in range(2):
            while not self._answers.empty():  # a late answer to an earlier refresh, or the
                if isinstance(self._answers.get_nowait(), BaseException):  # end of the stream
                    self.close()
            if self._requests is None:
                self._open()
            assert self._requests is not None
            self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=self._lease_id))
            try:
                answer = self._answers.get(timeout=timeout_s)
            except queue.Empty as exc:
                self.close()  # a stream that stopped answering is not trusted again
                raise NoAnswer(f"no keep-alive answer within {timeout_s:g} s") from exc
            if not isinstance(answer, BaseException):
                return int(answer.TTL)
            self.close()
        raise answer

    def close(self) -> None:
        """End the stream (the lease itself is left alone)."""
        if self._requests is not None:
            self._requests.put(_CLOSE)
            self._requests = None

    def _open(self) -> None:
        requests: queue.Queue[Any] = queue.Queue()

        def outgoing() -> Iterator[Any]:
            while (request := requests.get()) is not _CLOSE:
                yield request

        stream = self._client.leasestub.LeaseKeepAlive(
            outgoing(), credentials=self._client.call_credentials, metadata=self._client.metadata
        )
        answers = self._answers

        def read() -> None:
            try:
                for answer in stream:
                    answers.put(answer)
            except etcd_errors() as exc:  # the stream broke: the waiting refresh raises it
                answers.put(exc)

        threading.Thread(target=read, name="etcd-keepalive-stream", daemon=True).start()
        self._requests = requests


class LeaseKeeper:
    """Refreshes one node's lease until stopped, the lease expires or etcd stays away too long.

    Too long is past the grace period. It says so through ``emit`` and the callbacks. Durations are
    on the monotonic clock, so a stepped wall clock changes nothing."""

    def __init__(
        self,
        client: Any,
        lease_id: int,
        cfg: RendezvousConfig,
        node_id: str,
        emit: Emit,
        *,
        on_back: Callable[[], None],
        on_expired: Callable[[], None],
        on_lost: Callable[[], None],
        count_keepalive: Callable[[], None],
    ) -> None:
        """Prepare to keep lease ``lease_id`` alive; :meth:`run` does the keeping.

        ``on_back``: etcd answers again after an outage; ``on_expired``: the server says the lease
        is gone; ``on_lost``: no answer past ``rendezvous.etcd_grace_s`` (after the ``etcd_lost``
        event). The last two end the keeping."""
        self._client, self._lease_id, self._cfg = client, lease_id, cfg
        self._node_id, self._emit = node_id, emit
        self._on_back, self._on_expired, self._on_lost = on_back, on_expired, on_lost
        self._count_keepalive = count_keepalive
        self._last_refresh = time.monotonic()
        self._down_since: float | None = None  # monotonic; None while etcd answers

    def run(self, stop: threading.Event) -> None:
        """The keeping thread's body: a refresh every quarter TTL until ``stop`` is set."""
        stream = KeepAliveStream(self._client, self._lease_id)
        try:
            while not stop.wait(self._cfg.lease_ttl_s / 4):
                if not self._refresh(stream):
                    return
        finally:
            stream.close()

    def _refresh(self, stream: KeepAliveStream) -> bool:
        """One keep-alive and its verdict; False once the keeping is over."""
        ttl: int | None = None
        error = ""
        try:
            self._count_keepalive()
            ttl = stream.refresh(timeout_s=self._cfg.lease_ttl_s / 2)
        except (*etcd_errors(), NoAnswer) as exc:
            error = exc.__class__.__name__
        now = time.monotonic()
        verdict = lease_verdict(ttl, now - self._last_refresh, self._cfg.etcd_grace_s)
        if verdict is Lease.ALIVE:
            self._last_refresh = now
            self._back(now)
            return True
        if verdict is Lease.OUTAGE:
            self._away(now, error)
            return True
        if verdict is Lease.EXPIRED:
            self._back(now)
            self._on_expired()
        else:
            self._give_up(now - self._last_refresh, error)
        return False

    def _away(self, now: float, error: str) -> None:
        """A keep-alive found no etcd: say so once per outage."""
        if self._down_since is not None:
            return
        self._down_since = now
        self._emit(
            ev.ETCD_UNREACHABLE,
            f"{self._node_id}: etcd does not answer ({error}); training goes on, retrying "
            f"for up to rendezvous.etcd_grace_s={self._cfg.etcd_grace_s:g} s",
            level=logging.WARNING,
            error=error,
            grace_s=self._cfg.etcd_grace_s,
        )

    def _back(self, now: float) -> None:
        if self._down_since is None:
            return
        down, self._down_since = now - self._down_since, None
        self._emit(
            ev.ETCD_REACHABLE,
            f"{self._node_id}: etcd answers again after {down:.1f} s",
            down_s=round(down, 3),
        )
        self._on_back()

    def _give_up(self, waited: float, error: str) -> None:
        """etcd stayed away beyond the grace period."""
        reason = (
            f"etcd did not answer for {waited:.0f} s (rendezvous.etcd_grace_s="
            f"{self._cfg.etcd_grace_s:g}; last error {error}): the node stops, and the newest "
            "checkpoint is kept"
        )
        self._emit(
            ev.ETCD_LOST,
            f"{self._node_id}: {reason}. Fix: {ETCD_LOST_FIX}",
            level=logging.ERROR,
            reason=reason,
            fix=ETCD_LOST_FIX,
            waited_s=round(waited, 3),
        )
        self._on_lost()
