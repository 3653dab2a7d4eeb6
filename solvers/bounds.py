"""Sound lower bounds of configurations over all their inner choices (split, recompute).

One scoring pass reduces each configuration's coefficient tables over its stages to a
:class:`Summary` -- a few numbers per configuration and block kind -- from which the bounds
of every recompute mode follow (:meth:`Summary.bounds`).  A solve that pins another mode
(a framework's uniform-recompute runs) then needs no second pass over the tables.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from autoplace.cost.candidates import Candidates
from autoplace.cost.layers import LayerTable
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


@dataclass(frozen=True)
class Summary:
    """Per configuration (C), block kind (K), recompute mode (3) and memory phase (F), what
    the bounds read, reduced over stages."""

    n_kind: Array  # [K] blocks of each kind
    pp: Array  # [C] pipeline depth, micro-batches and virtual stages (floats)
    ga: Array
    vpp: Array
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
        n_kind, pp, m, v = self.n_kind, self.pp, self.ga, self.vpp
        # time: the sum of stage times is split-independent (up to per-stage hardware: take the fastest)
        total = self.static_time + (self.t_min[..., mode or 0] * n_kind).sum(-1)
        if mode is None:
            total = total + self.recompute
        # the slowest tail is at least the average of the gather + optimizer parts of all stages
        time_lb = (m - 1 / v) * total / pp + total / v + self.rest / pp
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
    mask = st.mask
    t_sum = _shared(terms.t_block).sum(-1)  # [C, S or 1, K, 3]
    n_kind = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds)).astype(float)
    rest_blocks = np.where(mask[..., None], terms.gather_block + terms.opt_block, np.inf).min(axis=1)  # [C, K]
    static, per_block, mult = terms.phases  # [C,S,F], [C,S,F,K], [C,S,F]
    static_real = st.where(static, 0, 1)
    return Summary(
        n_kind=n_kind, pp=cand.pp.astype(float), ga=cand.ga.astype(float), vpp=cand.vpp.astype(float),
        static_time=st.where(terms.t_static.sum(-1), 0).sum(1), t_min=st.where(t_sum, np.inf, 2).min(axis=1),
        recompute=_recompute_time_lb(terms, st, n_kind, t_sum),
        rest=np.where(mask, terms.gather_static + terms.opt_static, 0).sum(1) + (rest_blocks * n_kind).sum(-1),
        static_mem=static_real.sum(1), static_max=static_real.max(1), state=st.where(per_block, np.inf, 2).min(1),
        mult_min=st.where(mult, np.inf, 1).min(1), act=terms.act_block[:, 0], cap_max=st.where(_shared(terms.capacity), 0).max(1),
        comm_static=np.where(mask[..., None], terms.bytes_static, 0).sum((1, 2)),
        comm_block=terms.bytes_block[:, 0].sum(-1),
        split_fits=_some_split_fits(terms, st, cand.vpp, table.blocks),
        host_fits=_host_fits(terms, mask, n_kind))


def _host_fits(terms: StageTerms, mask: np.ndarray, n_kind: np.ndarray) -> np.ndarray:
    """Whether the offloaded states can fit the hosts: every block on the stage with the least
    host memory per block, and the stages' edges, within the largest host share (necessary)."""
    host_block = np.where(mask[..., None], terms.host_block, np.inf).min(1)  # [C, K]
    total = np.where(mask, terms.host_static, 0).sum(1) + (host_block * n_kind).sum(-1)
    pp = mask.sum(1)
    return total / pp <= np.where(mask, terms.host_capacity, 0).max(1) * (1 + 1e-9)


def _some_split_fits(terms: StageTerms, st: Stages, vpp: np.ndarray, blocks: int) -> np.ndarray:
    """Whether any split can fit with every block in each recompute mode ``[C, 3]`` (full: the
    least memory).

    Stage ``s`` then holds at most ``n_max(s) = (capacity - static) / per_block`` blocks
    (rounded down to a multiple of vpp); a split exists iff every stage can hold vpp blocks
    and together they hold all of them.  With several block kinds the lightest kind is used,
    which keeps this a necessary condition.
    """
    static, state, mult = terms.phases
    act = terms.act_block[:, 0, None, None]  # [C, 1, 1, K, 3]
    per_block = (state[..., None] + mult[..., None, None] * act).min(-2)  # [C, S, F, 3]
    room = (_shared(terms.capacity)[..., None] - static)[..., None]
    n_max = np.full(np.broadcast_shapes(room.shape, per_block.shape), float(blocks))
    np.divide(room, per_block, out=n_max, where=per_block > 0)
    n_max = np.floor(functools.reduce(np.minimum, np.moveaxis(n_max, -2, 0)))  # [C, S, 3]: the tightest phase
    v = vpp[:, None, None]
    n_max = np.floor(np.clip(n_max, 0, blocks) / v) * v
    ok = st.where(n_max >= v, True, 1).all(1)
    return ok & (st.where(n_max, 0, 1).sum(1) >= blocks)


