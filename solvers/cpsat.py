"""CP-SAT placement search: one integer program over configurations, layer splits and
per-layer recompute, with per-stage memory caps.

Model (``build_model``):

* one Boolean per configuration (degrees, ZeRO level, offload, micro-batch, schedule; the
  table of valid factorizations replaces nonlinear degree products), exactly one true;
* per (pp, vpp) group: blocks per stage ``n_s = vpp * q_s`` (contiguous, uneven allowed),
  blocks of each kind per stage (element constraints on prefix counts), and recompute counts
  ``r[s,k,mode]`` summing to them -- the per-layer decisions;
* for each configuration, enforced by its Boolean: every stage's memory <= capacity, stage
  micro-batch times, the exposed DP tail, and the objective bound.

Coefficients come from :func:`autoplace.cost.terms.stage_terms` (the evaluator's own tables),
scaled to integers with a recorded scale; configurations whose sound lower bound exceeds the
K-th best uniform plan are pruned first, which never removes an optimum.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoplace.cost.evaluate import evaluate_batch
from autoplace.cost.step import pipeline_weights
from autoplace.plan import even_split
from solvers.base import Budget, Problem, Solver, SolveResult
from solvers.common import finish
from solvers.cpsat_tables import build_table_model, read_solution
from solvers.space import Scored, enumerate_configs, score_space, to_candidates
from solvers.tables import StageTables, split_bounds, split_value, stage_tables

LCM_VPP = 12  # lcm(1, 2, 3, 4): keeps (Σt - max)/v integral for every vpp we search


@dataclass
class Built:
    """The CP-SAT model and the handles needed to read a solution back."""

    model: Any
    chosen: dict[int, Any]  # config index -> Boolean
    groups: dict[tuple[int, int], dict[str, Any]]
    objective: Any
    time_scale_s: float  # seconds per integer time unit
    notes: list[str] = field(default_factory=list)


def _ceil(x: float) -> int:
    return int(math.ceil(x - 1e-9))


def build_model(problem: Problem, scored: Scored, keep: list[int]) -> Built:
    """Build the integer program over the configurations ``keep``."""
    from ortools.sat.python import cp_model

    t, table = scored.terms, scored.table
    L, K = table.blocks, len(table.kinds)
    md = cp_model.CpModel()
    # time unit: the slowest stage micro-batch among kept configs maps to ~1e8 units
    worst = max(float(t.t_static[i].sum(-1).max() + L * t.t_block[i].sum(-1).max()) for i in keep)
    tail_worst = max(float((t.reduce_static[i] + t.gather_static[i] + t.opt_static[i]).max()
                           + L * (t.reduce_block[i] + t.gather_block[i] + t.opt_block[i]).max()) for i in keep)
    unit = max(worst, tail_worst, 1e-12) / 1e8
    T = lambda x: int(round(float(x) / unit))  # noqa: E731 - seconds -> integer units
    fixed_mode = ["none", "selective", "full"].index(problem.fixed["recompute"]) if "recompute" in problem.fixed else None
    fixed_split = tuple(int(x) for x in str(problem.fixed["layers"]).split(":")) if "layers" in problem.fixed else None
    prefix = np.vstack([np.zeros(K, int), np.cumsum(np.eye(K, dtype=int)[list(table.sequence)], axis=0)])
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for i in keep:
        key = (scored.configs[i]["pp"], scored.configs[i]["vpp"])
        if key not in groups:
            groups[key] = _stage_vars(md, key, L, K, prefix, fixed_mode, fixed_split, int(1e8 * 4))
    chosen = {i: md.new_bool_var(f"x{i}") for i in keep}
    md.add_exactly_one(chosen.values())
    horizon = int(LCM_VPP * (max(scored.configs[i]["ga"] for i in keep) + 1) * 4e8 * 2)
    obj = md.new_int_var(0, max(horizon, int(4e15)), "objective")
    for i in keep:
        _config_constraints(md, problem, scored, i, groups[(scored.configs[i]["pp"], scored.configs[i]["vpp"])],
                            chosen[i], obj, T)
    md.minimize(obj)
    return Built(md, chosen, groups, obj, unit)


def _stage_vars(md: Any, key: tuple[int, int], L: int, K: int, prefix: np.ndarray, fixed_mode: int | None,
                fixed_split: tuple[int, ...] | None, tmax: int) -> dict[str, Any]:
    P, v = key
    tag = f"p{P}v{v}"
    q = [md.new_int_var(1, L // v, f"{tag}_q{s}") for s in range(P)]
    n = [qq * v for qq in q]
    md.add(sum(q) * v == L)
    if fixed_split is not None and len(fixed_split) == P:
        for s in range(P):
            md.add(n[s] == fixed_split[s])
    bounds = [md.new_int_var(0, L, f"{tag}_b{s}") for s in range(P + 1)]
    md.add(bounds[0] == 0)
    for s in range(P):
        md.add(bounds[s + 1] == bounds[s] + n[s])
    counts = []  # counts[s][k]
    for s in range(P):
        if K == 1:
            counts.append([n[s]])
            continue
        row = []
        for k in range(K):
            lo, hi = md.new_int_var(0, L, ""), md.new_int_var(0, L, "")
            md.add_element(bounds[s], [int(x) for x in prefix[:, k]], lo)
            md.add_element(bounds[s + 1], [int(x) for x in prefix[:, k]], hi)
            row.append(hi - lo)
        counts.append(row)
    r = [[[md.new_int_var(0, L if (fixed_mode is None or fixed_mode == mode) else 0, f"{tag}_r{s}{k}{mode}")
           for mode in range(3)] for k in range(K)] for s in range(P)]
    for s in range(P):
        for k in range(K):
            md.add(sum(r[s][k]) == counts[s][k])
    tvars = [md.new_int_var(0, tmax, f"{tag}_t{s}") for s in range(P)]
    tmaxv = md.new_int_var(0, tmax, f"{tag}_tmax")
    for s in range(P):
        md.add(tmaxv >= tvars[s])
    tail = md.new_int_var(0, tmax * 4, f"{tag}_tail")
    return {"q": q, "n": n, "counts": counts, "r": r, "t": tvars, "tmax": tmaxv, "tail": tail, "P": P, "v": v}


def _config_constraints(md: Any, problem: Problem, scored: Scored, i: int, g: dict[str, Any], x: Any, obj: Any,
                        T: Any) -> None:
    t, cf = scored.terms, scored.configs[i]
    P, v, m = g["P"], g["v"], cf["ga"]
    K = len(scored.table.kinds)
    static, per_block, mult = t.phases
    comm_terms, mem_terms = [], []
    for s in range(P):
        cnt, r = g["counts"][s], g["r"][s]
        # memory <= capacity in every phase, conservatively rounded (coefficients up, capacity down)
        for f in t.binding_phases(i, P):
            mem = _ceil(static[i, s, f]) + sum(_ceil(per_block[i, s, f, k]) * cnt[k] for k in range(K)) + sum(
                _ceil(mult[i, s, f] * t.act_block[i, 0, k, mode]) * r[k][mode] for k in range(K) for mode in range(3))
            md.add(mem <= int(t.capacity[i, s])).only_enforce_if(x)
            mem_terms.append(mem)
        # offloaded states within the stage's host share, conservatively rounded
        if t.host_block[i, s].any() or t.host_static[i, s] > 0:
            md.add(_ceil(t.host_static[i, s]) + sum(_ceil(t.host_block[i, s, k]) * cnt[k] for k in range(K))
                   <= int(t.host_capacity[i, s])).only_enforce_if(x)
        tb = t.t_block[i, s].sum(-1)  # [K, 3]
        md.add(g["t"][s] == T(t.t_static[i, s].sum()) + sum(T(tb[k, mode]) * r[k][mode] for k in range(K)
                                                             for mode in range(3))).only_enforce_if(x)
        # exposed DP tail (autoplace.cost.step.exposed_reduction) + gather + optimizer:
        # (1 - k) max(red - win, min(red, bucket)) + k red + rest, as two linear lower bounds
        def lin(static: np.ndarray, block: np.ndarray, w: float = 1.0, s: int = s, cnt: list[Any] = cnt) -> Any:
            return T(w * static[i, s]) + sum(T(w * block[i, s, k]) * cnt[k] for k in range(K))

        kappa = t.slowdown
        rest = lin(t.gather_static + t.opt_static, t.gather_block + t.opt_block)
        bucket = T((1 - kappa) * t.last_bucket[i, s])
        floor = md.new_int_var(0, max(bucket, 0), "")  # min(reduce, last bucket), scaled by 1 - k
        md.add_min_equality(floor, [lin(t.reduce_static, t.reduce_block, 1 - kappa), bucket])
        md.add(g["tail"] >= lin(t.reduce_static, t.reduce_block) - lin(t.window_static, t.window_block, 1 - kappa)
               + rest).only_enforce_if(x)
        md.add(g["tail"] >= floor + lin(t.reduce_static, t.reduce_block, kappa) + rest).only_enforce_if(x)
        cb = t.bytes_block[i, 0].sum(-1)  # [K, 3]
        comm_terms.append(int(t.bytes_static[i, s].sum()) + sum(int(cb[k, mode]) * r[k][mode]
                                                                for k in range(K) for mode in range(3)))
    if problem.objective == "time":
        w_max, w_sum = pipeline_weights(m, v)
        md.add(obj >= int(round(float(LCM_VPP * w_max))) * g["tmax"] + int(round(float(LCM_VPP * w_sum))) * sum(g["t"])
               + LCM_VPP * g["tail"]).only_enforce_if(x)
    elif problem.objective == "comm":
        for expr in comm_terms:
            md.add(obj >= expr).only_enforce_if(x)
    else:
        for expr in mem_terms:
            md.add(obj >= expr).only_enforce_if(x)


def _prune(problem: Problem, scored: Scored) -> tuple[list[int], np.ndarray, int | None]:
    """Keep configurations that may hold one of the top-K optima (sound bound test).

    Returns:
        (kept indices, uniform objective values, index of the best uniform plan for the hint)
    """
    feasible = scored.memory_lb <= 0
    best_uniform = np.full(len(scored.configs), np.inf)
    best_mode = np.zeros(len(scored.configs), dtype=int)
    if "layers" not in problem.fixed:
        modes = [["none", "selective", "full"].index(problem.fixed["recompute"])] if "recompute" in problem.fixed else [0, 1, 2]
        for mode in modes:
            cand = to_candidates(scored.configs, scored.table, mode=mode)
            b = evaluate_batch(scored.table, problem.cluster, cand, problem.model.training.recipe(), problem.assumptions)
            value = {"time": b.step_time, "comm": b.comm_total, "memory": b.peak_memory}[problem.objective]
            value = np.where(b.fits, value, np.inf)
            better = value < best_uniform
            best_uniform = np.where(better, value, best_uniform)
            best_mode = np.where(better, mode, best_mode)
    finite = np.sort(best_uniform[np.isfinite(best_uniform)])
    ub = finite[min(problem.top_k, len(finite)) - 1] if len(finite) >= 1 else np.inf
    # the uniform UB is a real plan's value; allow float noise before discarding
    keep = np.flatnonzero(feasible & (scored.lower_bound <= ub * (1 + 1e-9)))
    hint = int(np.argmin(best_uniform)) if np.isfinite(best_uniform).any() else None
    return keep.tolist(), best_mode, hint


class CpSatSolver(Solver):
    """OR-Tools CP-SAT over the whole placement space (the default)."""

    name = "cpsat"

    @classmethod
    def available(cls) -> bool:
        try:
            import ortools.sat.python.cp_model  # noqa: F401
        except ImportError:
            return False
        return True

    def solve(self, problem: Problem, budget: Budget) -> SolveResult:

        start = time.perf_counter()
        configs = enumerate_configs(problem)
        scored = score_space(problem, configs)
        if len(scored.table.kinds) == 1:
            return self._solve_with_tables(problem, budget, scored, start)
        keep, best_mode, hint = _prune(problem, scored)
        notes = [f"{len(configs)} configurations scored, {len(keep)} kept after bounding"]
        if not keep:
            return finish(problem, scored, [], "infeasible", bound=None, start=start, n_evaluated=len(configs),
                          notes=notes)
        built = build_model(problem, scored, keep)
        if hint is not None and hint in built.chosen:
            for i, var in built.chosen.items():
                built.model.add_hint(var, i == hint)
        runs = _top_k(built.model, built.chosen, problem, budget, start)
        chosen = [self._read(solver, built, scored, i) for solver, i in runs.found]
        statuses, bound = runs.statuses, runs.bound
        if not chosen and hint is not None:  # time ran out before CP-SAT's first solution
            chosen.append(_uniform(scored, hint, int(best_mode[hint])))
            notes.append("time limit hit before a CP-SAT solution: returning the best uniform plan")
            statuses.append("feasible")
        status = "optimal" if statuses and all(s == "optimal" for s in statuses) else (
            "feasible" if chosen else "infeasible")
        scale = {"time": built.time_scale_s / LCM_VPP, "comm": 1.0, "memory": 1.0}[problem.objective]
        notes.append(f"objective scale: 1 unit = {scale:.3g} {'s' if problem.objective == 'time' else 'bytes'}")
        return finish(problem, scored, chosen, status, bound=None if bound is None else bound * scale, start=start,
                      n_evaluated=len(configs), notes=notes)

    def _solve_with_tables(self, problem: Problem, budget: Budget, scored: Scored, start: float) -> SolveResult:
        """Single-kind models: bound configurations with exact per-stage tables, then CP-SAT."""

        tables, lowers, upper, hint = _bound_with_tables(problem, scored)
        n_cfg = len(scored.configs)
        notes = [f"{n_cfg} configurations scored, {len(tables)} kept after bounding"]
        if not tables:
            return finish(problem, scored, [], "infeasible", bound=None, start=start, n_evaluated=n_cfg, notes=notes)
        built = build_table_model(problem, scored, tables, lowers, upper)
        if hint is not None:
            i, split = hint
            for j, var in built.chosen.items():
                built.model.add_hint(var, j == i)
            for lits, n in zip(built.groups[(scored.configs[i]["pp"], scored.configs[i]["vpp"])]["y"], split, strict=True):
                for k, lit in lits.items():
                    built.model.add_hint(lit, k == n // scored.configs[i]["vpp"])
        runs = _top_k(built.model, built.chosen, problem, budget, start, objective=built.objective)
        chosen = [read_solution(solver, built, scored, tables, i) for solver, i in runs.found]
        values = [v * built.unit for v in runs.values]
        statuses = runs.statuses
        # the objective carries a tie-break of < 1 unit per configuration: strip it from the bound
        bound = None if runs.bound is None else (runs.bound // len(built.chosen)) * built.unit
        if not chosen and hint is not None:  # time ran out before CP-SAT's first solution
            i, split = hint
            tb = tables[i]
            chosen.append((scored.configs[i], split,
                           [[[n - int(tb.sel[s, n]) - int(tb.full[s, n]), int(tb.sel[s, n]), int(tb.full[s, n])]]
                            for s, n in enumerate(split)]))
            notes.append("time limit hit before a CP-SAT solution: returning the best even split")
            statuses.append("feasible")
        status = "optimal" if statuses and all(x == "optimal" for x in statuses) else (
            "feasible" if chosen else "infeasible")
        notes.append(f"objective scale: 1 unit = {built.unit:.3g} {'s' if problem.objective == 'time' else 'bytes'}")
        return finish(problem, scored, chosen, status, bound=bound, start=start, n_evaluated=n_cfg, notes=notes,
                      model_values=values if len(values) == len(chosen) else None)

    @staticmethod
    def _read(solver: Any, built: Built, scored: Scored, i: int) -> tuple[dict[str, Any], list[int], list[Any]]:
        cf = scored.configs[i]
        g = built.groups[(cf["pp"], cf["vpp"])]
        split = [int(solver.value(n)) for n in g["n"]]
        modes = [[[int(solver.value(v)) for v in kind] for kind in stage] for stage in g["r"]]
        return cf, split, modes


@dataclass
class _Runs:
    """What the top-K loop found: (solver, configuration) per plan, statuses, the first bound."""

    found: list[tuple[Any, int]] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    bound: float | None = None
    values: list[float] = field(default_factory=list)


def _top_k(model: Any, chosen: dict[int, Any], problem: Problem, budget: Budget, start: float,
           objective: Any = None) -> _Runs:
    """Solve, record the chosen configuration, forbid it, solve again: the top-K distinct
    configurations, each optimal among those left, within the shared time budget."""
    from ortools.sat.python import cp_model

    runs = _Runs()
    for _ in range(problem.top_k):
        remaining = budget.time_limit_s - (time.perf_counter() - start)
        if remaining <= 0 or not chosen:
            break
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = remaining
        solver.parameters.num_workers = budget.workers
        solver.parameters.random_seed = budget.seed
        code = solver.solve(model)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            if code != cp_model.INFEASIBLE:
                runs.statuses.append("feasible")
            break
        runs.statuses.append("optimal" if code == cp_model.OPTIMAL else "feasible")
        if runs.bound is None:
            runs.bound = solver.best_objective_bound
        i = next(j for j, var in chosen.items() if solver.value(var))
        runs.found.append((solver, i))
        if objective is not None:
            runs.values.append(solver.value(objective))
        model.add(chosen[i] == 0)  # next: the best *other* configuration
    return runs


def _bound_with_tables(problem: Problem, scored: Scored) -> tuple[
        dict[int, StageTables], dict[int, float], float, tuple[int, list[int]] | None]:
    """Tables for every configuration that may hold a top-K optimum.

    Configurations are visited in order of their cheap lower bound; each gets its exact
    per-stage tables, a split-DP lower bound and, from its even split, an upper bound.  The
    visit stops once the cheap bound exceeds the K-th best upper bound; configurations whose
    table bound exceeds it are dropped.  Both bounds are sound, so no optimum is lost.
    """
    fixed_mode = ["none", "selective", "full"].index(problem.fixed["recompute"]) if "recompute" in problem.fixed else None
    fixed_split = [int(x) for x in str(problem.fixed["layers"]).split(":")] if "layers" in problem.fixed else None
    L = scored.table.blocks
    uppers: list[float] = []
    kept: dict[int, tuple[float, StageTables]] = {}
    hint: tuple[float, int, list[int]] | None = None
    for i in np.argsort(scored.lower_bound, kind="stable"):
        i = int(i)
        kth = sorted(uppers)[problem.top_k - 1] if len(uppers) >= problem.top_k else np.inf
        if scored.lower_bound[i] > kth * (1 + 1e-9) or scored.memory_lb[i] > 0:
            if scored.lower_bound[i] > kth * (1 + 1e-9):
                break
            continue
        cf = scored.configs[i]
        tb = stage_tables(scored, i, problem.objective, fixed_mode)
        lb, bottleneck = split_bounds(tb, cf["vpp"], cf["ga"], problem.objective)
        if not np.isfinite(lb):
            continue
        even = [x * cf["vpp"] for x in even_split(L // cf["vpp"], cf["pp"])]
        splits = [fixed_split] if fixed_split else [even, *([bottleneck] if bottleneck else [])]
        values = [(split_value(tb, sp, cf["vpp"], cf["ga"], problem.objective), sp) for sp in splits
                  if sum(sp) == L and len(sp) == cf["pp"]]
        if values:
            ub, split = min(values, key=lambda x: x[0])
            if np.isfinite(ub):
                uppers.append(ub)
                if hint is None or ub < hint[0]:
                    hint = (ub, i, list(split))
        kept[i] = (lb, tb)
    kth = sorted(uppers)[problem.top_k - 1] if len(uppers) >= problem.top_k else np.inf
    tables = {i: tb for i, (lb, tb) in kept.items() if lb <= kth * (1 + 1e-9)}
    lowers = {i: lb for i, (lb, _) in kept.items() if i in tables}
    return tables, lowers, float(kth), None if hint is None else (hint[1], hint[2])


def _uniform(scored: Scored, i: int, mode: int) -> tuple[dict[str, Any], list[int], list[Any]]:
    """Configuration ``i`` with its even split and one recompute mode everywhere."""
    counts = to_candidates([scored.configs[i]], scored.table, mode=mode).counts[0]
    split = [int(counts[s].sum()) for s in range(scored.configs[i]["pp"])]
    return scored.configs[i], split, [counts[s].astype(int).tolist() for s in range(len(split))]

