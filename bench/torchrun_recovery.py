"""torchrun's recovery from a SIGKILLed node: this project's etcd-v3 backend next to c10d.

It runs ``--rdzv-backend=etcd-v3`` (this project's backend, ``launcher/torchrun/backend.py``)
next to torch's own ``--rdzv-backend=c10d``, in one run, on one machine. Each runs at torch's
default ``--rdzv-conf`` and tuned for fast recovery.

Every run is a fresh 3-node job of real torchrun agents (``--nnodes=2:3 --nproc-per-node=1
--max-restarts=3 --local-addr=127.0.0.1``; each agent in a session of its own, as a node): a gloo
job of ``--steps`` all-reduce steps, each padded to a real step's time with a ``--step-s``
sleep, that checkpoints its step every ``--ckpt-every`` steps to a file all nodes share and
resumes from it when torchrun starts its workers again. Every worker appends ``start FROM WORLD
TS RESTARTS`` (``RESTARTS``: torchrun's ``TORCHELASTIC_RESTART_COUNT``) and ``step N WORLD TS``
lines (wall-clock time) to its node's progress file. Once the job trained ``--kill-at`` steps at
world size 3, one node is SIGKILLed (its agent and its worker, as a machine failure kills both),
and the bench waits for the two survivors to train at world size 2.

The victims:

- ``etcd-v3``: the node whose worker has rank 0, the hardest loss: its worker hosts the round's
  TCPStore, so every survivor has to find the next round's store elsewhere (the backend turns
  torch's shared agent store off for this, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
- ``c10d``: the easiest loss torch's backend has, a node that is neither the ``--rdzv-endpoint``
  node (node0, started first, whose agent hosts c10d's rendezvous TCPStore: the job dies with
  it) nor a node whose worker had rank 0 in any round so far (at torch's default its agent hosts
  the workers' shared TCPStore for every later round, and the survivors would wait on a dead
  address, the failure the etcd-v3 backend's docstring describes).

Settings (the same for both backends; a ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` of the caller's
environment is not passed on, so each backend runs its own default unless the row sets it):

- ``defaults``: no ``--rdzv-conf``, torch's ``DynamicRendezvousHandler`` defaults: a keep-alive
  every 5 s, a node dead after 3 missed (15 s), a last call of 30 s (join 600 s, close 30 s,
  heartbeat 5 s, none of which a recovery waits on), and each backend's own store default
  (c10d: the shared agent store; etcd-v3: none, see above).
- ``tuned``: ``--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=1``
  and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a keep-alive every 1 s, a node dead after 4
  missed (the fewest the etcd-v3 backend allows at 1 s: ``keep_alive_problem``), a last call
  of 1 s. Those three are the only settings a recovery waits on (read from
  torch's ``dynamic_rendezvous.py``): the survivors leave the completed round, which moves to
  the next round only once the dead node's heartbeat is older than ``keep_alive_interval *
  keep_alive_max_attempt`` and a survivor's sync removes it; the new round reaches
  ``min_nodes`` (2) and is marked complete ``last_call_timeout`` later. Between syncs a waiting
  node sleeps 1 s, a constant of torch's, not a setting. No shared store (what etcd-v3 does by
  default) matters for c10d even though its victim never hosted it: the shared store outlives
  the worker restart with the old workers' keys in it (torch puts no per-attempt prefix on it),
  so a survivor's new worker can read its peer's dead gloo address before the peer's new worker
  overwrites it, fail with "Connection refused", and the restarts that follow fall out of step.
  A fresh store per round (each round's rank-0 worker hosts one) has no old keys. Seen on torch
  2.14: a c10d ``defaults`` run that lost its first world-2 attempt so (one failed retry, 81 s
  instead of 46 s), and a ``tuned`` run without the opt-out that never recovered. It is a race:
  other c10d ``defaults`` runs had none, so give the ratio of ``--repeats 3`` or more.

Measured per survivor (the job's figure is the later survivor's, within milliseconds of the
other since every step is a collective):

- **recovery**: from the kill (the bench's wall clock, just before the SIGKILLs) to the first step
  the survivor trained at world size 2 (its progress line's timestamp): failure detection, the
  rendezvous, the workers' restart (a Python + torch import on a loaded machine), the process
  group and the first step;
- **steps redone**: the last step trained at world size 3 minus the step the world-2 workers
  resumed from (the checkpoint), the same mechanism for both backends;
- **failed retries**: world-2 attempts that failed and cost another rendezvous (and one of
  ``--max-restarts``). A survivor's restarts for failures after the kill are the restart counts
  of its first world-2 and its last world-3 workers apart (a restart for a membership change,
  which a survivor whose worker had not failed yet may get, counts none); the job's failed
  retries are the larger survivor's count less one, the restart the kill forced.

A run whose survivors do not both train at world size 2 within ``--recover-wait-s`` is reported
as such (``>LIMIT s``), and every other wait is bounded too. The table gives, per backend and
settings, the median recovery over ``--repeats`` runs and each run's, the median steps redone,
and in each etcd-v3 row the ratio etcd-v3 / c10d of the medians (below 1: etcd-v3 recovers
faster). The etcd is a local one of the bench's own (``EmbeddedEtcd``); the runs are sequential.

Reproduce (about 3 minutes on 2 cores at ``--repeats 1``)::

    .venv/bin/python bench/torchrun_recovery.py --repeats 1 --json /tmp/torchrun_recovery.json

``--backends``/``--settings`` pick rows; ``--keep`` keeps the agents' logs and progress files.
Needs this package installed in the interpreter's environment (``pip install -e .`` registers
the ``etcd-v3`` entry point) and its ``torchrun`` beside the interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The bench imports etcd3 (through the embedded etcd); the agents are not given this.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import psutil  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peer_job import answers, free_port  # noqa: E402

from launcher.rendezvous.embedded_etcd import EmbeddedEtcd  # noqa: E402

TORCHRUN = Path(sys.executable).parent / "torchrun"
NODES = ["node0", "node1", "node2"]  # c10d: node0 is the --rdzv-endpoint node
BACKENDS = ("etcd-v3", "c10d")
SETTINGS = {  # name: (--rdzv-conf, the agents' extra environment)
    "defaults": ("", {}),
    "tuned": (
        "keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=1",
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    ),
}
# The agents run torch's own defaults for these: the caller's environment does not choose them.
AGENT_ENV_DROPPED = ("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
STORE_WAIT_S = 60.0  # c10d: node0's agent serves its rendezvous store within this
POLL_S = 0.05

# The job: STEPS all-reduces at a real step's pace; rank 0 checkpoints the step every CKPT_EVERY
# steps, and workers started again resume from it. Every worker logs its start and its steps to
# its node's progress file, with the wall-clock time.
TRAIN = """
import json, os, sys, time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

