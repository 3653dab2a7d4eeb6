"""The README's test command is the one CI runs."""

from __future__ import annotations

from tests.helpers import REPO


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if "pytest" in line and not line.startswith("#"))
    assert command in readme
