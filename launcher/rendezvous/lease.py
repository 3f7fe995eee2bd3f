"""One keep-alive stream per lease.

The etcd3 client's ``Lease.refresh()`` opens a new gRPC stream for every keep-alive and closes
it after one answer. A thousand nodes refreshing four times per TTL then cost etcd four thousand
stream set-ups and tear-downs per TTL. etcd's keep-alive is meant to be one long-lived
bidirectional stream per lease: :class:`KeepAliveStream` keeps one open, sends a request down it
at each refresh and waits, bounded, for the answer, which a reader thread takes off the stream.
A broken stream (etcd restarted, a member lost) is opened again at the next refresh.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from launcher.rendezvous.etcd import etcd_errors

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
        """Refresh the lease; returns the TTL etcd granted, 0 if the lease is gone. Raises what
        the etcd client raises when the stream breaks twice running, or :class:`NoAnswer` after
        ``timeout_s``.

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