run, total, every, pause = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
node = os.environ["BENCH_NODE"]
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
rank, world = dist.get_rank(), dist.get_world_size()
info = {"agent": os.getppid(), "node": node, "rank": rank, "world": world}
(run / f"worker-{os.getpid()}").write_text(json.dumps(info))
saved = run / "ckpt"
step = torch.tensor([int(saved.read_text()) if saved.exists() else 0])
dist.broadcast(step, 0)
log = open(run / f"progress-{node}", "a", buffering=1)
restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
log.write(f"start {step.item()} {world} {time.time():.6f} {restarts}\\n")
while step.item() < total:
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == world, (x.item(), world)
    step += 1
    if rank == 0 and step.item() % every == 0:
        (run / "ckpt.tmp").write_text(str(step.item()))
        (run / "ckpt.tmp").replace(saved)
    log.write(f"step {step.item()} {world} {time.time():.6f}\\n")
    time.sleep(pause)
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Line:
    """One progress line: ``start`` or ``step``.

    For ``start``, ``step`` is the step resumed from and ``restarts`` torchrun's restart count."""

    kind: str
    step: int
    world: int
    ts: float
    restarts: int = 0


def parse_progress(text: str) -> list[Line]:
    """Parse the lines of one progress file.

    A last line without its newline (being written) is left out, and so is any line that is not a
    progress line."""
    lines = []
    for raw in text.split("\n")[:-1]:
        f = raw.split()
        if (f[:1] == ["step"] and len(f) == 4) or (f[:1] == ["start"] and len(f) == 5):
            with contextlib.suppress(ValueError):
                lines.append(Line(f[0], int(f[1]), int(f[2]), float(f[3]), *map(int, f[4:])))
    return lines


