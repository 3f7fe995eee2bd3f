"""Hunt flakes: run the fault-tolerance tests again and again, idle and under load.

Every failure is kept with what it needs to be explained.

A test that passed 11 times and then failed once has a cause nobody has found yet. This runs
each chosen test ``--runs`` times in a fresh pytest process, under each ``--load``:

- ``idle``: nothing else on the machine;
- ``cpu``: one busy loop per core beside the test;
- ``io``: a writer that fills and fsyncs 64 MB blocks in the run's folder (the checkpoints' disk);
- ``net``: the test in a network namespace of its own whose loopback delays every packet by
  ``--delay-ms`` ± ``--jitter-ms`` (root, ``unshare`` and ``tc``); on a kernel without netem,
  whose loopback is throttled to ``--rate-mbit`` instead (tbf: bursts queue, so large
  collectives are delayed); skipped and said where neither can be had.

Loads combine (``--load cpu+io+net``). A run that passes leaves nothing; a failed one keeps, in
``<out>/<test>/<load>/run-<i>/``: pytest's output (the assertion, the test's stack, the job's
output that the e2e waits attach), the test's temporary folder (each job's run directory: events,
agents' and workers' logs, with a crashed worker's stack) and ``timeline.txt``, every event of
every job in it merged in time order: the faults, the agents' decisions, the rounds. It prints a
table of failure rates, test by load, and writes it to ``<out>/flakes.json``.

    .venv/bin/python bench/flakes.py --runs 10 --load idle --load cpu+io  # the three below
    .venv/bin/python bench/flakes.py --runs 10 tests/test_e2e.py          # every e2e test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic.events import read_events  # noqa: E402

# The three unexplained failures issue 47 names.
NAMED = (
    "tests/test_e2e.py::test_a_frozen_node_and_a_frozen_agent_are_evicted_and_rejoin_when_thawed",
    "tests/test_torchrun_handler.py::"
    "test_torchrun_agents_ride_out_an_etcd_restart_then_lose_a_node_and_finish",
    "tests/test_e2e.py::"
    "test_a_degraded_node_is_found_repaired_or_evicted_and_nothing_is_redone_by_it",
)
LOADS = ("idle", "cpu", "io", "net")
IO_BLOCK = 64 * 2**20
RUN_TIMEOUT_S = 900  # one pytest run, whatever it waits for: its own waits are bounded tighter


@dataclass
class Tally:
    """One test under one load."""

    test: str
    load: str
    runs: int = 0
    failed: list[int] = field(default_factory=list)  # the failed runs' numbers
    seconds: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.failed) / self.runs if self.runs else 0.0


def _spin() -> None:
    while True:
        pass


def _write(folder: str) -> None:
    path, block = Path(folder, "io-load.bin"), os.urandom(IO_BLOCK)
    while True:
        with open(path, "wb") as f:
            for _ in range(4):
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
        path.unlink()


def loopback_qdisc(args: argparse.Namespace) -> tuple[str | None, str]:
    """The qdisc that slows a new namespace's loopback here, or None, and why.

    It is netem's delay, else tbf's rate."""
    if os.geteuid() != 0:
        return None, "not root"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return None, f"no {tool}"
    netem = f"root netem delay {args.delay_ms}ms {args.jitter_ms}ms distribution normal"
    # Its bucket holds more than one of loopback's 64 KiB packets: tbf drops a larger packet
    # outright, and every TCP stream stalls on it (a 64 KiB bucket hung gloo for 120 s).
    tbf = f"root tbf rate {args.rate_mbit}mbit burst 1mb latency 100ms"
    for qdisc in (netem, tbf):
        probe = subprocess.run(
            [
                "unshare",
                "--net",
                "sh",
                "-c",
                f"ip link set lo up && tc qdisc add dev lo {qdisc}",
            ],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return qdisc, ""
    return None, f"neither netem nor tbf on a new namespace's loopback: {probe.stderr.strip()}"


@contextlib.contextmanager
def load(kinds: set[str], folder: Path) -> Iterator[None]:
    """The background load of ``kinds`` (``cpu``, ``io``) while the block runs."""
    ctx = mp.get_context("spawn")
    procs = []
    if "cpu" in kinds:
        procs += [ctx.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    if "io" in kinds:
        procs.append(ctx.Process(target=_write, args=(str(folder),), daemon=True))
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            Path(folder, "io-load.bin").unlink()


def command(test: str, basetemp: Path, qdisc: str | None) -> list[str]:
    """One pytest run of ``test``; with ``qdisc``, in a namespace whose loopback it slows."""
    pytest = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test]
    pytest += [f"--basetemp={basetemp}", "-o", "faulthandler_timeout=600"]
    if qdisc is None:
        return pytest
    script = f'ip link set lo up && tc qdisc add dev lo {qdisc} && exec "$@"'
    return ["unshare", "--net", "sh", "-c", script, "sh", *pytest]


def timeline(folder: Path) -> str:
    """Every event of every job under ``folder``, in time order, one a line.

    The events are each run directory's ``events/``, read as :func:`elastic.events.read_events`
    reads one. Each line holds seconds from the first, the job, the node, the kind, the rest."""
    events = [
        e | {"_job": run_dir.name}
        for run_dir in sorted({p.parent for p in folder.rglob("events") if p.is_dir()})
        for e in read_events(run_dir)
    ]
    events.sort(key=lambda e: e["ts"])
    if not events:
        return "(no events)\n"
    t0 = events[0]["ts"]
    lines = []
    for e in events:
        rest = {
            k: v for k, v in e.items() if k not in ("ts", "node", "event", "_job", "msg", "level")
        }
        what = e.get("msg") or json.dumps(rest, default=str)[:300]
        lines.append(
            f"{e['ts'] - t0:9.2f} {e['_job']:<10} {e.get('node', '?'):<7} "
            f"{e.get('event', '?'):<22} {what}"
        )
    return "\n".join(lines) + "\n"


def slug(test: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", test.split("::")[-1])[:80]


def run_once(test: str, run: Path, qdisc: str | None) -> tuple[bool, float, str]:
    """Run pytest on ``test`` once in ``run``: whether it passed, its seconds, its last line.

    A failure keeps ``run`` (pytest's output, the test's folder, the jobs' timeline)."""
    run.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    # A session of its own: whatever the test started goes with it on a timeout or a ^C.
    proc = subprocess.Popen(
        command(test, run / "tmp", qdisc),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code, output = -1, f"{output}\nflakes: timed out after {RUN_TIMEOUT_S} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    took = time.monotonic() - began
    last = (output.strip().splitlines() or ["(no output)"])[-1]
    if code == 0:
        shutil.rmtree(run, ignore_errors=True)
        return True, took, last
    (run / "pytest.out").write_text(output)
    (run / "timeline.txt").write_text(timeline(run / "tmp"))
    return False, took, last


def hunt(
    tests: list[str], loads: list[str], args: argparse.Namespace, qdisc: str | None
) -> list[Tally]:
    """Run every test ``args.runs`` times under every load, and keep what each failure left.

    ``qdisc`` slows the loopback of the loads with ``net``. The tests are taken in turn, so that a
    hunt cut short has tried each about as often."""
    tallies = []
    for spec in loads:
        kinds = set(spec.split("+")) - {"idle"}
        these = [Tally(test, spec) for test in tests]
        tallies += these
        with load(kinds, args.out):
            for i in range(1, args.runs + 1):
                for t in these:
                    run = args.out / slug(t.test) / spec / f"run-{i}"
                    passed, took, last = run_once(t.test, run, qdisc if "net" in kinds else None)
                    t.runs += 1
                    t.seconds.append(took)
                    if not passed:
                        t.failed.append(i)
                    save(tallies, args.out)  # so far: a hunt cut short keeps its counts
                    print(
                        f"flakes: {slug(t.test)} [{spec}] run {i}/{args.runs}: "
                        f"{'passed' if passed else 'FAILED'} in {took:.0f} s ({last[:100]})",
                        flush=True,
                    )
    return tallies


def save(tallies: list[Tally], out: Path) -> None:
    (out / "flakes.json").write_text(
        json.dumps(
            [{"test": t.test, "load": t.load, "runs": t.runs, "failed": t.failed} for t in tallies],
            indent=1,
        )
    )


def table(tallies: list[Tally]) -> str:
    lines = [f"{'test':<82}{'load':<14}{'runs':>6}{'failed':>8}{'rate':>8}{'mean s':>8}"]
    for t in tallies:
        mean = sum(t.seconds) / len(t.seconds) if t.seconds else 0.0
        lines.append(
            f"{slug(t.test):<82}{t.load:<14}{t.runs:>6}{len(t.failed):>8}{t.rate:>8.0%}{mean:>8.0f}"
        )
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="*", help="pytest node ids or files (default: the three named)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument(
        "--load",
        action="append",
        default=None,
        help=f"a load, or several joined by +, from {', '.join(LOADS)} (repeatable; default idle)",
    )
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--jitter-ms", type=float, default=1.0)
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="where netem is missing")
    p.add_argument("--out", type=Path, default=Path("flakes"))
    args = p.parse_args(argv)
    args.load = args.load or ["idle"]
    for spec in args.load:
        unknown = set(spec.split("+")) - set(LOADS)
        if unknown:
            p.error(f"--load {spec}: unknown {sorted(unknown)}; use {', '.join(LOADS)}")
    return args


