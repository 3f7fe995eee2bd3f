"""The places a newcomer opens stay readable in one sitting: no module of ``elastic/`` or
``launcher/`` over 600 lines, no class over 300, no function over 80, and the trainer, the loop
one reads first, within 400 (issue 48's bars).

    .venv/bin/python -m tests.test_sizes     # prints the largest modules, classes and functions
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("elastic", "launcher")
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 300, 80
TRAINER_LINES = 400


def sizes(paths: list[Path]) -> list[tuple[str, str, int]]:
    """(kind, name, lines) of every module, class and function in ``paths``."""
    found = []
    for path in paths:
        source = path.read_text()
        name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
        found.append(("module", name, source.count("\n")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((kind, f"{name}:{node.name}", lines))
    return found


def oversized(found: list[tuple[str, str, int]]) -> list[str]:
    """What is over its bar, as ``kind name: lines > bar``."""
    bars = {"module": MODULE_LINES, "class": CLASS_LINES, "function": FUNCTION_LINES}
    return [f"{k} {n}: {lines} > {bars[k]}" for k, n, lines in found if lines > bars[k]]


def runtime_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_module_class_or_function_of_the_runtime_is_over_its_bar() -> None:
    assert oversized(sizes(runtime_modules())) == []


def test_the_trainer_reads_in_one_sitting() -> None:
    assert (REPO / "elastic/trainer.py").read_text().count("\n") <= TRAINER_LINES


def test_the_size_check_sees_a_long_function_and_a_long_class(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    source = tmp_path / "long.py"
    source.write_text(f"def long():\n{body}\n\nclass Big:\n" + body * 4)
    found = oversized(sizes([source]))
    assert found == [
        f"function long.py:long: {FUNCTION_LINES + 1} > {FUNCTION_LINES}",
        f"class long.py:Big: {4 * FUNCTION_LINES + 1} > {CLASS_LINES}",
    ]


if __name__ == "__main__":
    for kind, title in (("module", "modules"), ("class", "classes"), ("function", "functions")):
        rows = sorted((r for r in sizes(runtime_modules()) if r[0] == kind), key=lambda r: -r[2])
        print(f"{title}: " + ", ".join(f"{name} {lines}" for _, name, lines in rows[:10]))
