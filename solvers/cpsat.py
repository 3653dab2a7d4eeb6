"""CP-SAT placement search: one integer program over configurations, layer splits and
per-layer recompute, with per-stage memory caps.

The model (:func:`build_model`):

* one Boolean ``x_c`` per configuration kept after bounding (degrees, ZeRO level, offload,
  micro-batch, schedule: the table of valid factorizations replaces nonlinear degree
  products), exactly one true;
* per (pp, vpp) group, shared by its configurations: a one-hot choice ``y[s][q]`` of ``q``
  chunks of ``vpp`` blocks on stage ``s`` (contiguous, uneven allowed, ``Σ vpp q_s = L``);
* per configuration and stage, enforced by ``x_c``: the stage's micro-batch time, its
  once-per-step tail (exposed DP reduction, gathers, optimizer) and its memory within
  capacity, encoded one of two ways --

  - *tables* (one block kind): the best recompute counts for every stage size are known in
    closed form (:mod:`solvers.tables`), so the stage's time and tail are read off the
    ``y`` literals, which exist only for the sizes that fit and can be part of a plan
    within the cap (:func:`solvers.tables.size_limits`);
  - *per-layer* (several block kinds, e.g. dense and MoE blocks): kind counts per stage
    from element constraints on prefix sums, recompute counts ``r[s][k][mode]`` summing to
    them, and memory, time and tail linear in those counts;

* the objective ``D ((m - 1/v) max_s t_s + Σ_s t_s / v + max_s tail_s)`` for time
  (:func:`autoplace.cost.step.pipeline_weights`), or the busiest stage's bytes for comm and
  memory.  ``D`` is the least common multiple of the kept configurations' vpp; every vpp
  divides the block count, so ``D`` does too and every weight is an exact integer.

Coefficients come from :func:`autoplace.cost.terms.stage_terms` (the evaluator's own
tables), in integer units of a recorded scale; memory is rounded conservatively (coefficients
up, capacity down).  Configurations whose sound lower bound exceeds the K-th best known plan
are pruned before the model is built, which never removes an optimum.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoplace.plan import Config
from solvers import _ortools
from solvers.base import Budget, Problem, Solver, SolveResult
from solvers.common import finish
from solvers.space import Scored, Space, enumerate_configs, score_space, to_candidates
from solvers.tables import StageTables, TableBound, bound_many, split_sizes, table_modes

UNITS = 10_000_000  # the slowest stage (or tail) of any kept configuration maps to this many units
SLACK = 1e-6  # relative slack on bounds computed in floating point

Chosen = tuple[Any, list[int], list[Any]]  # (configuration, blocks per stage, recompute counts per stage)


@dataclass
class Built:
    """The CP-SAT model and what is needed to read a solution back."""

    model: Any
    present: dict[int, Any]  # configuration index -> Boolean: its optimum is below the cap
    objective: dict[int, Any]  # configuration index -> its objective (integer units)
    groups: dict[int, dict[str, Any]]  # configuration index -> its split and recompute variables
    unit: float  # seconds or bytes per objective unit
    joint: bool  # every configuration solved at once (else exactly one present)
    read: Callable[[Any, int], Chosen]


def _ceil(x: float) -> int:
    return int(math.ceil(x - 1e-9))


def build_model(problem: Problem, scored: Scored, tables: dict[int, StageTables] | None = None,
                lower: dict[int, float] | None = None, upper: float | None = None, joint: bool = True) -> Built:
    """The integer program over every configuration of ``scored``; per-stage costs from
    ``tables`` (one block kind) or per-layer variables (otherwise).

    Each configuration has its own split and recompute variables and its own objective
    ``o_c``, and the model minimizes ``Σ_c o_c``.  With ``joint`` (the tables encoding, whose
    per-configuration proofs are cheap) every configuration is solved at once: they are
    independent, so one optimal solution holds each one's own optimum and the top-K is read
    off it (one search, not K); a configuration whose optimum is not below the cap (the K-th
    best known plan, ``upper``) may be left absent at the cap's value.  Otherwise exactly one
    configuration is present (the others count 0) and the top-K comes from re-solving without
    the ones found (:func:`_search`).  ``lower`` (per configuration) are sound bounds; both
    are in seconds or bytes and only tighten the search.
    """
    cp_model = _ortools.cp_model()

    t, table, configs = scored.terms, scored.table, scored.configs
    L, K = table.blocks, len(table.kinds)
    keep = range(len(configs))
    time_obj = problem.objective == "time"
    md = cp_model.CpModel()
    D = math.lcm(*(configs[i].vpp for i in keep)) if time_obj else 1
    # an upper bound of any stage's micro-batch time and of any stage's tail
    worst = max(max(float(t.t_static[i].sum(-1).max() + L * t.t_block[i].sum(-1).max()),
                    float((t.reduce_static[i] + t.gather_static[i] + t.opt_static[i]).max()
                          + L * (t.reduce_block[i] + t.gather_block[i] + t.opt_block[i]).max()))
                for i in keep)
    unit = max(worst, 1e-30) / UNITS if time_obj else 1.0  # seconds (or bytes) per integer unit
    top_bound = max(_ceil(2 * worst / unit), 1) if time_obj else 2**50
    m_max = max(configs[i].grad_accum for i in keep)
    rounding = D * (m_max + L + 2)  # the most the objective's rounding to units can move it
    hi = D * (m_max + L + 2) * top_bound if time_obj else 2**50
    cap = min(int(upper * D / unit * (1 + SLACK)) + rounding + 1, hi + 1) if upper is not None and np.isfinite(upper) else hi + 1
    present, objective, groups = {}, {}, {}
    for i in keep:
        cf = configs[i]
        sizes = None if tables is None else split_sizes(tables[i], problem.objective, cf.pp, cf.vpp, problem.fixed_split)
        g = groups[i] = _group(md, (cf.pp, cf.vpp), table.sequence, K, problem.fixed_split, sizes)
        x = present[i] = md.new_bool_var(f"x{i}")
        o = objective[i] = md.new_int_var(0, cap, f"o{i}")
        g["top"] = md.new_int_var(0, top_bound, "")
        g["tail"] = md.new_int_var(0, top_bound, "")
        if tables is not None:
            stages = _table_stages(md, problem, tables[i], g, x, unit)
        else:
            stages = _layer_stages(md, problem, scored, i, g, x, unit)
        for expr in stages:
            md.add(g["top"] >= expr).only_enforce_if(x)
        if time_obj:
            w_max, w_sum = D * cf.grad_accum - D // cf.vpp, D // cf.vpp  # D * pipeline_weights(m, v)
            md.add(o >= w_max * g["top"] + w_sum * sum(stages) + D * g["tail"]).only_enforce_if(x)
        else:
            md.add(o >= g["top"]).only_enforce_if(x)
        if lower is not None and np.isfinite(lower.get(i, np.inf)):
            md.add(o >= int(lower[i] * D / unit * (1 - SLACK)) - rounding).only_enforce_if(x)
        md.add(o == (cap if joint else 0)).only_enforce_if(~x)
    if not joint:
        md.add_exactly_one(present.values())
        if np.isfinite(cap):
            md.add(sum(objective.values()) <= cap)
    md.minimize(sum(objective.values()))

    def read(solver: Any, i: int) -> Chosen:
        cf, g = configs[i], groups[i]
        split = [int(solver.value(q)) * cf.vpp for q in g["q"]]
        if tables is None:
            return cf, split, [[[int(solver.value(v)) for v in kind] for kind in stage] for stage in g["r"]]
        return cf, split, table_modes(tables[i], split)

    return Built(md, present, objective, groups, unit / D, joint, read)


def _group(md: Any, key: tuple[int, int], sequence: tuple[int, ...], K: int,
           fixed_split: tuple[int, ...] | None, sizes: list[list[int]] | None = None) -> dict[str, Any]:
    """Per (pp, vpp) group: the one-hot chunks per stage (only ``sizes[s]`` when given: the
    sizes a configuration's tables allow), and for several block kinds the blocks of each
    kind per stage and the recompute counts of each."""
    P, v = key
    L = len(sequence)
    y, q = [], []
    for s in range(P):
        allowed = list(range(1, L // v - P + 2))
        if fixed_split is not None and len(fixed_split) == P:
            allowed = [fixed_split[s] // v] if fixed_split[s] % v == 0 else []
        if sizes is not None:
            allowed = sizes[s]
        lits = {k: md.new_bool_var("") for k in allowed}
        md.add_exactly_one(lits.values())
        y.append(lits)
        q.append(sum(k * lit for k, lit in lits.items()))
    md.add(sum(q) * v == L)
    g: dict[str, Any] = {"y": y, "q": q, "P": P, "v": v}
    if K == 1:
        return g
    prefix = np.vstack([np.zeros(K, int), np.cumsum(np.eye(K, dtype=int)[list(sequence)], axis=0)])
    bounds = [md.new_int_var(0, L, "") for _ in range(P + 1)]
    md.add(bounds[0] == 0)
    counts = []  # counts[s][k]: blocks of kind k on stage s
    for s in range(P):
        md.add(bounds[s + 1] == bounds[s] + v * q[s])
        row = []
        for k in range(K):
            lo, hi = md.new_int_var(0, L, ""), md.new_int_var(0, L, "")
            md.add_element(bounds[s], [int(n) for n in prefix[:, k]], lo)
            md.add_element(bounds[s + 1], [int(n) for n in prefix[:, k]], hi)
            row.append(hi - lo)
        counts.append(row)
    r = [[[md.new_int_var(0, L, "") for _ in range(3)] for _ in range(K)] for _ in range(P)]
    for s in range(P):
        for k in range(K):
            md.add(sum(r[s][k]) == counts[s][k])
    return {**g, "counts": counts, "r": r}


def _table_stages(md: Any, problem: Problem, tb: StageTables, g: dict[str, Any], x: Any, unit: float) -> list[Any]:
    """One block kind: each stage's objective term and tail read off the chunk literals."""
    v = g["v"]
    main = tb.time if problem.objective == "time" else tb.value
    stages = []
    for s, lits in enumerate(g["y"]):
        value = {q: main[s, q * v] for q in lits}
        for q, lit in lits.items():
            if not np.isfinite(value[q]):  # this stage cannot hold q chunks under this configuration
                md.add_implication(x, ~lit)
        stages.append(sum(int(round(value[q] / unit)) * lit for q, lit in lits.items() if np.isfinite(value[q])))
        if problem.objective == "time":
            md.add(g["tail"] >= sum(int(round(tb.tail[s, q * v] / unit)) * lit for q, lit in lits.items()
                                    if np.isfinite(value[q]))).only_enforce_if(x)
    return stages


def _layer_stages(md: Any, problem: Problem, scored: Scored, i: int, g: dict[str, Any], x: Any,
                  unit: float) -> list[Any]:
    """Several block kinds: memory, host memory, time, tail and bytes linear in the per-stage
    recompute counts; returns each stage's objective term (for memory: each phase's bytes)."""
    t, K = scored.terms, len(scored.table.kinds)
    static, per_block, mult = t.phases
    T = lambda seconds: int(round(float(seconds) / unit))  # noqa: E731 - seconds -> integer units
    out = []
    for s in range(g["P"]):
        cnt, r = g["counts"][s], g["r"][s]
        for f in t.binding_phases(i, g["P"]):
            mem = _ceil(static[i, s, f]) + sum(_ceil(per_block[i, s, f, k]) * cnt[k] for k in range(K)) + sum(
                _ceil(mult[i, s, f] * t.act_block[i, 0, k, mode]) * r[k][mode] for k in range(K) for mode in range(3))
            md.add(mem <= int(t.capacity[i, s])).only_enforce_if(x)
            if problem.objective == "memory":
                out.append(mem)
        if t.host_block[i, s].any() or t.host_static[i, s] > 0:
            md.add(_ceil(t.host_static[i, s]) + sum(_ceil(t.host_block[i, s, k]) * cnt[k] for k in range(K))
                   <= int(t.host_capacity[i, s])).only_enforce_if(x)
        if problem.objective == "comm":
            cb = t.bytes_block[i, 0].sum(-1)  # [K, 3]
            out.append(int(t.bytes_static[i, s].sum()) + sum(int(cb[k, mode]) * r[k][mode]
                                                             for k in range(K) for mode in range(3)))
        if problem.objective != "time":
            continue
        tb = t.t_block[i, s].sum(-1)  # [K, 3]
        out.append(T(t.t_static[i, s].sum()) + sum(T(tb[k, mode]) * r[k][mode] for k in range(K) for mode in range(3)))

        # the tail (autoplace.cost.step.exposed_reduction + gathers + optimizer), k = slowdown:
        # (1 - k) max(reduce - window, min(reduce, last bucket)) + k reduce + rest, as two linear lower bounds
        def lin(st: np.ndarray, block: np.ndarray, w: float = 1.0, s: int = s, cnt: list[Any] = cnt) -> Any:
            return T(w * st[i, s]) + sum(T(w * block[i, s, k]) * cnt[k] for k in range(K))

        kappa = t.slowdown
        rest = lin(t.gather_static + t.opt_static, t.gather_block + t.opt_block)
        bucket = T((1 - kappa) * t.last_bucket[i, s])
        floor = md.new_int_var(0, max(bucket, 0), "")  # min(reduce, last bucket), scaled by 1 - k
        md.add_min_equality(floor, [lin(t.reduce_static, t.reduce_block, 1 - kappa), bucket])
        md.add(g["tail"] >= lin(t.reduce_static, t.reduce_block) - lin(t.window_static, t.window_block, 1 - kappa)
               + rest).only_enforce_if(x)
        md.add(g["tail"] >= floor + lin(t.reduce_static, t.reduce_block, kappa) + rest).only_enforce_if(x)
    return out


@dataclass
class _Search:
    """What the search found: the top-K plans with their model values, best first, the
    status and a sound lower bound of the best objective."""

    found: list[tuple[Chosen, float]] = field(default_factory=list)
    status: str = "infeasible"
    bound: float | None = None


def _search(built: Built, problem: Problem, budget: Budget, deadline: float) -> _Search:
    """The top-K within the deadline: one search of the joint model (:func:`build_model`), or
    solve, forbid the configuration found, solve again -- each later solve knowing its
    optimum is at least the previous one.

    When stopped early, the joint bound is still sound: with current values ``o_c`` and a
    proven bound ``B`` of ``Σ_c o_c``, configuration c's optimum is at least
    ``B - Σ_{c' != c} o_c'``.
    """
    cp_model = _ortools.cp_model()

    out = _Search(status="optimal")
    total = sum(built.objective.values())
    for _ in range(1 if built.joint else problem.top_k):
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(), 0.01)
        solver.parameters.num_workers = budget.workers
        solver.parameters.random_seed = budget.seed
        # presolve probing spends seconds deriving ~10^5 clauses from the one-hot split
        # literals of deep pipelines and never pays for itself here (benchmarks/solve_speed.py)
        solver.parameters.cp_model_probing_level = 0
        code = solver.solve(built.model)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            if not out.found:
                out.status = "infeasible" if code == cp_model.INFEASIBLE else "unknown"
            elif code != cp_model.INFEASIBLE:
                out.status = "feasible"
            break
        if code == cp_model.FEASIBLE:
            out.status = "feasible"
        values = {i: solver.value(o) for i, o in built.objective.items()}
        present = sorted((values[i], i) for i, x in built.present.items() if solver.value(x))
        if out.bound is None:  # exactly one present: the proven bound is the best one's
            proven = (min(solver.best_objective_bound - (sum(values.values()) - v) for v in values.values())
                      if built.joint else solver.best_objective_bound)
            out.bound = max(proven, 0) * built.unit
        out.found.extend((built.read(solver, i), v * built.unit) for v, i in present[: problem.top_k])
        if built.joint or code != cp_model.OPTIMAL:
            break
        i = present[0][1]
        built.model.add(built.present[i] == 0)  # next: the best *other* configuration
        built.model.add(total >= values[i])
    return out


