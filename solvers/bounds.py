"""Sound lower bounds of configurations over all their inner choices (split, recompute).

One scoring pass reduces each configuration's coefficient tables over its stages to a
:class:`Summary` -- a few numbers per configuration and block kind -- from which the bounds
of every recompute mode follow (:meth:`Summary.bounds`): the space bounds each configuration in
each recompute form it may take (:meth:`solvers.space.Space.of`) from one pass over the tables.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from autoplace.cost.candidates import Candidates
from autoplace.cost.layers import LayerTable
from autoplace.cost.step import bubble_shares, pipeline_weights
from autoplace.cost.terms import StageTerms

Array = np.ndarray


class Stages:
    """Which stage entries of a group's [C, S, ...] arrays are real (s < pp): ``where`` is
    ``np.where(mask, x, fill)``, or ``x`` itself when every configuration has S stages (a
    group of one pipeline depth) -- the same values without the copies."""

    def __init__(self, pp: Array, stages: int) -> None:
        self.mask = np.arange(stages)[None, :] < pp[:, None]
        self.full = bool(self.mask.all())

    def where(self, x: Array, fill: float, extra: int = 0) -> Array:
        """``x`` with the stages past each configuration's pp set to ``fill`` (``extra``
        trailing axes of ``x`` beyond [C, S])."""
        return x if self.full else np.where(self.mask[(...,) + (None,) * extra], x, fill)

    def sum(self, x: Array, extra: int = 0) -> Array:
        """``x [C, S, ...]`` summed over the real stages ``[C, ...]``."""
        return _over_stages(np.add, self.where(x, 0.0, extra))

    def min(self, x: Array, extra: int = 0) -> Array:
        """The least of ``x [C, S or 1, ...]`` over the real stages ``[C, ...]``."""
        return x[:, 0] if x.shape[1] == 1 else _over_stages(np.minimum, self.where(x, np.inf, extra))

    def max(self, x: Array, extra: int = 0, fill: float = -np.inf) -> Array:
        """The largest of ``x [C, S or 1, ...]`` over the real stages ``[C, ...]`` (and ``fill``, past pp)."""
        return x[:, 0] if x.shape[1] == 1 else _over_stages(np.maximum, self.where(x, fill, extra))


def _over_stages(op: np.ufunc, x: Array) -> Array:
    """``op.reduce(x, axis=1)`` of ``x [C, S, ...]``.  Over this middle axis (a few entries
    after it) numpy reduces one stage at a time, in order, but several times slower than the
    same loop written out; over a last axis (``x [C, S]``) it sums pairwise, and fast."""
    if x.ndim == 2:
        return op.reduce(x, axis=1)
    return functools.reduce(op, (x[:, s] for s in range(x.shape[1])))


@dataclass(frozen=True)
class Summary:
    """Per configuration (C), block kind (K), recompute mode (3) and memory phase (F), what
    the bounds read, reduced over stages."""

    n_kind: Array  # [K] blocks of each kind
    pp: Array  # [C] pipeline depth, micro-batches and virtual stages (floats)
    ga: Array
    vpp: Array
    share: Array  # [C] the schedule's share of the 1F1B bubble (autoplace.cost.step.BUBBLE_SHARE)
    static_time: Array  # [C] seconds per micro-batch of all stages' static parts
    t_min: Array  # [C, K, 3] seconds per block on the fastest stage, by recompute mode
    recompute: Array  # [C] least recompute seconds any split needs to fit (_recompute_time_lb)
    rest: Array  # [C] gather + optimizer seconds of all stages (each stage's lightest blocks)
    static_mem: Array  # [C, F] static bytes of all stages, and of the fullest one
    static_max: Array
    state: Array  # [C, F, K] state bytes per block on the lightest stage
    mult_min: Array  # [C, F] fewest in-flight micro-batches of any stage
    act: Array  # [C, K, 3] activation bytes per block, by recompute mode
    cap_max: Array  # [C] the largest stage capacity
    comm_static: Array  # [C] and [C, K, 3]: bytes of all stages' static parts, per block by mode
    comm_block: Array
    split_fits: Array  # [C, 3] some split fits with every block in mode 0, 1, 2
    host_fits: Array  # [C] the offloaded states can fit the hosts

    def bounds(self, objective: str, mode: int | None) -> tuple[Array, Array]:
        """(objective lower bound over all inner choices, lower bound of the fullest stage's
        memory minus capacity -- positive when no split can fit) of every configuration, with
        every block in recompute ``mode`` or (None) any mix of modes."""
        n_kind, pp, m = self.n_kind, self.pp, self.ga
        w_max, w_sum = pipeline_weights(m, self.vpp, self.share)
        # time: the sum of stage times is split-independent (up to per-stage hardware: take the fastest)
        total = self.static_time + (self.t_min[..., mode or 0] * n_kind).sum(-1)
        if mode is None:
            total = total + self.recompute
        # the slowest tail is at least the average of the gather + optimizer parts of all stages
        time_lb = w_max * total / pp + w_sum * total + self.rest / pp
        # memory: in every phase the fullest stage holds at least the average of all stages, with
        # the lightest recompute allowed and each stage's lightest coefficients
        act = 2 if mode is None else mode
        mem_all = self.static_mem + (n_kind * (self.state + self.mult_min[..., None] * self.act[:, None, :, act])).sum(-1)
        memory_lb = np.maximum(mem_all / pp[:, None], self.static_max).max(-1)
        comm_none = self.comm_static + (self.comm_block[..., mode or 0] * n_kind).sum(-1)
        lb = {"time": time_lb, "comm": comm_none / pp, "memory": memory_lb}[objective]
        fits = (memory_lb <= self.cap_max) & self.split_fits[:, act] & self.host_fits
        return lb, np.where(fits, memory_lb - self.cap_max, np.maximum(memory_lb - self.cap_max, 1.0))

    @staticmethod
    def stack(parts: list[tuple[Array, Summary]], n: int) -> Summary:
        """One summary of ``n`` configurations from the summaries of groups of them (row indices)."""
        first = parts[0][1]
        out = {}
        for f in dataclasses.fields(Summary):
            if f.name == "n_kind":
                continue
            x = getattr(first, f.name)
            out[f.name] = np.empty((n, *x.shape[1:]), dtype=x.dtype)
            for rows, part in parts:
                out[f.name][rows] = getattr(part, f.name)
        return Summary(n_kind=first.n_kind, **out)


def summarize(table: LayerTable, cand: Candidates, terms: StageTerms) -> Summary:
    """The :class:`Summary` of candidates and their coefficient tables."""
    st = Stages(cand.pp, cand.counts.shape[1])
    t_min = st.min(_shared(terms.t_block).sum(-1), 2)  # [C, K, 3]
    n_kind = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds)).astype(float)
    rest_blocks = st.min(_shared(terms.gather_block) + _shared(terms.opt_block), 1)  # [C, K]
    static, per_block, mult = terms.phases  # [C,S,F], [C,S,F,K], [C,S,F]
    return Summary(
        n_kind=n_kind, pp=cand.pp.astype(float), ga=cand.ga.astype(float), vpp=cand.vpp.astype(float),
        share=bubble_shares(cand.schedule),
        static_time=st.sum(terms.t_static.sum(-1)), t_min=t_min, recompute=_recompute_time_lb(terms, st, n_kind, t_min),
        rest=st.sum(terms.gather_static + terms.opt_static) + (rest_blocks * n_kind).sum(-1),
        static_mem=st.sum(static, 1), static_max=st.max(static, 1, fill=0.0), state=st.min(per_block, 2),
        mult_min=st.min(mult, 1), act=terms.act_block[:, 0], cap_max=st.max(_shared(terms.capacity), fill=0.0),
        comm_static=np.where(st.mask[..., None], terms.bytes_static, 0).sum((1, 2)),
        comm_block=terms.bytes_block[:, 0].sum(-1),
        split_fits=_some_split_fits(terms, st, cand, table.blocks, n_kind),
        host_fits=_host_fits(terms, st, n_kind))


def _host_fits(terms: StageTerms, st: Stages, n_kind: np.ndarray) -> np.ndarray:
    """Whether the offloaded states can fit the hosts: every block on the stage with the least
    host memory per block, and the stages' edges, within the largest host share (necessary)."""
    host_block = st.min(_shared(terms.host_block), 1)  # [C, K]
    mask = st.mask
    total = np.where(mask, terms.host_static, 0).sum(1) + (host_block * n_kind).sum(-1)
    pp = mask.sum(1)
    return total / pp <= np.where(mask, terms.host_capacity, 0).max(1) * (1 + 1e-9)


