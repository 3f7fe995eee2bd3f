"""The communicator's round life cycle, repeated in one process: does rebuilding leak?

A worker lives across rounds and only its process group is replaced (``Communicator.enter``),
so whatever a group leaves behind when it is aborted and destroyed (file descriptors, threads,
NCCL's device memory) piles up for the whole job, one round at a time. This bench runs that
cycle ``--rounds`` times in one process with one rank, through the project's own
:class:`~elastic.communicator.Communicator` (NCCL on ``cuda``, gloo on ``cpu``) and a real local
``TCPStore`` hosted as an agent hosts it: enter round k, all-reduce a tensor (its value checked)
and pass the round's abortable barrier, then abort the round from another thread as the worker's
agent link does when a newer round is announced, and enter round k+1. It measures each rebuild
(abort until the next group has done its first all-reduce), the old group's shutdown that runs
beside it (:mod:`elastic.group_reaper`), and, after each round, the process's open fds, its
threads (Python's and the OS's), its resident memory and, on ``cuda``, the caching allocator's
and the device's used memory.

The rule: each measure's highest from round 3 (the rounds before it warm up one-time state: the
CUDA context, NCCL's and gloo's) to the middle round is the baseline, and the last round may
exceed it by at most :data:`ALLOWANCE` (:func:`baseline_rounds`); a run of three rounds or fewer
compares its last round to the one before. The
run fails (exit 1) when a measure grew beyond that, an all-reduce gave a wrong value, or a step
raised. What the process still holds after the last round's ``close()`` is reported beside what
it held before the first round, not judged (CUDA and NCCL keep one-time state). The JSON
(``--json``) is rewritten after every round, so a run cut short still leaves what it measured.

Every TCPStore connection looks its peer's address up in DNS (torch's c10d names the socket's
peer, here ``::ffff:127.0.0.1``, which ``/etc/hosts`` rarely lists), on the client's side and on
the store's; a resolver that drops the query holds that round's set-up for glibc's 5 s timeout
(on this project's CPU machine, about one connection in 25). That is the resolver's time, not the
group's, and on a machine without a network it could spend the whole time bound: unless
``RES_OPTIONS`` is set, this bench sets ``attempts:0``, so that no query is sent (torch warns
once that it cannot name the peer, and names it by its address).

What one GPU cannot show: NCCL refuses two ranks of one communicator on one device, so every
group here has one rank. The all-reduce crosses no link, the abort interrupts no collective
waiting on a peer (the rank's own collectives have completed), and
``torch.distributed.shrink_group``, which the communicator uses when a round only removed ranks,
needs a group of two or more: here it is only probed (is it there, does the backend support it,
does it accept the communicator's arguments up to the group's size check), never run.

    .venv/bin/python bench/nccl_lifecycle.py --device cpu --rounds 20 --json /tmp/lifecycle.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

# One process holds the only rank: every NCCL bootstrap socket is local (the lent GPU machine
# has no network, and NCCL would otherwise pick an interface for it).
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
# Read by glibc at the process's first DNS lookup (see the docstring: the store's peer names).
os.environ.setdefault("RES_OPTIONS", "attempts:0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic.communicator import Communicator  # noqa: E402
from elastic.control import Assignment  # noqa: E402

BASELINE_ROUND = 3  # the rounds before it warm up one-time state
MIB = 1 << 20
# How far the last round may lie above the baseline: a stray thread or socket still closing
# when the sample is taken; on cuda, the driver's own slack.
ALLOWANCE: dict[str, float] = {
    "fds": 2,
    "py_threads": 1,
    "os_threads": 2,
    "rss_mib": 32,
    "cuda_allocated_mib": 1,
    "cuda_reserved_mib": 2,
    "device_used_mib": 16,
}


def resources(device: torch.device) -> dict[str, float]:
    """What a leaked group would hold: fds, threads, host memory, and on cuda the GPU's."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    sample: dict[str, float] = {
        "fds": len(os.listdir("/proc/self/fd")),
        "py_threads": threading.active_count(),
        "os_threads": int(fields["Threads"]),
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,  # kB
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        sample["cuda_allocated_mib"] = torch.cuda.memory_allocated(device) / MIB
        sample["cuda_reserved_mib"] = torch.cuda.memory_reserved(device) / MIB
        sample["device_used_mib"] = (total - free) / MIB
    return sample


def checked_allreduce(comm: Communicator, value: float) -> bool:
    """All-reduce a tensor on the device through the round's group; whether the sum is right."""
    tensor = torch.full((1024,), value, device=comm.device)
    with comm.collective("checked all-reduce"):
        dist.all_reduce(tensor)
    expected = value * dist.get_world_size()
    return bool(torch.all(tensor == expected).item())  # .item() waits for the device


