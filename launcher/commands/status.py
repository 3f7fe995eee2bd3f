"""``python -m launcher.commands.status``: one screen for an operator of a running job.

It shows the members (host, ranks, readiness, health report, quarantine), the round and its
leader, the newest step rank 0's agent published (:mod:`launcher.agent.progress_key`) with the
estimated time left, and the newest committed checkpoint with its age; ``--json`` prints the same
data, ``--watch [seconds]`` refreshes it. The job and its etcd come from the launch's Hydra
overrides (``job_id=... cluster.etcd_endpoints=[...]``); a local run's embedded etcd is found in
its run directory, and with no job named the newest running local job is shown. Everything is
read in one range read and a listing of the checkpoints' manifests (nothing is loaded or hashed);
:func:`gather` and :func:`render` are pure functions of that data and the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic import config
from elastic.eta import as_text
from launcher.compose import UsageError, compose, finalize
from launcher.health.node_report import HealthReport
from launcher.local_cluster import ENDPOINTS_FILE
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.membership import NodeRecord, Round, leader_value

# One key of the range read: its value and create revision (a node's registration).
Keys = Mapping[str, tuple[bytes, int]]


class StatusError(RuntimeError):
    """What keeps the status from being read; the message names the setting and the fix."""


# --- the data ----------------------------------------------------------------------------------


def newest_checkpoint(url: str, now: float) -> dict[str, Any] | None:
    """The newest committed checkpoint at ``url`` whose files are all there; None if none.

    Its files must have the sizes its manifest lists (the loader also checks their sha256). It
    is found without loading it."""
    import fsspec

    from elastic.manifest import PREFIX, committed, manifest_bytes

    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    for manifest in committed(url):
        folder = f"{PREFIX}{manifest['step']:09d}"
        try:
            sizes = {n: fs.size(f"{root}/{folder}/{n}") for n in manifest["files"]}
        except (OSError, ValueError):
            continue
        if any(sizes[n] != f["size"] for n, f in manifest["files"].items()):
            continue
        saved_at = float(manifest.get("saved_at", 0.0))
        return {
            "step": manifest["step"],
            "url": f"{url.rstrip('/')}/{folder}",
            "saved_at": saved_at,
            "age_s": round(now - saved_at, 1),
            "world_size": manifest.get("world_size"),
            "samples_seen": manifest.get("progress", {}).get("samples_seen"),
            "bytes": manifest_bytes(manifest),
        }
    return None


@dataclasses.dataclass(frozen=True)
class JobRead:
    """A job's keys decoded, each folder by node id: what :func:`gather` builds the status from."""

    nodes: dict[str, NodeRecord]
    reports: dict[str, HealthReport]
    strikes: dict[str, Any]
    quarantine: dict[str, Any]
    stragglers: dict[str, Any]
    round: Round | None
    leader: str  # the leader's node id; "" for none
    leads: str  # the leader key's value, which names the leader's registration too

    @classmethod
    def decode(cls, keys: Keys, job: JobKeys) -> JobRead:
        """The job's folders and single keys from its range read, by full key."""

        def under(folder: str) -> dict[str, tuple[bytes, int]]:
            return {k[len(folder) :]: v for k, v in keys.items() if k.startswith(folder)}

        raw_round = keys.get(job.round)
        rnd = None
        if raw_round:
            parts = under(job.round_part_folder(json.loads(raw_round[0])["parts"]))
            rnd = Round.from_values(raw_round[0], {n: v for n, (v, _) in parts.items()}, whole=True)
        raw_leader = keys.get(job.leader)
        return cls(
            nodes={n: NodeRecord.from_json(v, rev) for n, (v, rev) in under(job.nodes).items()},
            reports={n: HealthReport.from_json(v) for n, (v, _) in under(job.reports).items()},
            strikes={n: json.loads(v) for n, (v, _) in under(job.strikes).items()},
            quarantine={n: json.loads(v) for n, (v, _) in under(job.quarantine).items()},
            stragglers={n: json.loads(v) for n, (v, _) in under(job.stragglers).items()},
            round=rnd,
            leader=json.loads(raw_leader[0])[0] if raw_leader else "",
            leads=raw_leader[0].decode() if raw_leader else "",
        )


