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

Only stage sizes that can be part of a plan within a known plan's objective are tabulated
(:func:`size_limits`), and of those only the ones whose memory can fit are worked out
(:meth:`_Coefficients.fit`): with deep pipelines that is a handful of sizes out of ``L``,
and the split DPs read only that band of sizes, in chunks of ``vpp`` blocks (the only sizes
a stage can take).

Bounding builds the tables of many configurations at once (:func:`stage_tables_many`: every
(configuration, stage) a row of one grid) and runs their split DPs together
(:func:`split_bounds_many`, one pipeline depth per call): the same numbers as one
configuration at a time, element by element, in a few numpy passes instead of a few hundred
small ones (tests/test_tables.py checks them against the per-configuration code they
replaced, tests/tables_reference.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from autoplace.cost.step import BUBBLE_SHARE, pipeline_time, pipeline_weights
from autoplace.plan import FIRST_FULL, config_slots, split_units
from solvers.space import Scored, recompute_of

INF = np.inf


@dataclass(frozen=True)
class StageTables:
    """Arrays ``[S, L+1]`` for one configuration, or ``[C, S, L+1]`` for several (``inf``
    where a stage size cannot fit).

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

    def rows(self, start: int, stop: int) -> StageTables:
        """Stages ``start:stop`` of tables whose rows are (configuration, stage) pairs (views)."""
        return StageTables(*(x[start:stop] for x in (self.value, self.time, self.tail, self.sel, self.full)))


def stage_tables(scored: Scored, i: int, objective: str, fixed_mode: int | None, cap: float = INF) -> StageTables:
    """Tables for configuration ``i`` of a single-kind model (see the module docstring).

    With a finite ``cap`` (the objective of a known plan), stage sizes that no split within
    ``cap`` can use (:func:`size_limits`) are left out (``inf``), as sizes that cannot fit are:
    the [stage, size, full-recompute] grid shrinks from ``L + 1`` sizes to the few that can
    be part of a good plan.
    """
    return stage_tables_many(scored, [i], objective, fixed_mode, cap)[0][0]


def table_groups(scored: Scored, rows: Sequence[int]) -> list[list[int]]:
    """``rows`` in groups :func:`stage_tables_many` takes at once (the same binding memory
    phases), each in the order of ``rows``."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in rows:
        groups.setdefault(tuple(scored.terms.binding_phases(i, scored.configs[i].pp)), []).append(i)
    return list(groups.values())


def stage_tables_many(scored: Scored, rows: Sequence[int], objective: str, fixed_mode: int | None,
                      cap: float | Sequence[float] = INF) -> tuple[list[StageTables], np.ndarray, np.ndarray]:
    """:func:`stage_tables` of configurations ``rows`` at once (one group of :func:`table_groups`),
    every (configuration, stage) a row of one grid; ``cap`` is one for all or one each.

    Returns:
        The tables of each configuration, and the range ``[lo, hi)`` of each one's
        ``c (1 + PRUNE_SLACK)`` over which :func:`stage_tables` with cap ``c`` gives the same
        tables ``[C]`` (:meth:`TableBound.holds`): a cap moving within it neither admits a
        size beyond the ones that can fit nor drops one of them.
    """
    t, L = scored.terms, scored.table.blocks
    pp = np.array([scored.configs[r].pp for r in rows])
    start = np.cumsum(pp) - pp  # each configuration's first row
    i = np.repeat(np.asarray(rows), pp)  # [R] configuration and stage of every row
    s = np.arange(len(i)) - np.repeat(start, pp)
    co = _Coefficients.of(scored, i, s, t.binding_phases(rows[0], int(pp[0])))
    tail = _tails(scored, i, s)  # [R, L+1]
    caps = np.repeat(np.broadcast_to(np.asarray(cap, dtype=float), pp.shape), pp)  # [R]
    limit, floors = np.full(len(i), L), np.full((len(i), L + 1), -INF)
    if objective == "time":
        for depth in np.unique(pp):  # the floors read every stage of a configuration
            at = np.flatnonzero(np.repeat(pp == depth, pp))
            floors[at] = size_floors(scored, [r for r, p in zip(rows, pp, strict=True) if p == depth],
                                     tail[at].reshape(-1, int(depth), L + 1)).reshape(-1, L + 1)
        limit = np.where(np.isfinite(caps), size_limits(floors, caps[:, None]), L)
    fit = co.fit(L)
    reach = np.minimum(limit, fit)
    # the cap may fall until a stage could no longer hold its largest size that fits, and
    # rise until one could hold a size past its limit that may fit
    n = np.arange(L + 1)
    lo = np.where(reach > 0, np.where(n >= reach[:, None], floors, INF).min(-1), -INF)
    hi = np.where(reach < fit, np.where(n > reach[:, None], floors, INF).min(-1), INF)
    out = StageTables(value=np.full((len(i), L + 1), INF), time=np.full((len(i), L + 1), INF), tail=tail,
                      sel=np.zeros((len(i), L + 1), dtype=int), full=np.zeros((len(i), L + 1), dtype=int))
    for at in _buckets(reach, fixed_mode in (None, FIRST_FULL)):
        N = int(reach[at].max()) + 1
        parts = _best_counts(co.take(at) if len(at) < len(i) else co, N, limit[at], objective, fixed_mode)
        for table, part in zip((out.value, out.time, out.sel, out.full), parts, strict=True):
            table[at, :N] = part  # sizes past N never fit
    tables = [out.rows(x, x + p) for x, p in zip(start.tolist(), pp.tolist(), strict=True)]
    return tables, np.maximum.reduceat(lo, start), np.minimum.reduceat(hi, start)


GRID_CALL = 4000  # grid cells one more numpy pass over a grid costs about as much as (its calls' overhead)


def _buckets(reach: np.ndarray, free: bool) -> list[np.ndarray]:
    """Rows in groups that share a grid of sizes ``0..max reach`` (by ``b`` too when ``free``):
    rows of similar reach together, a group merged into the next larger one while the cells
    that adds cost less than another pass (GRID_CALL)."""
    bucket = np.frexp(reach + 1.0)[1]  # reach + 1 in [2^(e-1), 2^e)
    groups: list[np.ndarray] = []
    for b in np.unique(bucket)[::-1]:
        at = np.flatnonzero(bucket == b)
        if groups:
            big, small = reach[groups[-1]].max() + 1, reach[at].max() + 1
            if len(at) * (big ** (1 + free) - small ** (1 + free)) < GRID_CALL:
                groups[-1] = np.sort(np.concatenate([groups[-1], at]))
                continue
        groups.append(at)
    return groups


@dataclass(frozen=True)
class _Coefficients:
    """What the tables read of each row (a configuration's stage), shaped to broadcast
    against the [row, n, b] grid (``F``: the binding memory phases)."""

    static: np.ndarray  # [R,1,1,F] bytes: static, per block of state, in-flight micro-batches, capacity left
    state: np.ndarray
    mult: np.ndarray
    room: np.ndarray
    act: np.ndarray  # [3,R,1,1,1] activation bytes per block, by recompute mode
    host_static: np.ndarray  # [R,1,1] host bytes, static and per block, and capacity
    host_block: np.ndarray
    host_capacity: np.ndarray
    t_static: np.ndarray  # [R,1,1] seconds per micro-batch, static; [R,1,1,3] per block by mode
    t_block: np.ndarray
    bytes_static: np.ndarray  # as t_static and t_block, in bytes communicated
    bytes_block: np.ndarray

    @staticmethod
    def of(scored: Scored, i: np.ndarray, s: np.ndarray, keep: list[int]) -> _Coefficients:
        """The rows of configurations ``i``, stages ``s``, memory phases ``keep``."""
        t = scored.terms
        static, per_block, mult = (x[i, s][:, keep][:, None, None] for x in t.phases)  # [R,1,1,F(,K)]
        return _Coefficients(
            static=static, state=per_block[..., 0], mult=mult, room=t.capacity[i, s, None, None, None] - static,
            act=t.act_block[i, 0, 0].T[:, :, None, None, None], host_static=t.host_static[i, s, None, None],
            host_block=t.host_block[i, s, 0, None, None], host_capacity=t.host_capacity[i, s, None, None],
            t_static=t.t_static[i, s].sum(-1)[:, None, None], t_block=t.t_block[i, s, 0].sum(-1)[:, None, None, :],
            bytes_static=t.bytes_static[i, s].sum(-1)[:, None, None],
            bytes_block=t.bytes_block[i, 0, 0].sum(-1)[:, None, None, :])

    def take(self, at: np.ndarray) -> _Coefficients:
        """Rows ``at``."""
        return _Coefficients(**{f: x[:, at] if f == "act" else x[at] for f, x in vars(self).items()})

    def fit(self, L: int) -> np.ndarray:
        """A number of blocks past which each row cannot fit, whatever their recompute
        ``[R]``: the tables need not look at larger sizes.

        Any ``a`` selective and ``b`` full of ``n`` blocks hold at least ``n (state + min_r
        mult act_r)`` bytes in every phase (a mix of the three modes' per-block bytes), so
        ``n`` above ``room`` over that by more than the rounding of the tables' own sums
        cannot fit (``1e-9`` relative; their rounding is ``~1e-15``, and the quotient's is
        covered by one block more); host memory the same way.
        """
        state, mult, room = self.state[:, 0, 0], self.mult[:, 0, 0], self.room[:, 0, 0]  # [R, F]
        act = self.act[:, :, 0, 0]  # [3, R, 1]
        lower = state + (mult * act).min(0)
        slack = 1e-9 * (abs(room) + L * (abs(state) + abs(mult) * abs(act).sum(0)))
        host_room = (self.host_capacity - self.host_static)[:, 0, 0]
        host_block = self.host_block[:, 0, 0]
        host_room = host_room + 1e-9 * (abs(host_room) + L * abs(host_block))
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(lower > 0, np.floor((room + slack) / lower) + 1, L).min(-1)
            most = np.minimum(most, np.where(host_block > 0, np.floor(host_room / host_block) + 1, L))
        return np.clip(most, 0, L).astype(int)


def _best_counts(co: _Coefficients, N: int, limit: np.ndarray, objective: str,
                 fixed_mode: int | None) -> tuple[np.ndarray, ...]:
    """For every row and stage size ``n < N`` (``<= limit``), the best recompute counts (see
    the module docstring; FIRST_FULL: no selective ones): the objective term, the micro-batch
    time and the selective and full counts ``[R, N]`` (``inf``, 0 where none fits)."""
    n = np.arange(N, dtype=float)[None, :, None]  # [1, N, 1]
    any_b = fixed_mode in (None, FIRST_FULL)
    b = np.arange(N, dtype=float)[None, None, :] if any_b else np.where(fixed_mode == 2, n, 0.0)
    n4, b4 = n[..., None], b[..., None]
    act, mult, room = co.act, co.mult, co.room
    base = n4 * (co.state + mult * act[0]) - b4 * mult * (act[0] - act[2])  # [R,N,B,F] with a = 0
    save_sel = mult * (act[0] - act[1])
    if fixed_mode is None:
        # the fewest selective blocks that make every phase fit, for every (n, b)
        need = np.where(save_sel > 0, np.ceil((base - room) / np.where(save_sel > 0, save_sel, 1) - 1e-9), 0.0)
        a = np.clip(_last_max(need), 0, None)
        ok = (b <= n) & (a <= n - b) & _last_all(base - a[..., None] * save_sel <= room)
    else:  # b is the one count of fully recomputed blocks the mode allows (any b for FIRST_FULL)
        a = np.where(fixed_mode == 1, n, 0.0) + 0 * b
        ok = (b <= n) & _last_all(base - a[..., None] * save_sel <= room)
    a = np.broadcast_to(a, ok.shape)
    tb = co.t_block
    time = co.t_static + (n - a - b) * tb[..., 0] + a * tb[..., 1] + b * tb[..., 2]
    if objective == "time":
        key = cost = time
    elif objective == "comm":
        cb = co.bytes_block
        cost = co.bytes_static + (n - a - b) * cb[..., 0] + a * cb[..., 1] + b * cb[..., 2]
        key = cost + 1e-9 * time
    else:
        cost = _last_max(co.static + base - a[..., None] * save_sel)
        key = cost + 1e-9 * time
    key = np.where(ok, key, INF)
    j = key.argmin(axis=-1)  # best b per (row, n)
    at = (np.arange(j.size) * key.shape[-1] + j.ravel()).reshape(j.shape)

    def pick(x: np.ndarray) -> np.ndarray:  # x at (row, n, j)
        return np.broadcast_to(x, key.shape)[..., 0] if key.shape[-1] == 1 else np.take(x, at)

    # host memory depends on n alone: where it does not fit no b does, and nothing is picked
    host = (co.host_static + n * co.host_block <= co.host_capacity)[..., 0]
    feasible = np.isfinite(pick(key)) & host & (np.arange(N) <= limit[:, None])
    return (np.where(feasible, pick(cost), INF), np.where(feasible, pick(time), INF),
            np.where(feasible, pick(a), 0), np.where(feasible, j if any_b else pick(b), 0))


def _last_max(x: np.ndarray) -> np.ndarray:
    """``x.max(-1)``; with one entry on the last axis, that entry (the same numbers, no pass)."""
    return x[..., 0] if x.shape[-1] == 1 else x.max(-1)


def _last_all(x: np.ndarray) -> np.ndarray:
    """``x.all(-1)``, as :func:`_last_max`."""
    return x[..., 0] if x.shape[-1] == 1 else np.logical_and.reduce(x, axis=-1)


PRUNE_SLACK = 0.01  # relative margin of size_limits: far beyond the rounding of CP-SAT's integer units


def size_floors(scored: Scored, rows: Sequence[int], tail: np.ndarray) -> np.ndarray:
    """A lower bound of the step time of every split in which stage ``s`` holds ``n`` blocks,
    ``[C, S, L+1]`` for configurations ``rows`` of one depth (``tail`` from :func:`_tails`, ``[C, S, L+1]``).

    A stage of ``n`` blocks takes at least ``T_s + n tau_s`` seconds per micro-batch (its
    static part and its fastest recompute mode), the others at least their static parts and
    ``(L - n) tau_min``, and the tail at least the largest of each stage's smallest tail, so
    every split with that stage is at least ``w_max (T_s + n tau_s) + w_sum (Σ T + n tau_s +
    (L - n) tau_min) + tail`` (:func:`autoplace.cost.step.pipeline_weights`).
    """
    t, L = scored.terms, scored.table.blocks
    i = np.asarray(rows)
    P = scored.configs[rows[0]].pp
    m = np.array([scored.configs[r].grad_accum for r in rows])
    v = np.array([scored.configs[r].vpp for r in rows])
    share = np.array([float(BUBBLE_SHARE[scored.configs[r].schedule]) for r in rows])
    w_max, w_sum = (w[:, None, None] for w in pipeline_weights(m, v, share))
    static = t.t_static[i, :P].sum(-1)  # [C, P]
    tau = t.t_block[i, :P, 0].sum(-1).min(-1)  # [C, P] seconds per block in its fastest mode
    n = np.arange(L + 1)[None, None, :]
    return w_max * (static[..., None] + n * tau[..., None]) + w_sum * (
        static.sum(-1)[:, None, None] + n * tau[..., None] + (L - n) * tau.min(-1)[:, None, None]) + \
        tail[:, :, 1:].min(-1).max(-1)[:, None, None]


def size_limits(floors: np.ndarray, cap: float | np.ndarray) -> np.ndarray:
    """The most blocks each stage can hold in a split whose objective is within ``cap (1 +
    PRUNE_SLACK)`` ``[..., S]``, from :func:`size_floors` (``cap`` broadcasts against their
    last axis; without a cap, or for an objective other than time, ``L``).

    CP-SAT never keeps a plan above its cap (within its slack and rounding, far below the
    margin), so the sizes left out are ones it could not use either.
    """
    L = floors.shape[-1] - 1
    ok = floors <= cap * (1 + PRUNE_SLACK)
    return np.where(ok.any(-1), L - np.argmax(ok[..., ::-1], axis=-1), 0)


def _tails(scored: Scored, i: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Once-per-step seconds of stage ``s`` of configuration ``i`` (rows) as a function of its
    size ``n`` ``[R, L+1]``."""
    n = np.arange(scored.table.blocks + 1, dtype=float)[None, :, None]
    # tail_at indexes its tables with i and s, so rows of several configurations broadcast as
    # one configuration's stages do (its annotation says one configuration)
    return scored.terms.tail_at(i[:, None], s[:, None], n)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TableBound:
    """What bounding learns of one configuration from its tables (:func:`bound_many`).

    Attributes:
        lower: a lower bound over all splits (:func:`split_bounds`; inf when none fits).
        upper: the objective of ``split`` (inf when no candidate split fits).
        split: the better of the even and the bottleneck split (the fixed one if any).
        tables: the configuration's tables.
        cap: the cap they were built with.
        lo, hi: the range of caps they hold for (:meth:`holds`).
    """

    lower: float
    upper: float
    split: list[int] | None
    tables: StageTables
    cap: float
    lo: float
    hi: float

    def holds(self, cap: float) -> bool:
        """Whether the tables (and so the bounds and split) are also those of ``cap``
        (:func:`stage_tables_many`)."""
        return cap == self.cap or self.lo <= cap * (1 + PRUNE_SLACK) < self.hi


def bound_many(scored: Scored, rows: Sequence[int], objective: str, fixed_mode: int | None,
               caps: Sequence[float], splits: Sequence[tuple[int, ...] | None]) -> dict[int, TableBound]:
    """Tables, split bounds and a good split of configurations ``rows`` (any mix), each built
    knowing a plan of objective ``caps[k]``: the tables by recompute form
    (:func:`solvers.space.recompute_of`, ``fixed_mode`` pinned) and groups of :func:`table_groups`,
    the DPs by groups of one pipeline depth.  ``splits[k]``: the split row k's plans must take
    (:func:`solvers.space.split_of`), its upper bound and split; None: the better of the even and
    the bottleneck split.  The lower bound holds over every split, so over that one too."""
    L = scored.table.blocks
    cap_of = dict(zip(rows, caps, strict=True))
    forced = dict(zip(rows, splits, strict=True))
    built: dict[int, tuple[StageTables, float, float]] = {}
    by_mode: dict[int | None, list[int]] = {}
    for i in rows:
        by_mode.setdefault(recompute_of(scored.configs, i, fixed_mode), []).append(i)
    for mode, part in by_mode.items():
        for group in table_groups(scored, part):
            tables, los, his = stage_tables_many(scored, group, objective, mode, [cap_of[i] for i in group])
            built.update((i, (tb, float(a), float(b))) for i, tb, a, b in zip(group, tables, los, his, strict=True))
    out = {}
    for pp, group in _by_depth(scored, rows).items():
        stacked = StageTables(*(np.stack([getattr(built[i][0], f) for i in group]) for f in StageTables.__annotations__))
        m, vs = (np.array([getattr(scored.configs[i], f) for i in group]) for f in ("grad_accum", "vpp"))
        slots = np.array([config_slots(scored.configs[i]) for i in group])
        shares = np.array([float(BUBBLE_SHARE[scored.configs[i].schedule]) for i in group])
        lower, bottlenecks = split_bounds_many(stacked, vs, m, objective, slots, shares)
        for c, i in enumerate(group):
            (tb, lo, hi), v, neck, cf = built[i], int(vs[c]), bottlenecks[c], scored.configs[i]
            even = list(split_units(L, pp, v, cf.pp_embedding, cf.pp_loss))
            pinned = forced[i]
            tried = [list(pinned)] if pinned else [even, *([neck] if neck else [])]
            values = [(split_value(tb, sp, v, int(m[c]), objective, shares[c]), sp) for sp in tried
                      if sum(sp) == L and len(sp) == pp]
            upper, split = min(values, key=lambda x: x[0]) if values else (INF, None)
            out[i] = TableBound(float(lower[c]), upper, split if np.isfinite(upper) else None, tb, cap_of[i], lo, hi)
    return out


def _by_depth(scored: Scored, rows: Sequence[int]) -> dict[int, list[int]]:
    """``rows`` by pipeline depth, each in the order of ``rows``."""
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(scored.configs[i].pp, []).append(i)
    return groups


def split_bounds(tables: StageTables, v: int, m: int, objective: str,
                 slots: tuple[int, ...] | None = None, share: float | Fraction = 1) -> tuple[float, list[int] | None]:
    """A lower bound of the configuration's objective over all splits, and a good split.

    Dynamic programs over stages: the smallest possible sum of stage values ``Σ*``, the
    smallest possible slowest stage ``τ*`` (the bottleneck split) and the smallest possible
    largest DP tail ``θ*`` (over the sizes that fit).  Every split has ``Σ >= Σ*``,
    ``max >= τ*`` and ``tail >= θ*``, so the step ``(m - 1/v) max + Σ/v + tail`` is at least
    ``(m - 1/v) τ* + Σ*/v + θ*``; for ``comm`` and ``memory`` the objective is the max itself.
    The bottleneck split is returned as a candidate (an upper bound once evaluated).
    """
    stacked = StageTables(*(x[None] for x in (tables.value, tables.time, tables.tail, tables.sel, tables.full)))
    lower, splits = split_bounds_many(stacked, np.array([v]), np.array([m]), objective,
                                      None if slots is None else np.array([slots]), np.array([float(share)]))
    return float(lower[0]), splits[0]


def split_bounds_many(tables: StageTables, v: np.ndarray, m: np.ndarray, objective: str,
                      slots: np.ndarray | None = None,
                      shares: np.ndarray | None = None) -> tuple[np.ndarray, list[list[int] | None]]:
    """:func:`split_bounds` of stacked tables ``[C, S, L+1]`` of one pipeline depth, with
    ``v[C]`` virtual stages, ``m[C]`` micro-batches and ``slots[C, S]`` the stages' embedding /
    loss places (:func:`autoplace.plan.stage_slots`; none when not given), ``shares[C]`` the
    schedules' bubble shares (:data:`autoplace.cost.step.BUBBLE_SHARE`; 1 when not given): the
    lower bounds ``[C]`` and the splits.

    The DPs run over chunks of ``v`` units (a stage's blocks and places), the only sizes a
    stage may take: every state between is unreachable (``inf``) on the grid, so the minima,
    and the earliest start among ties, are the same.  Configuration ``c`` reads its DPs at its
    ``(L + places) / v_c`` chunks; the states past it (other configurations' longer grids)
    never reach back.
    """
    C, P, N = tables.value.shape
    L, rows = N - 1, np.arange(C)
    slots = np.zeros((C, P), dtype=int) if slots is None else slots
    units = L + slots.sum(1)
    Q = np.where(units % v == 0, units // v, 0)  # a v that does not divide the units makes no split (all inf)
    vals = _chunks(tables.time if objective == "time" else tables.value, v, slots)  # [C, P, Q+1]
    W = _sizes(vals)
    sizes = np.ascontiguousarray(vals.transpose(1, 2, 0))[:, W - 1::-1, :, None]  # [S, W, C, 1]: W - 1 - r chunks
    total, top = _padded(vals[:, 0], W), _padded(vals[:, 0], W)  # the states, after W - 1 inf
    total_band, top_band = _band(total, W), _band(top, W)  # views: they follow the states
    picks = []
    for s in range(1, P):
        cand = np.maximum(top_band, sizes[s])
        picks.append(cand.argmin(axis=0))  # the stages before end at k - (W - 1 - r): the earliest start
        total[:, W - 1:] = (total_band + sizes[s]).min(axis=0)
        top[:, W - 1:] = cand.min(axis=0)
    found = np.isfinite(top[rows, W - 1 + Q])
    split, k = np.zeros((C, P), dtype=int), Q
    for s in range(P - 1, 0, -1):
        j = np.maximum(k - (W - 1 - picks[s - 1][rows, k]), 0)  # (rows that found no split: anywhere)
        split[:, s] = (k - j) * v - slots[:, s]
        k = j
    split[:, 0] = k * v - slots[:, 0]
    splits = [split[c].tolist() if found[c] else None for c in range(C)]
    lower = top[rows, W - 1 + Q]
    if objective == "time":
        w_max, w_sum = pipeline_weights(m, v, 1.0 if shares is None else shares)
        tails = _chunks(np.where(np.isfinite(tables.value), tables.tail, INF), v, slots)
        with np.errstate(invalid="ignore"):  # 0 * inf where no split fits: dropped below
            lower = w_max * lower + w_sum * total[rows, W - 1 + Q] + _min_max(tails, Q)
    return np.where(found, lower, INF), splits


def _chunks(table: np.ndarray, v: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``table[c, s, q v_c - slots[c, s]]`` for ``q`` chunks of ``v_c`` units, ``inf`` for none, for
    a stage that would hold fewer than no blocks or more than ``L``, and past the units
    ``[C, S, max units / min(v) + 1]`` (all ``inf`` where ``v_c`` does not divide the units)."""
    C, P, N = table.shape
    units = N - 1 + slots.sum(1)
    out = np.full((C, P, int(units.max()) // int(v.min()) + 1), INF)
    for x in np.unique(v):
        chosen = np.flatnonzero((v == x) & (units % x == 0))
        if not len(chosen):
            continue
        width = int(units[chosen].max()) // x + 1
        n = np.arange(width)[None, None, :] * x - slots[chosen][..., None]  # [c, P, Q] blocks
        inside = (n >= 0) & (n < N) & (n + slots[chosen][..., None] <= units[chosen][:, None, None])
        picked = np.take_along_axis(table[chosen], np.clip(n, 0, N - 1), axis=2)
        out[chosen, :, :width] = np.where(inside, picked, INF)
    out[..., 0] = INF
    return out


def _padded(x: np.ndarray, W: int) -> np.ndarray:
    """``x [C, N]`` after ``W - 1`` columns of inf: the DP states :func:`_band` reads."""
    return np.concatenate([np.full((len(x), W - 1), INF), x], axis=-1)


def _band(padded: np.ndarray, W: int) -> np.ndarray:
    """B[r, c, k] = state[c, k - W + 1 + r] (inf before 0) of states after ``W - 1`` inf
    (:func:`_padded`), a view: the state before a stage of ``W - 1 - r`` sizes that ends at
    ``k``.  The DPs over stages read only this band of the [start, end] matrix (no stage
    takes W sizes or more: :func:`_sizes`), in order of increasing start so that ties go to
    the earliest start, as on the full matrix; ``r`` first, so that the minima over it are
    elementwise passes over whole rows."""
    C, n = padded.shape
    row, col = padded.strides
    return np.ndarray((W, C, n - W + 1), padded.dtype, padded, strides=(col, row, col))


def _min_max(vals: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The smallest possible largest entry over all splits of ``at[c]`` sizes (a min-max DP
    over stages) of stacked tables ``[C, S, N]`` (``inf`` where a stage cannot take a size) ``[C]``."""
    W = _sizes(vals)
    sizes = np.ascontiguousarray(vals.transpose(1, 2, 0))[:, W - 1::-1, :, None]  # [S, W, C, 1]
    top = _padded(vals[:, 0], W)
    band = _band(top, W)
    for s in range(1, vals.shape[1]):
        top[:, W - 1:] = np.maximum(band, sizes[s]).min(axis=0)
    return top[np.arange(len(vals)), W - 1 + at]


def _sizes(vals: np.ndarray) -> int:
    """One more than the largest stage size any stage can take (finite ``vals[..., n]``)."""
    finite = np.isfinite(vals).reshape(-1, vals.shape[-1]).any(0)
    return int(np.flatnonzero(finite).max()) + 1 if finite.any() else 1


def split_value(tables: StageTables, split: list[int] | tuple[int, ...], v: int, m: int, objective: str,
                share: float | Fraction = 1) -> float:
    """The objective of one split using the tables (inf when a stage cannot fit); ``share`` the
    schedule's bubble share (:data:`autoplace.cost.step.BUBBLE_SHARE`)."""
    s = np.arange(len(split))
    n = np.asarray(split)
    vals = tables.value[s, n]
    if not np.isfinite(vals).all():
        return INF
    if objective != "time":
        return float(vals.max())
    return float(pipeline_time(tables.time[s, n], m, v, float(share)) + tables.tail[s, n].max())


def table_modes(tables: StageTables, split: list[int]) -> list[list[list[int]]]:
    """The recompute counts ``[stage][kind=0][none, selective, full]`` the tables chose for ``split``."""
    return [[[n - int(tables.sel[s, n]) - int(tables.full[s, n]), int(tables.sel[s, n]), int(tables.full[s, n])]]
            for s, n in enumerate(split)]


def split_sizes(tables: StageTables, objective: str, pp: int, v: int,
                fixed_split: tuple[int, ...] | None = None,
                slots: tuple[int, ...] | None = None) -> list[list[int]] | None:
    """The chunk counts (of ``v`` units: blocks and the stage's embedding / loss places ``slots``)
    each stage can take by the tables (a finite value; the fixed split's if any), or None when
    no split is made of them."""
    main, L = tables.time if objective == "time" else tables.value, tables.value.shape[1] - 1
    slots = slots or (0,) * pp
    U = L + sum(slots)
    if U % v:
        return None
    sizes = [[q for q in range(1, U // v - pp + 2) if 0 <= q * v - slot <= L and np.isfinite(row[q * v - slot])]
             for row, slot in zip(main, slots, strict=True)]
    if fixed_split is not None and len(fixed_split) == pp:
        sizes = [[q for q in ok if q * v - slot == n] for ok, n, slot in zip(sizes, fixed_split, slots, strict=True)]
    reach = np.zeros(U + 1, dtype=bool)  # unit counts the first stages can hold together
    reach[0] = True
    for ok in sizes:
        before, reach = reach, np.zeros(U + 1, dtype=bool)
        for q in ok:
            reach[q * v:] |= before[:U + 1 - q * v]
    return sizes if reach[U] else None
