"""The layout matches the processes: no import cycles, a worker imports nothing of the agent's,
and the runtime runs no test tooling.

``elastic/`` is what a worker imports and ``launcher/`` is the agent and the commands; ``chaos/``
strikes faults at them from outside, so neither may import it or start it as ``python -m
chaos...``. The graph is read from the source (every ``import``, at module level or inside a
function, since a function-level import hides a cycle rather than removing it), and a real worker
module is imported in a fresh interpreter to see what it loads.

    .venv/bin/python -m tests.test_layout     # prints the graph of elastic/ and launcher/
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from elastic import config

from .conftest import START_S

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("elastic", "launcher")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of ``elastic/`` and ``launcher/`` and the project modules it imports."""
    modules = {
        module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in modules and c != name)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each as the path that closes it (depth-first search)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_elastic_and_launcher_have_no_import_cycles() -> None:
    graph = import_graph()
    assert "launcher.agent.agent" in graph and "elastic.trainer" in graph
    assert cycles(graph) == []


def test_elastic_imports_nothing_from_launcher() -> None:
    graph = import_graph()
    upward = {
        m: sorted(t for t in targets if t.startswith("launcher")) for m, targets in graph.items()
    }
    assert {m: t for m, t in upward.items() if m.startswith("elastic") and t} == {}


# The agent's decisions and the alerts' are pure functions over plain data: they may read the
# membership's types, the key layout, the worker contract's constants, the event declarations and
# the final save's pure words (elastic/final_save.py), and nothing that talks to etcd or processes.
PURE = {
    "launcher.agent.decisions",
    "launcher.agent.peer_decisions",
    "launcher.alerts",
    "launcher.rendezvous.round_plan",
    "launcher.rendezvous.membership",
    "launcher.rendezvous.keys",
}
# ``elastic`` itself imports nothing: ``from elastic import event_types`` names it.
PURE_MAY_IMPORT = PURE | {"elastic", "elastic.control", "elastic.event_types", "elastic.final_save"}


def test_the_decisions_import_no_module_that_does_io() -> None:
    graph = import_graph()
    assert graph.keys() >= PURE
    assert {m: sorted(graph[m] - PURE_MAY_IMPORT) for m in PURE if graph[m] - PURE_MAY_IMPORT} == {}


# The launcher's roles, lowest first: a role imports only from roles below it (and elastic/, the
# lowest of all); the launch at the top of launcher/ and the operator's commands
# (launcher/commands/) may import any role.
ROLES = (
    "launcher.rendezvous",
    "launcher.torchrun",
    "launcher.health",
    "launcher.metrics",
    "launcher.agent",
)
MAY_IMPORT = {
    "launcher.rendezvous": set(),
    "launcher.torchrun": {"launcher.rendezvous"},
    "launcher.health": {"launcher.rendezvous"},
    "launcher.metrics": set(),
    "launcher.agent": {"launcher.rendezvous", "launcher.health", "launcher.metrics"},
}


def role_of(module: str) -> str:
    """The role a module of launcher/ belongs to, or ``launcher`` for the launch and commands."""
    return next((r for r in ROLES if module == r or module.startswith(r + ".")), "launcher")


def test_each_role_of_the_launcher_imports_only_the_roles_below_it() -> None:
    graph = import_graph()
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if role_of(m) in MAY_IMPORT
        for t in targets
        if t.startswith("launcher")
        and role_of(t) != role_of(m)
        and role_of(t) not in MAY_IMPORT[role_of(m)]
    )
    assert upward == []


def test_the_role_check_sees_an_upward_import() -> None:
    assert role_of("launcher.rendezvous.keys") == "launcher.rendezvous"
    assert role_of("launcher.commands.status") == "launcher"
    assert "launcher.agent" not in MAY_IMPORT[role_of("launcher.rendezvous.leader")]


CHAOS_KEYS = {f.name for f in dataclasses.fields(config.ChaosConfig)}


def chaos_uses(path: Path) -> list[str]:
    """Where the module at ``path`` imports ``chaos`` or names one of its modules in a string
    (the ``-m`` argument of a child process): ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # A module path, not the word ("chaos" is also the role of fault events) nor a key
            # of the job's chaos settings (chaos.allow).
            path = re.fullmatch(r"chaos(\.\w+)+", node.value)
            names = [node.value] if path and node.value.split(".")[1] not in CHAOS_KEYS else []
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n == "chaos" or n.startswith("chaos.")]
    return found


def test_the_runtime_neither_imports_nor_runs_chaos() -> None:
    modules = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    uses = {module_name(p): chaos_uses(p) for p in modules}
    assert {m: u for m, u in uses.items() if u} == {}


def test_the_chaos_finder_sees_an_import_and_a_module_run_as_a_child(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        'import os\nfrom chaos import injectors\nargv = ["python", "-m", "chaos.node_helper"]\n'
        'role = "chaos"\ndoc = "chaos campaigns"\n'
    )
    assert chaos_uses(source) == ["2: chaos", "3: chaos.node_helper"]


def test_a_worker_loads_no_module_of_the_launcher() -> None:
    """What ``python -m elastic.trainer`` really imports, lazy imports included: of the
    launcher, only torchrun's entry point (``launcher/torchrun/__init__.py``, which imports
    nothing), since torch loads every ``torchrun.handlers`` entry point when its rendezvous is
    imported, as DCP does."""
    probe = (
        "import sys, elastic.trainer; "
        "print(sorted(m for m in sys.modules if m == 'launcher' or m.startswith('launcher.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=START_S
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['launcher', 'launcher.torchrun']"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


if __name__ == "__main__":
    graph = import_graph()
    for module in sorted(graph):
        print(f"{module} -> {', '.join(sorted(graph[module])) or '-'}")
    print(f"cycles: {cycles(graph) or 'none'}")
