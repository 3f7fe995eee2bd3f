"""Several NCCL ranks on one GPU, and a survivor of a peer killed mid-all-reduce.

NCCL refuses two ranks of one communicator on one device of one host ("Duplicate GPU
detected": it compares the host's hash and the GPU's bus id). NCCL 2.28 takes the host's hash
from ``NCCL_HOSTID`` when it is set, so each rank here runs with a value of its own and passes
for a host of its own, its peers reached over sockets on loopback
(:func:`elastic.nccl_settings.own_host`). Whether NCCL then accepts them is what this
probes first, within ``--setup-timeout-s``; a refusal is reported word for word.

Then, through the project's own :class:`~elastic.communicator.Communicator`, as a worker runs
it: every rank all-reduces a tensor (its sum checked); the ranks but the last start an
all-reduce that the last never joins, the last is SIGKILLed while it is in flight, and each
survivor aborts its round from another thread as its agent link would. Recorded per survivor:
whether it lived, how its all-reduce ended, the abort's time, whether ``cuda.synchronize()``
returned, ``mem_get_info`` after, and the next round's group without the dead rank (its set-up
and first all-reduce, timed apart, and the sum checked), with the old group's teardown that runs
beside it (:mod:`elastic.group_reaper`). It runs under the runtime's settings for NCCL
(:mod:`elastic.nccl_settings`) once per ``--abort-after-s`` (how long after the kill the abort
comes), then under torch's defaults for the first of them (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``,
whose watchdog may end a survivor, and the flight recorder's dump on a failure, which a
survivor's next group may wait for). On CUDA each rank logs NCCL's set-up and proxy
(``NCCL_DEBUG=INFO``, subsystems INIT and PROXY) unless ``NCCL_DEBUG`` is set.

``--device cpu`` runs the same on gloo, so that CI keeps this script working before a GPU comes::

    .venv/bin/python bench/nccl_ranks.py --device cpu --json /tmp/ranks.json
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROUND_TIMEOUT_S = 30.0  # the groups' own timeout (--round-timeout-s): a hang beyond it fails
SYNC_TIMEOUT_S = 10.0  # how long cuda.synchronize() may take after the abort
KILL_AFTER_S = 0.5  # the survivors' all-reduce in flight this long before the kill
ABORT_AFTER_S = 0.5  # and the abort this long after it (--abort-after-s)
EXIT_WAIT_S = 15.0  # how long a rank may take to end by itself at the end
STACKS_WAIT_S = 2.0  # how long a stuck rank gets to write its threads' stacks before the kill
# torch's own defaults for what elastic.nccl_settings sets: given explicitly, they are kept.
TORCH_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": "1800",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000",
}
SETTINGS = ("ours", "torch")  # ours first: a proof cut short still has the one that matters


# --- one rank -------------------------------------------------------------------------------


def say(**fields: Any) -> None:
    """One JSON line to the parent."""
    print(json.dumps(fields), flush=True)


def round_of(rank: int, size: int, number: int, port: int) -> Any:
    """Rank ``rank``'s assignment to round ``number`` of ``size`` ranks, on the parent's store."""
    from elastic.control import Assignment

    return Assignment(
        round=number,
        rank=rank,
        world_size=size,
        store_host="127.0.0.1",
        store_port=port,
        formed_at=0,
    )


def enter_and_check(comm: Any, assignment: Any) -> dict[str, Any]:
    """Enter ``assignment``'s round and all-reduce each rank's number.

    The set-up and the first all-reduce are timed apart, and it says whether the sum is right."""
    import torch

    began = time.perf_counter()
    comm.enter(assignment)
    entered = time.perf_counter()
    size = assignment.world_size
    value = torch.full((1 << 20,), float(assignment.rank + 1), device=comm.device)
    comm.all_reduce(value, "probe")
    return {
        "ok": value[0].item() == size * (size + 1) / 2,
        "enter_s": entered - began,
        "allreduce_s": time.perf_counter() - entered,
        "backend": comm.backend,
    }


def survive_the_cut(comm: Any, round_timeout_s: float) -> dict[str, Any]:
    """Run an all-reduce that the last rank never joins, cut by its death.

    The abort comes from another thread when the parent writes ``abort``. It returns how it ended,
    the abort's time, and the device afterwards."""
    import torch

    from elastic.round_end import RoundAborted

    aborted: dict[str, Any] = {}
    done = threading.Event()

    def abort_on_word() -> None:
        for line in iter(sys.stdin.readline, ""):
            if line.strip() == "abort":
                began = time.perf_counter()
                comm.abort("the probe's peer was killed", before_round=2)
                aborted["s"] = time.perf_counter() - began
                aborted["group_aborted"] = comm._group_aborted
                done.set()
                return

    threading.Thread(target=abort_on_word, daemon=True).start()
    cut = torch.ones(1 << 20, device=comm.device)
    say(event="in_flight")
    began = time.perf_counter()
    try:
        comm.all_reduce(cut, "cut")
        ended = "completed"
    except RoundAborted:
        ended = "aborted"
    except Exception as exc:  # the transport's own error: how it failed is the finding
        ended = f"{type(exc).__name__}: {str(exc)[:200]}"
    waited_s = time.perf_counter() - began
    # As a worker waits for its agent's next assignment, which aborts the round first: a
    # collective of NCCL's returns to the host once queued, so the host is here long before the
    # peer's death is known.
    done.wait(round_timeout_s)
    synced = threading.Event()
    free = total = 0
    if comm.device.type == "cuda":

        def synchronize() -> None:
            torch.cuda.synchronize()
            synced.set()

        threading.Thread(target=synchronize, daemon=True).start()
        synced.wait(SYNC_TIMEOUT_S)
        free, total = torch.cuda.mem_get_info()
    else:
        synced.set()
    return {
        "all_reduce": ended,
        "waited_s": waited_s,
        "abort_s": aborted.get("s"),
        "group_aborted": aborted.get("group_aborted"),  # or found idle and healthy: destroyed
        "synchronized": synced.is_set(),
        "free_mib": free >> 20,
        "total_mib": total >> 20,
    }


