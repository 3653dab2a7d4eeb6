"""The runtime commands through the CLI: verify passes a sound plan, calibration feeds solve."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_cli import MODELS, invoke, strict_json

TINY = MODELS / "tiny-llama.json"
CPU2 = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "cpu-2.yaml"


@pytest.mark.slow
def test_verify_zero3_matches_one_process() -> None:
    pytest.importorskip("torch")
    result = invoke("verify", TINY, "--plan", "zero=3", "--world", "2", "--steps", "3", "--json")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["ok"] and doc["broken"] is None and doc["param_rel_err"] <= 1e-5


def test_solve_with_a_calibration_scales_times_and_reports_the_band(tmp_path: Path) -> None:
    cal = tmp_path / "calibration.yaml"
    cal.write_text(yaml.safe_dump({"schema": "autoplace.calibration/v1",
                                   "assumptions": {"compute_scale": 2.0, "bandwidth_scale": 1.0},
                                   "uncertainty": {"log_sigma": 0.1, "band_95": [0.8, 1.25]}}))
    base = strict_json(invoke("solve", TINY, CPU2, "--json", "--top", "1", "--fix", "zero=0",
                              "--fix", "mbs=4").stdout)["plans"][0]
    slow = strict_json(invoke("solve", TINY, CPU2, "--json", "--top", "1", "--fix", "zero=0", "--fix", "mbs=4",
                              "--calibration", cal).stdout)["plans"][0]
    assert slow["step_time_s"] > base["step_time_s"]
    low, high = slow["step_time_band_95_s"]
    assert low == pytest.approx(0.8 * slow["step_time_s"]) and high == pytest.approx(1.25 * slow["step_time_s"])


def test_bad_calibration_file_is_exit_2(tmp_path: Path) -> None:
    cal = tmp_path / "calibration.yaml"
    cal.write_text("assumptions: {warp_factor: 9}\n")
    result = invoke("solve", TINY, CPU2, "--calibration", cal)
    assert result.exit_code == 2 and result.stderr.startswith("autoplace: error:")
