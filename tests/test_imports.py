"""The import graph: specs -> cost -> solvers -> emit/runtime -> cli, with no cycles (a lazy import
inside a function counts: it is a cycle dodged, not removed) and nothing importing tests/."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("autoplace", "solvers", "benchmarks")


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body."""
    files = {}
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            parts = f.relative_to(REPO).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {d for d in deps if d != name and (d in files or d.split(".")[0] == "tests")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_check_finds_a_cycle_and_an_import_of_tests() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_tests() -> None:
    offenders = {m: sorted(d for d in deps if d.split(".")[0] == "tests") for m, deps in _graph().items()}
    assert not {m: d for m, d in offenders.items() if d}


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []
