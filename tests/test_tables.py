"""The exact per-stage tables and split DPs (solvers/tables.py) against enumerating every split."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.cost.step import pipeline_weights
from solvers.exhaustive import compositions
from solvers.problem import Problem
from solvers.space import enumerate_configs, score_space
from solvers.tables import PRUNE_SLACK, StageTables, split_bounds, split_value, stage_tables
from tests.helpers import gpu_cluster
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
    scored, L, dropped = space.scored(rows), space.table.blocks, 0
    for j, cf in enumerate(scored.configs):
        full = stage_tables(scored, j, "time", None)
        splits = compositions(L, cf.pp, cf.vpp)
        values = np.array([split_value(full, sp, cf.vpp, cf.grad_accum, "time") for sp in splits])
        cap = float(np.min(values)) * 1.05  # a plan 5% above this configuration's best
        capped = stage_tables(scored, j, "time", None, cap)
        for sp, value in zip(splits, values, strict=True):
            now = split_value(capped, sp, cf.vpp, cf.grad_accum, "time")
            if value <= cap * (1 + PRUNE_SLACK):
                assert now == value
            else:
                assert now == value or now == np.inf
                dropped += now == np.inf and np.isfinite(value)
    assert dropped > 0  # the cap did leave sizes out
