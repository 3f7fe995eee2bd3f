"""Recovery from node faults: this project next to the torchrun peer, in one run, same machine.

Four fault kinds, each injected ``--repeats`` times into a fresh 3-node job of each runtime:

- ``kill``: SIGKILL of a node that does not hold rank 0 (its agent and every process under it);
- ``kill_rank0``: SIGKILL of the node with rank 0, which for both runtimes also hosts the
  rendezvous store (ours: the round's TCPStore; torchrun: the c10d rendezvous store);
- ``freeze``: SIGSTOP of a node that does not hold rank 0 (a hung machine). Ours is thawed once
  the job made progress again (it finds itself fenced out and rejoins); the peer's stays frozen
  for ``--freeze-wait-s`` and then counts as "no progress";
- ``leave``: SIGTERM of a node that does not hold rank 0 (a preemption, a maintenance drain).
  Ours leaves as planned: it finishes the step in flight and one more, and the others switch
  rounds in between. The peer's torchrun agent stops its worker and the others restart.

Stall and redone steps are defined the same way for both (chaos/report.py and the peer's
README): from the fault until a survivor completes a step beyond the one in flight; steps trained
again because the job rolled back. Both checkpoint every ``--ckpt-every`` steps and see the fault
at step ``--kill-at``. Step time: the peer's step is padded with ``STEP_SLEEP`` to our measured
step time (the peer trains a small MLP on random data; ours the default ResNet-18 on JPEGs, whose
state is larger, so a state transfer costs us more than it would cost the peer). The stall
counts the step in flight as lost, which a planned leave does not lose; ours is also given as
the time lost against the pace before the fault (chaos/report.py), which the peer does not report.

    ./dev.sh bench                                  # everything: 4 kinds x 5 faults x 2 runtimes
    ./dev.sh bench --faults kill --repeats 2 --skip-peer

The peer is ``shared/bench/peer_torchrun/run.sh`` beside this checkout; it needs torchrun on PATH
(./dev.sh bench puts the project's venv first).
"""

from __future__ import annotations

import argparse
import os
import re
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

from chaos.injectors import kill_node, node_with_rank, thaw_node  # noqa: E402
from chaos.report import Recovery, recovery  # noqa: E402
from elastic.events import EventFollower, read_events  # noqa: E402

DATASET = 640  # the default synthetic ImageFolder: 10 classes x 64 JPEGs
BATCH = 16
FAULTS = {
    "kill": "SIGKILL a node",
    "kill_rank0": "SIGKILL the rank-0 + store node",
    "freeze": "SIGSTOP a node",
    "leave": "SIGTERM a node (planned leave)",
}
BREAKDOWN = ("detected", "round_formed", "rebuild", "sync", "first_step")


@dataclass(frozen=True)
class Outcome:
    stall_s: float | None  # None: no progress after the fault
    redone: int | None
    detail: str


def run_ours(work: Path, fault: str, args: argparse.Namespace) -> Recovery:
    """One job with one fault; its recovery (with its median step time before the fault)."""
    run_dir = work / f"ours-{fault}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            f"job_id={run_dir.name}",
            f"run_dir={run_dir}",
            "cluster.nodes=3",
            f"checkpoint.every_steps={args.ckpt_every}",
            f"trainer.epochs={args.steps * 3 * BATCH / DATASET}",  # --steps at world size 3
            f"data.batch_size={BATCH}",
        ],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
    )
    try:
        follower = EventFollower(run_dir)
        follower.wait_for(lambda e: e["event"] == "step" and e["step"] >= args.kill_at, 600)
        rank0 = node_with_rank(run_dir, 0)
        other = next(n for n in ("node2", "node1", "node0") if n != rank0)
        if fault == "freeze":
            fault_ts = kill_node(run_dir, other, signal.SIGSTOP)
            try:
                follower.wait_for(lambda e: e["event"] == "recovered", args.freeze_wait_s)
            except TimeoutError:
                pass  # counted as no progress by recovery()
            finally:
                thaw_node(run_dir, other)
        elif fault == "leave":
            fault_ts = kill_node(run_dir, other, signal.SIGTERM)
        else:
            fault_ts = kill_node(run_dir, rank0 if fault == "kill_rank0" else other)
        if proc.wait(timeout=900) != 0:
            print(f"  (our job exited with {proc.returncode}; run dir {run_dir})", flush=True)
    finally:
        proc.kill()
    return recovery(read_events(run_dir), fault_ts)


RESULT = re.compile(r"stall_s=(?P<stall>[\d.]+).*redone_steps=(?P<redone>-?\d+)")