def _shared(x: Array) -> Array:
    """``x [C, S, ...]``, or its first stage ``[C, 1, ...]`` when every stage is a view of it (a
    cluster of one pool gives every stage the same hardware): reductions over the stages then
    read one stage rather than S copies, with the same result."""
    return x[:, :1] if x.ndim > 1 and x.shape[1] > 1 and x.strides[1] == 0 else x


def _recompute_time_lb(terms: StageTerms, st: Stages, n_kind: np.ndarray, t_sum: np.ndarray) -> np.ndarray:
    """Least recompute time any split needs to fit (summed over stages): a fractional knapsack.

    All stages together must shed at least ``need`` bytes: their memory with no recompute,
    counted optimistically (fewest in-flight micro-batches, lightest blocks), minus their
    total capacity.  Each block offers two items: selective recompute (saves ``a0 - a1`` per
    in-flight micro-batch for ``t1 - t0`` seconds) and the upgrade to full (``a1 - a2`` for
    ``t2 - t1``), counted at the most in-flight micro-batches and the cheapest kind.  Taking
    the cheaper item first, fractionally, bounds the cost of any real choice from below.
    """
    L = n_kind.sum()
    # the start-of-backward phase alone (a necessary condition; it holds the most activations)
    mask = st.mask
    static_s, per_block, mult = (x[:, :, 0] for x in terms.phases)
    inflight_min = st.where(mult, np.inf).min(1)  # [C]
    inflight_max = st.where(mult, 0).max(1)
    state = st.where(per_block, np.inf, 1).min(axis=(1, 2))  # [C] lightest kind and stage
    act = terms.act_block[:, 0].min(1)  # [C, 3]
    static = st.where(static_s, 0).sum(1)
    need = np.maximum(static + L * (state + inflight_min * act[:, 0]) - st.where(terms.capacity, 0).sum(1), 0.0)
    t = st.where(t_sum, np.inf, 2).min(axis=(1, 2))  # [C, 3] fastest
    save = inflight_max[:, None] * np.stack([act[:, 0] - act[:, 1], act[:, 1] - act[:, 2]], axis=-1)  # [C, 2]
    cost = np.maximum(np.stack([t[:, 1] - t[:, 0], t[:, 2] - t[:, 1]], axis=-1), 0.0)
    ratio = np.where(save > 0, cost / np.where(save > 0, save, 1), np.inf)
    first = np.argmin(ratio, axis=1)
    rows = np.arange(len(need))
    cap_a, cap_b = L * save[rows, first], L * save[rows, 1 - first]
    r_a, r_b = ratio[rows, first], ratio[rows, 1 - first]
    take_a = np.minimum(need, cap_a)
    take_b = np.minimum(np.maximum(need - cap_a, 0.0), cap_b)
    with np.errstate(invalid="ignore"):
        knapsack = np.nan_to_num(take_a * r_a, posinf=0.0) + np.nan_to_num(take_b * r_b, posinf=0.0)
    # per stage: blocks beyond what a stage holds with no recompute (h_s, fractional) each
    # need w_s bytes shed at that stage's best seconds per byte (its own in-flight count)
    w = state[:, None] + mult * act[:, :1]  # [C, S]
    h = np.where(mask, np.maximum(terms.capacity - static_s, 0) / np.where(w > 0, w, 1), 0.0)
    excess = np.maximum(L - h.sum(1), 0.0)
    best = np.where(save > 0, cost / np.where(save > 0, save, 1), np.inf).min(1) * inflight_max  # s per byte at I=1
    per_block_s = np.where(mask, w * best[:, None] / np.where(mask, mult, 1), np.inf).min(1)
    stage = np.where(excess > 0, excess * np.where(np.isfinite(per_block_s), per_block_s, 0.0), 0.0)
    return np.maximum(knapsack, stage)
