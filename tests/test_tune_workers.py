"""Three `tune` workers on one study, one of them SIGKILLed mid-trial: on a real PostgreSQL server
(Debian's postgresql, started from a temp dir by this module, stopped at its end; CI installs it)
and on a journal file.  The workers enter run_tune together (a barrier), so they race to create
the study and to take its trials -- autoplace before claims fails this test with a duplicate.
Six single-process candidates; the study must end with every candidate
COMPLETE exactly once, the killed trial FAIL and retried once by another worker, nothing
pruned, queued or running -- the ledger one worker leaves -- and no process of the killed
worker's trial left.  Heartbeats every second with a 6 s grace keep the retry quick without
mistaking a loaded worker for a dead one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from autoplace.cost.layers import layer_table
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.model import load_model
from autoplace.studies import Heartbeat, open_storage
from benchmarks.chaos import throwaway_postgres
from tests.helpers import survivors

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "tiny-llama.json"
BEAT = Heartbeat(interval_s=1, grace_s=6, max_retry=1)
CLUSTER_1 = "name: cpu-1\nnodes: 1\ngpus_per_node: 1\ngpu: cpu\nintra_node: loopback\ninter_node: loopback\n" \
            "host_memory_GB: 16\n"
WORKER = """\
import json, sys, time
from pathlib import Path
from autoplace.studies import Heartbeat
from autoplace.tune import run_tune
model, cluster, out, storage, *cands = sys.argv[1:]
Path(out, "ready").touch()
while not Path(out).parent.joinpath("go").exists():  # all three open the study at once
    time.sleep(0.01)
report = run_tune(model, cluster, trials=len(cands), out_dir=out, storage=storage, candidates=cands, timeout_s=240,
                  steps=1, warmup=1, scale=0.5, progress=False, heartbeat=Heartbeat(interval_s=1, grace_s=6, max_retry=1))
print(json.dumps({"ran": report.ran, "notes": report.notes}))
"""


# ---- a throwaway PostgreSQL ---------------------------------------------------------------


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A running PostgreSQL on 127.0.0.1 (benchmarks/chaos.py starts it); yields its URL."""
    with throwaway_postgres() as pg:
        if pg is None:
            pytest.skip("needs PostgreSQL's server binaries (Debian: apt-get install postgresql)")
        yield pg.url


# ---- claims under races, without torch ----------------------------------------------------

CLAIMER = """\
import json, random, sys, time
from pathlib import Path
import optuna
from autoplace.studies import Heartbeat, claim, open_storage
storage, go, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
store, _ = open_storage(storage, go.parent, Heartbeat(interval_s=1, grace_s=30, max_retry=0))
st = optuna.load_study(study_name="claims", storage=store, sampler=optuna.samplers.RandomSampler(seed=seed))
rng = random.Random(seed)
while not go.exists():
    time.sleep(0.01)
won, lost = [], []
for _ in range(12):
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")
        t = st.ask({"x": optuna.distributions.CategoricalDistribution(list(range(6)))})
    time.sleep(rng.random() * 0.05)  # widen the race between asking and claiming
    holder = claim(st, t.number, lambda p: p["x"], poll_s=0.01)
    if holder is None:
        time.sleep(rng.random() * 0.05)  # hold the combination a while, as a trial would
        st.tell(t, float(t.params["x"]))
        won.append(t.params["x"])
    else:
        t.set_user_attr("duplicate_of", holder)
        st.tell(t, state=optuna.trial.TrialState.PRUNED)
        lost.append(t.params["x"])
print(json.dumps({"won": won, "lost": lost}))
"""


@pytest.mark.parametrize("kind", ["postgresql", "journal"])
def test_claims_racing_from_three_processes_give_each_combination_one_trial(tmp_path: Path, kind: str,
                                                                            request: pytest.FixtureRequest) -> None:
    """36 random asks over 6 combinations from 3 processes started together: each combination
    is measured (COMPLETE) by exactly one trial; every other ask of it yielded to that one."""
    import json

    storage = _storage(kind, tmp_path, request)
    store, _ = open_storage(storage, tmp_path, BEAT)
    optuna.create_study(study_name="claims", storage=store)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, storage, str(go), str(seed)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in range(3)]
    time.sleep(3.0)  # let them import and wait at the barrier
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    trials = optuna.load_study(study_name="claims", storage=store).get_trials()
    won = [t.params["x"] for t in trials if t.state.name == "COMPLETE"]
    assert sorted(won) == sorted(set(won)) and sum(len(r["won"]) for r in results) == len(won)
    assert len(trials) == 36 and all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    by_number = {t.number: t for t in trials}
    for t in trials:  # a yielded ask names a trial with its combination
        if t.state.name == "PRUNED":
            assert by_number[t.user_attrs["duplicate_of"]].params == t.params


