"""The rendezvous-scale bench's pure parts: the torch rows' settings taken from the torchrun
peer's, what torch's log says about keep-alives and removals, and the saturation flag."""

from __future__ import annotations

import logging
import os
import sys

from .conftest import REPO, load_bench

sys.path.insert(0, str(REPO / "bench"))  # the bench imports torchrun_peer as its neighbour
bench = load_bench("rendezvous_scale")


def test_torch_rows_run_torchrun_peer_settings() -> None:
    defaults, tuned = bench.PEERS
    assert (defaults.rdzv_conf, defaults.share_store, defaults.conf()) == ("", True, {})
    assert not tuned.share_store
    assert tuned.conf() == {
        "last_call_timeout": "1",
        "keep_alive_interval": "1",
        "keep_alive_max_attempt": "3",
    }
    # torchrun keeps the last --rdzv-conf given
    twice = bench.PeerSettings("x", {}, ["--rdzv-conf=a=1", "--nnodes=2", "--rdzv-conf=b=2"])
    assert bench.PeerRow.of(twice).conf() == {"b": "2"}


def _record(message: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("torch", level, __file__, 0, message, None, None)


def test_torch_log_counts_failed_keep_alives_and_removed_nodes() -> None:
    said = bench._TorchLog()
    said.emit(
        _record(
            "The node 'x_1_0' has failed to send a keep-alive heartbeat to the rendezvous 'r' "
            "due to an error of type RendezvousTimeoutError.",
            logging.WARNING,
        )
    )
    said.emit(
        _record(
            "As part of the sync operation the node(s) '127.0.0.1_4242_3', '127.0.0.1_77_0' have "
            "been removed from the rendezvous 'scale32-ab' since they had no heartbeat.",
            logging.DEBUG,
        )
    )
    said.emit(_record("Detected dead node '127.0.0.1_9_1', removing it", logging.DEBUG))
    assert said.failed == 1
    assert said.removed == ["127.0.0.1_4242_3", "127.0.0.1_77_0"]
    assert [bench.node_pid(d) for d in said.removed] == [4242, 77]
    assert bench.node_pid("my_host_name_12_5") == 12  # an address may hold underscores


def test_saturation_names_the_phases_with_the_machine_busy() -> None:
    cores = os.cpu_count() or 1
    quiet = bench.Busy(2.0, 0.1 * cores, 0.0, 0.5 * cores)
    busy = bench.Busy(0.3, 0.5 * cores, 0.1, 0.95 * cores)
    assert bench.saturation({"first round": quiet}) == "no"
    flag = bench.saturation({"first round": busy, "idle": quiet})
    assert flag.startswith("SATURATED: first round (") and "over 0.30 s" in flag
    assert "idle" not in flag