VISIT_BATCH = 256  # configurations whose coefficient tables are built together while bounding
WAVES = (4, 64)  # the first and the most configurations whose stage tables and DPs are built at once


@dataclass
class Bounded:
    """The configurations that may hold a top-K optimum, scored (indexed 0..n-1), with what
    bounding learned: per-configuration lower bounds, a good split of each (the search's
    hint), the best plan seen (the fallback), and the K-th best known plan (the cap)."""

    scored: Scored
    tables: dict[int, StageTables] | None
    lower: dict[int, float]
    splits: dict[int, list[int]]
    modes: dict[int, int]  # uniform recompute mode of the hinted plan (several block kinds)
    best: int | None
    upper: float
    stopped: bool = False  # the deadline passed while bounding


def _bound_with_tables(problem: Problem, space: Space, deadline: float) -> Bounded | None:
    """Tables for every configuration that may hold a top-K optimum (one block kind).

    Configurations are visited in order of their cheap lower bound; each gets its exact
    per-stage tables, a split-DP lower bound and, from its even and bottleneck splits, an
    upper bound.  The visit stops once the cheap bound exceeds the K-th best upper bound;
    configurations whose table bound exceeds it are dropped.  Both bounds are sound, so no
    optimum is lost -- unless the deadline stops the visit, which the result says.  None
    when no configuration can fit.

    Each configuration's tables are built knowing the cap at its turn (the K-th best upper
    bound of the ones before it), a wave of configurations at once
    (:func:`solvers.tables.bound_many`): first all with the cap at the wave's start, then,
    replaying the walk through the wave, the ones whose tables the cap they meet would
    change (:meth:`solvers.tables.TableBound.holds`) again with that cap, until none would.
    The first such configuration always meets its true cap (the ones before it hold), so
    this ends, and each configuration gets the tables, bounds and split of its own turn.
    """
    caps = _Caps(problem.top_k, space.lower_bound)
    kept: dict[int, TableBound] = {}  # by index into space.configs
    stopped, wave = False, WAVES[0]
    for chunk in _by_lower_bound(space, caps.admits):
        rows = [i for i in chunk if caps.within(i)]
        if time.perf_counter() > deadline and kept:
            stopped = True
            break
        batch, j = space.scored(rows), 0
        while j < len(rows) and caps.within(rows[j]):
            ahead = range(j, j + sum(map(caps.within, rows[j:j + wave])))  # a prefix: the bounds go up
            build = dict.fromkeys(ahead, caps.cap)  # the caps to build the tables with
            found: dict[int, TableBound] = {}
            while build:
                found.update(bound_many(batch, list(build), problem.objective, problem.fixed_mode,
                                        list(build.values()), problem.fixed_split))
                walk, build, visited = caps.copy(), {}, []
                for k in ahead:  # the walk, with the upper bounds found so far
                    if not walk.within(rows[k]):
                        break
                    if not found[k].holds(walk.cap):
                        build[k] = walk.cap
                    visited.append(k)
                    if np.isfinite(found[k].lower):
                        walk.add(found[k].upper)
            caps.best = walk.best
            kept.update((rows[k], found[k]) for k in visited if np.isfinite(found[k].lower))
            j, wave = ahead.start + len(visited), min(2 * wave, WAVES[1])
    cap = caps.cap
    rows = [i for i, b in kept.items() if b.lower <= cap * (1 + 1e-9)]
    if not rows:
        return None
    ubs = [kept[i].upper for i in rows]
    best_row = int(np.argmin(ubs)) if rows and np.isfinite(min(ubs)) else None
    return Bounded(space.scored(rows), {j: kept[i].tables for j, i in enumerate(rows)},
                   {j: kept[i].lower for j, i in enumerate(rows)},
                   {j: sp for j, i in enumerate(rows) if (sp := kept[i].split) is not None}, {}, best_row,
                   float(cap), stopped)


