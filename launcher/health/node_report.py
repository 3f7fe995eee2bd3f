"""The health report of a node's checks, with its JSON and its table.

What one check found is a :class:`CheckResult`; a node's checks together are a
:class:`HealthReport`.

These types have one home, apart from the checks, because four modules share them: the host
checks (:mod:`launcher.health.checks`), the GPU checks (:mod:`launcher.health.gpu`), the
quarantine that publishes reports to etcd (:mod:`launcher.health.quarantine`) and the doctor that
prints them. With only the standard library below it, any of them imports it without an import
cycle and without loading the checks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    message: str


@dataclass(frozen=True)
class HealthReport:
    """The outcome of every check on one node, as published to etcd and printed by the doctor."""

    node_id: str
    host: str
    checked_at: float
    seconds: float
    results: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is Status.FAIL]

    @property
    def counts(self) -> dict[str, int]:
        """How many checks ended in each status, by status name."""
        return {s.value: sum(r.status is s for r in self.results) for s in Status}

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        data["results"] = [{**asdict(r), "status": r.status.value} for r in self.results]
        return json.dumps(data)

    @classmethod
    def from_json(cls, raw: str | bytes) -> HealthReport:
        data = json.loads(raw)
        data.pop("ok", None)
        results = tuple(
            CheckResult(r["name"], Status(r["status"]), r["message"]) for r in data.pop("results")
        )
        return cls(**data, results=results)

    def table(self) -> str:
        """A plain-text table, one row per check, the message wrapped under its row."""
        width = max([len(r.name) for r in self.results] + [5])
        lines = [f"health of {self.node_id} ({self.host}), {self.seconds:.1f} s"]
        lines.append(f"{'check'.ljust(width)}  status  detail")
        for r in self.results:
            lines.append(f"{r.name.ljust(width)}  {r.status.value.upper():<6}  {r.message}")
        verdict = "fit to join" if self.ok else f"NOT fit to join: {len(self.failures)} failed"
        lines.append(f"{verdict} ({', '.join(f'{n} {s}' for s, n in self.counts.items() if n)})")
        return "\n".join(lines)
