"""Hub ids as the MODEL argument, read from a fake local Hugging Face cache (no network)."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.errors import SpecError
from autoplace.specs.hub import cached_config, hub_cache, parse_repo_id, resolve_model

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "hf" / "qwen3-8b.json"
CLUSTER = str(REPO / "examples" / "clusters" / "8x8-h100.yaml")


def fake_cache(home: Path, repo: str = "Qwen/Qwen3-8B", commit: str = "0123abcd") -> Path:
    """HF_HOME/hub laid out as huggingface_hub writes it: refs/main -> snapshots/<commit>/config.json."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(FIXTURE, root / "snapshots" / commit / "config.json")
    return root / "snapshots" / commit / "config.json"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_repo_ids_and_files_are_told_apart() -> None:
    assert parse_repo_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", "main")
    assert parse_repo_id("meta-llama/Llama-3.1-8B@v1.0") == ("meta-llama/Llama-3.1-8B", "v1.0")
    for not_an_id in ("model.json", "examples/models/tiny.json", "a/b/c", "/abs/path", "x/config.yaml"):
        assert parse_repo_id(not_an_id) is None


def test_reads_config_from_the_cache(offline: Path) -> None:
    config = fake_cache(offline)
    assert hub_cache() == offline / "hub"
    assert resolve_model("Qwen/Qwen3-8B") == (config, "Qwen/Qwen3-8B")
    assert cached_config("Qwen/Qwen3-8B", "0123abcd") == config  # a commit as the revision


def test_hf_hub_cache_wins(monkeypatch: pytest.MonkeyPatch, offline: Path, tmp_path: Path) -> None:
    config = fake_cache(tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere" / "hub"))
    assert resolve_model("Qwen/Qwen3-8B")[0] == config


def test_an_existing_file_is_never_a_hub_id(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cache(offline)
    (offline / "Qwen").mkdir()
    shutil.copy(FIXTURE, offline / "Qwen" / "Qwen3-8B")
    monkeypatch.chdir(offline)
    assert resolve_model("Qwen/Qwen3-8B") == (Path("Qwen/Qwen3-8B"), None)


def test_missing_everywhere_says_how_to_get_it(offline: Path) -> None:
    with pytest.raises(SpecError) as info:
        resolve_model("Qwen/Qwen2.5-7B")
    assert "`hf download Qwen/Qwen2.5-7B config.json`" in str(info.value)  # huggingface_hub's current command
    assert "huggingface-cli" not in str(info.value)


def test_download_asks_for_config_json_only(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked: list[tuple[str, str]] = []

    def hf_hub_download(repo_id: str, filename: str, revision: str = "main") -> str:
        asked.append((repo_id, filename))
        return str(FIXTURE)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    assert resolve_model("Qwen/Qwen3-8B") == (FIXTURE, "Qwen/Qwen3-8B")
    assert asked == [("Qwen/Qwen3-8B", "config.json")]


def test_solve_with_a_hub_id(offline: Path) -> None:
    fake_cache(offline)
    result = CliRunner().invoke(app, ["solve", "Qwen/Qwen3-8B", CLUSTER, "--json", "--time-limit", "5"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"]["name"] == "Qwen/Qwen3-8B"
    assert doc["model"]["params"] == pytest.approx(8.19e9, rel=0.005)


def test_evaluate_with_a_missing_hub_id_is_one_line(offline: Path) -> None:
    result = CliRunner().invoke(app, ["evaluate", "Qwen/Qwen2.5-7B", CLUSTER, "--plan", "tp=8"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf download Qwen/Qwen2.5-7B config.json" in lines[0]


def test_an_unreachable_hub_fails_in_seconds_with_one_line(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: huggingface_hub retries with backoff and logs a warning per attempt.  The
    miss is given up on after DOWNLOAD_SECONDS with those warnings silenced, and the one line
    names the command that exists (``hf download``, with the revision).  A fake hub stands in
    for the network: it logs its retries, then answers only after the test is done with it
    (a solve that waited for it would succeed, exit 0, and fail here)."""
    import logging
    import threading

    from autoplace.specs import hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub._download, "__defaults__", (0.2,))
    release, started = threading.Event(), []

    def hf_hub_download(repo_id: str, filename: str, revision: str = "main") -> str:
        started.append(repo_id)
        for attempt in range(1, 6):
            logging.getLogger("huggingface_hub").warning(f"Retrying in 1s [Retry {attempt}/5].")
        release.wait(10)
        return str(FIXTURE)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    try:
        result = CliRunner().invoke(app, ["evaluate", "Qwen/Qwen2.5-7B@v2", CLUSTER, "--plan", "tp=8"])
    finally:
        release.set()
    assert started == ["Qwen/Qwen2.5-7B"]
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "`hf download Qwen/Qwen2.5-7B config.json --revision v2`" in lines[0] and "Traceback" not in result.output
