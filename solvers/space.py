"""The placement space: every valid configuration of degrees, sharding, offload, micro-batch
and schedule, scored in one vectorized pass, with sound bounds for pruning.

A *configuration* fixes everything but the per-layer decisions (the layer-to-stage split and
each block's recompute mode); those are what CP-SAT decides per configuration.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplace.cost.candidates import Candidates, pack
from autoplace.cost.evaluate import evaluate_batch
from autoplace.cost.layers import LayerTable, layer_table
from autoplace.cost.terms import StageTerms, stage_terms
from autoplace.errors import Infeasible, SpecError
from autoplace.plan import RECOMPUTE, Config, Plan, even_split
from autoplace.specs.model import TransformerSpec
from solvers.problem import Problem


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(problem: Problem) -> list[Config]:
    """Every configuration the rules allow, honouring ``problem.fixed``.

    Raises:
        Infeasible: when the fixed keys leave nothing (with the reason).
    """
    m, c, fx, feat = problem.model, problem.cluster, problem.fixed, problem.features
    table = layer_table(m)
    W, G, L, B = c.gpus, c.nvlink_domain, table.blocks, m.training.global_batch  # G: GPUs on one NVLink fabric
    seq = table.seq_len

    def allowed(key: str, values: list[int]) -> list[int]:
        return [v for v in values if v == fx[key]] if key in fx else values

    tps = allowed("tp", [t for t in _divisors(W) if t <= G or "tp-across-nodes" in feat])
    if isinstance(m, TransformerSpec):
        tps = [t for t in tps if m.heads % t == 0 and m.ffn_hidden % t == 0
               and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)]
    cps = allowed("cp", [x for x in _divisors(W) if x == 1 or ("cp" in feat and x <= 16 and seq % (2 * x) == 0)])
    experts = m.moe.experts if isinstance(m, TransformerSpec) and m.moe else 1
    out: list[Config] = []
    for tp, cp in itertools.product(tps, cps):
        if W % (tp * cp):
            continue
        for pp in allowed("pp", [p for p in _divisors(W // (tp * cp)) if p <= L]):
            dp = W // (tp * cp * pp)
            if "dp" in fx and fx["dp"] != dp:
                continue
            if B % dp or (tp > 1 and (seq // cp) % tp):
                continue
            eps = allowed("ep", [e for e in _divisors(experts) if (dp * cp) % e == 0 and (e == 1 or "ep" in feat)])
            for ep, zero in itertools.product(eps, allowed("zero", [0, 1, 2, 3])):
                for dp_rep, dp_shard in _dp_splits(dp, zero, G // (tp * cp) if tp * cp <= G else 1, fx, feat):
                    out.extend(_micro(problem, L, B, dp, Config(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_rep,
                                                                dp_shard=dp_shard, sp=tp > 1, zero=zero)))
    if problem.admissible is not None:
        out = [config for config in out if problem.admissible(config)]
    if not out:
        raise Infeasible("no configuration satisfies the fixed keys and the composition rules "
                         f"({', '.join(f'{k}={v}' for k, v in fx.items()) or 'no keys fixed'}; {W} GPUs, {L} layers)")
    return out


def _dp_splits(dp: int, zero: int, node_dp: int, fx: dict[str, Any], feat: frozenset[str]) -> list[tuple[int, int]]:
    if zero == 0:
        splits = [(dp, 1)]
    else:
        splits = [(1, dp)]
        if zero == 3 and "hsdp" in feat and 1 < node_dp < dp and dp % node_dp == 0:
            splits.append((dp // node_dp, node_dp))
    return [(r, s) for r, s in splits
            if fx.get("dp_replicate", r) == r and fx.get("dp_shard", s) == s]


def _micro(problem: Problem, L: int, B: int, dp: int, base: Config) -> list[Config]:
    """The micro-batching, interleaving and offload choices of one set of degrees: every
    micro-batch that divides the per-replica batch (``Problem.max_mbs`` caps it when set), every
    interleave ``v`` that divides the blocks into ``v`` chunks per stage, with the micro-batches a
    multiple of pp (Megatron-LM's and PyTorch's interleaved schedules require it)."""
    fx, feat, pp = problem.fixed, problem.features, base.pp
    degrees = {k: getattr(base, k) for k in ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "sp", "zero")}
    out = []
    per_replica = B // dp
    mbss = [b for b in _divisors(per_replica) if problem.max_mbs is None or b <= problem.max_mbs]
    if "mbs" in fx:
        mbss = [fx["mbs"]] if per_replica % fx["mbs"] == 0 else []
    vpps = [1] + ([v for v in _divisors(L)[1:] if pp > 1 and L // v >= pp] if "interleave" in feat else [])
    if "vpp" in fx:
        vpps = [fx["vpp"]] if fx["vpp"] == 1 or (pp > 1 and L % fx["vpp"] == 0 and L // fx["vpp"] >= pp) else []
    offs_opt = ["none", "cpu"] if ("offload" in feat and base.zero >= 1) else ["none"]
    offs_par = ["none", "cpu"] if ("offload" in feat and base.zero == 3) else ["none"]
    for mbs, vpp in itertools.product(mbss, vpps):
        ga = per_replica // mbs
        if vpp > 1 and ga % pp:
            continue
        schedule = "interleaved" if vpp > 1 else fx.get("schedule", "1f1b")
        if fx.get("schedule", schedule) != schedule:
            continue
        for oo, op in itertools.product(offs_opt, offs_par):
            if fx.get("offload_optimizer", oo) != oo or fx.get("offload_params", op) != op:
                continue
            out.append(Config(**degrees, mbs=mbs, grad_accum=ga, vpp=vpp, schedule=schedule,
                              offload_optimizer=oo, offload_params=op))
    return out


def to_candidates(configs: list[Config], table: LayerTable, mode: int = 0) -> Candidates:
    """Configurations as arrays, each with an even split and one recompute mode everywhere."""
    S = max(cf.pp for cf in configs)
    K = len(table.kinds)
    counts = np.zeros((len(configs), S, K, 3))
    seq = np.asarray(table.sequence)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, cf in enumerate(configs):
        groups.setdefault((cf.pp, cf.vpp), []).append(i)
    for (pp, vpp), rows in groups.items():  # one even split per (pp, vpp), shared by its configurations
        grid = np.zeros((S, K))
        start = 0
        for s, n in enumerate(even_split(table.blocks // vpp, pp)):
            n *= vpp
            grid[s] = np.bincount(seq[start:start + n], minlength=K)
            start += n
        grid[pp - 1] += np.bincount(seq[start:], minlength=K)  # remainder of L % vpp
        counts[rows, :, :, mode] = grid

    return pack(configs, counts)


@dataclass(frozen=True)
class Scored:
    """Configurations with their coefficient tables (:func:`autoplace.cost.terms.stage_terms`),
    indexed 0..len-1: what the searches read."""

    configs: list[Config]
    table: LayerTable
    terms: StageTerms


GROUP_ROWS = 4096  # configurations scored per numpy pass (bounds the arrays' size)


@dataclass(frozen=True)
class Space:
    """The whole space bounded: every configuration and its sound lower bounds.  Coefficient
    tables are built on demand for the few configurations a search visits (:meth:`scored`),
    so the [configurations x stages] arrays of the whole space are never held at once."""

    problem: Problem
    configs: list[Config]
    table: LayerTable
    lower_bound: np.ndarray  # [C] objective lower bound over all inner choices
    memory_lb: np.ndarray  # [C] lower bound of the fullest stage's memory minus capacity (> 0: cannot fit)

    def scored(self, rows: Sequence[int]) -> Scored:
        """The configurations ``rows`` with their coefficient tables (re-indexed in that order)."""
        rows = list(rows)
        configs = [self.configs[i] for i in rows]
        return Scored(configs, self.table, _terms(self.problem, configs, self.table))

    def uniform(self, mode: int) -> tuple[np.ndarray, np.ndarray]:
        """Every configuration with an even split and recompute ``mode`` on every block, by the
        evaluator: (objective value, inf where it does not fit; memory or host shortfall)."""
        value, short = np.full(len(self.configs), np.inf), np.zeros(len(self.configs))
        p = self.problem
        for rows in _groups(self.configs):
            b = evaluate_batch(self.table, p.cluster, to_candidates([self.configs[i] for i in rows], self.table, mode),
                               p.model.training.recipe(), p.assumptions)
            objective = {"time": b.step_time, "comm": b.comm_total, "memory": b.peak_memory}[p.objective]
            value[rows] = np.where(b.fits, objective, np.inf)
            short[rows] = np.maximum(b.shortfall, b.host_shortfall)
        return value, short


def _groups(configs: list[Config]) -> list[np.ndarray]:
    """Row indices by pipeline depth (so stage arrays are as deep as the group's pp), in
    chunks of at most GROUP_ROWS."""
    pp = np.array([cf.pp for cf in configs])
    out: list[np.ndarray] = []
    for depth in np.unique(pp):
        rows = np.flatnonzero(pp == depth)
        out.extend(rows[k:k + GROUP_ROWS] for k in range(0, len(rows), GROUP_ROWS))
    return out


def _terms(problem: Problem, configs: list[Config], table: LayerTable, cand: Candidates | None = None) -> StageTerms:
    return stage_terms(table, problem.cluster, to_candidates(configs, table) if cand is None else cand,
                       problem.model.training.recipe(), problem.assumptions)


def score_space(problem: Problem, configs: list[Config]) -> Space:
    """Sound lower bounds of every configuration, scored group by group (:func:`_groups`),
    for the recompute mode the problem pins (if any)."""
    return score_spaces([problem], configs)[0]


def score_spaces(problems: Sequence[Problem], configs: list[Config]) -> list[Space]:
    """:func:`score_space` of problems that differ only in the recompute mode they pin (a
    framework's uniform-recompute runs): the coefficient tables, which do not depend on it,
    are built once for all of them."""
    table = layer_table(problems[0].model)
    lower, memory = np.empty((len(problems), len(configs))), np.empty((len(problems), len(configs)))
    for rows in _groups(configs):
        group = [configs[i] for i in rows]
        cand = to_candidates(group, table)
        terms = _terms(problems[0], group, table, cand)
        t_block = terms.t_block.sum(-1)  # [C, S, K, 3]: read by every problem's bounds
        for k, problem in enumerate(problems):
            lower[k, rows], memory[k, rows] = _bounds(problem, table, cand, terms, problem.fixed_mode, t_block)
    return [Space(problem, configs, table, lower[k], memory[k]) for k, problem in enumerate(problems)]


class _Stages:
    """Which stage entries of a group's [C, S, ...] arrays are real (s < pp): ``where`` is
    ``np.where(mask, x, fill)``, or ``x`` itself when every configuration has S stages (a
    group of one pipeline depth, :func:`_groups`) -- the same values without the copies."""

    def __init__(self, pp: np.ndarray, stages: int) -> None:
        self.mask = np.arange(stages)[None, :] < pp[:, None]
        self.full = bool(self.mask.all())

    def where(self, x: np.ndarray, fill: float, extra: int = 0) -> np.ndarray:
        """``x`` with the stages past each configuration's pp set to ``fill`` (``extra``
        trailing axes of ``x`` beyond [C, S])."""
        return x if self.full else np.where(self.mask[(...,) + (None,) * extra], x, fill)


def _bounds(problem: Problem, table: LayerTable, cand: Candidates, terms: StageTerms,
            mode: int | None, t_sum: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(objective lower bound over all inner choices, lower bound of the fullest stage's
    memory minus capacity -- positive when no split can fit) of every candidate, with every
    block in recompute ``mode`` or (None) any mix of modes; ``t_sum`` is
    ``terms.t_block.sum(-1)`` when the caller has it."""
    pp = cand.pp.astype(float)
    st = _Stages(cand.pp, cand.counts.shape[1])
    mask = st.mask
    t_sum = terms.t_block.sum(-1) if t_sum is None else t_sum  # [C, S, K, 3]
    n_kind = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds)).astype(float)
    # time: the sum of stage times is split-independent (up to per-stage hardware: take the fastest)
    t_block = st.where(t_sum[..., mode or 0], np.inf, 1).min(axis=1)  # [C, K]
    total = (st.where(terms.t_static.sum(-1), 0).sum(1) + (t_block * n_kind).sum(-1))
    m, v = cand.ga.astype(float), cand.vpp.astype(float)
    if mode is None:
        total = total + _recompute_time_lb(terms, st, n_kind, t_sum)
    # the slowest tail is at least the average of the gather + optimizer parts of all stages
    rest_blocks = np.where(mask[..., None], terms.gather_block + terms.opt_block, np.inf).min(axis=1)  # [C, K]
    rest = np.where(mask, terms.gather_static + terms.opt_static, 0).sum(1) + (rest_blocks * n_kind).sum(-1)
    time_lb = (m - 1 / v) * total / pp + total / v + rest / pp
    # memory: in every phase the fullest stage holds at least the average of all stages, with
    # the lightest recompute allowed and each stage's lightest coefficients
    act = 2 if mode is None else mode
    static, per_block, mult = terms.phases  # [C,S,F], [C,S,F,K], [C,S,F]
    state = st.where(per_block, np.inf, 2).min(1)  # [C, F, K]
    mult_min = st.where(mult, np.inf, 1).min(1)  # [C, F]
    static_real = st.where(static, 0, 1)
    mem_all = (static_real.sum(1)
               + (n_kind * (state + mult_min[..., None] * terms.act_block[:, 0, None, :, act])).sum(-1))
    cap_max = st.where(terms.capacity, 0).max(1)
    memory_lb = np.maximum(mem_all / pp[:, None], static_real.max(1)).max(-1)
    comm_none = np.where(mask[..., None], terms.bytes_static, 0).sum((1, 2)) + (
        terms.bytes_block[:, 0, :, mode or 0].sum(-1) * n_kind).sum(-1)
    lb = {"time": time_lb, "comm": comm_none / pp, "memory": memory_lb}[problem.objective]
    fits = ((memory_lb <= cap_max) & _some_split_fits(terms, mask, cand.vpp, table.blocks, act)
            & _host_fits(terms, mask, n_kind))
    return lb, np.where(fits, memory_lb - cap_max, np.maximum(memory_lb - cap_max, 1.0))


