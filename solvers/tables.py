"""Exact per-stage tables: for every configuration, stage and stage size, the best recompute
counts and the resulting stage time, DP tail, communication and memory.

Why this is exact.  With one block kind, a stage holding ``n`` blocks, ``a`` of them with
selective and ``b`` with full recompute, has memory and micro-batch time *linear* in
``(n, a, b)`` (see :mod:`autoplace.cost.terms`).  The step time is non-decreasing in every
stage's micro-batch time, and recompute changes nothing else (the DP tail depends on ``n``
only), so for each ``n`` the best ``(a, b)`` is the one minimizing the stage's own objective
term among those that fit: for each ``b`` the smallest ``a`` that fits is optimal whenever
selective recompute costs time.  The same holds for the communication objective (per-stage
bytes) and the memory objective (per-stage bytes in memory).  The tables are therefore the
per-layer decisions, solved in closed form for every stage size; CP-SAT then chooses the
configuration and the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.cost.step import pipeline_time, pipeline_weights
from solvers.space import Scored

INF = np.inf


@dataclass(frozen=True)
class StageTables:
    """Arrays ``[S, L+1]`` for one configuration (``inf`` where a stage size cannot fit).

    Attributes:
        value: the stage's objective term (time: micro-batch seconds; comm/memory: bytes).
        time: micro-batch seconds of the chosen recompute counts.
        tail: exposed DP seconds + optimizer seconds once per step.
        sel, full: the chosen numbers of selective and fully recomputed blocks.
    """

    value: np.ndarray
    time: np.ndarray
    tail: np.ndarray
    sel: np.ndarray
    full: np.ndarray


def stage_tables(scored: Scored, i: int, objective: str, fixed_mode: int | None) -> StageTables:
    """Tables for configuration ``i`` of a single-kind model (see the module docstring)."""
    t, L = scored.terms, scored.table.blocks
    P = scored.configs[i].pp
    n = np.arange(L + 1, dtype=float)[None, :, None]  # [1, N, 1]
    b = np.arange(L + 1, dtype=float)[None, None, :]  # [1, 1, B]
    act = t.act_block[i, 0, 0]  # [3]
    tb = t.t_block[i, :P, 0].sum(-1)[:, None, None, :]  # [P,1,1,3]
    cb = t.bytes_block[i, 0, 0].sum(-1)  # [3]
    # memory per phase f (last axis): static + n * state + mult * activations kept
    keep = t.binding_phases(i, P)
    static, per_block, mult = (x[i, :P][:, keep][:, None, None] for x in t.phases)  # [P,1,1,F(,K)]
    state, room = per_block[..., 0], t.capacity[i, :P, None, None, None] - static
    n4, b4 = n[..., None], b[..., None]
    base = n4 * (state + mult * act[0]) - b4 * mult * (act[0] - act[2])  # [P,N,B,F] with a = 0
    save_sel = mult * (act[0] - act[1])
    if fixed_mode is None:
        # the fewest selective blocks that make every phase fit, for every (n, b)
        need = np.where(save_sel > 0, np.ceil((base - room) / np.where(save_sel > 0, save_sel, 1) - 1e-9), 0.0)
        a = np.clip(need.max(-1), 0, None)
        ok = (b <= n) & (a <= n - b) & (base - a[..., None] * save_sel <= room).all(-1)
    else:
        a = np.where(fixed_mode == 1, n, 0.0) + 0 * b
        b_fixed = np.where(fixed_mode == 2, n, 0.0)
        ok = (b == b_fixed) & (base - a[..., None] * save_sel <= room).all(-1)
    host = t.host_static[i, :P, None, None] + n * t.host_block[i, :P, 0, None, None]
    ok = ok & (host <= t.host_capacity[i, :P, None, None])
    a = np.broadcast_to(a, ok.shape)
    time = t.t_static[i, :P].sum(-1)[:, None, None] + (n - a - b) * tb[..., 0] + a * tb[..., 1] + b * tb[..., 2]
    comm = t.bytes_static[i, :P].sum(-1)[:, None, None] + (n - a - b) * cb[0] + a * cb[1] + b * cb[2]
    mem = (static + base - a[..., None] * save_sel).max(-1)
    key = {"time": time, "comm": comm + 1e-9 * time, "memory": mem + 1e-9 * time}[objective]
    key = np.where(ok, key, INF)
    j = key.argmin(axis=2)  # best b per (stage, n)
    pick = (np.arange(P)[:, None], np.arange(L + 1)[None, :], j)
    feasible = np.isfinite(key[pick])
    value = np.where(feasible, {"time": time, "comm": comm, "memory": mem}[objective][pick], INF)
    return StageTables(value=value, time=np.where(feasible, time[pick], INF), tail=_tail(scored, i, L),
                       sel=np.where(feasible, a[pick], 0).astype(int), full=np.where(feasible, j, 0).astype(int))


def _tail(scored: Scored, i: int, L: int) -> np.ndarray:
    """Once-per-step seconds of each stage as a function of its size ``n`` ``[S, L+1]``."""
    P = scored.configs[i].pp
    n = np.arange(L + 1, dtype=float)[None, :, None]
    return scored.terms.tail_at(i, np.arange(P)[:, None], n)


def split_bounds(tables: StageTables, v: int, m: int, objective: str) -> tuple[float, list[int] | None]:
    """A lower bound of the configuration's objective over all splits, and a good split.

    Dynamic programs over stages: the smallest possible sum of stage values ``Σ*``, the
    smallest possible slowest stage ``τ*`` (the bottleneck split) and the smallest possible
    largest DP tail ``θ*``.  Every split has ``Σ >= Σ*``, ``max >= τ*`` and ``tail >= θ*``,
    so the step ``(m - 1/v) max + Σ/v + tail`` is at least ``(m - 1/v) τ* + Σ*/v + θ*``; for
    ``comm`` and ``memory`` the objective is the max itself.
    The bottleneck split is returned as a candidate (an upper bound once evaluated).
    """
    P, N = tables.value.shape
    L = N - 1
    allowed = (np.arange(N) % v == 0) & (np.arange(N) > 0)
    vals = np.where(allowed[None, :], tables.time if objective == "time" else tables.value, INF)
    total = vals[0].copy()
    top = vals[0].copy()
    choice = []
    for s in range(1, P):
        shifted = _shift(vals[s], N)
        total = np.min(total[:, None] + shifted, axis=0)
        cand = np.maximum(top[:, None], shifted)
        j = np.argmin(cand, axis=0)
        choice.append(j)
        top = cand[j, np.arange(N)]
    if not np.isfinite(top[L]):
        return INF, None
    split, k = [], L
    for s in range(P - 1, 0, -1):
        j = int(choice[s - 1][k])
        split.append(k - j)
        k = j
    split.append(k)
    split.reverse()
    if objective == "time":
        w_max, w_sum = pipeline_weights(m, v)
        return float(w_max * top[L] + w_sum * total[L] + _min_max(tables.tail, allowed)), split
    return float(top[L]), split


def _min_max(table: np.ndarray, allowed: np.ndarray) -> float:
    """The smallest possible largest entry over all splits (a min-max DP over stages)."""
    P, N = table.shape
    vals = np.where(allowed[None, :], table, INF)
    top = vals[0].copy()
    for s in range(1, P):
        top = np.min(np.maximum(top[:, None], _shift(vals[s], N)), axis=0)
    return float(top[N - 1])


def _shift(row: np.ndarray, N: int) -> np.ndarray:
    """M[j, k] = row[k - j] (inf where k < j): the cost of a stage of size k - j."""
    idx = np.arange(N)[None, :] - np.arange(N)[:, None]
    return np.where(idx >= 0, row[np.clip(idx, 0, N - 1)], INF)


def split_value(tables: StageTables, split: list[int] | tuple[int, ...], v: int, m: int, objective: str) -> float:
    """The objective of one split using the tables (inf when a stage cannot fit)."""
    s = np.arange(len(split))
    n = np.asarray(split)
    vals = tables.value[s, n]
    if not np.isfinite(vals).all():
        return INF
    if objective != "time":
        return float(vals.max())
    return float(pipeline_time(tables.time[s, n], m, v) + tables.tail[s, n].max())


def table_modes(tables: StageTables, split: list[int]) -> list[list[list[int]]]:
    """The recompute counts ``[stage][kind=0][none, selective, full]`` the tables chose for ``split``."""
    return [[[n - int(tables.sel[s, n]) - int(tables.full[s, n]), int(tables.sel[s, n]), int(tables.full[s, n])]]
            for s, n in enumerate(split)]