def collect(specs: list[str]) -> list[str]:
    """Each test that ``specs`` (files, node ids, folders) names, as a node id of its own.

    That way each is tallied alone."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *specs],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"flakes: no test collected from {specs}:\n{done.stdout}{done.stderr}")
    return ids


def main(argv: list[str]) -> int:
    args = parse(argv)
    # A SIGTERM ends the run in flight and what it started, as a ^C does.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tests = collect(args.tests) if args.tests else list(NAMED)
    loads, qdisc = list(args.load), None
    if any("net" in spec.split("+") for spec in loads):
        qdisc, why = loopback_qdisc(args)
        if qdisc is None:
            print(f"flakes: no slowed loopback here ({why}); the loads with net are left out")
            loads = [spec for spec in loads if "net" not in spec.split("+")]
        else:
            print(f"flakes: net: the loopback of a namespace of its own, with {qdisc}")
    args.out.mkdir(parents=True, exist_ok=True)
    tallies = hunt(tests, loads, args, qdisc)
    print(table(tallies))
    (args.out / "flakes.json").write_text(
        json.dumps(
            [{"test": t.test, "load": t.load, "runs": t.runs, "failed": t.failed} for t in tallies],
            indent=1,
        )
    )
    failures = sum(len(t.failed) for t in tallies)
    if failures:
        print(f"flakes: {failures} failure(s), each kept under {args.out}/<test>/<load>/run-<i>/")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
