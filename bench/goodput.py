"""Goodput under seeded campaigns: this project next to the torchrun peer at its defaults and
tuned, in one run, with the same faults at the same moments, over several seeds.

Each seed draws a campaign (chaos/campaign.py): faults at random moments ``--mtbf-s`` apart on
average, each a SIGKILL or a SIGSTOP of a node other than rank 0's (for the peer: other than
node0, whose agent hosts the c10d store: it is started first, and the others once its store
answers); a killed node is started again after ``--restart-after-s``, a frozen one thawed after
``--freeze-s``. Ours runs as ``python -m chaos`` on a 3-node job; the peer is
``shared/bench/peer_torchrun/train.py`` under three torchrun agents (``--nnodes=1:3``, c10d
rendezvous, ``--max-restarts=100``), driven here with the same schedule, node picks and ends of
faults, for as many steps as ours trained, each padded to our step time (so the same faults fall
within both jobs). The peer runs twice per seed:

- **defaults**: torchrun as most users run it (torch's shared rendezvous store, a keep-alive every
  5 s and a node dead after 3 missed, a 30 s last call, gloo's 30-minute timeout);
- **tuned**: as a careful user tunes it for fast recovery (the shared peer's ``TUNED=1``):
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ``--rdzv-conf=last_call_timeout=1,
  keep_alive_interval=1,keep_alive_max_attempt=3`` and a 10 s gloo timeout (``PG_TIMEOUT_S``).

A frozen torchrun node holds its peers in their all-reduce until it is thawed or the gloo
timeout fires; a killed one restarts every worker from the last checkpoint (every 50 steps):
that is the peer's own behaviour.

Goodput has one definition for both (chaos/verdict.py): the samples trained and kept, over what
the job trains at its own fault-free pace in the same time (the median rate between consecutive
steps of one round, or for the peer of one worker incarnation, at each world size), each 10 s
of steps counting at least the samples they trained, so it cannot exceed 100 %. A job that dies
is charged from its last step to the end of our campaign's time, at the full world's pace. The
steps before the first fault give the definition's figure for a job nothing happens to
(checkpoints, jitter).

    .venv/bin/python bench/goodput.py                        # seeds 1,2,3; about an hour on 2 cores
    .venv/bin/python bench/goodput.py --work-dir /tmp/gp     # keep every job's logs
    .venv/bin/python bench/goodput.py --seeds 1 --minutes 2  # a quick look
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchrun_peer import BATCH as PEER_BATCH  # noqa: E402
from torchrun_peer import NODES as PEER_NODES  # noqa: E402
from torchrun_peer import PEERS, Peer, PeerSettings  # noqa: E402

from chaos.campaign import CampaignConfig, FaultKind, pick, schedule  # noqa: E402
from chaos.verdict import Interval, goodput, steps_of  # noqa: E402
from elastic import event_types as ev  # noqa: E402
from elastic.events import read_events  # noqa: E402

NODES = 3
BATCH = 16  # our per-rank batch
DATASET = 640  # the default synthetic ImageFolder
MIN_NODES = 1  # both jobs train on down to one node; no fault may take the last one


@dataclass(frozen=True)
class Outcome:
    """One runtime under one seed's campaign."""

    goodput: float
    fault_free: float | None  # the goodput of the steps before the first fault
    faults: int
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


