"""What issue 27 asked of ``tune`` between its workers and its storage, step by step and without torch:
a trial that never beat goes stale on an RDB; a candidate whose retries all died is given up, named,
exits 4 and is revived by the next invocation; storage calls wait out transient faults and a
lost reply never tells a trial twice.  (tests/test_tune_chaos.py runs all of it under real kills.)"""

from __future__ import annotations

import warnings
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy.exc
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState
from typer.testing import CliRunner

import autoplace.patience as patience
from autoplace.errors import BenchmarkError
from autoplace.patience import Outage, patient
from autoplace.studies import Heartbeat, claim, fail_stale_trials, open_storage
from autoplace.tune import TuneReport, _key, _revive, _snapshot

BEAT = Heartbeat(interval_s=1, grace_s=2, max_retry=1)
PLAN = "dp_replicate=1,dp_shard=1,tp=1,pp=1,cp=1,ep=1,vpp=1,sp=false,zero=0,mbs=1,schedule=1f1b," \
       "offload_optimizer=none,offload_params=none,layers=4,recompute=none"
DISTS: dict[str, BaseDistribution] = {"plan": CategoricalDistribution([PLAN]), "bucket_mb": CategoricalDistribution([25, 10, 50])}


def _old_trial(state: TrialState, params: dict[str, Any] | None = None, **attrs: Any) -> FrozenTrial:
    """A trial started an hour ago, e.g. by a worker that died then."""
    params = params or {}
    return FrozenTrial(number=0, state=state, value=None, values=None,
                       datetime_start=datetime.now() - timedelta(hours=1), datetime_complete=None, params=params,
                       distributions={k: DISTS[k] for k in params}, user_attrs=attrs.get("user_attrs", {}),
                       system_attrs=attrs.get("system_attrs", {}), intermediate_values={}, trial_id=0)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_popped_trial_that_never_beat_is_failed_and_retried(tmp_path: Path, kind: str) -> None:
    """A worker SIGKILLed between popping a trial and its first beat: Optuna's RDB storage skips a
    RUNNING trial without a heartbeat row, so before issue 27 it stayed RUNNING for ever."""
    url = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else str(tmp_path / "s.journal")
    store, _ = open_storage(url, tmp_path, BEAT)
    st = optuna.create_study(study_name="s", storage=store)
    sid = store.get_study_id_from_name("s")
    store.create_new_trial(sid, template_trial=_old_trial(TrialState.RUNNING, {"plan": PLAN, "bucket_mb": 25}))
    store.create_new_trial(sid, template_trial=_old_trial(TrialState.RUNNING))  # died while asking: no parameters
    fail_stale_trials(st)
    trials = st.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.WAITING]
    assert trials[2].params == trials[0].params and trials[2].system_attrs["failed_trial"] == 0  # retried once
    # the parameter-less one measured nothing: failed, not retried with an empty combination


def test_a_running_trial_fails_other_workers_stale_trials_from_its_heartbeat_thread(tmp_path: Path) -> None:
    """Every live worker sweeps, not only one that asks: while its own trial runs, each beat fails
    a dead worker's stale trial (and so queues its retry)."""
    import time

    from autoplace.studies import beating

    store, _ = open_storage(str(tmp_path / "s.journal"), tmp_path, BEAT)
    st = optuna.create_study(study_name="s", storage=store)
    sid = store.get_study_id_from_name("s")
    store.create_new_trial(sid, template_trial=_old_trial(TrialState.RUNNING, {"plan": PLAN, "bucket_mb": 25}))
    mine = store.get_trial_number_from_id(store.create_new_trial(sid))
    with beating(store, sid, mine, interval_s=1, sweep=lambda: fail_stale_trials(st)):
        deadline = time.monotonic() + 30
        while st.get_trials()[0].state == TrialState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.1)
    states = [t.state for t in st.get_trials()]
    assert states == [TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING], states


def test_given_up_candidate_is_named_and_revived_by_the_next_invocation(tmp_path: Path) -> None:
    store, _ = open_storage(str(tmp_path / "s.journal"), tmp_path, BEAT)
    st = optuna.create_study(study_name="s", storage=store)
    sid = store.get_study_id_from_name("s")
    params = {"plan": PLAN, "bucket_mb": 25}
    # its retry died too (retry_history holds max_retry=1 failed trials): given up
    store.create_new_trial(sid, template_trial=_old_trial(TrialState.FAIL, params,
                                                          system_attrs={"retry_history": [7], "failed_trial": 7}))
    snap = _snapshot(st, grace_s=2, max_retry=1)
    assert list(snap.given_up) == [_key(params)] and _key(params) in snap.finished  # counted, so workers stop
    assert _snapshot(st, grace_s=2, max_retry=2).given_up == {}  # a budget left: the retry callback's job
    report = TuneReport("s", "x", [], 0, given_up=["mbs=1"])
    assert "given up" in report.incomplete and "mbs=1" in report.incomplete and "run the same command" in report.incomplete
    _revive(st, snap)  # a re-run: queued again with a fresh budget
    again = _snapshot(st, grace_s=2, max_retry=1)
    assert again.given_up == {} and _key(params) not in again.finished and _key(params) in again.busy
    _revive(st, again)  # a second worker starting now does not queue it twice
    assert [t.state for t in st.get_trials()] == [TrialState.FAIL, TrialState.WAITING]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeats outside optimize
        trial = st.ask(DISTS)  # pops the revival
    assert trial.params == params and claim(st, trial.number, _key) is None  # not a duplicate of the given-up one


