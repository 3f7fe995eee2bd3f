"""Whether a node still stands in the job: fenced out of it, or cut off from etcd.

A node is fenced when its key is gone (a peer evicted it, or its lease expired), and cut off when
etcd stayed away past ``rendezvous.etcd_grace_s``; either ends its part in the job. Both are
events the agent reads, set under the condition the node's view lives under, so that a wait on
the view ends at once, and followed by the ``on_change`` callback that tells the agent to look.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic import event_types as ev
from launcher.rendezvous.lease import Emit

# The rendezvous's log, as its lines have always been named.
log = logging.getLogger("launcher.rendezvous.rendezvous")


class Standing:
    """The :attr:`fenced` and :attr:`etcd_lost` events of one node (``node_id``).

    They are set under :attr:`cond` (the view's condition, shared with the view's follower). It also
    holds the agent's ``on_change``, which must return at once (the agent posts to its inbox)."""

    def __init__(self, node_id: str, emit: Emit, on_change: Callable[[], None]) -> None:
        self._node_id, self._emit, self._on_change = node_id, emit, on_change
        self.cond = threading.Condition()
        self.fenced = threading.Event()
        self.etcd_lost = threading.Event()

    def changed(self) -> None:
        """Tell whoever follows the job that the view changed or this node was fenced.

        Called without :attr:`cond` held, so the callback can read the view."""
        try:
            self._on_change()
        except Exception:  # the watch and keep-alive threads must survive a faulty callback
            log.exception("rendezvous on_change callback failed")

    def fence(self, reason: str) -> bool:
        """Consider this node out of the job; True if it was not fenced yet.

        Called with :attr:`cond` held, and then :meth:`changed` if this returns True."""
        if self.fenced.is_set():
            return False
        self._emit(
            ev.FENCED,
            f"{self._node_id} is fenced out of the job: {reason}",
            level=logging.WARNING,
            reason=reason,
        )
        self.fenced.set()
        self.cond.notify_all()
        return True

    def fence_now(self, reason: str) -> None:
        """:meth:`fence`, from a thread that does not hold :attr:`cond`."""
        with self.cond:
            fenced = self.fence(reason)
        if fenced:
            self.changed()

    def etcd_gone(self) -> None:
        """The lease keeper's word: etcd stayed away past ``rendezvous.etcd_grace_s``."""
        with self.cond:
            self.etcd_lost.set()
            self.cond.notify_all()
        self.changed()
