"""Who takes the training loop's core: each thread's wake-ups and CPU in a running job.

On two shared cores, every time a thread beside the training loop wakes it may preempt the
loop. This reads, for every thread of the process tree under ``--pid``, its context switches
(voluntary: it slept and woke; involuntary: it was preempted) and its CPU time, twice,
``--window`` seconds apart, and prints the rates, most wake-ups first. Python threads are named
through ``py-spy dump`` (their OS name is the process's). Linux only.

    # ours: a job on the embedded defaults, sampled once it trains
    .venv/bin/python -m launcher trainer.epochs=200 run_dir=/tmp/wk/run &
    .venv/bin/python bench/wakeups.py --pid $! --after-s 60
    # plain DDP: bench/throughput.py's plain loop (its ranks are spawned), sampled while it runs
    .venv/bin/python bench/throughput.py --repeats 1 --steps 300 --aggressive-every 0 &
    .venv/bin/python bench/wakeups.py --pid $! --match multiprocessing.spawn --after-s 20

The training loops are the rows named ``MainThread`` of the workers: their involuntary switches
a second are how often something else took their core.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadCount:
    process: str  # the command, shortened
    comm: str  # the OS thread name
    voluntary: int
    involuntary: int
    cpu_s: float


def _field(status: str, name: str) -> int:
    match = re.search(rf"^{name}:\s+(\d+)", status, re.M)
    return int(match.group(1)) if match else 0


def read_threads(root: int, match: str = "") -> dict[tuple[int, int], ThreadCount]:
    """Every thread now of the processes under ``root`` whose command has ``match``."""
    found = {}
    top = psutil.Process(root)
    for proc in (top, *top.children(recursive=True)):
        with contextlib.suppress(psutil.Error, OSError):
            if match not in " ".join(proc.cmdline()):
                continue
            command = " ".join(proc.cmdline()[1:3])[:40]
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                task = Path(f"/proc/{proc.pid}/task/{tid}")
                status = (task / "status").read_text()
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                found[proc.pid, int(tid)] = ThreadCount(
                    command,
                    (task / "comm").read_text().strip(),
                    _field(status, "voluntary_ctxt_switches"),
                    _field(status, "nonvoluntary_ctxt_switches"),
                    (int(stat[11]) + int(stat[12])) * TICK_S,
                )
    return found


def python_names(pid: int) -> dict[int, str]:
    """Each Python thread's name and innermost frame, by its OS thread id (py-spy dump)."""
    if shutil.which("py-spy") is None:
        return {}
    try:
        dump = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid), "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names: dict[int, str] = {}
    current = None
    for line in dump.splitlines():
        if match := re.match(r'Thread (\S+) \(\w+\): "([^"]*)"', line):
            current = None
            with contextlib.suppress(ValueError):
                current = int(match.group(1), 0)
                names[current] = match.group(2)
        elif current is not None and line.strip():  # its innermost frame
            names[current] += f" in {line.strip()[:60]}"
            current = None
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, required=True, help="the root of the tree to read")
    parser.add_argument("--window", type=float, default=15.0, help="seconds between readings")
    parser.add_argument(
        "--match", default="", help="only the processes whose command line has this text"
    )
    parser.add_argument(
        "--after-s",
        type=float,
        default=0.0,
        help="once a process matches, wait this long first (the job's start-up)",
    )
    parser.add_argument("--min-per-s", type=float, default=0.5, help="leave out quieter threads")
    args = parser.parse_args()
    deadline = time.monotonic() + 600
    while not read_threads(args.pid, args.match):
        if time.monotonic() > deadline:
            parser.error(f"no process under {args.pid} matched {args.match!r} in 600 s")
        time.sleep(1)
    time.sleep(args.after_s)  # the job's start-up: a probe's pause, not a synchronisation
    before, t0 = read_threads(args.pid, args.match), time.monotonic()
    time.sleep(args.window)
    after, seconds = read_threads(args.pid, args.match), time.monotonic() - t0
    names: dict[tuple[int, int], str] = {}
    for pid in {pid for pid, _ in after}:
        names.update({(pid, tid): name for tid, name in python_names(pid).items()})
    rows = []
    for key, now in after.items():
        then = before.get(key)
        if then is None:
            continue
        vol = (now.voluntary - then.voluntary) / seconds
        invol = (now.involuntary - then.involuntary) / seconds
        cpu = (now.cpu_s - then.cpu_s) / seconds * 1000
        if vol + invol >= args.min_per_s:
            rows.append((vol + invol, key, now, vol, invol, cpu))
    print(f"{'pid':>7} {'tid':>7} {'woke/s':>7} {'preempted/s':>11} {'cpu ms/s':>8}  thread")
    for _, (pid, tid), now, vol, invol, cpu in sorted(rows, key=lambda r: -r[0]):
        name = names.get((pid, tid), now.comm)
        print(f"{pid:>7} {tid:>7} {vol:>7.1f} {invol:>11.1f} {cpu:>8.1f}  {now.process}: {name}")


if __name__ == "__main__":
    main()