def test_a_stale_verdict_whose_retry_was_never_queued_is_requeued(tmp_path: Path) -> None:
    """The sweeper failed a stale trial and was killed before queueing its retry (found by
    tests/test_tune_chaos.py: the clean worker then exited 0 with that candidate unmeasured)."""
    from types import SimpleNamespace

    from autoplace.tune import _requeue_dropped

    store, _ = open_storage(str(tmp_path / "s.journal"), tmp_path, BEAT)
    st = optuna.create_study(study_name="s", storage=store)
    sid = store.get_study_id_from_name("s")
    params = {"plan": PLAN, "bucket_mb": 25}
    failed = _old_trial(TrialState.FAIL, params)
    failed.datetime_complete = datetime.now() - timedelta(minutes=30)
    store.create_new_trial(sid, template_trial=failed)
    snap = _snapshot(st, grace_s=2, max_retry=1)  # budget left: not given up, not finished, owed
    assert [t.number for t in snap.dropped] == [0] and snap.given_up == {} and snap.finished == {}
    _requeue_dropped(st, snap.dropped, SimpleNamespace(storage=store, heartbeat=BEAT))  # type: ignore[arg-type]
    [_, retry] = st.get_trials()
    assert retry.state == TrialState.WAITING and retry.params == params and retry.system_attrs["retry_history"] == [0]
    assert _snapshot(st, grace_s=2, max_retry=1).dropped == []


