"""``torchrun --rdzv-backend=etcd-v3``: torch's own dynamic rendezvous, with its state in etcd v3.

torch's etcd backends (``etcd``, ``etcd-v2``) speak only etcd's v2 API, which etcd 3.6 removed;
this one gives torchrun users the etcd v3 cluster they already run for us (registered through
:mod:`launcher.torchrun`). It implements torch's ``RendezvousBackend`` contract and nothing else:
torch's ``DynamicRendezvousHandler`` does the rendezvous, as for ``c10d``. Under
``<key_prefix>/<run_id>/``, ``state`` holds torch's state, fenced by its mod revision
(:class:`EtcdV3Backend`), and ``store/`` the c10d store torch's handler needs beside it
(:class:`EtcdV3Store`). Both expire between ``state_ttl``/2 and ``state_ttl`` seconds after the
last write, so reusing a run id whose state is still there joins a closed rendezvous: give every
job its own ``--rdzv-id``. The settings are :func:`create_rdzv_handler`'s.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from launcher.rendezvous.credentials import (
    CLUSTER_NAMES,
    ETCD_PASSWORD_ENV,
    TORCHRUN_NAMES,
    credential_problems,
    rdzv_conf_name,
    read_password,
)
from launcher.rendezvous.etcd import (
    PROTOBUF_MODE,
    EtcdRefused,
    EtcdSecurity,
    EtcdUnavailable,
    connect,
    denied,
    etcd_errors,
)
from launcher.torchrun.liveness import TORCH_KEEP_ALIVE, keep_alive_problem

log = logging.getLogger("launcher.torchrun")
T = TypeVar("T")

NAME = "etcd-v3"
DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/torchrun"
MIN_STATE_TTL_S = 60
SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
DEFAULT_GRACE_S = 60.0  # as our agents' rendezvous.etcd_grace_s
RETRY_PAUSE_S = (0.1, 1.0)  # the first pause between tries while etcd is away, and the longest


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's ``DynamicRendezvousHandler`` over etcd v3, what ``--rdzv-backend=etcd-v3`` gets.

    For example::

        torchrun --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=etcd-v3 \\
            --rdzv-endpoint=10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379 --rdzv-id=JOB train.py

    Settings (``--rdzv-conf key=value,...``), besides torch's own (``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``):

    ``key_prefix``   etcd prefix of all runs (default ``/torchrun``)
    ``etcd_timeout`` seconds one etcd request may take (default 5)
    ``etcd_grace_s`` seconds etcd may be away (a restart, a lost leader, a partition) before a
                     call gives up and the agent fails (default 60): every call to etcd is tried
                     again until then
    ``read_timeout`` seconds a store read waits for its key (default 60, as torch's ``c10d``)
    ``state_ttl``    the keys' lease, in seconds: 0 (never expire) or at least 60 (default 7200,
                     as torch's ``etcd-v2``); a stale run: ``etcdctl del --prefix /torchrun/JOB/``
    ``ca``           TLS: the CA file (PEM) that signed the etcd members' certificates
    ``cert``, ``key`` TLS: this node's client certificate and key, for ``--client-cert-auth``
    ``server_name``  the name the members' certificates are checked against (default: the first
                     endpoint's host)
    ``user``         an etcd user; its password is read from ``password_file``, or else from
                     ``$ELASTIC_ETCD_PASSWORD``, never from the command line (where ``ps`` shows it)

    The workers' process-group store: torch (2.4 and later) by default lets the rank-0 agent of
    the first round host a TCPStore for all later rounds. A node whose rank is not 0 keeps that
    address from its first round, so once the node of rank 0 is lost, the survivors' workers wait
    on a dead store and the job fails (torch fixed only the case of the node that becomes rank
    0). Losing any node is what this backend is for, so torch's own opt-out,
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, is set unless the user set it: each round's rank-0
    agent then publishes a free port in ``store/``, and the round's rank-0 worker hosts the
    TCPStore there.
    """
    problem = keep_alive_problem(
        params.get_as_int("keep_alive_interval", TORCH_KEEP_ALIVE[0]) or 0,
        params.get_as_int("keep_alive_max_attempt", TORCH_KEEP_ALIVE[1]) or 0,
    )
    if problem:
        raise ValueError(problem)
    backend, store = create_backend(params)
    os.environ.setdefault(SHARED_STORE_OPT_OUT, "1")
    return create_handler(store, backend, params)


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3Backend, EtcdV3Store]:
    """The backend and the store of one run, sharing one etcd client.

    They are returned as torch's ``etcd_rendezvous_backend`` returns them."""
    security = _security(params)
    endpoints = _endpoints(params.endpoint, security.tls)
    if not params.run_id or "/" in params.run_id:
        raise ValueError(
            f"etcd-v3 rendezvous: --rdzv-id={params.run_id!r} must be non-empty and without '/' "
            "(it is one segment of the etcd keys). Fix: e.g. --rdzv-id=resnet50-run1"
        )
    key_prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX)).rstrip("/")
    if not key_prefix:
        raise ValueError(
            f"etcd-v3 rendezvous: {rdzv_conf_name('key_prefix')} is empty. Fix: e.g. /torchrun"
        )
    etcd_timeout = _seconds(params, "etcd_timeout", 5.0)
    read_timeout = _seconds(params, "read_timeout", 60.0)
    grace_s = _seconds(params, "etcd_grace_s", DEFAULT_GRACE_S)
    state_ttl = _seconds(params, "state_ttl", 7200, allow_zero=True)
    if 0 < state_ttl < MIN_STATE_TTL_S:
        raise ValueError(
            f"etcd-v3 rendezvous: {rdzv_conf_name('state_ttl')}={state_ttl:g} is too short for "
            f"a round. Fix: 0 (never expire) or at least {MIN_STATE_TTL_S}"
        )

    patience = Patience(grace_s)
    client = _connect(endpoints, etcd_timeout, security, patience)
    run = f"{key_prefix}/{params.run_id}"
    lease = _Lease(client, int(state_ttl))
    store = EtcdV3Store(client, f"{run}/store/", lease, timedelta(seconds=read_timeout), patience)
    return EtcdV3Backend(client, f"{run}/state", store.prefix, lease, patience), store