def _some_split_fits(terms: StageTerms, st: Stages, cand: Candidates, blocks: int, n_kind: np.ndarray) -> np.ndarray:
    """Whether any split can fit with every block in each recompute mode ``[C, 3]`` (full: the
    least memory).

    Stage ``s`` then holds at most ``n_max(s) = (capacity - static) / per_block`` blocks, its
    units (those and its embedding / loss place, ``pp_embedding`` / ``pp_loss``) rounded down to
    a multiple of vpp; a split exists iff every stage can hold vpp units and together they hold
    every block.  With several block kinds the lightest kind is used, which keeps this a
    necessary condition; and the stages must also hold the blocks of each kind alone at that
    kind's bytes (a DeepSeek stack's MoE blocks, not only its few dense ones).
    """
    static, state, mult = terms.phases  # [C, S, F], [C, S, F, K], [C, S, F]
    act = terms.act_block[:, 0]  # [C, K, 3]
    room = _shared(terms.capacity)[..., None] - static  # [C, S, F]
    vpp = cand.vpp
    v = vpp[:, None]
    stage = np.arange(static.shape[1])[None, :]
    slot = ((stage == 0) & cand.pp_embedding[:, None]) + ((stage == cand.pp[:, None] - 1) & cand.pp_loss[:, None])

    def held(per_block: Array) -> Array:
        """Blocks of ``per_block [C, S, F]`` bytes each stage holds, in its tightest phase ``[C, S]``."""
        most = np.full(per_block.shape, float(blocks))
        np.divide(room, per_block, out=most, where=per_block > 0)
        return np.floor(functools.reduce(np.minimum, np.moveaxis(most, -1, 0)))

    # one recompute mode and kind at a time: [C, S, F] arrays numpy runs through in long strides
    # (a [C, S, F, K, 3] array ran three times slower, its inner loops three entries long)
    ok = np.empty((len(vpp), 3), dtype=bool)
    for r in range(3):
        kinds = [state[..., k] + mult * act[:, k, r, None, None] for k in range(len(n_kind))]  # [C, S, F] each
        units = np.floor((np.clip(held(functools.reduce(np.minimum, kinds)), 0, blocks) + slot) / v) * v  # lightest
        ok[:, r] = st.where(units >= v, True).all(1) & (st.where(units - slot, 0).sum(1) >= blocks)
        if len(n_kind) > 1:  # and the blocks of each kind alone, at their own bytes (the others only take room)
            for k, kind in enumerate(kinds):
                ok[:, r] &= st.where(np.floor(np.clip(held(kind), 0, blocks)), 0).sum(1) >= n_kind[k]
    return ok


