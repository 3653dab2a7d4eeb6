"""The exact best split (solvers/splits.py) against enumerating every split, and the bound it
gives CP-SAT against the model's own optimum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import _ortools, cpsat
from solvers.cpsat import CpSatSolver, build_model
from solvers.exhaustive import compositions
from solvers.problem import Problem
from solvers.space import enumerate_configs, score_space
from solvers.splits import best_split
from solvers.tables import StageTables, split_bounds, split_value, stage_tables
from tests.helpers import gpu_cluster
from tests.test_solvers import _model


def _cost(time: np.ndarray, tail: np.ndarray, split: tuple[int, ...], w_max: float, w_sum: float) -> float:
    s, n = np.arange(len(split)), np.asarray(split)
    if not np.isfinite(time[s, n]).all():
        return np.inf
    return float(w_max * time[s, n].max() + w_sum * time[s, n].sum() + tail[s, n].max())


@st.composite
def _tables(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, float, float]:
    """Small random tables: ties (few distinct values), sizes that cannot fit, interleave v > 1."""
    P, v = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    L = v * draw(st.integers(P, P + 4))
    seed, digits = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2))
    rng = np.random.default_rng(seed)
    time = np.round(rng.uniform(1.0, 2.0, (P, L + 1)) * np.arange(L + 1), digits)
    time[rng.random((P, L + 1)) < draw(st.floats(0.0, 0.6))] = np.inf
    tail = np.round(rng.uniform(0.0, 3.0, (P, L + 1)), digits)
    tail[rng.random((P, L + 1)) < 0.1] = np.inf
    w_max, w_sum = draw(st.sampled_from([0.0, 0.5, 1.0, 7.0, 23.5])), draw(st.sampled_from([0.0, 1 / v, 1.0]))
    return time, tail, v, w_max, w_sum


@settings(max_examples=400, deadline=None)
@given(_tables())
def test_best_split_is_the_best_of_every_split(case: tuple[np.ndarray, np.ndarray, int, float, float]) -> None:
    """The optimum over every split (tables with inf cells, v > 1, zero weights, ties), and
    the split returned reaches it (with no work budget: see the next test for one)."""
    time, tail, v, w_max, w_sum = case
    P, L = time.shape[0], time.shape[1] - 1
    costs = {sp: _cost(time, tail, sp, w_max, w_sum) for sp in compositions(L, P, v)}
    found = best_split(time, tail, v, w_max, w_sum, max_dps=10**9)
    if not np.isfinite(min(costs.values(), default=np.inf)):
        assert found.cost == found.bound == np.inf and found.split is None
        return
    assert found.exact and found.split is not None and tuple(found.split) in costs
    assert found.cost == pytest.approx(min(costs.values()), rel=1e-12)
    assert costs[tuple(found.split)] == pytest.approx(found.cost, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(_tables(), st.integers(0, 3))
def test_a_budget_cut_short_leaves_a_sound_bound_and_a_real_split(
        case: tuple[np.ndarray, np.ndarray, int, float, float], max_dps: int) -> None:
    """With few threshold DPs allowed the bound stays below every split's cost and the split
    returned is one of them, at its own cost."""
    time, tail, v, w_max, w_sum = case
    P, L = time.shape[0], time.shape[1] - 1
    costs = {sp: _cost(time, tail, sp, w_max, w_sum) for sp in compositions(L, P, v)}
    found = best_split(time, tail, v, w_max, w_sum, max_dps=max_dps)
    if found.split is None:
        assert not np.isfinite(min(costs.values(), default=np.inf))
        return
    assert found.bound <= min(costs.values()) * (1 + 1e-12) + 1e-12
    assert costs[tuple(found.split)] == pytest.approx(found.cost, rel=1e-12)
    assert found.bound <= found.cost


@pytest.mark.parametrize("seed", range(20))
def test_best_split_is_within_the_separate_bounds(seed: int) -> None:
    """The optimum is at least split_bounds' three-DP bound, and at most its bottleneck split."""
    rng = np.random.default_rng(seed)
    P, v = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    L, m = v * int(rng.integers(P, P + 8)), int(rng.integers(1, 9))
    time = rng.uniform(1.0, 2.0, (P, L + 1)) * np.arange(L + 1)
    time[rng.random((P, L + 1)) < 0.3] = np.inf
    tail = rng.uniform(0.0, 1.0, (P, L + 1))
    zeros = np.zeros((P, L + 1), dtype=int)
    tb = StageTables(value=time, time=time, tail=tail, sel=zeros, full=zeros)
    lb, bottleneck = split_bounds(tb, v, m, "time")
    found = best_split(time, tail, v, m - 1 / v, 1 / v)
    if bottleneck is None:
        assert found.split is None
        return
    assert lb * (1 - 1e-12) <= found.cost <= split_value(tb, bottleneck, v, m, "time") * (1 + 1e-12)
    assert split_value(tb, found.split, v, m, "time") == pytest.approx(found.cost, rel=1e-12)


def test_the_units_bound_is_each_configurations_model_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configuration's CP-SAT optimum in a model built without the exact bound equals the
    bound build_model adds (best_split_units on the model's own rounding and weights): sound,
    and reached by its complete hint, so with it CP-SAT proves the optimum at once."""
    problem = Problem(_model(12, 512, 32), gpu_cluster(8), top_k=1)
    space = score_space(problem, enumerate_configs(problem))
    rows = [int(i) for i in np.argsort(space.lower_bound) if space.memory_lb[i] <= 0 and space.configs[i].pp > 2]
    assert {space.configs[i].vpp for i in rows} - {1}, "the case needs interleaved pipelines (D > 1)"
    cp_model, checked = _ortools.cp_model(), 0
    for i in rows[:4] + [i for i in rows if space.configs[i].vpp > 1][:4]:
        one = space.scored([i])
        tables = {0: stage_tables(one, 0, "time", None)}
        with_bound = build_model(problem, one, tables)
        split, values = with_bound.groups[0]["best"]
        CpSatSolver._hint(with_bound, one, 0, split, values)
        solver = cp_model.CpSolver()
        solver.parameters.fix_variables_to_their_hinted_value = True  # the hint alone is a solution
        assert solver.solve(with_bound.model) == cp_model.OPTIMAL
        best = solver.value(with_bound.objective[0])
        monkeypatch.setattr(cpsat, "best_split_units", lambda *a: None)  # the model without the bound
        built = build_model(problem, one, tables)
        monkeypatch.undo()
        solver = cp_model.CpSolver()
        assert solver.solve(built.model) == cp_model.OPTIMAL
        assert solver.value(built.objective[0]) == best == values[with_bound.objective[0]]
        checked += 1
    assert checked == 8
