"""One node's etcd client for the rendezvous: each call counted, retried where asked, NOSPACE named.

The rendezvous's parts (the node's record, the view it follows, the leadership, the rendezvous
itself) talk to etcd through :class:`EtcdClient` alone, so what a node costs etcd
(:class:`EtcdLoad`, which the ``round_formed`` events, the scale bench and docs/scale.md report)
is counted in one place: a request as it is sent, a watch's events as they are delivered, the
bytes of the rounds' member keys read. A call that must outlast an outage goes through
:meth:`EtcdClient.retry` (backoff up to ``rendezvous.etcd_grace_s``, then :class:`EtcdLost`); an
etcd past its space quota is named once per episode (:meth:`EtcdClient.no_space`), and refuses a
retried call at once (:class:`EtcdFull`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from elastic import event_types as ev
from launcher.rendezvous.etcd import (
    allow_watch_filters,
    denied,
    etcd_errors,
    read_at_one_revision,
)
from launcher.rendezvous.etcd_usage import NoSpace, out_of_space
from launcher.rendezvous.lease import Emit

# The rendezvous's log, as its lines have always been named.
log = logging.getLogger("launcher.rendezvous.rendezvous")

T = TypeVar("T")


class EtcdLost(ConnectionError):
    """etcd did not answer for longer than ``rendezvous.etcd_grace_s``."""


class EtcdDenied(EtcdLost):
    """etcd answered and refused: the user may not use the job's keys.

    Raised at once, since waiting out the grace period cannot change a role."""


class EtcdFull(EtcdLost):
    """etcd answered and refused a write: its space quota is exceeded (the ``NOSPACE`` alarm).

    Raised at once, since waiting frees no space: an operator must, and disarm the alarm."""


RETRY_MIN_S, RETRY_MAX_S = 0.25, 4.0  # backoff of the calls retried while etcd is away


def backoff(attempt: int) -> float:
    """Seconds before retry number ``attempt`` (0-based) of a call that found etcd away."""
    return min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(attempt, 16))


@dataclass
class EtcdLoad:
    """What this node has cost etcd so far, as :class:`EtcdClient` counts it.

    It counts the requests (a watch created counts as one), and apart from them the lease's
    keep-alives (a fixed rate). It counts the watch events delivered and their bytes (key and
    value), and the bytes of the rounds' member keys read. They are counted as they happen, so that
    the events can say what a round costs the server (:meth:`take`)."""

    requests: int = 0
    keepalives: int = 0
    watch_events: int = 0
    watch_bytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0  # the requests' wall time, summed (a watch's: its creation)
    errors: int = 0  # requests that raised
    _taken: tuple[int, ...] = (0, 0, 0, 0, 0)

    def count_keepalive(self) -> None:
        self.keepalives += 1

    @contextlib.contextmanager
    def request(self, count: int = 1) -> Iterator[None]:
        """Count ``count`` requests sent in the block, its time, and an error raised from it."""
        self.requests += count
        started = time.monotonic()
        try:
            yield
        except BaseException:
            self.errors += 1
            raise
        finally:
            self.seconds += time.monotonic() - started

    def take(self) -> dict[str, int]:
        """The load since the previous call, as event fields."""
        now = (self.requests, self.keepalives, self.watch_events, self.watch_bytes, self.read_bytes)
        delta = [a - b for a, b in zip(now, self._taken, strict=True)]
        self._taken = now
        names = ("etcd_requests", "keepalives", "watch_events", "watch_bytes", "read_bytes")
        return dict(zip(names, delta, strict=True))


class EtcdClient:
    """The etcd3 client ``raw`` as one node of the job uses it, each request counted.

    Each request is counted into :attr:`load` as it is sent. A lease's revocation and a watch's
    cancellation are not, nor are the alarm and status reads that name ``NOSPACE``: the figures have
    always left them out. ``node_id`` and ``prefix`` (the job's keys) name the node and the keys in
    the errors; ``emit`` reports ``etcd_no_space``."""

    def __init__(self, raw: Any, *, node_id: str, prefix: str, grace_s: float, emit: Emit) -> None:
        allow_watch_filters(raw)
        self.raw = raw
        self.load = EtcdLoad()
        self._node_id, self._prefix, self._grace_s, self._emit = node_id, prefix, grace_s, emit
        self._full: NoSpace | None = None  # etcd's NOSPACE, reported; until a tracked put lands
        self._full_lock = threading.Lock()

    # --- the calls, counted ------------------------------------------------------------------

    @property
    def transactions(self) -> Any:
        """The builders of a transaction's compares and operations (no request of their own)."""
        return self.raw.transactions

    def get(self, key: str) -> tuple[bytes | None, Any]:
        with self.load.request():
            return self.raw.get(key)

    def put(self, key: str, value: str, lease: Any = None) -> None:
        with self.load.request():
            self.raw.put(key, value, lease)

    def transaction(
        self, compare: list[Any], success: list[Any], failure: list[Any]
    ) -> tuple[bool, list[Any]]:
        with self.load.request():
            return self.raw.transaction(compare=compare, success=success, failure=failure)

    def lease(self, ttl: int) -> Any:
        """A new lease of ``ttl`` seconds."""
        with self.load.request():
            return self.raw.lease(ttl)

    def revoke_lease(self, lease_id: int) -> None:
        self.raw.revoke_lease(lease_id)

    def read(
        self, reads: list[tuple[str, bytes | None]], revision: int = 0
    ) -> tuple[int, list[list[Any]]]:
        """:func:`launcher.rendezvous.etcd.read_at_one_revision`: one request per read."""
        with self.load.request(len(reads)):
            return read_at_one_revision(self.raw, reads, revision)

    def read_members(self, read: tuple[str, bytes | None], revision: int) -> list[list[Any]]:
        """One read of a round's member keys (:meth:`read`), whose bytes count as read."""
        _, found = self.read([read], revision)
        self.load.read_bytes += sum(len(kv.key) + len(kv.value) for kvs in found for kv in kvs)
        return found

    def add_watch_callback(self, key: str, callback: Callable[[Any], None], **kwargs: Any) -> int:
        """A watch of ``key`` whose events are counted as delivered, before ``callback`` sees them.

        The arguments are the etcd3 client's."""
        with self.load.request():
            return self.raw.add_watch_callback(
                key, functools.partial(self._delivered, callback), **kwargs
            )

    def _delivered(self, callback: Callable[[Any], None], response: Any) -> None:
        if not isinstance(response, Exception):  # the watch broke: nothing delivered
            self.load.watch_events += len(response.events)
            self.load.watch_bytes += sum(len(e.key) + len(e.value) for e in response.events)
        callback(response)

    def cancel_watch(self, watch_id: int) -> None:
        self.raw.cancel_watch(watch_id)

    # --- outages and refusals ----------------------------------------------------------------

    def retry(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried with backoff while etcd does not answer; then :class:`EtcdLost`.

        It retries for at most ``rendezvous.etcd_grace_s``. A refusal that waiting cannot change is
        raised at once: :class:`EtcdFull`, :class:`EtcdDenied`."""
        started, attempt = time.monotonic(), 0
        while True:
            try:
                return call()
            except etcd_errors() as exc:
                self._raise_refusal(what, exc)
                waited = time.monotonic() - started
                if waited > self._grace_s:
                    raise EtcdLost(
                        f"etcd did not answer for {waited:.0f} s "
                        f"(rendezvous.etcd_grace_s={self._grace_s:g}) while trying to "
                        f"{what}: {exc.__class__.__name__}"
                    ) from exc
                log.info("etcd unavailable (%s); retrying to %s", exc.__class__.__name__, what)
                time.sleep(backoff(attempt))
                attempt += 1

    def _raise_refusal(self, what: str, exc: BaseException) -> None:
        """Raise :class:`EtcdFull` or :class:`EtcdDenied` if etcd answered ``exc`` and refused."""
        full = self.no_space(exc)
        if full is not None:
            raise EtcdFull(f"while trying to {what}: {full}") from exc
        if denied(exc):
            prefix = self._prefix
            raise EtcdDenied(
                f"etcd denied {self._node_id} the job's keys ({prefix}) while "
                f"trying to {what}. Fix: grant cluster.etcd_user's role readwrite on "
                f"them (etcdctl role grant-permission ROLE readwrite --prefix=true "
                f"{prefix}), or run the job under a prefix the role covers "
                "(rendezvous.prefix, job_id)"
            ) from exc

    def put_tracking_space(self, key: str, value: str, lease: Any) -> None:
        """:meth:`put`, once, keeping track of whether etcd is out of space.

        It raises what etcd raises. A refusal for lack of space is named (:meth:`no_space`), and a
        put that lands ends the episode, so that the next refusal is reported again. Rank 0's
        ``progress`` put, every few seconds, tracks it so."""
        try:
            self.put(key, value, lease)
        except etcd_errors() as exc:
            self.no_space(exc)
            raise
        self._full = None

    def no_space(self, exc: BaseException) -> NoSpace | None:
        """Whether etcd refused the call that raised ``exc`` for lack of space.

        The test is :func:`launcher.rendezvous.etcd_usage.out_of_space`. The first refusal is
        reported as an ``etcd_no_space`` event, with the fix. Rank 0's node learns it first: its
        ``progress`` put is refused within seconds, and the next one that lands ends the episode."""
        full = out_of_space(self.raw, exc)
        if full is None:
            return None
        with self._full_lock:
            first, self._full = self._full is None, full
        if first:
            self._emit(
                ev.ETCD_NO_SPACE,
                f"{self._node_id}: {full.reason}: until then no round can change and no "
                f"node can join (a round in progress trains on). Fix: {full.fix}",
                level=logging.ERROR,
                reason=full.reason,
                fix=full.fix,
            )
        return full
