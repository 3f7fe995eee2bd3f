"""A compressed week: the real job under a fault every few seconds, and what piles up.

At the failure rate Meta reports for its research clusters (a mean time to failure of 7.9 hours
for a 1,024-GPU job), a 128-node run sees about three faults a day, each an in-place rebuild in
processes that never restart. This bench runs ``python -m chaos`` on a 3-node job with a random
campaign of ``--faults`` faults of mixed kinds (nodes killed and started again, workers killed,
planned leaves, freezes) ``--mtbf-s`` apart, checkpointing every ``--ckpt-every`` steps, and
after every recovery samples every agent and worker (resident memory, open descriptors,
threads: :class:`chaos.resources.ResourceWatch`) and the job's etcd (revision, database size).
Strikes count only within ``STRIKE_WINDOW_S``: the faults a real week spreads over many nodes
fall here on two, and must not quarantine them.
Once the campaign has struck its last fault and the job recovered from it, the job is stopped
(SIGTERM: a planned leave of every node). It prints:

- faults struck and recoveries seen, and the campaign's goodput (:func:`chaos.verdict.goodput`);
- per role, the steepest growth per recovery of memory, descriptors and threads among the
  processes that lived through at least ``WARMUP + 4`` recoveries (:func:`chaos.resources.growth`);
- etcd's revisions and database size per hour;
- the run directory's disk use by part, per hour and per simulated day (``FAULTS_PER_DAY``
  faults);

and draws each process's memory over the recoveries (``--png``). A test runs a short form
(tests/test_soak.py) and fails on growth.

``--pattern same-node`` is the other shape a long run sees: the same node, the last one, killed
every ``--every-steps`` steps (30 unless given) once the job trains at its full world again, and
started again ``--restart-after-s`` later, so that each cycle is a shrink round and a grow round
of the survivors. Its growth is counted after ``--warmup`` recoveries (20 unless given: 10
cycles).

    .venv/bin/python bench/soak.py                          # 100 faults, about 15 minutes
    .venv/bin/python bench/soak.py --faults 20 --png /tmp/soak.png
    .venv/bin/python bench/soak.py --pattern same-node --faults 100 --png /tmp/same.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.resources import METRICS, WARMUP, Growth, ResourceWatch, Sample, growth  # noqa: E402
from elastic import event_types as ev  # noqa: E402
from elastic.config import load  # noqa: E402
from elastic.events import EventFollower  # noqa: E402
from launcher.commands.disk_usage import PARTS, usage  # noqa: E402

FAULTS_PER_DAY = 3.0  # a 128-node run at Meta's 7.9 h MTTF per 1,024 GPUs
KINDS = "kill_node,kill_worker,leave_node,freeze_node"
MIXED, SAME_NODE = "mixed", "same-node"
SAME_NODE_EVERY_STEPS = 30
SAME_NODE_WARMUP = 20  # recoveries: 10 cycles of a kill and a return
POLL_S = 0.2
SETTLE_S = 10.0  # after the last fault's recovery: the nodes it took come back
FINAL = ("samples", "replicas")  # the invariants that need the job to have finished
# A node of a real 128-node job meets a fault every few weeks, so its strikes (health.max_strikes
# within health.strike_window_s, an hour) never add up to a quarantine. Here two nodes take every
# fault seconds apart: with the hour's window both were quarantined within 3 minutes and the soak
# went on measuring one node training alone. Strikes count within this many seconds instead.
STRIKE_WINDOW_S = 1.0


@dataclass
class Soak:
    """What one soak run measured."""

    faults: int = 0
    skipped: int = 0  # faults the campaign found no target for
    quarantined: int = 0  # nodes that quarantined themselves
    recoveries: int = 0
    seconds: float = 0.0
    goodput: float | None = None
    ok: bool | None = None  # the campaign's invariants held
    samples: list[Sample] = field(default_factory=list)
    growth: dict[str, Growth] = field(default_factory=dict)
    etcd: list[tuple[float, int, int]] = field(default_factory=list)  # (t, revision, db bytes)
    disk: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (t, part -> bytes)


def etcd_client(run_dir: Path) -> Any:
    """A client of the job's etcd (the campaign's own), from the job's config."""
    from launcher.rendezvous.etcd import connect

    cfg = load(run_dir / "config.yaml")
    return connect(list(cfg.cluster.etcd_endpoints), timeout_s=5.0)


