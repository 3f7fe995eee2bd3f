"""Start-up cost: an agent from process start to ``node_ready``, and the doctor command.

The doctor command is ``python -m launcher.commands.doctor``.

A node's agent imports its dependencies, connects to etcd, runs the health checks, registers and
starts its workers; ``node_ready`` is the moment its workers wait for a round. The peer is
torchrun: from its start until its (single) worker process runs the first line of the script,
which is what torchrun's agent does before training can begin. Each figure is the median of
``--repeats`` fresh processes, measured in one run on this machine, with the ratio ours / peer.

    .venv/bin/python bench/startup.py --repeats 5
    .venv/bin/python bench/startup.py --resume    # agents of a job that has a checkpoint

The agent runs as the only node of a local job (``cluster.nodes=1``) with the embedded etcd; the
job is stopped (SIGTERM) as soon as its node is ready. ``--resume`` first trains the job to its
first checkpoint, so that the agents measured afterwards size checkpoints from its manifest.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic import event_types as ev  # noqa: E402
from elastic.events import EventFollower  # noqa: E402

TIMEOUT_S = 180.0
PEER_WORKER = "import sys, time; print(f'WORKER_STARTED {time.time()}', flush=True)"


def one_node_job(workdir: Path, job_id: str, extra: list[str]) -> list[str]:
    """The command line of a local job of one node, run directory ``workdir/job_id``."""
    run_dir = workdir / job_id
    return [
        sys.executable,
        "-m",
        "launcher",
        f"job_id={job_id}",
        f"run_dir={run_dir}",
        "cluster.nodes=1",
        *extra,
    ]


def agent_startup(workdir: Path, job_id: str, extra: list[str]) -> tuple[float, float]:
    """Seconds from the agent process's creation to its ``node_ready`` event, and its checks'.

    The latter are the seconds its health checks took (its ``health_checked`` event)."""
    run_dir = workdir / job_id
    launched = time.time()
    launcher = subprocess.Popen(
        one_node_job(workdir, job_id, extra),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        follower = EventFollower(run_dir)
        checked = follower.wait_for(
            lambda e: ev.HEALTH_CHECKED.matches(e) and e["ts"] >= launched, timeout_s=TIMEOUT_S
        )
        ready = follower.wait_for(ev.NODE_READY.matches, timeout_s=TIMEOUT_S)
        started = next(
            p.create_time()
            for p in psutil.Process(launcher.pid).children(recursive=True)
            if "launcher.agent" in " ".join(p.cmdline())
        )
        return ready["ts"] - started, checked["seconds"]
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)


def train_to_first_checkpoint(workdir: Path, job_id: str, extra: list[str]) -> None:
    subprocess.run(
        one_node_job(workdir, job_id, ["trainer.epochs=0.1", *extra]),
        cwd=workdir,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=TIMEOUT_S,
    )


def doctor_wall(workdir: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "launcher.commands.doctor"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        timeout=TIMEOUT_S,
        check=False,
    )
    return time.perf_counter() - t0


def torchrun_startup(workdir: Path) -> float:
    """Seconds from torchrun's start until its worker runs its first line."""
    script = workdir / "peer_worker.py"
    script.write_text(PEER_WORKER)
    started = time.time()
    out = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node=1", str(script)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("WORKER_STARTED"))
    return float(line.split()[1]) - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resume", action="store_true", help="agents of a checkpointed job")
    args = parser.parse_args()
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        workdir = Path(tmp)
        extra = [f"data.root={workdir / 'data'}"]
        job = "resumed" if args.resume else "fresh"
        if args.resume:
            train_to_first_checkpoint(workdir, job, extra)
        agents, checks, doctors, peers = [], [], [], []
        for i in range(args.repeats):
            took, checked = agent_startup(workdir, job if args.resume else f"fresh{i}", extra)
            agents.append(took)
            checks.append(checked)
            doctors.append(doctor_wall(workdir))
            peers.append(torchrun_startup(workdir))
            print(
                f"run {i + 1}: agent {took:.2f} s (health checks {checked:.2f} s), "
                f"doctor {doctors[-1]:.2f} s, torchrun {peers[-1]:.2f} s",
                flush=True,
            )
    agent, check, doctor, peer = (statistics.median(x) for x in (agents, checks, doctors, peers))
    kind = "with a checkpoint" if args.resume else "fresh job"
    print(f"agent start to node_ready ({kind}): {agent:.2f} s (median of {args.repeats})")
    print(f"  of which the health checks:      {check:.2f} s")
    print(f"torchrun start to its worker:      {peer:.2f} s; ours / torchrun = {agent / peer:.1f}x")
    print(f"python -m launcher.commands.doctor: {doctor:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
