"""``python -m launcher.doctor``: is this machine fit to join a job? Without joining one.

It runs the checks an agent runs before it joins (:func:`launcher.health.checks.run_checks`), with
the thresholds and job of the same Hydra overrides as the launch, prints them as a table (``--json``
for machines), and exits 1 when a check fails, 2 on bad arguments. Given a job (``job_id`` and
``cluster.etcd_endpoints``) it also says whether this node is quarantined in it. Nothing is
written: not to etcd, and not where checkpoints go.

It is meant to be quick, so it loads no torch unless it probes GPUs: the device is decided
without CUDA where there can be no GPU (:func:`launcher.agent.slots.local_slots`), and before the
first checkpoint the disk check does not size the model (``run_checks(..., size_model=False)``).

    python -m launcher.doctor
    python -m launcher.doctor --json cluster=bare_metal job_id=resnet50-run1 \\
        cluster.etcd_endpoints=[10.0.0.1:2379] checkpoint.url=file:///shared/ckpt/run1
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys

from elastic.config import Config
from launcher.agent.slots import local_slots
from launcher.compose import UsageError, compose, finalize
from launcher.health.checks import run_checks
from launcher.health.quarantine import Quarantine, clear_command
from launcher.health.report import CheckResult, Status
from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_security


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.doctor",
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
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
