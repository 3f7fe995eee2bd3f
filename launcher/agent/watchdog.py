"""Deciding that a local worker is frozen, from the heartbeats it sends its agent.

Two ways to freeze: the whole process stops (SIGSTOP, a machine paging itself to death), and then
its heartbeats stop; or the training thread hangs while the process lives (a hung GPU kernel), and
then the heartbeat keeps saying the same step, computing. A worker whose backward has handed all
its gradient buckets to the network is waiting for its peers, which is not its fault: the peer
that hangs is judged by its own agent, so healthy nodes never evict themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Watchdog:
    limit_s: float
    last_heartbeat: float = 0.0
    _position: tuple[Any, ...] = ()
    _position_since: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)

    def start(self, now: float) -> None:
        self.last_heartbeat = self._position_since = now
        self._position = ()
        self.status = {}

    def heartbeat(self, status: dict[str, Any], now: float) -> None:
        self.last_heartbeat = now
        self.status = status
        position = (status.get("round"), status.get("step"), status.get("phase"))
        if position != self._position:
            self._position, self._position_since = position, now

    def excuse(self, now: float) -> None:
        """Judge the worker from ``now`` on, as if it had just sent its last heartbeat.

        The agent itself did not run until ``now`` (stopped, or starved of CPU). The heartbeats
        of that time wait unread in the channel, so the silence proves nothing about the worker."""
        self.last_heartbeat = max(self.last_heartbeat, now)
        self._position_since = max(self._position_since, now)

    def verdict(self, now: float) -> str | None:
        """Why the worker counts as frozen, or None."""
        silent = now - self.last_heartbeat
        if silent > self.limit_s:
            return f"no heartbeat for {silent:.1f} s"
        stuck = now - self._position_since
        if (
            self.status.get("phase") == "step"
            and not self.status.get("waiting")
            and stuck > self.limit_s
        ):
            return f"step {self.status.get('step')} computing for {stuck:.1f} s"
        return None