class _Caps:
    """The K best upper bounds seen while bounding, and the cap they make (the K-th)."""

    def __init__(self, k: int, lower_bound: np.ndarray, best: list[float] | None = None) -> None:
        self.k, self.lower_bound, self.best = k, lower_bound, best or []  # best: sorted, at most k

    @property
    def cap(self) -> float:
        return self.best[self.k - 1] if len(self.best) >= self.k else np.inf

    def admits(self, bound: float) -> bool:
        """Whether a configuration with this cheap lower bound may beat the cap."""
        return bool(bound <= self.cap * (1 + 1e-9))

    def within(self, i: int) -> bool:
        """Whether configuration ``i`` may beat the cap by its cheap lower bound."""
        return self.admits(self.lower_bound[i])

    def add(self, upper: float) -> None:
        if np.isfinite(upper):
            bisect.insort(self.best, upper)
            del self.best[self.k:]

    def copy(self) -> _Caps:
        return _Caps(self.k, self.lower_bound, list(self.best))


def _by_lower_bound(space: Space, wanted: Callable[[float], bool]) -> Iterator[list[int]]:
    """The configurations that may fit in order of their cheap lower bound (ties in index
    order), VISIT_BATCH at a time, while the next one's bound is ``wanted``.  The visit rarely
    goes past the first few: those are the ones at most the VISIT_BATCH-th smallest bound,
    sorted; the rest only when the smallest of their bounds is wanted."""
    fits = np.flatnonzero(space.memory_lb <= 0)
    lb = space.lower_bound[fits]
    head = np.partition(lb, VISIT_BATCH - 1)[VISIT_BATCH - 1] if len(fits) > VISIT_BATCH else np.inf
    first = lb <= head
    order = fits[first][np.argsort(lb[first], kind="stable")]
    for start in range(0, len(fits), VISIT_BATCH):
        if start + VISIT_BATCH > len(order) < len(fits):  # the rest: every bound larger than the first ones'
            if start >= len(order) and not wanted(float(lb[~first].min())):
                return
            order = np.concatenate([order, fits[~first][np.argsort(lb[~first], kind="stable")]])
        if not wanted(float(space.lower_bound[order[start]])):
            return
        yield order[start:start + VISIT_BATCH].tolist()


