"""Riding out storage outages: an Optuna storage whose calls wait for the database to come back.

A ``tune`` worker talks to its study storage between trials (ask, claim, tell) and during one
(heartbeats, user attributes).  A PostgreSQL server restarting, or a network hiccup, makes every
call in that window fail -- and Optuna lets the failure end the worker.  :func:`patient` makes a
storage class retry a call that failed for a transient reason (the connection, not the data)
with exponential backoff, up to a patience, then raise one :class:`BenchmarkError`.

Retrying is safe because every write a worker makes is idempotent or checked: attributes are
set to the same value again; a tell whose commit landed but whose reply was lost finds the trial
already in the told state and counts as done (nothing told twice); a trial created or popped
twice is a RUNNING trial no one beats, failed as stale later (nothing lost).  Heartbeats are not
retried: the next beat comes soon, and a beat stuck in backoff would hold its trial open.

After an outage no worker could beat, so a storage that has just seen one passes no stale
verdict for a grace period: live workers get the time to beat again before their trials are
judged dead.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import optuna
from optuna.storages import BaseStorage

from autoplace.errors import BenchmarkError

log = logging.getLogger("autoplace")

FIRST_DELAY_S = 0.5  # backoff: 0.5, 1, 2, 4, then every 5 s
MAX_DELAY_S = 5.0
NOT_RETRIED = frozenset({"record_heartbeat", "check_trial_is_updatable", "remove_session", "get_heartbeat_interval",
                         "get_heartbeat_stale_trial_callback", "get_failed_trial_callback", "is_heartbeat_enabled"})
_TRANSIENT_ERRNO = {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                    errno.ECONNREFUSED, errno.ECONNRESET}

# what Optuna's _CachedStorage (the storage a Study holds) calls on its RDB backend besides the public API
BACKEND_CALLS = ("_create_new_trial", "_get_best_trial_id", "_get_stale_trial_ids", "_get_trials", "_set_trial_param")

S = TypeVar("S", bound=type)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those it was raised from or during (Optuna wraps SQLAlchemy's)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def outage_cause(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that says the storage was unreachable (not that the request
    was wrong), or None.  Optuna raises StorageInternalError ("... invalid data in the commit,
    e.g. exceeding max length") from any SQLAlchemy error: the cause decides."""
    import sqlalchemy.exc as sx

    for e in _chain(exc):
        if isinstance(e, (sx.OperationalError, sx.InterfaceError, sx.DisconnectionError, sx.PendingRollbackError,
                          ConnectionError, TimeoutError)):
            return e
        if isinstance(e, sx.DBAPIError) and e.connection_invalidated:
            return e
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
            return e
    return None


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage was unreachable, not that the request was wrong."""
    return outage_cause(exc) is not None


def unreachable(exc: BaseException) -> str | None:
    """"study storage unreachable (OperationalError: ...)" for an outage, naming its cause (its first
    line), not the wrapper Optuna raised; None when ``exc`` is no outage."""
    cause = outage_cause(exc)
    if cause is None:
        return None
    first = (str(cause).strip().splitlines() or [""])[0][:160]
    return f"study storage unreachable ({type(cause).__name__}{': ' + first if first else ''})"


class Outage:
    """When this process last failed to reach the storage (monotonic seconds)."""

    def __init__(self, patience_s: float, quiet_s: float) -> None:
        self.patience_s = patience_s
        self.quiet_s = quiet_s  # no stale verdicts this long after a fault
        self.last_fault = -float("inf")

    def fault(self) -> None:
        self.last_fault = time.monotonic()

    def recent(self) -> bool:
        """Whether a fault was seen within ``quiet_s``: other workers' beats may have failed too."""
        return time.monotonic() - self.last_fault < self.quiet_s


def _told_already(storage: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """After a lost reply: whether ``set_trial_state_values`` had in fact committed this state."""
    trial_id, state = args[0], kwargs.get("state", args[1] if len(args) > 1 else None)
    values = kwargs.get("values", args[2] if len(args) > 2 else None)
    t = storage.get_trial(trial_id)
    return bool(t.state == state and (values is None or list(t.values or []) == list(values)))


def _retrying(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        outage: Outage = self.outage
        delay, waited, attempt = FIRST_DELAY_S, 0.0, 0
        while True:
            try:
                result = method(self, *args, **kwargs)
            except optuna.exceptions.UpdateFinishedTrialError:
                if attempt and name == "set_trial_state_values" and _told_already(self, args, kwargs):
                    return True  # our first attempt committed; its reply was lost
                raise
            except Exception as exc:
                if isinstance(exc, BenchmarkError) or not transient(exc):  # a nested call's patience ran out
                    raise
                outage.fault()
                if waited >= outage.patience_s:
                    raise BenchmarkError(f"the study storage stayed unreachable for {waited:.0f} s ({name}: "
                                         f"{type(exc).__name__}); run the same command again when it is back") from exc
                log.warning("%s in %s; retrying in %.1f s", unreachable(exc), name, delay)
                time.sleep(delay)
                waited, delay, attempt = waited + delay, min(2 * delay, MAX_DELAY_S), attempt + 1
                continue
            if attempt:
                outage.fault()  # back now; the quiet period counts from here
                log.warning("study storage reachable again after %.1f s", waited)
            return result

    return call


def patient(cls: S) -> S:
    """Make every storage call of ``cls`` (but heartbeats) wait out transient faults, those a
    Study's cache makes on it directly included; the instance needs an ``outage`` attribute
    (:class:`Outage`)."""
    for name in (*(n for n in dir(BaseStorage) if not n.startswith("_")), *BACKEND_CALLS):
        if name in NOT_RETRIED or not callable(getattr(cls, name, None)):
            continue
        setattr(cls, name, _retrying(name, getattr(cls, name)))
    return cls