def etcd_state(client: Any) -> tuple[int, int]:
    from launcher.rendezvous.etcd_usage import usage

    u = usage(client)
    return u.revision, u.db_size


def launcher_of(chaos: subprocess.Popen[bytes]) -> psutil.Process | None:
    """The job's ``python -m launcher``, which ``python -m chaos`` started."""
    try:
        for child in psutil.Process(chaos.pid).children():
            if "launcher" in child.cmdline():
                return child
    except psutil.NoSuchProcess:
        pass
    return None


def stop(chaos: subprocess.Popen[bytes], watch: ResourceWatch) -> None:
    """Send SIGTERM to the job's launcher and to every agent, so that each node leaves as planned.

    The agents the campaign started again are not the launcher's, hence every agent."""
    job = launcher_of(chaos)
    agents = [pid for pid, (_, role, _) in watch.procs.items() if role == "agent"]
    for proc in ([job] if job else []) + [
        psutil.Process(p) for p in agents if psutil.pid_exists(p)
    ]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)


def spaced(args: argparse.Namespace) -> str:
    """``--every-steps``: the campaign's faults written out, one every that many steps.

    Their kinds come in turn from ``--kinds``; each strikes a node other than rank 0's, or the last
    node for ``--pattern same-node``."""
    kinds = args.kinds.split(",")
    same = args.pattern == SAME_NODE
    # One worker a node (a CPU node's cluster.cpu_workers): the node back means every rank is.
    target, world = (f"node{args.nodes - 1}", args.nodes) if same else ("not_rank0", 0)
    faults = [
        f"{{kind:{kinds[i % len(kinds)]},at_step:{(i + 1) * args.every_steps},target:{target},"
        f"min_world:{world},"
        f"duration_s:{args.freeze_s},restart_after_s:{args.restart_after_s}}}"
        for i in range(args.faults)
    ]
    return f"campaign.faults=[{','.join(faults)}]"


def overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    if args.every_steps:
        campaign = ["campaign.mtbf_s=0", spaced(args)]
    else:
        campaign = [
            f"campaign.count={args.faults}",
            f"campaign.mtbf_s={args.mtbf_s}",
            f"campaign.kinds=[{args.kinds}]",
            "campaign.target=not_rank0",
            f"campaign.freeze_s={args.freeze_s}",
            f"campaign.restart_after_s={args.restart_after_s}",
        ]
    return [
        f"run_dir={run_dir}",
        f"job_id=soak-{os.getpid()}",
        "campaign=random",
        f"campaign.seed={args.seed}",
        *campaign,
        f"cluster.nodes={args.nodes}",
        # Without --epochs, the job is stopped once the campaign is over.
        f"trainer.epochs={args.epochs or 100000}",
        f"checkpoint.every_steps={args.ckpt_every}",
        f"health.strike_window_s={STRIKE_WINDOW_S}",
        *args.job,
    ]


