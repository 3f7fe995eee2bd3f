"""The contract every event keeps: what an event type is, the registry, and the lookup of its line.

Each :class:`EventType` names an event, who writes it, the fields it carries beyond those of
every event (:data:`COMMON`: the time, the writer, and a worker's rank and round), and the line a
person watching the run reads for it (:func:`describe`). The declarations themselves sit in the
modules beside this one, one per writer; the package gathers them (:mod:`elastic.event_types`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]
# What a person reads for an event: a format string over its fields, or a function of it that
# may return None (not worth showing); an event with no line is not shown.
Line = str | Callable[[Event], str | None] | None

# In every event: when, what, and who wrote it; a worker adds its local rank, rank and round.
COMMON = frozenset({"ts", "event", "node", "host", "pid", "role", "local_rank", "rank", "round"})


@dataclass(frozen=True)
class EventType:
    """One kind of event: its name, the process that writes it, its fields, and what it says.

    ``name`` is its name in the files; ``by`` the process that writes it (agent, launcher,
    worker, chaos or bench); ``fields`` its own fields; ``doc`` what it means; ``line`` what the
    progress display prints for it."""

    name: str
    by: str
    fields: frozenset[str]
    doc: str
    line: Line = None

    def matches(self, event: Event) -> bool:
        return event.get("event") == self.name

    def of(self, events: Iterable[Event]) -> list[Event]:
        """The events of this kind among ``events``, in their order."""
        return [e for e in events if e.get("event") == self.name]


class UndeclaredEvent(ValueError):
    """An event whose name this module does not declare."""


DECLARED: dict[str, EventType] = {}


def declared(name: str) -> EventType:
    """The declaration of ``name``; :class:`UndeclaredEvent` if there is none."""
    try:
        return DECLARED[name]
    except KeyError:
        raise UndeclaredEvent(
            f"event {name!r} is not declared: declare it, with its fields, in the module of "
            "elastic/event_types/ named for its writer"
        ) from None


def describe(e: Event) -> str | None:
    """The line a person reads for ``e``: its declaration's, or None if it is not shown."""
    kind = DECLARED.get(e.get("event", ""))
    line = kind.line if kind is not None else None
    if line is None or isinstance(line, str):
        return line.format_map(e) if line is not None else None
    return line(e)


def declare(name: str, by: str, fields: str, doc: str, line: Line = None) -> EventType:
    """Declare an event once: the constant its writers pass and its readers pick events with."""
    kind = EventType(name, by, frozenset(fields.split()), doc, line)
    DECLARED[name] = kind
    return kind
