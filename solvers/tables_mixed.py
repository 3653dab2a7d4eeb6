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
from fractions import Fraction

import numpy as np

from autoplace.cost.layers import LayerTable
from autoplace.cost.step import BUBBLE_SHARE, pipeline_time, pipeline_weights
from autoplace.plan import FIRST_FULL, config_slots
from solvers.space import Scored
from solvers.tables import INF, size_limits

Arcs = list[list[tuple[int, int]]]  # per stage, the (first block, blocks) it may hold
OPTION_CELLS = 1 << 21  # rows x recompute options x phases evaluated at once (bounds the arrays' size)
ENUMERATED_ROWS = 64  # rows whose recompute options are enumerated together (up to the largest one's)


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


def stage_arcs(P: int, v: int, L: int, W: int, slots: tuple[int, ...] | None = None) -> np.ndarray:
    """Which (stage, first block, blocks) can be part of a split of ``L`` blocks into ``P``
    stages of multiples of ``v`` units, sizes below ``W`` ``[P, L+1, W]``: the first stage
    starts at 0, the last ends at ``L``, and every stage leaves room for the others.  A stage's
    units are its blocks and its places (``slots``: the embedding's on the first stage, the
    loss's on the last, :func:`autoplace.plan.stage_slots`), so a later stage starts ``e`` units
    (the embedding's place) past its first block."""
    slot = np.zeros(P, dtype=int) if slots is None else np.asarray(slots, dtype=int)
    e = int(slot[0]) if P > 1 else 0  # the units before block 0 that later stages count from
    s = np.arange(P)[:, None, None]
    a = np.arange(L + 1)[None, :, None]
    n = np.arange(W)[None, None, :]
    here = slot[:, None, None]
    ends = (s < P - 1) | (a + n == L)
    start = np.where(s > 0, a + e, a)  # the stage's first unit
    units = n + here
    return (start % v == 0) & (units % v == 0) & (units >= v) & (start >= s * v) & ((s > 0) | (a == 0)) & ends & (
        start + units + (P - 1 - s) * v <= L + int(slot.sum()))


def mixed_tables(scored: Scored, i: int, objective: str, fixed_mode: int | None, cap: float = INF,
                 fixed_split: tuple[int, ...] | None = None) -> MixedTables:
    """Tables for configuration ``i`` (see the module docstring).

    With a finite ``cap`` (the objective of a known plan), stage sizes that no split within it
    can use are left out, as in :func:`solvers.tables.stage_tables`; with ``fixed_split`` only
    its stages are tabulated.  ``fixed_mode``: a recompute mode for every block, FIRST_FULL
    (full on the first blocks, none after: one stage only), or None (any mix).
    """
    t, L, cf = scored.terms, scored.table.blocks, scored.configs[i]
    P = cf.pp
    if fixed_mode == FIRST_FULL and P != 1:
        raise ValueError("full recompute of the first blocks is tabulated for one stage only")
    prefix = kind_prefix(scored.table)
    limit = mixed_limits(scored, i, objective, cap, np.zeros(P))  # first without the tails
    arcs = stage_arcs(P, cf.vpp, L, int(limit.max()) + 1, config_slots(cf)) & (
        np.arange(int(limit.max()) + 1) <= limit[:, None, None])
    if fixed_split is not None:
        arcs &= _on_split(P, L, fixed_split)[..., :arcs.shape[2]]
    s, a, n = np.nonzero(arcs)
    counts = prefix[a + n] - prefix[a]  # [M, K] blocks of each kind on each arc
    tail = t.tail_at(i, s, counts)
    # then with each stage's smallest tail over the arcs left: every plan within the cap uses only those
    smallest = np.full(P, INF)
    np.minimum.at(smallest, s, tail)
    limit = np.minimum(limit, mixed_limits(scored, i, objective, cap, smallest))
    keep = n <= limit[s]
    s, a, n, counts, tail = s[keep], a[keep], n[keep], counts[keep], tail[keep]
    W, K = int(limit.max()) + 1, prefix.shape[1]
    # arcs alike (same stage, same blocks of each kind) share their recompute counts: one key each
    key = s.astype(np.int64)
    for k in range(K):
        key = key * (L + 1) + counts[:, k]
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    value, time, sel, full = best_recompute(scored, i, s[first], counts[first], objective, fixed_mode)
    out = {name: np.full((P, L + 1, W), INF) for name in ("value", "time", "tail")}
    out["value"][s, a, n], out["time"][s, a, n] = value[inverse], time[inverse]
    out["tail"][s, a, n] = np.where(np.isfinite(value[inverse]), tail, INF)
    picked = {name: np.zeros((P, L + 1, W, K), dtype=int) for name in ("sel", "full")}
    picked["sel"][s, a, n], picked["full"][s, a, n] = sel[inverse], full[inverse]
    return MixedTables(out["value"], out["time"], out["tail"], picked["sel"], picked["full"], prefix)


