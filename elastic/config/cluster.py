"""The ``cluster`` and ``rendezvous`` sections: where the nodes come from, and how they meet.

Simulated nodes on this machine or one agent per bare-metal node; the etcd they meet in (the
embedded one, or an external cluster with TLS and a user) and the waits of their rounds. The
rules on the etcd credentials are the launcher's (:mod:`launcher.rendezvous.credentials`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.config.schema import SECONDS, Choice, bounded


class ClusterMode(Choice):
    local = "local"  # simulated nodes on this machine
    bare_metal = "bare_metal"  # one agent per machine, an external etcd


class Device(Choice):
    auto = "auto"  # CUDA when a GPU is visible, else the CPU
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class EtcdTlsConfig:
    """TLS to an external etcd (``cluster.etcd_endpoints``); the embedded etcd is plaintext.

    ``ca`` alone: the servers are verified, the client shows no certificate. ``cert`` and ``key``
    as well: the client shows its certificate (etcd ``--client-cert-auth``). Paths to PEM files.
    """

    ca: str = ""  # the CA that signed the etcd members' certificates; "" = plaintext
    cert: str = ""  # this node's client certificate (with key)
    key: str = ""  # its private key
    # The name every member's certificate must carry (a SAN): gRPC checks one name for all the
    # members of a channel. "" = the host of the first cluster.etcd_endpoints entry.
    server_name: str = ""


@dataclass
class ClusterConfig:
    """Where the nodes come from: simulated on this machine, or one agent per bare-metal node."""

    mode: ClusterMode = ClusterMode.local
    # local: nodes to start; bare_metal: the usual size (max_nodes defaults to it).
    nodes: int = bounded(
        2, ge=1, why="a job needs at least one node", fix="set cluster.nodes to 1 or more"
    )
    min_nodes: int = bounded(1, ge=1, fix="set cluster.min_nodes=1 or more")
    # 0: the same as nodes.
    max_nodes: int = bounded(
        0, ge=0, fix="set cluster.max_nodes=0 (same as cluster.nodes) or a positive count"
    )
    node_id: str = ""  # bare_metal: defaults to the host name
    host: str = ""  # address peers reach this node at; "" = 127.0.0.1 (local) or the FQDN
    device: Device = Device.auto
    # 0: one per visible GPU, or cpu_workers on CPU.
    workers_per_node: int = bounded(0, ge=0, fix="use 0 (one per GPU) or a positive count")
    cpu_workers: int = bounded(1, ge=1, fix="set cluster.cpu_workers=1 or more")
    # 0: this machine's cores shared among its workers.
    threads_per_worker: int = bounded(
        0, ge=0, fix="use 0 (share this machine's cores) or a positive count"
    )
    etcd_endpoints: list[str] = field(default_factory=list)  # empty (local): embedded etcd
    etcd_tls: EtcdTlsConfig = field(default_factory=EtcdTlsConfig)
    # etcd user authentication: the user, and a file holding its password (else the password is
    # read from the ELASTIC_ETCD_PASSWORD environment variable; never from the command line).
    etcd_user: str = ""
    etcd_password_file: str = ""
    # local, no etcd_endpoints: members of the embedded etcd; 3 survive the loss of one member.
    embedded_etcd_members: int = bounded(
        1, ge=1, le=3, fix="set cluster.embedded_etcd_members=1 or 3"
    )
    # The launcher, agents, embedded etcd and the workers' helper threads (curves, saves, the
    # agent link) run SCHED_BATCH: waking, they never take a training loop's core (Linux;
    # elastic/sched_policy.py). false: everything at the default policy.
    yield_to_training: bool = True
    # Worker crashes a node survives before it leaves the job.
    max_restarts: int = bounded(10, ge=0, fix="set cluster.max_restarts=0 or more")


@dataclass
class RendezvousConfig:
    """Membership in etcd: leases, round formation, and how long each wait may take."""

    prefix: str = "/elastic"
    lease_ttl_s: int = bounded(
        3,
        ge=2,
        why="etcd does not keep leases shorter than 2 s",
        fix="set rendezvous.lease_ttl_s=2 or more",
    )
    settle_s: float = bounded(1.0, ge=0, fix=SECONDS)
    # The first round of a job waits up to this long for max_nodes, so that nodes that start a
    # few seconds apart do not cause a restart right after the job began.
    first_round_wait_s: float = bounded(30.0, ge=0, fix=SECONDS)
    join_timeout_s: float = bounded(600.0, gt=0, fix=SECONDS)
    pg_timeout_s: float = bounded(120.0, gt=0, fix=SECONDS)
    resync_s: float = bounded(30.0, gt=0, fix=SECONDS)
    # A worker whose heartbeat stops, or that computes one step this long without handing its
    # gradients to the network, is taken for frozen (SIGSTOP, a hung GPU) and its node evicted.
    watchdog_s: float = bounded(10.0, gt=0, fix=SECONDS)
    # After a failed collective, a peer agent that refuses a TCP connection within this long is
    # dead (its machine is up but the node's processes are gone) and is dropped at once,
    # without waiting for its lease to expire.
    probe_timeout_s: float = bounded(0.5, gt=0, fix=SECONDS)
    # etcd may be away this long (a restart, a leader election, a network blip) while the job
    # trains on; past it every node stops cleanly and the newest checkpoint is kept.
    etcd_grace_s: float = bounded(60.0, gt=0, fix=SECONDS)
