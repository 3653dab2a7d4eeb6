"""The per-configuration stage tables and split DPs as solvers/tables.py had them before
bounding built many configurations at once (commit 45bec57), kept verbatim as the reference
the batched functions must equal element for element (tests/test_tables.py)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from autoplace.cost.step import BUBBLE_SHARE, pipeline_weights
from solvers.space import Scored
from solvers.tables import PRUNE_SLACK, StageTables

INF = np.inf


def stage_tables(scored: Scored, i: int, objective: str, fixed_mode: int | None, cap: float = INF) -> StageTables:
    """Tables for configuration ``i`` of a single-kind model (see the module docstring).

    With a finite ``cap`` (the objective of a known plan), stage sizes that no split within
    ``cap`` can use (:func:`size_limits`) are left out (``inf``), as sizes that cannot fit are:
    the [stage, size, full-recompute] grid shrinks from ``L + 1`` sizes to the few that can
    be part of a good plan.
    """
    t, L = scored.terms, scored.table.blocks
    P = scored.configs[i].pp
    tail = _tail(scored, i, L)
    limit = size_limits(scored, i, objective, cap, tail)
    N = int(limit.max()) + 1  # sizes 0..N-1; a stage of n blocks has at most n fully recomputed
    n = np.arange(N, dtype=float)[None, :, None]  # [1, N, 1]
    b = np.arange(N, dtype=float)[None, None, :]  # [1, 1, B]
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
    pick = (np.arange(P)[:, None], np.arange(N)[None, :], j)
    feasible = np.isfinite(key[pick]) & (np.arange(N)[None, :] <= limit[:, None])

    def pad(x: np.ndarray, fill: float) -> np.ndarray:  # [P, N] -> [P, L + 1]: sizes past N never chosen
        return np.concatenate([x, np.full((P, L + 1 - N), fill, dtype=x.dtype)], axis=1)

    value = np.where(feasible, {"time": time, "comm": comm, "memory": mem}[objective][pick], INF)
    return StageTables(value=pad(value, INF), time=pad(np.where(feasible, time[pick], INF), INF), tail=tail,
                       sel=pad(np.where(feasible, a[pick], 0).astype(int), 0),
                       full=pad(np.where(feasible, j, 0).astype(int), 0))


def size_limits(scored: Scored, i: int, objective: str, cap: float, tail: np.ndarray) -> np.ndarray:
    """The most blocks each stage of configuration ``i`` can hold in a split whose objective
    is within ``cap (1 + PRUNE_SLACK)`` ``[S]`` (``L`` when nothing is known: no cap, or an
    objective other than time).

    A stage of ``n`` blocks takes at least ``T_s + n tau_s`` seconds per micro-batch (its
    static part and its fastest recompute mode), the others at least their static parts and
    ``(L - n) tau_min``, and the tail at least the largest of each stage's smallest tail, so
    every split with that stage is at least ``w_max (T_s + n tau_s) + w_sum (Σ T + n tau_s +
    (L - n) tau_min) + tail`` (:func:`autoplace.cost.step.pipeline_weights`).  CP-SAT never
    keeps a plan above its cap (within its slack and rounding, far below the margin), so the
    sizes left out are ones it could not use either.
    """
    t, L, cf = scored.terms, scored.table.blocks, scored.configs[i]
    P = cf.pp
    if objective != "time" or not np.isfinite(cap):
        return np.full(P, L)
    w_max, w_sum = pipeline_weights(cf.grad_accum, cf.vpp, BUBBLE_SHARE[cf.schedule])
    static = t.t_static[i, :P].sum(-1)  # [P]
    tau = t.t_block[i, :P, 0].sum(-1).min(-1)  # [P] seconds per block in its fastest mode
    n = np.arange(L + 1)[None, :]
    floor = w_max * (static[:, None] + n * tau[:, None]) + w_sum * (
        static.sum() + n * tau[:, None] + (L - n) * tau.min()) + float(tail[:, 1:].min(1).max())
    ok = floor <= cap * (1 + PRUNE_SLACK)
    return np.where(ok.any(1), L - np.argmax(ok[:, ::-1], axis=1), 0)


def _tail(scored: Scored, i: int, L: int) -> np.ndarray:
    """Once-per-step seconds of each stage as a function of its size ``n`` ``[S, L+1]``."""
    P = scored.configs[i].pp
    n = np.arange(L + 1, dtype=float)[None, :, None]
    return scored.terms.tail_at(i, np.arange(P)[:, None], n)


def split_bounds(tables: StageTables, v: int, m: int, objective: str,
                 share: float | Fraction = 1) -> tuple[float, list[int] | None]:
    """A lower bound of the configuration's objective over all splits, and a good split.

    Dynamic programs over stages: the smallest possible sum of stage values ``Σ*``, the
    smallest possible slowest stage ``τ*`` (the bottleneck split) and the smallest possible
    largest DP tail ``θ*`` (over the sizes that fit).  Every split has ``Σ >= Σ*``,
    ``max >= τ*`` and ``tail >= θ*``, so the step ``(m - 1/v) max + Σ/v + tail`` is at least
    ``(m - 1/v) τ* + Σ*/v + θ*``; for ``comm`` and ``memory`` the objective is the max itself.
    The bottleneck split is returned as a candidate (an upper bound once evaluated).
    """
    P, N = tables.value.shape
    L = N - 1
    allowed = (np.arange(N) % v == 0) & (np.arange(N) > 0)
    vals = np.where(allowed[None, :], tables.time if objective == "time" else tables.value, INF)
    total = vals[0].copy()
    top = vals[0].copy()
    choice = []
    W = _sizes(vals)
    band = _band_index(N, W)
    for s in range(1, P):
        stage = vals[s][W - 1::-1]  # a stage of W - 1 - r blocks
        total = np.min(_band(total, band) + stage, axis=1)
        cand = np.maximum(_band(top, band), stage)
        r = np.argmin(cand, axis=1)
        choice.append(np.arange(N) - W + 1 + r)  # the stages before end at k - (W - 1 - r)
        top = cand[np.arange(N), r]
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
        w_max, w_sum = pipeline_weights(m, v, float(share))
        fits = allowed & np.isfinite(tables.value)
        return float(w_max * top[L] + w_sum * total[L] + _min_max(tables.tail, fits)), split
    return float(top[L]), split


def _min_max(table: np.ndarray, allowed: np.ndarray) -> float:
    """The smallest possible largest entry over all splits (a min-max DP over stages),
    ``allowed[s, n]`` saying which sizes each stage may take."""
    P, N = table.shape
    vals = np.where(allowed, table, INF)
    top = vals[0].copy()
    W = _sizes(vals)
    band = _band_index(N, W)
    for s in range(1, P):
        top = np.min(np.maximum(_band(top, band), vals[s][W - 1::-1]), axis=1)
    return float(top[N - 1])


def _sizes(vals: np.ndarray) -> int:
    """One more than the largest stage size any stage can take (finite ``vals[s, n]``)."""
    finite = np.isfinite(vals).any(0)
    return int(np.flatnonzero(finite).max()) + 1 if finite.any() else 1


def _band_index(N: int, W: int) -> np.ndarray:
    """Indices of :func:`_band` for ``N`` block counts and stages of fewer than ``W`` blocks."""
    return np.arange(N)[:, None] + np.arange(W)[None, :]


def _band(prev: np.ndarray, index: np.ndarray) -> np.ndarray:
    """B[k, r] = prev[k - W + 1 + r] (inf before 0): the state before a stage of ``W - 1 - r``
    blocks that ends at ``k``.  The DPs over stages read only this band of the [start, end]
    matrix (no stage takes W blocks or more: :func:`_sizes`), in order of increasing start so
    that ties go to the earliest start, as on the full matrix."""
    return np.concatenate([np.full(index.shape[1] - 1, INF), prev])[index]