def run_ours(work: Path, args: argparse.Namespace, seed: int) -> tuple[Outcome, float, int, float]:
    """``python -m chaos`` on a 3-node job about ``--minutes`` long: the outcome, our median
    step time (the peer's step is padded to it), our last step (the peer trains as many) and
    the seconds from our first step to our last."""
    run_dir = work / f"ours-seed{seed}"
    steps = args.minutes * 60 / args.step_guess_s
    overrides = [
        f"job_id=goodput-{os.getpid()}-{seed}",
        f"run_dir={run_dir}",
        "campaign=random",
        f"campaign.seed={seed}",
        f"campaign.mtbf_s={args.mtbf_s}",
        "campaign.kinds=[kill_node,freeze_node]",
        "campaign.target=not_rank0",
        f"campaign.freeze_s={args.freeze_s}",
        f"campaign.restart_after_s={args.restart_after_s}",
        f"cluster.nodes={NODES}",
        f"data.batch_size={BATCH}",
        f"trainer.epochs={steps * NODES * BATCH / DATASET:.2f}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "chaos", *overrides], cwd=work, capture_output=True, text=True
    )
    print(done.stdout[-2500:], flush=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"python -m chaos failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    events = read_events(run_dir)
    steps_ = steps_of(events)
    gaps = [b["ts"] - a["ts"] for a, b in zip(steps_, steps_[1:], strict=False)]
    if not report["ok"]:
        print(f"  ours: an invariant broke: {report['violations']}", flush=True)
    finished = any(ev.TRAINING_DONE.matches(e) for e in events)
    outcome = Outcome(
        report["goodput"], report["fault_free_goodput"], len(report["faults"]), finished
    )
    return outcome, statistics.median(gaps), steps_[-1]["step"], report["seconds"]


def peer_goodput(
    steps: list[tuple[float, int, int]], rates: dict[int, float], until: float
) -> tuple[float, int]:
    """The same goodput as ours (:func:`chaos.verdict.goodput`): the kept samples (the last
    attempt of each step up to the last one) over the job's own pace at each step's world size
    and time. A job that died before its last step is charged from its last step ``until`` the
    campaign's end at the full world's pace: the time it was meant to train, and did not."""
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
    return goodput(kept, spans, rates, min_nodes=MIN_NODES)[1], kept


def run_peer(
    work: Path,
    args: argparse.Namespace,
    seed: int,
    settings: PeerSettings,
    step_s: float,
    steps: int,
    seconds: float,
) -> Outcome:
    """The peer under the same schedule, node picks and ends of faults as ours, for as many
    steps as ours trained, each padded to our step time: the same length of job, so the same
    faults fall in it. A peer that dies is charged to the end of our campaign (``seconds``
    after its first step) or to its own last step, whichever is later."""
    sleep = max(0.0, step_s - 0.01)  # ~10 ms of MLP compute, padded to our step
    name = settings.name.split(", ")[1]
    peer = Peer(
        work / f"peer-{name}-seed{seed}",
        args.peer / "train.py",
        settings,
        steps=steps,
        step_sleep=sleep,
        ckpt_every=50,
        nnodes=f"1:{NODES}",
        max_restarts=100,
    )
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
    finished = logged[-1][1] >= steps
    until = logged[-1][0] if finished else logged[0][0] + seconds
    ratio, _ = peer_goodput(logged, peer.pace(), until)
    first_fault = started + schedule(campaign(args, seed))[0].at_s if started else float("inf")
    before = [s for s in logged if s[0] < first_fault]
    fault_free = peer_goodput(before, peer.pace(), before[-1][0])[0] if len(before) > 30 else None
    if not finished:
        print(
            f"  peer: the job died at step {logged[-1][1]} of {steps}, "
            f"{logged[-1][0] - logged[0][0]:.0f} s in (logs: {peer.work})",
            flush=True,
        )
    return Outcome(ratio, fault_free, struck, finished)


def spread(values: list[float]) -> str:
    """``mean (min-max)`` in %."""
    low, high = 100 * min(values), 100 * max(values)
    return f"{100 * statistics.mean(values):.1f} % ({low:.1f}-{high:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds", default="1,2,3", help="comma-separated campaign seeds (at least 3 for a range)"
    )
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="mean time between faults")
    parser.add_argument("--minutes", type=float, default=5.0, help="fault-free job length")
    parser.add_argument("--freeze-s", type=float, default=10.0)
    parser.add_argument("--restart-after-s", type=float, default=10.0)
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
        "--timeline", type=Path, help="copy our first seed's timeline.png here (docs/...)"
    )
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. 1,2,3")
    if not (args.peer / "train.py").exists():
        parser.error(f"--peer: {args.peer}/train.py not found")
    if shutil.which("torchrun") is None:
        parser.error("torchrun is not on PATH: run with PATH=$PWD/.venv/bin:$PATH")
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir: {args.work_dir} is not empty; name a new or empty directory")
    rows: dict[str, list[Outcome]] = {"elastic": [], **{p.name: [] for p in PEERS}}
    step_times = []
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-goodput-")))
        else:
            work = args.work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
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


if __name__ == "__main__":
    main()
