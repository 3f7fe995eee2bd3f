"""Recovery from node faults: this project next to the torchrun and torchft peers, in one run.

Six fault kinds, each injected ``--repeats`` times into a fresh 3-node job of each runtime:

- ``kill``: SIGKILL of a node that does not hold rank 0 (its agent and every process under it);
- ``kill_rank0``: SIGKILL of the node with rank 0, which for every runtime also hosts the
  rendezvous store (ours: the round's TCPStore; torchrun: the c10d rendezvous store; torchft:
  the quorum's process group store);
- ``freeze``: SIGSTOP of a node that does not hold rank 0 (a hung machine). Ours is thawed once
  the job made progress again (it finds itself fenced out and rejoins); the peer's stays frozen
  for ``--freeze-wait-s`` and then counts as "no progress";
- ``leave``: SIGTERM of a node that does not hold rank 0 (a preemption, a maintenance drain).
  Ours leaves as planned: it finishes the step in flight and one more, and the others switch
  rounds in between. The peer's torchrun agent stops its worker and the others restart;
  torchft has no planned leave, and its replica ends as if killed.
- ``etcd_restart``: the job's etcd SIGKILLed and started again (same data, same port) after
  ``--etcd-down-s``; the round trains on meanwhile (the steps are counted), and the recovery is
  measured from etcd's return, when the agents renew their leases and watch again (the job is
  made longer by 10 steps per second of outage, to train on past it). Ours only: the peer has
  no etcd.
- ``partition``: a node that does not hold rank 0 cut off its peers by bringing its link down
  (each node a bare-metal launcher in a network namespace, chaos/netns.py; needs root). The
  round's collectives fail after ``--pg-timeout-s``, the majority evicts it, and its link comes
  up again once they recovered. Ours only: the peer script runs its nodes on loopback.

The torchrun peer runs twice for each fault (bench/torchrun_peer.py): at torchrun's defaults
(what most users run) and tuned as a careful user would (no shared rendezvous store, keep-alives
every 1 s with 3 missed allowed, a 1 s last call, a 10 s gloo timeout). Its node0 is started
first and its other nodes once node0's agent serves the c10d store, so ``kill_rank0`` kills the
store's node. With ``--peers torchrun,torchft`` the torchft peer runs twice too
(bench/torchft_peer.py, in a venv of its own made on first use): at torchft's defaults and tuned
(a replica dropped after 1 s without a heartbeat, a 10 s Manager and gloo timeout).

Stall and redone steps are defined the same way for all (chaos/recovery_figures.py): from the
fault until a survivor completes a step beyond the one in flight; steps trained again because the
job rolled back. Ours and the torchrun peer checkpoint every ``--ckpt-every`` steps; the torchft
peer needs no checkpoint, as a failed step is not committed. All see the fault at step
``--kill-at``. Step time: the peers' step is padded with ``STEP_SLEEP`` to our measured step time
(the peers train a small MLP on random data; ours the default ResNet-18 on JPEGs, whose state is
larger, so a state transfer costs us more than it would cost a peer). The stall counts the step
in flight as lost, which a planned leave does not lose; ours is also given as the time lost
against the pace before the fault (chaos/recovery_figures.py), which the peers do not report.

    ./dev.sh bench                                  # everything: 6 kinds x 5 faults x 3 rows
    ./dev.sh bench --faults kill,kill_rank0,freeze --repeats 3   # the peer comparisons
    ./dev.sh bench --faults kill,freeze --repeats 3 --peers torchrun,torchft
    ./dev.sh bench --faults kill --repeats 2 --skip-peer
    ./dev.sh bench --faults kill --repeats 16 --skip-peer --keep runs/bench   # keeps the runs

The torchrun peer's ``train.py`` is ``shared/bench/peer_torchrun/`` beside this checkout; it
needs torchrun on PATH (./dev.sh bench puts the project's venv first). The torchft peer's is
bench/torchft_train.py.
"""

from __future__ import annotations

import argparse
import contextlib
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

from torchft_peer import TORCHFT_PEERS, TorchftPeer, TorchftSettings, torchft_python  # noqa: E402
from torchrun_peer import PEERS, Peer, PeerSettings  # noqa: E402