def test_claim_yields_to_earlier_and_finished_trials_and_waits_for_one_being_asked(tmp_path: Path) -> None:
    """The bakery rule, step by step on one storage: the interleavings the race test may not hit."""
    import threading

    from optuna.distributions import CategoricalDistribution

    from autoplace.studies import claim

    store, _ = open_storage(str(tmp_path / "s.journal"), tmp_path, BEAT)
    st = optuna.create_study(study_name="s", storage=store)
    dist = CategoricalDistribution([0, 1, 2, 3])
    sid = store.get_study_id_from_name("s")

    def asked(x: int | None) -> int:  # a RUNNING trial; None: still being asked (no parameters)
        trial = store.create_new_trial(sid)
        if x is not None:
            store.set_trial_param(trial, "x", dist.to_internal_repr(x), dist)
        return store.get_trial_number_from_id(trial)

    key = lambda p: p["x"]  # noqa: E731
    first, second = asked(1), asked(1)
    assert claim(st, second, key) == first and claim(st, first, key) is None  # the earlier one holds
    st.enqueue_trial({"x": 2})  # queued: holds its combination against later asks
    assert claim(st, asked(2), key) == 2
    third = asked(None)  # being asked: a later trial waits for its parameters
    late = asked(0)
    threading.Timer(0.5, lambda: store.set_trial_param(store.get_trial_id_from_study_id_trial_number(
        sid, third), "x", dist.to_internal_repr(0), dist)).start()
    assert claim(st, late, key, poll_s=0.05, patience_s=30) == third
    asked(None)  # a worker that died while asking: waited for ``patience_s``, then ignored
    assert claim(st, asked(3), key, poll_s=0.05, patience_s=0.3) is None
    store.set_trial_state_values(store.get_trial_id_from_study_id_trial_number(sid, third), optuna.trial.TrialState.FAIL)
    assert claim(st, asked(0), key) == third  # a failed trial that was not retried holds its combination


def test_a_trial_whose_worker_died_while_asking_stops_counting_as_running(tmp_path: Path) -> None:
    """An RDB never calls a trial that never beat stale, so a worker killed inside ask() would
    hold a RUNNING, parameter-less trial for ever and keep the study one trial short."""
    from datetime import datetime, timedelta

    from autoplace.tune import _snapshot

    store, _ = open_storage(str(tmp_path / "s.journal"), tmp_path, BEAT)
    st = optuna.create_study(study_name="s", storage=store)
    sid = store.get_study_id_from_name("s")
    old = optuna.trial.FrozenTrial(number=0, state=optuna.trial.TrialState.RUNNING, value=None, values=None,
                                   datetime_start=datetime.now() - timedelta(hours=1), datetime_complete=None,
                                   params={}, distributions={}, user_attrs={}, system_attrs={}, intermediate_values={},
                                   trial_id=0)
    store.create_new_trial(sid, template_trial=old)
    assert _snapshot(st, grace_s=6).running == 0
    store.create_new_trial(sid)  # being asked right now: running
    assert _snapshot(st, grace_s=6).running == 1


# ---- workers, and the processes they leave ------------------------------------------------


def _candidates() -> list[str]:
    m = load_model(MODEL)
    return [build_plan(parse_plan_string(text), world=1, blocks=layer_table(m).blocks,
                       global_batch=m.training.global_batch).to_string()
            for text in ("mbs=1", "mbs=2", "mbs=4", "mbs=8", "mbs=1,recompute=full", "mbs=2,recompute=full")]


def _start(out: Path, cluster: Path, storage: str, cands: list[str]) -> subprocess.Popen:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out / "worker.out", "wb") as stdout, open(out / "worker.err", "wb") as stderr:
        return subprocess.Popen([sys.executable, "-c", WORKER, str(MODEL), str(cluster), str(out), storage, *cands],
                                env=env, stdout=stdout, stderr=stderr)


def _release_together(workers: list[subprocess.Popen], outs: list[Path], go: Path) -> None:
    """Let the workers into run_tune at the same moment, once all have imported autoplace."""
    deadline = time.time() + 120
    while not all((out / "ready").exists() for out in outs):
        for proc, out in zip(workers, outs, strict=True):
            if proc.poll() is not None:
                pytest.fail(f"worker {out.name} exited early: {(out / 'worker.err').read_text()[-2000:]}")
        if time.time() > deadline:
            pytest.fail("the workers never got ready")
        time.sleep(0.05)
    go.touch()


def _kill_a_worker_mid_trial(workers: list[subprocess.Popen], outs: list[Path], storage: Any) -> tuple[int, Path]:
    """SIGKILL the first worker seen running a trial; returns (trial number, trial directory).

    The worker is stopped first, so it cannot tell its trial between the check (RUNNING in the
    storage) and the kill: the kill is mid-trial by construction, not by timing."""
    seen: set[Path] = set()
    deadline = time.time() + 180
    while time.time() < deadline:
        for proc, out in zip(workers, outs, strict=True):
            if proc.poll() is not None:
                pytest.fail(f"worker {out.name} exited early ({proc.returncode}): "
                            f"{(out / 'worker.err').read_text()[-2000:]}")
            for log in sorted(out.glob("trials/*/run.log")):
                if log.parent in seen:
                    continue
                seen.add(log.parent)
                proc.send_signal(signal.SIGSTOP)
                number = int(log.parent.name)
                study = optuna.load_study(study_name="autoplace", storage=storage)
                if next(t for t in study.get_trials() if t.number == number).state.name == "RUNNING":
                    proc.kill()
                    proc.wait()
                    return number, log.parent
                proc.send_signal(signal.SIGCONT)
        time.sleep(0.2)
    pytest.fail("no worker started a trial")


def _storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "journal":
        return str(tmp_path / "study.journal")
    url = request.getfixturevalue("postgres")
    # one database per test: the module's server outlives it
    import psycopg

    name = f"t{os.getpid()}_{int(time.time() * 1000)}"
    with psycopg.connect(url, autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + f"/{name}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgresql", "journal"])
def test_three_workers_one_killed_measure_every_candidate_once(tmp_path: Path, kind: str,
                                                                 request: pytest.FixtureRequest) -> None:
    pytest.importorskip("torch")
    storage = _storage(kind, tmp_path, request)
    cluster = tmp_path / "cpu-1.yaml"
    cluster.write_text(CLUSTER_1)
    cands = _candidates()
    outs = [tmp_path / f"w{i}" for i in range(3)]
    workers = [_start(out, cluster, storage, cands) for out in outs]
    try:
        _release_together(workers, outs, tmp_path / "go")  # they race to create the study and take its trials
        store, _ = open_storage(storage, tmp_path, BEAT)
        killed, trial_dir = _kill_a_worker_mid_trial(workers, outs, store)
        orphans = survivors(str(trial_dir))  # the reaper makes the trial follow its dead worker
        for proc in workers:
            proc.wait(timeout=600)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not orphans, f"the killed worker's trial processes outlived it: {orphans}"
    for proc, out in zip(workers, outs, strict=True):
        assert proc.returncode in (0, -signal.SIGKILL), (out / "worker.err").read_text()[-2000:]
    trials = optuna.load_study(study_name="autoplace", storage=store).get_trials()
    states = sorted(t.state.name for t in trials)
    assert states == ["COMPLETE"] * 6 + ["FAIL"], [(t.number, t.state.name, t.params) for t in trials]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert sorted(t.params["plan"] for t in done) == sorted(cands)  # each candidate once, none twice
    [failed] = [t for t in trials if t.state.name == "FAIL"]
    assert failed.number == killed and "fail_reason" not in failed.user_attrs  # failed by a heartbeat verdict
    [retry] = [t for t in done if t.system_attrs.get("failed_trial") == killed]
    assert retry.params == failed.params  # retried once, by a surviving worker
    assert all(t.value and t.value > 0 for t in done)
    assert not survivors(str(tmp_path)), "trial processes outlived their workers"


def test_a_trial_failed_as_stale_while_being_asked_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """A trial beats only once it has its parameters, so a storage outage longer than the grace period
    while a worker asks lets another worker's sweep fail it; the asker's next write then raises
    UpdateFinishedTrialError inside ``ask``.  The worker asks again and finishes the study (it exited 1,
    "internal error", in the chaos test's PostgreSQL restart)."""
    from autoplace import studies
    from autoplace.tune import run_tune

    original = studies._BeatingJournalStorage.set_trial_param
    swept: list[int] = []

    def set_param_after_a_sweep(self: Any, trial_id: int, *args: Any, **kwargs: Any) -> Any:
        if not swept:  # the first parameter of the first trial: another worker's sweep got there first
            swept.append(trial_id)
            self.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL)
        return original(self, trial_id, *args, **kwargs)

    monkeypatch.setattr(studies._BeatingJournalStorage, "set_trial_param", set_param_after_a_sweep)
    cluster = tmp_path / "cpu-1.yaml"
    cluster.write_text(CLUSTER_1)
    report = run_tune(str(MODEL), str(cluster), trials=1, out_dir=tmp_path / "out", storage=str(tmp_path / "s.journal"),
                      candidates=_candidates()[:1], timeout_s=240, steps=1, warmup=1, scale=0.5, progress=False,
                      heartbeat=BEAT)
    assert swept and report.ran == 1 and not report.incomplete
    states = [r.state for r in report.records]
    assert states.count("COMPLETE") == 1 and "FAIL" in states, states
