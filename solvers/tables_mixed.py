"""Exact per-stage tables for models with several block kinds (DeepSeek's dense first layers
before MoE ones, windowed and full attention): for every configuration, stage, first block
and stage size, the best recompute counts of each kind and the resulting stage time, DP
tail, communication and memory.

Why this is exact.  Blocks are contiguous, so the blocks of each kind a stage holds are fixed
by where it starts and how many it holds (a dense prefix lands on the first stage only).
Given those counts, the stage's memory and micro-batch time are linear in the recompute
counts ``(a_k, b_k)`` (selective, full) of every kind ``k``; as with one kind
(:mod:`solvers.tables`) the step time is non-decreasing in every stage's time and recompute
touches nothing else, so each (stage, start, size) takes its own best counts.  Those come
from enumerating ``(a_k, b_k)`` of every kind but the most numerous one, ``z``, and ``b_z``:
what is left is linear in ``a_z`` (time) and non-increasing in it (memory), so the best
``a_z`` is an end of the interval that fits -- the fewest selective blocks that fit, or all
the blocks left.

A split is a path through the stage boundaries 0 = e_0 < e_1 < ... < e_P = L: the split DPs
run over boundary positions, and CP-SAT chooses one arc (start, size) per stage
(:func:`solvers.cpsat.build_model`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autoplace.cost.layers import LayerTable
from autoplace.cost.step import pipeline_time, pipeline_weights
from solvers.space import Scored
from solvers.tables import INF, PRUNE_SLACK

Arcs = list[list[tuple[int, int]]]  # per stage, the (first block, blocks) it may hold
OPTION_CELLS = 1 << 21  # rows x recompute options x phases evaluated at once (bounds the arrays' size)


@dataclass(frozen=True)
class MixedTables:
    """Arrays ``[S, L+1, W]`` for one configuration, indexed by stage, first block and blocks
    held (``inf`` where the stage cannot hold them, they are not a multiple of the interleave,
    or no plan within the cap uses them; ``W - 1`` is the largest size tabulated).

    Attributes:
        value, time, tail: as :class:`solvers.tables.StageTables` (the tail too is ``inf``
            where the stage cannot hold the blocks).
        sel, full: the chosen numbers of selective and fully recomputed blocks of each kind
            ``[S, L+1, W, K]``.
        prefix: blocks of each kind before every position ``[L+1, K]``.
    """

    value: np.ndarray
    time: np.ndarray
    tail: np.ndarray
    sel: np.ndarray
    full: np.ndarray
    prefix: np.ndarray


def kind_prefix(table: LayerTable) -> np.ndarray:
    """Blocks of each kind among the first ``p`` blocks, for every ``p`` ``[L+1, K]``."""
    one_hot = np.eye(len(table.kinds), dtype=int)[list(table.sequence)]
    return np.vstack([np.zeros(len(table.kinds), dtype=int), np.cumsum(one_hot, axis=0)])


def stage_arcs(P: int, v: int, L: int, W: int) -> np.ndarray:
    """Which (stage, first block, blocks) can be part of a split of ``L`` blocks into ``P``
    stages of multiples of ``v`` blocks, sizes below ``W`` ``[P, L+1, W]``."""
    s = np.arange(P)[:, None, None]
    a = np.arange(L + 1)[None, :, None]
    n = np.arange(W)[None, None, :]
    return (a % v == 0) & (n % v == 0) & (n >= v) & (a >= s * v) & (a + n + (P - 1 - s) * v <= L)


def mixed_tables(scored: Scored, i: int, objective: str, fixed_mode: int | None, cap: float = INF,
                 fixed_split: tuple[int, ...] | None = None) -> MixedTables:
    """Tables for configuration ``i`` (see the module docstring).

    With a finite ``cap`` (the objective of a known plan), stage sizes that no split within it
    can use are left out, as in :func:`solvers.tables.stage_tables`; with ``fixed_split`` only
    its stages are tabulated.
    """
    t, L, cf = scored.terms, scored.table.blocks, scored.configs[i]
    P = cf.pp
    prefix = kind_prefix(scored.table)
    arcs = stage_arcs(P, cf.vpp, L, L + 1)
    if fixed_split is not None:
        arcs &= _on_split(P, L, fixed_split)
    counts = _counts(prefix, L + 1)  # [L+1, L+1, K]
    tail = np.where(arcs, t.tail_at(i, np.arange(P)[:, None, None], counts[None]), INF)
    limit = mixed_limits(scored, i, objective, cap, tail)
    W = int(limit.max()) + 1
    arcs = arcs[..., :W] & (np.arange(W)[None, None, :] <= limit[:, None, None])
    s, a, n = np.nonzero(arcs)
    keys, inverse = np.unique(np.column_stack([s, counts[a, n]]), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    value, time, sel, full = best_recompute(scored, i, keys[:, 0], keys[:, 1:], objective, fixed_mode)
    K = prefix.shape[1]
    out = {name: np.full((P, L + 1, W), INF) for name in ("value", "time")}
    out["value"][s, a, n], out["time"][s, a, n] = value[inverse], time[inverse]
    picked = {name: np.zeros((P, L + 1, W, K), dtype=int) for name in ("sel", "full")}
    picked["sel"][s, a, n], picked["full"][s, a, n] = sel[inverse], full[inverse]
    tail = np.where(np.isfinite(out["value"]), tail[..., :W], INF)
    return MixedTables(out["value"], out["time"], tail, picked["sel"], picked["full"], prefix)


def _counts(prefix: np.ndarray, W: int) -> np.ndarray:
    """Blocks of each kind in ``[a, a + n)`` for every start ``a`` and size ``n < W``
    (clipped at the last block) ``[L+1, W, K]``."""
    L = prefix.shape[0] - 1
    end = np.minimum(np.arange(L + 1)[:, None] + np.arange(W)[None, :], L)
    return prefix[end] - prefix[:, None, :]


def _on_split(P: int, L: int, split: tuple[int, ...]) -> np.ndarray:
    """The arcs of one split ``[P, L+1, L+1]`` (none when it does not fit ``P`` stages and ``L`` blocks)."""
    mask = np.zeros((P, L + 1, L + 1), dtype=bool)
    if len(split) == P and sum(split) == L:
        starts = np.concatenate([[0], np.cumsum(split)[:-1]])
        mask[np.arange(P), starts, list(split)] = True
    return mask


def mixed_limits(scored: Scored, i: int, objective: str, cap: float, tail: np.ndarray) -> np.ndarray:
    """The most blocks each stage of configuration ``i`` can hold in a split whose objective is
    within ``cap (1 + PRUNE_SLACK)`` ``[S]`` (``L`` when nothing is known), by the argument of
    :func:`solvers.tables.size_limits` with every kind's fastest mode as the per-block floor
    and ``tail`` ``[S, L+1, L+1]`` (``inf`` off the arcs) for the tail's."""
    t, L, cf = scored.terms, scored.table.blocks, scored.configs[i]
    P = cf.pp
    if objective != "time" or not np.isfinite(cap):
        return np.full(P, L)
    w_max, w_sum = pipeline_weights(cf.grad_accum, cf.vpp)
    static = t.t_static[i, :P].sum(-1)  # [P]
    tau = t.t_block[i, :P].sum(-1).min(axis=(-2, -1))  # [P] seconds per block, fastest kind and mode
    n = np.arange(L + 1)[None, :]
    smallest = tail.min(axis=(1, 2))  # [P] each stage's smallest tail over what it may hold
    floor = w_max * (static[:, None] + n * tau[:, None]) + w_sum * (
        static.sum() + n * tau[:, None] + (L - n) * tau.min()) + float(smallest.max())
    ok = floor <= cap * (1 + PRUNE_SLACK)
    return np.where(ok.any(1), L - np.argmax(ok[:, ::-1], axis=1), 0)


