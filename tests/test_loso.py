"""The leave-one-source-out machinery of benchmarks/loso.py on synthetic runs whose step times are
known functions of the two calibration factors: a source measured 2x slow is the one that fits
only itself, and a fit that sees every source is calibrate.fit's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import autoplace.calibrate as calibrate
from autoplace.calibrate import Observation
from autoplace.plan import build_plan
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from benchmarks.loso import LOSO_GAP, SourceScore, headline, leave_one_source_out, mape, surrogate

REPO = Path(__file__).resolve().parents[1]
TRUTH = (1.3, 0.8)  # the factors the synthetic runs were measured under
SOURCES = ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"] * 4 + ["slow"] * 2


def synthetic() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per run: compute seconds, transfer seconds and a fixed overhead at factors 1; step time
    ``compute * c + transfer * b + fixed`` (linear in the factors, as the surrogate assumes)."""
    rng = np.random.default_rng(7)
    n = len(SOURCES)
    return rng.uniform(0.5, 2.0, n), rng.uniform(0.1, 1.0, n), rng.uniform(0.0, 0.2, n)


def times(c: float, b: float) -> np.ndarray:
    compute, transfer, fixed = synthetic()
    return compute * c + transfer * b + fixed


def measured() -> np.ndarray:
    """The runs measured under TRUTH, the source ``slow`` at twice its step time."""
    return times(*TRUTH) * np.where(np.array(SOURCES) == "slow", 2.0, 1.0)


def run_loso() -> dict[str, object]:
    coef = surrogate(times(1.0, 1.0), times)
    return leave_one_source_out(SOURCES, measured(), coef, lambda mask, c, b: times(c, b)[mask])


def test_the_source_measured_slow_is_the_one_that_fits_only_itself() -> None:
    result = run_loso()
    scores: list[SourceScore] = result["scores"]  # type: ignore[assignment]
    gaps = {s.source: s.gap for s in scores}
    assert max(gaps, key=gaps.__getitem__) == "slow" and gaps["slow"] > LOSO_GAP
    slow = next(s for s in scores if s.source == "slow")
    # fitted without it, the other sources' factors are the truth, so it is predicted 2x fast in step time
    assert slow.factors == pytest.approx(TRUTH, rel=1e-3)
    assert slow.held_out == pytest.approx(1.0, abs=1e-3) and mape(slow.uncalibrated) != pytest.approx(1.0, abs=0.05)
    assert result["miss"] == pytest.approx(0.0, abs=1e-9)  # the surrogate is exact for a linear step time
    h = headline(result)
    assert h["held_out"]["n"] == len(SOURCES) and h["held_out"]["mape"] > h["in_sample"]["mape"]


def test_the_fit_on_every_source_is_calibrate_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    model, cluster = load_model(REPO / "examples" / "models" / "tiny-llama.json"), load_cluster(
        REPO / "examples" / "clusters" / "cpu-2.yaml")
    plan = build_plan({"dp": 2}, world=cluster.gpus, blocks=model.layers, global_batch=2)  # type: ignore[union-attr]
    observations = [Observation(model, cluster, plan, float(t), str(i)) for i, t in enumerate(measured())]
    # calibrate.fit evaluates each trial: here the synthetic step time of the run its label names
    monkeypatch.setattr(calibrate, "predict", lambda o, a: float(times(a.compute_scale, a.bandwidth_scale)[int(o.label)]))
    cal = calibrate.fit(observations)
    assert run_loso()["all"] == pytest.approx((cal.assumptions.compute_scale, cal.assumptions.bandwidth_scale), rel=1e-9)
