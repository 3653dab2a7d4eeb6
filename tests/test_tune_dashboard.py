"""`autoplace tune` prints the optuna-dashboard command for its study's storage (issue 37 item 2): the
command, run for real, serves the study tune wrote -- an SQLite URL and a journal file alike."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.studies import dashboard_command, open_storage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _served_studies(command: list[str], timeout: float = 60.0) -> list[str]:
    """Start ``command`` on a free local port; the study names its /api/studies answers."""
    port = _free_port()
    proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"optuna-dashboard exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as answer:
                    return [s["study_name"] for s in json.load(answer)["study_summaries"]]
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        pytest.fail("optuna-dashboard never answered")
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.mark.parametrize("storage", [None, "journal:{tmp}/study.journal"])
def test_the_printed_command_serves_the_study(storage: str | None, tmp_path: Path) -> None:
    if shutil.which("optuna-dashboard") is None:
        pytest.skip("optuna-dashboard is not installed (the dashboard extra)")
    backend, url = open_storage(storage.format(tmp=tmp_path) if storage else None, tmp_path)
    optuna.create_study(storage=backend, study_name="llama-8b-trials").optimize(lambda t: t.suggest_float("x", 0, 1),
                                                                                n_trials=1)
    command = dashboard_command(url)
    assert command[0] == "optuna-dashboard"
    assert "llama-8b-trials" in _served_studies(command)


def test_dashboard_without_optuna_dashboard_is_one_line_before_any_trial(monkeypatch, tmp_path: Path) -> None:
    import autoplace.tune

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(autoplace.tune, "run_tune", lambda *a, **k: pytest.fail("trials ran"))
    out = CliRunner().invoke(app, ["tune", "examples/models/tiny-llama.json", "examples/clusters/cpu-2.yaml",
                                   "--out", str(tmp_path), "--dashboard"])
    assert out.exit_code == 2
    assert out.stderr.strip().splitlines() == ["autoplace: error: --dashboard: optuna-dashboard is not installed: pip "
                                               "install 'autoplace[dashboard]' (without --dashboard, tune prints the "
                                               "command to run later)"]
