"""A calibration is bound to what it measured: the GPU, link tiers and framework are recorded
and checked where it is applied; its band is a Student-t prediction interval that includes the
fitted factors' own uncertainty, and needs at least four trials."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from autoplace.calibrate import (
    MIN_BAND_TRIALS,
    Observation,
    check_applies,
    fit,
    load_band,
    predict,
    t_quantile,
    write_calibration,
)
from autoplace.cli import app
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.errors import SpecError
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.cluster import cluster_from_flags, load_cluster
from autoplace.specs.model import load_model

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "tiny-llama.json"
CPU2 = REPO / "examples" / "clusters" / "cpu-2.yaml"
PLANS = ["dp=2,zero=0", "dp=2,zero=3,mbs=4", "tp=2", "pp=2,mbs=2", "dp=2,zero=1,recompute=full", "dp=2,mbs=2"]


def observations(n: int, framework: str = "native") -> list[Observation]:
    """Synthetic trials: the cost model under compute_scale 2 with +-3% noise."""
    m, c = load_model(MODEL), load_cluster(CPU2)
    truth = DEFAULT.replace(compute_scale=2.0)
    out = []
    for i, text in enumerate(PLANS[:n]):
        plan = build_plan(parse_plan_string(text), world=c.gpus, blocks=layer_table(m).blocks,
                          global_batch=m.training.global_batch, gpus_per_node=c.gpus_per_node)
        t = predict(Observation(m, c, plan, 1.0), truth) * (1.0 + 0.03 * math.sin(3.0 * i))
        out.append(Observation(m, c, plan, t, text, framework))
    return out


@pytest.mark.parametrize(("dof", "table"), [(2, 4.303), (3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042)])
def test_t_quantile_matches_the_tables(dof: int, table: float) -> None:
    assert t_quantile(0.975, dof) == pytest.approx(table, abs=1e-3)
    assert t_quantile(0.975, 100_000) == pytest.approx(1.960, abs=1e-3)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_too_few_trials_give_no_band(n: int, tmp_path: Path) -> None:
    cal = fit(observations(n))
    assert cal.band is None
    doc = cal.to_dict()
    assert doc["uncertainty"]["band_95"] is None and f">= {MIN_BAND_TRIALS} trials" in doc["uncertainty"]["note"]
    assert load_band(write_calibration(cal, tmp_path / "c.yaml")) is None


def test_band_is_a_t_interval_with_the_factors_uncertainty() -> None:
    cal = fit(observations(5))
    assert cal.band is not None and cal.factor_sd is not None
    residual_only = math.exp(t_quantile(0.975, 3) * cal.sigma)
    assert cal.band[1] > residual_only > math.exp(1.96 * cal.sigma)  # wider than the old z band
    assert cal.band[0] == pytest.approx(1 / cal.band[1])
    assert cal.assumptions.compute_scale == pytest.approx(2.0, rel=0.1)


def test_file_records_what_it_measured(tmp_path: Path) -> None:
    cal = fit(observations(4, framework="deepspeed"))
    doc = yaml.safe_load(write_calibration(cal, tmp_path / "c.yaml").read_text())
    assert doc["measured_on"] == {"gpu": "cpu", "gpus_per_node": 2, "intra_node": "loopback",
                                  "inter_node": "loopback", "framework": "deepspeed"}


def test_applying_elsewhere_is_refused_unless_forced(tmp_path: Path) -> None:
    path = write_calibration(fit(observations(4)), tmp_path / "c.yaml")
    assert check_applies(path, load_cluster(CPU2), None) == []
    assert check_applies(path, load_cluster(CPU2), "native") == []
    h100 = cluster_from_flags("h100", 2)
    with pytest.raises(SpecError) as info:
        check_applies(path, h100, None)
    assert "gpu 'cpu' (here 'h100-sxm5-80gb')" in str(info.value) and "--force" in str(info.value)
    [warning] = check_applies(path, h100, None, force=True)
    assert "applied anyway" in warning
    with pytest.raises(SpecError, match="framework 'native' \\(here 'deepspeed'\\)"):
        check_applies(path, load_cluster(CPU2), "deepspeed")


def test_a_file_without_a_record_warns(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"schema": "autoplace.calibration/v1", "assumptions": {"compute_scale": 2.0}}))
    [warning] = check_applies(path, load_cluster(CPU2), None)
    assert "does not record" in warning


def test_solve_refuses_a_foreign_calibration_and_force_applies_it(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = str(write_calibration(fit(observations(4)), tmp_path / "c.yaml"))
    args = ["solve", str(MODEL), "--cluster", "1x8xh100", "--json", "--time-limit", "3", "--calibration", path]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "--force" in refused.stderr
    forced = CliRunner().invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert "applied anyway" in caplog.text  # logged to stderr (pytest captures the autoplace logger)


def test_solve_gives_no_calibrated_band_from_a_one_trial_fit(tmp_path: Path) -> None:
    import json

    path = str(write_calibration(fit(observations(1)), tmp_path / "c.yaml"))
    result = CliRunner().invoke(app, ["solve", str(MODEL), str(CPU2), "--json", "--time-limit", "3",
                                      "--calibration", path])
    assert result.exit_code == 0, result.output
    # no calibrated band: the band shown is the development set's, said so
    assert all(p["step_time_band_source"] != "calibration" for p in json.loads(result.stdout)["plans"])
