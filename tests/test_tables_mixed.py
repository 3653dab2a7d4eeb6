"""The tables of several block kinds (solvers/tables_mixed.py) against enumerating every
recompute assignment and every split."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autoplace.cost.step import pipeline_weights
from autoplace.plan import FIRST_FULL
from solvers.exhaustive import _options, compositions
from solvers.problem import Problem
from solvers.space import Scored, enumerate_configs, plan_from, score_space
from solvers.tables import stage_tables
from solvers.tables_mixed import (
    MixedTables,
    kind_prefix,
    mixed_arcs,
    mixed_modes,
    mixed_split_bounds,
    mixed_split_value,
    mixed_tables,
    stage_arcs,
)
from tests.helpers import gpu_cluster
from tests.test_solvers import ALL_FEATURES, _model, _moe_model
from tests.test_tables import dropped_by_a_cap

MODES = ("none", "selective", "full")


def _brute(scored: Scored, i: int, s: int, counts: np.ndarray, objective: str, fixed_mode: int | None,
           first: np.ndarray | None = None) -> float:
    """Stage ``s``'s best objective term holding ``counts`` blocks of each kind: every
    recompute assignment (the oracle's :func:`solvers.exhaustive._options`; FIRST_FULL:
    ``first[b]``, the blocks of each kind among the stage's first b, fully recomputed)."""
    t = scored.terms
    opts = _options(tuple(int(x) for x in counts), fixed_mode, first)  # [O, K, 3]
    N = opts.sum(-1)
    static, per_block, mult = (x[i, s] for x in t.phases)
    mem = (static[None, :] + N @ per_block.T + mult[None, :] * (opts * t.act_block[i, 0]).sum((1, 2))[:, None]).max(-1)
    tim = t.t_static[i, s].sum() + (opts * t.t_block[i, s].sum(-1)).sum((1, 2))
    com = t.bytes_static[i, s].sum() + (opts * t.bytes_block[i, 0].sum(-1)).sum((1, 2))
    fits = (mem <= t.capacity[i, s]) & (t.host_static[i, s] + N @ t.host_block[i, s] <= t.host_capacity[i, s])
    value = {"time": tim, "comm": com, "memory": mem}[objective]
    return float(value[fits].min()) if fits.any() else np.inf


def _scored(model, gpus: int, gpu: str, objective: str, fixed_mode: int | None, n: int, seed: int,
            squeeze: bool = False) -> Scored:
    """``n`` random configurations; with ``squeeze``, each stage's capacity set between the
    memory of its even share of blocks with full and with no recompute (so that the
    recompute counts matter)."""
    fixed = {} if fixed_mode is None else {"recompute": MODES[fixed_mode]}
    problem = Problem(model, gpu_cluster(gpus, gpu=gpu), objective=objective, top_k=1, features=ALL_FEATURES,
                      fixed=fixed)
    space = score_space(problem, enumerate_configs(problem))
    rng = np.random.default_rng(seed)
    scored = space.scored(rng.choice(len(space.configs), size=min(n, len(space.configs)), replace=False))
    if not squeeze:
        return scored
    t = scored.terms
    static, per_block, mult = t.phases
    share = np.bincount(scored.table.sequence) / np.array([cf.pp for cf in scored.configs])[:, None]  # [C, K]
    full, none = ((static + (share[:, None, None] * (per_block + mult[..., None] * t.act_block[:, :, None, :, r])
                             ).sum(-1)).max(-1) for r in (2, 0))
    capacity = full + rng.uniform(0, 1, full.shape) * (none - full)
    return dataclasses.replace(scored, terms=dataclasses.replace(t, capacity=capacity))


CASES = [  # (dense first layers, MoE every k-th layer, sliding window, flash attention): two kinds,
    # two interleaved (selective recompute saving the scores), four kinds
    (1, 1, None, True), (2, 2, None, False), (1, 2, 256, True)]


@pytest.mark.parametrize("objective", ["time", "comm", "memory"])
@pytest.mark.parametrize("fixed_mode", [None, 0, 2])
@pytest.mark.parametrize("case", CASES)
def test_every_entry_is_the_stage_best_recompute(objective: str, fixed_mode: int | None,
                                                 case: tuple[int, int, int | None, bool]) -> None:
    """Each (stage, first block, size) holds the best objective term over every recompute
    assignment of its blocks of each kind that fits, and inf exactly off the arcs or where
    nothing fits; on a memory-tight cluster some entries do need recompute."""
    dense, every, window, flash = case
    model = _moe_model(6, 1024, 16, 2048, dense=dense, every=every, window=window, flash=flash)
    scored = _scored(model, 8, "v100-sxm2-32gb", objective, fixed_mode, 10, seed=len(objective), squeeze=True)
    L, recomputed = scored.table.blocks, 0
    assert len(scored.table.kinds) == (4 if window else 2)
    prefix = kind_prefix(scored.table)
    for j, cf in enumerate(scored.configs):
        tb = mixed_tables(scored, j, objective, fixed_mode)
        arcs = stage_arcs(cf.pp, cf.vpp, L, L + 1)
        for s, a, n in zip(*np.nonzero(np.ones_like(tb.value, dtype=bool)), strict=True):
            want = _brute(scored, j, s, prefix[min(a + n, L)] - prefix[a], objective, fixed_mode) if arcs[s, a, n] else np.inf
            assert tb.value[s, a, n] == pytest.approx(want, rel=1e-12), (cf, s, a, n)
        recomputed += int(((tb.full if flash else tb.sel).sum(-1) > 0)[np.isfinite(tb.value)].sum())
    if fixed_mode is None and objective == "time":
        assert recomputed > 0  # full recompute with flash attention, selective without


@pytest.mark.parametrize("objective", ["time", "comm", "memory"])
@pytest.mark.parametrize("case", [None, *CASES])
def test_first_blocks_recomputed_is_the_best_such_prefix(objective: str, case: tuple[int, int, int | None, bool] | None) -> None:
    """FIRST_FULL (Megatron-LM's block method on one stage): the entry is the best of full
    recompute on the first b blocks and none after (b = 0..L) that fits, by enumerating them,
    with one block kind and several; the counts chosen lay out as exactly that (plan_from puts
    full recompute first); and where it fits, no selective recompute is chosen."""
    model = _model(8, 1024, 16, 2048) if case is None else _moe_model(
        6, 1024, 16, 2048, dense=case[0], every=case[1], window=case[2], flash=case[3])
    scored = _scored(model, 8, "v100-sxm2-32gb", objective, None, 200, seed=3, squeeze=True)
    L, table = scored.table.blocks, scored.table
    prefix = kind_prefix(table)
    one_stage = [j for j, cf in enumerate(scored.configs) if cf.pp == 1]
    assert len(one_stage) >= 3
    some_recompute = 0
    for j in one_stage:
        tb = mixed_tables(scored, j, objective, FIRST_FULL)
        want = _brute(scored, j, 0, prefix[L], objective, FIRST_FULL, first=prefix)
        assert tb.value[0, 0, L] == pytest.approx(want, rel=1e-12)
        if case is None:  # the single-kind tables agree
            assert stage_tables(scored, j, objective, FIRST_FULL).value[0, L] == pytest.approx(want, rel=1e-12)
        if np.isfinite(want):
            plan = plan_from(scored.configs[j], table, [L], mixed_modes(tb, [L]))
            k = plan.recompute.count("full")
            assert plan.recompute == ("full",) * k + ("none",) * (L - k)
            some_recompute += 0 < k < L
    if objective == "time":
        assert some_recompute  # the squeeze makes some fit only with part of the blocks recomputed


@pytest.mark.parametrize("objective", ["time", "memory"])
def test_one_kind_tables_are_the_single_kind_tables(objective: str) -> None:
    """With one block kind a stage's entry depends only on its size: the single-kind table's."""
    scored = _scored(_model(8, 1024, 16, 2048), 8, "v100-sxm2-32gb", objective, None, 12, seed=1)
    for j in range(len(scored.configs)):
        one, mixed = stage_tables(scored, j, objective, None), mixed_tables(scored, j, objective, None)
        P, N, W = mixed.value.shape
        for s, a, n in zip(*np.nonzero(np.isfinite(mixed.value)), strict=True):
            assert mixed.value[s, a, n] == pytest.approx(one.value[s, n], rel=1e-12)
            assert mixed.tail[s, a, n] == pytest.approx(one.tail[s, n], rel=1e-12)


def _random_tables(rng: np.random.Generator, P: int, v: int, L: int) -> MixedTables:
    arcs = stage_arcs(P, v, L, L + 1)
    time = rng.uniform(1.0, 2.0, arcs.shape) * np.arange(L + 1)
    time[~arcs | (rng.random(arcs.shape) < 0.3)] = np.inf  # stages that do not fit
    tail = np.where(np.isfinite(time), rng.uniform(0.0, 1.0, arcs.shape), np.inf)
    zeros = np.zeros((*arcs.shape, 2), dtype=int)
    return MixedTables(time, time, tail, zeros, zeros, np.zeros((L + 1, 2), dtype=int))


@pytest.mark.parametrize("seed", range(40))
def test_split_dps_are_the_best_of_every_split(seed: int) -> None:
    """Σ*, τ* and θ* of the DPs over boundaries are the smallest sum, slowest stage and
    largest tail over every split that fits, the bottleneck split reaches τ*, and the arcs
    are exactly those of the splits that fit."""
    rng = np.random.default_rng(seed)
    P, v = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    L = v * int(rng.integers(P, P + 6))
    tb, m = _random_tables(rng, P, v, L), int(rng.integers(1, 9))
    starts = [np.concatenate([[0], np.cumsum(sp)[:-1]]) for sp in compositions(L, P, v)]
    splits = [(sp, st) for sp, st in zip(compositions(L, P, v), starts, strict=True)
              if all(np.isfinite(tb.time[s, a, n]) for s, (a, n) in enumerate(zip(st, sp, strict=True)))]
    lb, bottleneck = mixed_split_bounds(tb, v, m, "time")
    arcs = mixed_arcs(tb, "time")
    if not splits:
        assert lb == np.inf and bottleneck is None and arcs is None
        return

    def stages(table: np.ndarray, sp: tuple[int, ...], st: np.ndarray) -> list[float]:
        return [table[s, a, n] for s, (a, n) in enumerate(zip(st, sp, strict=True))]

    w_max, w_sum = pipeline_weights(m, v)
    top = min(max(stages(tb.time, sp, st)) for sp, st in splits)
    total = min(sum(stages(tb.time, sp, st)) for sp, st in splits)
    tail = min(max(stages(tb.tail, sp, st)) for sp, st in splits)
    assert lb == pytest.approx(w_max * top + w_sum * total + tail, rel=1e-12)
    assert bottleneck is not None
    assert max(stages(tb.time, tuple(bottleneck), np.concatenate([[0], np.cumsum(bottleneck)[:-1]]))) == top
    assert all(lb <= mixed_split_value(tb, sp, v, m, "time") * (1 + 1e-12) for sp, _ in splits)
    used = [sorted({(int(st[s]), sp[s]) for sp, st in splits}) for s in range(P)]
    assert arcs is not None and [sorted(x) for x in arcs] == used


def test_a_cap_leaves_every_split_within_it_as_it_was() -> None:
    """Tables built knowing a plan's objective (the cap) drop stage sizes, but every split
    within the cap keeps its value, and the dropped splits were all above it."""
    scored = _scored(_moe_model(6, 512, 32, 1024, dense=1), 8, "a100-sxm4-80gb", "time", None, 200, seed=2)
    dropped = sum(dropped_by_a_cap(scored, j, mixed_tables, mixed_split_value)
                  for j, cf in enumerate(scored.configs) if cf.pp >= 3)
    assert dropped > 0  # the cap did leave sizes out
