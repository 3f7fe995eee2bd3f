"""An operator's view of a job's quarantine: list it, clear it, add to it.

Run it as ``python -m launcher.commands.quarantine list|clear|add``.

The job and its etcd come from the same Hydra overrides as the launch (:mod:`launcher.compose`),
so ``job_id=... cluster.etcd_endpoints=[...]`` name the job as they did when it was started.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from launcher.compose import UsageError, compose
from launcher.health.quarantine import Entry, Quarantine
from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_security


def _format_entries(entries: list[tuple[Entry, float]]) -> str:
    if not entries:
        return "no node is quarantined"
    rows = [("node", "left", "until", "by", "reasons")]
    for entry, left in entries:
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.until))
        rows.append((entry.node_id, f"{left:.0f} s", until, entry.by, "; ".join(entry.reasons)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)), r[4]]) for r in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.commands.quarantine",
        description="List, clear or add quarantined nodes of a running job. The job and its "
        "etcd come from the same Hydra overrides as the launch, e.g. job_id=resnet50-run1 "
        "cluster=bare_metal cluster.etcd_endpoints=[10.0.0.1:2379].",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="quarantined nodes and the cooldown they have left")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    clear = sub.add_parser("clear", help="end nodes' quarantine now and forget their strikes")
    clear.add_argument("nodes", nargs="*", help="node ids (see list)")
    clear.add_argument("--all", action="store_true", help="every quarantined node")
    add = sub.add_parser("add", help="keep a node out of the job (drain it) for a while")
    add.add_argument("nodes", nargs="+", help="node ids")
    add.add_argument("--seconds", type=float, default=0.0, help="default health.quarantine_s")
    add.add_argument("--reason", default="put in quarantine by an operator")
    argv = sys.argv[1:] if argv is None else argv
    # key=value words are Hydra overrides, wherever they stand (node ids never contain '=').
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])

    try:
        cfg = compose(overrides, need_job=True)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        client = connect(list(cfg.cluster.etcd_endpoints), security=etcd_security(cfg.cluster))
    except EtcdUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    q = Quarantine(client, cfg.rendezvous.prefix, cfg.job_id, cfg.health)
    try:
        if args.command == "list":
            entries = q.entries()
            if args.json:
                print(json.dumps([{**asdict(e), "left_s": left} for e, left in entries]))
            else:
                print(_format_entries(entries))
            return 0
        if args.command == "clear":
            nodes = [e.node_id for e, _ in q.entries()] if args.all else args.nodes
            if not nodes:
                print("error: name the nodes to clear, or pass --all", file=sys.stderr)
                return 2
            missing = [n for n in nodes if not q.clear(n)]
            for n in nodes:
                print(f"{n}: {'was not quarantined' if n in missing else 'cleared'}")
            return 0
        seconds = args.seconds or cfg.health.quarantine_s
        for n in args.nodes:
            entry = q.add(n, seconds, (args.reason,), by="operator")
            until = time.strftime("%H:%M:%S", time.localtime(entry.until))
            print(f"{n}: quarantined until {until}")
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
