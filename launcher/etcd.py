"""Connecting to etcd v3: endpoint parsing and the client import.

The ``etcd3`` client (0.12) was generated against an old protobuf and only works with today's
protobuf in its pure-Python mode, so the variable is set here, before the import, in the
processes that talk to etcd (agents and the launcher) and nowhere else.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import etcd3


class EtcdUnavailable(ConnectionError):
    """No endpoint of the etcd cluster answered."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (an ``http://`` prefix is allowed) to a tuple."""
    endpoint = endpoint.removeprefix("http://")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host, int(port)


def connect(endpoints: list[str], timeout_s: float = 3.0) -> etcd3.Etcd3Client:
    """A client to the first endpoint that answers a status call.

    Production runs against a 3-member etcd cluster: trying each member in turn means one dead
    member does not keep a node out of the job.
    """
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    import etcd3

    errors = []
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        client = etcd3.client(host=host, port=port, timeout=timeout_s)
        try:
            client.status()
        except Exception as exc:  # grpc raises a family of errors; any of them means "next"
            errors.append(f"{endpoint}: {exc.__class__.__name__}")
            client.close()
            continue
        return client
    raise EtcdUnavailable(
        "no etcd endpoint answered (" + "; ".join(errors) + "). Check cluster.etcd_endpoints "
        "and that etcd is running."
    )
