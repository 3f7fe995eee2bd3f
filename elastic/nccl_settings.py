"""The NCCL settings a worker runs with, so that the survivors of a lost peer live to recover.

torch's defaults suit a job that ends at its first error. With ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
at 3, its watchdog ends the process when a collective fails, which a peer killed mid-all-reduce
makes happen: the survivors would die with it before their agent moved them to the next round.
And a non-blocking communicator's own calls (its set-up, its abort) wait up to
``TORCH_NCCL_NONBLOCKING_TIMEOUT``, 30 minutes. A worker on NCCL sets both before its first group:
no handling (the communicator fails the round's collectives itself, and aborts them) and the
round's ``rendezvous.pg_timeout_s``.

It also turns off the flight recorder's dump on a failure (:data:`NO_FAILURE_DUMP`). A watchdog
that sees a collective fail before the abort reaches it symbolizes the recorded stacks (about 5 s),
signals a dump and then sleeps four times ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (60 s); the
group's shutdown joins that thread. On an H200 (2026-11-28), when the destroy still ran on the
training thread, a survivor whose watchdog logged "signal dumping" never reached the next group,
while the one whose watchdog saw nothing did. The runtime records what failed itself
(:mod:`elastic.round_end`). What the worker's environment already sets is kept, as the user
asked; a handling that would end survivors is named in a warning, with the fix.

:func:`own_host` is what lets ranks that share one GPU (simulated nodes, the GPU proof's probe)
into one NCCL communicator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
# torch's values: 0 no handling, 1 abort and end the process, 2 abort only, 3 end the process.
SURVIVABLE_HANDLING = frozenset({"0", "2"})
# No flight-recorder trace, no dump on a failure, and no wait for one (torch's watchdog: see above).
NO_FAILURE_DUMP = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
}


def own_host(host_id: str) -> dict[str, str]:
    """The settings that make this process a host of its own to NCCL, named ``host_id``.

    NCCL refuses two ranks of one communicator on one GPU of one host; from 2.28 it takes a
    host's identity from ``NCCL_HOSTID`` (src/misc/utils.cc), so ranks that share a test
    machine's GPU pass for separate hosts, reached over sockets on loopback. It took 3 such ranks
    on one H100 and one H200 (2026-11-28)."""
    return {
        "NCCL_HOSTID": host_id,
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
    }


def survivor_settings(
    environ: Mapping[str, str], timeout_s: float
) -> tuple[dict[str, str], list[str]]:
    """The settings to add to ``environ``, and warnings about the settings it has.

    There is a warning for each of its own settings that would end the survivors of a lost peer."""
    add: dict[str, str] = {}
    warnings: list[str] = []
    handling = environ.get(ERROR_HANDLING)
    if handling is None:
        add[ERROR_HANDLING] = "0"
    elif handling.strip() not in SURVIVABLE_HANDLING:
        warnings.append(
            f"{ERROR_HANDLING}={handling} in the environment has torch end this worker when a "
            "collective fails, as one does when a peer is lost: the survivors of a lost node "
            f"would die with it instead of recovering in place. Fix: unset {ERROR_HANDLING} "
            "(the runtime then sets 0), or set it to 0 or 2"
        )
    if NONBLOCKING_TIMEOUT not in environ:
        add[NONBLOCKING_TIMEOUT] = str(max(1, round(timeout_s)))
    add.update({k: v for k, v in NO_FAILURE_DUMP.items() if k not in environ})
    return add, warnings


def apply(timeout_s: float, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :func:`survivor_settings` in this process's environment, and log each warning.

    It runs before the process's first NCCL group. Returns what was added."""
    add, warnings = survivor_settings(environ, timeout_s)
    environ.update(add)
    for warning in warnings:
        log.warning(warning)
    return add