def _bound_uniform(problem: Problem, space: Space) -> Bounded | None:
    """Configurations that may hold a top-K optimum (several block kinds): the K-th best plan
    with an even split and one recompute mode everywhere is an upper bound; configurations
    whose sound lower bound exceeds it are dropped.  None when no configuration can fit."""
    best = np.full(len(space.configs), np.inf)
    best_mode = np.zeros(len(space.configs), dtype=int)
    if problem.fixed_split is None:
        for mode in [problem.fixed_mode] if problem.fixed_mode is not None else [0, 1, 2]:
            value, _ = space.uniform(mode)
            best_mode = np.where(value < best, mode, best_mode)
            best = np.minimum(value, best)
    finite = np.sort(best[np.isfinite(best)])
    ub = float(finite[min(problem.top_k, len(finite)) - 1]) if len(finite) else np.inf
    rows = np.flatnonzero((space.memory_lb <= 0) & (space.lower_bound <= ub * (1 + 1e-9))).tolist()
    if not rows:
        return None
    scored = space.scored(rows)
    cand = to_candidates(scored.configs, space.table)
    splits = {j: [int(cand.counts[j, s].sum()) for s in range(cf.pp)]
              for j, cf in enumerate(scored.configs) if np.isfinite(best[rows[j]])}
    fallback = int(np.argmin(best[rows])) if np.isfinite(best[rows]).any() else None
    return Bounded(scored, None, {}, splits, {j: int(best_mode[i]) for j, i in enumerate(rows)}, fallback, ub)


