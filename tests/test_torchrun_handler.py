"""torchrun's ``--rdzv-backend=etcd-v3`` (``launcher/torchrun/backend.py``) against a real etcd.

The backend's compare-and-set (a stale token loses), the store the handler gives the agents, the
settings refused by name, etcd's absence waited out within ``etcd_grace_s`` and named past it,
and three real torchrun agents running a gloo job through an etcd restart and then the loss of a
node. torch's own contract for backends and its handler's flows are in
``tests/test_torchrun_contract.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from launcher.rendezvous.embedded_etcd import EmbeddedEtcd
from launcher.rendezvous.etcd import connect
from launcher.torchrun.backend import create_backend, create_rdzv_handler
from launcher.torchrun.liveness import keep_alive_problem

from .conftest import AnswerLost

TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 200  # at most 20 a second (a 0.05 s sleep each): an etcd outage and a node lost fit in
SHORT_OUTAGE_S = 2.0  # etcd away while one call waits for it
OUTAGE_S = 5.0  # etcd away: longer than the 3.6 s restart that ended torch's own etcd handling

# A job of STEPS all-reduces. Rank 0 keeps the step in a file, so that workers started again
# after a membership change go on from it, and logs each step with the world size.
TRAIN = """
import json, os, sys, time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

run, total = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
rank, world = dist.get_rank(), dist.get_world_size()
info = {"agent": os.getppid(), "rank": rank, "world": world}
(run / f"worker-{os.getpid()}").write_text(json.dumps(info))
saved = run / "step"
step = torch.tensor([int(saved.read_text()) if saved.exists() else 0])
dist.broadcast(step, 0)
while step.item() < total:
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == world, (x.item(), world)
    step += 1
    if rank == 0:
        (run / "step.tmp").write_text(str(step.item()))
        (run / "step.tmp").replace(saved)
        with open(run / "progress", "a") as f:
            f.write(f"{step.item()} {world}\\n")
    time.sleep(0.05)
