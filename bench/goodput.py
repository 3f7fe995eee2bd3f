"""Goodput under one seeded campaign: this project next to the torchrun peer, in one run, with the
same faults at the same moments.

The campaign (chaos/campaign.py, drawn from ``--seed``; the default, 6, draws two kills and two
freezes in the 8 minutes, where seed 0 draws three freezes and no kill): faults at random moments
``--mtbf-s`` apart on average, each a SIGKILL or a SIGSTOP of a node other than rank 0's (for the
peer: other than the node whose agent hosts the c10d store); a killed node is started again after
``--restart-after-s``, a frozen one thawed after ``--freeze-s``. Ours runs as ``python -m chaos``
on a 3-node job; the peer is ``shared/bench/peer_torchrun/train.py`` under three torchrun agents
(``--nnodes=1:3``, c10d rendezvous), driven here with the same schedule, node picks and ends of
faults, for as many steps as ours trained, each padded to our step time (so the same faults fall
within both jobs). A frozen torchrun node holds its peers in their all-reduce until it is thawed; a
killed one restarts every worker from the last checkpoint: that is the peer's own behaviour.

Goodput has one definition for both (README, chaos/verdict.py): samples trained and kept per
second, divided by what a fault-free run of the same job trains per second at the same world
sizes, each step's time counted at the fault-free rate of the world that trained it. Both
fault-free rates are measured in the same run.

    .venv/bin/python bench/goodput.py                         # a fault every 2 minutes, ~30 min
    .venv/bin/python bench/goodput.py --work-dir /tmp/gp      # keep both jobs' logs
    .venv/bin/python bench/goodput.py --mtbf-s 30 --minutes 3 # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.campaign import CampaignConfig, FaultKind, pick, schedule  # noqa: E402
from chaos.verdict import goodput  # noqa: E402
from elastic.events import read_events  # noqa: E402

NODES = 3
BATCH = 16  # our per-rank batch
DATASET = 640  # the default synthetic ImageFolder
PEER_BATCH = 32  # train.py's per-rank batch
PEER_NODES = [f"node{i}" for i in range(NODES)]  # node0 hosts the c10d store
MIN_NODES = 1  # both jobs train on down to one node; no fault may take the last one


def campaign(args: argparse.Namespace) -> CampaignConfig:
    return CampaignConfig(
        name="goodput",
        seed=args.seed,
        mtbf_s=args.mtbf_s,
        kinds=[FaultKind.kill_node, FaultKind.freeze_node],
        target="not_rank0",
        freeze_s=args.freeze_s,
        restart_after_s=args.restart_after_s,
    )


def run_ours(work: Path, args: argparse.Namespace) -> tuple[dict, float, int]:
    """``python -m chaos`` on a 3-node job about ``--minutes`` long: its report, our median
    step time (the peer's step is padded to it) and our last step (the peer trains as many)."""
    run_dir = work / "ours"
    steps = args.minutes * 60 / args.step_guess_s
    overrides = [
        f"job_id=goodput-{os.getpid()}",
        f"run_dir={run_dir}",
        "campaign=random",
        f"campaign.seed={args.seed}",
        f"campaign.mtbf_s={args.mtbf_s}",
        "campaign.kinds=[kill_node,freeze_node]",
        "campaign.target=not_rank0",
        f"campaign.freeze_s={args.freeze_s}",
        f"campaign.restart_after_s={args.restart_after_s}",
        f"cluster.nodes={NODES}",
        f"data.batch_size={BATCH}",
        f"trainer.epochs={steps * NODES * BATCH / DATASET:.2f}",
        f"campaign.baseline_steps={args.baseline_steps}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "chaos", *overrides], cwd=work, capture_output=True, text=True
    )
    print(done.stdout[-3000:], flush=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"python -m chaos failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    steps = sorted((e for e in read_events(run_dir) if e["event"] == "step"), key=lambda e: e["ts"])
    gaps = [b["ts"] - a["ts"] for a, b in zip(steps, steps[1:], strict=False)]
    return report, statistics.median(gaps), max(e["step"] for e in steps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Peer:
    """Three torchrun agents of the peer job, each in its own session (a node)."""

    def __init__(self, work: Path, steps: int, step_sleep: float, nnodes: str) -> None:
        self.work = work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.env = {
            **os.environ,
            "LOG_DIR": str(self.logs),
            "CKPT_PATH": str(work / "ckpt.pt"),
            "STEPS": str(steps),
            "CKPT_EVERY": "50",
            "STEP_SLEEP": f"{step_sleep:.3f}",
        }
        self.port = free_port()
        self.nnodes = nnodes
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, train: Path) -> None:
        with open(self.work / f"{node}.out", "ab") as out:
            self.procs[node] = subprocess.Popen(
                [
                    "torchrun",
                    f"--nnodes={self.nnodes}",
                    "--nproc-per-node=1",
                    "--max-restarts=100",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{self.port}",
                    "--rdzv-id=peer",
                    "--monitor-interval=0.5",
                    str(train),
                ],
                env={**self.env, "NODE_NAME": node},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, node: str, sig: signal.Signals) -> None:
        """``sig`` to the node's agent and every process under it."""
        with contextlib.suppress(psutil.NoSuchProcess):
            agent = psutil.Process(self.procs[node].pid)
            for p in [agent, *agent.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(sig)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def steps(self) -> list[tuple[float, int, int]]:
        """``(time, step, world size)`` of every step any rank logged, in time order."""
        lines = []
        for log in self.logs.glob("*.log"):
            for line in log.read_text().splitlines():
                part = line.split()
                if part and part[0] == "step":
                    lines.append((float(part[2]), int(part[1]), int(part[3])))
        return sorted(lines)

    def stop(self) -> None:
        for node in self.procs:
            self.signal(node, signal.SIGCONT)
            self.signal(node, signal.SIGKILL)


def peer_rate(work: Path, train: Path, world: int, step_sleep: float, steps: int) -> float:
    """The peer's fault-free samples/s at ``world`` nodes, over ``steps`` steps."""
    peer = Peer(work / f"peer-baseline-{world}", steps, step_sleep, str(world))
    for node in PEER_NODES[:world]:
        peer.start(node, train)
    deadline = time.monotonic() + 300
    while peer.running() and time.monotonic() < deadline:
        time.sleep(0.5)
    peer.stop()
    steps = peer.steps()
    first, last = steps[0], steps[-1]
    return (last[1] - first[1]) * PEER_BATCH * world / (last[0] - first[0])


def peer_goodput(
    steps: list[tuple[float, int, int]], rates: dict[int, float], until: float
) -> tuple[float, int]:
    """The same goodput as ours: the kept samples (the last attempt of each step up to the last
    one) over the fault-free samples at each step's world size and time. A job that died before
    its last step is charged from its last step ``until`` the campaign's end at the full
    world's rate: the time it was meant to train, and did not."""
    last_attempt: dict[int, int] = {}
    distinct: list[tuple[float, int, int]] = []
    for t, step, world in steps:
        last_attempt[step] = world
        if not distinct or distinct[-1][1] != step:
            distinct.append((t, step, world))
    final = distinct[-1][1]
    kept = sum(PEER_BATCH * last_attempt[s] for s in range(distinct[0][1] + 1, final + 1))
    segments = [(a[0], b[0], b[2]) for a, b in zip(distinct, distinct[1:], strict=False)]
    if until > distinct[-1][0]:
        segments.append((distinct[-1][0], until, NODES))
    return goodput(kept, segments, rates, min_nodes=MIN_NODES)[1], kept


def run_peer(
    work: Path, args: argparse.Namespace, step_s: float, steps: int, seconds: float
) -> dict:
    """The peer under the same schedule, node picks and ends of faults as ours, for as many
    steps as ours trained, each padded to our step time: the same length of job, so the same
    faults fall in it. A peer that dies is charged to the end of our campaign (``seconds``
    after its first step) or to its own last step, whichever is later."""
    train = args.peer / "train.py"
    sleep = max(0.0, step_s - 0.01)  # ~10 ms of MLP compute, padded to our step
    rates = {w: peer_rate(work, train, w, sleep, args.baseline_steps) for w in (3, 2, 1)}
    peer = Peer(work / "peer", steps, sleep, f"1:{NODES}")
    for node in PEER_NODES:
        peer.start(node, train)
    faults, down, frozen, number = schedule(campaign(args)), {}, {}, 0
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
                    peer.start(node, train)
                    del down[node]
            while started is not None and faults and now - started >= faults[0].at_s:
                spec = faults.pop(0)
                number += 1
                up = [n for n in PEER_NODES if n not in down and n not in frozen]
                node = pick(spec.target, up, "node0", args.seed, number)
                if node is None or len(up) - 1 < MIN_NODES:
                    print(f"peer: fault {number} skipped (too few nodes up)", flush=True)
                    continue
                print(f"peer: fault {number}: {spec.kind} {node}", flush=True)
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
    ratio, kept = peer_goodput(logged, rates, until)
    if not finished:
        print(
            f"peer: the job died at step {logged[-1][1]} of {steps}, "
            f"{logged[-1][0] - logged[0][0]:.0f} s in (logs: {peer.work})",
            flush=True,
        )
    return {
        "goodput": ratio,
        "kept": kept,
        "faults": number,
        "finished": finished,
        "rates": rates,
        "seconds": logged[-1][0] - logged[0][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seed", type=int, default=6, help="6 draws two kills and two freezes in 8 minutes"
    )
    parser.add_argument("--mtbf-s", type=float, default=120.0, help="mean time between faults")
    parser.add_argument("--minutes", type=float, default=8.0, help="fault-free job length")
    parser.add_argument("--freeze-s", type=float, default=10.0)
    parser.add_argument(
        "--baseline-steps",
        type=int,
        default=150,
        help="steps of each fault-free run (both runtimes); on shared cores the rate is noisy, "
        "and a short run misjudges it by several %%",
    )
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
        help="keep both jobs' run directories and logs here (default: a temporary directory)",
    )
    args = parser.parse_args()
    if not (args.peer / "train.py").exists():
        parser.error(f"--peer: {args.peer}/train.py not found")
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir: {args.work_dir} is not empty; name a new or empty directory")
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-goodput-")))
        else:
            work = args.work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        ours, step_s, steps = run_ours(work, args)
        peer = run_peer(work, args, step_s, steps, ours["seconds"])
    print(
        f"\n3 nodes x 1 CPU worker, seed {args.seed}, a fault every {args.mtbf_s:.0f} s on "
        f"average (SIGKILL or SIGSTOP of a node other than rank 0's; back after "
        f"{args.restart_after_s:.0f} s / thawed after {args.freeze_s:.0f} s); our step "
        f"{step_s:.3f} s, the peer's padded to it"
    )
    print(f"{'runtime':10}{'faults':>8}{'goodput':>10}{'kept samples':>14}{'finished':>10}")
    our_faults = len(ours["faults"])
    print(
        f"{'elastic':10}{our_faults:>8}{100 * ours['goodput']:>9.1f}%{ours['kept_samples']:>14}"
        f"{'yes':>10}"
    )
    print(
        f"{'torchrun':10}{peer['faults']:>8}{100 * peer['goodput']:>9.1f}%{peer['kept']:>14}"
        f"{'yes' if peer['finished'] else 'no':>10}"
    )
    if peer["goodput"] > 0:
        print(f"ours / peer: {ours['goodput'] / peer['goodput']:.2f}x")


if __name__ == "__main__":
    main()