class _Clock:
    """Seconds per phase of one solve; each phase's name goes to the budget's progress."""

    def __init__(self, budget: Budget) -> None:
        self.budget, self.name, self.start = budget, "enumerate", time.perf_counter()
        self.phases: dict[str, float] = {}
        budget.phase(self.name)

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[self.name] = now - self.start
        self.name, self.start = name, now
        self.budget.phase(name)

    def done(self) -> dict[str, float]:
        self.phases[self.name] = time.perf_counter() - self.start
        return dict(self.phases)


class CpSatSolver(Solver):
    """OR-Tools CP-SAT over the whole placement space (the default)."""

    name = "cpsat"

    @classmethod
    def available(cls) -> bool:
        try:
            _ortools.cp_model()
        except ImportError:
            return False
        return True

    def __init__(self) -> None:
        self._configs: dict[tuple[Any, ...], list[Config]] = {}
        self._space: tuple[tuple[Any, ...], Space] | None = None  # the last scored space, by _score's key

    def solve(self, problem: Problem, budget: Budget) -> SolveResult:
        start = time.perf_counter()
        deadline = start + budget.time_limit_s
        clock = _Clock(budget)
        configs = self._enumerate(problem)
        clock("score")
        space = self._score(problem, configs)
        configs = space.configs
        clock("bound")
        one_kind = len(space.table.kinds) == 1
        bounded = _bound_with_tables(problem, space, deadline) if one_kind else _bound_uniform(problem, space)
        notes = [f"{len(configs)} configurations scored, {len(bounded.scored.configs) if bounded else 0} kept "
                 "after bounding"]
        if bounded is None:
            return finish(problem, space, [], "infeasible", bound=None, start=start, n_evaluated=len(configs),
                          notes=notes, phases=clock.done())
        scored = bounded.scored
        clock("build")
        built = build_model(problem, scored, bounded.tables, bounded.lower, bounded.upper, joint=one_kind)
        for j, split in bounded.splits.items():
            self._hint(built, scored, j, split)
        clock("search")
        found = _search(built, problem, budget, deadline)
        chosen = [c for c, _ in found.found]
        status, bound = found.status, found.bound
        if not chosen and bounded.best is not None:  # time ran out before CP-SAT's first solution
            chosen.append(self._fallback(bounded, bounded.best))
            notes.append("the time limit stopped the search before CP-SAT's first solution: "
                         "returning the best plan found while bounding")
            status, bound = "feasible", min(bounded.lower.values(), default=None)
        elif status == "unknown":
            status = "infeasible"
        if bounded.stopped:
            status = "feasible" if chosen else status
            notes.append("the time limit stopped the bounding: configurations not yet visited were not searched")
        notes.append(f"objective scale: 1 unit = {built.unit:.3g} {'s' if problem.objective == 'time' else 'bytes'}")
        values = [v for _, v in found.found]
        size = {"variables": len(built.model.proto.variables), "constraints": len(built.model.proto.constraints)}
        return finish(problem, space, chosen, status, bound=bound, start=start, n_evaluated=len(configs),
                      notes=notes, model_values=values if len(values) == len(chosen) else None,
                      phases=clock.done(), model_size=size)

    @staticmethod
    def _key(problem: Problem) -> tuple[Any, ...]:
        """What enumeration reads: everything but a pinned recompute mode."""
        return (id(problem.model), id(problem.cluster), id(problem.admissible), problem.features, problem.max_mbs,
                tuple(sorted((k, str(v)) for k, v in problem.fixed.items() if k != "recompute")))

    def _enumerate(self, problem: Problem) -> list[Config]:
        """The configurations, shared by this solver's solves that differ only in a pinned
        recompute mode (a framework's uniform-recompute runs): enumeration does not read it."""
        key = self._key(problem)
        if key not in self._configs:
            self._configs = {key: enumerate_configs(problem)}  # keep one: spaces can be large
        return self._configs[key]

    def _score(self, problem: Problem, configs: list[Config]) -> Space:
        """The scored space, shared like the configurations (:meth:`_enumerate`): a solve that
        pins another recompute mode reads its bounds off the last space's summary."""
        # the objects themselves, compared by identity: held here, their ids cannot be reused
        key = (problem.model, problem.cluster, problem.admissible, problem.assumptions)
        if self._space is not None and all(a is b for a, b in zip(self._space[0], key, strict=True)) \
                and self._space[1].configs is configs:
            return self._space[1].for_problem(problem)
        space = score_space(problem, configs)
        self._space = (key, space)
        return space

    @staticmethod
    def _hint(built: Built, scored: Scored, j: int, split: list[int]) -> None:
        """Start CP-SAT from a known good split of configuration ``j``."""
        v = scored.configs[j].vpp
        built.model.add_hint(built.present[j], True)
        for lits, n in zip(built.groups[j]["y"], split, strict=True):
            for q, lit in lits.items():
                built.model.add_hint(lit, q == n // v)

    @staticmethod
    def _fallback(bounded: Bounded, j: int) -> Chosen:
        """Configuration ``j``'s hinted plan as a (configuration, split, recompute counts)."""
        cf, split = bounded.scored.configs[j], bounded.splits[j]
        if bounded.tables is not None:
            return cf, split, table_modes(bounded.tables[j], split)
        counts = to_candidates([cf], bounded.scored.table, mode=bounded.modes.get(j, 0)).counts[0]
        return cf, split, [counts[s].astype(int).tolist() for s in range(cf.pp)]
