"""The schema's machinery: declared ranges, closed spellings, and the one shape of a refusal.

Every section module declares its keys with these: a numeric key's range with :func:`bounded`
(checked by :func:`bound_problems` in one walk of the schema), a group whose bounds only count
while a sibling flag is on with :func:`checked_when`, and a closed set of spellings as a
:class:`Choice`. :func:`problem` is the shape every refusal prints, whoever finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, TypeVar

N = TypeVar("N", int, float)
G = TypeVar("G")

# Field metadata keys: a numeric key's Bound, and the sibling flag that switches a group's
# bounds on.
_BOUND = "bound"
_WHEN = "checked_when"


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


def problem(key: str, value: object, why: str, fix: str) -> str:
    """The one shape of a refusal: key, value, why it cannot work, and what to write instead.

    The key is as typed on the command line. A choice is shown as typed (``'gloo'``)."""
    shown = value.value if isinstance(value, Enum) else value
    return f"{key}={shown!r}: {why}. Fix: {fix}."


@dataclass(frozen=True)
class Bound:
    """The range a numeric key must lie in, with the reason and the fix :func:`validate` prints.

    ``ge``/``gt`` and ``le``/``lt`` are the lower and upper limit (at most one of each). An empty
    ``why`` is made from the limits ("must be at least 1", "must be in (0, 1]"), so that the
    message and the check cannot disagree; a custom ``why`` says what the limit protects.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""
    fix: str = ""

    def __post_init__(self) -> None:
        if (self.ge is not None and self.gt is not None) or (
            self.le is not None and self.lt is not None
        ):
            raise TypeError("a Bound takes at most one lower (ge/gt) and one upper (le/lt) limit")
        if self.ge is None and self.gt is None and self.le is None and self.lt is None:
            raise TypeError("a Bound needs a limit")
        if not self.fix:
            raise TypeError("a Bound needs the fix its message tells the user")
        if not self.why:
            object.__setattr__(self, "why", self._phrase())

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def _phrase(self) -> str:
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            return f"must be in {left}{low:g}, {high:g}{right}"
        if self.ge is not None:
            return "must not be negative" if self.ge == 0 else f"must be at least {self.ge:g}"
        if self.gt is not None:
            return "must be positive" if self.gt == 0 else f"must be more than {self.gt:g}"
        if self.le is not None:
            return f"must be at most {self.le:g}"
        return f"must be less than {self.lt:g}"


# Fixes shared by many keys; ``{key}`` is the key's full name.
SECONDS = "set {key} to a positive number of seconds"
ANY_MINIMUM = "set {key}=0 to accept any value, or a positive minimum"


def bounded(
    default: N,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str = "",
    fix: str,
) -> N:
    """A dataclass field with ``default`` whose range :func:`validate` checks.

    See :class:`Bound`; ``{key}`` in ``fix`` stands for the key's full name.

    Declared next to the key, so that the key's type, default, comment and range are read in one
    place, and a new key cannot be added without deciding its range and fix.
    """
    bound = Bound(ge=ge, gt=gt, le=le, lt=lt, why=why, fix=fix)
    return field(default=default, metadata={_BOUND: bound})


def checked_when(flag: str, factory: Callable[[], G]) -> G:
    """A group of keys whose bounds are checked only while the sibling bool ``flag`` is on.

    The settings of something that is not used cannot stop a job."""
    return field(default_factory=factory, metadata={_WHEN: flag})


def bound_problems(node: Any, prefix: str = "") -> Iterator[str]:
    """Every declared :class:`Bound` that ``node`` (a schema dataclass) or a group in it breaks.

    Walks the fields in declaration order and recurses into groups with the dotted prefix, so
    the keys are named as on the command line. A group declared with :func:`checked_when` is
    skipped while its flag is off.
    """
    for f in fields(node):
        value = getattr(node, f.name)
        key = prefix + f.name
        if is_dataclass(value):
            flag = f.metadata.get(_WHEN)
            if flag is None or getattr(node, flag):
                yield from bound_problems(value, key + ".")
            continue
        bound: Bound | None = f.metadata.get(_BOUND)
        if bound is not None and not bound.holds(value):
            yield problem(key, value, bound.why, bound.fix.format(key=key))


class Choice(str, Enum):
    """A closed set of spellings for a key.

    OmegaConf refuses any other value when the config is composed, naming the key and the
    allowed values. Members are named as they are spelled in YAML (OmegaConf matches by name),
    compare equal to that string, and print as it."""

    def __str__(self) -> str:
        return str(self.value)
