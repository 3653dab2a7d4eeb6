"""CP-SAT placement search: one integer program over configurations, layer splits and
per-layer recompute, with per-stage memory caps.

The model (:func:`build_model`):

* one Boolean ``x_c`` per configuration kept after bounding (degrees, ZeRO level, offload,
  micro-batch, schedule: the table of valid factorizations replaces nonlinear degree
  products), exactly one true;
* per (pp, vpp) group, shared by its configurations: a one-hot choice ``y[s][q]`` of ``q``
  chunks of ``vpp`` units on stage ``s`` (contiguous, uneven allowed, ``Σ vpp q_s = L`` plus the
  places the embedding and the loss take, ``pp_embedding`` / ``pp_loss``: a stage holds its
  units but its places in blocks);
* per configuration and stage, enforced by ``x_c``: the stage's micro-batch time and its
  once-per-step tail (exposed DP reduction, gathers, optimizer) with the best recompute
  counts that fit, known in closed form for every stage the tables allow, read off one of
  two encodings of the split --

  - *sizes* (one block kind, :mod:`solvers.tables`): a stage's cost depends only on its
    size, so it is read off the ``y`` literals, which exist only for the sizes that fit and
    can be part of a plan within the cap (:func:`solvers.tables.size_limits`);
  - *arcs* (several block kinds, e.g. DeepSeek's dense first layer before MoE layers,
    :mod:`solvers.tables_mixed`): a stage's blocks of each kind depend on where it starts,
    so each stage chooses one arc (first block, blocks) among those on some split that fits,
    consecutive stages meeting at their shared boundary (a path from block 0 to ``L``);

* the objective ``D ((m - w) max_s t_s + w Σ_s t_s + max_s tail_s)`` for time, ``w = share / v``
  (:func:`autoplace.cost.step.pipeline_weights`; ``share`` the schedule's ``BUBBLE_SHARE``), or the
  busiest stage's bytes for comm and memory.  ``D`` is the least common multiple of the kept
  configurations' denominators of ``w``, so every weight is an exact integer.

Coefficients come from :func:`autoplace.cost.terms.stage_terms` (the evaluator's own
tables), in integer units of a recorded scale; memory is rounded conservatively (coefficients
up, capacity down).  Configurations whose sound lower bound exceeds the K-th best known plan
are pruned before the model is built, which never removes an optimum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from autoplace.cost.step import BUBBLE_SHARE
from autoplace.plan import Config, config_slots
from solvers import _ortools
from solvers.base import Budget, Problem, Solver, SolveResult
from solvers.common import finish
from solvers.space import Scored, Space, enumerate_configs, score_space, split_of
from solvers.splits import best_split_units
from solvers.tables import StageTables, split_sizes, table_modes
from solvers.tables_mixed import MixedTables, mixed_arcs, mixed_modes
from solvers.visit import Bounded, Tables, bound_mixed, bound_with_tables

UNITS = 10_000_000  # the slowest stage (or tail) of any kept configuration maps to this many units
SLACK = 1e-6  # relative slack on bounds computed in floating point

Chosen = tuple[Any, list[int], list[Any]]  # (configuration, blocks per stage, recompute counts per stage)


@dataclass
class Built:
    """The CP-SAT model and what is needed to read a solution back."""

    model: Any
    present: dict[int, Any]  # configuration index -> Boolean: its optimum is below the cap
    objective: dict[int, Any]  # configuration index -> its objective (integer units)
    groups: dict[int, dict[str, Any]]  # configuration index -> its split variables
    unit: float  # seconds or bytes per objective unit
    read: Callable[[Any, int], Chosen]


def _bubble_weight(cf: Config) -> Fraction:
    """The other stages' weight in ``cf``'s pipeline time, ``share / vpp`` (:func:`autoplace.cost.step.pipeline_weights`)."""
    return BUBBLE_SHARE[cf.schedule] / cf.vpp


def _ceil(x: float) -> int:
    return int(math.ceil(x - 1e-9))


def build_model(problem: Problem, scored: Scored, tables: dict[int, Tables],
                lower: dict[int, float] | None = None, upper: float | None = None) -> Built:
    """The integer program over every configuration of ``scored``, per-stage costs from
    ``tables`` (:class:`StageTables` or, with several block kinds, :class:`MixedTables`).

    Each configuration has its own split variables and its own objective ``o_c``, and the
    model minimizes ``Σ_c o_c``: they are independent, so one optimal solution holds each
    one's own optimum and the top-K is read off it (one search, not K); a configuration whose
    optimum is not below the cap (the K-th best known plan, ``upper``) may be left absent at
    the cap's value.  ``lower`` (per configuration) are sound bounds; both are in seconds or
    bytes and only tighten the search.
    """
    cp_model = _ortools.cp_model()

    t, table, configs = scored.terms, scored.table, scored.configs
    L = table.blocks
    keep = range(len(configs))
    time_obj = problem.objective == "time"
    md = cp_model.CpModel()
    # every w_sum = D * share / vpp an integer (autoplace.cost.step.BUBBLE_SHARE: thirds under interleaved-zb)
    D = math.lcm(*(_bubble_weight(configs[i]).denominator for i in keep)) if time_obj else 1
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
        cf, tb, forced = configs[i], tables[i], split_of(configs, i, problem)
        x = present[i] = md.new_bool_var(f"x{i}")
        o = objective[i] = md.new_int_var(0, cap, f"o{i}")
        w_sum = int(D * _bubble_weight(cf))  # D * pipeline_weights(m, v, share), exactly
        w_max = D * cf.grad_accum - w_sum
        slots = config_slots(cf)
        best = best_split_units(tb, unit, cf.vpp, w_max, w_sum, D, slots) \
            if time_obj and forced is None else None
        if isinstance(tb, MixedTables):
            arcs = mixed_arcs(tb, problem.objective)
            if best is not None and best.bound >= best.cost:  # proven: its best split's arcs alone (no other beats it)
                arcs = [[(int(a), n)] for a, n in zip(np.cumsum(best.split) - best.split, best.split, strict=True)]
            g = groups[i] = _arc_group(md, arcs, cf.pp, x)
        else:
            sizes = split_sizes(tb, problem.objective, cf.pp, cf.vpp, forced, slots)
            g = groups[i] = _group(md, (cf.pp, cf.vpp), L, forced, sizes, slots)
        g["top"] = md.new_int_var(0, top_bound, "")
        g["tail"] = md.new_int_var(0, top_bound, "")
        if isinstance(tb, MixedTables):
            stages = _arc_stages(md, problem, tb, g, x, unit)
        else:
            stages = _table_stages(md, problem, tb, g, x, unit)
        for expr in stages:
            md.add(g["top"] >= expr).only_enforce_if(x)
        if time_obj:
            md.add(o >= w_max * g["top"] + w_sum * sum(stages) + D * g["tail"]).only_enforce_if(x)
            if best is not None:  # its exact optimum (solvers.splits) and a complete hint reaching it: proven at once
                md.add(o >= best.bound).only_enforce_if(x)
                fits = best.cost <= cap
                g["best"] = (best.split, {x: fits, o: best.cost if fits else cap,
                                          g["top"]: best.top, g["tail"]: best.tail})
        else:
            md.add(o >= g["top"]).only_enforce_if(x)
        if lower is not None and np.isfinite(lower.get(i, np.inf)):
            md.add(o >= int(lower[i] * D / unit * (1 - SLACK)) - rounding).only_enforce_if(x)
        md.add(o == cap).only_enforce_if(~x)
    md.minimize(sum(objective.values()))

    def read(solver: Any, i: int) -> Chosen:
        cf, g, tb = configs[i], groups[i], tables[i]
        if isinstance(tb, MixedTables):
            split = [n for arcs in g["z"] for (_, n), lit in arcs.items() if solver.value(lit)]
            return cf, split, mixed_modes(tb, split)
        split = [int(solver.value(q)) * cf.vpp - slot for q, slot in zip(g["q"], g["slots"], strict=True)]
        return cf, split, table_modes(tb, split)

    return Built(md, present, objective, groups, unit / D, read)


def _group(md: Any, key: tuple[int, int], L: int, fixed_split: tuple[int, ...] | None,
           sizes: list[list[int]] | None = None, slots: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Per (pp, vpp) group: the one-hot chunks per stage (only ``sizes[s]`` when given: the
    sizes a configuration's tables allow); chunks of ``vpp`` units, a stage's blocks and its
    embedding / loss places (``slots``, :func:`autoplace.plan.stage_slots`)."""
    P, v = key
    slots = slots or (0,) * P
    U = L + sum(slots)
    y, q = [], []
    for s in range(P):
        allowed = list(range(1, U // v - P + 2))
        if fixed_split is not None and len(fixed_split) == P:
            units = fixed_split[s] + slots[s]
            allowed = [units // v] if units % v == 0 else []
        if sizes is not None:
            allowed = sizes[s]
        lits = {k: md.new_bool_var("") for k in allowed}
        md.add_exactly_one(lits.values())
        y.append(lits)
        q.append(sum(k * lit for k, lit in lits.items()))
    md.add(sum(q) * v == U)
    return {"y": y, "q": q, "P": P, "v": v, "slots": slots}


def _arc_group(md: Any, arcs: list[list[tuple[int, int]]] | None, P: int, x: Any) -> dict[str, Any]:
    """Several block kinds: one Boolean per (stage, first block, blocks) of ``arcs``, one per
    stage, each stage starting where the one before ends; with no split that fits (``arcs``
    None) the configuration is absent."""
    if arcs is None:
        md.add(x == 0)
        return {"z": [{} for _ in range(P)], "P": P}
    z = [{arc: md.new_bool_var("") for arc in stage} for stage in arcs]
    for lits in z:
        md.add_exactly_one(lits.values())
    for before, after in zip(z, z[1:], strict=False):
        for e in {a for a, _ in after} | {a + n for a, n in before}:
            md.add(sum(lit for (a, n), lit in before.items() if a + n == e)
                   == sum(lit for (a, _), lit in after.items() if a == e))
    return {"z": z, "P": P}


def _table_stages(md: Any, problem: Problem, tb: StageTables, g: dict[str, Any], x: Any, unit: float) -> list[Any]:
    """One block kind: each stage's objective term and tail read off the chunk literals."""
    v, L = g["v"], tb.time.shape[1] - 1
    main = tb.time if problem.objective == "time" else tb.value
    stages = []
    for s, lits in enumerate(g["y"]):
        n = {q: q * v - g["slots"][s] for q in lits}  # blocks: the chunks' units but the stage's places
        value = {q: main[s, n[q]] if 0 <= n[q] <= L else np.inf for q in lits}
        for q, lit in lits.items():
            if not np.isfinite(value[q]):  # this stage cannot hold q chunks under this configuration
                md.add_implication(x, ~lit)
        stages.append(sum(int(round(value[q] / unit)) * lit for q, lit in lits.items() if np.isfinite(value[q])))
        if problem.objective == "time":
            md.add(g["tail"] >= sum(int(round(tb.tail[s, n[q]] / unit)) * lit for q, lit in lits.items()
                                    if np.isfinite(value[q]))).only_enforce_if(x)
    return stages


def _arc_stages(md: Any, problem: Problem, tb: MixedTables, g: dict[str, Any], x: Any, unit: float) -> list[Any]:
    """Several block kinds: each stage's objective term and tail read off its arc literals
    (every arc fits: :func:`solvers.tables_mixed.mixed_arcs`)."""
    main = tb.time if problem.objective == "time" else tb.value
    stages = []
    for s, lits in enumerate(g["z"]):
        stages.append(sum(int(round(main[s, a, n] / unit)) * lit for (a, n), lit in lits.items()))
        if problem.objective == "time":
            md.add(g["tail"] >= sum(int(round(tb.tail[s, a, n] / unit)) * lit
                                    for (a, n), lit in lits.items())).only_enforce_if(x)
    return stages


@dataclass
class _Search:
    """What the search found: the top-K plans with their model values, best first, the
    status and a sound lower bound of the best objective."""

    found: list[tuple[Chosen, float]] = field(default_factory=list)
    status: str = "infeasible"
    bound: float | None = None


def _search(built: Built, problem: Problem, budget: Budget, deadline: float) -> _Search:
    """The top-K within the deadline: one search of the joint model (:func:`build_model`).

    When stopped early, the bound is still sound: with current values ``o_c`` and a proven
    bound ``B`` of ``Σ_c o_c``, configuration c's optimum is at least ``B - Σ_{c' != c} o_c'``.
    """
    cp_model = _ortools.cp_model()

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(), 0.01)
    solver.parameters.num_workers = budget.workers
    solver.parameters.random_seed = budget.seed
    # presolve probing spends seconds deriving ~10^5 clauses from the one-hot split
    # literals of deep pipelines and never pays for itself here (benchmarks/solve_speed.py)
    solver.parameters.cp_model_probing_level = 0
    code = solver.solve(built.model)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Search(status="infeasible" if code == cp_model.INFEASIBLE else "unknown")
    values = {i: solver.value(o) for i, o in built.objective.items()}
    present = sorted((values[i], i) for i, x in built.present.items() if solver.value(x))
    proven = min(solver.best_objective_bound - (sum(values.values()) - v) for v in values.values())
    return _Search([(built.read(solver, i), v * built.unit) for v, i in present[: problem.top_k]],
                   "optimal" if code == cp_model.OPTIMAL else "feasible", max(proven, 0) * built.unit)


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
        configs = self._enumerate(problem, deadline)
        enumerated = len(configs)
        clock("score")
        space = self._score(problem, configs, deadline)
        configs = space.listed
        stopped = [f"the time limit stopped enumeration and scoring at {len(configs):,} configurations"
                   f"{'' if len(configs) == enumerated else f' of {enumerated:,}'}: the rest of the space was not "
                   "searched"] if getattr(configs, "stopped", False) else []
        clock("bound")
        one_kind = len(space.table.kinds) == 1
        bounded = (bound_with_tables if one_kind else bound_mixed)(problem, space, deadline)
        forms = "" if len(space.configs) == len(configs) else f" ({len(space.configs)} with their recompute forms)"
        notes = [*stopped, f"{len(configs)} configurations scored{forms}, "
                 f"{len(bounded.scored.configs) if bounded else 0} kept after bounding"]
        if bounded is None:  # nothing fits among what was scored; unsearched if the time limit stopped scoring
            return finish(problem, space, [], "unknown" if stopped else "infeasible", bound=None, start=start, n_evaluated=len(configs),
                          notes=notes, phases=clock.done())
        scored = bounded.scored
        clock("build")
        built = build_model(problem, scored, bounded.tables, bounded.lower, bounded.upper)
        for j, split in bounded.splits.items():
            self._hint(built, scored, j, *built.groups[j].get("best", (split, {})))
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
        if stopped or bounded.stopped:  # the time limit left configurations unsearched: nothing is proven
            status = "feasible" if chosen else "unknown"
        if bounded.stopped:
            notes.append("the time limit stopped the bounding: configurations not yet visited were not searched")
        notes.append(f"objective scale: 1 unit = {built.unit:.3g} {'s' if problem.objective == 'time' else 'bytes'}")
        values = [v for _, v in found.found]
        size = {"variables": len(built.model.proto.variables), "constraints": len(built.model.proto.constraints)}
        return finish(problem, space, chosen, status, bound=bound, start=start, n_evaluated=len(configs),
                      notes=notes, model_values=values if len(values) == len(chosen) else None,
                      phases=clock.done(), model_size=size)

    @staticmethod
    def _key(problem: Problem) -> tuple[Any, ...]:
        """What enumeration reads."""
        return (id(problem.model), id(problem.cluster), id(problem.admissible), problem.features, problem.max_mbs,
                tuple(sorted((k, str(v)) for k, v in problem.fixed.items())))

    def _enumerate(self, problem: Problem, deadline: float) -> list[Config]:
        """The configurations, shared by this solver's solves that differ only in what enumeration
        does not read (how many plans they keep: a deeper search for more runnable plans).
        One the time limit stopped is not kept (a later solve may have the time to finish)."""
        key = self._key(problem)
        if key in self._configs:
            return self._configs[key]
        configs = enumerate_configs(problem, deadline)
        if not configs.stopped:
            self._configs = {key: configs}  # keep one: spaces can be large
        return configs

    def _score(self, problem: Problem, configs: list[Config], deadline: float) -> Space:
        """The scored space, shared like the configurations (:meth:`_enumerate`): a solve of the
        same configurations reads its bounds off the last space's summary."""
        # the objects themselves, compared by identity: held here, their ids cannot be reused
        key = (problem.model, problem.cluster, problem.admissible, problem.assumptions, problem.costings)
        if self._space is not None and all(a is b for a, b in zip(self._space[0], key, strict=True)) \
                and self._space[1].listed is configs:
            return self._space[1].for_problem(problem)
        space = score_space(problem, configs, deadline)
        self._space = (key, space)
        return space

    @staticmethod
    def _hint(built: Built, scored: Scored, j: int, split: list[int], values: dict[Any, int] | None = None) -> None:
        """Start CP-SAT from a known good split of configuration ``j`` (and the ``values`` of
        other variables, if known: present by default)."""
        v, g = scored.configs[j].vpp, built.groups[j]
        for var, value in (values or {built.present[j]: True}).items():
            built.model.add_hint(var, value)
        if "z" in g:  # several block kinds: the arcs of the split
            starts = np.concatenate([[0], np.cumsum(split)[:-1]])
            for lits, a, n in zip(g["z"], starts, split, strict=True):
                for arc, lit in lits.items():
                    built.model.add_hint(lit, arc == (a, n))
            return
        for lits, n, slot in zip(g["y"], split, g["slots"], strict=True):
            for q, lit in lits.items():
                built.model.add_hint(lit, q == (n + slot) // v)

    @staticmethod
    def _fallback(bounded: Bounded, j: int) -> Chosen:
        """Configuration ``j``'s hinted plan as a (configuration, split, recompute counts)."""
        cf, split, tb = bounded.scored.configs[j], bounded.splits[j], bounded.tables[j]
        return cf, split, mixed_modes(tb, split) if isinstance(tb, MixedTables) else table_modes(tb, split)
