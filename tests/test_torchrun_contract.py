"""torch's own rendezvous contract, run against ``--rdzv-backend=etcd-v3`` and a real etcd.

torch's tests for a rendezvous backend (``RendezvousBackendTestMixin``) and for the handler over
it (``IntegrationTest``) run against in-memory fakes and torch's own backends, never ours. These
are their equivalents, written for this backend: the eight checks every ``RendezvousBackend``
must pass (:class:`EtcdV3Backend` alone, plus the corrupt-state check where ``set_state``
decodes), then the flows of several nodes that torch's ``DynamicRendezvousHandler`` runs over
it (handlers built by :func:`create_rdzv_handler`, as torchrun builds them, one thread per
node): all nodes join; a node beyond ``max_nodes`` waits in
the redundancy list, moves to the wait list when a participant misses its heartbeats and is
dropped, and joins the next round; a lone node times out; a closed rendezvous turns nodes away;
the agent store torch can share. Timings are small (heartbeat every second, dead after three) so
that the file takes seconds; every wait is bounded and, where it waits for the shared state,
woken by an etcd watch on the state key rather than by polling.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist
from etcd3.exceptions import WatchTimedOut
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    Token,
    _RendezvousState,
)

from launcher.rendezvous.etcd import connect
from launcher.torchrun.backend import (
    SHARED_STORE_OPT_OUT,
    EtcdV3Backend,
    EtcdV3Store,
    create_backend,
    create_rdzv_handler,
)

# A node sends a heartbeat every second and is dead after three missed ones; a round that has
# its minimum of nodes waits 3 s for more (time for a node that syncs once a second to come).
# The close keeps torch's default of 30 s: it is a compare-and-set that loses to every heartbeat
# written between its read and its write, so when a write takes as long as the heartbeat
# interval it loses again and again. A 5 s close failed so in CI on 2 loaded cores. With every
# write of this file's handlers delayed by 1 s, the close timed out after 5.4 s: of 13 writes,
# the 4 that landed were heartbeats; with delays up to 0.6 s it closed within 0.9 s.
FAST_CONF = {
    "join_timeout": "20",
    "last_call_timeout": "3",
    "close_timeout": "30",
    "heartbeat_timeout": "5",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "4",
    "read_timeout": "10",
}
WAIT_S = 15.0  # the most any step of a flow waits (a round takes 1-3 s)
CORRUPT = b"\x00not base64!"  # what no base64 encoder writes


def rdzv_params(
    endpoint: str,
    run_id: str,
    min_nodes: int = 1,
    max_nodes: int = 1,
    local_addr: str | None = None,
    **conf: Any,
) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd-v3", endpoint, run_id, min_nodes, max_nodes, local_addr=local_addr, **conf
    )


# --- RendezvousBackendTestMixin: the backend alone --------------------------------------------


@pytest.fixture
def backend(etcd_endpoint: str, job_id: str) -> EtcdV3Backend:
    return create_backend(rdzv_params(etcd_endpoint, job_id))[0]


def set_state(backend: EtcdV3Backend, state: bytes, token: Any = None) -> tuple[bytes, Token, bool]:
    """``backend.set_state``, which must answer (``None`` only means: no state exists)."""
    result = backend.set_state(state, token)
    assert result is not None
    return result


def test_get_state_returns_the_state_that_was_set(backend: EtcdV3Backend) -> None:
    backend.set_state(b"x")
    result = backend.get_state()
    assert result is not None
    state, token = result
    assert state == b"x"
    assert token is not None


def test_get_state_returns_none_when_no_state_exists(backend: EtcdV3Backend) -> None:
    assert backend.get_state() is None


def test_get_state_raises_a_state_error_when_the_stored_state_is_corrupt(
    backend: EtcdV3Backend, etcd_client: Any
) -> None:
    etcd_client.put(backend.key, CORRUPT)
    with pytest.raises(RendezvousStateError):
        backend.get_state()


@pytest.mark.parametrize("token", ["stale", None, "invalid"])
def test_set_state_raises_a_state_error_when_the_state_it_loses_to_is_corrupt(
    backend: EtcdV3Backend, etcd_client: Any, token: str | None
) -> None:
    """Not one of torch's eight: the other place the backend decodes what etcd holds, the
    current state that ``set_state`` returns when its write loses."""
    _, first, _ = set_state(backend, b"x")
    etcd_client.put(backend.key, CORRUPT)  # a new revision: ``first`` is now stale
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"y", first if token == "stale" else token)


def test_set_state_creates_the_state_when_none_exists(backend: EtcdV3Backend) -> None:
    state, token, has_set = set_state(backend, b"x")
    assert state == b"x"
    assert token is not None
    assert has_set


def test_set_state_overwrites_the_state_when_the_token_is_current(
    backend: EtcdV3Backend,
) -> None:
    _, token1, has_set1 = set_state(backend, b"x")
    state2, token2, has_set2 = set_state(backend, b"y", token1)
    assert state2 == b"y"
    assert token2 != token1
    assert has_set1 and has_set2
    assert backend.get_state() == (b"y", token2)


def test_set_state_returns_the_current_state_when_the_token_is_old(
    backend: EtcdV3Backend,
) -> None:
    _, token1, _ = set_state(backend, b"x")
    state2, token2, _ = set_state(backend, b"y", token1)
    state3, token3, has_set = set_state(backend, b"z", token1)
    assert (state3, token3) == (state2, token2)
    assert not has_set


def test_set_state_returns_the_current_state_when_no_token_is_given_but_a_state_exists(
    backend: EtcdV3Backend,
) -> None:
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y")
    assert (state2, token2) == (state1, token1)
    assert not has_set


def test_set_state_returns_the_current_state_when_the_token_is_invalid(
    backend: EtcdV3Backend,
) -> None:
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y", token="invalid")
    assert (state2, token2) == (state1, token1)
    assert not has_set


# --- IntegrationTest: several nodes, torch's handler over the backend -------------------------


class Joining:
    """``handler.next_rendezvous()`` in a thread of its own, as one node's agent calls it."""

    def __init__(self, handler: DynamicRendezvousHandler) -> None:
        self.handler = handler
        self._info: RendezvousInfo | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="next_rendezvous", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._info = self.handler.next_rendezvous()
        except BaseException as exc:  # handed to the test thread, which raises or checks it
            self._error = exc

    def join(self, timeout_s: float = WAIT_S) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def info(self, timeout_s: float = WAIT_S) -> RendezvousInfo:
        """The rendezvous this node joined; fails if it did not within ``timeout_s``."""
        assert self.join(timeout_s), f"no rendezvous within {timeout_s:g} s"
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def error(self, timeout_s: float = WAIT_S) -> BaseException:
        """What ended this node's attempt; fails if it joined, or still waits after
        ``timeout_s``."""
        assert self.join(timeout_s), f"still waiting after {timeout_s:g} s"
        assert self._error is not None, f"joined: rank {self._info and self._info.rank}"
        return self._error


