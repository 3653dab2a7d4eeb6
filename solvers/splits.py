"""The exact best split of one configuration (one block kind, time objective).

A split ``n_1..n_P`` (multiples of the interleave ``v`` summing to ``L``) costs
``w_max max_s t_s(n_s) + w_sum Σ_s t_s(n_s) + max_s θ_s(n_s)``
(:func:`autoplace.cost.step.pipeline_weights`; ``t`` and ``θ`` are the tables'
micro-batch and tail seconds).  :func:`solvers.tables.split_bounds` bounds it with three
separate DPs (smallest sum, smallest max, smallest max tail), which is sound but loose;
:func:`best_split` finds the optimum itself, so CP-SAT is handed a lower bound it can reach
and a hint that reaches it, and proves each configuration's optimum at once.

Why thresholds are exact.  Let ``Σ(τ, θ)`` be the smallest ``Σ_s t_s(n_s)`` over the splits
whose every stage has ``t_s(n_s) <= τ`` and ``θ_s(n_s) <= θ`` (``inf`` if there is none).
Then ``OPT = min_{τ, θ} w_max τ + w_sum Σ(τ, θ) + θ`` over the values the tables take:

* ``>=``: for an optimal split ``S*`` take ``τ = max_s t_s``, ``θ = max_s θ_s`` (both are
  table values); ``S*`` is allowed there, so ``Σ(τ, θ) <= Σ_s t_s`` and the term is at most
  ``OPT``;
* ``<=``: the split ``S`` reaching a finite ``Σ(τ, θ)`` has ``max t <= τ`` and
  ``max θ <= θ``, so (``w_max, w_sum >= 0``) its cost ``<= w_max τ + w_sum Σ(τ, θ) + θ``.

``Σ`` is non-increasing in both thresholds and at least the unrestricted ``Σ*``, and a
threshold pair is only feasible with ``τ >= τ*`` and ``θ >= θ*`` (the smallest possible max
time and tail), so ``w_max τ + w_sum Σ* + θ*`` bounds every pair with that ``τ`` from below:
thresholds are visited in increasing ``τ``, only the ``θ`` still able to beat the best split
found, and the visit stops once that bound exceeds it.  On the deep pipelines where the
search was slow, one or two ``(τ, θ)`` pairs remain per configuration.  Where thresholds do
not prune (``w_max`` near 0: one micro-batch; many distinct values) the visit is cut after
``MAX_DPS`` threshold DPs with the best split found and a sound bound (tens of ms at worst,
rather than seconds); CP-SAT then closes the rest by search, as without this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from solvers.tables import StageTables
from solvers.tables_mixed import MixedTables

INF = np.inf


MAX_DPS = 8  # threshold DPs per configuration before settling for a bound (see best_split)
MAX_ROWS = 8  # thresholds one DP takes at once


@dataclass(frozen=True)
class BestSplit:
    """What :func:`best_split` found.

    Attributes:
        cost: the cost of ``split``.
        split: blocks per stage, None when no split fits (then ``cost = bound = inf``).
        bound: a sound lower bound of every split's cost, ``cost`` itself unless the work
            budget ran out first (``exact``).
    """

    cost: float
    split: list[int] | None
    bound: float

    @property
    def exact(self) -> bool:
        return self.bound >= self.cost


def best_split(time: np.ndarray, tail: np.ndarray, v: int, w_max: float, w_sum: float,
               max_dps: int = MAX_DPS, slots: tuple[int, ...] | None = None) -> BestSplit:
    """The smallest cost over every split and a split reaching it (see the module docstring).

    Tables whose thresholds do not prune (a small ``w_max``, many distinct values) could take
    a DP per threshold pair: after ``max_dps`` threshold DPs the visit stops with the best
    split found and the smallest lower bound of the pairs not visited (still at least the
    three separate DPs' bound).

    Args:
        time, tail: ``[P, L + 1]`` seconds of stage ``s`` holding ``n`` blocks per micro-batch
            and once per step (``inf`` where the size cannot fit).
        v: the interleave: stage sizes are positive multiples of it.
        w_max, w_sum: the non-negative weights of the slowest stage and of the sum.
        max_dps: the work budget, in threshold DPs.
        slots: per stage, the places the embedding and the loss take (:func:`autoplace.plan.stage_slots`):
            a stage's blocks and its places are the multiple of ``v``.
    """
    t, th, Q = chunk_tables(time, tail, v, slots)  # in chunks of v units: 0..Q-1 per stage
    if Q == 0:
        return BestSplit(INF, None, INF)
    ok = np.isfinite(t) & np.isfinite(th) & (np.arange(Q) > 0)
    if not ok.any():
        return BestSplit(INF, None, INF)
    W = int(np.flatnonzero(ok.any(0)).max()) + 1  # no stage holds W chunks or more
    return _thresholds(_Sizes(Q, v, np.zeros(len(t), dtype=int) if slots is None else np.asarray(slots)),
                       np.where(ok, t, INF)[:, :W], np.where(ok, th, INF)[:, :W], w_max, w_sum, max_dps)


def chunk_tables(time: np.ndarray, tail: np.ndarray, v: int,
                 slots: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """``time`` and ``tail`` ``[P, L + 1]`` by chunks of ``v`` units per stage ``[P, Q]`` (``inf`` where a
    stage's blocks would be negative or past ``L``), and ``Q``, the chunk counts 0..Q-1 (0 when ``v``
    does not divide the units): a stage of ``q`` chunks holds ``q v - slots[s]`` blocks."""
    P, N = time.shape
    slot = np.zeros(P, dtype=int) if slots is None else np.asarray(slots, dtype=int)
    units = N - 1 + int(slot.sum())
    if units % v:
        return time[:, :0], tail[:, :0], 0
    Q = units // v + 1
    n = np.arange(Q)[None, :] * v - slot[:, None]  # [P, Q] blocks
    inside = (n >= 0) & (n < N)
    at = (np.arange(P)[:, None], np.clip(n, 0, N - 1))
    return np.where(inside, time[at], INF), np.where(inside, tail[at], INF), Q


def best_arc_split(time: np.ndarray, tail: np.ndarray, w_max: float, w_sum: float,
                   max_dps: int = MAX_DPS) -> BestSplit:
    """:func:`best_split` for several block kinds (:mod:`solvers.tables_mixed`): a stage's
    seconds depend on where it starts as well as on its size, so the DPs run over stage
    boundaries (a split is a path 0 = e_0 < ... < e_P = L) and the same thresholds are exact
    by the same argument.

    Args:
        time, tail: ``[P, L + 1, W]`` seconds of stage ``s`` starting at block ``a`` and
            holding ``n < W`` blocks (``inf`` where it cannot: sizes off the interleave too).
        w_max, w_sum, max_dps: as :func:`best_split`.
    """
    ok = np.isfinite(time) & np.isfinite(tail) & (np.arange(time.shape[2]) > 0)
    if not ok.any():
        return BestSplit(INF, None, INF)
    return _thresholds(_Arcs(ok), np.where(ok, time, INF), np.where(ok, tail, INF),
                       w_max, w_sum, max_dps)


class _Sizes:
    """The DPs of one block kind: a stage's cost depends on its size only (``[P, W]`` tables
    in chunks of ``v`` units: blocks and the embedding / loss places ``slots``)."""

    def __init__(self, Q: int, v: int, slots: np.ndarray) -> None:
        self.Q, self.v, self.slots = Q, v, slots

    def dp(self, vals: np.ndarray, join: np.ufunc, choose: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
        return _dp(vals, self.Q, join, choose)

    def path(self, choices: list[np.ndarray]) -> np.ndarray:
        return _path(choices, self.Q)

    def at(self, x: np.ndarray, split: np.ndarray) -> np.ndarray:
        return x[np.arange(len(split)), split]

    def blocks(self, split: np.ndarray) -> list[int]:
        return (split * self.v - self.slots).tolist()


class _Arcs:
    """The DPs of several block kinds, over stage boundaries 0..L, reading only the arcs
    (stage, first block, size) the tables allow (``ok`` ``[P, L + 1, W]``): a few per stage
    once the tables are cut at a cap, of the ``(L + 1) W`` a dense band would read."""

    def __init__(self, ok: np.ndarray) -> None:
        self.N = ok.shape[1]
        self.arcs = []  # per stage: (first blocks, sizes) sorted by where they end, and each end's first arc
        for s in range(ok.shape[0]):
            a, n = np.nonzero(ok[s])
            a, n = a[a + n < self.N], n[a + n < self.N]  # (past the last block: no split uses it)
            order = np.argsort(a + n, kind="stable")
            a, n = a[order], n[order]
            ends, first = np.unique(a + n, return_index=True)
            self.arcs.append((a, n, ends, first))

    def dp(self, vals: np.ndarray, join: np.ufunc, choose: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
        """As :func:`_dp`, ``vals`` ``[K, P, L + 1, W]``; the choices are each stage's arc
        values ``[K, arcs]`` (:meth:`path` finds the best arc ending at each boundary)."""
        K = vals.shape[0]
        best = np.full((K, self.N), INF)
        best[:, 0] = 0.0 if join is np.add else -INF
        choices = []
        for s, (a, n, ends, first) in enumerate(self.arcs):
            cand = join(best[:, a], vals[:, s, a, n])  # [K, arcs]
            if choose:
                choices.append(cand)
            best = np.full((K, self.N), INF)
            if len(a):
                best[:, ends] = np.minimum.reduceat(cand, first, axis=1)
        return best[:, -1].copy(), choices

    def path(self, choices: list[np.ndarray]) -> np.ndarray:
        split, e = np.zeros(len(choices), dtype=int), self.N - 1
        for s in range(len(choices) - 1, -1, -1):  # stage s ends at boundary e: its best arc there
            a, n, _, _ = self.arcs[s]
            at = np.flatnonzero(a + n == e)
            split[s] = n[at[np.argmin(choices[s][0, at])]]
            e -= split[s]
        return split

    def at(self, x: np.ndarray, split: np.ndarray) -> np.ndarray:
        return x[np.arange(len(split)), np.cumsum(split) - split, split]

    def blocks(self, split: np.ndarray) -> list[int]:
        return split.tolist()


def _thresholds(dps: _Sizes | _Arcs, t: np.ndarray, th: np.ndarray, w_max: float, w_sum: float,
                max_dps: int) -> BestSplit:
    """The visit of threshold pairs (the module docstring) over tables ``t``, ``th`` (``inf``
    where a stage cannot take a size) whose DPs ``dps`` runs."""
    sums, choices = dps.dp(t[None], np.add, choose=True)
    total = float(sums[0])
    if not np.isfinite(total):
        return BestSplit(INF, None, INF)
    top, worst = dps.dp(np.stack([t, th]), np.maximum)[0]
    split = dps.path(choices)  # the smallest sum: its cost is the first to beat
    best, pair, bound = float(w_max * dps.at(t, split).max() + w_sum * total + dps.at(th, split).max()), None, INF
    ok = np.isfinite(t)
    taus, thetas = np.unique(t[ok]), np.unique(th[ok])
    thetas = thetas[thetas >= worst]
    for tau in taus[taus >= top]:
        if w_max * tau + w_sum * total + worst >= best:
            break  # no later pair beats the best found
        if max_dps <= 0:
            bound = float(w_max * tau + w_sum * total + worst)  # every pair not visited is above it
            break
        start, size = 0, 1  # thetas in increasing order, in growing batches: each best found prunes the rest
        while start < len(thetas) and max_dps > 0:
            cand = thetas[start:start + size]
            cand = cand[w_max * tau + w_sum * total + cand < best]
            if not len(cand):
                break
            allowed = (t <= tau)[None] & (th[None] <= cand.reshape(-1, *[1] * t.ndim))  # [K, *t.shape]
            sums = dps.dp(np.where(allowed, t[None], INF), np.add)[0]
            max_dps -= 1
            fits = np.isfinite(sums)  # (w_sum may be 0, and 0 * inf is no cost)
            cost = np.where(fits, w_max * tau + w_sum * np.where(fits, sums, 0) + cand, INF)
            k = int(np.argmin(cost))
            if cost[k] < best:
                best, pair = float(cost[k]), (tau, cand[k])
            start, size = start + size, min(4 * size, MAX_ROWS)
        else:
            if start < len(thetas):  # the budget ran out within this tau: the rest, and later taus, are above
                bound = float(w_max * tau + w_sum * total + worst)
                break
    if pair is not None:
        split = dps.path(dps.dp(np.where((t <= pair[0]) & (th <= pair[1]), t, INF)[None], np.add, choose=True)[1])
    value = float(w_max * dps.at(t, split).max() + w_sum * dps.at(t, split).sum() + dps.at(th, split).max())
    return BestSplit(value, dps.blocks(split), min(value, bound))


def _dp(vals: np.ndarray, Q: int, join: np.ufunc, choose: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """A DP over stages for ``K`` tables at once: the smallest ``join_s vals[k, s, q_s]``
    (``np.add``: a sum, ``np.maximum``: a max) over the sizes of the ``P`` stages holding
    ``Q - 1`` chunks together ``[K]``; with ``choose``, per stage the size it takes when the
    stages so far hold ``j`` chunks ``[K, Q]`` (:func:`_path`).

    Args:
        vals: ``[K, P, W]``, ``inf`` where a size is not allowed; no stage holds ``W`` chunks
            or more, so each stage reads a band of ``W`` earlier chunk counts.
        Q: chunk counts ``0..Q-1``.
    """
    K, P, W = vals.shape
    buf = np.full((K, W - 1 + Q), INF)  # W - 1 impossible counts before 0, then the DP's row
    buf[:, W - 1:W - 1 + min(W, Q)] = vals[:, 0, :Q]
    before = sliding_window_view(buf, W, axis=1)  # [K, Q, W]: r -> W - 1 - r chunks before j
    choices = [np.broadcast_to(np.arange(Q), (K, Q))]
    for s in range(1, P):
        cand = join(before, vals[:, s, None, ::-1])  # a stage of W - 1 - r chunks ending at j
        if choose:
            choices.append(W - 1 - np.argmin(cand, axis=2))
        buf[:, W - 1:] = cand.min(axis=2)
    return buf[:, -1].copy(), choices


def _path(choices: list[np.ndarray], Q: int) -> np.ndarray:
    """The chunks of each stage of the first table's split of ``Q - 1`` chunks, from
    :func:`_dp`'s choices."""
    split, j = np.zeros(len(choices), dtype=int), Q - 1
    for s in range(len(choices) - 1, -1, -1):  # stage s ends at chunk j
        split[s] = choices[s][0, j]
        j -= split[s]
    return split