def _on_split(P: int, L: int, split: tuple[int, ...]) -> np.ndarray:
    """The arcs of one split ``[P, L+1, L+1]`` (none when it does not fit ``P`` stages and ``L`` blocks)."""
    mask = np.zeros((P, L + 1, L + 1), dtype=bool)
    if len(split) == P and sum(split) == L:
        starts = np.concatenate([[0], np.cumsum(split)[:-1]])
        mask[np.arange(P), starts, list(split)] = True
    return mask


def mixed_limits(scored: Scored, i: int, objective: str, cap: float, smallest: np.ndarray) -> np.ndarray:
    """The most blocks each stage of configuration ``i`` can hold in a split whose objective is
    within ``cap (1 + PRUNE_SLACK)`` ``[S]`` (``L`` when nothing is known): the floors of
    :func:`solvers.tables.size_floors` with every kind's fastest mode as the per-block floor
    and ``smallest[s]``, stage s's smallest tail over what it may hold, for the tail's, cut at
    the cap by :func:`solvers.tables.size_limits`."""
    t, L, cf = scored.terms, scored.table.blocks, scored.configs[i]
    P = cf.pp
    if objective != "time" or not np.isfinite(cap):
        return np.full(P, L)
    w_max, w_sum = pipeline_weights(cf.grad_accum, cf.vpp, BUBBLE_SHARE[cf.schedule])
    static = t.t_static[i, :P].sum(-1)  # [P]
    tau = t.t_block[i, :P].sum(-1).min(axis=(-2, -1))  # [P] seconds per block, fastest kind and mode
    n = np.arange(L + 1)[None, :]
    floor = w_max * (static[:, None] + n * tau[:, None]) + w_sum * (
        static.sum() + n * tau[:, None] + (L - n) * tau.min()) + float(smallest.max())
    return size_limits(floor, cap)