def _shared(x: Array) -> Array:
    """``x [C, S, ...]``, or its first stage ``[C, 1, ...]`` when every stage is a view of it (a
    cluster of one pool gives every stage the same hardware): reductions over the stages then
    read one stage rather than S copies, with the same result."""
    return x[:, :1] if x.ndim > 1 and x.shape[1] > 1 and x.strides[1] == 0 else x


def _recompute_time_lb(terms: StageTerms, st: Stages, n_kind: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least recompute time any split needs to fit (summed over stages), the largest of the
    bounds :func:`_kind_recompute_lb` finds for the blocks of each kind alone.

    Blocks of the other kinds only take room, and whatever room their recompute frees is
    counted among the items of the fractional knapsacks (every block of every kind, each
    kind's seconds per byte): so the blocks of each kind alone bound the whole from below.
    With several kinds this counts each kind at its own bytes per block; the lightest kind's
    for every block (a DeepSeek stack's few dense layers for its MoE ones) left memory
    pressure, and so the recompute of deep MoE pipelines, almost uncounted.
    """
    static_s, per_block, mult = (x[:, :, 0] for x in terms.phases)  # the start-of-backward phase
    # seconds (``t``: on the fastest stage, [C, K, 3]) and bytes saved per block, per kind and
    # step (none->selective, selective->full)
    act = terms.act_block[:, 0]  # [C, K, 3]
    cost, drop = _hull(np.maximum(t[..., 1:] - t[..., :1], 0.0), np.maximum(act[..., :1] - act[..., 1:], 0.0))
    return functools.reduce(np.maximum, (
        _kind_recompute_lb(terms, st, n_kind, k, static_s, per_block[..., k], mult, cost, drop)
        for k in range(len(n_kind)) if n_kind[k] > 0))


def _hull(cost: np.ndarray, saved: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block's recompute as two knapsack items ``[..., 2]`` (seconds, bytes per in-flight
    micro-batch), from the seconds and bytes of selective and full recompute over none
    ``[..., 2]``: the lower convex hull of (0, 0), selective, full.  Selective first, then the
    upgrade to full, when selective is the better buy; otherwise (it saves nothing, as with
    flash attention) full alone, for its whole price.  Any fraction of a block's recompute
    costs at least the hull's, so the fractional knapsack over these items is a lower bound;
    taking the steps as independent items instead counted the upgrade without its first step.
    """
    (c1, c2), (s1, s2) = np.moveaxis(cost, -1, 0), np.moveaxis(saved, -1, 0)
    s2 = np.maximum(s2, s1)
    both = (s1 > 0) & (c1 * s2 <= c2 * s1)
    return (np.stack([np.where(both, c1, c2), np.where(both, np.maximum(c2 - c1, 0.0), 0.0)], axis=-1),
            np.stack([np.where(both, s1, s2), np.where(both, s2 - s1, 0.0)], axis=-1))


def _kind_recompute_lb(terms: StageTerms, st: Stages, n_kind: np.ndarray, k: int, static_s: np.ndarray,
                       state_k: np.ndarray, mult: np.ndarray, cost: np.ndarray, drop: np.ndarray) -> np.ndarray:
    """Least recompute time for the ``n_kind[k]`` blocks of kind ``k`` to fit, the others
    taking no room (:func:`_recompute_time_lb`): the larger of two fractional knapsacks.

    All stages together must shed at least ``need`` bytes: their memory with no recompute,
    counted optimistically (fewest in-flight micro-batches, lightest stage), minus their total
    capacity.  Each block of each kind offers the two items of :func:`_hull` (bytes saved per
    in-flight micro-batch, for seconds), counted at the most in-flight micro-batches.  Taking the
    cheaper items first, fractionally, bounds the cost of any real choice from below.
    Per stage: blocks beyond what a stage holds with no recompute (``h_s``, fractional) each
    need their bytes shed at that stage's best seconds per byte (its own in-flight count), and
    no stage holds more than fit with every block recomputed: the cheapest stages take them
    first, each up to that (in 1F1B the first stages hold many micro-batches in flight).
    """
    mask = st.mask
    inflight_min, inflight_max = st.where(mult, np.inf).min(1), st.where(mult, 0).max(1)  # [C]
    state = st.where(state_k, np.inf).min(1)  # [C] lightest stage
    a0 = terms.act_block[:, 0, k, 0]
    need = np.maximum(st.where(static_s, 0).sum(1) + n_kind[k] * (state + inflight_min * a0)
                      - st.where(terms.capacity, 0).sum(1), 0.0)
    save = inflight_max[:, None, None] * drop  # [C, K, 2] bytes per block and step
    ratio = np.where(save > 0, cost / np.where(save > 0, save, 1), np.inf).reshape(len(need), -1)  # [C, 2K]
    room = (save * n_kind[None, :, None]).reshape(len(need), -1)
    order = np.argsort(ratio, axis=1, kind="stable")
    ratio, room = np.take_along_axis(ratio, order, 1), np.take_along_axis(room, order, 1)
    before = np.cumsum(room, axis=1) - room
    take = np.clip(need[:, None] - before, 0.0, room)
    with np.errstate(invalid="ignore"):
        knapsack = np.where(take > 0, take * ratio, 0.0).sum(1)
    knapsack = np.nan_to_num(knapsack, posinf=0.0)
    w = state[:, None] + mult * a0[:, None]  # [C, S] bytes per block, no recompute
    w_min = state[:, None] + mult * terms.act_block[:, 0, k].min(-1)[:, None]  # and the least, recomputed
    room_s = np.maximum(terms.capacity - static_s, 0)
    h = np.where(mask, room_s / np.where(w > 0, w, 1), 0.0)  # blocks each stage holds free
    most = np.where(mask, np.minimum(room_s / np.where(w_min > 0, w_min, 1), n_kind[k]), 0.0)  # and at all
    best = ratio[:, 0] * inflight_max  # seconds per byte at one micro-batch in flight, any kind
    price = np.where(mask, w * best[:, None] / np.where(mask, mult, 1), np.inf)  # seconds per block past h_s
    price = np.where(np.isfinite(price), price, 0.0)  # (nothing saves bytes there: no split fits, bound 0)
    # the blocks past what the stages hold free go to the cheapest stages first, each up to what it can hold
    order = np.argsort(price, axis=1, kind="stable")
    price, extra = np.take_along_axis(price, order, 1), np.take_along_axis(np.maximum(most - h, 0.0), order, 1)
    excess = np.maximum(n_kind[k] - h.sum(1), 0.0)
    placed = np.clip(excess[:, None] - (np.cumsum(extra, axis=1) - extra), 0.0, extra)
    return np.maximum(knapsack, (placed * price).sum(1))
