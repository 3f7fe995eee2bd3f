"""The verdict of a campaign, from the run's event log: the invariants, each fault's recovery,
and the goodput.

Goodput is the samples trained and kept per second over the campaign, divided by what a
fault-free run of the same job trains per second at the same world sizes::

    goodput = kept samples / sum over steps of (fault-free rate at the step's world size)
                                               x (time since the step before)

"Kept" is the samples the last step has trained (a rollback to a checkpoint loses the samples
after it). Each step's time counts at the rate of the world that trained it, so a stall (the
time from a fault to the first step of the next round: detection, rendezvous, rebuild, sync)
and redone steps cost goodput, and a world made smaller by a dead node does not. The fault-free
rate at each world size is measured by a fault-free run of the same job (``campaign.baseline``).

The second figure, goodput of the nodes up, also charges the time a repaired node takes to train
again: each moment counts at the rate of the nodes that were up then (a killed or departed node
is down until the campaign starts it again, a frozen one until it is thawed).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from chaos.invariants import (
    history_violations,
    lr_violations,
    replica_violations,
    sample_violations,
)
from chaos.report import recovery
from elastic.config import Config

DOWN_SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM")  # a node given one of these is not up
RECOVERING_KINDS = ("node", "worker", "agent", "partition")  # injector kinds a round recovers from


@dataclass(frozen=True)
class FaultResult:
    number: int
    kind: str  # the injector's kind (node, worker, ...) and signal, or the campaign's kind
    target: str
    ts: float
    member: bool  # whether the target was in the round then (else nothing had to recover)
    detected_s: float | None
    stall_s: float | None  # None: no progress after it
    redone_steps: int
    lost_s: float | None
    breakdown: dict[str, float]


@dataclass
class Verdict:
    violations: dict[str, list[str]]  # invariant -> what broke it (empty lists: kept)
    faults: list[FaultResult]
    skipped: list[dict[str, Any]]  # faults that were due but could not be carried out
    kept_samples: int
    seconds: float
    rates: dict[int, float]  # world size -> fault-free samples/s
    reference_samples: float | None  # what fault-free runs would have trained meanwhile
    goodput: float | None
    goodput_of_nodes_up: float | None
    segments: list[tuple[float, float, int]] = field(default_factory=list)  # nodes up
    rates_from: str = "fault-free runs"  # or "the job's own steps" (attached to a job)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"ok": self.ok}, indent=1)


def capacity(events: list[dict[str, Any]], nodes: int, t0: float, t1: float) -> list[tuple]:
    """``(start, end, nodes up)`` segments covering ``[t0, t1]``, from the chaos events; the
    nodes up at first are the first round's members (``node<K>`` before any round)."""
    first = next((e for e in events if e["event"] == "round_formed"), None)
    up = set(first["members"]) if first else {f"node{i}" for i in range(nodes)}
    changes: list[tuple[float, str, bool]] = []
    for e in events:
        if e.get("role") != "chaos":
            continue
        if e["event"] == "fault_injected" and e["kind"] == "node":
            if e["signal"] in DOWN_SIGNALS:
                changes.append((e["ts"], e["target"], False))
        elif e["event"] == "fault_cleared" and e["kind"] in ("node", "restart"):
            changes.append((e["ts"], e["target"], True))
    segments, start = [], t0
    for ts, target, is_up in sorted(changes):
        if ts >= t1:
            break
        if ts > start:
            segments.append((start, ts, len(up)))
            start = ts
        (up.add if is_up else up.discard)(target)
    segments.append((start, t1, len(up)))
    return [s for s in segments if s[1] > s[0]]


def world_segments(events: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """``(previous step's time, step's time, its world size)`` for every step after the first:
    the time each step took, stalls included, at the world size that trained it."""
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["ts"])
    return [(a["ts"], b["ts"], b["world_size"]) for a, b in zip(steps, steps[1:], strict=False)]


def fault_free_rate(events: list[dict[str, Any]]) -> float:
    """Samples per second of a fault-free run, over its whole training (checkpoints and
    evaluations included, as in the campaign), from its first step to its last."""
    steps = [e for e in events if e["event"] == "step"]
    if len(steps) < 2:
        raise ValueError("a fault-free run needs at least two steps to give a rate")
    first, last = steps[0], steps[-1]
    return (last["samples"] - first["samples"]) / (last["ts"] - first["ts"])


