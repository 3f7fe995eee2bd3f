"""The event contract holds: every event the code writes is declared, with the fields it carries.

The emitting calls are read from the source (``emit``, the chaos helpers ``log_event`` and
``send``), so a new event or a new field that is not declared fails here, before any run writes
it; the end-to-end tests check the events real runs wrote (:func:`chaos.invariants.
contract_violations`).
"""

from __future__ import annotations

import ast
import string
from pathlib import Path

import pytest

from chaos.invariants import contract_violations
from elastic import event_types as ev
from elastic.event_types import lr_text
from elastic.events import EventLog, read_events

REPO = Path(__file__).resolve().parent.parent
EMITTERS = {"emit": 0, "_emit": 0, "log_event": 1, "send": 3}  # where the event type is passed
NOT_FIELDS = {"level", "writer", "event"}


def emitting_calls() -> list[tuple[str, str, set[str]]]:
    """(where, event type constant, keyword fields) of every emitting call in the runtime, the
    chaos tooling and the benchmarks that names its type as ``ev.<NAME>``."""
    calls = []
    for package in ("elastic", "launcher", "chaos", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name not in EMITTERS:
                    continue
                given = [k.value for k in node.keywords if k.arg == "event"]
                if len(node.args) > EMITTERS[name]:
                    given.append(node.args[EMITTERS[name]])
                for arg in given:
                    if (
                        isinstance(arg, ast.Attribute)
                        and isinstance(arg.value, ast.Name)
                        and arg.value.id == "ev"
                    ):
                        fields = {k.arg for k in node.keywords if k.arg and k.arg not in NOT_FIELDS}
                        if name == "send":  # it adds the signal and the pids
                            fields |= {"signal", "pids"}
                        where = f"{path.relative_to(REPO)}:{node.lineno}"
                        calls.append((where, arg.attr, fields))
    return calls


def test_every_emitting_call_names_a_declared_type_and_its_declared_fields() -> None:
    calls = emitting_calls()
    assert len(calls) > 60  # the scan sees the calls
    wrong = []
    for where, constant, fields in calls:
        kind = getattr(ev, constant, None)
        if not isinstance(kind, ev.EventType):
            wrong.append(f"{where}: ev.{constant} is not an event type")
            continue
        extra = fields - kind.fields - ev.COMMON
        if extra:
            wrong.append(f"{where}: {kind.name} given {sorted(extra)}, not declared")
    assert wrong == []


def test_no_event_is_written_as_a_bare_string() -> None:
    """Writers name the declared type, so a name is written once."""
    bare = []
    for package in ("elastic", "launcher", "chaos", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    first = node.args[0] if node.args else None
                    if (
                        node.func.attr in ("emit", "_emit")
                        and isinstance(first, ast.Constant)
                        and isinstance(first.value, str)
                    ):
                        bare.append(f"{path.relative_to(REPO)}:{node.lineno}: {first.value}")
    assert bare == []


def test_each_name_is_declared_once_and_every_declaration_is_written_somewhere() -> None:
    constants = {k: v for k, v in vars(ev).items() if isinstance(v, ev.EventType)}
    assert len({v.name for v in constants.values()}) == len(constants) == len(ev.DECLARED)
    written = {constant for _, constant, _ in emitting_calls()}
    assert set(constants) - written == set()


def test_emit_refuses_an_undeclared_name_and_writes_a_declared_one(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "n0", role="agent")
    with pytest.raises(ev.UndeclaredEvent, match="'stepp' is not declared"):
        log.emit("stepp")
    log.emit(ev.FENCED, reason="test")
    log.emit("standby", round=3, after_step=0)  # a declared name still writes (old callers)
    events = read_events(tmp_path)
    assert [e["event"] for e in events] == ["fenced", "standby"]
    assert ev.FENCED.of(events) == [events[0]] and ev.STANDBY.matches(events[1])
    assert contract_violations(events) == []


def test_the_contract_check_names_an_undeclared_event_and_field() -> None:
    events = [
        {"ts": 1.0, "event": "fenced", "node": "n0", "reason": "x", "why": "y"},
        {"ts": 2.0, "event": "nope", "node": "n0"},
        {"ts": 3.0, "event": "fenced", "node": "n1", "reason": "x", "why": "z"},
    ]
    assert contract_violations(events) == [
        "fenced carries 'why', which its declaration lacks",
        "event 'nope' is not declared",
    ]


def test_an_lr_shows_five_decimals_in_sgds_range_and_three_digits_below_it() -> None:
    """AdamW's 3e-4 would read 0.00030, and its warm-up's first LRs 0.00000."""
    assert [lr_text(x) for x in (0.0, 0.1, 0.01875, 3e-4, 3.75e-6)] == [
        "0.00000",
        "0.10000",
        "0.01875",
        "0.0003",
        "3.75e-06",
    ]


def test_each_line_is_declared_with_its_event_and_names_only_its_fields() -> None:
    """A format-string line that names a field its event lacks would fail while a job runs."""
    named = {
        kind.name: {field for _, field, _, _ in string.Formatter().parse(kind.line) if field}
        for kind in ev.DECLARED.values()
        if isinstance(kind.line, str)
    }
    assert len(named) >= 15
    wrong = {n: f - ev.DECLARED[n].fields - ev.COMMON for n, f in named.items()}
    assert {n: f for n, f in wrong.items() if f} == {}
    peer_evicted = {"event": "peer_evicted", "node": "n0", "peer": "n1", "reason": "lease expired"}
    assert ev.describe(peer_evicted) == "n0: evicted n1 (lease expired)"
    assert ev.describe({"event": "node_registered", "node": "n0"}) is None  # declared, no line
    assert ev.describe({"event": "nope"}) is None