@dataclass(frozen=True)
class UnitsOptimum:
    """One configuration's best split in the CP-SAT model's integer units (:func:`best_split_units`).

    Attributes:
        cost: ``w_max top + w_sum Σ + w_tail tail`` of the best split found.
        bound: a lower bound of every split's: ``cost`` when it is the optimum (almost always).
        split: its blocks per stage.
        top, tail: its slowest stage and its largest tail (unweighted units).
    """

    cost: int
    bound: int
    split: list[int]
    top: int
    tail: int


def best_split_units(tables: StageTables | MixedTables, unit: float, v: int, w_max: int, w_sum: int,
                     w_tail: int, slots: tuple[int, ...] | None = None) -> UnitsOptimum | None:
    """One configuration's best split in the CP-SAT model's own integer units: stage times
    and tails rounded to ``unit`` as :func:`solvers.cpsat._table_stages` (and, with several
    block kinds, :func:`solvers.cpsat._arc_stages`) round them, weighed as
    :func:`solvers.cpsat.build_model` weighs them.  None when no split fits.

    A bound in seconds would reach the model only through a rounding margin (hundreds of
    units) that CP-SAT still had to close by search; this one its solution reaches (when
    the split found is exact), so with the split as a hint the proof is immediate.  Every
    value is an integer far below 2**53, so the float arithmetic is exact.
    """
    time = np.rint(tables.time / unit)
    tail = np.where(np.isfinite(time), w_tail * np.rint(tables.tail / unit), INF)
    mixed = isinstance(tables, MixedTables)
    found = best_arc_split(time, tail, w_max, w_sum) if mixed else best_split(time, tail, v, w_max, w_sum,
                                                                              slots=slots)
    if found.split is None:
        return None
    n = np.asarray(found.split)
    at = (np.arange(len(n)), np.cumsum(n) - n, n) if mixed else (np.arange(len(n)), n)
    return UnitsOptimum(int(found.cost), int(found.bound), found.split, int(time[at].max()),
                        int(np.rint(tables.tail / unit)[at].max()))
