"""tune (Optuna trials of real runs) and calibration."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest
import yaml

from autoplace.calibrate import Observation, fit, load_band, load_calibration, predict, write_calibration
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.errors import SpecError
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from autoplace.studies import open_storage
from autoplace.tune import _key as tune_key
from autoplace.tune import print_report, run_tune, short_plan

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "tiny-llama.json"
CLUSTER = REPO / "examples" / "clusters" / "cpu-2.yaml"
PLANS = ["dp=2,zero=0", "dp=2,zero=3", "tp=2"]


def _plan(text: str):
    m = load_model(MODEL)
    return build_plan(parse_plan_string(text), world=2, blocks=layer_table(m).blocks, global_batch=m.training.global_batch)


@pytest.mark.slow
def test_study_runs_stores_in_sqlite_and_resumes_without_repeating(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    first = run_tune(MODEL, CLUSTER, trials=2, top=3, out_dir=tmp_path, timeout_s=180, steps=1, progress=False)
    assert first.ran == 2 and [r.state for r in first.records] == ["COMPLETE", "COMPLETE"]
    db = tmp_path / "study.db"
    assert db.exists()
    with sqlite3.connect(db) as con:
        states = [row[0] for row in con.execute("select state from trials order by number")]
    assert states == ["COMPLETE", "COMPLETE", "WAITING"]  # the top 3 were enqueued; the third waits for a re-run
    second = run_tune(MODEL, CLUSTER, trials=3, top=3, out_dir=tmp_path, timeout_s=180, steps=1, progress=False)
    done = [r for r in second.records if r.state == "COMPLETE"]
    assert second.ran == 1 and len(done) == 3
    assert len({(r.plan, r.bucket_mb) for r in done}) == 3  # never the same run twice
    for r in done:
        assert r.measured_step_s and r.measured_step_s > 0 and r.predicted_step_s and r.predicted_step_s > 0
    third = run_tune(MODEL, CLUSTER, trials=3, top=3, out_dir=tmp_path, timeout_s=180, steps=1, progress=False)
    assert third.ran == 0 and len(third.records) == 3
    print_report(third)


@pytest.mark.slow
def test_crash_oom_and_hang_are_failed_trials_and_the_study_completes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cands = [_plan(t).to_string() for t in PLANS]
    inject = dict(zip(cands, ["crash", "oom", "hang"], strict=True))
    # the limit only has to separate a hang from a slow start: a crash trial takes 20-35 s on a busy 2-core machine
    report = run_tune(MODEL, CLUSTER, trials=3, out_dir=tmp_path, timeout_s=90, steps=1, candidates=cands,
                      inject=inject, progress=False)
    reasons = {r.plan: (r.state, r.reason) for r in report.records}
    assert reasons == {cands[0]: ("FAIL", "crash"), cands[1]: ("FAIL", "oom"), cands[2]: ("FAIL", "hang")}
    assert report.best is None
    print_report(report)


@pytest.mark.slow
def test_after_the_enqueued_top_k_tpe_proposes_knobs_and_repeats_are_pruned_never_rerun(tmp_path: Path) -> None:
    """Two candidates, four trials: the two enqueued at the default bucket, then TPE proposals over
    (plan, bucket).  Only the DDP plan has buckets, so four combinations exist and TPE's repeats
    of measured ones are told PRUNED naming the trial that measured them (with its time, for TPE)."""
    pytest.importorskip("torch")
    import optuna

    cands = [_plan(t).to_string() for t in ("dp=2,zero=0", "dp=2,zero=3")]
    report = run_tune(MODEL, CLUSTER, trials=4, out_dir=tmp_path, timeout_s=180, steps=1, candidates=cands,
                      progress=False)
    done = [r for r in report.records if r.state == "COMPLETE"]
    assert sorted((r.plan, r.bucket_mb) for r in done) == sorted([(cands[0], 10), (cands[0], 25), (cands[0], 50),
                                                                  (cands[1], 25)])
    store, _ = open_storage(None, tmp_path)
    trials = optuna.load_study(study_name="autoplace", storage=store).get_trials()
    assert [t.params["plan"] for t in trials[:2]] == cands and all("fixed_params" in t.system_attrs for t in trials[:2])
    assert "fixed_params" not in trials[2].system_attrs  # proposed by the sampler, not enqueued
    by_number = {t.number: t for t in trials}
    for t in trials:
        if t.state.name == "PRUNED":
            holder = by_number[t.user_attrs["duplicate_of"]]
            assert tune_key(holder.params) == tune_key(t.params) and t.intermediate_values == {0: holder.value}
    assert report.ran == 4 and all(r.state in ("COMPLETE", "PRUNED") for r in report.records)


def test_journal_storage_and_short_plan(tmp_path: Path) -> None:
    from optuna.storages.journal import JournalStorage

    store, url = open_storage(str(tmp_path / "study.journal"), tmp_path)
    assert isinstance(store, JournalStorage) and url.endswith("study.journal")
    assert short_plan(_plan("dp=2,zero=3").to_string()) == "dp_shard=2 zero=3 mbs=1"


# ---- calibration ------------------------------------------------------------------------


def _observations(compute: float, bandwidth: float) -> list[Observation]:
    """Synthetic trials: what the cost model predicts under known factors, with +-3% noise."""
    m, c = load_model(MODEL), load_cluster(CLUSTER)
    truth = DEFAULT.replace(compute_scale=compute, bandwidth_scale=bandwidth)
    out = []
    for i, text in enumerate(["dp=2,zero=0", "dp=2,zero=3,mbs=4", "tp=2", "pp=2,mbs=2", "dp=2,zero=1,recompute=full"]):
        obs = Observation(m, c, _plan(text), 1.0, text)
        noise = 1.0 + 0.03 * math.sin(3.0 * i)
        out.append(Observation(m, c, obs.plan, predict(obs, truth) * noise, text))
    return out


@pytest.mark.parametrize("compute, bandwidth", [(6.0, None), (2.0, 20.0)])
def test_calibration_recovers_the_factors_and_lowers_the_error(tmp_path: Path, compute: float,
                                                               bandwidth: float | None) -> None:
    # bandwidth None: communication is too small a share of these steps for the data to fix the
    # factor (any value near 1 fits); at 20x slower links it dominates and must be recovered
    cal = fit(_observations(compute=compute, bandwidth=bandwidth or 3.0))
    assert cal.assumptions.compute_scale == pytest.approx(compute, rel=0.1)
    if bandwidth:
        assert cal.assumptions.bandwidth_scale == pytest.approx(bandwidth, rel=0.15)
    assert cal.error_after["mean_abs_rel"] < 0.05 < cal.error_before["mean_abs_rel"]
    assert cal.band[0] < 1.0 < cal.band[1] and cal.band[1] < 1.2
    path = write_calibration(cal, tmp_path / "calibration.yaml")
    loaded = load_calibration(path)
    assert loaded.compute_scale == pytest.approx(cal.assumptions.compute_scale)
    assert loaded.bandwidth_scale == pytest.approx(cal.assumptions.bandwidth_scale)
    assert load_band(path) == pytest.approx(cal.band)


@pytest.mark.parametrize("doc, field", [
    ({"assumptions": {"compute_scale": 2.0}, "extra": 1}, "extra"),
    ({"assumptions": {"compute_scael": 2.0}}, "assumptions.compute_scael"),
    ({"assumptions": {"compute_scale": -1}}, "assumptions.compute_scale"),
    ({"assumptions": {"compute_scale": "fast"}}, "assumptions.compute_scale"),
])
def test_calibration_loader_is_strict(tmp_path: Path, doc: dict, field: str) -> None:
    path = tmp_path / "calibration.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError) as err:
        load_calibration(path)
    assert field in str(err.value)


def test_calibration_leaves_out_trials_that_ran_another_plan(tmp_path: Path) -> None:
    """A trial labelled with a deviation (e.g. ZeRO-2 run as unresharded FSDP2) is not fitted."""
    import optuna

    from autoplace.calibrate import observations_from_study

    store, url = open_storage(str(tmp_path / "study.journal"), tmp_path)
    st = optuna.create_study(storage=store, study_name="s")
    plans = [_plan(t).to_string() for t in ("dp=2,zero=3", "dp=2,zero=2")]
    dist = optuna.distributions.CategoricalDistribution(plans)
    for plan, why in zip(plans, [None, "zero2 ran as FSDP2 reshard_after_forward=False"], strict=True):
        st.add_trial(optuna.trial.create_trial(params={"plan": plan}, distributions={"plan": dist}, value=1.0,
                                               user_attrs={"scale": 1.0, "deviation": why}))
    kept = observations_from_study(MODEL, CLUSTER, url, "s")
    assert [o.plan.zero for o in kept] == [3]
    assert len(observations_from_study(MODEL, CLUSTER, url, "s", include_deviations=True)) == 2


def test_calibration_needs_trials() -> None:
    with pytest.raises(SpecError, match="at least one"):
        fit([])


@pytest.mark.slow
def test_deepspeed_trials_train_with_the_emitted_config(tmp_path: Path) -> None:
    """--trainer deepspeed: the trial runs deepspeed.initialize with the ds_config.json autoplace
    emits for the plan; plans DeepSpeed cannot express (tp here) are left out of the candidates."""
    pytest.importorskip("deepspeed")
    import optuna

    report = run_tune(MODEL, CLUSTER, trials=1, top=3, out_dir=tmp_path, timeout_s=240, steps=1, progress=False,
                      framework="deepspeed")
    [trial] = report.records
    assert trial.state == "COMPLETE" and trial.measured_step_s and trial.measured_step_s > 0
    assert "tp=2" not in trial.plan
    store, _ = open_storage(None, tmp_path)
    [stored] = [t for t in optuna.load_study(study_name="autoplace", storage=store).get_trials()
                if t.state.name != "WAITING"]  # the other candidates stay queued for a re-run
    assert stored.user_attrs["framework"] == "deepspeed"
    # DeepSpeed runs ZeRO-1/2 and optimizer-only offload natively: its trials run their plan exactly
    assert stored.user_attrs["semantics"] == "exact" and stored.user_attrs["deviation"] is None
    result = json.loads((tmp_path / "trials" / "0000" / "result.json").read_text())
    assert result["framework"] == "deepspeed" and result["status"] == "ok"