@dataclass(frozen=True)
class Survivor:
    recovery_s: float | None  # None: no step at world size 2 after the kill
    redone: int | None  # None: not recovered, or no step at world size 3 before
    restarts: int | None = None  # restarts for failures after the kill


def survivor_recovery(lines: list[Line], kill_ts: float, world: int = 2) -> Survivor:
    """One survivor's recovery after the kill at ``kill_ts``: its time, steps redone and restarts.

    The time runs from the kill to this node's first step at ``world`` after it. The steps it
    trains again are its last step at a larger world size minus the step that the incarnation of
    that first step resumed from. Its restarts for failures since are that incarnation's restart
    count minus the last larger-world incarnation's. Steps at ``world`` before the kill (a first
    round that formed before the last node joined) do not count."""
    first = next(
        (
            i
            for i, ln in enumerate(lines)
            if ln.kind == "step" and ln.world == world and ln.ts >= kill_ts
        ),
        None,
    )
    if first is None:
        return Survivor(None, None)
    starts = [ln for ln in lines[:first] if ln.kind == "start" and ln.world == world]
    before = [ln.step for ln in lines if ln.kind == "step" and ln.world > world]
    larger = [ln for ln in lines[:first] if ln.kind == "start" and ln.world > world]
    redone = max(before) - starts[-1].step if before and starts else None
    restarts = starts[-1].restarts - larger[-1].restarts if starts and larger else None
    return Survivor(lines[first].ts - kill_ts, redone, restarts)


@dataclass
class Run:
    backend: str
    settings: str
    rdzv_conf: str
    env: dict[str, str]
    victim: str | None = None
    victim_rank: int | None = None
    killed_at_step: int | None = None  # the last step at world size 3 when the kill was sent
    survivors: dict[str, Survivor] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    error: str | None = None  # why there is no recovery figure
    work: str = ""

    @property
    def recovery_s(self) -> float | None:
        """The later survivor's: the job trains at world size 2 only once both do."""
        times = [s.recovery_s for s in self.survivors.values()]
        if not times or None in times:
            return None
        return max(t for t in times if t is not None)

    @property
    def redone(self) -> int | None:
        found = [s.redone for s in self.survivors.values() if s.redone is not None]
        return max(found) if found else None

    @property
    def retries(self) -> int | None:
        """Failed world-2 attempts: the restarts beyond the one the kill forced."""
        found = [s.restarts for s in self.survivors.values() if s.restarts is not None]
        return max(0, max(found) - 1) if found else None


def workers(run: Path) -> dict[int, dict]:
    """Every worker started so far: pid -> its agent, node, rank and world size."""
    found = {}
    for path in run.glob("worker-*"):
        try:
            found[int(path.name.split("-")[1])] = json.loads(path.read_text())
        except ValueError:  # being written
            continue
    return found


def workers_of(run: Path, agent_pid: int) -> list[int]:
    return [pid for pid, w in workers(run).items() if w["agent"] == agent_pid]


def progress(run: Path, node: str) -> list[Line]:
    path = run / f"progress-{node}"
    return parse_progress(path.read_text()) if path.exists() else []


def last_step(run: Path, world: int) -> int:
    return max(
        (
            ln.step
            for n in NODES
            for ln in progress(run, n)
            if ln.kind == "step" and ln.world == world
        ),
        default=0,
    )