def rank_main(args: argparse.Namespace) -> int:
    """Run one rank: set up and all-reduce, then live through the cut or wait for the kill.

    A survivor lives through the last rank's death (:func:`survive_the_cut`) and enters the next
    round without it, while the last rank waits to be killed."""
    import torch

    sys.path.insert(0, str(REPO))
    from elastic.communicator import Communicator

    # Where a rank that never ends is stuck: its threads' stacks, into its log, on the parent's
    # word before the kill (Rank.close).
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    rank, world = args.rank, args.world
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = Communicator(device, args.round_timeout_s)
    say(event="allreduce", **enter_and_check(comm, round_of(rank, world, 1, args.port)))
    if rank == world - 1:
        say(event="victim")
        time.sleep(3600)  # until killed
        return 1
    say(event="survived", **survive_the_cut(comm, args.round_timeout_s))
    say(event="next_group", **enter_and_check(comm, round_of(rank, world - 1, 2, args.port)))
    drained = comm.reaper.drain(args.round_timeout_s)  # the first group's, beside the second
    say(event="teardown", ended=drained, seconds=comm.reaper.teardown_s[:1])
    comm.close(wait_s=args.round_timeout_s)
    return 0


# --- the parent -----------------------------------------------------------------------------


class Rank:
    """A rank's process and the JSON lines it said, read as they come."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.said: list[dict[str, Any]] = []
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self.said.append(json.loads(raw))
            except ValueError:
                self._log.write(raw)

    def has(self, event: str) -> dict[str, Any] | None:
        return next((s for s in self.said if s["event"] == event), None)

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{word}\n".encode())
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died: what it said says so
            pass

    def _write_native_stacks(self) -> None:
        """py-spy's dump of the rank's threads, C++ frames too, into its log (if py-spy is here)."""
        spy = shutil.which("py-spy")
        if spy is None:
            return
        self._log.write(b"\n--- py-spy dump --native, before the kill ---\n")
        self._log.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):
            argv = [spy, "dump", "--native", "--pid", str(self.proc.pid)]
            subprocess.run(
                argv, stdout=self._log, stderr=subprocess.STDOUT, timeout=STACKS_WAIT_S * 5
            )

    def close(self) -> None:
        """Let it end by itself (its stdin closed), within :data:`EXIT_WAIT_S`; else kill it.

        A rank killed so first writes its threads' stacks into its log (SIGUSR1), after py-spy's
        native ones where py-spy is installed."""
        with contextlib.suppress(BrokenPipeError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._write_native_stacks()
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STACKS_WAIT_S)
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        self._log.close()


def wait_all(ranks: list[Rank], event: str, timeout_s: float) -> bool:
    """Until every rank said ``event`` (True), one of them exited first or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(r.has(event) for r in ranks):
            return True
        if any(r.proc.poll() is not None and not r.has(event) for r in ranks):
            return False
        time.sleep(0.02)
    return False


