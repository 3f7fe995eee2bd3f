"""Health reports, strikes and quarantine in etcd, as the agent and the operator's command use them.

A node that fails again and again (its checks, its workers, its lease) costs every other node a
new round each time it leaves and comes back. After ``health.max_strikes`` failures within
``health.strike_window_s`` it is quarantined: it leaves the job and stays out for
``health.quarantine_s``, then checks itself again and may rejoin. The cooldown is an etcd lease
that nobody keeps alive, so it ends on time even if the node died meanwhile, and the leader
never places a quarantined node (:func:`launcher.rendezvous.round_plan.plan_round`). Operators
use ``python -m launcher.commands.quarantine`` (:mod:`launcher.commands.quarantine`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from elastic import event_types as ev
from elastic.config import ClusterConfig, HealthConfig
from elastic.event_types import EventType
from elastic.events import EventLog
from launcher.health.node_report import HealthReport
from launcher.rendezvous.keys import JobKeys

CLEAR_POLL_S = 1.0  # how soon a waiting node notices that an operator cleared it


@dataclass(frozen=True)
class Entry:
    """A quarantined node: since when, until when, why, and who put it there."""

    node_id: str
    since: float
    until: float
    reasons: tuple[str, ...]
    by: str  # "agent" (its own strikes) or "operator"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Entry:
        data = json.loads(raw)
        data["reasons"] = tuple(data["reasons"])
        return cls(**data)


class Quarantine:
    """One job's health records in etcd, as seen from an agent or an operator's command."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        job_id: str,
        cfg: HealthConfig,
        events: EventLog | None = None,
    ) -> None:
        self._client = client
        self._cfg = cfg
        self._events = events
        # In the rendezvous prefix: every agent's watch sees quarantine come and go.
        self._keys = JobKeys(prefix, job_id)

    # --- reports -------------------------------------------------------------------------------

    def publish(self, report: HealthReport) -> None:
        self._client.put(self._keys.report(report.node_id), report.to_json())

    def report(self, node_id: str) -> HealthReport | None:
        raw, _ = self._client.get(self._keys.report(node_id))
        return HealthReport.from_json(raw) if raw else None

    # --- strikes -------------------------------------------------------------------------------

    def strikes(self, node_id: str) -> list[dict[str, Any]]:
        """The node's failures within ``strike_window_s``, oldest first."""
        raw, _ = self._client.get(self._keys.strike(node_id))
        horizon = time.time() - self._cfg.strike_window_s
        return [s for s in (json.loads(raw) if raw else []) if s["ts"] >= horizon]

    def strike(self, node_id: str, reason: str) -> Entry | None:
        """Count a failure of ``node_id``; quarantine it when it reaches ``max_strikes``.

        Only the node itself strikes its own key, so the read-modify-write needs no transaction.
        """
        strikes = [*self.strikes(node_id), {"ts": time.time(), "reason": reason}]
        self._emit(
            ev.STRIKE, strikes=len(strikes), max_strikes=self._cfg.max_strikes, reason=reason
        )
        if len(strikes) < self._cfg.max_strikes:
            self._client.put(self._keys.strike(node_id), json.dumps(strikes))
            return None
        return self.add(
            node_id, self._cfg.quarantine_s, tuple(s["reason"] for s in strikes), by="agent"
        )

    # --- quarantine ----------------------------------------------------------------------------

    def add(self, node_id: str, seconds: float, reasons: tuple[str, ...], by: str) -> Entry:
        """Quarantine ``node_id`` for ``seconds``; its strikes start again from zero."""
        now = time.time()
        entry = Entry(node_id, now, now + seconds, reasons, by)
        lease = self._client.lease(max(2, math.ceil(seconds)))
        self._client.put(self._keys.quarantined(node_id), entry.to_json(), lease=lease)
        self._client.delete(self._keys.strike(node_id))
        self._emit(ev.QUARANTINED, peer=node_id, until=entry.until, reasons=list(reasons), by=by)
        return entry

    def get(self, node_id: str) -> tuple[Entry, float] | None:
        """The node's entry and the seconds its cooldown has left (from the lease), or None."""
        raw, meta = self._client.get(self._keys.quarantined(node_id))
        if raw is None:
            return None
        return Entry.from_json(raw), self._left(meta)

    def entries(self) -> list[tuple[Entry, float]]:
        return sorted(
            (
                (Entry.from_json(raw), self._left(meta))
                for raw, meta in self._client.get_prefix(self._keys.quarantine)
            ),
            key=lambda e: e[0].node_id,
        )

    def clear(self, node_id: str) -> bool:
        """End ``node_id``'s quarantine now and forget its strikes; False if it had none."""
        deleted = bool(self._client.delete(self._keys.quarantined(node_id)))
        self._client.delete(self._keys.strike(node_id))
        return deleted

    def wait_cleared(self, node_id: str, timeout_s: float) -> bool:
        """Block until ``node_id`` is out of quarantine (cooldown over or cleared); True if it is.

        It waits at most ``timeout_s``. It looks again when the lease should have run out, and
        every ``CLEAR_POLL_S`` for an operator's clear: a watch would be quicker by a second, but
        etcd3's watch thread outlives its client.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.get(node_id)
            if found is None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, found[1] + 0.1, CLEAR_POLL_S))

    def _left(self, meta: Any) -> float:
        if not meta.lease_id:
            return math.inf
        return float(max(0, self._client.get_lease_info(meta.lease_id).TTL))

    def _emit(self, event: EventType, **fields: Any) -> None:
        if self._events is not None:
            self._events.emit(event, **fields)


def clear_command(node_id: str, job_id: str, endpoints: list[str], cluster: ClusterConfig) -> str:
    """The command line an operator runs to end ``node_id``'s quarantine now.

    It carries the job's etcd security settings, so that it works against a secured etcd as
    printed (the password stays in its file or the environment)."""
    words = [
        f"python -m launcher.commands.quarantine clear {node_id} job_id={job_id}",
        f"cluster.etcd_endpoints=[{','.join(endpoints)}]",
    ]
    tls = cluster.etcd_tls
    words += [
        f"cluster.etcd_tls.{name}={getattr(tls, name)}"
        for name in ("ca", "cert", "key", "server_name")
        if getattr(tls, name)
    ]
    if cluster.etcd_user:
        words.append(f"cluster.etcd_user={cluster.etcd_user}")
    if cluster.etcd_user and cluster.etcd_password_file:
        words.append(f"cluster.etcd_password_file={cluster.etcd_password_file}")
    return " ".join(words)