def shrink_support(comm: Communicator) -> dict[str, Any]:
    """Probe what this torch and backend offer for the communicator's shrink path.

    It probes the live one-rank group: ``shrink_group`` validates its arguments (the flag included)
    before refusing a group of one rank, so the probe changes nothing. Any refusal is the probe's
    answer."""
    c10d = dist.distributed_c10d
    info: dict[str, Any] = {
        "shrink_group": hasattr(dist, "shrink_group"),
        "shrink_abort_flag": hasattr(c10d, "SHRINK_ABORT"),
        "backend_supports_shrinking": None,
        "probe": "not asked: this torch lacks shrink_group or its SHRINK_ABORT flag",
        "why_not_run": "a round that removes no rank cannot shrink, and one device holds one "
        "NCCL rank: a real shrink needs a group of two or more GPUs",
    }
    try:
        backend = c10d._get_default_group()._get_backend(comm.device)
        info["backend_supports_shrinking"] = getattr(backend, "supports_shrinking", None)
        if info["shrink_group"] and info["shrink_abort_flag"]:
            dist.shrink_group([0], shrink_flags=c10d.SHRINK_ABORT)
            info["probe"] = "shrink_group accepted a one-rank group (unexpected)"
    except Exception as exc:
        info["probe"] = f"{type(exc).__name__}: {exc}"[:300]
    return info