from chaos.injectors import (  # noqa: E402
    heal,
    kill_node,
    node_with_rank,
    partition,
    start_etcd,
    stop_etcd,
    thaw_node,
)
from chaos.netns import PEER_LINK, LocalNetwork, available  # noqa: E402
from chaos.recovery_figures import Recovery, recovery  # noqa: E402
from elastic import event_types as ev  # noqa: E402
from elastic.events import EventFollower, read_events  # noqa: E402
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd  # noqa: E402

DATASET = 640  # the default synthetic ImageFolder: 10 classes x 64 JPEGs
BATCH = 16
FAULTS = {
    "kill": "SIGKILL a node",
    "kill_rank0": "SIGKILL the rank-0 + store node",
    "freeze": "SIGSTOP a node",
    "leave": "SIGTERM a node (planned leave)",
    "etcd_restart": "etcd stopped, restarted",
    "partition": "cut a node off its peers",
}
# Faults the peers cannot take: they have no etcd (torchrun's c10d store lives in an agent,
# torchft's quorum in its lighthouse), and they run their nodes on loopback, not in network
# namespaces.
PEERLESS = {"etcd_restart": "the peer has no etcd", "partition": "peer runs on loopback"}
PEER_ROWS = {"torchrun": PEERS, "torchft": TORCHFT_PEERS}  # --peers: each peer's settings rows
BREAKDOWN = ("detected", "round_formed", "rebuild", "sync", "first_step")


@dataclass(frozen=True)
class Outcome:
    stall_s: float | None  # None: no progress after the fault
    redone: int | None
    detail: str
    died: bool = False  # no progress because the job ended (every peer agent exited)


def job_overrides(run_dir: Path, args: argparse.Namespace, steps: int) -> list[str]:
    """The same job for every fault kind: ``steps`` at world size 3."""
    return [
        f"job_id={run_dir.name}",
        f"run_dir={run_dir}",
        f"checkpoint.every_steps={args.ckpt_every}",
        f"trainer.epochs={steps * 3 * BATCH / DATASET}",
        f"data.batch_size={BATCH}",
    ]


def run_ours(work: Path, fault: str, args: argparse.Namespace) -> Recovery:
    """One job with one fault; its recovery (with its median step time before the fault)."""
    run_dir = work / f"ours-{fault}-{time.monotonic_ns()}"
    if fault == "partition":
        return run_ours_partitioned(run_dir, args)
    with contextlib.ExitStack() as stack:
        # Long enough to train on through an etcd outage (steps take well over 0.1 s here).
        steps = args.steps + (round(10 * args.etcd_down_s) if fault == "etcd_restart" else 0)
        overrides = ["cluster.nodes=3", *job_overrides(run_dir, args, steps)]
        if fault == "etcd_restart":  # an etcd of the bench's own, to stop and start
            etcd = stack.enter_context(EmbeddedEtcd(work / "etcd", work / "etcd.log"))
            overrides.append(f"cluster.etcd_endpoints=[{etcd.endpoint}]")
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", *overrides],
            cwd=work,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
        )
        stack.callback(proc.kill)
        follower = EventFollower(run_dir)
        follower.wait_for(lambda e: ev.STEP.matches(e) and e["step"] >= args.kill_at, 600)
        rank0 = node_with_rank(run_dir, 0)
        other = next(n for n in ("node2", "node1", "node0") if n != rank0)
        if fault == "freeze":
            fault_ts = kill_node(run_dir, other, signal.SIGSTOP)
            try:
                follower.wait_for(ev.RECOVERED.matches, args.freeze_wait_s)
            except TimeoutError:
                pass  # counted as no progress by recovery()
            finally:
                thaw_node(run_dir, other)
        elif fault == "leave":
            fault_ts = kill_node(run_dir, other, signal.SIGTERM)
        elif fault == "etcd_restart":
            down = stop_etcd(run_dir, etcd)
            time.sleep(max(0.0, down + args.etcd_down_s - time.time()))  # the outage
            fault_ts = start_etcd(run_dir, etcd)  # measured from here: the agents reconnect
            steps = ev.STEP.of(read_events(run_dir))
            during = [e for e in steps if down < e["ts"] < fault_ts]
            print(f"  etcd down {fault_ts - down:.1f} s: {len(during)} steps trained", flush=True)
        else:
            fault_ts = kill_node(run_dir, rank0 if fault == "kill_rank0" else other)
        if proc.wait(timeout=900) != 0:
            print(f"  (our job exited with {proc.returncode}; run dir {run_dir})", flush=True)
    return recovery(read_events(run_dir), fault_ts)


