"""The exact per-stage tables and split DPs (solvers/tables.py) against enumerating every split,
and the batched functions bounding uses against one configuration at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from autoplace.cost.step import BUBBLE_SHARE, pipeline_weights
from autoplace.plan import RECOMPUTE, even_split
from autoplace.specs.model import load_model
from solvers import visit
from solvers.exhaustive import compositions
from solvers.problem import Problem
from solvers.space import Scored, Space, enumerate_configs, score_space
from solvers.tables import (
    PRUNE_SLACK,
    StageTables,
    TableBound,
    split_bounds,
    split_bounds_many,
    split_value,
    stage_tables,
    stage_tables_many,
    table_groups,
)
from solvers.visit import VISIT_BATCH
from tests import tables_reference as ref
from tests.helpers import REPO, gpu_cluster
from tests.test_solvers import _model


def _random_tables(rng: np.random.Generator, P: int, L: int) -> StageTables:
    time = rng.uniform(1.0, 2.0, (P, L + 1)) * np.arange(L + 1)
    time[rng.random((P, L + 1)) < 0.3] = np.inf  # sizes that do not fit
    tail = rng.uniform(0.0, 1.0, (P, L + 1))
    zeros = np.zeros((P, L + 1), dtype=int)
    return StageTables(value=time, time=time, tail=tail, sel=zeros, full=zeros)


@pytest.mark.parametrize("seed", range(40))
def test_split_bounds_are_the_best_of_every_split(seed: int) -> None:
    """Σ*, τ* and θ* of the DPs are the smallest sum, slowest stage and largest tail over
    every split that fits, and the bottleneck split reaches τ*."""
    rng = np.random.default_rng(seed)
    P, v = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    L = v * int(rng.integers(P, P + 6))
    tb, m = _random_tables(rng, P, L), int(rng.integers(1, 9))
    splits = [sp for sp in compositions(L, P, v) if all(np.isfinite(tb.time[s, n]) for s, n in enumerate(sp))]
    lb, bottleneck = split_bounds(tb, v, m, "time")
    if not splits:
        assert lb == np.inf and bottleneck is None
        return
    w_max, w_sum = pipeline_weights(m, v)
    top = min(max(tb.time[s, n] for s, n in enumerate(sp)) for sp in splits)
    total = min(sum(tb.time[s, n] for s, n in enumerate(sp)) for sp in splits)
    tail = min(max(tb.tail[s, n] for s, n in enumerate(sp)) for sp in splits)
    assert lb == pytest.approx(w_max * top + w_sum * total + tail, rel=1e-12)
    assert tuple(bottleneck) in splits and max(tb.time[s, n] for s, n in enumerate(bottleneck)) == top
    assert all(lb <= split_value(tb, sp, v, m, "time") * (1 + 1e-12) for sp in splits)


def test_a_cap_leaves_every_split_within_it_as_it_was() -> None:
    """Tables built knowing a plan's objective (the cap) drop stage sizes, but every split
    within the cap keeps its value, and the dropped splits were all above it."""
    problem = Problem(_model(12, 512, 32), gpu_cluster(8), top_k=1)
    space = score_space(problem, enumerate_configs(problem))
    rows = [i for i in np.argsort(space.lower_bound) if space.memory_lb[i] <= 0 and space.configs[i].pp > 2][:12]
    scored = space.scored(rows)
    dropped = sum(dropped_by_a_cap(scored, j, stage_tables, split_value) for j in range(len(rows)))
    assert dropped > 0  # the cap did leave sizes out


def dropped_by_a_cap(scored: Scored, j: int, build: Callable[..., Any], value: Callable[..., float]) -> int:
    """How many splits of configuration ``j`` that fit tables built with a cap 5% above its
    best plan (``build(scored, j, "time", None, cap)``) drop, asserting that every split
    within the cap keeps the value ``value`` gives it without one and the others keep it or
    become inf (0 when no split fits)."""
    cf, L = scored.configs[j], scored.table.blocks
    full = build(scored, j, "time", None)
    splits = compositions(L, cf.pp, cf.vpp)
    values = np.array([value(full, sp, cf.vpp, cf.grad_accum, "time") for sp in splits])
    if not np.isfinite(values).any():
        return 0
    cap = float(np.min(values)) * 1.05  # a plan 5% above this configuration's best
    capped = build(scored, j, "time", None, cap)
    dropped = 0
    for sp, before in zip(splits, values, strict=True):
        now = value(capped, sp, cf.vpp, cf.grad_accum, "time")
        if before <= cap * (1 + PRUNE_SLACK):
            assert now == before
        else:
            assert now == before or now == np.inf
            dropped += now == np.inf and np.isfinite(before)
    return dropped


# -- the batched functions against one configuration at a time (tests/tables_reference.py) --

def _assert_same(got: StageTables, want: StageTables) -> None:
    """Equal element for element, in shape and dtype too."""
    for name in ("value", "time", "tail", "sel", "full"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), name


def _problem(objective: str = "time", mode: int | None = None, top_k: int = 1, **extra: object) -> Problem:
    fixed = {"recompute": RECOMPUTE[mode]} if mode is not None else {}
    return Problem(_model(12, 512, 32), gpu_cluster(8), objective=objective, fixed=fixed, top_k=top_k, **extra)


@pytest.mark.parametrize(("objective", "mode"), [("time", None), ("time", 0), ("time", 1), ("time", 2),
                                                 ("comm", None), ("memory", None), ("memory", 2)])
def test_stage_tables_many_equal_one_configuration_at_a_time(objective: str, mode: int | None) -> None:
    """Tables built for many configurations at once (mixed pipeline depths, each with its own
    cap) are the old per-configuration tables, and so are the tables of every cap in the
    range they are said to hold for."""
    problem = _problem(objective, mode)
    space = score_space(problem, enumerate_configs(problem))
    rng = np.random.default_rng(0)
    fits = np.flatnonzero(space.memory_lb <= 0)
    rows = rng.choice(fits, size=min(60, len(fits)), replace=False)
    scored = space.scored(rows)
    lbs = space.lower_bound[rows]
    caps = [np.inf, *np.quantile(lbs, [0.1, 0.5, 0.9]) * 1.05]  # from no cap to ones that drop most sizes
    held = 0
    for group in table_groups(scored, range(len(rows))):
        mine = rng.choice(caps, size=len(group))
        tables, lo, hi = stage_tables_many(scored, group, objective, mode, mine.tolist())
        for k, j in enumerate(group):
            _assert_same(tables[k], ref.stage_tables(scored, j, objective, mode, float(mine[k])))
            bound = TableBound(0.0, 0.0, None, tables[k], float(mine[k]), float(lo[k]), float(hi[k]))
            for cap in caps:
                if cap != mine[k] and bound.holds(cap):
                    _assert_same(tables[k], ref.stage_tables(scored, j, objective, mode, cap))
                    held += 1
    assert held > 0  # the ranges do let other caps use the tables


@pytest.mark.parametrize("seed", range(60))
def test_split_bounds_many_equal_one_configuration_at_a_time(seed: int) -> None:
    """The chunked, batched DPs give the old block-grid DPs' bounds and splits, ties included
    (integer stage values tie often; the earliest start must win as before)."""
    rng = np.random.default_rng(seed)
    L, P, C = 12, int(rng.integers(1, 6)), int(rng.integers(1, 6))
    tables = []
    for _ in range(C):
        time = rng.integers(1, 4, (P, L + 1)).astype(float) * (1 + np.arange(L + 1) // 3)
        time[rng.random((P, L + 1)) < 0.25] = np.inf
        tail = rng.integers(0, 3, (P, L + 1)).astype(float)
        zeros = np.zeros((P, L + 1), dtype=int)
        tables.append(StageTables(value=time, time=time, tail=tail, sel=zeros, full=zeros))
    v = rng.choice([1, 2, 3, 4, 5, 6], size=C)  # 5 does not divide L: no split
    m = rng.integers(1, 9, size=C)
    for objective in ("time", "memory"):
        stacked = StageTables(*(np.stack([getattr(tb, f) for tb in tables]) for f in ("value", "time", "tail", "sel",
                                                                                      "full")))
        lower, splits = split_bounds_many(stacked, v, m, objective)
        for c, tb in enumerate(tables):
            want = ref.split_bounds(tb, int(v[c]), int(m[c]), objective)
            assert (float(lower[c]), splits[c]) == want
            assert split_bounds(tb, int(v[c]), int(m[c]), objective) == want


def _one_at_a_time(problem: Problem, space: Space) -> tuple[list[tuple[float, StageTables, list[int] | None]], float]:
    """The walk of visit.bound_with_tables as it was: one configuration at a time, with the
    reference tables and DPs; the kept configurations' (bound, tables, hint) and the cap."""
    L = space.table.blocks
    order = [int(i) for i in np.argsort(space.lower_bound, kind="stable") if space.memory_lb[i] <= 0]
    uppers: list[float] = []
    kept: dict[int, tuple[float, StageTables, list[int] | None]] = {}

    def kth() -> float:
        return sorted(uppers)[problem.top_k - 1] if len(uppers) >= problem.top_k else np.inf

    for start in range(0, len(order), VISIT_BATCH):
        rows = [i for i in order[start:start + VISIT_BATCH] if space.lower_bound[i] <= kth() * (1 + 1e-9)]
        if not rows:
            break
        batch = space.scored(rows)
        for j, i in enumerate(rows):
            if space.lower_bound[i] > kth() * (1 + 1e-9):
                break
            cf = space.configs[i]
            tb = ref.stage_tables(batch, j, problem.objective, problem.fixed_mode, kth())
            share = BUBBLE_SHARE[cf.schedule]
            lb, neck = ref.split_bounds(tb, cf.vpp, cf.grad_accum, problem.objective, share)
            if not np.isfinite(lb):
                continue
            even = [x * cf.vpp for x in even_split(L // cf.vpp, cf.pp)]
            values = [(split_value(tb, sp, cf.vpp, cf.grad_accum, problem.objective, share), sp)
                      for sp in [even, *([neck] if neck else [])] if sum(sp) == L and len(sp) == cf.pp]
            ub, split = min(values, key=lambda x: x[0]) if values else (np.inf, None)
            if np.isfinite(ub):
                uppers.append(ub)
            kept[i] = (lb, tb, split if np.isfinite(ub) else None)
    cap = kth()
    return [x for x in kept.values() if x[0] <= cap * (1 + 1e-9)], cap


@functools.cache
def _llama_70b(objective: str, mode: int | None, top_k: int) -> tuple[Problem, Space]:
    """Llama-3-70B on 64 H100 (hundreds of configurations visited, the cap falling often)."""
    fixed = {"recompute": RECOMPUTE[mode]} if mode is not None else {}
    problem = Problem(load_model(REPO / "examples" / "models" / "llama-3-70b.json"),
                      gpu_cluster(64, gpu="h100-sxm5-80gb", intra="nvlink4", inter="ib-ndr"),
                      objective=objective, fixed=fixed, top_k=top_k)
    return problem, score_space(problem, enumerate_configs(problem))


@pytest.mark.parametrize("waves", [(1, 1), (4, 64), (64, 64)])
@pytest.mark.parametrize(("objective", "mode", "top_k"), [("time", None, 3), ("time", 1, 1), ("time", None, 8),
                                                          ("comm", None, 3)])
def test_waves_bound_as_one_configuration_at_a_time(monkeypatch: pytest.MonkeyPatch, waves: tuple[int, int],
                                                    objective: str, mode: int | None, top_k: int) -> None:
    """Bounding in waves (tables built with the cap at a wave's start, rebuilt where the walk
    meets a cap that changes them) keeps, bounds, hints and tabulates every configuration as
    visiting them one at a time did."""
    monkeypatch.setattr(visit, "WAVES", waves)
    problem, space = _llama_70b(objective, mode, top_k)
    want, cap = _one_at_a_time(problem, space)
    got = visit.bound_with_tables(problem, space, deadline=np.inf)
    assert got is not None and got.upper == cap and len(got.scored.configs) == len(want)
    for j, (lb, tb, split) in enumerate(want):
        assert got.lower[j] == lb and got.splits.get(j) == split
        _assert_same(got.tables[j], tb)  # type: ignore[index]


@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("size", [0, 5, VISIT_BATCH, VISIT_BATCH + 1, 2 * VISIT_BATCH, 3 * VISIT_BATCH + 7])
def test_configurations_are_visited_in_order_of_their_cheap_bound(size: int, ties: bool) -> None:
    """The chunks bounding visits are those of a stable sort of every configuration that may
    fit (with few distinct bounds, or all distinct), however many there are."""
    rng = np.random.default_rng(size)
    space = SimpleNamespace(lower_bound=rng.integers(0, 20, size).astype(float) if ties else rng.random(size),
                            memory_lb=np.where(rng.random(size) < 0.2, 1.0, -1.0))
    order = [int(i) for i in np.argsort(space.lower_bound, kind="stable") if space.memory_lb[i] <= 0]
    want = [order[k:k + VISIT_BATCH] for k in range(0, len(order), VISIT_BATCH)]
    assert list(visit.by_lower_bound(space, lambda lb: True)) == want  # type: ignore[arg-type]
    for cap in (4.5, 11.0, 30.0 if ties else 0.7):  # a visit stops at the first chunk that starts above its cap
        chunks = list(visit.by_lower_bound(space, lambda lb, cap=cap: lb <= cap))  # type: ignore[arg-type]
        assert chunks == [c for c in want if space.lower_bound[c[0]] <= cap]
