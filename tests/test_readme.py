"""The README's test command is the one CI runs."""

from __future__ import annotations

from typing import Any

from tests.helpers import REPO


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if "pytest" in line and not line.startswith("#"))
    assert command in readme


def test_every_example_prints_what_the_readme_shows() -> None:
    """Each ``$ autoplace ...`` block of README.md is what its command prints now (docs/examples.py
    regenerates them; wall-clock seconds masked).  A change to any example's output fails here until
    ``python docs/examples.py`` rewrites the README."""
    examples = _examples()
    assert len(examples.blocks((REPO / "README.md").read_text())) >= 5
    assert examples.main(["--check"]) == 0


def test_the_example_check_fails_on_a_stale_block(tmp_path, monkeypatch) -> None:
    examples = _examples()
    stale = tmp_path / "README.md"
    stale.write_text("text\n```\n$ autoplace profiles\nnot what it prints\n```\nmore\n")
    monkeypatch.setattr(examples, "README", stale)
    assert examples.main(["--check"]) == 1
    assert examples.main([]) == 0 and "not what it prints" not in stale.read_text()
    assert examples.main(["--check"]) == 0 and stale.read_text().startswith("text\n```\n$ autoplace profiles\n")


def _examples() -> Any:
    """docs/examples.py as a module (docs/ is no package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("readme_examples", REPO / "docs" / "examples.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
