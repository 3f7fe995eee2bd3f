"""Shared fixtures: a real etcd server, real launcher processes, the run's event log."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# This process talks to etcd, whose client (etcd3 0.12) needs protobuf's pure-Python parser, and
# protobuf takes its implementation once, at its first import: a test that imports tensorboard
# (which imports protobuf) before any etcd client would leave etcd3 unable to load.
os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"

from elastic.config import RendezvousConfig  # noqa: E402
from elastic.events import EventFollower
from launcher.rendezvous.embedded_etcd import EmbeddedEtcd
from launcher.rendezvous.etcd import connect
from launcher.rendezvous.membership import NodeRecord
from launcher.rendezvous.rendezvous import Rendezvous

REPO = Path(__file__).resolve().parent.parent
# How long a child process may take to start: importing torch took up to 2 minutes on cores
# loaded far past CI's (docs/benchmarks.md, "Flake hunt"). A test's own bounds start once its
# children said they started (:func:`ranks_started`), so they never count this.
START_S = 300.0


def load_bench(name: str) -> ModuleType:
    """A script of bench/ as a module (bench/ is not a package), loaded once."""
    if (module := sys.modules.get(f"bench_{name}")) is not None:
        return module
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / f"bench/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


# A job small enough for two CPU cores: 240 JPEGs, 8 per worker per step, 32-pixel crops, and
# torchvision's ShuffleNet V2 x0.5 (1.4 M parameters, batch norms) instead of the main job's
# ResNet-18 (11.2 M): what the runtime does is the same for any model, and the smaller one
# halves a step's and a save's CPU. The killed-node e2e test took 95 CPU-s with ResNet-18 and
# 59 with it (tests take 2 cores whatever their number of processes: CI's time is their CPU's).
FAST_JOB = [
    "data.generate.images_per_class=24",
    "data.generate.val_images_per_class=4",  # 40 held out: an evaluation a test waits little for
    "data.batch_size=8",
    "model.name=shufflenet_v2_x0_5",
    "checkpoint.every_steps=5",
    "rendezvous.lease_ttl_s=2",
    "rendezvous.settle_s=0.5",
    "rendezvous.first_round_wait_s=60",
]
# The main job's ResNet-18, for tests whose faults are timed against its steps (appended after
# FAST_JOB: the last override wins). With ShuffleNet a step took too little: the soak's node,
# killed every 50 survivor steps, was killed again before it was back from its first restart;
# a 300 Mbit/s link no longer made a slow node's steps slower than twice the others'.
RESNET18 = "model.name=resnet18"


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(path / "data", path / "etcd.log") as etcd:
        yield etcd.endpoint


@pytest.fixture
def etcd_client(etcd_endpoint: str):  # type: ignore[no-untyped-def]
    # Left open: closing the channel of a client that watched (chaos.requests waits for an
    # answer on a watch) kills etcd3's watch thread with a traceback, as in the agent.
    return connect([etcd_endpoint])


@pytest.fixture
def job_id() -> str:
    return "test-" + uuid.uuid4().hex[:8]


# Rendezvous timings for tests that drive Rendezvous objects directly.
FAST = RendezvousConfig(lease_ttl_s=2, settle_s=0.3, first_round_wait_s=0.3)


@pytest.fixture
def make(etcd_endpoint: str, job_id: str):  # type: ignore[no-untyped-def]
    """Join nodes of one job; every node still joined is made to leave at the end."""
    joined: list[Rendezvous] = []

    def _make(
        name: str,
        *,
        min_nodes: int = 1,
        max_nodes: int = 3,
        slots: int = 1,
        cfg: RendezvousConfig = FAST,
    ) -> Rendezvous:
        r = Rendezvous(
            connect([etcd_endpoint]),
            job_id=job_id,
            node=NodeRecord(name, "127.0.0.1", 1000 + len(joined), slots),
            cfg=cfg,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
        )
        r.join()
        r.record.set_ready()
        joined.append(r)
        return r

    yield _make
    for r in joined:
        r.leave()


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Generated data sets live in one folder per test session, not in the user's cache."""
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("ELASTIC_CACHE")
    os.environ["ELASTIC_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["ELASTIC_CACHE"]
    else:
        os.environ["ELASTIC_CACHE"] = old


class _Hook(http.server.BaseHTTPRequestHandler):
    received: queue.Queue[tuple[str, dict[str, Any]]]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.put((self.path, json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, queue.Queue[tuple[str, dict[str, Any]]]]]:
    """A webhook on 127.0.0.1 (notify.webhook): its URL, and the path and JSON of each POST it
    received, put before it answers."""
    received: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Hook", (_Hook,), {"received": received})
    )
    thread = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/T0", received
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@contextlib.contextmanager
def served_store() -> Iterator[int]:
    """The port of a TCPStore that this process serves while in the block, for ranks spawned in
    it to join as clients (``is_master=False``). The port is the one the OS gave the store as
    it bound it. A port picked first (``free_port``) and bound by a spawned rank seconds later
    is free meanwhile, for any other socket bound to an OS-chosen port to take."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def rank_started(store: Any, rank: int) -> None:
    """Say, in the test's :func:`served_store`, that this spawned rank has started."""
    store.set(f"started/{rank}", "1")


