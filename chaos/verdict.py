"""The verdict of a campaign, from its event log: the invariants, each recovery and the goodput.

Goodput is the samples trained and kept, as a fraction of what the same job trains at its own
fault-free pace in the same time (:func:`goodput`). The pace at each world size is the campaign's
own (:func:`pace`), so no separate fault-free run is needed and none can be slow or fast on a day
of its own. A stall (from a fault to the first step of the next round: detection, rendezvous,
rebuild, sync), a hang and redone steps cost goodput, and a world made smaller by a dead node
does not. The second figure, goodput of the nodes up, also charges the time a repaired node takes
to train again: each moment counts at the pace of the nodes that were up then (:func:`capacity`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from chaos.invariants import (
    contract_violations,
    history_violations,
    lr_violations,
    replica_violations,
    sample_violations,
)
from chaos.recovery_figures import recovery
from elastic import config
from elastic import event_types as ev
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
    rates: dict[int, float]  # world size -> the campaign's own fault-free pace, samples/s
    reference_samples: float | None  # what the job trains at that pace in the same time
    goodput: float | None  # None: no world size trained two steps in a row (no pace)
    goodput_of_nodes_up: float | None
    # The same goodput over the steps before the first fault: what this definition gives the
    # job when nothing goes wrong (checkpoint stalls, evaluations, jitter); None without one.
    fault_free_goodput: float | None = None
    segments: list[tuple[float, float, int]] = field(default_factory=list)  # nodes up

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"ok": self.ok}, indent=1)


@dataclass(frozen=True)
class Interval:
    """The time from one step to the next, with the world size and samples of the later one.

    The world size is the one that trained the later step; the samples are those it trained (0:
    time in which the job trained nothing, such as a dead job's)."""

    start: float
    end: float
    world: int
    samples: int


def capacity(events: list[dict[str, Any]], nodes: int, t0: float, t1: float) -> list[tuple]:
    """Segments ``(start, end, nodes up)`` covering ``[t0, t1]``, from the chaos events.

    The nodes up at first are the first round's members (``node<K>`` before any round). A killed
    or departed node is down until the campaign starts it again, a frozen one until it is thawed."""
    first = next((e for e in events if ev.ROUND_FORMED.matches(e)), None)
    up = set(first["members"]) if first else {f"node{i}" for i in range(nodes)}
    changes: list[tuple[float, str, bool]] = []
    for e in events:
        if e.get("role") != "chaos":
            continue
        if ev.FAULT_INJECTED.matches(e) and e["kind"] == "node":
            if e["signal"] in DOWN_SIGNALS:
                changes.append((e["ts"], e["target"], False))
        elif ev.FAULT_CLEARED.matches(e) and e["kind"] in ("node", "restart"):
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


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``step`` events (rank 0's: one per step trained), in time order."""
    return sorted(ev.STEP.of(events), key=lambda e: e["ts"])


def intervals(events: list[dict[str, Any]]) -> list[Interval]:
    """One :class:`Interval` for every step event after the first.

    Each holds the time since the one before, stalls included, at the world size that trained it,
    and the samples gained (none after a rollback)."""
    steps = steps_of(events)
    return [
        Interval(a["ts"], b["ts"], b["world_size"], max(0, b["samples"] - a["samples"]))
        for a, b in zip(steps, steps[1:], strict=False)
    ]


def pace(events: list[dict[str, Any]], nodes: int) -> dict[int, float]:
    """The job's own fault-free pace: the median samples/s at each world size.

    It is taken between consecutive steps of one round, which leaves out stalls (and, being a
    median, checkpoint and evaluation steps). Every world size up to ``nodes`` that never trained
    two steps in a row is scaled from the nearest one that did."""
    steps = steps_of(events)
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


WINDOW_S = 10.0  # goodput's windows: long enough to even out a step's jitter, short next to a fault


def goodput(
    kept: int,
    spans: list[Interval],
    rates: dict[int, float],
    min_nodes: int,
    up: list[tuple[float, float, int]] | None = None,
    window_s: float = WINDOW_S,
) -> tuple[float, float]:
    """Compute ``(reference samples, goodput)`` of ``kept`` samples trained over ``spans``.

    The definition::

        goodput = kept samples / sum over windows of
                  max(the samples the window's steps trained,
                      its time x the pace at each step's world size)

    Each span counts at the pace of the world size that trained it, or, with ``up``
    (:func:`capacity`), of the nodes up meanwhile (a world below ``min_nodes`` trains nothing).
    "Kept" is the samples the last step has trained (a rollback to a checkpoint loses the
    samples after it). The spans are taken in windows of ``window_s`` seconds (0: each alone),
    and each window counts at least the samples it trained: the kept samples never exceed the
    reference, so goodput is at most 1 by construction, and within a window the jitter of single
    steps (a checkpoint's copy, a busy core) evens out, which a cap on every step would charge in
    full to a job whose steps are irregular and not to one whose steps are regular. What the
    median pace leaves out is still charged (checkpoint stalls and evaluations, steps slower than
    usual), so a fault-free stretch of the same job scores a little under 1
    (:attr:`Verdict.fault_free_goodput`)."""

    def fault_free(s: Interval) -> float:
        if up is None:
            return rates[s.world] * (s.end - s.start)
        return sum(
            rates[n] * (min(b, s.end) - max(a, s.start))
            for a, b, n in up
            if n >= min_nodes and b > s.start and a < s.end
        )

    reference = trained = paced = 0.0
    opened = spans[0].start if spans else 0.0
    for s in spans:
        if s.end - opened > window_s and (trained or paced):  # s would overrun: close the window
            reference += max(trained, paced)
            trained = paced = 0.0
            opened = s.start
        trained += s.samples
        paced += fault_free(s)
    reference += max(trained, paced)
    return reference, (kept / reference if reference > 0 else 0.0)


def training_span(events: list[dict[str, Any]]) -> tuple[float, float, int]:
    """``(first step's time, last step's time, samples kept between them)``."""
    steps = steps_of(events)
    if len(steps) < 2:
        raise ValueError("the campaign's job trained fewer than two steps")
    return steps[0]["ts"], steps[-1]["ts"], steps[-1]["samples"] - steps[0]["samples"]


def checkpoint_violations(events: list[dict[str, Any]]) -> list[str]:
    """Checkpoint violations: bad checkpoints loaded, and corrupted shards not refused.

    The bad ones are checkpoints loaded that had been rejected (incomplete, or failing their
    manifest), or that this run never committed. The shards are those the campaign corrupted that
    their verification did not refuse (or that were never verified)."""
    bad, rejected, committed, verified = [], set(), set(), {}
    for e in events:
        if ev.CHECKPOINT_SKIPPED.matches(e):
            rejected.add(e["url"])
        elif ev.CHECKPOINT_SAVED.matches(e):
            committed.add(e["url"])
        elif ev.CHECKPOINT_VERIFIED.matches(e):
            verified[e["target"]] = e["refused"]
        elif ev.CHECKPOINT_LOADED.matches(e):
            if e["url"] in rejected:
                bad.append(f"step {e['step']}: loaded {e['url']}, which failed its manifest")
            elif e["url"] not in committed:
                bad.append(f"step {e['step']}: loaded {e['url']}, which no rank committed")
    for e in events:
        if ev.FAULT_INJECTED.matches(e) and e.get("kind") == "checkpoint":
            if e["target"] not in verified:
                bad.append(f"{e['target']} was corrupted and never verified")
            elif verified[e["target"]] is None:
                bad.append(f"{e['target']} was corrupted and its verification passed it")
    return bad


def invariants(events: list[dict[str, Any]], cfg: Config) -> dict[str, list[str]]:
    started = next((e for e in events if ev.TRAINING_STARTED.matches(e)), None)
    if started is None:
        return {"samples": ["training never started"]}
    total = started["total_samples"]
    per_epoch = round(total / cfg.trainer.epochs)
    return {
        "samples": sample_violations(events, per_epoch, total),
        "replicas": replica_violations(events) + history_violations(events),
        "lr": lr_violations(events, cfg, per_epoch),
        "checkpoints": checkpoint_violations(events),
        "events": contract_violations(events),
    }


def fault_results(events: list[dict[str, Any]]) -> list[FaultResult]:
    """Each fault's recovery (:func:`chaos.recovery_figures.recovery`).

    A fault on a node that was not in the round (it was still starting, or rejoining) stopped
    nothing. Its detection and breakdown would be those of some later round, so they are left
    out."""
    injected = [e for e in events if ev.FAULT_INJECTED.matches(e) and e.get("role") == "chaos"]
    rounds = ev.ROUND_FORMED.of(events)
    results = []
    for number, e in enumerate(injected, 1):
        rec = recovery(events, e["ts"])
        current = [r for r in rounds if r["ts"] < e["ts"]]
        member = bool(current) and e["target"].split("/")[0] in current[-1]["members"]
        # Only a fault that takes a member out of the round has a recovery of its own; after a
        # slow link, an etcd member or a bad shard, the next round is some later fault's.
        recovers = member and e["kind"] in RECOVERING_KINDS
        found = responses(events, e)
        results.append(
            FaultResult(
                number=number,
                kind=f"{e['kind']} {e.get('signal', '')}".strip(),
                target=e["target"],
                ts=e["ts"],
                member=member,
                detected_s=rec.breakdown.get("detected")
                if recovers
                else min(found.values(), default=None),
                stall_s=rec.stall_s,
                redone_steps=rec.redone_steps,
                lost_s=rec.lost_s,
                breakdown=rec.breakdown if recovers else found,
            )
        )
    return results


# What each fault of a degraded (not dead) node must lead to: (name, event, the field naming the
# node). The node is the fault's target up to a "/" (a worker's node).
RESPONSES = {
    "slow_node": (("straggler", ev.STRAGGLER, "node"), ("evicted", ev.QUARANTINED, "peer")),
    "replica": (("repaired", ev.REPLICA_REPAIRED, "node"), ("rolled_back", ev.ROLLED_BACK, "")),
}


def responses(events: list[dict[str, Any]], fault: dict[str, Any]) -> dict[str, float]:
    """Seconds from a fault of a degraded node to each response that came while the fault lasted.

    The faults are ``slow_node`` and a corrupt replica; the responses are :data:`RESPONSES`. One
    not seen is left out."""
    node, t0 = fault["target"].split("/")[0], fault["ts"]
    end = min(
        (
            e["ts"]
            for e in ev.FAULT_CLEARED.of(events)
            if e.get("kind") == fault["kind"] and e["target"] == fault["target"] and e["ts"] >= t0
        ),
        default=float("inf"),
    )
    found = {}
    for name, kind, who in RESPONSES.get(fault["kind"], ()):
        hit = next(
            (e for e in kind.of(events) if (not who or e[who] == node) and t0 <= e["ts"] <= end),
            None,
        )
        if hit is not None:
            found[name] = round(hit["ts"] - t0, 3)
    return found


def judge(events: list[dict[str, Any]], cfg: Config) -> Verdict:
    """The verdict, the goodput at the job's own pace (:func:`pace`)."""
    t0, t1, kept = training_span(events)
    segments = capacity(events, cfg.cluster.nodes, t0, t1)
    rates = pace(events, config.max_nodes(cfg))
    reference = ratio = ratio_up = fault_free = None
    if rates:
        min_nodes = cfg.cluster.min_nodes
        spans = intervals(events)
        reference, ratio = goodput(kept, spans, rates, min_nodes)
        ratio_up = goodput(kept, spans, rates, min_nodes, up=segments)[1]
        fault_free = fault_free_goodput(events, spans, rates, min_nodes)
    return Verdict(
        violations=invariants(events, cfg),
        faults=fault_results(events),
        skipped=ev.FAULT_SKIPPED.of(events),
        kept_samples=kept,
        seconds=t1 - t0,
        rates=rates,
        reference_samples=reference,
        goodput=ratio,
        goodput_of_nodes_up=ratio_up,
        fault_free_goodput=fault_free,
        segments=segments,
    )


FAULT_FREE_STEPS = 10  # fewer steps before the first fault say nothing of the job's own jitter


def fault_free_goodput(
    events: list[dict[str, Any]], spans: list[Interval], rates: dict[int, float], min_nodes: int
) -> float | None:
    """The goodput of the steps before the first fault (all of them, without one).

    It is what the definition charges a job that nothing happens to. None when fewer than
    ``FAULT_FREE_STEPS`` steps came first."""
    first = min((e["ts"] for e in ev.FAULT_INJECTED.of(events)), default=float("inf"))
    before = [s for s in spans if s.end < first]
    if len(before) < FAULT_FREE_STEPS:
        return None
    return goodput(sum(s.samples for s in before), before, rates, min_nodes)[1]


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
        if f.kind.split()[0] in RESPONSES:
            said = [f"{name.replace('_', ' ')} after {s:.1f} s" for name, s in f.breakdown.items()]
            lines.append("      " + (", ".join(said) or "nothing found it"))
    for s in v.skipped:
        lines.append(f"  skipped: {s['kind']} {s['target']}: {s['reason']}")
    lines.append(f"training: {v.kept_samples} samples kept in {v.seconds:.1f} s")
    if v.goodput is None:
        lines.append("goodput: not measured (no world size trained two steps in a row)")
    else:
        rates = ", ".join(f"{w} nodes {r:.1f}/s" for w, r in sorted(v.rates.items()))
        lines.append(
            f"goodput: {100 * v.goodput:.1f} % ({v.kept_samples} kept / "
            f"{v.reference_samples:.0f} the job trains at its own fault-free pace in the same "
            f"time at the same world sizes; pace {rates})"
        )
        lines.append(
            f"goodput of the nodes up: {100 * (v.goodput_of_nodes_up or 0):.1f} % (also charges "
            "the time a repaired node takes to train again)"
        )
        if v.fault_free_goodput is not None:
            lines.append(
                f"goodput before the first fault: {100 * v.fault_free_goodput:.1f} % (what the "
                "definition charges checkpoints, evaluations and jitter)"
            )
    median = statistics.median([f.stall_s for f in v.faults if f.stall_s is not None] or [0])
    lines.append(f"median stall {median:.2f} s; verdict: {'PASS' if v.ok else 'FAIL'}")
    return "\n".join(lines)