dist.destroy_process_group()
"""

# Loaded by every agent and worker (PYTHONPATH): SIGUSR1 prints every thread's stack to the log,
# so that a job that does not finish says where each process waits.
# What each agent's log keeps for a failure to be explained: every thread's stack on SIGUSR1,
# torch's INFO lines (LOGLEVEL: each rendezvous's rank and world size, the exit barrier) and each
# etcd-v3 store call's result (DEBUG). The exit barrier once hung 1 in 50 runs (issue 47).
DIAGNOSTICS = """
import faulthandler, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)
import logging
_h = logging.StreamHandler()
_h.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s: %(message)s"))
logging.getLogger("launcher.torchrun").addHandler(_h)
logging.getLogger("launcher.torchrun").setLevel(logging.DEBUG)
"""

# Fast re-forming: a node whose heartbeat (every second) is 4 s old is dead, the shortest bound
# the backend allows (keep_alive_problem); a round with the minimum of nodes waits 1 s for more.
RDZV_CONF = (
    "join_timeout=40,last_call_timeout=1,close_timeout=5,heartbeat_timeout=5,"
    "keep_alive_interval=1,keep_alive_max_attempt=4,read_timeout=30,etcd_timeout=5"
)


def params(endpoint: str, run_id: str, **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf)


def test_a_stale_token_loses_and_the_winner_is_returned(etcd_endpoint: str, job_id: str) -> None:
    backend, _ = create_backend(params(etcd_endpoint, job_id))
    assert backend.name == "etcd-v3" and backend.key == f"/torchrun/{job_id}/state"
    assert backend.get_state() is None

    state, token, written = backend.set_state(b"first")
    assert (state, written) == (b"first", True)
    # Without a token, the state is created only if absent.
    assert backend.set_state(b"other") == (b"first", token, False)

    state, newer, written = backend.set_state(b"second", token)
    assert (state, written) == (b"second", True) and newer > token
    # The token of before that write is stale: the write loses, the current state comes back.
    assert backend.set_state(b"third", token) == (b"second", newer, False)
    assert backend.set_state(b"third", "not-a-revision") == (b"second", newer, False)
    assert backend.get_state() == (b"second", newer)

    # Two backends racing with the same token: exactly one wins.
    rival, _ = create_backend(params(etcd_endpoint, job_id))
    results = [backend.set_state(b"mine", newer), rival.set_state(b"theirs", newer)]
    assert [r[2] for r in results] == [True, False]
    assert results[1][:2] == (b"mine", results[0][1])
    # etcd's client URL serves as well as host:port (docs/bare-metal.md: the endpoint forms).
    via_url, _ = create_backend(params(f"http://{etcd_endpoint}", job_id))
    assert via_url.get_state() == (b"mine", results[0][1])


def test_the_store_waits_for_keys_and_a_new_rendezvous_clears_it(
    etcd_endpoint: str, job_id: str
) -> None:
    backend, store = create_backend(params(etcd_endpoint, job_id, read_timeout=10))
    store.set("leftover", b"from an earlier run of this id")
    backend.set_state(b"state")  # creating the state clears the store
    assert not store.check(["leftover"])

    prefixed = dist.PrefixStore("round.0", store)  # as DynamicRendezvousHandler wraps it
    assert prefixed.add("n", 2) == 2 and prefixed.add("n", 3) == 5
    prefixed.multi_set(["a", "b"], ["1", "2"])
    assert prefixed.multi_get(["a", "b"]) == [b"1", b"2"]
    assert prefixed.compare_set("a", "1", "9") == b"9"
    assert prefixed.compare_set("a", "1", "7") == b"9"

    late = threading.Timer(0.2, lambda: prefixed.set("late", "here"))
    late.start()
    assert prefixed.get("late") == b"here"  # woken by the write (watch), not by a timeout
    late.join()
    with pytest.raises(dist.DistStoreError, match="read_timeout"):
        prefixed.wait(["never"], timedelta(seconds=0.3))


def test_an_add_whose_answer_is_lost_counts_once(etcd_endpoint: str, job_id: str) -> None:
    """torch's exit barrier writes its last key when an add returns the world size: an add
    counted twice (its write committed, its answer lost, the retry adding again) would leave
    every agent waiting out the barrier's 300 s."""
    backend, store = create_backend(params(etcd_endpoint, job_id))
    backend.set_state(b"state")
    lossy = AnswerLost(store._client)
    store._client = lossy
    lossy.lose = 1
    assert store.add("num_members", 1) == 1  # committed, answer lost, retried
    assert store.add("num_members", 1) == 2
    lossy.lose = 1
    assert store.add("num_members", 3) == 5
    assert store.get("num_members") == b"5"


