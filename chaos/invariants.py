"""Invariants a run must keep whatever the faults, judged from its event log and config.

Each function returns a list of violations, empty when the run kept the invariant, so a test
can show every problem at once and a chaos report can print them.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

from elastic import event_types as ev
from elastic.config import Config
from elastic.lr_policy import LRPolicy, Ramp


def lr_violations(events: list[dict[str, Any]], cfg: Config, samples_per_epoch: int) -> list[str]:
    """Steps whose LR is not what the policy gives for that step's samples and world size.

    Replays the policy over rank 0's step events: a step whose world size differs from the
    step before it starts a ramp (when the policy ramps), exactly as the trainer must. A step
    rank 0 did not log (its worker was interrupted after the all-reduce, and the next round took
    that step's state from another rank) was trained in the world of the step before it, so it
    is replayed in that world.
    """
    policy = LRPolicy.from_config(
        cfg.optim,
        cfg.data.batch_size,
        samples_per_epoch,
        total_samples=round(cfg.trainer.epochs * samples_per_epoch),
    )
    steps = ev.STEP.of(events)
    if not steps:
        return ["no step events"]
    first_global = steps[0]["world_size"] * cfg.data.batch_size
    latest: dict[int, dict[str, Any]] = {}
    ramps: dict[int, Ramp | None] = {}
    bad = []
    for e in steps:
        before = e["samples"] - e["step_samples"]
        global_batch = policy.global_batch(e["world_size"], first_global)
        known = [s for s in latest if s < e["step"]] if e["step"] - 1 not in latest else []
        if known:  # steps rank 0 did not log, replayed in the world before them
            last = latest[max(known)]
            for step in range(last["step"] + 1, e["step"]):
                lr = policy.lr(last["samples"], last["global_batch"], ramps[last["step"]])
                latest[step] = {
                    **last,
                    "step": step,
                    "samples": last["samples"] + last["global_batch"],
                    "lr": lr,
                }
                ramps[step], last = ramps[last["step"]], latest[step]
        prev = latest.get(e["step"] - 1)
        if prev is not None and prev["world_size"] != e["world_size"]:
            ramp = policy.after_resize(before, prev["lr"], global_batch)
        else:
            ramp = ramps.get(e["step"] - 1)
        want = policy.lr(before, global_batch, ramp)
        if not math.isclose(e["lr"], want, rel_tol=1e-9):
            bad.append(f"step {e['step']} (world {e['world_size']}): lr {e['lr']} != {want}")
        if e.get("global_batch", global_batch) != global_batch:
            bad.append(f"step {e['step']}: global batch {e['global_batch']} != {global_batch}")
        latest[e["step"]] = {**e, "global_batch": global_batch}
        ramps[e["step"]] = ramp
    return bad


def attempts_of(events: list[dict[str, Any]]) -> dict[int, dict[tuple[int, int], list]]:
    """Group every step's ``samples`` records by attempt: ``(round, rollbacks)``.

    ``rollbacks`` counts the ``rolled_back`` events its writer had written in that round before it
    (every rank of a round rolls back alike; a later round starts from none). A round that rolled
    back (:func:`elastic.step_checks.roll_back`) trains the steps after the checkpoint again: a
    new attempt, as a later round's would be."""
    rollbacks: Counter[tuple[str, int, int]] = Counter()  # (node, pid, round)
    attempts: dict[int, dict[tuple[int, int], list]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        writer = (e.get("node", ""), e.get("pid", 0), e.get("round", 0))
        if ev.ROLLED_BACK.matches(e):
            rollbacks[writer] += 1
        elif ev.SAMPLES.matches(e):
            attempts[e["step"]][(e["round"], rollbacks[writer])].append(e)
    return attempts


def corrupt_windows(events: list[dict[str, Any]]) -> dict[tuple[str, int], list[tuple]]:
    """Per writer, the windows in which chaos had corrupted its parameters on purpose.

    Each runs from a bit chaos flipped in its parameters (``bit_flipped``) to the repair of its
    replica (``replica_repaired``) or a rollback (never, if neither came). Its states differ from
    its peers' there on purpose, and the replica check is what must end that."""
    windows: dict[tuple[str, int], list[tuple]] = defaultdict(list)
    for e in events:
        writer = (e.get("node", ""), e.get("pid", 0))
        if ev.BIT_FLIPPED.matches(e):
            windows[writer].append((e["ts"], float("inf")))
        elif (ev.REPLICA_REPAIRED.matches(e) or ev.ROLLED_BACK.matches(e)) and windows[writer]:
            flipped, ended = windows[writer][-1]
            windows[writer][-1] = (flipped, min(ended, e["ts"]))
    return windows


def sample_violations(
    events: list[dict[str, Any]], samples_per_epoch: int, total_samples: int
) -> list[str]:
    """Samples not trained exactly once per epoch (needs ``trainer.record_samples=true``).

    Every rank logs the indices of a step before it trains it. A step that several rounds
    attempted counts in the last of them: a round only trains a step again when no surviving
    replica had committed it.
    """
    attempts = attempts_of(events)
    done = ev.TRAINING_DONE.of(events)
    if not done:
        return ["the run did not finish"]
    last_step = done[-1]["step"]
    bad = []
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    for step in range(1, last_step + 1):
        if step not in attempts:
            bad.append(f"step {step}: no rank recorded its samples")
            continue
        last = max(attempts[step])
        records = attempts[step][last]
        if len({r["rank"] for r in records}) != records[0]["world_size"]:
            bad.append(
                f"step {step} (round {last[0]}): {len(records)} of {records[0]['world_size']} ranks"
            )
        for r in records:
            seen[r["epoch"]].update(r["indices"])
    trained = sum(sum(c.values()) for c in seen.values())
    if trained != total_samples:
        bad.append(f"{trained} samples trained, the run has {total_samples}")
    for epoch, counts in sorted(seen.items()):
        twice = sorted(i for i, n in counts.items() if n > 1)
        if twice:
            bad.append(
                f"epoch {epoch}: {len(twice)} samples trained more than once, e.g. {twice[:5]}"
            )
        complete = (epoch + 1) * samples_per_epoch <= total_samples
        missing = samples_per_epoch - len(counts)
        if complete and missing:
            bad.append(f"epoch {epoch}: {missing} samples never trained")
    return bad


def replica_violations(events: list[dict[str, Any]]) -> list[str]:
    """Replicas whose parameters differ: after each state sync, and at the end of training.

    Under ``parallel.shard=node`` the replicas of each shard are compared (the events' ``shard``;
    older runs have none: one shard)."""
    bad = []
    synced: dict[tuple[int, int], set[str]] = defaultdict(set)
    final: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in events:
        if ev.STATE_SYNCED.matches(e):
            synced[e["round"], e.get("shard", 0)].add(e["digest"])
        elif ev.STATE_DIGEST.matches(e):
            final[e["step"], e.get("shard", 0)].add(e["digest"])
    for (rnd, k), digests in sorted(synced.items()):
        if len(digests) > 1:
            bad.append(
                f"round {rnd}: replicas{_of_shard(k)} differ after the state sync "
                f"({sorted(digests)})"
            )
    if not final:
        bad.append("no replica reported its final parameters")
    for (step, k), digests in sorted(final.items()):
        if len(digests) > 1:
            bad.append(f"step {step}: replicas{_of_shard(k)} finished with different parameters")
    return bad


def _of_shard(k: int) -> str:
    return f" of shard {k}" if k else ""


def history_violations(events: list[dict[str, Any]]) -> list[str]:
    """Steps trained from two different states: two worlds training two histories at once.

    Every rank logs the fingerprint of its parameters before each step (the ``samples`` event's
    ``before``; needs ``trainer.record_samples=true``). The ranks of one round must agree on it,
    and a step attempted again by a later round (the first attempt dropped in flight) must start
    from the same state, unless a checkpoint was loaded in between (a whole restart, or a
    rollback, and the steps after the checkpoint are trained again, possibly at another world
    size).

    Rounds are compared only where every rank of both started the step. A round left while a
    step's all-reduce was in flight may have delivered it to some ranks only: those apply the
    step and start the next alone, from a state no peer shares, and can go no further (the next
    collective needs every rank). Their state is dropped with the round (or, if one of them is in
    the next round, becomes the newest state, which the others take). A second world training on
    its own starts every step with all of its ranks, so it is still caught.
    """
    loads = sorted(e["ts"] for e in events if ev.CHECKPOINT_LOADED.matches(e))
    loads += sorted(e["ts"] for e in events if ev.ROLLED_BACK.matches(e))
    corrupt = corrupt_windows(events)
    bad = []
    for step, by_attempt in sorted(attempts_of(events).items()):
        # (shard, fingerprint): each shard's replicas agree (parallel.shard=node; else one shard)
        by_round: dict[tuple[int, int], set[tuple[int, str]]] = defaultdict(set)
        ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
        world: dict[tuple[int, int], int] = {}
        first_ts: dict[tuple[int, int], float] = {}
        for attempt, records in by_attempt.items():
            for r in records:
                windows = corrupt.get((r.get("node", ""), r.get("pid", 0)), [])
                if not any(a < r["ts"] <= b for a, b in windows):  # a bit flipped on purpose
                    by_round[attempt].add((r.get("shard", 0), r["before"]))
                ranks[attempt].add(r["rank"])
                world[attempt] = r["world_size"]
                first_ts.setdefault(attempt, r["ts"])
        for (rnd, _), states in sorted(by_round.items()):
            most = max(Counter(shard for shard, _ in states).values(), default=1)
            if most > 1:
                bad.append(f"step {step}: the ranks of round {rnd} trained it from {most} states")
        whole = sorted(rnd for rnd in by_round if len(ranks[rnd]) == world[rnd])
        for earlier, later in zip(whole, whole[1:], strict=False):
            rolled_back = any(first_ts[earlier] < ts < first_ts[later] for ts in loads)
            if by_round[earlier] != by_round[later] and not rolled_back:
                bad.append(
                    f"step {step}: rounds {earlier[0]} and {later[0]} trained it from different "
                    "states "
                    "with no checkpoint loaded between them (two histories)"
                )
    return bad


def contract_violations(events: list[dict[str, Any]]) -> list[str]:
    """Events that break their declaration (:mod:`elastic.event_types`).

    That is a name declared nowhere, or a field its type does not declare. Once per name and
    field."""
    found: dict[str, None] = {}
    for e in events:
        kind = ev.DECLARED.get(e.get("event", ""))
        if kind is None:
            found[f"event {e.get('event')!r} is not declared"] = None
            continue
        for key in e.keys() - kind.fields - ev.COMMON:
            found[f"{kind.name} carries {key!r}, which its declaration lacks"] = None
    return list(found)
