"""Goodput under seeded campaigns: this project next to the torchrun peer, with the same faults.

The peer runs at its defaults and tuned, in one run, with the same faults at the same moments,
over several seeds. With ``--scenario straggler``, they run under a node that is slow and not
dead instead.

**faults** (the default). Each seed draws a campaign (chaos/campaign.py): faults at random
moments ``--mtbf-s`` apart on average, each a SIGKILL or a SIGSTOP of a node other than rank 0's
(for the peer: other than node0, whose agent hosts the c10d store: it is started first, and the
others once its store answers); a killed node is started again after ``--restart-after-s``, a
frozen one thawed after ``--freeze-s``. Ours runs as ``python -m chaos`` on a 3-node job; the
peer is ``shared/bench/peer_torchrun/train.py`` under three torchrun agents (``--nnodes=1:3``,
c10d rendezvous, ``--max-restarts=100``), driven here with the same schedule, node picks and ends
of faults, for as many steps as ours trained, each padded to our step time (so the same faults
fall within both jobs). The peer runs twice per seed:

- **defaults**: torchrun as most users run it (torch's shared rendezvous store, a keep-alive every
  5 s and a node dead after 3 missed, a 30 s last call, gloo's 30-minute timeout);
- **tuned**: as a careful user tunes it for fast recovery (the shared peer's ``TUNED=1``):
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ``--rdzv-conf=last_call_timeout=1,
  keep_alive_interval=1,keep_alive_max_attempt=3`` and a 10 s gloo timeout (``PG_TIMEOUT_S``).

A frozen torchrun node holds its peers in their all-reduce until it is thawed or the gloo
timeout fires; a killed one restarts every worker from the last checkpoint (every 50 steps):
that is the peer's own behaviour.

**straggler**. One fault per seed: a node other than rank 0's (ours: the campaign's pick,
``target: not_rank0``, since rank 0 can be on any node; the peer's: node1, neither rank 0's nor
the store's) is slowed ``--slow-factor`` times from ``--slow-at-s`` seconds into training for
``--slow-s`` seconds, on a 3-node job about ``--minutes`` long. Ours runs it twice, as the
scripted campaign ``campaign.faults=[{kind:slow_node,...}]`` (chaos/cpu_limit.py: a CPU quota as
root where the kernel has one, else a stop/continue duty cycle; the run says which): with
``health.straggler=warn`` (the job keeps the slow node's pace) and ``evict`` (the node leaves,
quarantined for ``--quarantine-s``, then rejoins). The peer runs once, at its defaults, for as
many steps as ours trained under warn, each padded to our step time: torchrun has no straggler
handling, and the tuned settings only touch rendezvous and timeouts, which a slow node never
trips. Its step is mostly the padded sleep, which neither a CPU quota nor a duty cycle slows
much (a sleep's clock runs on while the process is stopped: half the CPU in 0.2 s cycles takes
a 0.27 s step to 0.30 s), so by default (``--peer-slow steps``) its node's workers are stopped
for ``factor - 1`` of their own median step after each step they log, which makes each of
their steps ``factor`` times as long; ``--peer-slow duty`` gives them
:class:`chaos.cpu_limit.DutyCycle` instead. The table gives each job's pace before, during and
after the slow window (samples/s between its steps, stalls included, and as a fraction of the
pace before: how much the slow node slowed the job), and for ours the seconds from the fault to
the ``straggler`` event, to the eviction and to the first round the node is back in.

Goodput has one definition for both (chaos/verdict.py): the samples trained and kept, over what
the job trains at its own fault-free pace in the same time (the median rate between consecutive
steps of one round, or for the peer of one worker incarnation, at each world size), each 10 s
of steps counting at least the samples they trained, so it cannot exceed 100 %. A job that dies
is charged from its last step to the end of our campaign's time, at the full world's pace. The
steps before the first fault give the definition's figure for a job nothing happens to
(checkpoints, jitter). The goodput of the nodes up charges each moment at the pace of the nodes
up, so an evicted straggler (up, not in the round) costs it the world it left.

    .venv/bin/python bench/goodput.py                        # seeds 1,2,3; about an hour on 2 cores
    .venv/bin/python bench/goodput.py --work-dir /tmp/gp     # keep every job's logs
    .venv/bin/python bench/goodput.py --seeds 1 --minutes 2  # a quick look
    .venv/bin/python bench/goodput.py --scenario straggler   # seed 1, 2 minutes; ~10-15 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peer_job import BATCH as PEER_BATCH  # noqa: E402
from peer_job import NODES as PEER_NODES  # noqa: E402
from torchrun_peer import DEFAULTS, PEERS, Peer, PeerSettings  # noqa: E402

from chaos.campaign import CampaignConfig, FaultKind, pick, schedule  # noqa: E402
from chaos.cpu_limit import CpuLimit, DutyCycle, Stopper  # noqa: E402
from chaos.verdict import Interval, goodput, steps_of  # noqa: E402
from elastic import event_types as ev  # noqa: E402
from elastic.events import read_events  # noqa: E402

NODES = 3
BATCH = 16  # our per-rank batch
DATASET = 640  # the default synthetic ImageFolder
MIN_NODES = 1  # both jobs train on down to one node; no fault may take the last one
SLOW_NODE = "node1"  # the peer's straggler: neither rank 0's nor the store's
FOLLOW_S = 0.005  # how often --peer-slow steps looks for the slow node's next step
SCENARIOS = {  # --scenario: its default --seeds and --minutes
    "faults": ("1,2,3", 5.0),
    "straggler": ("1", 2.0),
}


@dataclass(frozen=True)
class Outcome:
    """One runtime under one seed's campaign."""

    goodput: float
    fault_free: float | None  # the goodput of the steps before the first fault
    faults: int
    finished: bool


