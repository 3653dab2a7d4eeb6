"""The CP-SAT model for single-kind models: configuration x split, per-stage recompute from
exact tables (:mod:`solvers.tables`).

Variables: one Boolean per configuration (exactly one true); per (pp, vpp) group the chunks
per stage ``q_s`` (stage size ``n_s = vpp * q_s``, contiguous, uneven allowed); per
configuration and stage the stage time and DP tail read from the tables with element
constraints indexed by ``q_s``; per configuration the pipeline's slowest stage and tail.
Infeasible stage sizes carry a sentinel that the chosen configuration may not take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoplace.cost.step import pipeline_weights
from solvers.problem import Problem
from solvers.space import Scored
from solvers.tables import StageTables

LCM_VPP = 12  # lcm(1, 2, 3, 4): keeps (Σt - max)/v integral for every vpp searched
UNITS = 10_000_000  # the largest finite table entry maps to this many integer units
P_SLACK = 4096  # integer rounding of the upper bound, in objective units


@dataclass
class TableModel:
    """The built model and what is needed to read a solution back."""

    model: Any
    chosen: dict[int, Any]
    groups: dict[tuple[int, int], dict[str, Any]]
    objective: Any
    unit: float  # objective units per integer unit (seconds or bytes)
    notes: list[str] = field(default_factory=list)


def build_table_model(problem: Problem, scored: Scored, tables: dict[int, StageTables],
                      lower: dict[int, float] | None = None, upper: float | None = None) -> TableModel:
    """Build the CP-SAT model over the configurations in ``tables``.

    ``lower`` (per configuration) and ``upper`` (the K-th best known plan) are sound bounds
    in objective units; they only tighten the search, never cut off an optimum.
    """
    from ortools.sat.python import cp_model

    L = scored.table.blocks
    md = cp_model.CpModel()
    time_obj = problem.objective == "time"
    big_value = max(_finite_max(tb.value if not time_obj else np.maximum(tb.time, tb.tail)) for tb in tables.values())
    unit = max(big_value, 1e-30) / UNITS
    sentinel = UNITS * 4

    def ints(a: np.ndarray) -> list[int]:
        return [int(round(x / unit)) if np.isfinite(x) else sentinel for x in a]

    fixed_split = (tuple(int(x) for x in str(problem.fixed["layers"]).split(":"))
                   if "layers" in problem.fixed else None)
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for i in tables:
        key = (scored.configs[i]["pp"], scored.configs[i]["vpp"])
        if key not in groups:
            groups[key] = _group_vars(md, key, L, fixed_split, sentinel)
    chosen = {i: md.new_bool_var(f"x{i}") for i in tables}
    md.add_exactly_one(chosen.values())
    obj = md.new_int_var(0, LCM_VPP * sentinel * (max(cf["ga"] for cf in scored.configs) * 4 + 8), "objective")
    for i, tb in tables.items():
        cf = scored.configs[i]
        P, v, m = cf["pp"], cf["vpp"], cf["ga"]
        g, x = groups[(P, v)], chosen[i]
        index = np.arange(L // v + 1) * v  # q -> n
        main = tb.time if time_obj else tb.value
        stage_sum = []
        for s in range(P):
            values = ints(main[s, index])
            for q, y in g["y"][s].items():
                if values[q] >= sentinel:  # this stage cannot hold q chunks under configuration i
                    md.add_implication(x, ~y)
            expr = sum(values[q] * y for q, y in g["y"][s].items() if values[q] < sentinel)
            md.add(g["top"] >= expr).only_enforce_if(x)
            stage_sum.append(expr)
            if time_obj:
                tails = ints(tb.tail[s, index])
                md.add(g["tail"] >= sum(tails[q] * y for q, y in g["y"][s].items() if tails[q] < sentinel)
                       ).only_enforce_if(x)
        if lower is not None and i in lower and np.isfinite(lower[i]):
            md.add(obj >= int(lower[i] / (unit / (LCM_VPP if time_obj else 1)) * (1 - 1e-6))).only_enforce_if(x)
        if time_obj:
            w_max, w_sum = pipeline_weights(m, v)
            md.add(obj >= int(round(float(LCM_VPP * w_max))) * g["top"] + int(round(float(LCM_VPP * w_sum))) * sum(stage_sum)
                   + LCM_VPP * g["tail"]).only_enforce_if(x)
        else:
            md.add(obj >= g["top"]).only_enforce_if(x)
    if upper is not None and np.isfinite(upper):
        obj_unit = unit / LCM_VPP if time_obj else unit
        md.add(obj <= int(upper / obj_unit * (1 + 1e-6)) + P_SLACK)
    # ties (equal objective to the integer unit) go to the configuration that is better on the
    # other criterion: fewer bytes for the time objective, less time for the others
    rank = _secondary_rank(problem, scored, tables)
    md.minimize(obj * len(rank) + sum(rank[i] * x for i, x in chosen.items()))
    return TableModel(md, chosen, groups, obj, unit / LCM_VPP if time_obj else unit)


def _group_vars(md: Any, key: tuple[int, int], L: int, fixed_split: tuple[int, ...] | None,
                sentinel: int) -> dict[str, Any]:
    """Per (pp, vpp) group: a one-hot choice of chunks per stage, its integer value, the
    slowest stage and the largest tail (shared by the group's configurations)."""
    P, v = key
    y = []
    q = []
    for s in range(P):
        allowed: list[int] = list(range(1, L // v + 1))
        if fixed_split is not None and len(fixed_split) == P:
            allowed = [fixed_split[s] // v] if fixed_split[s] % v == 0 else []
        lits = {k: md.new_bool_var(f"y_p{P}v{v}_{s}_{k}") for k in allowed}
        md.add_exactly_one(lits.values())
        y.append(lits)
        q.append(sum(k * lit for k, lit in lits.items()))
    md.add(sum(q) * v == L)
    return {"y": y, "q": q, "top": md.new_int_var(0, sentinel, f"top_p{P}v{v}"),
            "tail": md.new_int_var(0, sentinel, f"tail_p{P}v{v}")}


def _secondary_rank(problem: Problem, scored: Scored, tables: dict[int, StageTables]) -> dict[int, int]:
    """Each configuration's rank (0 = best) on the tie-breaking criterion, at its even split."""
    from autoplace.plan import even_split

    t, L = scored.terms, scored.table.blocks
    key = {}
    for i, tb in tables.items():
        cf = scored.configs[i]
        split = np.array([x * cf["vpp"] for x in even_split(L // cf["vpp"], cf["pp"])])
        stages = np.arange(cf["pp"])
        if problem.objective == "time":  # bytes of the busiest device, no recompute
            key[i] = float((t.bytes_static[i, stages].sum(-1) + split * t.bytes_block[i, 0, 0, 0].sum()).max())
        else:
            key[i] = float(np.nan_to_num(tb.time[stages, split], posinf=1e300).sum())
    return {i: r for r, i in enumerate(sorted(key, key=lambda j: (key[j], j)))}


def _finite_max(a: np.ndarray) -> float:
    finite = a[np.isfinite(a)]
    return float(finite.max()) if finite.size else 1.0


def read_solution(solver: Any, built: TableModel, scored: Scored, tables: dict[int, StageTables],
                  i: int) -> tuple[dict[str, Any], list[int], list[Any]]:
    """(configuration, split, recompute counts per stage) of the chosen configuration ``i``."""
    cf = scored.configs[i]
    v = cf["vpp"]
    split = [int(solver.value(x)) * v for x in built.groups[(cf["pp"], v)]["q"]]
    tb = tables[i]
    modes = []
    for s, n in enumerate(split):
        sel, full = int(tb.sel[s, n]), int(tb.full[s, n])
        modes.append([[n - sel - full, sel, full]])
    return cf, split, modes