def observed_rates(events: list[dict[str, Any]], nodes: int) -> dict[int, float]:
    """Fault-free rates from a campaign's own steps, where no fault-free run can be started (a
    job attached to): at each world size, the median rate between consecutive steps of one
    round, which leaves out stalls, and checkpoints and evaluations too (so it errs high, and
    goodput low). Every world size up to ``nodes`` that never trained two steps in a row is
    scaled from the nearest one that did."""
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["ts"])
    by_size: dict[int, list[float]] = {}
    for a, b in zip(steps, steps[1:], strict=False):
        if a["round"] == b["round"] and b["ts"] > a["ts"]:
            by_size.setdefault(b["world_size"], []).append(
                (b["samples"] - a["samples"]) / (b["ts"] - a["ts"])
            )
    rates = {w: statistics.median(r) for w, r in by_size.items()}
    if not rates:
        return {}
    sizes = {e["world_size"] for e in steps} | set(range(1, nodes + 1))
    for w in sizes - set(rates):
        near = min(rates, key=lambda m: abs(m - w))
        rates[w] = rates[near] * w / near
    return rates


def goodput(
    kept: int, segments: list[tuple[float, float, int]], rates: dict[int, float], min_nodes: int
) -> tuple[float, float]:
    """``(reference samples, goodput)``; a world below ``min_nodes`` trains nothing."""
    reference = 0.0
    for start, end, up in segments:
        if up >= min_nodes:
            reference += rates[up] * (end - start)
    return reference, (kept / reference if reference > 0 else 0.0)


def world_sizes(segments: list[tuple[float, float, int]], min_nodes: int) -> list[int]:
    """The world sizes a fault-free rate is needed for."""
    return sorted({up for _, _, up in segments if up >= min_nodes}, reverse=True)


def needed_sizes(events: list[dict[str, Any]], nodes: int, min_nodes: int) -> list[int]:
    """Every world size either goodput needs a fault-free rate for."""
    t0, t1, _ = training_span(events)
    both = world_segments(events) + capacity(events, nodes, t0, t1)
    return world_sizes(both, min_nodes)


def training_span(events: list[dict[str, Any]]) -> tuple[float, float, int]:
    """``(first step's time, last step's time, samples kept between them)``."""
    steps = [e for e in events if e["event"] == "step"]
    if len(steps) < 2:
        raise ValueError("the campaign's job trained fewer than two steps")
    last = max(steps, key=lambda e: e["ts"])
    return steps[0]["ts"], last["ts"], last["samples"] - steps[0]["samples"]


def checkpoint_violations(events: list[dict[str, Any]]) -> list[str]:
    """Checkpoints loaded that had been rejected (incomplete, or failing their manifest), or
    that this run never committed."""
    bad, rejected, committed = [], set(), set()
    for e in events:
        if e["event"] == "checkpoint_skipped":
            rejected.add(e["url"])
        elif e["event"] == "checkpoint_saved":
            committed.add(e["url"])
        elif e["event"] == "checkpoint_loaded":
            if e["url"] in rejected:
                bad.append(f"step {e['step']}: loaded {e['url']}, which failed its manifest")
            elif e["url"] not in committed:
                bad.append(f"step {e['step']}: loaded {e['url']}, which no rank committed")
    return bad


def invariants(events: list[dict[str, Any]], cfg: Config) -> dict[str, list[str]]:
    started = next((e for e in events if e["event"] == "training_started"), None)
    if started is None:
        return {"samples": ["training never started"]}
    total = started["total_samples"]
    per_epoch = round(total / cfg.trainer.epochs)
    return {
        "samples": sample_violations(events, per_epoch, total),
        "replicas": replica_violations(events) + history_violations(events),
        "lr": lr_violations(events, cfg, per_epoch),
        "checkpoints": checkpoint_violations(events),
    }


