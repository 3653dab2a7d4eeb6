"""Optuna study storage with heartbeats and claims, for ``autoplace tune`` and ``autoplace calibrate``.

SQLite (the default), any Optuna RDB URL (PostgreSQL for many hosts) or a journal file.  While
a trial runs, a thread records its heartbeat in the storage; a worker killed mid-trial stops
beating, and once the grace period has passed any live worker (between trials, or from its own
trial's heartbeat thread) fails that trial and re-enqueues its combination, up to ``max_retry``
times (Optuna's ``RetryHeartbeatStaleTrialCallback``).  A trial that never beat at all (its
worker died between popping it and its first beat) goes stale the same way, counted from its
start: Optuna's RDB storage alone would leave it RUNNING for ever.  Failing a stale trial is a
compare-and-set in the storage, so among workers racing to notice it exactly one enqueues the
retry.  Storage calls wait out a database restart or outage (:mod:`autoplace.patience`).

Many workers on one study: every trial must measure a combination no other trial measures.
Popping an enqueued trial is atomic in Optuna (a row lock in an RDB, log order in a journal);
:func:`claim` settles the rest -- a combination asked twice, by two samplers or two enqueues.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
from optuna.storages._heartbeat import BaseHeartbeat  # what fail_stale_trials checks; not re-exported
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from autoplace.errors import BenchmarkError
from autoplace.patience import Outage, patient, transient, unreachable

log = logging.getLogger("autoplace")
_BEAT = "autoplace:heartbeat"  # journal trials' heartbeat (a system attribute: wall-clock seconds)


@dataclass(frozen=True)
class Heartbeat:
    """How a dead worker's trial is noticed and retried.

    Attributes:
        interval_s: seconds between heartbeats of a running trial.
        grace_s: a RUNNING trial whose last heartbeat is older than this is failed (its worker
            died) and, up to ``max_retry`` times, re-enqueued.  Six beats by default, not Optuna's
            two: a live worker whose beats stall (a locked SQLite file, a loaded host) must not
            lose its trial to another worker.
        max_retry: re-runs of a combination whose workers keep dying (a per-candidate budget);
            then it stays FAIL and is *given up* -- reported, and run again by the next
            invocation -- so a plan that kills its orchestrator (host OOM) cannot loop for ever.
        patience_s: how long a storage call waits for an unreachable database before the
            worker gives up (:mod:`autoplace.patience`).
    """

    interval_s: int = 10
    grace_s: int = 60
    max_retry: int = 3
    patience_s: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.interval_s <= self.grace_s or self.max_retry < 0 or not self.patience_s >= 0:
            raise BenchmarkError(f"1 <= interval_s <= grace_s, max_retry >= 0 and patience_s >= 0 must hold, but got "
                                 f"(interval_s={self.interval_s}, grace_s={self.grace_s}, max_retry={self.max_retry}, "
                                 f"patience_s={self.patience_s})")

    def outage(self) -> Outage:
        """A fresh outage record for one storage: no stale verdicts for a grace period after a fault."""
        return Outage(self.patience_s, quiet_s=self.grace_s + self.interval_s)


class _RetryLiveCombinations:
    """Optuna's retry callback, but for trials whose worker died while asking (no parameters):
    those measured nothing and are only failed, so a retry never inherits an empty combination --
    unless the trial was popped from the queue, whose combination (``fixed_params``) its retry keeps."""

    def __init__(self, max_retry: int) -> None:
        self._retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)

    def __call__(self, study: Any, trial: Any) -> None:
        if trial.params or trial.system_attrs.get("fixed_params"):  # a popped queued trial: its combination
            self._retry(study, trial)


def replaced(trials: list[Any]) -> set[int]:
    """Numbers of failed trials another trial stands for: retried after a stale heartbeat
    (``retry_history``) or revived by a later invocation after they were given up (``revived``)."""
    return {n for t in trials for key in ("retry_history", "revived") for n in t.system_attrs.get(key, [])}


@patient
class _BeatingJournalStorage(JournalStorage, BaseHeartbeat):
    """A journal file with heartbeats, which Optuna 5's JournalStorage lacks (only RDBStorage has
    them).  A beat is the trial's ``autoplace:heartbeat`` system attribute: the writer's wall clock,
    so hosts sharing the file must keep their clocks in step (NTP), as they would for NFS anyway."""

    def __init__(self, path: str, heartbeat: Heartbeat, on_stale: Callable[[Any, Any], None]) -> None:
        self.outage = heartbeat.outage()
        super().__init__(JournalFileBackend(path))
        self._heartbeat = heartbeat
        self._on_stale = on_stale

    def record_heartbeat(self, trial_id: int) -> None:
        # the unwrapped write: a beat is not retried (the next one comes soon)
        _noting_faults(self.outage, JournalStorage.set_trial_system_attr, self, trial_id, _BEAT, time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        if self.outage.recent():
            return []
        now = time.time()
        running = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
        return [self.get_trial_id_from_study_id_trial_number(study_id, t.number) for t in running
                if now - _last_beat(t) > self._heartbeat.grace_s]

    def get_heartbeat_interval(self) -> int:
        return self._heartbeat.interval_s

    def get_heartbeat_stale_trial_callback(self) -> Callable[[Any, Any], None]:
        return self._on_stale


@patient
class _BeatingRDBStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage, patient with its server, and with a stale rule for trials that never
    beat: Optuna skips a RUNNING trial without a heartbeat row, so one popped by a worker that
    died before its first beat would stay RUNNING for good.  Such a trial goes stale ``grace_s``
    after it started (the popping worker's clock, as the journal's ``_last_beat``)."""

    def __init__(self, url: str, heartbeat: Heartbeat, on_stale: Callable[[Any, Any], None]) -> None:
        self.outage = heartbeat.outage()
        super().__init__(url, heartbeat_interval=heartbeat.interval_s, grace_period=heartbeat.grace_s,
                         heartbeat_stale_trial_callback=on_stale, engine_kwargs=engine_kwargs(url))

    def record_heartbeat(self, trial_id: int) -> None:
        _noting_faults(self.outage, super().record_heartbeat, trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        if self.outage.recent():  # nobody could beat a moment ago
            return []
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        stale = super()._get_stale_trial_ids(study_id)
        # Optuna stores the start as naive UTC (column ``datetime_start``)
        oldest = datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=self.grace_period or 0)
        with _create_scoped_session(self.scoped_session) as session:
            never = (session.query(models.TrialModel.trial_id)
                     .filter(models.TrialModel.study_id == study_id, models.TrialModel.state == TrialState.RUNNING,
                             models.TrialModel._datetime_start_utc < oldest, ~models.TrialModel.heartbeats.any())
                     .all())
        return stale + [row[0] for row in never if row[0] not in stale]