def choose_victim(backend: str, found: dict[int, dict]) -> tuple[str, int] | None:
    """Choose the node to kill for a backend.

    etcd-v3: the node of rank 0 at world size 3. c10d: a node at world size 3 that is not node0
    (the rendezvous store's) and never had rank 0 (the shared workers' store's); the last of
    them."""
    at3 = {w["node"]: w["rank"] for w in found.values() if w["world"] == 3}
    if backend == "etcd-v3":
        return next(((n, r) for n, r in at3.items() if r == 0), None)
    ever_rank0 = {w["node"] for w in found.values() if w["rank"] == 0}
    fit = sorted(n for n in at3 if n != NODES[0] and n not in ever_rank0)
    return (fit[-1], at3[fit[-1]]) if fit else None


def kill_node(agent: subprocess.Popen, workers: list[int], train: Path) -> None:
    """SIGKILL a node: its agent's group, the processes under the agent, its workers' sessions.

    Torchrun starts each worker in a session of its own. Only processes of this run are signalled:
    a worker pid only while it runs ``train``, the agent's group only while the agent is not reaped
    (its pid cannot have been reused)."""
    groups, under = [], []
    if agent.poll() is None:
        groups.append(agent.pid)
        with contextlib.suppress(psutil.Error):
            under = [p.pid for p in psutil.Process(agent.pid).children(recursive=True)]
    for pid in workers:
        with contextlib.suppress(psutil.Error):
            if str(train) in psutil.Process(pid).cmdline():
                groups.append(pid)
    for pid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in under:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait_for(
    done: Callable[[], bool], agents: dict[str, subprocess.Popen], timeout_s: float
) -> bool:
    """Poll until ``done()``; False once ``timeout_s`` passed or every agent exited."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or all(a.poll() is not None for a in agents.values()):
            return done()
        time.sleep(POLL_S)
    return True


def run_once(
    work: Path, train: Path, backend: str, settings: str, etcd: str, args: argparse.Namespace
) -> Run:
    conf, extra_env = SETTINGS[settings]
    result = Run(backend, settings, conf, extra_env, work=str(work))
    run = work / "run"
    run.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in AGENT_ENV_DROPPED:
        env.pop(name, None)
    env.update(extra_env)
    port = free_port()
    endpoint = etcd if backend == "etcd-v3" else f"127.0.0.1:{port}"
    argv = [
        str(TORCHRUN),
        "--nnodes=2:3",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--local-addr=127.0.0.1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id=bench-{uuid.uuid4().hex[:8]}",
        *([f"--rdzv-conf={conf}"] if conf else []),
        str(train),
        str(run),
        str(args.steps),
        str(args.ckpt_every),
        f"{args.step_s:.3f}",
    ]
    agents: dict[str, subprocess.Popen] = {}

    def start(node: str) -> None:
        with open(work / f"agent-{node}.log", "wb") as log:
            agents[node] = subprocess.Popen(
                argv,
                env={**env, "BENCH_NODE": node},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    try:
        start(NODES[0])
        # c10d: node0 hosts the store, so the others start once it serves it.
        if backend == "c10d" and not wait_for(lambda: answers(port), agents, STORE_WAIT_S):
            result.error = f"node0 served no c10d store within {STORE_WAIT_S:.0f} s"
            return result
        for node in NODES[1:]:
            start(node)
        if not wait_for(lambda: last_step(run, 3) >= args.kill_at, agents, args.start_wait_s):
            result.error = f"never trained step {args.kill_at} at world size 3"
            return result
        found = workers(run)
        chosen = choose_victim(backend, found)
        if chosen is None:
            result.error = f"no node fit to kill ({backend}): {sorted(found.values(), key=str)}"
            return result
        victim, result.victim_rank = chosen
        result.victim = victim
        pids = [pid for pid, w in found.items() if w["node"] == victim]
        result.killed_at_step = last_step(run, 3)
        kill_ts = time.time()
        kill_node(agents[victim], pids, train)
        survivors = [n for n in NODES if n != victim]
        alive = {n: agents[n] for n in survivors}

        def recovered() -> bool:
            return all(
                survivor_recovery(progress(run, n), kill_ts).recovery_s is not None
                for n in survivors
            )

        if not wait_for(recovered, alive, args.recover_wait_s):
            ended = all(a.poll() is not None for a in alive.values())
            result.error = (
                "survivors exited without training at world size 2"
                if ended
                else f"no step at world size 2 within {args.recover_wait_s:.0f} s"
            )
        result.survivors = {n: survivor_recovery(progress(run, n), kill_ts) for n in survivors}
        if result.error is not None:
            said = {n: last_error(work / f"agent-{n}.log") for n in survivors}
            result.error += "; " + "; ".join(f"{n}: {e}" for n, e in said.items() if e)
        if result.error is None:  # the survivors should finish the job
            deadline = time.monotonic() + args.finish_wait_s
            for a in alive.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    a.wait(timeout=max(0.1, deadline - time.monotonic()))
        result.exit_codes = {n: a.poll() for n, a in alive.items()}
        return result
    finally:  # every process of the run: a worker that never wrote its file too
        for a in agents.values():
            kill_node(a, workers_of(run, a.pid), train)
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(timeout=10)


def described(conf: str, env: dict[str, str]) -> str:
    return " ".join(
        [f"--rdzv-conf={conf}" if conf else "no --rdzv-conf (torch defaults)"]
        + [f"{k}={v}" for k, v in env.items()]
    )


def last_error(log: Path) -> str:
    """The last line of an agent's log that names an error (a worker's traceback's last line)."""
    if not log.exists():
        return ""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
    return lines[-1].strip()[:240] if lines else ""


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def median_recovery(times: list[float | None]) -> float | None:
    """The median recovery over every run, one that did not recover counted as longer than any.

    Of (80.5, none, 45.5) it is 80.5, not the 63.0 of the two that did; None when the median run
    itself did not recover."""
    found = median([math.inf if t is None else t for t in times])
    return None if found is None or math.isinf(found) else found


