"""`autoplace explain`: the plan's breakdown beside the alternatives that change it most."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import H100_64, LLAMA_70B, PLAN_70B, invoke, strict_json


def test_explain_json_lists_three_alternatives_that_differ() -> None:
    result = invoke("explain", LLAMA_70B, H100_64, "--plan", PLAN_70B, "--json")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    base = doc["plan"]
    assert len(doc["alternatives"]) == 3
    for alt in doc["alternatives"]:
        assert alt["change"]
        assert (alt["step_time_s"], alt["memory_per_device_bytes"]["total"]) != (
            base["step_time_s"], base["memory_per_device_bytes"]["total"])


def test_explain_writes_a_png_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "explain.png"
    result = invoke("explain", LLAMA_70B, H100_64, "--plan", PLAN_70B, "--png", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Alternatives that change the most" in result.stdout