def run_peer(fault: str, args: argparse.Namespace, step_sleep: float) -> Outcome:
    env = {
        **os.environ,
        "KILL_AT": str(args.kill_at),
        "CKPT_EVERY": str(args.ckpt_every),
        "STEPS": str(args.steps),
        "STEP_SLEEP": f"{step_sleep:.3f}",
        "WAIT_DS": str(round((args.freeze_wait_s if fault == "freeze" else args.peer_wait_s) * 10)),
    }
    if fault in ("freeze", "leave"):
        env["SIG"] = "STOP" if fault == "freeze" else "TERM"
    victim = "host" if fault == "kill_rank0" else "other"
    out = subprocess.run(
        ["bash", str(args.peer), victim], env=env, capture_output=True, text=True, timeout=1200
    ).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), "no RESULT line")
    match = RESULT.search(line)
    if match is None:
        return Outcome(None, None, line)
    return Outcome(float(match["stall"]), int(match["redone"]), line)


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (no interpolation: with 5 runs, p90 is the worst)."""
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(outcomes: list[Outcome]) -> tuple[str, float | None]:
    stalls = [o.stall_s for o in outcomes if o.stall_s is not None]
    redone = [o.redone for o in outcomes if o.redone is not None]
    if not stalls:
        return f"{'no progress':>22}{'-':>12}{0:>8}/{len(outcomes)}", None
    p50 = pct(stalls, 0.5)
    return (
        f"{p50:>10.2f} s{pct(stalls, 0.9):>8.2f} s{statistics.median(redone):>12.0f}"
        f"{len(stalls):>8}/{len(outcomes)}",
        p50,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated kinds")
    parser.add_argument("--repeats", type=int, default=5, help="faults of each kind")
    parser.add_argument("--kill-at", type=int, default=15, help="inject at this step")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="job length at world size 3")
    parser.add_argument(
        "--peer-wait-s", type=float, default=200.0, help="how long the peer may take to finish"
    )
    parser.add_argument(
        "--freeze-wait-s",
        type=float,
        default=60.0,
        help="how long a frozen node stays frozen when the job makes no progress",
    )
    parser.add_argument(
        "--peer", type=Path, default=REPO.parent / "shared" / "bench" / "peer_torchrun" / "run.sh"
    )
    parser.add_argument("--skip-peer", action="store_true")
    args = parser.parse_args()
    faults = args.faults.split(",")
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    if not args.skip_peer and not args.peer.exists():
        parser.error(f"--peer: {args.peer} not found (or pass --skip-peer)")

    ours: dict[str, list[Recovery]] = {f: [] for f in faults}
    peer: dict[str, list[Outcome]] = {f: [] for f in faults}
    step_times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        for fault in faults:
            for i in range(args.repeats):
                rec = run_ours(Path(tmp), fault, args)
                ours[fault].append(rec)
                step_times.append(rec.step_s)
                stall = "no progress" if rec.stall_s is None else f"stall {rec.stall_s:.2f} s"
                print(
                    f"{fault:10} ours #{i + 1}: {stall}, lost {fmt(rec.lost_s)}, "
                    f"redone {rec.redone_steps}, step {rec.step_s:.3f} s; "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in rec.breakdown.items()),
                    flush=True,
                )
                if not args.skip_peer:
                    # The peer's step: ~10 ms of MLP compute, padded to our step time.
                    out = run_peer(fault, args, max(0.0, statistics.median(step_times) - 0.01))
                    peer[fault].append(out)
                    print(f"{fault:10} peer #{i + 1}: {out.detail}", flush=True)

    print(
        f"\n3 nodes x 1 CPU worker, fault at step {args.kill_at}, checkpoint every "
        f"{args.ckpt_every} steps, {args.repeats} faults of each kind per runtime; "
        f"our step time {statistics.median(step_times):.3f} s (the peer's padded to it)"
    )
    print(
        f"{'fault':34}{'runtime':10}{'p50 stall':>12}{'p90 stall':>10}{'redone p50':>12}"
        f"{'recovered':>11}{'peer/ours':>11}"
    )
    for fault in faults:
        mine = [Outcome(r.stall_s, r.redone_steps, "") for r in ours[fault]]
        line, our_p50 = summary(mine)
        print(f"{FAULTS[fault]:34}{'elastic':10}{line}")
        if peer[fault]:
            line, peer_p50 = summary(peer[fault])
            if our_p50 is None:
                ratio = "-"
            elif peer_p50 is None:
                wait = args.freeze_wait_s if fault == "freeze" else args.peer_wait_s
                ratio = f">{wait / our_p50:.0f}x"
            else:
                ratio = f"{peer_p50 / our_p50:.1f}x"
            print(f"{'':34}{'torchrun':10}{line}{ratio:>11}")
    print(
        "\nour recovery breakdown, p50 seconds (detected/round_formed: from the fault; lost: the"
        " delay against the pace before the fault)"
    )
    print(f"{'fault':34}" + "".join(f"{k:>13}" for k in (*BREAKDOWN, "lost")))
    for fault in faults:
        lost = [r.lost_s for r in ours[fault] if r.lost_s is not None]
        cells = []
        for key in BREAKDOWN:
            values = [r.breakdown[key] for r in ours[fault] if key in r.breakdown]
            cells.append(f"{pct(values, 0.5):>13.2f}" if values else f"{'-':>13}")
        cells.append(f"{pct(lost, 0.5):>13.2f}" if lost else f"{'-':>13}")
        print(f"{FAULTS[fault]:34}" + "".join(cells))


if __name__ == "__main__":
    main()