@dataclass(frozen=True)
class Slowed:
    """One runtime under the straggler scenario."""

    goodput: float
    of_nodes_up: float | None  # None: not measured
    how: str  # how the node was slowed
    pace: tuple[float | None, float | None, float | None]  # samples/s before, during, after
    named_s: float | None  # fault -> straggler event
    evicted_s: float | None  # fault -> quarantined
    back_s: float | None  # fault -> the first round the evicted node is in again
    finished: bool


def campaign(args: argparse.Namespace, seed: int) -> CampaignConfig:
    return CampaignConfig(
        name="goodput",
        seed=seed,
        mtbf_s=args.mtbf_s,
        kinds=[FaultKind.kill_node, FaultKind.freeze_node],
        target="not_rank0",
        freeze_s=args.freeze_s,
        restart_after_s=args.restart_after_s,
    )


def run_chaos(run_dir: Path, overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``python -m chaos`` with ``overrides`` in ``run_dir``: its report and events.

    A broken invariant is said."""
    done = subprocess.run(
        [sys.executable, "-m", "chaos", f"run_dir={run_dir}", *overrides],
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
    )
    print(done.stdout[-2500:], flush=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"python -m chaos failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    if not report["ok"]:
        print(f"  ours: an invariant broke: {report['violations']}", flush=True)
    return report, read_events(run_dir)


def our_job(args: argparse.Namespace) -> list[str]:
    """Our job's overrides: 3 nodes, about ``--minutes`` of steps."""
    steps = args.minutes * 60 / args.step_guess_s
    return [
        f"cluster.nodes={NODES}",
        f"data.batch_size={BATCH}",
        f"trainer.epochs={steps * NODES * BATCH / DATASET:.2f}",
    ]


def step_time(events: list[dict[str, Any]]) -> tuple[float, int]:
    """Our median step time and our last step."""
    steps = steps_of(events)
    gaps = [b["ts"] - a["ts"] for a, b in zip(steps, steps[1:], strict=False)]
    return statistics.median(gaps), steps[-1]["step"]


def run_ours(work: Path, args: argparse.Namespace, seed: int) -> tuple[Outcome, float, int, float]:
    """Run ``python -m chaos`` on a 3-node job about ``--minutes`` long.

    It returns the outcome, our median step time (the peer's step is padded to it), our last step
    (the peer trains as many) and the seconds from our first step to our last."""
    report, events = run_chaos(
        work / f"ours-seed{seed}",
        [
            f"job_id=goodput-{os.getpid()}-{seed}",
            "campaign=random",
            f"campaign.seed={seed}",
            f"campaign.mtbf_s={args.mtbf_s}",
            "campaign.kinds=[kill_node,freeze_node]",
            "campaign.target=not_rank0",
            f"campaign.freeze_s={args.freeze_s}",
            f"campaign.restart_after_s={args.restart_after_s}",
            *our_job(args),
        ],
    )
    finished = any(ev.TRAINING_DONE.matches(e) for e in events)
    outcome = Outcome(
        report["goodput"], report["fault_free_goodput"], len(report["faults"]), finished
    )
    return outcome, *step_time(events), report["seconds"]


def peer_goodput(
    steps: list[tuple[float, int, int]],
    rates: dict[int, float],
    until: float,
    nodes_up: int | None = None,
) -> tuple[float, int]:
    """The same goodput as ours (:func:`chaos.verdict.goodput`), for the peer.

    It is the kept samples (the last attempt of each step up to the last one) over the job's own
    pace at each step's world size and time. With ``nodes_up``, it is at the pace of that many
    nodes up throughout (verdict's goodput of the nodes up). A job that died before its last step
    is charged from its last step ``until`` the campaign's end at the full world's pace: the time
    it was meant to train, and did not."""
    last_attempt: dict[int, int] = {}
    distinct: list[tuple[float, int, int]] = []
    for t, step, world in steps:
        last_attempt[step] = world
        if not distinct or distinct[-1][1] != step:
            distinct.append((t, step, world))
    final = distinct[-1][1]
    kept = sum(PEER_BATCH * last_attempt[s] for s in range(distinct[0][1] + 1, final + 1))
    spans = [
        Interval(a[0], b[0], b[2], PEER_BATCH * b[2] * max(0, b[1] - a[1]))
        for a, b in zip(distinct, distinct[1:], strict=False)
    ]
    if until > distinct[-1][0]:
        spans.append(Interval(distinct[-1][0], until, NODES, 0))
    if not rates:  # no two steps in a row at any world size
        return 0.0, kept
    rates = dict(rates)
    for w in set(range(1, NODES + 1)) - set(rates):  # never trained twice in a row: scaled
        near = min(rates, key=lambda m: abs(m - w))
        rates[w] = rates[near] * w / near
    up = [(spans[0].start, spans[-1].end, nodes_up)] if nodes_up and spans else None
    return goodput(kept, spans, rates, min_nodes=MIN_NODES, up=up)[1], kept


def peer_job(
    work: Path, args: argparse.Namespace, settings: PeerSettings, step_s: float, steps: int
) -> Peer:
    """The peer job (not started yet) for ``steps`` steps, each padded to our step time."""
    return Peer(
        work,
        args.peer / "train.py",
        settings,
        steps=steps,
        step_sleep=max(0.0, step_s - 0.01),  # ~10 ms of MLP compute, padded to our step
        ckpt_every=50,
        nnodes=f"1:{NODES}",
        max_restarts=100,
    )


def died(p: Peer, steps: int) -> bool:
    """Whether the peer's job ended short of ``steps`` (said so, with where its logs are)."""
    logged = p.steps()
    if logged[-1][1] >= steps:
        return False
    print(
        f"  peer: the job died at step {logged[-1][1]} of {steps}, "
        f"{logged[-1][0] - logged[0][0]:.0f} s in (logs: {p.work})",
        flush=True,
    )
    return True


def run_peer(
    work: Path,
    args: argparse.Namespace,
    seed: int,
    settings: PeerSettings,
    step_s: float,
    steps: int,
    seconds: float,
) -> Outcome:
    """Run the peer under the same schedule, node picks and ends of faults as ours.

    It runs for as many steps as ours trained, each padded to our step time: the same length of
    job, so the same faults fall in it. A peer that dies is charged to the end of our campaign
    (``seconds`` after its first step) or to its own last step, whichever is later."""
    name = settings.name.split(", ")[1]
    peer = peer_job(work / f"peer-{name}-seed{seed}", args, settings, step_s, steps)
    peer.start_all()
    faults, down, frozen, number, struck = schedule(campaign(args, seed)), {}, {}, 0, 0
    started = None
    deadline = time.monotonic() + args.minutes * 60 * 4 + 300
    try:
        while peer.running() and time.monotonic() < deadline:
            now = time.time()
            if started is None and peer.steps():
                started = peer.steps()[0][0]
            for node, at in list(frozen.items()):
                if now >= at:
                    peer.signal(node, signal.SIGCONT)
                    del frozen[node]
            for node, at in list(down.items()):
                if now >= at:
                    peer.start(node)
                    del down[node]
            while started is not None and faults and now - started >= faults[0].at_s:
                spec = faults.pop(0)
                number += 1
                up = [n for n in PEER_NODES if n not in down and n not in frozen]
                node = pick(spec.target, up, "node0", seed, number)
                if node is None or len(up) - 1 < MIN_NODES:
                    print(f"  peer: fault {number} skipped (too few nodes up)", flush=True)
                    continue
                print(f"  peer: fault {number}: {spec.kind} {node}", flush=True)
                struck += 1
                if spec.kind is FaultKind.freeze_node:
                    peer.signal(node, signal.SIGSTOP)
                    frozen[node] = now + spec.duration_s
                else:
                    peer.signal(node, signal.SIGKILL)
                    down[node] = now + spec.restart_after_s
            time.sleep(0.1)
    finally:
        peer.stop()
    logged = peer.steps()
    finished = not died(peer, steps)
    until = logged[-1][0] if finished else logged[0][0] + seconds
    ratio, _ = peer_goodput(logged, peer.pace(), until)
    first_fault = started + schedule(campaign(args, seed))[0].at_s if started else float("inf")
    before = [s for s in logged if s[0] < first_fault]
    fault_free = peer_goodput(before, peer.pace(), before[-1][0])[0] if len(before) > 30 else None
    return Outcome(ratio, fault_free, struck, finished)


class StepStop(Stopper):
    """``--peer-slow steps``: a peer node's workers, stopped for ``stop_s`` after each step it logs.

    ``stop_s`` is ``factor - 1`` of its step, so that each of its steps takes ``factor`` times as
    long, sleep and all."""

    def __init__(self, log: Path, workers: list[psutil.Process], stop_s: float) -> None:
        super().__init__(workers)
        # Its size now (here: a missing log fails the bench, not just the thread): the lines
        # after it are the steps to follow.
        self.log, self.stop_s, self._offset = log, stop_s, log.stat().st_size
        self.how = f"stopped {stop_s:.2f} s after each of its steps"
        self.start()

    def _run(self) -> None:
        with open(self.log) as f:
            f.seek(self._offset)
            tail = ""
            while not self._done.wait(FOLLOW_S):
                *lines, tail = (tail + f.read()).split("\n")
                if any(line.startswith("step ") for line in lines):
                    self._each("suspend")
                    self._done.wait(self.stop_s)
                    self._each("resume")


def paces(
    points: list[tuple[float, int]], start: float | None, end: float | None
) -> tuple[float | None, float | None, float | None]:
    """Samples/s before, during and after the slow window ``[start, end)``.

    Each is the samples between the first and the last step in it over the time between them,
    stalls included; None for fewer than two steps (or no window)."""
    if start is None or end is None:
        return None, None, None

    def rate(lo: float, hi: float) -> float | None:
        inside = [p for p in points if lo <= p[0] < hi]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    return rate(float("-inf"), start), rate(start, end), rate(end, float("inf"))


def run_ours_slow(
    work: Path, args: argparse.Namespace, seed: int, policy: str
) -> tuple[Slowed, float, int, float]:
    """Run ``python -m chaos`` with one ``slow_node`` under ``health.straggler=policy``.

    The node slowed is one other than rank 0's. It returns the outcome, our median step time, our
    last step and the seconds from our first step to our last."""
    fault = f"{{kind:slow_node,at_s:{args.slow_at_s},target:not_rank0,duration_s:{args.slow_s}}}"
    report, events = run_chaos(
        work / f"ours-{policy}-seed{seed}",
        [
            f"job_id=straggler-{os.getpid()}-{policy}-{seed}",
            "campaign=scripted",
            "campaign.name=straggler",
            f"campaign.seed={seed}",
            "campaign.etcd_members=1",
            f"campaign.faults=[{fault}]",
            f"campaign.slow_factor={args.slow_factor}",
            f"health.straggler={policy}",
            f"health.quarantine_s={args.quarantine_s}",
            *our_job(args),
        ],
    )
    for skipped in report["skipped"]:
        print(f"  ours: the fault was skipped: {skipped['reason']}", flush=True)
    injected = next((e for e in ev.FAULT_INJECTED.of(events) if e.get("kind") == "slow_node"), None)
    start = injected["ts"] if injected else None
    end = next((e["ts"] for e in ev.FAULT_CLEARED.of(events) if e.get("kind") == "slow_node"), None)
    found = next((f["breakdown"] for f in report["faults"] if f["kind"] == "slow_node"), {})
    back = None
    if start is not None and "evicted" in found:
        back = next(
            (
                r["ts"] - start
                for r in ev.ROUND_FORMED.of(events)
                if r["ts"] > start + found["evicted"] and injected["target"] in r["members"]
            ),
            None,
        )
    outcome = Slowed(
        goodput=report["goodput"],
        of_nodes_up=report["goodput_of_nodes_up"],
        how=f"{injected['target']}: {injected['how']}" if injected else "-",
        pace=paces([(e["ts"], e["samples"]) for e in steps_of(events)], start, end),
        named_s=found.get("straggler"),
        evicted_s=found.get("evicted"),
        back_s=back,
        finished=any(ev.TRAINING_DONE.matches(e) for e in events),
    )
    return outcome, *step_time(events), report["seconds"]


def slow_peer(peer: Peer, args: argparse.Namespace) -> CpuLimit:
    """Slow the peer's node1 (its workers, not its agent) by ``--slow-factor``.

    ``--peer-slow`` says how; ``steps`` stops them for ``factor - 1`` of their median step so
    far."""
    workers = psutil.Process(peer.procs[SLOW_NODE].pid).children(recursive=True)
    if args.peer_slow == "duty":
        return DutyCycle(workers, args.slow_factor)
    times = [float(p[2]) for p in peer.lines(SLOW_NODE) if p[0] == "step"]
    step_s = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    return StepStop(peer.logs / f"{SLOW_NODE}.log", workers, (args.slow_factor - 1) * step_s)


def run_peer_slow(
    work: Path, args: argparse.Namespace, seed: int, step_s: float, steps: int, seconds: float
) -> Slowed:
    """Run the peer at its defaults for ``steps`` steps padded to ``step_s`` (ours under warn).

    Its node1 is slowed from ``--slow-at-s`` after its first step for ``--slow-s``. A peer that dies
    is charged as in :func:`run_peer`."""
    peer = peer_job(work / f"peer-defaults-seed{seed}", args, DEFAULTS, step_s, steps)
    peer.start_all()
    started = start = end = None
    limit = None
    deadline = time.monotonic() + args.minutes * 60 * 4 + 300
    try:
        while peer.running() and time.monotonic() < deadline:
            now = time.time()
            if started is None:
                if logged := peer.steps():
                    started = logged[0][0]
            elif limit is None and now - started >= args.slow_at_s:
                limit, start = slow_peer(peer, args), now
            elif end is None and limit is not None and now - start >= args.slow_s:
                limit.end()
                end = time.time()
            time.sleep(0.1)
    finally:
        if limit is not None and end is None:
            limit.end()
            end = time.time()
        peer.stop()
    logged = peer.steps()
    finished = not died(peer, steps)
    until = logged[-1][0] if finished else logged[0][0] + seconds
    rates = peer.pace()
    # The first rank's line of each step, and the samples trained until then.
    first = [s for i, s in enumerate(logged) if i == 0 or s[1] != logged[i - 1][1]]
    points = [(first[0][0], 0)]
    for a, b in zip(first, first[1:], strict=False):
        points.append((b[0], points[-1][1] + PEER_BATCH * b[2] * max(0, b[1] - a[1])))
    return Slowed(
        goodput=peer_goodput(logged, rates, until)[0],
        of_nodes_up=peer_goodput(logged, rates, until, nodes_up=NODES)[0],
        how=f"{SLOW_NODE}: {limit.how}" if limit else "-",
        pace=paces(points, start, end),
        named_s=None,
        evicted_s=None,
        back_s=None,
        finished=finished,
    )


def spread(values: list[float]) -> str:
    """``mean (min-max)`` in %."""
    low, high = 100 * min(values), 100 * max(values)
    return f"{100 * statistics.mean(values):.1f} % ({low:.1f}-{high:.1f})"


def faults(work: Path, args: argparse.Namespace, seeds: list[int]) -> None:
    """Run the faults scenario and print the table.

    Ours and the peer at its defaults and tuned run under each seed's campaign."""
    rows: dict[str, list[Outcome]] = {"elastic": [], **{p.name: [] for p in PEERS}}
    step_times = []
    for seed in seeds:
        print(f"seed {seed}: ours", flush=True)
        ours, step_s, steps, seconds = run_ours(work, args, seed)
        rows["elastic"].append(ours)
        step_times.append(step_s)
        if args.timeline is not None and seed == seeds[0]:
            shutil.copy(work / f"ours-seed{seed}" / "chaos" / "timeline.png", args.timeline)
        for settings in PEERS:
            print(f"seed {seed}: {settings.name}", flush=True)
            out = run_peer(work, args, seed, settings, step_s, steps, seconds)
            rows[settings.name].append(out)
        line = ", ".join(f"{name} {100 * r[-1].goodput:.1f} %" for name, r in rows.items())
        print(f"seed {seed}: {line}", flush=True)

    print(
        f"\n3 nodes x 1 CPU worker, seeds {args.seeds}, a fault every {args.mtbf_s:.0f} s on "
        f"average (SIGKILL or SIGSTOP of a node other than rank 0's / the store's; back after "
        f"{args.restart_after_s:.0f} s / thawed after {args.freeze_s:.0f} s); our step "
        f"{statistics.median(step_times):.3f} s, the peer's padded to it"
    )
    print(
        f"{'runtime':20}{'goodput, mean (range)':>26}{'before 1st fault':>20}{'faults':>10}"
        f"{'finished':>10}   per seed"
    )
    for name, outcomes in rows.items():
        free = [o.fault_free for o in outcomes if o.fault_free is not None]
        print(
            f"{name:20}{spread([o.goodput for o in outcomes]):>26}"
            f"{spread(free) if free else '-':>20}"
            f"{sum(o.faults for o in outcomes):>10}"
            f"{sum(o.finished for o in outcomes):>7}/{len(outcomes)}   "
            + " ".join(f"{100 * o.goodput:.1f}" for o in outcomes)
        )
    ours_mean = statistics.mean(o.goodput for o in rows["elastic"])
    for settings in PEERS:
        peer = [p.goodput for p in rows[settings.name]]
        ratios = [o.goodput / p for o, p in zip(rows["elastic"], peer, strict=True) if p > 0]
        if ratios:
            # The ratio of the means: a mean of per-seed ratios is ruled by the seed where the
            # peer died soonest.
            print(
                f"ours / {settings.name}: {ours_mean / statistics.mean(peer):.2f}x on the mean "
                f"({min(ratios):.2f}-{max(ratios):.2f}x seed by seed)"
            )


def straggler(work: Path, args: argparse.Namespace, seeds: list[int]) -> None:
    """Run the straggler scenario and print the table.

    Ours runs under warn and evict and the peer at its defaults, each with a node slowed for the
    same window."""
    warn, evict = "elastic, warn", "elastic, evict"
    rows: dict[str, list[Slowed]] = {warn: [], evict: [], DEFAULTS.name: []}
    step_times = []
    for seed in seeds:
        print(f"seed {seed}: ours, health.straggler=warn", flush=True)
        ours, step_s, steps, seconds = run_ours_slow(work, args, seed, "warn")
        rows[warn].append(ours)
        step_times.append(step_s)
        print(f"seed {seed}: ours, health.straggler=evict", flush=True)
        rows[evict].append(run_ours_slow(work, args, seed, "evict")[0])
        if args.timeline is not None and seed == seeds[0]:
            shutil.copy(work / f"ours-evict-seed{seed}" / "chaos" / "timeline.png", args.timeline)
        print(f"seed {seed}: {DEFAULTS.name}", flush=True)
        rows[DEFAULTS.name].append(run_peer_slow(work, args, seed, step_s, steps, seconds))

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} s"

    def rate(x: float | None, before: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:.1f}/s" + (f" ({x / before:.2f})" if before else "")

    print(
        f"\n3 nodes x 1 CPU worker, seeds {args.seeds}: a node other than rank 0's slowed "
        f"{args.slow_factor:g}x from {args.slow_at_s:g} s into training for {args.slow_s:g} s; "
        f"evicted nodes quarantined {args.quarantine_s:g} s; our step "
        f"{statistics.median(step_times):.3f} s, the peer's padded to it. The peer runs at its "
        "defaults only: torchrun has no straggler handling, and tuning changes only its "
        "rendezvous and timeouts, which a slow node never trips."
    )
    print(
        f"{'runtime':20}{'seed':>5}{'goodput':>9}{'nodes up':>10}{'pace before':>13}"
        f"{'during (x before)':>20}{'after (x before)':>19}{'named':>8}{'evicted':>9}"
        f"{'back':>8}{'finished':>10}"
    )
    for name, outcomes in rows.items():
        for seed, o in zip(seeds, outcomes, strict=True):
            before, during, after = o.pace
            print(
                f"{name:20}{seed:>5}{pct(o.goodput):>9}{pct(o.of_nodes_up):>10}"
                f"{rate(before, None):>13}{rate(during, before):>20}{rate(after, before):>19}"
                f"{secs(o.named_s):>8}{secs(o.evicted_s):>9}{secs(o.back_s):>8}"
                f"{'yes' if o.finished else 'NO':>10}"
            )
    print(
        "named / evicted / back: seconds from the fault to the straggler event, to the "
        "eviction and to the first round with the node again"
    )
    for name, outcomes in rows.items():
        print(f"{name} slowed by: {'; '.join(sorted({o.how for o in outcomes}))}")
    peer = rows[DEFAULTS.name]
    for name in (evict, warn):
        ours = rows[name]
        for figure, label in (("goodput", "goodput"), ("of_nodes_up", "goodput of the nodes up")):
            mine = [getattr(o, figure) for o in ours if getattr(o, figure) is not None]
            theirs = [getattr(p, figure) for p in peer if getattr(p, figure) is not None]
            if mine and theirs and statistics.mean(theirs) > 0:
                print(
                    f"ours ({name.split(', ')[1]}) / {DEFAULTS.name}, {label}: "
                    f"{statistics.mean(mine) / statistics.mean(theirs):.2f}x on the mean"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario",
        choices=list(SCENARIOS),
        default="faults",
        help="faults: seeded kills and freezes; straggler: one node slowed for a while",
    )
    parser.add_argument(
        "--seeds",
        help="comma-separated campaign seeds (faults: at least 3 for a range; default 1,2,3; "
        "straggler: default 1)",
    )
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="mean time between faults")
    parser.add_argument(
        "--minutes", type=float, help="fault-free job length (faults: 5; straggler: 2)"
    )
    parser.add_argument("--freeze-s", type=float, default=10.0)
    parser.add_argument("--restart-after-s", type=float, default=10.0)
    parser.add_argument("--slow-factor", type=float, default=2.0, help="straggler: the slow-down")
    parser.add_argument(
        "--slow-at-s", type=float, default=20.0, help="straggler: seconds into training"
    )
    parser.add_argument("--slow-s", type=float, default=60.0, help="straggler: how long")
    parser.add_argument(
        "--quarantine-s", type=float, default=30.0, help="straggler: an evicted node's quarantine"
    )
    parser.add_argument(
        "--peer-slow",
        choices=["steps", "duty"],
        default="steps",
        help="straggler: how the peer's node is slowed (steps: stopped after each step for "
        "factor - 1 of a step; duty: chaos.cpu_limit.DutyCycle, which barely slows a sleep)",
    )
    parser.add_argument(
        "--step-guess-s", type=float, default=0.27, help="our step time, to size the job"
    )
    parser.add_argument(
        "--peer", type=Path, default=REPO.parent / "shared" / "bench" / "peer_torchrun"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep every job's run directory and logs here (default: a temporary directory)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        help="copy our first seed's timeline.png here (straggler: under evict; docs/...)",
    )
    args = parser.parse_args()
    default_seeds, default_minutes = SCENARIOS[args.scenario]
    args.seeds = default_seeds if args.seeds is None else args.seeds
    args.minutes = default_minutes if args.minutes is None else args.minutes
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. 1,2,3")
    if args.slow_factor <= 1:
        parser.error(f"--slow-factor {args.slow_factor}: a slow node runs slower; give >1")
    if not (args.peer / "train.py").exists():
        parser.error(f"--peer: {args.peer}/train.py not found")
    if shutil.which("torchrun") is None:
        parser.error("torchrun is not on PATH: run with PATH=$PWD/.venv/bin:$PATH")
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir: {args.work_dir} is not empty; name a new or empty directory")
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-goodput-")))
        else:
            work = args.work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        (straggler if args.scenario == "straggler" else faults)(work, args, seeds)


if __name__ == "__main__":
    main()
