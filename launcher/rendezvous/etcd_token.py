"""Keeping a user/password etcd client authenticated: its token renewed when etcd refuses it.

The etcd3 client authenticates once, when it is built; etcd forgets the token long before a
training job ends. :func:`reauthenticate_on_refusal` wraps the client's stubs so that a refused
call authenticates again and is sent once more, and a refused watch is an error, not a watch that
never fires. :func:`launcher.rendezvous.etcd.connect` applies it to every client with a user.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from launcher.rendezvous.credentials import ETCD_PASSWORD_ENV

log = logging.getLogger("launcher.rendezvous.etcd")


class WatchRefused(ConnectionError):
    """etcd refused to create a watch; one of :func:`etcd_errors`.

    The cause: the user's permission, or the stream's token."""


def password_fix(names: Mapping[str, str]) -> str:
    """The fix for a user etcd refuses, in ``names``' words (:data:`OUR_NAMES`)."""
    return (
        f"check {names['user']} and the password in {names['password_file']} (or "
        f"${ETCD_PASSWORD_ENV}); the user must exist in etcd (etcdctl user get <user>)"
    )


def reauthenticate_on_refusal(
    client: Any, user: str, password: str, names: Mapping[str, str]
) -> None:
    """Make ``client`` authenticate again when etcd refuses its token.

    The etcd3 client authenticates once, when it is built, and etcd forgets a simple token after
    ``--auth-token-ttl`` (300 s) without use, when a member restarts, and whenever users or roles
    change (the auth store's revision moves on). Every unary call goes through its stub: a call
    refused with ``UNAUTHENTICATED`` (a token expired or unknown to the member) or
    ``INVALID_ARGUMENT`` (also etcd's code for "auth store revision is old") authenticates once
    more and is sent again, once, with the new token; a second refusal is raised. The new token
    also goes to the calls made afterwards (the etcd3 client reads ``metadata`` and
    ``call_credentials`` per call) and to the streams opened afterwards; the open watch stream is
    cancelled, so that its watchers learn it broke and watch again on a stream with the new
    token. A watch creation that etcd refuses is an error
    (:class:`WatchRefused`), not a watch that never fires."""
    token = _Token(client, user, password, names)
    client.kvstub = _RenewingStub(client.kvstub, (), token)
    client.leasestub = _RenewingStub(client.leasestub, ("LeaseKeepAlive",), token)
    client.clusterstub = _RenewingStub(client.clusterstub, (), token)
    client.maintenancestub = _RenewingStub(client.maintenancestub, ("Snapshot",), token)
    watcher = client.watcher
    watcher._watch_stub = _TrackedWatchStub(watcher._watch_stub, token)
    _raise_refused_watches(watcher)


class _Token:
    """The token ``client`` sends, renewed when etcd refuses it (:meth:`renew`).

    It also tracks the watch streams opened with it (:meth:`opened`), cancelled on renewal."""

    def __init__(self, client: Any, user: str, password: str, names: Mapping[str, str]) -> None:
        import grpc

        self._client, self._names = client, names
        self._user, self._password = user, password
        self._lock = threading.Lock()
        self._watch_calls: list[Any] = []
        self._retry_codes = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)

    def renewing(self, method: Any) -> Any:
        """``method`` (a unary call), sent again with a new token if etcd refuses the old one."""
        import grpc

        client = self._client

        def call(*args: Any, **kwargs: Any) -> Any:
            stale = client.metadata
            try:
                return method(*args, **kwargs)
            except grpc.RpcError as exc:
                if exc.code() not in self._retry_codes:
                    raise
            self._renew_or_say(stale)
            kwargs.update(credentials=client.call_credentials, metadata=client.metadata)
            return method(*args, **kwargs)

        return call

    def _renew_or_say(self, stale: Any) -> None:
        """:meth:`renew`; a user etcd no longer accepts is logged, with the fix, and raised."""
        import grpc

        try:
            self.renew(stale)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                log.error(
                    "etcd no longer accepts user %r (changed password, or removed). Fix: %s",
                    self._user,
                    password_fix(self._names),
                )
            raise

    def renew(self, stale: Any) -> None:
        """Authenticate again, unless another thread did since the token ``stale`` was sent.

        Later calls and streams carry the new token; the watch streams open now are cancelled."""
        import grpc
        from etcd3 import etcdrpc
        from etcd3.client import EtcdTokenCallCredentials

        client = self._client
        with self._lock:
            if client.metadata is not stale:
                return  # another thread did it while this call failed
            response = client.auth_stub.Authenticate(
                etcdrpc.AuthenticateRequest(name=self._user, password=self._password),
                client.timeout,
            )
            token = response.token
            client.metadata = (("token", token),)
            client.call_credentials = grpc.metadata_call_credentials(
                EtcdTokenCallCredentials(token)
            )
            client.watcher._metadata = client.metadata
            client.watcher._credentials = client.call_credentials
            calls, self._watch_calls[:] = list(self._watch_calls), []
        for call in calls:
            call.cancel()

    def opened(self, call: Any) -> None:
        """A watch stream ``call`` was opened with the current token."""
        with self._lock:
            self._watch_calls.append(call)
            self._watch_calls[:] = [c for c in self._watch_calls if c.is_active()]


class _RenewingStub:
    """A gRPC stub whose unary calls renew a refused token (:meth:`_Token.renewing`).

    The streams named in ``streams`` pass through."""

    def __init__(self, stub: Any, streams: tuple[str, ...], token: _Token) -> None:
        self._stub, self._streams, self._token = stub, streams, token

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if name in self._streams:
            return method
        return self._token.renewing(method)


class _TrackedWatchStub:
    """The watch stub, telling ``token`` of each stream it opens (:meth:`_Token.opened`)."""

    def __init__(self, stub: Any, token: _Token) -> None:
        self._stub, self._token = stub, token

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - gRPC's name
        call = self._stub.Watch(*args, **kwargs)
        self._token.opened(call)
        return call


def _raise_refused_watches(watcher: Any) -> None:
    """Make a watch creation that etcd refuses fail with :class:`WatchRefused`.

    etcd creates and cancels such a watch at once; unchanged, it is a watch that never fires."""
    handle = watcher._handle_response

    def handle_response(rs: Any) -> None:
        if rs.created and rs.canceled:
            with watcher._lock:
                if watcher._new_watch is not None:
                    why = rs.cancel_reason or "no reason given"
                    watcher._new_watch.err = WatchRefused(f"etcd refused a watch: {why}")
                    watcher._new_watch_cond.notify_all()
                    return
        handle(rs)

    watcher._handle_response = handle_response