def one_run(
    args: argparse.Namespace, settings: str, abort_after_s: float, logs: Path
) -> dict[str, Any]:
    """The probe under ``settings``: what each rank said, and how each process ended."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from elastic.nccl_settings import own_host

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tag = uuid.uuid4().hex[:8]
    name = f"{settings}-abort{abort_after_s:g}s"
    debug = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,PROXY"}
    ranks = []
    for rank in range(args.ranks):
        env = {
            **(debug if args.device == "cuda" and "NCCL_DEBUG" not in os.environ else {}),
            **os.environ,
            **own_host(f"elastic-probe-{tag}-{rank}"),
            "RES_OPTIONS": "attempts:0",  # no DNS for the store's peer names (nccl_lifecycle.py)
            **(TORCH_DEFAULTS if settings == "torch" else {}),
        }
        argv = [sys.executable, __file__, f"--device={args.device}", f"--rank={rank}"]
        argv += [f"--world={args.ranks}", f"--port={store.port}"]
        argv += [f"--round-timeout-s={args.round_timeout_s}"]
        ranks.append(Rank(argv, env, logs / f"{name}-rank{rank}.log"))
    survivors, victim = ranks[:-1], ranks[-1]
    out: dict[str, Any] = {"settings": settings, "abort_after_s": abort_after_s}
    try:
        out["set_up"] = wait_all(ranks, "allreduce", args.setup_timeout_s)
        ready = out["set_up"] and wait_all([victim], "victim", 10)
        if ready and wait_all(survivors, "in_flight", 10):
            time.sleep(KILL_AFTER_S)
            os.kill(victim.proc.pid, signal.SIGKILL)
            time.sleep(abort_after_s)
            for r in survivors:
                r.tell("abort")
            wait_all(survivors, "next_group", args.round_timeout_s + SYNC_TIMEOUT_S + 10)
            wait_all(survivors, "teardown", args.round_timeout_s + 5)
    finally:
        for r in ranks:
            r.close()
    out["ranks"] = [
        {
            "rank": i,
            "exit": r.proc.returncode,
            **{s["event"]: {k: v for k, v in s.items() if k != "event"} for s in r.said},
        }
        for i, r in enumerate(ranks)
    ]
    if not out["set_up"]:  # the refusal, word for word: the last lines of each rank's log
        out["refusal"] = {
            f"rank{i}": (logs / f"{name}-rank{i}.log").read_text(errors="replace")[-1500:]
            for i in range(len(ranks))
        }
    return out


def headline(run: dict[str, Any]) -> str:
    """One line for a run: set up or refused; the survivors' fate, abort and rebuild times."""
    label = f"{run['settings']}: abort {run['abort_after_s']:g} s after the kill"
    if not run["set_up"]:
        return f"{label}: {len(run['ranks'])} ranks not set up (see refusal)"
    survivors = run["ranks"][:-1]
    lived = [r for r in survivors if "survived" in r]
    rebuilt = [r for r in survivors if r.get("next_group", {}).get("ok")]
    aborts = [r["survived"]["abort_s"] for r in lived if r["survived"].get("abort_s") is not None]
    enters = [r["next_group"]["enter_s"] for r in rebuilt]
    firsts = [r["next_group"]["allreduce_s"] for r in rebuilt]
    teardowns = [s for r in rebuilt for s in r.get("teardown", {}).get("seconds", [])]
    text = f"{label}: {len(lived)}/{len(survivors)} survivors lived"
    text += f", {len(rebuilt)} in the next group"
    if aborts:
        text += f"; abort {max(aborts):.3f} s"
    if enters:
        text += f", next group set up in {max(enters):.3f} s"
        text += f" and its first all-reduce {max(firsts):.3f} s"
    if teardowns:
        text += f"; old group torn down beside it in {max(teardowns):.3f} s"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ranks", type=int, default=3, help="2 or more; the last is killed")
    parser.add_argument("--settings", choices=(*SETTINGS, "both"), default="both")
    parser.add_argument("--setup-timeout-s", type=float, default=20.0)
    parser.add_argument(
        "--round-timeout-s",
        type=float,
        default=ROUND_TIMEOUT_S,
        help="the groups' timeout, and how long a survivor waits for its abort",
    )
    parser.add_argument(
        "--abort-after-s",
        type=float,
        nargs="+",
        default=[ABORT_AFTER_S],
        help="how long after the kill the survivors' abort comes: a run under ours for each",
    )
    parser.add_argument("--json", type=Path, help="the report, rewritten after each run")
    parser.add_argument("--logs", type=Path, help="each rank's log (default: beside --json)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank's own process
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    if args.ranks < 2:
        parser.error("--ranks must be 2 or more: the last one is killed")
    logs = args.logs or (args.json.parent if args.json else Path.cwd())
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": args.device, "ranks": args.ranks, "runs": []}
    plan = [("ours", after) for after in args.abort_after_s]
    plan += [("torch", args.abort_after_s[0])]
    for settings, after in plan:
        if args.settings not in (settings, "both"):
            continue
        run = one_run(args, settings, after, logs)
        report["runs"].append(run)
        print(headline(run), flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    ours = [r for r in report["runs"] if r["settings"] == "ours"]
    ok = all(
        run["set_up"] and all(r.get("next_group", {}).get("ok") for r in run["ranks"][:-1])
        for run in ours
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
