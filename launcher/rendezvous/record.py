"""This node's own record in etcd (``nodes/<node_id>``), written for one registration.

The record says whether the node's workers are ready for a round, how often they failed
(``incarnation``) and after which step it leaves. A write that finds etcd away is kept and
retried by the rendezvous's sync thread (:meth:`OwnRecord.flush`); each write is conditioned on
this node's registration, so a node evicted meanwhile never re-creates its key, and learns from
the failed write that it is fenced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elastic import event_types as ev
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.etcd_client import EtcdClient
from launcher.rendezvous.lease import Emit
from launcher.rendezvous.membership import NodeRecord

log = logging.getLogger(__name__)


class OwnRecord:
    """Writes :attr:`node` under the registration :meth:`start` names.

    ``saw_own(record, revision)`` hears of each write that landed, ``fence(reason)`` of a key found
    gone, and ``wake()`` is called when a write waits for etcd."""

    def __init__(
        self,
        etcd: EtcdClient,
        key: str,
        node: NodeRecord,
        emit: Emit,
        *,
        saw_own: Callable[[NodeRecord, int], None],
        fence: Callable[[str], None],
        wake: Callable[[], None],
    ) -> None:
        self._etcd, self._key, self._emit = etcd, key, emit
        self._saw_own, self._fence, self._wake = saw_own, fence, wake
        self.node = node
        self._registration = 0  # create revision of the key
        self._lease: Any = None
        self._dirty = False  # self.node has changes etcd has not taken yet
        self._lock = threading.Lock()

    def fresh(self) -> NodeRecord:
        """The record of a new registration: not ready, no failure, not leaving."""
        self.node = replace(self.node, incarnation=0, ready=False, leaving_after=0)
        self._dirty = False
        return self.node

    def start(self, registration: int, lease: Any) -> None:
        """Write for the registration ``registration`` (the key's create revision) from now."""
        self._registration, self._lease = registration, lease

    def report_failure(self, reason: str) -> None:
        """Leave the current round at once: this node's workers failed.

        The node is placed in a later round when it reports itself ready again."""
        self.node = replace(self.node, incarnation=self.node.incarnation + 1, ready=False)
        self._write()
        self._emit(ev.FAILURE_REPORTED, incarnation=self.node.incarnation, reason=reason)

    def leave_after(self, step: int) -> None:
        """Plan this node's leave: its workers train up to ``step``.

        The others form the next round without it, and switch to it after that step
        (:func:`launcher.rendezvous.round_plan.switch_step`)."""
        self.node = replace(self.node, leaving_after=step)
        self._write()
        self._emit(ev.NODE_LEAVING, after_step=step)

    def set_ready(self) -> None:
        """This node's workers wait for a round: it may be placed in the next one."""
        self.node = replace(self.node, ready=True)
        self._write()
        self._emit(ev.NODE_READY, incarnation=self.node.incarnation)

    def flush(self) -> None:
        """Write a change that found etcd away; raises what etcd raises."""
        if self._dirty:
            self._put()

    def _write(self) -> None:
        """Write :attr:`node` now, or, if etcd is away, leave it to :meth:`flush`."""
        self._dirty = True
        try:
            self._put()
        except etcd_errors() as exc:
            log.info("etcd unavailable (%s); this node's record is written later", exc)
            self._wake()

    def _put(self) -> None:
        """Put :attr:`node` under the lease, if the key is still this registration's.

        It raises what etcd raises. A key that is gone means the node was evicted or its lease
        expired: it is fenced (the watch may not have said so yet). One write at a time, so an older
        record never lands after a newer one."""
        t = self._etcd.transactions
        with self._lock:
            record = self.node
            ok, responses = self._etcd.transaction(
                compare=[t.create(self._key) == self._registration],
                success=[t.put(self._key, record.to_json(), self._lease)],
                failure=[],
            )
            if self.node is record:  # else a newer record is on its way
                self._dirty = False
            if ok:
                written = replace(record, joined_rev=self._registration)
                self._saw_own(written, responses[0].response_put.header.revision)
        if not ok:
            self._fence("this node's key is gone (evicted, or its lease expired)")
