"""What serving Prometheus metrics costs an agent, in CPU, beside what the agent costs anyway.

One local job with ``metrics.port`` set trains; once it trains, each agent's CPU time (user +
system, psutil) is read over two windows of the same length: one with no scrape (the agent's own
work: its loop, heartbeats, the progress key, reading its workers' events), and one in which
every node is scraped as fast as ``--scrapes-per-s`` allows (each scrape reads the events the
node's file gained since the last one, moves the figures and answers). The difference over the
scrapes is the cost of one scrape; at Prometheus' usual 1 scrape every 15 s it is a share of a
core, printed next to the agent's own share as a ratio. The workers are not involved: a scrape
reads a file the node writes anyway. The first scrape of the second window also reads the events
of the first: the cost is counted high, not low.

    .venv/bin/python bench/metrics_cost.py                  # about 2 minutes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from elastic import event_types as ev
from elastic.events import EventFollower
from launcher.rendezvous.embedded_etcd import free_ports


def agents(launcher: psutil.Process) -> list[psutil.Process]:
    return [
        p for p in launcher.children(recursive=True) if "launcher.agent" in " ".join(p.cmdline())
    ]


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument(
        "--scrapes-per-s", type=float, default=10.0, help="each node's, in the scraped window"
    )
    parser.add_argument(
        "--every-s", type=float, default=15.0, help="the scrape interval the cost is given at"
    )
    args = parser.parse_args()
    base = free_ports(args.nodes)
    work = Path(tempfile.mkdtemp(prefix="metrics-cost-"))
    run_dir = work / "run"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            f"run_dir={run_dir}",
            f"cluster.nodes={args.nodes}",
            "trainer.epochs=1000",
            f"metrics.port={base}",
        ],
        stdout=open(work / "job.out", "w"),  # noqa: SIM115 - the job's for its life
        stderr=subprocess.STDOUT,
    )
    try:
        EventFollower(run_dir).wait_for(lambda e: ev.STEP.matches(e) and e["step"] >= 20, 600)
        procs = agents(psutil.Process(job.pid))
        urls = [f"http://127.0.0.1:{base + i}/metrics" for i in range(args.nodes)]
        for url in urls:  # the first scrape reads what came before the window
            urllib.request.urlopen(url, timeout=10).read()
        start, cpu0 = time.monotonic(), cpu_s(procs)
        time.sleep(args.window_s)
        quiet = cpu_s(procs) - cpu0
        start, cpu0, scrapes = time.monotonic(), cpu_s(procs), 0
        while time.monotonic() - start < args.window_s:
            for url in urls:
                urllib.request.urlopen(url, timeout=10).read()
                scrapes += 1
            time.sleep(max(0.0, 1 / args.scrapes_per_s - 0.001 * args.nodes))
        scraped = cpu_s(procs) - cpu0
    finally:
        job.terminate()
        job.wait(timeout=120)
    per_scrape = (scraped - quiet) / scrapes
    own = quiet / args.window_s / args.nodes
    share = per_scrape / args.every_s
    print(f"{args.nodes} agents, {args.window_s:.0f} s windows, {scrapes} scrapes in the second")
    print(f"an agent's own CPU: {100 * own:.2f} % of a core")
    print(f"one scrape: {1000 * per_scrape:.2f} ms of the agent's CPU")
    print(
        f"at 1 scrape every {args.every_s:g} s: {100 * share:.4f} % of a core, "
        f"{share / own:.3f}x the agent's own; goal < 1 % of a core: "
        f"{'met' if share < 0.01 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