def finished(run: Run) -> bool:
    """Whether every survivor recovered and exited 0."""
    return run.error is None and bool(run.exit_codes) and set(run.exit_codes.values()) == {0}


def cell(seconds: float | None, limit_s: float) -> str:
    return f">{limit_s:.0f}" if seconds is None else f"{seconds:.1f}"


def row_summary(runs: list[Run]) -> dict:
    times = [r.recovery_s for r in runs if r.recovery_s is not None]
    redone = [float(r.redone) for r in runs if r.redone is not None]
    retries = [float(r.retries) for r in runs if r.retries is not None]
    return {
        "recovered": len(times),
        "runs": len(runs),
        "median_s": median_recovery([r.recovery_s for r in runs]),
        "each_s": [r.recovery_s for r in runs],
        "redone_median": median(redone),
        "retries_median": median(retries),
    }


def ratio(etcd: dict, c10d: dict) -> str:
    """etcd-v3 / c10d of the median recoveries; '-' unless both recovered at least once."""
    if etcd["median_s"] is None or c10d["median_s"] is None:
        return "-"
    return f"{etcd['median_s'] / c10d['median_s']:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    parser.add_argument("--steps", type=int, default=100, help="the job's steps")
    parser.add_argument("--kill-at", type=int, default=45, help="kill once this step is trained")
    parser.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--step-s", type=float, default=0.08, help="sleep per step")
    parser.add_argument(
        "--start-wait-s", type=float, default=120.0, help="limit to reach --kill-at at world 3"
    )
    parser.add_argument(
        "--recover-wait-s", type=float, default=120.0, help="limit from the kill to world 2"
    )
    parser.add_argument(
        "--finish-wait-s", type=float, default=60.0, help="limit for the survivors to finish"
    )
    parser.add_argument("--json", type=Path, help="write the runs and the table here")
    parser.add_argument("--keep", action="store_true", help="keep the logs (path printed)")
    args = parser.parse_args()
    backends = args.backends.split(",")
    settings = args.settings.split(",")
    if set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {', '.join(BACKENDS)}")
    if set(settings) - set(SETTINGS):
        parser.error(f"--settings: choose from {', '.join(SETTINGS)}")
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must be between 0 and --steps")
    if not TORCHRUN.exists():
        parser.error(f"{TORCHRUN} not found: run this with the project's venv interpreter")

    started = time.monotonic()
    runs: dict[tuple[str, str], list[Run]] = {(b, s): [] for s in settings for b in backends}
    tmp = Path(tempfile.mkdtemp(prefix="bench-torchrun-recovery-"))
    try:
        train = tmp / "train.py"
        train.write_text(TRAIN)
        with EmbeddedEtcd(tmp / "etcd", tmp / "etcd.log") as etcd:
            for i in range(args.repeats):
                for s in settings:
                    for b in backends:
                        r = run_once(tmp / f"{b}-{s}-{i}", train, b, s, etcd.endpoint, args)
                        runs[(b, s)].append(r)
                        each = ", ".join(
                            f"{n} {cell(v.recovery_s, args.recover_wait_s)} s"
                            for n, v in r.survivors.items()
                        )
                        print(
                            f"{b:8} {s:9} #{i + 1}: killed {r.victim} (rank {r.victim_rank}) "
                            f"after step {r.killed_at_step}; survivors: {each or '-'}; redone "
                            f"{r.redone}; failed retries {r.retries}; exit {r.exit_codes}"
                            + (f"; {r.error}" if r.error else ""),
                            flush=True,
                        )
    finally:
        # A run that did not recover or finish keeps its logs, whatever --keep says.
        kept = [r.work for rs in runs.values() for r in rs if not finished(r)]
        if args.keep or kept:
            print(
                f"logs kept in {tmp}"
                + (f" (runs that did not finish: {', '.join(kept)})" if kept else "")
            )
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - started

    import torch  # only for the header: the bench itself runs torch in its agents

    summaries = {k: row_summary(v) for k, v in runs.items()}
    print(
        f"\ntorchrun recovery from a SIGKILLed node: 3 nodes x 1 gloo worker on one machine "
        f"({os.cpu_count()} CPUs), torch {torch.__version__}, step {args.step_s:g} s, kill after "
        f"step {args.kill_at} of {args.steps}, checkpoint every {args.ckpt_every}; "
        f"{args.repeats} run(s) each; {wall:.0f} s in all"
    )
    print(
        "victim: etcd-v3 the node of rank 0 (hardest); c10d a node neither the store's nor rank 0"
    )
    for s in settings:
        conf, extra_env = SETTINGS[s]
        print(f"{s}: {described(conf, extra_env)}")
    print(
        f"\n{'backend':9}{'settings':10}{'recovery s (median)':>21}  {'each run':20}"
        f"{'recovered':>10}{'steps redone':>14}{'failed retries':>16}{'etcd-v3/c10d':>14}"
    )
    for s in settings:
        for b in backends:
            m = summaries[(b, s)]
            each = " ".join(cell(t, args.recover_wait_s) for t in m["each_s"])
            other = summaries.get(("c10d", s))
            r = ratio(m, other) if b == "etcd-v3" and other is not None else ""
            redone = "-" if m["redone_median"] is None else f"{m['redone_median']:g}"
            retries = "-" if m["retries_median"] is None else f"{m['retries_median']:g}"
            print(
                f"{b:9}{s:10}{cell(m['median_s'], args.recover_wait_s):>21}  {each:20}"
                f"{m['recovered']:>6}/{m['runs']:<3}{redone:>14}{retries:>16}{r:>14}"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": [Path(sys.executable).name, *sys.argv],
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    "torch": torch.__version__,
                    "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "settings": {s: described(*SETTINGS[s]) for s in settings},
                    "wall_s": wall,
                    "rows": [
                        {
                            "backend": b,
                            "settings": s,
                            **summaries[(b, s)],
                            "ratio_etcd_v3_over_c10d": (
                                ratio(summaries[(b, s)], summaries[("c10d", s)])
                                if b == "etcd-v3" and ("c10d", s) in summaries
                                else None
                            ),
                            "runs": [
                                {
                                    **asdict(r),
                                    "recovery_s": r.recovery_s,
                                    "redone": r.redone,
                                    "retries": r.retries,
                                }
                                for r in runs[(b, s)]
                            ],
                        }
                        for (b, s) in runs
                    ],
                },
                indent=2,
            )
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