@pytest.mark.parametrize(
    ("conf", "endpoint", "message"),
    [
        ({"state_ttl": "5"}, None, "state_ttl=5"),
        ({"etcd_timeout": "soon"}, None, "etcd_timeout='soon'"),
        ({"key_prefix": "/"}, None, "key_prefix is empty"),
        ({"etcd_grace_s": "0"}, None, "etcd_grace_s='0' is not a positive number"),
        ({}, "", "--rdzv-endpoint is empty"),
        ({}, "grpc://127.0.0.1:2379", "grpc:// is not etcd's"),
        ({}, "https://127.0.0.1:2379", "asks for TLS, and --rdzv-conf ca is not set"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(
    etcd_endpoint: str, conf: dict, endpoint: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        create_backend(params(etcd_endpoint if endpoint is None else endpoint, "job", **conf))


@pytest.mark.parametrize(
    ("interval", "attempts", "fix"),
    [(1, 2, 4), (1, 3, 4), (2, 2, 3), (5, 2, 3), (1, 4, None), (2, 3, None), (5, 3, None)],
)
def test_a_dead_node_bound_inside_a_live_nodes_heartbeat_gap_is_refused_before_connecting(
    interval: int, attempts: int, fix: int | None
) -> None:
    """torch's defaults (5 s, 3) pass; 1 s and 2 split a round's world in one run of 12 here."""
    conf = {"keep_alive_interval": str(interval), "keep_alive_max_attempt": str(attempts)}
    if fix is None:
        assert keep_alive_problem(interval, attempts) is None
        return
    with pytest.raises(ValueError, match=f"keep_alive_max_attempt={fix} or more"):
        create_rdzv_handler(params("127.0.0.1:1", "job", **conf))  # no etcd there: not reached


def wait_until(what: str, done: Callable[[], bool], agents: list, logs: Path, timeout_s: float):
    """Poll the files the workers write until ``done``; fail with the agents' logs."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or all(a.poll() is not None for a in agents):
            tails = "\n".join(p.read_text()[-3000:] for p in sorted(logs.glob("agent*.log")))
            pytest.fail(f"not {what} within {timeout_s} s ({[a.poll() for a in agents]})\n{tails}")
        time.sleep(0.05)


def progress(run: Path) -> list[tuple[int, int]]:
    """(step, world size) of every step rank 0 logged."""
    if not (run / "progress").exists():
        return []
    fields = (line.split() for line in (run / "progress").read_text().split("\n"))
    return [(int(f[0]), int(f[1])) for f in fields if len(f) == 2]  # a torn last line: not yet


def workers(run: Path) -> dict[int, dict]:
    """Every worker started so far: pid -> its agent, rank and world size."""
    found = {}
    for path in run.glob("worker-*"):
        try:
            found[int(path.name.split("-")[1])] = json.loads(path.read_text())
        except ValueError:  # being written
            continue
    return found


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def start_agents(tmp_path: Path, endpoint: str, job_id: str, nodes: int, steps: int) -> list:
    """``nodes`` torchrun agents (``--nnodes=2:nodes``) of one job over etcd-v3, each in its own
    process group as a node; the workers write into ``tmp_path/run``."""
    registered = {e.name for e in entry_points(group="torchrun.handlers")}
    assert "etcd-v3" in registered, "entry point missing: pip install -e . (pyproject.toml)"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "diag").mkdir()
    (tmp_path / "diag" / "sitecustomize.py").write_text(DIAGNOSTICS)
    path = os.pathsep.join(filter(None, [str(tmp_path / "diag"), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": path,
        "LOGLEVEL": "INFO",
    }
    env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)  # the agent needs none set
    agents = []
    for i in range(nodes):
        log = open(tmp_path / f"agent{i}.log", "w")  # noqa: SIM115 - closed with the agent
        command = [
            str(TORCHRUN),
            f"--nnodes=2:{nodes}",
            "--nproc-per-node=1",
            "--max-restarts=3",
            "--local-addr=127.0.0.1",
            "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job_id}",
            f"--rdzv-conf={RDZV_CONF}",
            str(script),
            str(run),
            str(steps),
        ]
        # Its own process group, as a node; torchrun starts each worker in a session of its own.
        agents.append(
            subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()
    return agents


def agent_logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("agent*.log")))


def stacks(agents: list, tmp_path: Path) -> str:
    """Every live agent's and worker's Python stacks (SIGUSR1, DIAGNOSTICS), with the tails of
    the logs they go to: what a job that did not finish was waiting on."""
    live = [a for a in agents if a.poll() is None]
    for agent in live:
        for proc in [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(True)]:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGUSR1)
    logs = [tmp_path / f"agent{agents.index(a)}.log" for a in live]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(
        "most recent call first" in p.read_text() for p in logs
    ):
        time.sleep(0.1)
    return "\n".join(f"== {p.name}\n{p.read_text()[-8000:]}" for p in logs)


@pytest.mark.timeout(180)
def test_torchrun_agents_ride_out_an_etcd_restart_then_lose_a_node_and_finish(
    tmp_path: Path,
) -> None:
    """One 3-node job over etcd-v3, two faults in turn.

    - etcd killed for OUTAGE_S (torch's own etcd handling ended every agent after a 3.6 s
      restart): training goes on meanwhile, no worker is restarted, and nothing fails.
    - The node of rank 0 killed (its agent and its worker, as a machine failure kills both),
      whose worker hosts the round's TCPStore, the hardest loss: torch's own
      DynamicRendezvousHandler re-forms the round over etcd v3 with the other two, which finish.
    """
    with EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log") as etcd:
        agents = start_agents(tmp_path, etcd.endpoint, "two-faults", nodes=3, steps=STEPS)
        run = tmp_path / "run"
        started = time.monotonic()
        try:
            wait_until(
                "training with all 3 nodes",
                lambda: any(w == 3 and s >= 5 for s, w in progress(run)),
                agents,
                tmp_path,
                60,
            )
            etcd.stop_member(0, kill=True)
            down_at = progress(run)[-1][0]
            time.sleep(OUTAGE_S)  # the fault's length, not a wait for an event
            up_at = progress(run)[-1][0]
            etcd.start_member(0)
            assert up_at > down_at, agent_logs(tmp_path)[-6000:]  # trained while etcd was away
            wait_until(
                "training on after etcd came back",
                lambda: progress(run)[-1][0] >= up_at + 10,
                agents,
                tmp_path,
                30,
            )
            assert {w["world"] for w in workers(run).values()} == {3}  # nothing restarted
            assert len(workers(run)) == 3

            victim = next(
                w["agent"] for w in workers(run).values() if (w["world"], w["rank"]) == (3, 0)
            )
            killed_at = progress(run)[-1][0]
            for pid in [victim] + [p for p, w in workers(run).items() if w["agent"] == victim]:
                kill_group(pid)
            survivors = [a for a in agents if a.pid != victim]
            deadline = time.monotonic() + 60
            for agent in survivors:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=max(1.0, deadline - time.monotonic()))
            if not all(a.poll() is not None for a in survivors):
                pytest.fail(
                    f"not done in 60 s; steps {progress(run)[-3:]}, workers {workers(run)}; the "
                    f"survivors' stacks:\n{stacks(agents, tmp_path)}"
                )
            logs = agent_logs(tmp_path)[-6000:]
            assert [a.returncode for a in survivors] == [0, 0], logs
            steps = progress(run)
            assert steps[-1] == (STEPS, 2), logs
            assert killed_at < STEPS  # the node died mid-run
            assert any(w == 2 for s, w in steps if s > killed_at)
            # The rendezvous went through etcd v3, under the documented key.
            assert connect([etcd.endpoint]).get("/torchrun/two-faults/state")[0] is not None
            print(
                f"job done in {time.monotonic() - started:.1f} s; trained steps {down_at}-{up_at}"
                f" while etcd was away; node lost at step {killed_at}"
            )
        finally:
            for pid in [a.pid for a in agents] + list(workers(run)):
                kill_group(pid)
            for agent in agents:
                agent.wait(timeout=10)


def test_etcd_away_within_the_grace_is_waited_out_and_longer_is_named(tmp_path: Path) -> None:
    """Every call waits for etcd within ``etcd_grace_s``; past it, the error says how long it
    waited and which setting bounds it, in torchrun's words (the first connection too)."""
    with EmbeddedEtcd(tmp_path / "etcd", tmp_path / "etcd.log") as etcd:
        backend, store = create_backend(params(etcd.endpoint, "grace", etcd_grace_s=30))
        backend.set_state(b"before")
        read: dict[str, Any] = {}

        def reader() -> None:
            began = time.monotonic()
            read["found"] = backend.get_state()
            read["waited"] = time.monotonic() - began

        etcd.stop_member(0, kill=True)
        waiting = threading.Thread(target=reader)
        waiting.start()
        time.sleep(SHORT_OUTAGE_S)  # the fault's length; started again from this thread, its parent
        etcd.start_member(0)
        waiting.join(timeout=30)
        assert read["found"] is not None and read["found"][0] == b"before"
        assert (
            read["waited"] >= SHORT_OUTAGE_S - 0.5
        )  # it waited for etcd, which was away that long
        store.set("k", "v")
        assert store.get("k") == b"v"

        short, short_store = create_backend(params(etcd.endpoint, "grace", etcd_grace_s=1))
        etcd.stop_member(0, kill=True)
        began = time.monotonic()
        with pytest.raises(
            RendezvousConnectionError,
            match=r"did not answer a read of the state for 1\.\d s .*Fix: bring etcd back "
            r"\(--rdzv-endpoint\).*raise --rdzv-conf etcd_grace_s \(now 1\)",
        ):
            short.get_state()
        assert time.monotonic() - began < 10
        with pytest.raises(dist.DistNetworkError, match="store key 'k' for 1\\.\\d s"):
            short_store.set("k", "v")
        with pytest.raises(
            RendezvousConnectionError,
            match=r"no etcd endpoint answered .*Fix: check --rdzv-endpoint and that etcd is "
            r"running \(tried for 1\.\d s, --rdzv-conf etcd_grace_s=1\)",
        ):
            create_backend(params(etcd.endpoint, "grace", etcd_grace_s=1))