def ranks_started(port: int, ranks: int) -> None:
    """Wait until ranks ``0..ranks-1`` said they started (:func:`rank_started`), up to
    :data:`START_S`: the test's own bounds begin here, past the ranks' import of torch."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=START_S))
    store.wait([f"started/{r}" for r in range(ranks)])


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mb: int, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` at ``path`` (read-only with ``read_only``); the test is skipped
    where it cannot be mounted."""
    path.mkdir(parents=True)
    options = f"{'ro,' if read_only else ''}size={size_mb}m"
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def with_limit(argv: list[str], which: str, soft: int, hard: int) -> list[str]:
    """``argv`` run with a lowered resource limit (``which``: a ``resource.RLIMIT_*`` name).

    The limit is set by a small interpreter that then execs ``argv``, not by ``preexec_fn``:
    this test process holds gRPC threads (the etcd clients), and Python code between fork and
    exec trips gRPC's fork handlers (the child can abort in its epoll poller).
    """
    setter = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.{which}, ({soft}, {hard})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", setter, *argv]


def launch(
    run_dir: Path, *overrides: str, job_id: str = "job", env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``python -m launcher`` with the fast job settings, ``env`` added to ours; output
    goes to run_dir.out."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = open(run_dir.with_suffix(".out"), "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            f"job_id={job_id}",
            f"run_dir={run_dir}",
            *FAST_JOB,
            *overrides,
        ],
        cwd=run_dir.parent,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def output(run_dir: Path) -> str:
    """What :func:`launch` printed (bare-metal nodes, started otherwise, print elsewhere)."""
    path = run_dir.with_suffix(".out")
    return path.read_text() if path.exists() else f"({path} was not written)"


PATCH_HOOKS = Path(__file__).parent / "patch_on_import"
OPEN_ON_S = 600.0


@dataclass
class Gate:
    """What keeps a test's job from ending before the test has seen what it waits for
    (``$ELASTIC_TEST_GATE``, read by tests/patch_on_import before every step).

    A job of a fixed number of epochs races any fault's consequence that takes wall time (a
    node coming back after its quarantine): on a fast machine the job may end first. Held at
    its last steps until the test has seen the consequence, the job outlasts it on any machine,
    with no more epochs than the checks need.
    """

    path: Path

    def env(self) -> dict[str, str]:
        """What a launcher needs in its environment for its workers to obey the gate."""
        return {"PYTHONPATH": str(PATCH_HOOKS), "ELASTIC_TEST_GATE": str(self.path)}

    def hold_end(self, steps: int) -> None:
        """Hold the job before each of its last ``steps`` steps (at the world size then)."""
        self._write(f"end {steps}")

    def hold_after(self, step: int) -> None:
        """Hold the job before every step after ``step`` (0: before its next one)."""
        self._write(str(step))

    def open(self) -> None:
        self._write("open")

    def open_on(self, run_dir: Path, predicate: Callable[[dict[str, Any]], bool]) -> None:
        """Open the gate, from a thread of its own, at the first event of ``run_dir`` matching
        ``predicate`` (or after :data:`OPEN_ON_S`, when the test has failed): for a job that
        the test waits on whole, a campaign's or a soak's."""

        def watch() -> None:
            with contextlib.suppress(TimeoutError):
                EventFollower(run_dir).wait_for(predicate, timeout_s=OPEN_ON_S)
            self.open()

        threading.Thread(target=watch, name="gate", daemon=True).start()

    def _write(self, text: str) -> None:
        new = self.path.with_suffix(".new")
        new.write_text(text + "\n")
        os.replace(new, self.path)  # a rank reads the old word or the new one, never half


def back_after_restart(n: int) -> Callable[[dict[str, Any]], bool]:
    """A predicate for :meth:`Gate.open_on`: the node that a campaign (or a test) started again
    for the ``n``-th time (its ``fault_cleared`` of kind ``restart``) is back in a round."""
    restarted: list[str] = []

    def back(e: dict[str, Any]) -> bool:
        if e["event"] == "fault_cleared" and e.get("kind") == "restart":
            restarted.append(e["target"])
        joined = e["event"] == "round_joined"
        return joined and len(restarted) >= n and e["node"] == restarted[n - 1]

    return back


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    """A :class:`Gate` for one test's job, open until the test closes it, and opened again at
    the end: a failed test leaves nothing held."""
    held = Gate(tmp_path / "gate")
    held.open()
    yield held
    held.open()


class AnswerLost:
    """A real etcd client whose next transaction commits and then loses its answer.

    That is what a connection dropped between etcd's commit and its reply does; the call raises
    the client's connection error, as it would, and is retried."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.lose = 0  # the transactions still to lose the answer of

    def transaction(self, **kwargs: Any) -> Any:
        result = self._client.transaction(**kwargs)
        if self.lose:
            from etcd3.exceptions import ConnectionFailedError

            self.lose -= 1
            raise ConnectionFailedError("the answer was lost (injected)")
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