def run_ours_partitioned(run_dir: Path, args: argparse.Namespace) -> Recovery:
    """Run three bare-metal launchers, each in a network namespace (chaos/netns.py), and cut one.

    The node cut off its peers does not hold rank 0. Its link is brought up again once the others
    recovered (it rejoins)."""
    work = run_dir.parent
    overrides = [
        *job_overrides(run_dir, args, args.steps),
        f"rendezvous.pg_timeout_s={args.pg_timeout_s}",
    ]
    with (
        LocalNetwork(3) as net,
        EmbeddedEtcd(work / "etcd", work / "etcd.log", listen_host="0.0.0.0") as etcd,
        contextlib.ExitStack() as stack,
    ):
        port = int(etcd.endpoint.rsplit(":", 1)[1])
        follower = EventFollower(run_dir)
        nodes: list[subprocess.Popen[bytes]] = []
        for i in range(3):
            nodes.append(
                subprocess.Popen(
                    net.launcher(i, port, *overrides),
                    cwd=work,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            stack.callback(nodes[-1].kill)
            if i == 0:  # node0's launcher makes the data set before its agent starts
                follower.wait_for(ev.AGENT_STARTED.matches, 600)
        follower.wait_for(lambda e: ev.STEP.matches(e) and e["step"] >= args.kill_at, 600)
        victim = next(i for i in (2, 1, 0) if f"node{i}" != node_with_rank(run_dir, 0))
        fault_ts = partition(run_dir, net, victim, PEER_LINK)
        try:
            follower.wait_for(ev.RECOVERED.matches, args.pg_timeout_s + 60)
        except TimeoutError:
            pass  # counted as no progress by recovery()
        finally:
            heal(run_dir, net, victim, PEER_LINK)
        codes = [p.wait(timeout=900) for p in nodes]
        if codes != [0, 0, 0]:
            print(f"  (our nodes exited with {codes}; run dir {run_dir})", flush=True)
    return recovery(read_events(run_dir), fault_ts)


def run_peer(
    work: Path,
    fault: str,
    args: argparse.Namespace,
    settings: PeerSettings | TorchftSettings,
    step_sleep: float,
) -> Outcome:
    """Run a peer with the same fault at the same step.

    The torchrun peer has 3 nodes, ``--nnodes=2:3`` and ``--max-restarts=3``, as the shared
    peer's run.sh; the torchft peer a lighthouse and 3 replicas, 2 of them enough. It waits until
    the job made progress again or ``--peer-wait-s`` (``--freeze-wait-s`` for a freeze) passed."""
    where = work / f"peer-{fault}-{time.monotonic_ns()}"
    peer: Peer | TorchftPeer
    if isinstance(settings, TorchftSettings):
        peer = TorchftPeer(where, settings, steps=args.steps, step_sleep=step_sleep)
    else:
        peer = Peer(
            where,
            args.peer / "train.py",
            settings,
            steps=args.steps,
            step_sleep=step_sleep,
            ckpt_every=args.ckpt_every,
            nnodes="2:3",
            max_restarts=3,
        )
    try:
        peer.start_all()
        deadline = time.monotonic() + 600
        while peer.max_step() < args.kill_at:
            if time.monotonic() > deadline or not peer.running():
                return Outcome(None, None, f"never reached step {args.kill_at}: see {peer.work}")
            time.sleep(0.05)
        victim = "node0" if fault == "kill_rank0" else "node2"  # node0 hosts the store
        sig = {"freeze": signal.SIGSTOP, "leave": signal.SIGTERM}.get(fault, signal.SIGKILL)
        fault_ts = peer.signal(victim, sig)
        wait = args.freeze_wait_s if fault == "freeze" else args.peer_wait_s
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and peer.running():
            if peer.recovery(fault_ts, victim).stall_s is not None:
                break
            time.sleep(0.2)
        found = peer.recovery(fault_ts, victim)
        died = found.stall_s is None and not peer.running()
        detail = found.detail + ("; every agent exited" if died else "")
        return Outcome(found.stall_s, found.redone_steps, detail, died)
    finally:
        peer.stop()


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
        what = "job died" if all(o.died for o in outcomes) else "no progress"
        return f"{what:>22}{'-':>12}{0:>8}/{len(outcomes)}", None
    p50 = pct(stalls, 0.5)
    return (
        f"{p50:>10.2f} s{pct(stalls, 0.9):>8.2f} s{statistics.median(redone):>12.0f}"
        f"{len(stalls):>8}/{len(outcomes)}",
        p50,
    )


def work_dir(keep: Path | None) -> contextlib.AbstractContextManager[str]:
    """Where the runs live: ``keep`` (made if need be, left behind), else a temporary folder."""
    if keep is None:
        return tempfile.TemporaryDirectory(prefix="bench-recovery-")
    keep.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(keep))


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
        "--peer",
        type=Path,
        default=REPO.parent / "shared" / "bench" / "peer_torchrun",
        help="the folder of the peer's train.py",
    )
    parser.add_argument(
        "--etcd-down-s", type=float, default=5.0, help="how long etcd_restart keeps etcd down"
    )
    parser.add_argument(
        "--pg-timeout-s",
        type=float,
        default=10.0,
        help="rendezvous.pg_timeout_s for partition: a cut link fails collectives after this",
    )
    parser.add_argument(
        "--peers", default="torchrun", help=f"comma-separated, of {', '.join(PEER_ROWS)}"
    )
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument(
        "--keep",
        type=Path,
        help="keep every run's directory (events, logs) under this folder, to read afterwards",
    )
    args = parser.parse_args()
    peers = [] if args.skip_peer else args.peers.split(",")
    if set(peers) - set(PEER_ROWS):
        parser.error(f"--peers: unknown {sorted(set(peers) - set(PEER_ROWS))}")
    faults = args.faults.split(",")
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    why_not = available()
    if "partition" in faults and why_not:
        print(f"partition: skipped, network namespaces are not available here ({why_not})")
        faults.remove("partition")
    if "torchrun" in peers and not (args.peer / "train.py").exists():
        parser.error(f"--peer: {args.peer}/train.py not found (or pass --skip-peer)")
    if "torchrun" in peers and shutil.which("torchrun") is None:
        parser.error("torchrun is not on PATH: run ./dev.sh bench, or put .venv/bin first")
    if "torchft" in peers:
        print(f"torchft: {torchft_python()}", flush=True)  # its venv, made on first use
    rows = [settings for name in peers for settings in PEER_ROWS[name]]

    ours: dict[str, list[Recovery]] = {f: [] for f in faults}
    peer: dict[str, dict[str, list[Outcome]]] = {f: {p.name: [] for p in rows} for f in faults}
    step_times: list[float] = []
    with work_dir(args.keep) as tmp:
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
                if fault not in PEERLESS:
                    # The peer's step: ~10 ms of MLP compute, padded to our step time.
                    sleep = max(0.0, statistics.median(step_times) - 0.01)
                    for settings in rows:
                        out = run_peer(Path(tmp), fault, args, settings, sleep)
                        peer[fault][settings.name].append(out)
                        print(f"{fault:10} {settings.name} #{i + 1}: {out.detail}", flush=True)

    print(
        f"\n3 nodes x 1 CPU worker, fault at step {args.kill_at}, checkpoint every "
        f"{args.ckpt_every} steps, {args.repeats} faults of each kind per runtime; "
        f"our step time {statistics.median(step_times):.3f} s (the peer's padded to it)"
    )
    print(
        f"{'fault':34}{'runtime':20}{'p50 stall':>12}{'p90 stall':>10}{'redone p50':>12}"
        f"{'recovered':>11}{'peer/ours':>11}"
    )
    for fault in faults:
        mine = [Outcome(r.stall_s, r.redone_steps, "") for r in ours[fault]]
        line, our_p50 = summary(mine)
        print(f"{FAULTS[fault]:34}{'elastic':20}{line}")
        for name, outcomes in peer[fault].items():
            if not outcomes:
                continue
            line, peer_p50 = summary(outcomes)
            if our_p50 is None:
                ratio = "-"
            elif peer_p50 is None and all(o.died for o in outcomes):
                ratio = "-"  # no stall to compare: the job is over
            elif peer_p50 is None:
                wait = args.freeze_wait_s if fault == "freeze" else args.peer_wait_s
                ratio = f">{wait / our_p50:.0f}x"
            else:
                ratio = f"{peer_p50 / our_p50:.1f}x"
            print(f"{'':34}{name:20}{line}{ratio:>11}")
        for name in peers if fault in PEERLESS else []:
            print(f"{'':34}{name:20}  not run: {PEERLESS[fault]}")
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