# libpq's limits on a PostgreSQL connection: a worker whose server went away mid-query (a restart,
# a network partition) gets an error it can retry with patience instead of waiting forever for a
# reply (a chaos run's worker sat 200 s in a SELECT after the server restarted)
POSTGRES_LIMITS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                   "keepalives_count": 3, "options": "-c statement_timeout=60000"}


def engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options of a study storage URL: connections checked before use, and
    PostgreSQL's with :data:`POSTGRES_LIMITS`."""
    limits = {"connect_args": dict(POSTGRES_LIMITS)} if url.startswith(("postgresql", "postgres:")) else {}
    return {"pool_pre_ping": True, **limits}


def _noting_faults(outage: Outage, write: Callable[..., Any], *args: Any) -> None:
    """One heartbeat write; an unreachable storage is noted (no stale verdicts for a while)."""
    try:
        write(*args)
    except Exception as exc:
        if transient(exc):
            outage.fault()
        raise


def _last_beat(t: Any) -> float:
    """A journal trial's last sign of life: its beat or its start, whichever is later (a retry
    inherits its dead predecessor's system attributes, old beat included)."""
    started = t.datetime_start.timestamp() if t.datetime_start else 0.0
    return max(float(t.system_attrs.get(_BEAT, 0.0)), started)


def open_storage(storage: str | None, out_dir: Path, heartbeat: Heartbeat | None = None) -> tuple[Any, str]:
    """An Optuna storage with heartbeats: SQLite in ``out_dir`` by default, an RDB URL, or a journal
    file (``journal:PATH`` or a path ending in ``.log``/``.journal``)."""
    hb = heartbeat or Heartbeat()
    if storage is None:
        out_dir.mkdir(parents=True, exist_ok=True)
        storage = f"sqlite:///{(out_dir / 'study.db').resolve()}"
    with warnings.catch_warnings():  # heartbeats and the retry callback are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = _RetryLiveCombinations(hb.max_retry)
        path = journal_path(storage)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            return _BeatingJournalStorage(path, hb, retry), storage
        return _rdb(storage, hb, retry), storage


def dashboard_command(storage: str) -> list[str]:
    """The optuna-dashboard command line that opens ``storage`` (a URL or a journal file, as
    :func:`open_storage` takes it): optuna-dashboard 0.21 takes an RDB URL, and a journal file by its
    path (``_storage_url.guess_storage_from_url``), never autoplace's ``journal:`` prefix."""
    path = journal_path(storage)
    return ["optuna-dashboard", storage if path is None else str(Path(path).resolve())]