class Run:
    """The nodes of one rendezvous run (one ``--rdzv-id``) over the real etcd, and a view of
    the state they share, read through a backend of the run's own."""

    def __init__(self, endpoint: str, run_id: str) -> None:
        self.endpoint = endpoint
        self.run_id = run_id
        self.handlers: list[DynamicRendezvousHandler] = []
        self.joins: list[Joining] = []
        self.observer, _ = create_backend(rdzv_params(endpoint, run_id))
        # Left open (see conftest's etcd_client): it watches.
        self._watcher = connect([endpoint])

    def node(self, min_nodes: int = 2, max_nodes: int = 2, **conf: str) -> DynamicRendezvousHandler:
        """A node's handler, as torchrun creates it; nodes get 127.0.0.1, .2, ... in order, so
        that rank 0 of a round is its node of the lowest address."""
        addr = f"127.0.0.{len(self.handlers) + 1}"
        handler = create_rdzv_handler(
            rdzv_params(
                self.endpoint, self.run_id, min_nodes, max_nodes, addr, **{**FAST_CONF, **conf}
            )
        )
        assert isinstance(handler, DynamicRendezvousHandler)
        self.handlers.append(handler)
        return handler

    def join(self, handler: DynamicRendezvousHandler) -> Joining:
        joining = Joining(handler)
        self.joins.append(joining)
        return joining

    def state(self) -> _RendezvousState | None:
        result = self.observer.get_state()
        # torch's own format, written by this test's handlers (torch's handler unpickles it too)
        return None if result is None else pickle.loads(result[0])

    def wait_for(
        self,
        what: str,
        condition: Callable[[_RendezvousState], bool],
        timeout_s: float = WAIT_S,
    ) -> _RendezvousState:
        """The shared state, once ``condition`` holds; woken by each write of the state key."""
        deadline = time.monotonic() + timeout_s
        while True:
            revision = self._watcher.get_response(self.observer.key).header.revision
            state = self.state()
            if state is not None and condition(state):
                return state
            left = deadline - time.monotonic()
            if left <= 0:
                seen = None if state is None else vars(state)
                pytest.fail(f"not {what} within {timeout_s:g} s; the state: {seen}")
            with contextlib.suppress(WatchTimedOut):  # timed out: one more look, then fail
                # Any write after the read above ends the watch at once.
                self._watcher.watch_once_response(
                    self.observer.key, timeout=left, start_revision=revision + 1
                )

    def end(self) -> None:
        """Close the rendezvous (every node still in a ``next_rendezvous`` returns: closed, or
        a graceful exit from the redundancy list) and stop every heartbeat."""
        if self.handlers:
            with contextlib.suppress(Exception):  # the test's own failure says more
                self.node().set_closed()
        for joining in self.joins:
            joining.join()
        for handler in self.handlers:
            handler._stop_heartbeats()  # as torch's IntegrationTest tears down