def best_recompute(scored: Scored, i: int, stage: np.ndarray, counts: np.ndarray, objective: str,
                   fixed_mode: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The best recompute counts of rows (stage ``stage[r]`` holding ``counts[r, k]`` blocks of
    each kind) of configuration ``i``: (objective value, micro-batch seconds, selective and
    full counts ``[R, K]``), value and time ``inf`` where nothing fits.

    Only rows where memory binds enumerate: where no recompute fits and every recompute costs
    (time, or the objective's key) no recompute is best, and where fully recomputing every
    block does not fit (when that keeps the least of every kind) nothing does.
    """
    R, K = counts.shape
    out = (np.full(R, INF), np.full(R, INF), np.zeros((R, K), dtype=int), np.zeros((R, K), dtype=int))
    if R == 0:
        return out
    if fixed_mode == FIRST_FULL:  # one stage, from block 0: full on the first b blocks, b = 0..L
        first = kind_prefix(scored.table)
        return _best_of(scored, i, stage, counts, (np.zeros_like(first), first, 0), objective, fixed_mode)
    if fixed_mode is not None:
        return _best_of(scored, i, stage, counts, _options(counts.max(0), fixed_mode), objective, fixed_mode)
    none = _best_of(scored, i, stage, counts, _options(counts.max(0), 0), objective, 0)
    done = np.isfinite(none[0]) & _recompute_costs(scored, i, stage, objective)
    for x, y in zip(out, none, strict=True):
        x[done] = y[done]
    act = scored.terms.act_block[i, 0]  # [K, 3]
    if (act[:, 2] <= act.min(-1)).all():
        done |= ~np.isfinite(_best_of(scored, i, stage, counts, _options(counts.max(0), 2), objective, 2)[0])
    rest = np.flatnonzero(~done)
    z = int(np.argmax(counts.sum(0)))
    # alike rows together (by the other kinds' counts, then z's): each chunk enumerates only its own options
    rest = rest[np.lexsort((counts[rest, z], *(counts[rest, k] for k in range(K) if k != z)))]
    for lo in range(0, len(rest), ENUMERATED_ROWS):
        chunk = rest[lo:lo + ENUMERATED_ROWS]
        options = _options(counts[chunk].max(0), None)
        per_row = max(1, OPTION_CELLS // (options[0].shape[0] * 4))
        for part in (chunk[k:k + per_row] for k in range(0, len(chunk), per_row)):
            for x, y in zip(out, _best_of(scored, i, stage[part], counts[part], options, objective, None), strict=True):
                x[part] = y
    return out


def _recompute_costs(scored: Scored, i: int, stage: np.ndarray, objective: str) -> np.ndarray:
    """Whether every block's selective or full recompute costs at least as much as none on
    each row's stage, by the objective's key (time; comm, then time) ``[R]`` (never for memory)."""
    t = scored.terms
    tb = t.t_block[i, stage].sum(-1)  # [R, K, 3]
    extra = tb[..., 1:] - tb[..., :1]
    if objective == "comm":
        cb = t.bytes_block[i, 0].sum(-1)  # [K, 3]
        extra = (cb[:, 1:] - cb[:, :1]) + 1e-9 * extra
    return (extra >= 0).all(axis=(1, 2)) if objective != "memory" else np.zeros(len(stage), dtype=bool)


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
    """:func:`best_recompute` of a few rows: every option's time, bytes and memory as the
    rows' no-recompute values plus the option's counts times each mode's extra per block."""
    t = scored.terms
    c = counts.astype(float)  # [R, K]
    if fixed_mode in (None, FIRST_FULL):
        A, B, z = options  # [O, K], shared by the rows (FIRST_FULL: each one whole, no selective to fill in)
    else:  # one option per row: every block in the pinned mode
        A, B, z = c[:, None] * (fixed_mode == 1), c[:, None] * (fixed_mode == 2), options[2]  # [R, 1, K]

    def per_option(x: np.ndarray, y: np.ndarray) -> np.ndarray:  # A x + B y per (row, option) [R, O]
        return np.broadcast_to(np.matmul(A, x[..., None])[..., 0] + np.matmul(B, y[..., None])[..., 0],
                               (len(c), A.shape[-2]))

    act = t.act_block[i, 0]  # [K, 3]
    tb = t.t_block[i, stage].sum(-1)  # [R, K, 3]
    cb = t.bytes_block[i, 0].sum(-1)  # [K, 3]
    static, per_block, mult = (x[i, stage] for x in t.phases)  # [R, F], [R, F, K], [R, F]
    time = (t.t_static[i, stage].sum(-1) + (c * tb[..., 0]).sum(-1))[:, None] + per_option(
        tb[..., 1] - tb[..., 0], tb[..., 2] - tb[..., 0])
    comm = (t.bytes_static[i, stage].sum(-1) + c @ cb[:, 0])[:, None] + per_option(
        np.broadcast_to(cb[:, 1] - cb[:, 0], c.shape), np.broadcast_to(cb[:, 2] - cb[:, 0], c.shape))
    kept = (c @ act[:, 0])[:, None] - per_option(np.broadcast_to(act[:, 0] - act[:, 1], c.shape),
                                                 np.broadcast_to(act[:, 0] - act[:, 2], c.shape))
    base = (static + (c[:, None, :] * per_block).sum(-1))[:, None] + mult[:, None] * kept[..., None]  # [R, O, F]
    room = t.capacity[i, stage][:, None, None]
    ok = np.ones(time.shape, dtype=bool)
    for k in range(c.shape[1]):
        ok &= (A[..., k] + B[..., k]) <= c[:, k, None]
    if fixed_mode is None:
        # a_z: the fewest selective blocks of kind z that fit (or one more, against rounding), or all left
        save = (mult * (act[z, 0] - act[z, 1]))[:, None, :]  # [R, 1, F]
        need = np.where(save > 0, np.ceil((base - room) / np.where(save > 0, save, 1) - 1e-9), 0.0)
        fewest = np.clip(need.max(-1), 0, None)
        fewest = np.where((base - fewest[..., None] * save <= room).all(-1), fewest, fewest + 1)
        left = c[:, z, None] - B[:, z]
        a_z = np.stack([fewest, np.broadcast_to(left, fewest.shape)], axis=-1)  # [R, O, 2]
        base = base[:, :, None] - a_z[..., None] * save[:, :, None]  # [R, O, 2, F]
        ok = ok[..., None] & (a_z <= left[..., None])
        time = time[..., None] + a_z * (tb[:, z, 1] - tb[:, z, 0])[:, None, None]
        comm = comm[..., None] + a_z * (cb[z, 1] - cb[z, 0])
    ok = ok & (base <= room.reshape(-1, *[1] * (base.ndim - 1))).all(-1)
    host = t.host_static[i, stage] + (counts * t.host_block[i, stage]).sum(-1)
    ok = ok & (host <= t.host_capacity[i, stage]).reshape((-1,) + (1,) * (ok.ndim - 1))
    mem = base.max(-1)
    main = {"time": time, "comm": comm, "memory": mem}[objective]
    key = np.where(ok, main + (0.0 if objective == "time" else 1e-9 * time), INF).reshape(len(c), -1)
    j = key.argmin(1)
    rows = np.arange(len(c))
    fits = np.isfinite(key[rows, j])
    value, seconds = main.reshape(len(c), -1)[rows, j], time.reshape(len(c), -1)[rows, j]
    if fixed_mode == FIRST_FULL:
        sel, full = A[j], B[j]
    elif fixed_mode is not None:
        sel, full = A[:, 0], B[:, 0]
    else:
        o = j // 2
        sel, full = A[o].astype(float), B[o]
        sel[:, z] = a_z.reshape(len(c), -1)[rows, j]
    return (np.where(fits, value, INF), np.where(fits, seconds, INF),
            np.rint(sel).astype(int), np.rint(full).astype(int))


def _band(N: int, W: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices for the DPs over boundary positions: a stage of ``n < W`` blocks ending
    at ``e`` starts at ``start[e, n] = e - n`` (clipped at 0; ``valid`` says where it is real)."""
    start = np.arange(N)[:, None] - np.arange(W)[None, :]
    return np.maximum(start, 0), start >= 0


def mixed_split_bounds(tables: MixedTables, v: int, m: int, objective: str,
                       share: float | Fraction = 1) -> tuple[float, list[int] | None]:
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
    w_max, w_sum = pipeline_weights(m, v, float(share))
    return float(w_max * top[L] + w_sum * total[L] + tail[L]), split


def _lookup(tables: MixedTables, split: list[int] | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(stages, starts, sizes) of ``split`` as indices into the tables, or None when a stage
    is larger than any tabulated."""
    n = np.asarray(split, dtype=int)
    if len(n) != tables.time.shape[0] or (n >= tables.time.shape[2]).any() or (n < 0).any():
        return None
    return np.arange(len(n)), np.concatenate([[0], np.cumsum(n)[:-1]]).astype(int), n


def mixed_split_value(tables: MixedTables, split: list[int] | tuple[int, ...], v: int, m: int,
                      objective: str, share: float | Fraction = 1) -> float:
    """The objective of one split using the tables (inf when a stage cannot fit)."""
    at = _lookup(tables, split)
    if at is None or sum(split) != tables.time.shape[1] - 1:
        return INF
    vals = tables.value[at]
    if not np.isfinite(vals).all():
        return INF
    if objective != "time":
        return float(vals.max())
    return float(pipeline_time(tables.time[at], m, v, float(share)) + tables.tail[at].max())


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