def baseline_rounds(measured: int) -> range:
    """The rounds (1-based) the last one is compared to.

    They run from round 3 to the middle of the run, or in a short run are the one before the last;
    empty for a single round, which cannot show growth. A window, not one round: on an H200,
    NCCL's host memory warmed up until round 6. It then alternated between two levels 31 MiB apart
    (the allocator's arenas) for good."""
    if measured < 2:
        return range(0)
    if measured <= BASELINE_ROUND:
        return range(measured - 1, measured)
    return range(BASELINE_ROUND, max(measured // 2, BASELINE_ROUND) + 1)


def grown(rounds: list[dict[str, Any]]) -> list[str]:
    """The measures whose last value exceeds their highest in :func:`baseline_rounds` by too much.

    Too much is more than the allowance: a leak of a few MiB a round does, over the run's second
    half."""
    window = baseline_rounds(len(rounds))
    if not window:
        return []
    last = rounds[-1]
    found = []
    for name, allowed in ALLOWANCE.items():
        if name not in last:
            continue
        base = max(rounds[i - 1][name] for i in window)
        if last[name] - base > allowed:
            found.append(
                f"{name} {base:g} -> {last[name]:g} "
                f"(rounds {window[0]}-{window[-1]}'s highest -> round {last['round']})"
            )
    return found


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    """Replace ``path`` whole, so a run killed mid-write leaves the previous round's report."""
    if path is None:
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, path)


def row(r: dict[str, Any]) -> str:
    """One round's line of the table."""
    rebuild = f"{r['rebuild_s']:.3f}" if r["rebuild_s"] is not None else f"({r['enter_s']:.3f})"
    teardown = f"{r['teardown_s']:.3f}" if r["teardown_s"] is not None else "-"
    gpu = f"{r['device_used_mib']:>8.0f}" if "device_used_mib" in r else f"{'-':>8}"
    return (
        f"{r['round']:>5}  {rebuild:>9}  {teardown:>10}  {r['fds']:>4}"
        f"  {r['py_threads']:>4}/{r['os_threads']:<4}"
        f"  {gpu}  {'ok' if r['allreduce_ok'] else 'WRONG'}"
    )


def one_round(comm: Communicator, number: int, store_port: int) -> dict[str, Any]:
    """Leave the previous round as the agent link does, enter round ``number`` and use it."""
    started = time.monotonic()
    if number > 1:  # the agent link announcing round `number`, on a thread of its own
        link = threading.Thread(
            target=comm.abort, args=(f"round {number} was formed", number), name="agent-link"
        )
        link.start()
        link.join()
    entering = time.monotonic()
    comm.enter(
        Assignment(
            round=number,
            rank=0,
            world_size=1,
            store_host="127.0.0.1",
            store_port=store_port,
            formed_at=time.time(),
        )
    )
    entered = time.monotonic()
    correct = checked_allreduce(comm, float(number))
    usable = time.monotonic()
    comm.barrier(f"round {number}")  # the abortable, tracked collective a round ends with
    # The old group's shutdown runs beside the round (elastic.group_reaper): it is timed apart,
    # and ended before the sample, so that a teardown still running is not taken for a leak.
    drained = comm.reaper.drain(comm.timeout.total_seconds())
    return {
        "round": number,
        "rebuild_s": usable - started if number > 1 else None,
        "abort_s": entering - started if number > 1 else None,
        "enter_s": entered - entering,
        "first_allreduce_s": usable - entered,
        "teardown_s": comm.reaper.teardown_s[-1] if number > 1 and drained else None,
        "allreduce_ok": correct,
    } | resources(comm.device)


def verdict(report: dict[str, Any]) -> tuple[bool, str]:
    """Whether the run passed, and the line that says so (the proof's headline: printed last)."""
    measured = report["rounds"]
    report["grew"] = grown(measured)
    wrong = [r["round"] for r in measured if not r["allreduce_ok"]]
    problems = [f"grew: {g}" for g in report["grew"]] + [f"wrong all-reduce: {n}" for n in wrong]
    problems += report["errors"]
    if problems:
        return False, "FAIL: " + "; ".join(problems)
    rebuild, teardown = report.get("rebuild_s"), report.get("teardown_s")
    timing = (
        f"rebuild median {rebuild['median']:.3f} s (max {rebuild['max']:.3f} s), "
        if rebuild
        else ""
    )
    if teardown:
        timing += f"old group's teardown beside it {teardown['median']:.3f} s, "
    window = baseline_rounds(len(measured))
    growth = (
        f"nothing grew beyond rounds {window[0]}-{window[-1]}'s"
        if window
        else "growth not judged (one round)"
    )
    return True, f"OK: {len(measured)} round(s), {timing}{growth}, every all-reduce right"


def run(device: torch.device, rounds: int, timeout_s: float, out: Path | None) -> int:
    """The rounds, the table and the verdict; the exit code."""
    # Hosted as the agent hosts it (launcher/agent/agent.py), the round's ranks its clients.
    store = dist.TCPStore(
        "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    comm = Communicator(device, timeout_s=timeout_s)
    before = resources(device)
    report: dict[str, Any] = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "backend": comm.backend,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "res_options": os.environ.get("RES_OPTIONS"),
        "rounds_requested": rounds,
        "rule": f"the last round's measures may exceed their highest from round {BASELINE_ROUND} "
        f"to the middle round (in a run of {BASELINE_ROUND} rounds or fewer, the one before the "
        "last's) by the allowance",
        "allowance": {k: v for k, v in ALLOWANCE.items() if k in before},
        "before": before,
        "rounds": [],
        "errors": [],
    }
    print(f"{comm.backend} on {report['gpu'] or device}, torch {torch.__version__}, one rank")
    print("round  rebuild s  teardown s   fds  threads   GPU MiB  all-reduce")
    print("       (first set-up in brackets; teardown: the old group's, beside the round;")
    print("       threads: python/os; GPU: the device's used memory)")
    for number in range(1, rounds + 1):
        try:
            report["rounds"].append(one_round(comm, number, store.port))
        except Exception as exc:
            report["errors"].append(f"round {number}: {type(exc).__name__}: {exc}"[:500])
            print(f"round {number} failed: {report['errors'][-1]}")
            break
        print(row(report["rounds"][-1]), flush=True)
        write_json(out, report)
    if not report["errors"]:
        try:
            report["shrink"] = shrink_support(comm)
            comm.abort("the bench is over")
            comm.close(wait_s=timeout_s)
            report["after_close"] = resources(device)
        except Exception as exc:
            report["errors"].append(f"shrink probe or close: {type(exc).__name__}: {exc}"[:500])
    teardowns = [r["teardown_s"] for r in report["rounds"] if r["teardown_s"] is not None]
    if teardowns:
        report["teardown_s"] = {"median": statistics.median(teardowns), "max": max(teardowns)}
        print(
            f"teardown beside the next round: median {statistics.median(teardowns):.3f} s, "
            f"max {max(teardowns):.3f} s"
        )
    rebuilds = [r["rebuild_s"] for r in report["rounds"] if r["rebuild_s"] is not None]
    if rebuilds:
        report["rebuild_s"] = {
            "median": statistics.median(rebuilds),
            "min": min(rebuilds),
            "max": max(rebuilds),
        }
        print(
            f"rebuild: median {statistics.median(rebuilds):.3f} s, "
            f"min {min(rebuilds):.3f} s, max {max(rebuilds):.3f} s over {len(rebuilds)}"
        )
    if "shrink" in report:
        shrink = report["shrink"]
        print(
            f"shrink: shrink_group {'present' if shrink['shrink_group'] else 'absent'}, "
            f"backend supports shrinking: {shrink['backend_supports_shrinking']}; "
            f"probe: {shrink['probe']}"
        )
        print(f"        not run: {shrink['why_not_run']}")
    if "after_close" in report:
        print(f"after close: {report['after_close']}; before round 1: {report['before']}")
    report["ok"], report["verdict"] = verdict(report)
    print(report["verdict"], flush=True)
    write_json(out, report)
    return 0 if report["ok"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, help="the report, rewritten after every round")
    parser.add_argument(
        "--timeout", type=float, default=60, help="the group's and the store's timeout, s"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)  # NCCL binds the group to an indexed device
        torch.cuda.mem_get_info(device)  # the CUDA context, before the first sample
    return run(device, args.rounds, args.timeout, args.json)


if __name__ == "__main__":
    sys.exit(main())