def best_recompute(scored: Scored, i: int, stage: np.ndarray, counts: np.ndarray, objective: str,
                   fixed_mode: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The best recompute counts of rows (stage ``stage[r]`` holding ``counts[r, k]`` blocks of
    each kind) of configuration ``i``: (objective value, micro-batch seconds, selective and
    full counts ``[R, K]``), value and time ``inf`` where nothing fits."""
    R, K = counts.shape
    value, time = np.full(R, INF), np.full(R, INF)
    sel, full = np.zeros((R, K), dtype=int), np.zeros((R, K), dtype=int)
    if R == 0:
        return value, time, sel, full
    options = _options(counts.max(0), fixed_mode)
    per_row = max(1, OPTION_CELLS // (options[0].shape[0] * 2 * 2))
    for lo in range(0, R, per_row):
        rows = slice(lo, lo + per_row)
        value[rows], time[rows], sel[rows], full[rows] = _best_of(scored, i, stage[rows], counts[rows], options,
                                                                  objective, fixed_mode)
    return value, time, sel, full


def _options(most: np.ndarray, fixed_mode: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Recompute options for stages holding up to ``most[k]`` blocks of each kind: (selective
    ``[O, K]``, full ``[O, K]``, the kind ``z`` whose selective count is left to fit).  Every
    ``(a_k, b_k)`` with ``a_k + b_k <= most[k]`` of the other kinds and every ``b_z``; ``a_z``
    is 0 here.  With a pinned mode, one option (a marker: every block in that mode)."""
    K = len(most)
    z = int(np.argmax(most))
    if fixed_mode is not None:
        return np.zeros((1, K), dtype=int), np.zeros((1, K), dtype=int), z
    per_kind = [[(a, b) for a in range(int(c) + 1) for b in range(int(c) + 1 - a)] if k != z
                else [(0, b) for b in range(int(c) + 1)] for k, c in enumerate(most)]
    combos = np.array(list(itertools.product(*per_kind)), dtype=int).reshape(-1, K, 2)
    return combos[..., 0], combos[..., 1], z


def _best_of(scored: Scored, i: int, stage: np.ndarray, counts: np.ndarray,
             options: tuple[np.ndarray, np.ndarray, int], objective: str,
             fixed_mode: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`best_recompute` of a few rows."""
    t = scored.terms
    c = counts[:, None, :].astype(float)  # [R, 1, K]
    sel_o, full_o, z = options
    if fixed_mode is None:
        a, b = np.broadcast_to(sel_o[None], (len(c), *sel_o.shape)), full_o[None] + 0 * c
    else:
        a, b = c * (fixed_mode == 1), c * (fixed_mode == 2)
    ok = (a + b <= c).all(-1)  # [R, O]
    act = t.act_block[i, 0]  # [K, 3]
    static, per_block, mult = (x[i, stage] for x in t.phases)  # [R, F], [R, F, K], [R, F]
    kept = ((c - a - b) * act[:, 0] + a * act[:, 1] + b * act[:, 2]).sum(-1)  # [R, O] activation bytes
    base = static[:, None] + (c[..., None, :] * per_block[:, None]).sum(-1) + mult[:, None] * kept[..., None]  # [R,O,F]
    room = t.capacity[i, stage][:, None, None]
    if fixed_mode is None:
        # a_z: the fewest selective blocks of kind z that fit (or one more, against rounding), or all left
        save = (mult * (act[z, 0] - act[z, 1]))[:, None, :]  # [R, 1, F]
        need = np.where(save > 0, np.ceil((base - room) / np.where(save > 0, save, 1) - 1e-9), 0.0)
        fewest = np.clip(need.max(-1), 0, None)
        left = c[..., z] - b[..., z]
        fewest = np.where((base - fewest[..., None] * save <= room).all(-1), fewest, fewest + 1)
        a_z = np.concatenate([fewest, np.broadcast_to(left, fewest.shape)], axis=1)  # [R, 2O]
        a, b, ok, base = (np.concatenate([x, x], axis=1) for x in (a, b, ok, base))
        a = a.astype(float).copy()
        a[..., z] = a_z
        base = base - a_z[..., None] * save
        ok = ok & (a_z <= np.concatenate([left, left], axis=1))
    ok = ok & (base <= room).all(-1)
    host = t.host_static[i, stage] + (counts * t.host_block[i, stage]).sum(-1)
    ok = ok & (host <= t.host_capacity[i, stage])[:, None]
    none = c - a - b
    tb = t.t_block[i, stage].sum(-1)[:, None]  # [R, 1, K, 3]
    cb = t.bytes_block[i, 0].sum(-1)  # [K, 3]
    time = t.t_static[i, stage].sum(-1)[:, None] + (none * tb[..., 0] + a * tb[..., 1] + b * tb[..., 2]).sum(-1)
    comm = t.bytes_static[i, stage].sum(-1)[:, None] + (none * cb[:, 0] + a * cb[:, 1] + b * cb[:, 2]).sum(-1)
    mem = base.max(-1)
    main = {"time": time, "comm": comm, "memory": mem}[objective]
    key = np.where(ok, main + (0.0 if objective == "time" else 1e-9 * time), INF)
    j = key.argmin(1)
    rows = np.arange(len(c))
    fits = np.isfinite(key[rows, j])
    return (np.where(fits, main[rows, j], INF), np.where(fits, time[rows, j], INF),
            np.rint(a[rows, j]).astype(int), np.rint(b[rows, j]).astype(int))


def _band(N: int, W: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices for the DPs over boundary positions: a stage of ``n < W`` blocks ending
    at ``e`` starts at ``start[e, n] = e - n`` (clipped at 0; ``valid`` says where it is real)."""
    start = np.arange(N)[:, None] - np.arange(W)[None, :]
    return np.maximum(start, 0), start >= 0


def mixed_split_bounds(tables: MixedTables, v: int, m: int, objective: str) -> tuple[float, list[int] | None]:
    """A lower bound of the configuration's objective over all splits, and a good split: the
    DPs of :func:`solvers.tables.split_bounds` (smallest sum ``Σ*``, smallest slowest stage
    ``τ*``, smallest largest tail ``θ*``) over boundary positions instead of stage sizes."""
    main = tables.time if objective == "time" else tables.value
    P, N, W = main.shape
    L = N - 1
    start, valid = _band(N, W)
    sizes = np.broadcast_to(np.arange(W)[None, :], start.shape)
    total, top, tail = (np.where(np.arange(N) == 0, 0.0, INF) for _ in range(3))
    choice = []
    for s in range(P):
        stage = np.where(valid, main[s, start, sizes], INF)  # [N, W]: the stage ending at e, of n blocks
        total = np.min(total[start] + stage, axis=1)
        cand = np.maximum(top[start], stage)
        j = np.argmin(cand, axis=1)
        choice.append(j)
        top = cand[np.arange(N), j]
        tail = np.min(np.maximum(tail[start], np.where(valid, tables.tail[s, start, sizes], INF)), axis=1)
    if not np.isfinite(top[L]):
        return INF, None
    split, e = [], L
    for s in range(P - 1, -1, -1):
        n = int(choice[s][e])
        split.append(n)
        e -= n
    split.reverse()
    if objective != "time":
        return float(top[L]), split
    w_max, w_sum = pipeline_weights(m, v)
    return float(w_max * top[L] + w_sum * total[L] + tail[L]), split


def _lookup(tables: MixedTables, split: list[int] | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(stages, starts, sizes) of ``split`` as indices into the tables, or None when a stage
    is larger than any tabulated."""
    n = np.asarray(split, dtype=int)
    if len(n) != tables.time.shape[0] or (n >= tables.time.shape[2]).any() or (n < 0).any():
        return None
    return np.arange(len(n)), np.concatenate([[0], np.cumsum(n)[:-1]]).astype(int), n


def mixed_split_value(tables: MixedTables, split: list[int] | tuple[int, ...], v: int, m: int,
                      objective: str) -> float:
    """The objective of one split using the tables (inf when a stage cannot fit)."""
    at = _lookup(tables, split)
    if at is None or sum(split) != tables.time.shape[1] - 1:
        return INF
    vals = tables.value[at]
    if not np.isfinite(vals).all():
        return INF
    if objective != "time":
        return float(vals.max())
    return float(pipeline_time(tables.time[at], m, v) + tables.tail[at].max())


def mixed_modes(tables: MixedTables, split: list[int]) -> list[list[list[int]]]:
    """The recompute counts ``[stage][kind][none, selective, full]`` the tables chose for ``split``."""
    out, start = [], 0
    for s, n in enumerate(split):
        counts = tables.prefix[start + n] - tables.prefix[start]
        sel, full = tables.sel[s, start, n], tables.full[s, start, n]
        out.append([[int(c - a - b), int(a), int(b)] for c, a, b in zip(counts, sel, full, strict=True)])
        start += n
    return out


def mixed_arcs(tables: MixedTables, objective: str) -> Arcs | None:
    """The (first block, blocks) each stage can take on some split that fits (a finite value
    on every stage), or None when no split fits."""
    main = tables.time if objective == "time" else tables.value
    P, N, W = main.shape
    finite = np.isfinite(main)
    start, valid = _band(N, W)
    ahead = [np.arange(N) == 0]  # ahead[s][a]: the first s stages can end at a
    for s in range(P):
        ahead.append((valid & finite[s, start, np.arange(W)[None, :]] & ahead[s][start]).any(1))
    if not ahead[P][N - 1]:
        return None
    behind = np.arange(N) == N - 1  # the stages from s + 1 on can start at a position
    arcs: Arcs = [[] for _ in range(P)]
    for s in range(P - 1, -1, -1):
        ends = np.arange(N)[:, None] + np.arange(W)[None, :]
        on = finite[s] & ahead[s][:, None] & (ends < N) & behind[np.minimum(ends, N - 1)]
        arcs[s] = [(int(a), int(n)) for a, n in zip(*np.nonzero(on), strict=True)]
        behind = on.any(1)
    return arcs
