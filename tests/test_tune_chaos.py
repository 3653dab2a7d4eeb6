"""``autoplace tune`` under chaos (benchmarks/chaos.py, a small seeded slice): three workers (the real
CLI) share one study on PostgreSQL or a journal file; four of them SIGKILL themselves, one at each
point of a trial's life -- right after ``ask`` popped it (RUNNING, no heartbeat yet: the trial
Optuna's RDB storage would leave RUNNING for ever), inside ``claim``, halfway through the trial
(its subprocess must die with the worker), just before ``tell`` -- and each is restarted at once;
PostgreSQL is crashed (``-m immediate``) and started again after the second kill.  Then one clean
worker finishes.  Every candidate must be COMPLETE exactly once, nothing left RUNNING or WAITING,
no trial process left behind, every exit code one the README documents (-9 for the killed, 0 or
4 for the others, 0 for the clean worker).  Loopback only; a run takes about a minute here."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from benchmarks.chaos import PHASES, run_chaos, throwaway_postgres


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgresql", "journal"])
def test_every_candidate_is_measured_once_under_kills_and_a_server_restart(tmp_path: Path, kind: str) -> None:
    with throwaway_postgres() as pg:
        if kind == "postgresql":
            if pg is None:
                pytest.skip("needs PostgreSQL's server binaries (Debian: apt-get install postgresql)")
            storage = pg.database(f"chaos_{os.getpid()}_{int(time.time() * 1000)}")
        else:
            storage = str(tmp_path / "study.journal")
        r = run_chaos(tmp_path, storage, seed=7, kills=4, n_candidates=3, trial_s=0.3, grace=3, retries=3,
                      server=pg if kind == "postgresql" else None, deadline_s=400, nth_max=1)
    assert r.final_exit == 0, r.final_err
    # kills land at the points of a trial's life the workers reach in time (a loaded machine may end the
    # study before the last one): at least three of ask, claim, trial, tell, and no other
    assert set(r.kills) <= set(PHASES) and len(set(r.kills)) >= 3, r
    assert r.server_restarts == (1 if kind == "postgresql" else 0)
    assert all(n == 1 for n in r.complete.values()), r.complete  # each candidate COMPLETE exactly once
    assert r.states.get("RUNNING", 0) == r.states.get("WAITING", 0) == 0, r.states
    assert r.states.get("FAIL", 0) >= len(r.kills), r.states  # every killed worker's trial was failed as stale
    assert not r.orphans, f"trial processes outlived their workers: {r.orphans}"
    assert set(r.exits) <= {0, 4, -signal.SIGKILL}, (r.exits, r.failures)
