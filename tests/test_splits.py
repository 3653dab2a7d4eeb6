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
from solvers.splits import best_arc_split, best_split
from solvers.tables import StageTables, split_bounds, split_value, stage_tables
from solvers.tables_mixed import mixed_tables
from tests.helpers import gpu_cluster
from tests.test_solvers import _model, _moe_model


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


def _arc_cost(time: np.ndarray, tail: np.ndarray, split: tuple[int, ...], w_max: float, w_sum: float) -> float:
    n = np.asarray(split)
    at = (np.arange(len(n)), np.cumsum(n) - n, n)
    if (n >= time.shape[2]).any() or not np.isfinite(time[at]).all():
        return np.inf
    return float(w_max * time[at].max() + w_sum * time[at].sum() + tail[at].max())


@settings(max_examples=150, deadline=None)
@given(_tables(), st.integers(1, 4), st.sampled_from([10**9, 0, 1, 2]))
def test_best_arc_split_is_the_best_of_every_split(case: tuple[np.ndarray, np.ndarray, int, float, float],
                                                   spread: int, max_dps: int) -> None:
    """Several block kinds: a stage's seconds depend on where it starts too (tables by stage,
    first block and size, narrower than L + 1 sizes, inf off the interleave).  Unbounded, the
    optimum over every split and a split reaching it; with a work budget, a sound bound and a
    real split at its own cost."""
    time1, tail1, v, w_max, w_sum = case
    P, L = time1.shape[0], time1.shape[1] - 1
    rng = np.random.default_rng(int(time1.shape[1] * 1000 + spread))
    W = min(L + 1, v * (L // (v * P) + spread) + 1)
    start_cost = np.round(rng.uniform(0.0, 1.0, (P, L + 1, 1)), 1)  # seconds that depend on the first block
    time = np.where(np.arange(W) % v == 0, time1[:, None, :W] + start_cost * np.arange(W), np.inf)
    tail = np.broadcast_to(tail1[:, None, :W], time.shape) + start_cost
    costs = {sp: _arc_cost(time, tail, sp, w_max, w_sum) for sp in compositions(L, P, v)}
    found = best_arc_split(time, tail, w_max, w_sum, max_dps=max_dps)
    best = min(costs.values(), default=np.inf)
    if not np.isfinite(best):
        assert found.cost == found.bound == np.inf and found.split is None
        return
    assert found.split is not None and costs[tuple(found.split)] == pytest.approx(found.cost, rel=1e-12)
    assert found.bound <= best * (1 + 1e-12) + 1e-12 and found.bound <= found.cost
    if max_dps == 10**9:
        assert found.exact and found.cost == pytest.approx(best, rel=1e-12)


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


@pytest.mark.parametrize("mixed", [False, True])
def test_the_units_bound_is_each_configurations_model_optimum(monkeypatch: pytest.MonkeyPatch, mixed: bool) -> None:
    """Every configuration's CP-SAT optimum in a model built without the exact bound equals the
    bound build_model adds (best_split_units on the model's own rounding and weights): sound,
    and reached by its complete hint, so with it CP-SAT proves the optimum at once.  With
    several block kinds (a dense first layer, then MoE ones) the model chooses arcs and the
    bound comes from the DPs over stage boundaries."""
    model = _moe_model(12, 512, 32, 512, dense=2) if mixed else _model(12, 512, 32)
    problem = Problem(model, gpu_cluster(8), top_k=1)
    space = score_space(problem, enumerate_configs(problem))
    assert (len(space.table.kinds) > 1) == mixed
    rows = [int(i) for i in np.argsort(space.lower_bound) if space.memory_lb[i] <= 0 and space.configs[i].pp > 2]
    assert {space.configs[i].vpp for i in rows} - {1}, "the case needs interleaved pipelines (D > 1)"
    cp_model, checked = _ortools.cp_model(), 0
    for i in rows[:4] + [i for i in rows if space.configs[i].vpp > 1][:4]:
        one = space.scored([i])
        tables = {0: mixed_tables(one, 0, "time", None) if mixed else stage_tables(one, 0, "time", None)}
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
