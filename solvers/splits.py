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
               max_dps: int = MAX_DPS) -> BestSplit:
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
    """
    none = BestSplit(INF, None, INF)
    P, Q = time.shape[0], (time.shape[1] - 1) // v + 1  # in chunks of v blocks: 0..Q-1 per stage
    if (time.shape[1] - 1) % v:
        return none
    t, th = time[:, ::v], tail[:, ::v]
    ok = np.isfinite(t) & np.isfinite(th) & (np.arange(Q) > 0)
    if not ok.any():
        return none
    W = int(np.flatnonzero(ok.any(0)).max()) + 1  # no stage holds W chunks or more
    t, th = np.where(ok, t, INF)[:, :W], np.where(ok, th, INF)[:, :W]
    sums, choices = _dp(t[None], Q, np.add, choose=True)
    total = float(sums[0])
    if not np.isfinite(total):
        return none
    top, worst = _dp(np.stack([t, th]), Q, np.maximum)[0]
    split = _path(choices, Q)  # the smallest sum: its cost is the first to beat
    s = np.arange(P)
    best, pair, bound = float(w_max * t[s, split].max() + w_sum * total + th[s, split].max()), None, INF
    taus, thetas = np.unique(t[ok[:, :W]]), np.unique(th[ok[:, :W]])
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
            allowed = (t <= tau)[None] & (th[None] <= cand[:, None, None])  # [K, P, W]
            sums = _dp(np.where(allowed, t[None], INF), Q, np.add)[0]
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
        split = _path(_dp(np.where((t <= pair[0]) & (th <= pair[1]), t, INF)[None], Q, np.add, choose=True)[1], Q)
    value = float(w_max * t[s, split].max() + w_sum * t[s, split].sum() + th[s, split].max())
    return BestSplit(value, (split * v).tolist(), min(value, bound))


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


def best_split_units(tables: StageTables, unit: float, v: int, w_max: int, w_sum: int,
                     w_tail: int) -> UnitsOptimum | None:
    """One configuration's best split in the CP-SAT model's own integer units: stage times
    and tails rounded to ``unit`` as :func:`solvers.cpsat._table_stages` rounds them, weighed
    as :func:`solvers.cpsat.build_model` weighs them.  None when no split fits.

    A bound in seconds would reach the model only through a rounding margin (hundreds of
    units) that CP-SAT still had to close by search; this one its solution reaches (when
    :func:`best_split` is exact), so with the split as a hint the proof is immediate.  Every
    value is an integer far below 2**53, so the float arithmetic is exact.
    """
    time = np.rint(tables.time / unit)
    tail = np.rint(tables.tail / unit)
    found = best_split(time, np.where(np.isfinite(time), w_tail * tail, INF), v, w_max, w_sum)
    if found.split is None:
        return None
    s, n = np.arange(len(found.split)), found.split
    return UnitsOptimum(int(found.cost), int(found.bound), found.split, int(time[s, n].max()), int(tail[s, n].max()))