def run(args: argparse.Namespace, run_dir: Path) -> Soak:
    """The soak: launch, follow, sample after each recovery, stop after the last fault."""
    out = Soak()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / "soak-chaos.out", "wb") as log:
        chaos = subprocess.Popen(
            [sys.executable, "-m", "chaos", *overrides(args, run_dir)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    watch, follower, client = ResourceWatch(), None, None
    began, last_fault, stopping, deadline = time.monotonic(), None, False, None
    try:
        while chaos.poll() is None:
            if follower is None and (run_dir / "events").is_dir():
                follower = EventFollower(run_dir)
            events = follower.poll() if follower is not None else []
            for e in events:
                if ev.FAULT_INJECTED.matches(e) or ev.FAULT_SKIPPED.matches(e):
                    out.faults += 1
                    out.skipped += ev.FAULT_SKIPPED.matches(e)
                    last_fault = time.monotonic()
                elif ev.QUARANTINED.matches(e):
                    out.quarantined += 1
            if client is None and (run_dir / "config.yaml").exists():
                client = etcd_client(run_dir)
                out.etcd.append((time.monotonic() - began, *etcd_state(client)))
                out.disk.append((time.monotonic() - began, usage(run_dir)))
            if watch.see(events):
                now = time.monotonic() - began
                if client is not None:
                    out.etcd.append((now, *etcd_state(client)))
                out.disk.append((now, usage(run_dir)))
                print(
                    f"soak: recovery {watch.recoveries}, {out.faults} faults, "
                    + ", ".join(
                        f"{s.node} {s.role} {s.rss_mb:.0f} MB"
                        + (f" GPU {s.gpu_mb:.0f} MB" if s.gpu_mb else "")
                        + f" {s.fds} fds {s.threads} thr"
                        for s in watch.samples
                        if s.recovery == watch.recoveries
                    ),
                    flush=True,
                )
            over = out.faults >= args.faults and last_fault is not None and not args.epochs
            if over and not stopping and time.monotonic() - last_fault > SETTLE_S:
                stopping, deadline = True, time.monotonic() + 120
                print("soak: the campaign is over; stopping the job (SIGTERM)", flush=True)
                stop(chaos, watch)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the job did not stop within 120 s of its SIGTERM")
            time.sleep(POLL_S)
    finally:
        if chaos.poll() is None:
            chaos.kill()
        if client is not None:
            client.close()
    out.seconds = time.monotonic() - began
    out.disk.append((out.seconds, usage(run_dir)))
    out.recoveries, out.samples = watch.recoveries, watch.samples
    out.growth = growth(watch.samples, warmup=args.warmup)
    report = run_dir / "chaos" / "report.json"
    if report.exists():
        verdict = json.loads(report.read_text())
        out.goodput = verdict["goodput"]
        # A job stopped before its end cannot show every sample trained or its final replicas.
        judged = {k: v for k, v in verdict["violations"].items() if not stopping or k not in FINAL}
        out.ok = not any(judged.values())
    return out


def per_hour(first: float, last: float, seconds: float) -> float:
    return (last - first) * 3600 / seconds if seconds > 0 else 0.0


def table(s: Soak) -> str:
    """The figures, as printed."""
    lines = [
        f"faults {s.faults} ({s.skipped} skipped: no target), recoveries {s.recoveries}, "
        f"nodes quarantined {s.quarantined}, {s.seconds / 60:.1f} min, goodput "
        + (f"{s.goodput:.1%}" if s.goodput is not None else "n/a")
        + ("" if s.ok is None else f", invariants {'held' if s.ok else 'BROKEN'}"),
        "",
        f"{'growth per recovery':<22}{'processes':>10}{'memory MB':>12}{'GPU MB':>9}{'fds':>8}"
        f"{'threads':>9}"
        "   worst (first -> last after warm-up)",
    ]
    for role, g in sorted(s.growth.items()):
        p = g.per_recovery
        worst = g.worst["rss_mb"]
        lines.append(
            f"{role:<22}{g.processes:>10}{p['rss_mb']:>12.2f}{p['gpu_mb']:>9.2f}{p['fds']:>8.2f}"
            f"{p['threads']:>9.2f}"
            f"   {worst}: {g.first['rss_mb']:.0f} -> {g.last['rss_mb']:.0f} MB"
        )
    if len(s.etcd) >= 2:
        (t0, r0, d0), (t1, r1, d1) = s.etcd[0], s.etcd[-1]
        lines += [
            "",
            f"etcd: {per_hour(r0, r1, t1 - t0):,.0f} revisions/h, database {d0 / 2**20:.2f} -> "
            f"{d1 / 2**20:.2f} MB ({per_hour(d0, d1, t1 - t0) / 2**20:+.2f} MB/h)",
        ]
    if len(s.disk) >= 2:
        (t0, first), (t1, last) = s.disk[0], s.disk[-1]
        days = s.faults / FAULTS_PER_DAY
        lines += ["", f"{'disk':<14}{'end MB':>10}{'MB/h':>10}{'MB/sim. day':>14}"]
        for part in PARTS:
            grown = last[part] - first[part]
            lines.append(
                f"{part:<14}{last[part] / 2**20:>10.1f}{per_hour(0, grown, t1 - t0) / 2**20:>10.1f}"
                f"{(grown / days if days else 0) / 2**20:>14.1f}"
            )
        lines.append(
            f"(a simulated day: {FAULTS_PER_DAY:.0f} faults, {days:.1f} days; checkpoints are "
            "pruned to checkpoint.keep)"
        )
    return "\n".join(lines)


def draw(s: Soak, path: Path, warmup: int = WARMUP) -> None:
    """Each long-lived process's resident memory over the recoveries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(18, 4))
    lives: dict[tuple[str, int], list[Sample]] = {}
    for sample in s.samples:
        lives.setdefault((sample.role, sample.pid), []).append(sample)
    for ax, metric in zip(axes, METRICS, strict=True):
        for (role, pid), life in sorted(lives.items()):
            if len(life) < warmup + 4:
                continue
            xs = [x.recovery for x in life]
            ax.plot(
                xs,
                [getattr(x, metric) for x in life],
                ".-" if role == "worker" else "--",
                label=f"{life[0].node} {role} {pid}",
            )
        ax.set_xlabel("recovery")
        ax.set_title(metric)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"soak: {s.faults} faults, {s.recoveries} recoveries")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=100)
    p.add_argument(
        "--pattern",
        choices=[MIXED, SAME_NODE],
        default=MIXED,
        help="mixed faults on any node but rank 0's, or the last node killed and started again",
    )
    p.add_argument("--mtbf-s", type=float, default=5.0, help="random faults this far apart")
    p.add_argument(
        "--every-steps", type=int, default=0, help="instead: a fault every this many steps"
    )
    p.add_argument("--kinds", default=None, help=f"default {KINDS}; kill_node for same-node")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--freeze-s", type=float, default=4.0)
    p.add_argument("--restart-after-s", type=float, default=3.0)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"recoveries not counted as growth (default {WARMUP}; {SAME_NODE_WARMUP} for "
        "same-node)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--epochs", type=float, default=0.0, help="let the job end by itself after these epochs"
    )
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("job", nargs="*", help="more job overrides (key=value)")
    args = p.parse_args(argv)
    same = args.pattern == SAME_NODE
    if args.kinds is None:
        args.kinds = "kill_node" if same else KINDS
    if args.warmup is None:
        args.warmup = SAME_NODE_WARMUP if same else WARMUP
    if same and not args.every_steps:
        args.every_steps = SAME_NODE_EVERY_STEPS
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="soak-"))
    run_dir = work / "run"
    spacing = f"every {args.every_steps} steps" if args.every_steps else f"~{args.mtbf_s} s apart"
    print(
        f"soak: {args.faults} faults ({args.kinds}, {args.pattern}) {spacing} on a "
        f"{args.nodes}-node job, growth counted after {args.warmup} recoveries; run "
        f"directory {run_dir}",
        flush=True,
    )
    s = run(args, run_dir)
    print(table(s), flush=True)
    if args.png:
        draw(s, args.png, args.warmup)
        print(f"soak: picture {args.png}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "faults": s.faults,
                    "skipped": s.skipped,
                    "quarantined": s.quarantined,
                    "recoveries": s.recoveries,
                    "seconds": s.seconds,
                    "goodput": s.goodput,
                    "ok": s.ok,
                    "growth": {r: g.per_recovery for r, g in s.growth.items()},
                    "etcd": s.etcd,
                    "disk": s.disk,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
