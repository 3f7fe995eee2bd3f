"""Simulated nodes as NCCL sees them: each a host of its own when they share a GPU."""

from __future__ import annotations

from elastic.config import ClusterConfig, CommBackend, CommConfig, Config, Device
from launcher.local_cluster import nccl_host_environ


def config(nodes: int, device: Device, backend: CommBackend = CommBackend.auto) -> Config:
    return Config(
        job_id="job",
        cluster=ClusterConfig(nodes=nodes, device=device),
        comm=CommConfig(backend=backend),
    )


def test_each_node_on_nccl_is_a_host_of_its_own_over_loopback() -> None:
    cfg = config(3, Device.cuda)
    first, second = (nccl_host_environ(cfg, n, {}) for n in ("node0", "node1"))
    assert first["NCCL_HOSTID"] == "job-node0" and second["NCCL_HOSTID"] == "job-node1"
    assert first["NCCL_SOCKET_IFNAME"] == "lo" and first["NCCL_IB_DISABLE"] == "1"


def test_what_the_environment_sets_is_kept() -> None:
    got = nccl_host_environ(config(3, Device.cuda), "node0", {"NCCL_SOCKET_IFNAME": "eth0"})
    assert "NCCL_SOCKET_IFNAME" not in got and got["NCCL_HOSTID"] == "job-node0"


def test_nothing_without_nccl_or_without_peers() -> None:
    assert nccl_host_environ(config(3, Device.cpu), "node0", {}) == {}
    assert nccl_host_environ(config(3, Device.auto), "node0", {}) == {}
    assert nccl_host_environ(config(3, Device.cuda, CommBackend.gloo), "node0", {}) == {}
    assert nccl_host_environ(config(1, Device.cuda), "node0", {}) == {}
