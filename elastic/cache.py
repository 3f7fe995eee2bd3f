"""Facts about the installed packages that take seconds to learn, kept as JSON files.

Listing torchvision's models or sizing one imports torch and torchvision (3 to 5 s on a small
machine). The launcher checks a model name before any node starts, and an agent sizes the model
before it joins, in processes that need neither package otherwise, so each fact is learned once
per version of what it depends on and read back from the cache folder: ``ELASTIC_CACHE``, by
default ``~/.cache/elastic-runtime``, where the generated data sets live too.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def cache_dir() -> Path:
    return Path(os.environ.get("ELASTIC_CACHE") or Path.home() / ".cache/elastic-runtime")


def cached(name: str, valid: Callable[[object], bool], learn: Callable[[], T]) -> T:
    """The fact kept as ``name``.json in the cache folder, else ``learn()``, saved for next time.

    ``learn()`` runs where the file is missing or fails ``valid``; its result is written there for
    the next process. ``name`` must name every version the fact depends on. A folder that cannot
    be written only costs the next caller ``learn()``."""
    path = cache_dir() / f"{name}.json"
    try:
        found = json.loads(path.read_text())
        if valid(found):
            return found  # type: ignore[return-value]
    except (OSError, ValueError):
        pass  # not learned yet, or unreadable: learn it again
    fact = learn()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(fact))
        os.replace(partial, path)  # whole or not at all, for the processes reading it at once
    return fact