def gather(
    keys: Keys,
    prefix: str,
    job_id: str,
    now: float,
    checkpoint: dict[str, Any] | None = None,
    endpoints: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The status of a job at wall time ``now``: the data that ``--json`` prints.

    It comes from the job's keys (:meth:`JobKeys.everything`, by full key), with the newest
    checkpoint (:func:`newest_checkpoint`)."""
    job = JobKeys(prefix, job_id)
    read = JobRead.decode(keys, job)
    in_round = [m.node_id for m in read.round.members] if read.round else []
    others = sorted((set(read.nodes) | set(read.reports) | set(read.quarantine)) - set(in_round))
    raw_progress = keys.get(job.progress)
    progress = json.loads(raw_progress[0]) if raw_progress else None
    if progress is not None:
        progress["age_s"] = round(now - progress["logged_at"], 1)
    return {
        "job_id": job_id,
        "prefix": prefix,
        "endpoints": list(endpoints),
        "at": now,
        "done": job.done in keys,
        "leader": read.leader,
        "round": _round_data(read.round, now),
        "members": [_member_data(read, node_id, now) for node_id in in_round + others],
        "progress": progress,
        "checkpoint": checkpoint,
    }


def _round_data(rnd: Round | None, now: float) -> dict[str, Any] | None:
    """The round's part of the status; None before the first round."""
    if rnd is None:
        return None
    return {
        "number": rnd.number,
        "world_size": rnd.world_size,
        "members": [m.node_id for m in rnd.members],
        "formed_at": rnd.formed_at,
        "age_s": round(now - rnd.formed_at, 1),
        "after_step": rnd.after_step,
        "store": f"{rnd.store_host}:{rnd.store_port}",
    }


def _member_data(read: JobRead, node_id: str, now: float) -> dict[str, Any]:
    """One node's row: its record, its place in the round, health, quarantine and strikes."""
    record, report = read.nodes.get(node_id), read.reports.get(node_id)
    m = read.round.member(node_id) if read.round else None
    current = (
        m is not None
        and record is not None
        and (record.joined_rev, record.incarnation) == (m.joined_rev, m.incarnation)
    )
    recent = [s for s in read.strikes.get(node_id, []) if isinstance(s, dict)]
    return {
        "node": node_id,
        "host": record.host if record else (report.host if report else ""),
        "registered": record is not None,
        "in_round": current,
        "ranks": [m.first_rank, m.first_rank + m.slots - 1] if current and m else None,
        "slots": record.slots if record else None,
        "ready": record.ready if record else False,
        "incarnation": record.incarnation if record else None,
        "leaving_after": record.leaving_after if record else 0,
        "leader": record is not None and read.leads == leader_value(node_id, record.joined_rev),
        "health": None if report is None else _health_data(report, now),
        "quarantine": _quarantine_data(read.quarantine.get(node_id), now),
        "strikes": len(recent),
        "straggler": read.stragglers.get(node_id),
        "metrics": record.metrics_url if record else "",
    }


def _health_data(report: HealthReport, now: float) -> dict[str, Any]:
    """A node's newest health report, as the status shows it."""
    return {
        "ok": report.ok,
        "counts": {s: n for s, n in report.counts.items() if n},
        "failures": [f"{r.name}: {r.message}" for r in report.failures],
        "checked_at": report.checked_at,
        "age_s": round(now - report.checked_at, 1),
    }


def _quarantine_data(entry: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """A node's quarantine entry with the time it has left; None when it is not quarantined."""
    if entry is None:
        return None
    return {
        "until": entry["until"],
        "left_s": round(max(0.0, entry["until"] - now), 1),
        "by": entry["by"],
        "reasons": entry["reasons"],
    }


# --- the screen --------------------------------------------------------------------------------


def age(seconds: float) -> str:
    """A duration as an operator reads it: ``4.2 s``, ``75 s``, ``12 min``, ``3.5 h``."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def _health(h: dict[str, Any] | None) -> str:
    if h is None:
        return "-"
    counts = ", ".join(f"{n} {s}" for s, n in h["counts"].items())
    if h["ok"]:
        return f"ok ({counts}), {age(h['age_s'])} ago"
    failed = ", ".join(f.split(":", 1)[0] for f in h["failures"])
    return f"FAIL {failed}, {age(h['age_s'])} ago"


def _straggler(m: dict[str, Any], now: float) -> str:
    s = m["straggler"]
    if s is None:
        return "-"
    what = "evicted" if s["evicted"] else "kept"
    return f"{s['slowdown']:.1f}x slower at step {s['step']}, {age(now - s['at'])} ago ({what})"


def _quarantine(m: dict[str, Any]) -> str:
    q = m["quarantine"]
    if q is None:
        return f"{m['strikes']} strike(s)" if m["strikes"] else "-"
    until = time.strftime("%H:%M:%S", time.localtime(q["until"]))
    return f"until {until} ({age(q['left_s'])} left, by {q['by']}: {'; '.join(q['reasons'])})"


def _state(m: dict[str, Any]) -> tuple[str, str]:
    """The ranks column and the ready column."""
    if not m["registered"]:
        return "-", "not registered"
    ranks = m["ranks"]
    if ranks is None:
        where = "-"
    else:
        where = str(ranks[0]) if ranks[0] == ranks[1] else f"{ranks[0]}-{ranks[1]}"
    ready = "yes" if m["ready"] else "no"
    if m["leaving_after"]:
        ready += f", leaving after step {m['leaving_after']}"
    return where, ready


def render(data: dict[str, Any]) -> str:
    """The screen for :func:`gather`'s data: a few summary lines, then one row per node."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["at"]))
    etcd = ",".join(data["endpoints"]) or "?"
    lines = [f"job {data['job_id']}  (etcd {etcd}, {data['prefix']})  {when}"]
    if data["done"]:
        lines.append("the job is DONE")
    rnd = data["round"]
    if rnd is None:
        lines.append("round      none yet (waiting for cluster.min_nodes ready nodes)")
    else:
        switch = f", members switch after step {rnd['after_step']}" if rnd["after_step"] else ""
        lines.append(
            f"round      {rnd['number']}: world size {rnd['world_size']} on "
            f"{len(rnd['members'])} node(s), formed {age(rnd['age_s'])} ago{switch}; "
            f"leader {data['leader'] or 'none'}"
        )
    p = data["progress"]
    if p is None:
        lines.append("progress   none published yet (rank 0's agent writes it once it trains)")
    else:
        total = f"/{p['total_samples']}" if p.get("total_samples") else ""
        lines.append(
            f"progress   step {p['step']}, epoch {p['epoch']}, samples {p['samples']}{total}, "
            f"lr {p['lr']:.6g}, loss {p['loss']:.4f}, {p['samples_per_s']:.1f} samples/s, "
            f"world size {p['world_size']} (round {p['round']}), {age(p['age_s'])} ago; "
            f"ETA {as_text(p.get('eta_s'))}"
        )
    c = data["checkpoint"]
    if c is None:
        lines.append("checkpoint none committed yet")
    else:
        lines.append(
            f"checkpoint step {c['step']}, saved {age(c['age_s'])} ago, {_size(c['bytes'])}, "
            f"world size {c['world_size']}: {c['url']}"
        )
    rows = [("node", "host", "ranks", "ready", "inc", "health", "straggler", "quarantine")]
    for m in data["members"]:
        ranks, ready = _state(m)
        inc = "-" if m["incarnation"] is None else str(m["incarnation"])
        name = m["node"] + (" *" if m["leader"] else "")
        straggler = _straggler(m, data["at"])
        rows.append(
            (name, m["host"], ranks, ready, inc, _health(m["health"]), straggler, _quarantine(m))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines.append("")
    for r in rows:
        lines.append(
            "  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip()
        )
    if len(rows) == 1:
        lines.append("(no node is registered)")
    if any(m["leader"] for m in data["members"]):
        lines.append("* leader (proposes the rounds)")
    lines += [f"{m['node']} metrics: {m['metrics']}" for m in data["members"] if m["metrics"]]
    return "\n".join(lines)


# --- reading it --------------------------------------------------------------------------------


def job_and_endpoints(overrides: list[str], cwd: Path) -> tuple[config.Config, list[str]]:
    """The job's configuration and its etcd, from the overrides or else a local run's directory.

    That directory is ``run_dir=``, ``job_id=``'s ``runs/<job_id>``, or the newest running local
    job under ``runs/``. Raises :class:`UsageError` or :class:`StatusError`."""
    cfg = compose(overrides)
    if not cfg.job_id:
        run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        if run_dir is None:
            running = sorted(
                (cwd / "runs").glob(f"*/{ENDPOINTS_FILE}"), key=lambda p: p.stat().st_mtime
            )
            if not running:
                raise UsageError(
                    "job_id is empty and no local job is running under runs/. Fix: pass "
                    "job_id=<the job's id> (and cluster.etcd_endpoints=[host:port] for a job "
                    "on an etcd cluster)"
                )
            run_dir = running[-1].parent
        saved = run_dir / "config.yaml"
        if not saved.exists():
            raise UsageError(f"{saved} does not exist. Fix: pass job_id=<the job's id>")
        cfg = dataclasses.replace(cfg, job_id=config.load(saved).job_id, run_dir=str(run_dir))
    cfg = finalize(cfg)
    saved = Path(cfg.run_dir) / "config.yaml"
    if saved.exists():  # this machine launched it: its checkpoint URL and prefix are known
        job = config.load(saved)
        if job.job_id == cfg.job_id:
            cfg = dataclasses.replace(cfg, checkpoint=job.checkpoint, rendezvous=job.rendezvous)
    endpoints = list(cfg.cluster.etcd_endpoints)
    if not endpoints:
        found = Path(cfg.run_dir) / ENDPOINTS_FILE
        if not found.exists():
            raise StatusError(
                f"cluster.etcd_endpoints is empty and {found} does not exist (a local run "
                "writes it while its embedded etcd runs). Fix: pass the job's etcd, e.g. "
                "cluster.etcd_endpoints=[10.0.0.1:2379], or run_dir=<the local run's "
                "directory> while it runs"
            )
        endpoints = found.read_text().split()[0].split(",")
    return cfg, endpoints


class Reader:
    """Reads a job's status; connects (again) to etcd when it must."""

    def __init__(self, cfg: config.Config, endpoints: list[str]) -> None:
        self.cfg, self.endpoints = cfg, endpoints
        self._client: Any = None

    def read(self) -> dict[str, Any]:
        from launcher.rendezvous.etcd import EtcdUnavailable, connect, etcd_errors, etcd_security

        cfg, prefix = self.cfg, self.cfg.rendezvous.prefix
        where = f"cluster.etcd_endpoints=[{','.join(self.endpoints)}]"
        try:
            if self._client is None:
                self._client = connect(
                    self.endpoints,
                    timeout_s=cfg.health.etcd_timeout_s,
                    security=etcd_security(cfg.cluster),
                )
            job = JobKeys(prefix, cfg.job_id)
            start, end = job.everything()
            keys = {
                meta.key.decode(): (value, meta.create_revision)
                for value, meta in self._client.get_range(start, end)
            }
        except EtcdUnavailable as exc:
            raise StatusError(f"cannot read job {cfg.job_id} from etcd ({where}): {exc}") from exc
        except etcd_errors() as exc:
            self._client = None
            raise StatusError(
                f"etcd did not answer ({where}: {exc.__class__.__name__}). Fix: check "
                "cluster.etcd_endpoints and that etcd is running"
            ) from exc
        if not keys:
            raise StatusError(
                f"etcd ({where}) holds no keys of job {cfg.job_id} under "
                f"{job.rendezvous}: the job is not running there. Fix: check "
                "job_id, cluster.etcd_endpoints and rendezvous.prefix (they must be the "
                "launch's)"
            )
        now = time.time()
        raw = keys.get(job.progress)
        url = (json.loads(raw[0]).get("checkpoint_url") if raw else "") or cfg.checkpoint.url
        try:
            checkpoint = newest_checkpoint(url, now)
        except (OSError, ValueError, ImportError):  # a store this machine cannot reach
            checkpoint = None
        return gather(keys, prefix, cfg.job_id, now, checkpoint, tuple(self.endpoints))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.commands.status",
        description="One screen on a running job: members, round, progress, checkpoint. The "
        "job and its etcd come from the launch's Hydra overrides, e.g. job_id=resnet50-run1 "
        "cluster.etcd_endpoints=[10.0.0.1:2379]; a local run needs only job_id= (or nothing: "
        "the newest running local job).",
    )
    parser.add_argument("--json", action="store_true", help="the same data as JSON")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])
    try:
        cfg, endpoints = job_and_endpoints(overrides, Path.cwd())
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StatusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    reader = Reader(cfg, endpoints)
    clear = args.watch is not None and not args.json and sys.stdout.isatty()
    try:
        while True:
            try:
                data = reader.read()
                text = json.dumps(data) if args.json else render(data)
                code = 0
            except StatusError as exc:
                if args.watch is None:
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
                text, code = f"error: {exc}", 1
            print(("\x1b[H\x1b[2J" if clear else "") + text, flush=True)
            if args.watch is None:
                return code
            time.sleep(max(0.2, args.watch))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
