"""ruff and mypy run with the tests, so CI enforces them."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "ruff", "check", "autoplace", "solvers", "hardware_profiles", "tests", "benchmarks"],
    [sys.executable, "-m", "mypy"],  # files and options from pyproject.toml
], ids=["ruff", "mypy"])
def test_linters_pass(command: list[str]) -> None:
    if shutil.which(command[2]) is None and subprocess.run([sys.executable, "-m", command[2], "--version"],
                                                             capture_output=True).returncode != 0:
        pytest.skip(f"{command[2]} is not installed (it is in the test extra)")
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
