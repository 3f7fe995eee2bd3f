"""``python -m launcher.commands.doctor``: is this machine fit to join a job? Without joining one.

It runs the checks an agent runs before it joins (:func:`launcher.health.checks.run_checks`), with
the thresholds and job of the same Hydra overrides as the launch, prints them as a table (``--json``
for machines), and exits 1 when a check fails, 2 on bad arguments. Given a job (``job_id`` and
``cluster.etcd_endpoints``) it also says whether this node is quarantined in it. Given an
external etcd it checks its upkeep too (:func:`etcd_space_row`, :func:`etcd_compaction_row`): a
raised alarm, a database near etcd's space quota, a history never compacted. Nothing is written:
not to etcd, and not where checkpoints go.

It is meant to be quick, so it loads no torch unless it probes GPUs: the device is decided
without CUDA where there can be no GPU (:func:`launcher.agent.slots.local_slots`), and before the
first checkpoint the disk check does not size the model (``run_checks(..., size_model=False)``).

    python -m launcher.commands.doctor
    python -m launcher.commands.doctor --json cluster=bare_metal job_id=resnet50-run1 \\
        cluster.etcd_endpoints=[10.0.0.1:2379] checkpoint.url=file:///shared/ckpt/run1
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

from elastic.config import Config
from launcher.agent.slots import local_slots
from launcher.compose import UsageError, compose, finalize
from launcher.health.checks import run_checks
from launcher.health.node_report import CheckResult, Status
from launcher.health.quarantine import Quarantine, clear_command
from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_errors, etcd_security
from launcher.rendezvous.etcd_usage import (
    DEFAULT_QUOTA_BYTES,
    MB,
    alarms,
    compacted,
    nospace_fix,
    usage,
)
from launcher.rendezvous.keys import JobKeys

# etcd cannot be asked for its --quota-backend-bytes, so the size is held to half its default.
DB_SIZE_WARN_BYTES = DEFAULT_QUOTA_BYTES // 2
# A history this long with nothing compacted means etcd does not compact it: with
# --auto-compaction-retention=1h it would have to be written within the hour, and a training job
# writes about 700 an hour (docs/bare-metal.md, "An external etcd").
UNCOMPACTED_WARN_REVISIONS = 10_000
COMPACTION_FLAGS = "--auto-compaction-mode=periodic --auto-compaction-retention=1h"


def quarantine_row(cfg: Config, node_id: str) -> CheckResult:
    """Whether ``node_id`` is quarantined in ``cfg``'s job, and how many strikes it has."""
    try:
        client = connect(
            list(cfg.cluster.etcd_endpoints),
            timeout_s=cfg.health.etcd_timeout_s,
            security=etcd_security(cfg.cluster),
        )
    except EtcdUnavailable as exc:
        return CheckResult("quarantine", Status.SKIP, f"not known: {exc}")
    try:
        q = Quarantine(client, cfg.rendezvous.prefix, cfg.job_id, cfg.health)
        found = q.get(node_id)
        if found is not None:
            entry, left = found
            return CheckResult(
                "quarantine",
                Status.FAIL,
                f"{node_id} is quarantined in job {cfg.job_id} for {left:.0f} s more "
                f"({'; '.join(entry.reasons)}). Fix: repair the cause, then wait, or clear it: "
                + clear_command(node_id, cfg.job_id, list(cfg.cluster.etcd_endpoints), cfg.cluster),
            )
        strikes = len(q.strikes(node_id))
        return CheckResult(
            "quarantine",
            Status.PASS,
            f"not quarantined in job {cfg.job_id}; {strikes} of health.max_strikes="
            f"{cfg.health.max_strikes} failures in the last {cfg.health.strike_window_s:.0f} s",
        )
    finally:
        client.close()