def _host_fits(terms: StageTerms, mask: np.ndarray, n_kind: np.ndarray) -> np.ndarray:
    """Whether the offloaded states can fit the hosts: every block on the stage with the least
    host memory per block, and the stages' edges, within the largest host share (necessary)."""
    host_block = np.where(mask[..., None], terms.host_block, np.inf).min(1)  # [C, K]
    total = np.where(mask, terms.host_static, 0).sum(1) + (host_block * n_kind).sum(-1)
    pp = mask.sum(1)
    return total / pp <= np.where(mask, terms.host_capacity, 0).max(1) * (1 + 1e-9)


def _some_split_fits(terms: StageTerms, mask: np.ndarray, vpp: np.ndarray, blocks: int, act: int) -> np.ndarray:
    """Whether any split can fit, with every block in recompute mode ``act`` (full: the least memory).

    Stage ``s`` then holds at most ``n_max(s) = (capacity - static) / per_block`` blocks
    (rounded down to a multiple of vpp); a split exists iff every stage can hold vpp blocks
    and together they hold all of them.  With several block kinds the lightest kind is used,
    which keeps this a necessary condition.
    """
    static, state, mult = terms.phases
    per_block = (state + mult[..., None] * terms.act_block[:, 0, None, None, :, act]).min(-1)  # [C, S, F]
    room = terms.capacity[..., None] - static
    n_max = np.floor(np.where(per_block > 0, room / np.where(per_block > 0, per_block, 1), blocks)).min(-1)
    n_max = np.floor(np.clip(n_max, 0, blocks) / vpp[:, None]) * vpp[:, None]
    ok = np.where(mask, n_max >= vpp[:, None], True).all(1)
    return ok & (np.where(mask, n_max, 0).sum(1) >= blocks)


def _recompute_time_lb(terms: StageTerms, st: _Stages, n_kind: np.ndarray, t_sum: np.ndarray) -> np.ndarray:
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


def plan_from(config: Config, table: LayerTable, split: list[int], modes: list[list[list[int]]]) -> Plan:
    """The Plan of a configuration, a split (blocks per stage) and recompute counts
    ``modes[stage][kind] = [none, selective, full]``: full recompute goes to the first blocks
    of a stage (Megatron's ``--recompute-method block``), then selective, then none."""
    if any(x < 0 for row in modes for kind in row for x in kind):
        raise SpecError("negative recompute count")
    recompute: list[str] = []
    start = 0
    for s, n in enumerate(split):
        left = [list(modes[s][k]) for k in range(len(table.kinds))]
        for i in range(start, start + n):
            k = table.sequence[i]
            r = 2 if left[k][2] else (1 if left[k][1] else 0)
            left[k][r] -= 1
            recompute.append(RECOMPUTE[r])
        start += n
    return config.to_plan(split, recompute)