def test_tune_exits_4_naming_what_is_left(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import autoplace.tune
    from autoplace.cli import app

    report = TuneReport("s", "x", [], 0, given_up=["mbs=4"], unmeasured=["mbs=8"])
    monkeypatch.setattr(autoplace.tune, "run_tune", lambda *a, **k: report)
    monkeypatch.setattr(autoplace.tune, "print_report", lambda r: None)
    result = CliRunner().invoke(app, ["tune", "m.json", "c.yaml", "--retries", "2", "--grace", "30"])
    assert result.exit_code == 4, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("autoplace: error:") and "mbs=4" in line and "mbs=8" in line
    monkeypatch.setattr(autoplace.tune, "run_tune", lambda *a, **k: TuneReport("s", "x", [], 0))
    assert CliRunner().invoke(app, ["tune", "m.json", "c.yaml"]).exit_code == 0


# ---- storage faults ------------------------------------------------------------------------------


def _down(n: int) -> list[Exception]:
    """``n`` faults as SQLAlchemy raises them when PostgreSQL restarts (wrapped by Optuna)."""
    cause = sqlalchemy.exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
    faults: list[Exception] = []
    for _ in range(n):
        try:
            raise optuna.exceptions.StorageInternalError("commit failed") from cause
        except optuna.exceptions.StorageInternalError as exc:
            faults.append(exc)
    return faults


@patient
class _Flaky(JournalStorage):
    """A journal whose next calls fail as a restarting database would; ``lose_reply`` makes the
    next state change commit and then fail (the reply lost on the way back)."""

    def __init__(self, path: Path, patience_s: float) -> None:
        self.outage = Outage(patience_s, quiet_s=60)
        self.faults: list[Exception] = []
        self.lose_reply = False
        super().__init__(JournalFileBackend(str(path)))

    def get_all_trials(self, *args: Any, **kwargs: Any) -> Any:
        if self.faults:
            raise self.faults.pop()
        return super().get_all_trials(*args, **kwargs)

    def set_trial_state_values(self, *args: Any, **kwargs: Any) -> bool:
        done = super().set_trial_state_values(*args, **kwargs)
        if self.lose_reply:
            self.lose_reply = False
            raise _down(1)[0]
        return done


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patience, "FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(patience, "MAX_DELAY_S", 0.02)


def test_a_storage_outage_is_waited_out_and_noted(tmp_path: Path, quick_backoff: None) -> None:
    store = _Flaky(tmp_path / "s.journal", patience_s=5)
    st = optuna.create_study(study_name="s", storage=store)
    store.faults = _down(3)
    assert st.get_trials() == [] and not store.faults  # three faults, then through
    assert store.outage.recent()  # no stale verdicts for a while: nobody could beat


def test_an_outage_longer_than_the_patience_is_one_clear_error(tmp_path: Path, quick_backoff: None) -> None:
    store = _Flaky(tmp_path / "s.journal", patience_s=0.05)
    st = optuna.create_study(study_name="s", storage=store)
    store.faults = _down(100)
    with pytest.raises(BenchmarkError, match="unreachable for .* run the same command again"):
        st.get_trials()


def _data_error() -> Exception:
    """A request the database refuses (Optuna wraps SQLAlchemy's DataError as it wraps an outage)."""
    try:
        raise optuna.exceptions.StorageInternalError("commit failed") from sqlalchemy.exc.DataError(
            "INSERT", {}, ValueError("value too long for type character varying(512)"))
    except optuna.exceptions.StorageInternalError as exc:
        return exc


@pytest.mark.parametrize("fault", [_data_error(), optuna.exceptions.StorageInternalError("no cause")])
def test_a_request_error_is_not_retried(tmp_path: Path, quick_backoff: None, fault: Exception) -> None:
    store = _Flaky(tmp_path / "s.journal", patience_s=5)
    st = optuna.create_study(study_name="s", storage=store)
    store.faults = [fault]  # the data, not the connection
    with pytest.raises(optuna.exceptions.StorageInternalError):
        st.get_trials()
    assert not store.outage.recent()


@patient
class _FlakyRDB(optuna.storages.RDBStorage):
    """An RDB whose next reads of trials fail; a Study reads them through Optuna's cache, which
    calls the backend's private ``_get_trials`` (a worker exited 1 there when PostgreSQL restarted)."""

    def __init__(self, url: str, patience_s: float) -> None:
        self.outage = Outage(patience_s, quiet_s=60)
        self.faults: list[Exception] = []
        super().__init__(url)

    def _get_trials(self, *args: Any, **kwargs: Any) -> Any:
        if self.faults:
            raise self.faults.pop()
        return super()._get_trials(*args, **kwargs)


def test_reads_through_a_studys_cache_wait_out_an_outage(tmp_path: Path, quick_backoff: None) -> None:
    store = _FlakyRDB(f"sqlite:///{tmp_path / 's.db'}", patience_s=5)
    st = optuna.create_study(study_name="s", storage=store)
    st.ask(DISTS)
    rollback = sqlalchemy.exc.PendingRollbackError("Can't reconnect until invalid transaction is rolled back")
    try:  # as the failed worker saw it: Optuna's commit error, caused by the dropped connection's session
        raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from rollback
    except optuna.exceptions.StorageInternalError as exc:
        store.faults = [exc, *_down(2)]
    assert len(st.get_trials()) == 1 and not store.faults
    assert store.outage.recent()


def test_a_tell_whose_reply_was_lost_is_told_once(tmp_path: Path, quick_backoff: None) -> None:
    store = _Flaky(tmp_path / "s.journal", patience_s=5)
    st = optuna.create_study(study_name="s", storage=store)
    trial = st.ask(DISTS)
    store.lose_reply = True
    st.tell(trial, 1.5)  # committed, reply lost, retried: finds it told and counts it done
    [t] = st.get_trials()
    assert t.state == TrialState.COMPLETE and t.value == 1.5


def test_a_postgres_storage_never_waits_forever_for_its_server(tmp_path: Path) -> None:
    """libpq's limits on every connection (keepalives, connect and statement timeouts), and a
    statement the server cancelled is an outage, retried with patience."""
    from autoplace.patience import transient
    from autoplace.studies import engine_kwargs
    from benchmarks.chaos import throwaway_postgres

    assert engine_kwargs(f"sqlite:///{tmp_path / 's.db'}") == {"pool_pre_ping": True}
    with throwaway_postgres() as pg:
        if pg is None:
            pytest.skip("needs PostgreSQL's server binaries (Debian: apt-get install postgresql)")
        store, _ = open_storage(pg.database("limits"), tmp_path, BEAT)
        with store.engine.connect() as con:
            assert con.execute(sqlalchemy.text("SHOW statement_timeout")).scalar() == "1min"
            con.execute(sqlalchemy.text("SET statement_timeout = 50"))
            with pytest.raises(sqlalchemy.exc.OperationalError) as cancelled:
                con.execute(sqlalchemy.text("SELECT pg_sleep(2)"))
        assert transient(cancelled.value)


def test_a_heartbeat_lost_to_an_outage_reads_as_an_outage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 36: a beat during a storage outage was logged as Optuna's StorageInternalError ("invalid data in
    the commit, e.g. exceeding max length"), which Optuna raises from any SQLAlchemy error; the warning
    names the outage and its cause (the database file is gone: SQLite's OperationalError)."""
    import logging

    import sqlalchemy

    from autoplace.studies import beat_once

    store, _ = open_storage(None, tmp_path, BEAT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeats outside optimize
        st = optuna.create_study(study_name="s", storage=store)
        trial = st.ask()
    backend = getattr(store, "_backend", store)
    backend.scoped_session.remove()  # the database goes away
    backend.scoped_session.configure(bind=sqlalchemy.create_engine(f"sqlite:///{tmp_path}/gone/study.db"))
    with caplog.at_level(logging.WARNING, logger="autoplace"):
        beat_once(backend, trial._trial_id, trial.number)
    assert f"heartbeat of trial {trial.number} not recorded: study storage unreachable (OperationalError" \
        in caplog.text and "max length" not in caplog.text, caplog.text
