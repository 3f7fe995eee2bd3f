"""Admit a node into the job: wait out its quarantine, pass its health checks, register in etcd.

Before it first joins, before every rejoin and before every worker restart, a node runs the health
checks (:mod:`launcher.health.checks`) and publishes the report to etcd. A node that fails them
does not join: it exits with :data:`EXIT_UNHEALTHY` and the others carry on without it. Each
crash, fencing or failed check is a strike (:mod:`launcher.health.quarantine`); too many within
the window and the node is quarantined: it waits out the cooldown, then starts over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastic import config
from elastic import event_types as ev
from elastic.events import EventLog
from launcher.agent import decisions as decide
from launcher.agent.peer_decisions import Reach
from launcher.agent.peers import probe
from launcher.agent.slots import layout_refusal
from launcher.health.checks import run_checks
from launcher.health.node_report import Status
from launcher.health.quarantine import Entry, Quarantine, clear_command
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.etcd_client import EtcdDenied, EtcdFull, EtcdLost
from launcher.rendezvous.lease import ETCD_LOST_FIX
from launcher.rendezvous.rendezvous import NodeIdInUse, Rendezvous

log = logging.getLogger("launcher.agent")

EXIT_UNHEALTHY = 3  # the node failed its health checks (or cannot reach etcd) and did not join
EXIT_ETCD_LOST = 4  # etcd stayed away past rendezvous.etcd_grace_s, or is full; checkpoint kept
EXIT_NODE_ID_IN_USE = 5  # another live node holds this node's id (cluster.node_id)
QUARANTINE_POLL_S = 2.0  # how often a quarantined node looks up from its wait (signals)


class Admission:
    """The admission of one node: its quarantine, its health checks and its registration.

    ``stopped(timeout)`` takes in the agent's messages that come within ``timeout`` and returns
    the stop signal, if one came. An exit code comes with its :attr:`reason` (empty when the
    events said it already)."""

    def __init__(
        self,
        cfg: config.Config,
        node_id: str,
        host: str,
        endpoints: list[str],
        slots: int,
        device: str,
        guard: Quarantine,
        rdzv: Rendezvous,
        events: EventLog,
        *,
        stopped: Callable[[float], int | None],
    ) -> None:
        self._cfg, self._node_id, self._host, self._endpoints = cfg, node_id, host, endpoints
        self._slots, self._device = slots, device
        self._guard, self._rdzv, self._events = guard, rdzv, events
        self._stopped = stopped
        self.reason = ""

    def join(self, in_running_job: bool) -> int:
        """Admit the node, then register it: 0 once it is in, else the exit code."""
        self.reason = ""
        try:
            return self.admit(in_running_job) or self._register()
        except EtcdLost as exc:
            if isinstance(exc, EtcdDenied):  # waiting cannot change a role
                self.reason = str(exc)
                return EXIT_UNHEALTHY
            # A full etcd's error names its own fix (free space, disarm the alarm).
            self.reason = str(exc) if isinstance(exc, EtcdFull) else f"{exc}; {ETCD_LOST_FIX}"
            return EXIT_ETCD_LOST

    def _register(self) -> int:
        """Join the job (:meth:`Rendezvous.join`): 0, or the exit code.

        An id held by this node's own earlier incarnation is taken over at once; one held by a
        live node is waited for, up to two lease TTLs."""
        ttl = self._cfg.rendezvous.lease_ttl_s
        deadline = time.monotonic() + 2 * ttl + 1
        while True:
            try:
                self._rdzv.join()
                return 0
            except NodeIdInUse as exc:
                holder = exc.holder
                timeout = self._cfg.rendezvous.probe_timeout_s
                alive = probe(holder.host, holder.store_port, timeout) is not Reach.DEAD
                step = decide.on_node_id_in_use(
                    holder.host, self._host, alive, time.monotonic() > deadline
                )
                if isinstance(step, decide.IdTaken):
                    self.reason = str(exc)
                    return EXIT_NODE_ID_IN_USE
                if isinstance(step, decide.TakeOver):
                    self._rdzv.evict(holder, "an earlier incarnation of this node, now gone")
                    continue
            signum = self._stopped(ttl / 4)
            if signum is not None:
                self.reason = "stopped by a signal before it could register"
                return 128 + signum

    def admit(self, in_running_job: bool) -> int:
        """Wait while this node is quarantined, then run the health checks.

        Returns 0 when it may join, else the exit code. Raises :class:`EtcdLost` when etcd
        stays away."""
        found = self._rdzv.retry("read the quarantine", lambda: self._guard.get(self._node_id))
        if found is not None:
            entry, left = found
            self._events.emit(
                ev.QUARANTINE_WAIT,
                f"{self._node_id} is quarantined for {left:.0f} s more "
                f"({'; '.join(entry.reasons)}); waiting. To end it sooner: "
                + clear_command(
                    self._node_id, self._cfg.job_id, self._endpoints, self._cfg.cluster
                ),
                level=logging.WARNING,
                left_s=left,
                reasons=list(entry.reasons),
                by=entry.by,
            )
            while not self._rdzv.retry(
                "wait for the quarantine to end",
                lambda: self._guard.wait_cleared(self._node_id, QUARANTINE_POLL_S),
            ):
                signum = self._stopped(0)
                if signum is not None:
                    return 128 + signum
            self._events.emit(ev.QUARANTINE_OVER)
        return self.check(in_running_job)

    def check(self, in_running_job: bool) -> int:
        """Run the health checks and publish the report; 0 if the node may (re)join.

        Otherwise strike the node and return :data:`EXIT_UNHEALTHY`. A node already in a running
        job is not refused for what every node shares
        (:func:`launcher.agent.decisions.refusing_checks`): that is a warning."""
        if not self._cfg.health.enabled:
            log.warning("%s: health checks are off (health.enabled=false)", self._node_id)
            return 0
        report = run_checks(self._cfg, self._node_id, self._endpoints, self._slots, self._device)
        try:
            self._guard.publish(report)
        except etcd_errors() as exc:  # etcd away: the report waits for the next check
            log.warning("%s: could not publish the health report (%s)", self._node_id, exc)
        refusing = set(decide.refusing_checks([r.name for r in report.failures], in_running_job))
        shared = [r for r in report.failures if r.name not in refusing]
        warnings = [f"{r.name}: {r.message}" for r in report.results if r.status is Status.WARN]
        warnings += [
            f"{r.name} (the whole job shares it; not refused): {r.message}" for r in shared
        ]
        self._events.emit(
            ev.HEALTH_CHECKED,
            report.table(),
            ok=not refusing,
            seconds=round(report.seconds, 3),
            counts=report.counts,
            warnings=warnings,
        )
        if not refusing:
            return 0
        failed = [r for r in report.failures if r.name in refusing]
        failures = [f"{r.name}: {r.message}" for r in failed]
        entry = self.strike("failed health checks: " + ", ".join(r.name for r in failed))
        self._events.emit(
            ev.HEALTH_FAILED,
            f"{self._node_id} failed its health checks and does not join the job:\n  "
            + "\n  ".join(failures),
            level=logging.ERROR,
            failures=failures,
            quarantined_until=entry.until if entry else None,
        )
        return EXIT_UNHEALTHY

    def say_ready(self, workers_ready: bool, reaches_the_round: Callable[[], bool]) -> int:
        """Say the node is ready once its workers are and the rendezvous has caught up.

        0, or :data:`EXIT_UNHEALTHY` when the job's layout cannot take its workers. It must also
        reach every live member of the round (``reaches_the_round``, asked last: it probes
        them): only ready nodes are placed in a round. Under ``parallel.shard=node`` a node runs
        as many workers as the round's nodes (:func:`launcher.agent.slots.layout_refusal`)."""
        rdzv = self._rdzv
        if rdzv.node.ready or not (workers_ready and rdzv.synced and reaches_the_round()):
            return 0
        current = rdzv.view.round
        refusal = None
        if current is not None and self._cfg.parallel.shard is config.Shard.node:
            refusal = layout_refusal(self._slots, current.number, current.size, current.ranks)
        if refusal is None:
            rdzv.record.set_ready()
            return 0
        self.reason = refusal
        self._events.emit(
            ev.HEALTH_FAILED,
            f"{self._node_id} does not join the job: {refusal}",
            level=logging.ERROR,
            failures=[refusal],
            quarantined_until=None,
        )
        return EXIT_UNHEALTHY

    def strike(self, reason: str) -> Entry | None:
        """Count a failure of this node; the quarantine entry if this one put it there."""
        try:
            return self._guard.strike(self._node_id, reason)
        except etcd_errors() as exc:  # etcd away: the lease decides this node's fate instead
            log.warning("%s: could not record a strike (%s)", self._node_id, exc)
            return None

    def sentence(self, reason: str) -> bool:
        """Quarantine this node for ``health.quarantine_s`` for what it found while training.

        Such a finding is a straggler under ``health.straggler=evict``. The node then drains like
        a node an operator quarantined, and rejoins after the cooldown and a new check. False if
        etcd could not be told (the node trains on; the finding comes again)."""
        try:
            self._guard.add(self._node_id, self._cfg.health.quarantine_s, (reason,), by="agent")
            return True
        except etcd_errors() as exc:
            log.warning("%s: could not quarantine itself (%s)", self._node_id, exc)
            return False