@pytest.fixture
def run(etcd_endpoint: str, job_id: str) -> Iterator[Run]:
    # create_rdzv_handler sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE unless the user did: keep it
    # to the test, which starts as a user who set nothing.
    with mock.patch.dict(os.environ):
        os.environ.pop(SHARED_STORE_OPT_OUT, None)
        started = Run(etcd_endpoint, job_id)
        try:
            yield started
        finally:
            started.end()


def eventually(what: str, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """For what only a handler's own view shows, which no etcd event announces: torch's handler
    answers from the state it read less than a second ago (its cache), so its view lags etcd by
    up to a second. Polled, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} within {timeout_s:g} s")
        time.sleep(0.05)


def addrs(nodes: Any) -> list[str]:
    return sorted(node.addr for node in nodes)


def test_all_nodes_join_a_rendezvous_with_ranks_of_their_own(run: Run) -> None:
    handler1, handler2 = run.node(), run.node()
    assert handler1.get_backend() == "etcd-v3" and handler1.get_run_id() == run.run_id

    joins = [run.join(handler1), run.join(handler2)]
    info1, info2 = (joining.info() for joining in joins)

    assert {info1.rank, info2.rank} == {0, 1}
    assert info1.world_size == info2.world_size == 2
    # Both got the run's store in etcd, under the round's prefix: what one node writes there,
    # the other reads (as the agents' bootstrap keys need).
    for info in (info1, info2):
        assert isinstance(info.store, dist.PrefixStore)
        assert isinstance(info.store.underlying_store, EtcdV3Store)
    info1.store.set("from node 1", "hello")
    assert info2.store.get("from node 1") == b"hello"
    # Everyone was told the same master address: that of the node of rank 0.
    assert info1.bootstrap_store_info == info2.bootstrap_store_info
    assert info1.bootstrap_store_info.master_addr == "127.0.0.1"
    state = run.wait_for("the round complete", lambda s: s.complete)
    assert (state.round, addrs(state.participants)) == (0, ["127.0.0.1", "127.0.0.2"])


def test_a_node_beyond_max_nodes_waits_in_the_redundancy_list_until_the_rendezvous_closes(
    run: Run,
) -> None:
    handler1, handler2, handler3 = run.node(), run.node(), run.node()
    for joining in [run.join(handler1), run.join(handler2)]:
        joining.info()

    late = run.join(handler3)
    state = run.wait_for("the third node redundant", lambda s: bool(s.redundancy_list))
    assert addrs(state.redundancy_list) == ["127.0.0.3"]
    assert addrs(state.participants) == ["127.0.0.1", "127.0.0.2"]
    assert not state.wait_list
    assert handler1.num_nodes_waiting() == 0  # a spare node does not make the agents re-form
    assert late.join(0.0) is False  # still waiting: a redundant node has no join deadline

    handler1.set_closed()
    assert isinstance(late.error(), RendezvousGracefulExitError)


def test_a_node_that_misses_its_heartbeats_is_dropped_and_a_redundant_node_takes_its_place(
    run: Run,
) -> None:
    handler1, handler2, handler3 = (run.node(min_nodes=1) for _ in range(3))
    for joining in [run.join(handler1), run.join(handler2)]:
        assert joining.info().world_size == 2
    late = run.join(handler3)
    run.wait_for("the third node redundant", lambda s: bool(s.redundancy_list))

    handler2._stop_heartbeats()  # node 2 dies, as far as the rendezvous can tell
    state = run.wait_for(
        "node 2 dropped and node 3 in the wait list",
        lambda s: addrs(s.participants) == ["127.0.0.1"] and addrs(s.wait_list) == ["127.0.0.3"],
    )
    assert "127.0.0.2" not in addrs(state.last_heartbeats)
    assert not state.redundancy_list
    # What makes a torchrun agent start a new round; its handler's view lags up to a second.
    eventually("node 1 sees node 3 waiting", lambda: handler1.num_nodes_waiting() == 1)

    again = run.join(handler1)
    info1, info3 = again.info(), late.info()
    assert (info1.rank, info3.rank, info1.world_size, info3.world_size) == (0, 1, 2, 2)
    state = run.wait_for("round 1 complete", lambda s: s.round == 1 and s.complete)
    assert addrs(state.participants) == ["127.0.0.1", "127.0.0.3"]


def test_a_node_gives_up_and_leaves_when_too_few_nodes_join_in_time(run: Run) -> None:
    lone = run.join(run.node(join_timeout="1"))
    assert isinstance(lone.error(), RendezvousTimeoutError)
    state = run.state()
    assert state is not None
    assert not state.complete
    assert not state.participants and not state.last_heartbeats  # it took itself out


def test_a_closed_rendezvous_turns_away_nodes_that_join_later(run: Run) -> None:
    first = run.node(min_nodes=1, max_nodes=1)
    assert run.join(first).info().world_size == 1
    assert not first.is_closed()

    first.set_closed()
    later = run.node(min_nodes=1, max_nodes=1)
    assert later.is_closed()
    assert isinstance(run.join(later).error(), RendezvousClosedError)
    assert first.shutdown() is True  # closing what is closed succeeds


def test_the_agent_store_is_not_shared_unless_the_user_asks_for_it(run: Run) -> None:
    handler = run.node()
    assert not handler.use_agent_store
    assert os.environ[SHARED_STORE_OPT_OUT] == "1"


def test_a_user_who_asks_for_the_shared_agent_store_gets_rank_0s_tcp_store(
    run: Run,
) -> None:
    os.environ[SHARED_STORE_OPT_OUT] = "0"  # the run fixture restores the environment
    handler1, handler2 = run.node(), run.node()
    assert handler1.use_agent_store and handler2.use_agent_store
    assert os.environ[SHARED_STORE_OPT_OUT] == "0"

    info1, info2 = (joining.info() for joining in [run.join(handler1), run.join(handler2)])
    assert info1.bootstrap_store_info == info2.bootstrap_store_info
    master = info1.bootstrap_store_info
    assert master.master_addr == "127.0.0.1"
    # Rank 0's agent serves a TCPStore there, which any node's workers can use.
    client = dist.TCPStore(
        master.master_addr, master.master_port, is_master=False, timeout=timedelta(seconds=5)
    )
    client.set("worker", "reached rank 0's store")
    assert client.get("worker") == b"reached rank 0's store"