def fault_results(events: list[dict[str, Any]]) -> list[FaultResult]:
    """Each fault's recovery (:func:`chaos.report.recovery`). A fault on a node that was not in
    the round (it was still starting, or rejoining) stopped nothing: its detection and
    breakdown would be those of some later round, so they are left out."""
    injected = [e for e in events if e["event"] == "fault_injected" and e.get("role") == "chaos"]
    rounds = [e for e in events if e["event"] == "round_formed"]
    results = []
    for number, e in enumerate(injected, 1):
        rec = recovery(events, e["ts"])
        current = [r for r in rounds if r["ts"] < e["ts"]]
        member = bool(current) and e["target"].split("/")[0] in current[-1]["members"]
        # Only a fault that takes a member out of the round has a recovery of its own; after a
        # slow link, an etcd member or a bad shard, the next round is some later fault's.
        recovers = member and e["kind"] in RECOVERING_KINDS
        results.append(
            FaultResult(
                number=number,
                kind=f"{e['kind']} {e.get('signal', '')}".strip(),
                target=e["target"],
                ts=e["ts"],
                member=member,
                detected_s=rec.breakdown.get("detected") if recovers else None,
                stall_s=rec.stall_s,
                redone_steps=rec.redone_steps,
                lost_s=rec.lost_s,
                breakdown=rec.breakdown if recovers else {},
            )
        )
    return results


def judge(
    events: list[dict[str, Any]],
    cfg: Config,
    rates: dict[int, float] | None,
    rates_from: str = "fault-free runs",
) -> Verdict:
    """The verdict; ``rates`` None: no fault-free rates, no goodput."""
    t0, t1, kept = training_span(events)
    segments = capacity(events, cfg.cluster.nodes, t0, t1)
    reference, ratio, ratio_up = None, None, None
    if rates is not None:
        min_nodes = cfg.cluster.min_nodes
        reference, ratio = goodput(kept, world_segments(events), rates, min_nodes)
        ratio_up = goodput(kept, segments, rates, min_nodes)[1]
    return Verdict(
        violations=invariants(events, cfg),
        faults=fault_results(events),
        skipped=[e for e in events if e["event"] == "fault_skipped"],
        kept_samples=kept,
        seconds=t1 - t0,
        rates=rates or {},
        reference_samples=reference,
        goodput=ratio,
        goodput_of_nodes_up=ratio_up,
        segments=segments,
        rates_from=rates_from,
    )


def summary(v: Verdict) -> str:
    """The text a user reads first: the invariants, the faults, the goodput."""
    lines = ["invariants:"]
    for name, broken in v.violations.items():
        lines.append(f"  {name:12} {'kept' if not broken else 'BROKEN'}")
        lines += [f"    {b}" for b in broken[:10]]
    lines.append(f"faults: {len(v.faults)} carried out, {len(v.skipped)} skipped")
    lines.append(
        f"  {'#':>3} {'fault':16} {'target':27} {'detected':>12} {'stall':>11} {'redone':>7}"
    )
    for f in v.faults:
        detected = "-" if f.detected_s is None else f"{f.detected_s:.2f} s"
        if not f.member and f.kind.split()[0] in ("node", "worker"):
            detected = "not in round"  # nothing had to be detected
        stall = "no progress" if f.stall_s is None else f"{f.stall_s:.2f} s"
        lines.append(
            f"  {f.number:>3} {f.kind:16} {f.target:27} {detected:>12} {stall:>11} "
            f"{f.redone_steps:>7}"
        )
    for s in v.skipped:
        lines.append(f"  skipped: {s['kind']} {s['target']}: {s['reason']}")
    lines.append(f"training: {v.kept_samples} samples kept in {v.seconds:.1f} s")
    if v.goodput is None:
        lines.append("goodput: not measured (campaign.baseline=false)")
    else:
        rates = ", ".join(f"{w} nodes {r:.1f}/s" for w, r in sorted(v.rates.items()))
        lines.append(
            f"goodput: {100 * v.goodput:.1f} % ({v.kept_samples} kept / "
            f"{v.reference_samples:.0f} a fault-free run would have trained at the same world "
            f"sizes; fault-free {rates}, from {v.rates_from})"
        )
        lines.append(
            f"goodput of the nodes up: {100 * (v.goodput_of_nodes_up or 0):.1f} % (also charges "
            "the time a repaired node takes to train again)"
        )
    median = statistics.median([f.stall_s for f in v.faults if f.stall_s is not None] or [0])
    lines.append(f"median stall {median:.2f} s; verdict: {'PASS' if v.ok else 'FAIL'}")
    return "\n".join(lines)