class Patience:
    """Calls to etcd that outlast an outage shorter than ``grace_s`` (``etcd_grace_s``).

    torch's handler treats any backend error as fatal to the agent (its monitor loop does not
    catch it), so without this a 4 s etcd restart ended every torchrun agent of the job. A call
    that fails for want of etcd is tried again, after pauses growing from 0.1 to 1 s, until
    ``grace_s`` has passed since it began; then it raises ``kind`` with the time it waited and
    the setting that bounds it. A refusal (no permission) is a fact about the settings, not an
    outage: raised at once. A write tried again after etcd applied it but before it answered
    finds its own result: the state's compare-and-set sees the new revision and returns the
    state written (torch reads it as the current state, which it is)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s

    def call(self, what: str, attempt: Callable[[], T], kind: type[Exception]) -> T:
        began = time.monotonic()
        pause, longest = RETRY_PAUSE_S
        warned = False
        while True:
            try:
                return attempt()
            except etcd_errors() as exc:
                waited = time.monotonic() - began
                if denied(exc):
                    raise kind(
                        f"etcd-v3 rendezvous: etcd refused {what} ({exc!r}). Fix: give the etcd "
                        f"user of {rdzv_conf_name('user')} read and write on the run's prefix "
                        f"({rdzv_conf_name('key_prefix')})"
                    ) from exc
                if waited >= self.grace_s:
                    raise kind(
                        f"etcd-v3 rendezvous: etcd did not answer {what} for {waited:.1f} s "
                        f"({exc!r}). Fix: bring etcd back (--rdzv-endpoint); to ride out longer "
                        f"outages, raise {rdzv_conf_name('etcd_grace_s')} (now {self.grace_s:g})"
                    ) from exc
                if not warned:
                    log.warning(
                        "etcd-v3 rendezvous: etcd did not answer %s (%r); trying again for up "
                        "to %g s (%s)",
                        what,
                        exc,
                        self.grace_s,
                        rdzv_conf_name("etcd_grace_s"),
                    )
                    warned = True
                time.sleep(min(pause, self.grace_s - waited))
                pause = min(2 * pause, longest)


class EtcdV3Backend(RendezvousBackend):
    """torch's rendezvous state (opaque bytes) in one etcd key, fenced by its mod revision.

    The state is base64-encoded, as torch's own backends store it. The fencing token is the key's
    mod revision. ``set_state`` is one transaction. It writes only if the mod revision is still the
    token's (or, without a token, only if the key does not exist); otherwise it reads the current
    state. A key that does not decode raises ``RendezvousStateError`` (torch's contract), naming the
    key to delete."""

    def __init__(
        self, client: Any, key: str, store_prefix: str, lease: _Lease, patience: Patience
    ) -> None:
        self._client = client
        self._key = key
        self._store_prefix = store_prefix
        self._lease = lease
        self._patience = patience

    @property
    def name(self) -> str:
        return NAME

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        value, meta = self._patience.call(
            "a read of the state", lambda: self._client.get(self._key), RendezvousConnectionError
        )
        return None if value is None else (self._decode(value), meta.mod_revision)

    def _decode(self, value: bytes) -> bytes:
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise RendezvousStateError(
                f"etcd-v3 rendezvous: the state at {self._key} is corrupt (not base64: {exc}). "
                f"Fix: etcdctl del {self._key}, or give the job another --rdzv-id"
            ) from exc

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):  # not one of ours: cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        t = self._client.transactions
        if token is None:  # a new rendezvous: also clear the store of an earlier run of this id
            compare = [t.version(self._key) == 0]
            clear = [t.delete(self._store_prefix, range_end=_prefix_end(self._store_prefix))]
        else:
            compare = [t.mod(self._key) == token]
            clear = []
        encoded = base64.b64encode(state)
        written, responses = self._patience.call(
            "a write of the state",
            lambda: self._lease.call(
                lambda lease_id: self._client.transaction(
                    compare=compare,
                    success=[t.put(self._key, encoded, lease=lease_id), *clear],
                    failure=[t.get(self._key)],
                )
            ),
            RendezvousConnectionError,
        )
        if written:  # every write of one transaction has the transaction's revision
            return state, responses[0].response_put.header.revision, True
        kvs = responses[0]
        if not kvs:
            return None
        value, meta = kvs[0]
        return self._decode(value), meta.mod_revision, False


class EtcdV3Store(dist.Store):
    """A c10d ``Store`` in etcd v3 keys under ``prefix``, for the agents' few bootstrap keys.

    Those are ``MASTER_ADDR``/``MASTER_PORT``, the rank assignment and the exit barrier.

    Why a store in etcd, as torch's ``etcd-v2`` backend does (its ``EtcdStore``), rather than a
    TCPStore: the handler needs its store before the first round, to learn who is rank 0, so a
    TCPStore would have to be at a fixed address (``c10d`` hosts it on the ``--rdzv-endpoint``
    node), and the job would die with that one node. etcd is the only part that every node can
    reach and that survives the loss of any node. The transaction that creates ``state`` also
    deletes ``store/``, so a run id used again never reads an earlier run's keys. Reads that wait
    for a key watch it from the revision they read at, so they never miss a write in between.
    """

    def __init__(
        self, client: Any, prefix: str, lease: _Lease, timeout: timedelta, patience: Patience
    ) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self.prefix = prefix
        self._lease = lease
        self._patience = patience
        self.set_timeout(timeout)

    def _call(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt`` within the grace; a ``DistNetworkError`` past it, as c10d's stores raise."""
        return self._patience.call(what, attempt, dist.DistNetworkError)

    def set(self, key: str, value: bytes | str) -> None:
        log.debug("etcd-v3 store: set %r", key)
        self._call(
            f"a write of store key {key!r}",
            lambda: self._lease.call(
                lambda lease: self._client.put(self._k(key), value, lease=lease)
            ),
        )

    def get(self, key: str) -> bytes:
        return self._wait([key], self.timeout)[0]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, self.timeout if timeout is None else timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return all(
            self._call(
                f"a read of store key {key!r}", lambda key=key: self._client.get(self._k(key))
            )[0]
            is not None
            for key in keys
        )

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal integer at ``key`` (0 if absent); the sum, once.

        A compare-and-set on the key's mod revision, repeated while another writer comes first.
        The write also puts a marker of this add (``<key>/.add/<uuid>``: the sum it wrote). A
        transaction etcd committed but whose answer was lost is retried, and its compare then
        fails on its own write: the marker, read back by the failed transaction, says the add is
        done, and with what sum. Without it the add counted twice, and torch's exit barrier,
        which ends when an add returns the world size, waited out its 300 s."""
        k, t = self._k(key), self._client.transactions
        marker = f"{k}/.add/{uuid.uuid4().hex}"
        deadline = time.monotonic() + self.timeout.total_seconds()
        what = f"an add to store key {key!r}"
        while True:
            value, meta = self._call(what, lambda: self._client.get(k))
            new = (0 if value is None else int(value)) + amount
            seen = t.version(k) == 0 if value is None else t.mod(k) == meta.mod_revision
            written, responses = self._call(
                what,
                lambda new=new, seen=seen: self._lease.call(
                    lambda lease: self._client.transaction(
                        compare=[seen],
                        success=[
                            t.put(k, str(new), lease=lease),
                            t.put(marker, str(new), lease=lease),
                        ],
                        failure=[t.get(marker)],
                    )
                ),
            )
            done = not written and responses and responses[0]
            if written or done:
                new = int(responses[0][0][0]) if done else new
                log.debug("etcd-v3 store: added %d to %r: %d", amount, key, new)
                return new
            if time.monotonic() > deadline:
                raise dist.DistStoreError(
                    f"etcd-v3 store: an add to {key!r} lost to other writers for "
                    f"{self.timeout.total_seconds():g} s. Fix: raise "
                    f"{rdzv_conf_name('read_timeout')} (now {self.timeout.total_seconds():g})"
                )

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Write ``desired`` if the value is ``expected``; return the value the key then has.

        These are c10d's semantics. With an empty ``expected``, it writes only if the key is absent;
        for an absent key it returns ``expected``."""
        k, t = self._k(key), self._client.transactions
        expected_b = expected.encode() if isinstance(expected, str) else expected
        desired_b = desired.encode() if isinstance(desired, str) else desired
        seen = t.version(k) == 0 if not expected_b else t.value(k) == expected_b
        written, responses = self._call(
            f"a compare-and-set of store key {key!r}",
            lambda: self._lease.call(
                lambda lease: self._client.transaction(
                    compare=[seen], success=[t.put(k, desired_b, lease=lease)], failure=[t.get(k)]
                )
            ),
        )
        if written:
            return desired_b
        kvs = responses[0]
        return kvs[0][0] if kvs else expected_b

    def delete_key(self, key: str) -> bool:
        return bool(
            self._call(f"a delete of store key {key!r}", lambda: self._client.delete(self._k(key)))
        )

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _wait(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        values = []
        for key in keys:
            while True:
                found = self._call(
                    f"a read of store key {key!r}",
                    lambda key=key: self._client.get_response(self._k(key)),
                )
                if found.kvs:
                    log.debug("etcd-v3 store: read %r", key)
                    values.append(found.kvs[0].value)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"etcd-v3 store: key {key!r} not set within {timeout.total_seconds():g}"
                        " s: a peer's agent died, or is slow. Fix: if every node's agent is "
                        f"alive, raise {rdzv_conf_name('read_timeout')}"
                    )
                try:  # any answer (the put, a compaction, an error) means: read again
                    self._client.watch_once_response(
                        self._k(key), timeout=left, start_revision=found.header.revision + 1
                    )
                except etcd_errors():
                    pass  # timed out, or etcd away: the loop reads again (within the grace)
        return values


class _Lease:
    """The lease on the keys this agent writes, so that they expire ``ttl_s`` after the last write.

    A lease is used for half its TTL, then a new one is granted (the old one expires with whatever
    no later write has moved off it); nothing keeps it alive. ``ttl_s`` 0: no lease, the keys
    stay."""

    def __init__(self, client: Any, ttl_s: int) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._id = 0
        self._granted = float("-inf")
        self._lock = threading.Lock()

    def call(self, write: Callable[[int], Any]) -> Any:
        """``write(lease_id)``; once more with a new lease if etcd no longer has this one."""
        import grpc

        try:
            return write(self._current(renew=False))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # "requested lease not found"
                raise
            return write(self._current(renew=True))

    def _current(self, renew: bool) -> int:
        if not self._ttl_s:
            return 0
        with self._lock:
            if renew or time.monotonic() - self._granted > self._ttl_s / 2:
                self._granted = time.monotonic()
                self._id = self._client.lease(self._ttl_s).id
            return self._id


def _endpoints(endpoint: str, tls: bool) -> list[str]:
    """The etcd members that ``--rdzv-endpoint`` names, as ``host:port``.

    It names one etcd member or several, comma-separated, as ``host:port`` (port 2379 by default) or
    as etcd's client URLs (``http://host:port``, ``https://`` with TLS)."""
    parts = [part.strip() for part in (endpoint or "").split(",") if part.strip()]
    if not parts:
        raise ValueError(
            "etcd-v3 rendezvous: --rdzv-endpoint is empty. Fix: host:port of an etcd member, or "
            "several, comma-separated"
        )
    addresses = []
    for part in parts:
        scheme, _, rest = part.rpartition("://")
        if scheme not in ("", "http", "https"):
            raise ValueError(
                f"etcd-v3 rendezvous: --rdzv-endpoint={endpoint}: {scheme}:// is not etcd's. "
                "Fix: host:port, or http://host:port (https:// for TLS)"
            )
        if scheme == "https" and not tls:
            raise ValueError(
                f"etcd-v3 rendezvous: --rdzv-endpoint={endpoint} asks for TLS, and "
                f"{rdzv_conf_name('ca')} is not set. Fix: set {rdzv_conf_name('ca')} to the CA "
                "of etcd's certificates"
            )
        if scheme == "http" and tls:
            raise ValueError(
                f"etcd-v3 rendezvous: --rdzv-endpoint={endpoint} is plaintext, and "
                f"{rdzv_conf_name('ca')} asks for TLS. Fix: write https:// (or host:port)"
            )
        host, port = parse_rendezvous_endpoint(rest.rstrip("/"), DEFAULT_PORT)
        addresses.append(f"{host}:{port}")
    return addresses


def _seconds(
    params: RendezvousParameters, name: str, default: float, allow_zero: bool = False
) -> float:
    raw = params.get(name, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        need = "a number of seconds, 0 or more" if allow_zero else "a positive number of seconds"
        raise ValueError(
            f"etcd-v3 rendezvous: {rdzv_conf_name(name)}={raw!r} is not {need}. Fix: e.g. "
            f"{rdzv_conf_name(name)}={default:g}"
        )
    return value


def _security(params: RendezvousParameters) -> EtcdSecurity:
    """TLS files and the etcd user from ``--rdzv-conf``, with the user's password.

    They are checked before any connection by the launcher's own rules (:func:`credential_problems`,
    named as rdzv_conf settings). The password comes from ``password_file`` or the environment."""
    conf = {name: str(params.get(name, "") or "") for name in CLUSTER_NAMES}
    if params.get("password") is not None:
        raise ValueError(
            f"etcd-v3 rendezvous: {rdzv_conf_name('password')} would show in the process list. "
            f"Fix: put it in a file named by {rdzv_conf_name('password_file')}, or in "
            f"${ETCD_PASSWORD_ENV}"
        )
    problems = credential_problems(**conf, name=rdzv_conf_name)
    if problems:
        raise ValueError("etcd-v3 rendezvous: " + "; ".join(problems))
    password = read_password(conf["password_file"]) if conf["user"] else ""
    if conf["user"] and not password:
        raise ValueError(
            f"etcd-v3 rendezvous: {rdzv_conf_name('password_file')}={conf['password_file']!r} "
            "is empty. Fix: write the etcd user's password into it"
        )
    return EtcdSecurity(
        ca=conf["ca"],
        cert=conf["cert"],
        key=conf["key"],
        server_name=conf["server_name"],
        user=conf["user"],
        password=password,
    )


def _connect(
    endpoints: list[str], timeout_s: float, security: EtcdSecurity, patience: Patience
) -> Any:
    """``launcher.rendezvous.etcd.connect``, its errors in torchrun's words, tried again.

    It is tried again while no member answers (within ``etcd_grace_s``: etcd may be restarting as
    the job starts). It leaves the environment as it was: connect sets the protobuf mode that the
    etcd client needs before its import. torchrun's workers inherit the agent's environment, where
    that mode would slow every protobuf user down."""
    before = os.environ.get(PROTOBUF_MODE)
    began = time.monotonic()
    pause, longest = RETRY_PAUSE_S
    try:
        while True:
            try:
                client = connect(endpoints, timeout_s, security, TORCHRUN_NAMES)
                etcd_errors()  # imports what the error handling needs while the mode is set
                return client
            except EtcdRefused as exc:  # answered, and refused: no wait changes that
                raise RendezvousConnectionError(f"etcd-v3 rendezvous: {exc}") from exc
            except EtcdUnavailable as exc:
                waited = time.monotonic() - began
                if waited >= patience.grace_s:
                    raise RendezvousConnectionError(
                        f"etcd-v3 rendezvous: {exc} (tried for {waited:.1f} s, "
                        f"{rdzv_conf_name('etcd_grace_s')}={patience.grace_s:g})"
                    ) from exc
                if pause == RETRY_PAUSE_S[0]:
                    log.warning(
                        "etcd-v3 rendezvous: %s; trying again for up to %g s (%s)",
                        exc,
                        patience.grace_s,
                        rdzv_conf_name("etcd_grace_s"),
                    )
                time.sleep(min(pause, patience.grace_s - waited))
                pause = min(2 * pause, longest)
    finally:
        if before is None:
            os.environ.pop(PROTOBUF_MODE, None)
        else:
            os.environ[PROTOBUF_MODE] = before


def _prefix_end(prefix: str) -> bytes:
    """The end of etcd's range of keys that start with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)