def journal_path(storage: str) -> str | None:
    """The journal file ``storage`` names (``journal:PATH`` or a path ending in ``.log``/``.journal``),
    or None for an RDB URL."""
    if storage.startswith("journal:") or storage.endswith((".log", ".journal")):
        return storage.removeprefix("journal:")
    return None


def _rdb(url: str, hb: Heartbeat, retry: Any, attempts: int = 5) -> Any:
    """An RDBStorage; retried because workers starting together on an empty database race to create
    Optuna's tables, and the losers' CREATE TABLE fails (PostgreSQL: a duplicate key in pg_type)."""
    import sqlalchemy.exc

    for attempt in range(attempts):
        try:
            return _BeatingRDBStorage(url, hb, retry)
        except ImportError as exc:  # Optuna's wording names no package
            hint = "pip install 'autoplace[postgres]'" if url.startswith("postgresql") else "install its SQLAlchemy driver"
            raise BenchmarkError(f"cannot open the study storage {url}: no database driver ({hint})") from exc
        except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            if attempt == attempts - 1:
                raise BenchmarkError(f"cannot open the study storage {url}: {exc}") from exc
            log.info("storage %s not ready (%s); retrying", url, exc)
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


@contextmanager
def beating(storage: Any, study_id: int, number: int, interval_s: int,
            sweep: Callable[[], None] | None = None) -> Iterator[None]:
    """Record trial ``number``'s heartbeat now and every ``interval_s`` until the block exits;
    after each beat, ``sweep`` (fail other workers' stale trials) if given.

    Optuna beats only inside ``Study.optimize``; this study uses ask/tell (to skip duplicates), so
    it beats itself.  The block must end before the trial is told: a journal beat on a finished
    trial would be refused."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            beat_once(storage, trial_id, number)
            if sweep is not None:
                sweep()

    beat_once(storage, trial_id, number)

    thread = threading.Thread(target=beat, name=f"autoplace-heartbeat-{number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def beat_once(storage: Any, trial_id: int, number: int) -> None:
    """Record one heartbeat of trial ``number``; a missed one is a warning, not the trial's end."""
    try:
        storage.record_heartbeat(trial_id)
    except Exception as exc:  # noqa: BLE001 - a missed beat (the database restarting) must not end the trial
        # an outage reads as one, not as Optuna's wrapper ("invalid data in the commit, e.g. exceeding max length")
        log.warning("heartbeat of trial %d not recorded: %s", number,
                    f"{unreachable(exc)}; the next beat retries" if transient(exc) else exc)


def fail_stale_trials(st: Any) -> None:
    """Fail RUNNING trials whose worker stopped beating; the storage's callback re-enqueues them.
    A storage fault here is only logged: the next sweep (a beat or a loop later) tries again."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(st)
    except Exception as exc:
        if not (isinstance(exc, BenchmarkError) or transient(exc)):
            raise
        log.warning("stale trials not checked: %s", exc)


def claim(st: Any, number: int, key: Callable[[dict[str, Any]], Hashable], poll_s: float = 0.2,
          patience_s: float = 60.0) -> int | None:
    """Whether trial ``number`` may measure its combination, among workers racing on one study.

    The storage numbers trials in one order (an RDB locks the study row to number a trial; a
    journal numbers them in log order), so the rule is Lamport's bakery: a trial yields to every
    finished trial with its combination and to every *earlier* trial, queued or running, with it.
    An earlier trial still being asked (RUNNING, no parameters yet) is waited for, up to
    ``patience_s`` (a worker that died there is then ignored).  Two racing trials always see
    the earlier one: it was created before the later one read the study.  Failed trials that
    were retried do not count (the retry stands for them), nor do pruned ones (they yielded).

    Args:
        st: the study; ``number`` a trial of it that was asked and has its parameters.
        key: a combination from a trial's parameters (knobs that change nothing folded).

    Returns:
        None when the trial holds the combination, else the number of the trial that does.
    """
    deadline = time.monotonic() + patience_s
    while True:
        trials = st.get_trials(deepcopy=False)
        mine = key(next(t for t in trials if t.number == number).params)
        retried = replaced(trials)
        asking = False
        for t in trials:
            earlier_open = t.number < number and t.state in (TrialState.RUNNING, TrialState.WAITING)
            # a trial failed before it had its parameters (failed as stale while being asked) measured nothing
            finished = t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and bool(t.params))
            if t.number == number or t.number in retried or not (earlier_open or finished):
                continue
            try:  # an enqueued trial's combination is fixed before it is popped
                theirs = key(t.system_attrs.get("fixed_params") or t.params)
            except KeyError:  # still being asked: its parameters are not all set yet
                asking = asking or t.state == TrialState.RUNNING
                continue
            if theirs == mine:
                return int(t.number)
        if not asking or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
