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


def test_every_module_is_named_in_the_architecture_map() -> None:
    """docs/ARCHITECTURE.md names every module of the package (a package by its folder)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    missing = []
    for pkg in ("autoplace", "solvers"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            rel = f.relative_to(REPO)
            folder = f"{rel.parent.as_posix()}/"
            if f.name == "__init__.py":
                if folder not in text and pkg != rel.parent.as_posix():
                    missing.append(folder)
            elif rel.as_posix() not in text and f.name not in text:
                missing.append(rel.as_posix())
    assert missing == []


def test_frameworks_are_named_by_string_only_in_their_own_package() -> None:
    """What a framework can run is known in its module: outside autoplace/frameworks/, no code names
    one by a string literal, except the trial runtime's own trainers (``autoplace tune --trainer
    native|deepspeed``: cli.py, tune.py, runtime/), the ``fsdp`` placement preset (plan.py: zero=3),
    the published runs' labels (validation.py) and the launcher commands ``deepspeed`` and ``accelerate``
    whose words a dry run records (dryrun/launches.py)."""
    names = {"deepspeed", "megatron", "torchtitan", "fsdp", "accelerate"}
    allowed = {"autoplace/cli.py", "autoplace/tune.py", "autoplace/runtime/worker.py", "autoplace/runtime/spec.py",
               "autoplace/runtime/parallel.py", "autoplace/plan.py", "autoplace/validation.py",
               "autoplace/dryrun/launches.py"}
    naming = set()
    for f in (REPO / "autoplace").rglob("*.py"):
        rel = f.relative_to(REPO).as_posix()
        if rel.startswith("autoplace/frameworks/"):
            continue
        tree = ast.parse(f.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        fragments = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
               and id(n) not in docstrings | fragments for n in ast.walk(tree)):
            naming.add(rel)
    assert naming <= allowed, sorted(naming - allowed)