def etcd_space_row(client: Any, endpoint: str) -> CheckResult:
    """The ``etcd_space`` row: fails on a raised alarm, warns on a large database.

    A raised alarm is ``NOSPACE`` (etcd refuses every write) or ``CORRUPT``. It warns when the
    database of the member that answers passes :data:`DB_SIZE_WARN_BYTES`."""
    used = usage(client)
    raised = alarms(client)
    full = [member for name, member in raised if name == "NOSPACE"]
    if full:
        return CheckResult(
            "etcd_space",
            Status.FAIL,
            f"etcd at {full[0]} is out of space (NOSPACE alarm) and refuses every write: no node "
            f"can join, no round can change. Fix: {nospace_fix(endpoint, used.revision)}",
        )
    if raised:
        members = ", ".join(f"{name} at {member}" for name, member in raised)
        return CheckResult(
            "etcd_space",
            Status.FAIL,
            f"etcd has alarms raised ({members}). Fix: repair the member (a CORRUPT one: replace "
            "it, etcdctl member remove / add, from a healthy member's snapshot), then etcdctl "
            f"--endpoints={endpoint} alarm disarm",
        )
    in_use = "" if used.db_size_in_use is None else f", {used.db_size_in_use / MB:.1f} MB in use"
    size = f"database {used.db_size / MB:.1f} MB{in_use}"
    if used.db_size >= DB_SIZE_WARN_BYTES:
        return CheckResult(
            "etcd_space",
            Status.WARN,
            f"{size}: past {DB_SIZE_WARN_BYTES / MB:.0f} MB, half of etcd's default "
            f"--quota-backend-bytes ({DEFAULT_QUOTA_BYTES / MB:.0f} MB), beyond which it raises "
            f"NOSPACE and refuses writes. Fix: etcdctl --endpoints={endpoint} compact "
            f"{used.revision}; etcdctl --endpoints={endpoint} defrag --cluster; run etcd with "
            f"{COMPACTION_FLAGS}, and with a larger --quota-backend-bytes (at most 8 GiB) if the "
            "data needs it",
        )
    return CheckResult(
        "etcd_space",
        Status.PASS,
        f"no alarm; {size}, below {DB_SIZE_WARN_BYTES / MB:.0f} MB (half of etcd's default "
        "--quota-backend-bytes)",
    )


def etcd_compaction_row(
    client: Any, key: str, warn_after: int = UNCOMPACTED_WARN_REVISIONS
) -> CheckResult:
    """The ``etcd_compaction`` row: whether etcd compacts its history.

    Its flags cannot be read from a client. What can be is whether it ever compacted
    (:func:`compacted`, a read of ``key`` at revision 1), and how many revisions it holds. Past
    ``warn_after`` with none compacted, it warns that auto-compaction is off."""
    revision = usage(client).revision
    if compacted(client, key):
        return CheckResult(
            "etcd_compaction",
            Status.PASS,
            f"etcd compacts its history (revision 1 is compacted; now at revision {revision})",
        )
    if revision > warn_after:
        return CheckResult(
            "etcd_compaction",
            Status.WARN,
            f"etcd has compacted none of its {revision} revisions (more than {warn_after}): "
            "auto-compaction is off, or its retention is longer than etcd has run. It keeps every "
            "revision of every key until its database passes --quota-backend-bytes and it "
            f"refuses all writes (NOSPACE). Fix: run every etcd member with {COMPACTION_FLAGS}; "
            f"meanwhile etcdctl compact {revision}",
        )
    return CheckResult(
        "etcd_compaction",
        Status.PASS,
        f"{revision} revisions, none compacted yet: not yet due on an etcd this young (this "
        f"check warns past {warn_after}; etcd compacts only when run with {COMPACTION_FLAGS} "
        "or similar)",
    )


def etcd_upkeep_rows(cfg: Config) -> list[CheckResult]:
    """The external etcd's :func:`etcd_space_row` and :func:`etcd_compaction_row`.

    They go as far as this node may read them: SKIP where it may not, or etcd does not answer."""
    endpoints = list(cfg.cluster.etcd_endpoints)
    try:
        client = connect(
            endpoints, timeout_s=cfg.health.etcd_timeout_s, security=etcd_security(cfg.cluster)
        )
    except EtcdUnavailable as exc:
        return [CheckResult("etcd_space", Status.SKIP, f"not known: {exc}")]
    key = JobKeys(cfg.rendezvous.prefix, cfg.job_id).progress
    try:
        return [
            _or_skip("etcd_space", lambda: etcd_space_row(client, ",".join(endpoints))),
            _or_skip("etcd_compaction", lambda: etcd_compaction_row(client, key)),
        ]
    finally:
        client.close()


def _or_skip(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """``check()``, or SKIP when etcd refuses or fails the reads it makes."""
    import grpc

    try:
        return check()
    except etcd_errors() as exc:  # etcd away, or this node's etcd user may not read it
        why = exc.code().name if isinstance(exc, grpc.RpcError) else exc.__class__.__name__
        return CheckResult(name, Status.SKIP, f"not known: etcd answered {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.commands.doctor",
        description="Run the health checks a node passes before it joins a job, without "
        "joining. Any other argument is a Hydra override, as for python -m launcher.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--node-id", default="", help="default: cluster.node_id or the host name")
    args, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING)

    try:
        raw = compose(overrides)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = finalize(raw)
    node_id = args.node_id or cfg.cluster.node_id or socket.gethostname()
    slots, device = local_slots(cfg)
    endpoints = list(cfg.cluster.etcd_endpoints)
    report = run_checks(cfg, node_id, endpoints, slots, device, size_model=False)
    if raw.job_id and cfg.cluster.etcd_endpoints:
        row = quarantine_row(cfg, node_id)
        report = dataclasses.replace(report, results=(*report.results, row))
    if cfg.cluster.etcd_endpoints:
        rows = etcd_upkeep_rows(cfg)
        report = dataclasses.replace(report, results=(*report.results, *rows))
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
