"""A small network of Linux network namespaces, one per simulated node, for partition faults.

Each node ``i`` gets a namespace with two links, so that either can be cut alone:

- ``peer``: a veth on a bridge shared by all nodes (``10.77.1.<i+1>``), which carries the
  rounds' traffic (the c10d store, gloo);
- ``etcd``: a veth to this machine's own namespace (``10.78.<i>.2``, the machine at
  ``10.78.<i>.1``), where etcd listens on every address.

The namespace's host name resolves to its peer address (``/etc/netns/<name>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts``), so gloo binds the peer link. It needs root and
``ip``; :func:`available` says whether this host allows it, and why not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

PREFIX = "elns"  # namespaces elns0.., host-side links elnsp0.. and elnse0.., bridge elnsbr
BRIDGE = f"{PREFIX}br"
PEER_LINK = "peer"
ETCD_LINK = "etcd"
NETNS_ETC = Path("/etc/netns")
TBF_BURST = "256kb"  # what the bucket lets through at once: a few dozen packets
TBF_LATENCY = "2s"  # the longest a packet may queue behind the bucket before it is dropped


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def available() -> str:
    """Empty if namespaces can be made here; else why not (for a test's skip line)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool} command (iproute2)"
    # A name of this process's own: two processes probing at once (a campaign and a test module,
    # two at a time in CI) shared one, and the second's add failed with "File exists".
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return ""


class LocalNetwork:
    """``nodes`` namespaces wired as the module docstring says; a context manager."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def ns(self, i: int) -> str:
        return f"{PREFIX}{i}"

    def peer_address(self, i: int) -> str:
        return f"10.77.1.{i + 1}"

    def etcd_address(self, i: int) -> str:
        """This machine's address as node ``i`` reaches it (where etcd answers it)."""
        return f"10.78.{i}.1"

    def __enter__(self) -> LocalNetwork:
        self.close()  # what a killed earlier run left
        steps = [("link", "add", BRIDGE, "type", "bridge"), ("link", "set", BRIDGE, "up")]
        for args in steps:
            self._must(args)
        for i in range(self.nodes):
            ns = self.ns(i)
            self._must(("netns", "add", ns))
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            hosts = f"127.0.0.1 localhost\n{self.peer_address(i)} {socket.gethostname()}\n"
            (NETNS_ETC / ns / "hosts").write_text(hosts)
            self._must(("link", "set", "lo", "up"), ns)
            for link, side, address, host_address in (
                (PEER_LINK, f"{PREFIX}p{i}", f"{self.peer_address(i)}/24", None),
                (ETCD_LINK, f"{PREFIX}e{i}", f"10.78.{i}.2/24", f"{self.etcd_address(i)}/24"),
            ):
                self._must(("link", "add", side, "type", "veth", "peer", "name", link, "netns", ns))
                if host_address is None:
                    self._must(("link", "set", side, "master", BRIDGE))
                else:
                    self._must(("addr", "add", host_address, "dev", side))
                self._must(("link", "set", side, "up"))
                self._must(("addr", "add", address, "dev", link), ns)
                self._must(("link", "set", link, "up"), ns)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace, link and hosts file of this network (idempotent)."""
        for i in range(self.nodes):
            _ip("netns", "del", self.ns(i))  # takes its ends of the veths with it
            shutil.rmtree(NETNS_ETC / self.ns(i), ignore_errors=True)
        _ip("link", "del", BRIDGE)

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def launcher(self, i: int, etcd_port: int | Sequence[int], *overrides: str) -> list[str]:
        """The command that runs node ``i``'s bare-metal launcher in its namespace.

        It runs as on a machine of its own: it binds its peer address and reaches etcd over its etcd
        link. Etcd listens on every address of this machine, port ``etcd_port``, or each of several
        members' ports."""
        ports = [etcd_port] if isinstance(etcd_port, int) else list(etcd_port)
        endpoints = ",".join(f"{self.etcd_address(i)}:{port}" for port in ports)
        return self.command(
            i,
            [
                sys.executable,
                "-m",
                "launcher",
                "cluster=bare_metal",
                f"cluster.nodes={self.nodes}",
                f"cluster.node_id=node{i}",
                f"cluster.host={self.peer_address(i)}",
                f"cluster.etcd_endpoints=[{endpoints}]",
                "cluster.threads_per_worker=1",  # the "machines" share this one's cores
                *overrides,
            ],
        )

    def set_link(self, i: int, link: str, up: bool) -> None:
        """Bring node ``i``'s ``link`` (:data:`PEER_LINK` or :data:`ETCD_LINK`) down or up."""
        self._must(("link", "set", link, "up" if up else "down"), self.ns(i))

    def set_rate(self, i: int, link: str, rate_mbit: float | None) -> None:
        """Limit what node ``i`` sends on ``link`` to ``rate_mbit``, or lift the limit (None).

        The limit is a token bucket (tbf). Packets queue behind the bucket, so every transfer slows,
        and past ``TBF_LATENCY`` of queue they are dropped: a slow, and under load lossy, link.
        (``tc netem`` would add delay and loss directly, but many kernels lack ``sch_netem``.)"""
        tc = ["ip", "netns", "exec", self.ns(i), "tc", "qdisc"]
        if rate_mbit is None:
            subprocess.run([*tc, "del", "dev", link, "root"], capture_output=True)  # none: fine
            return
        shape = ["rate", f"{rate_mbit}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY]
        done = subprocess.run(
            [*tc, "replace", "dev", link, "root", "tbf", *shape], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"tc qdisc replace ... tbf (in {self.ns(i)}): {done.stderr}")

    def _must(self, args: tuple[str, ...], ns: str | None = None) -> None:
        done = _ip(*args, ns=ns)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} (in {ns or 'the host'}): {done.stderr}")
