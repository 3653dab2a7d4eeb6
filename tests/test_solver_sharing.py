"""Work CP-SAT shares between the solves a framework runs in turn (one per uniform recompute mode)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import solvers.space
from solvers.problem import Budget, Problem
from solvers.registry import get_solver
from solvers.space import enumerate_configs, score_space, score_spaces
from tests.helpers import gpu_cluster
from tests.test_solvers import _model

MODES = ("none", "selective", "full")


def _runs() -> list[Problem]:
    problem = Problem(_model(8, 512, 16), gpu_cluster(8, gpu="a100-sxm4-40gb"), top_k=2)
    return [dataclasses.replace(problem, fixed={"recompute": mode}) for mode in MODES]


def test_spaces_scored_together_are_the_spaces_scored_alone() -> None:
    runs = _runs()
    configs = enumerate_configs(runs[0])
    for together, run in zip(score_spaces(runs, configs), runs, strict=True):
        alone = score_space(run, configs)
        assert together.problem is run
        assert np.array_equal(together.lower_bound, alone.lower_bound)
        assert np.array_equal(together.memory_lb, alone.memory_lb)


def test_prepared_solves_score_once_and_find_the_same_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    alone = [get_solver("cpsat").solve(run, Budget(time_limit_s=60)) for run in _runs()]
    calls = []
    real = solvers.space.stage_terms
    monkeypatch.setattr(solvers.space, "stage_terms", lambda *a: calls.append(len(a[2].pp)) or real(*a))
    solver, runs = get_solver("cpsat"), _runs()
    solver.prepare(runs)
    shared = [solver.solve(run, Budget(time_limit_s=60)) for run in runs]
    scored = sum(calls)  # configurations whose coefficient tables were built, searches included
    calls.clear()
    for run in _runs():
        get_solver("cpsat").solve(run, Budget(time_limit_s=60))
    assert scored < sum(calls)
    for a, b in zip(alone, shared, strict=True):
        assert a.status == b.status == "optimal"
        assert [ev.plan for ev in a.plans] == [ev.plan for ev in b.plans]
