"""A tune worker killed mid-trial: its trial must not stay RUNNING, and a re-run must measure
every candidate once -- the killed one again, the finished ones never.  Heartbeats every second
with a 2 s grace period keep this quick; the trials run one CPU process each."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
import pytest

from autoplace.cost.layers import layer_table
from autoplace.errors import BenchmarkError
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.model import load_model
from autoplace.studies import Heartbeat, open_storage
from autoplace.tune import run_tune
from tests.helpers import survivors

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "tiny-llama.json"
FAST = Heartbeat(interval_s=1, grace_s=2, max_retry=1)
CLUSTER_1 = """\
name: cpu-1
nodes: 1
gpus_per_node: 1
gpu: cpu
intra_node: loopback
inter_node: loopback
host_memory_GB: 16
"""
FIRST_RUN = """\
import sys
from autoplace.studies import Heartbeat
from autoplace.tune import run_tune
cands = sys.argv[4:]
run_tune(sys.argv[1], sys.argv[2], trials=3, out_dir=sys.argv[3], storage=STORAGE, candidates=cands,
         inject={cands[1]: 'hang'}, timeout_s=300, steps=1, progress=False,
         heartbeat=Heartbeat(interval_s=1, grace_s=2, max_retry=1))
"""


def _candidates() -> list[str]:
    """Three single-process plans: A completes, B is killed (its first run hangs), C is left."""
    m = load_model(MODEL)
    return [build_plan(parse_plan_string(text), world=1, blocks=layer_table(m).blocks,
                       global_batch=m.training.global_batch).to_string()
            for text in ("mbs=1", "mbs=2", "recompute=full")]


def _start_first_run(tmp_path: Path, cluster: Path, storage: str | None, cands: list[str]) -> subprocess.Popen:
    script = FIRST_RUN.replace("STORAGE", repr(storage))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "first-run.err", "wb") as err:  # a file, not a pipe nobody drains
        return subprocess.Popen([sys.executable, "-c", script, str(MODEL), str(cluster), str(tmp_path), *cands],
                                env=env, stdout=subprocess.DEVNULL, stderr=err)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            err = (path.parents[2] / "first-run.err").read_text()[-2000:]
            pytest.fail(f"the first run exited early ({proc.returncode}): {err}")
        if time.time() > deadline:
            pytest.fail(f"{path} never appeared")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_killed_trial_fails_and_is_retried_and_finished_ones_never_rerun(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("torch")
    cluster = tmp_path / "cpu-1.yaml"
    cluster.write_text(CLUSTER_1)
    storage = str(tmp_path / "study.journal") if kind == "journal" else None
    cands = _candidates()
    proc = _start_first_run(tmp_path, cluster, storage, cands)
    try:
        _wait_for(tmp_path / "trials" / "0001" / "run.log", proc)  # A done, B's processes started
        time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
        orphans = survivors(str(tmp_path))
    assert not orphans, f"trial processes outlived their tune process: {orphans}"
    store, _ = open_storage(storage, tmp_path, FAST)
    states = [t.state.name for t in optuna.load_study(study_name="autoplace", storage=store).get_trials()]
    # a dead worker's trial: RUNNING until someone notices; C still queued (the creator enqueued all three)
    assert states == ["COMPLETE", "RUNNING", "WAITING"]

    report = run_tune(MODEL, cluster, trials=3, out_dir=tmp_path, storage=storage, candidates=cands, steps=1,
                      timeout_s=60, progress=False, heartbeat=FAST)
    by_number = {r.number: r for r in report.records}
    assert (by_number[0].plan, by_number[0].state) == (cands[0], "COMPLETE")
    assert (by_number[1].plan, by_number[1].state, by_number[1].reason) == (cands[1], "FAIL",
                                                                         "worker died (heartbeat stale)")
    done = [r for r in report.records if r.state == "COMPLETE"]
    assert sorted(r.plan for r in done) == sorted(cands)  # every candidate measured exactly once
    assert [r.reason for r in done if r.plan == cands[1]] == ["retry of #1"]
    assert report.ran == 2 and len(report.records) == 4  # A was not run again
    assert all(r.measured_step_s and r.measured_step_s > 0 for r in done)


def _ask(st: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():  # Optuna: heartbeats are meant for optimize(); tune beats itself
        warnings.simplefilter("ignore")
        return st.ask({"x": optuna.distributions.FloatDistribution(0, 2)})


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_stale_journal_trial_is_failed_and_retried_up_to_max_retry(tmp_path: Path) -> None:
    store, _ = open_storage(str(tmp_path / "study.journal"), tmp_path, Heartbeat(interval_s=1, grace_s=1, max_retry=1))
    st = optuna.create_study(study_name="s", storage=store)
    st.enqueue_trial({"x": 1.0})
    trial = _ask(st)
    store.record_heartbeat(store.get_trial_id_from_study_id_trial_number(store.get_study_id_from_name("s"), 0))
    optuna.storages.fail_stale_trials(st)
    assert [t.state.name for t in st.get_trials()] == ["RUNNING"]  # beat just now: alive
    time.sleep(2.2)
    optuna.storages.fail_stale_trials(st)
    assert [t.state.name for t in st.get_trials()] == ["FAIL", "WAITING"]
    retry = _ask(st)
    assert retry.number == 1 and retry.params == trial.params == {"x": 1.0}
    optuna.storages.fail_stale_trials(st)  # it inherited trial 0's old beat; its own start counts
    assert [t.state.name for t in st.get_trials()] == ["FAIL", "RUNNING"]
    time.sleep(2.2)
    optuna.storages.fail_stale_trials(st)
    assert [t.state.name for t in st.get_trials()] == ["FAIL", "FAIL"]  # max_retry=1: not queued again


def test_heartbeat_settings_are_checked() -> None:
    with pytest.raises(BenchmarkError, match="interval_s=5, grace_s=2"):
        Heartbeat(interval_s=5, grace_s=2)
