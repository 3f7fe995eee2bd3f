"""Connecting to etcd v3: one client over every endpoint of the cluster.

The ``etcd3`` client (0.12) was generated against an old protobuf and only works with today's
protobuf in its pure-Python mode, so the variable is set here, before the import, in the
processes that talk to etcd (agents and the launcher) and nowhere else.

The client's gRPC channel is given every member's address, so when the member it talks to dies
or restarts, the next call goes to another one (gRPC's ``pick_first`` over the address list). A
member that comes back is reconnected within a second (the reconnect backoff is capped), and the
watch stream waits for a member instead of failing at once, so that an outage does not make
the etcd client's watch thread spin.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import etcd3


class EtcdUnavailable(ConnectionError):
    """No endpoint of the etcd cluster answered."""


RECONNECT_BACKOFF_MS = 1000  # a restarted member is found again within about this long


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (an ``http://`` prefix is allowed) to a tuple."""
    endpoint = endpoint.removeprefix("http://")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host, int(port)


def grpc_target(addresses: list[tuple[str, int]]) -> str:
    """A gRPC target naming every member (IPv4 addresses), e.g. ``ipv4:10.0.0.1:2379,...``."""
    return "ipv4:" + ",".join(f"{host}:{port}" for host, port in addresses)


def grpc_options() -> list[tuple[str, object]]:
    """Channel options: capped reconnect backoff, and a watch that waits for a member.

    Without ``waitForReady`` on the Watch service, the etcd client's watch thread re-opens its
    stream in a tight loop while no member answers (each attempt fails at once).
    """
    service_config = {
        "loadBalancingConfig": [{"pick_first": {}}],
        "methodConfig": [{"name": [{"service": "etcdserverpb.Watch"}], "waitForReady": True}],
    }
    return [
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.service_config", json.dumps(service_config)),
    ]


def _resolve(endpoint: str) -> tuple[str, int]:
    host, port = parse_endpoint(endpoint)
    try:
        return socket.gethostbyname(host), port
    except OSError as exc:
        raise EtcdUnavailable(
            f"etcd endpoint {endpoint!r}: cannot resolve {host!r} ({exc}). Fix: correct "
            "cluster.etcd_endpoints"
        ) from exc


def connect(endpoints: list[str], timeout_s: float = 3.0) -> etcd3.Etcd3Client:
    """A client over all of ``endpoints``, once one of them answers a status call.

    Production runs against a 3-member etcd cluster: one dead member neither keeps a node out of
    the job nor breaks a running one.
    """
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    import etcd3

    if not endpoints:
        raise EtcdUnavailable("no etcd endpoint given. Fix: set cluster.etcd_endpoints")
    host, _, port = grpc_target([_resolve(e) for e in endpoints]).rpartition(":")
    client = etcd3.client(host=host, port=int(port), timeout=timeout_s, grpc_options=grpc_options())
    try:
        client.status()
    except etcd_errors() as exc:
        client.close()
        raise EtcdUnavailable(
            f"no etcd endpoint answered ({', '.join(endpoints)}: {exc.__class__.__name__}). "
            "Fix: check cluster.etcd_endpoints and that etcd is running"
        ) from exc
    return client


@functools.cache
def etcd_errors() -> tuple[type[BaseException], ...]:
    """What a call to an unreachable or failing etcd raises: the client's own exceptions, and
    gRPC's for the calls it does not translate (streams). Callers retry on these alone."""
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    import grpc
    from etcd3.exceptions import Etcd3Exception

    return (Etcd3Exception, grpc.RpcError)


def allow_watch_filters(client: etcd3.Etcd3Client) -> None:
    """Let ``client.add_watch_callback(..., filters=[...])`` work. The etcd3 client (0.12)
    assigns the filters to a repeated protobuf field, which protobuf refuses; its request
    builder is wrapped once per client to append them instead."""
    watcher = client.watcher
    build = watcher._create_watch_request
    if getattr(build, "appends_filters", False):
        return

    def create_watch_request(*args: object, filters: list[int] | None = None, **kwargs: object):
        request = build(*args, **kwargs)
        request.create_request.filters.extend(filters or [])
        return request

    create_watch_request.appends_filters = True  # type: ignore[attr-defined]
    watcher._create_watch_request = create_watch_request
