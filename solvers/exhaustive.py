"""The reference back end: every configuration, every contiguous split, every recompute count.

Per configuration and split the stages are independent: the step time is non-decreasing in
every stage's micro-batch time and recompute choices touch nothing else (the DP overlap
window excludes recompute, see :mod:`autoplace.cost.terms`), so each stage takes its fastest
recompute counts that fit.  That makes the enumeration exact, and small instances cheap.
"""

from __future__ import annotations

import itertools
import math
import time
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from autoplace.cost.layers import layer_table
from autoplace.cost.step import BUBBLE_SHARE, pipeline_time
from autoplace.errors import SolverError, SpecError
from autoplace.plan import FIRST_FULL, config_slots
from solvers.base import Budget, Problem, Solver, SolveResult
from solvers.common import finish
from solvers.space import Scored, enumerate_configs, recompute_of, score_space, split_of

MAX_WORK = 3_000_000  # split x option evaluations; beyond this the oracle is the wrong tool


def compositions(total: int, parts: int, step: int, slots: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
    """All ways to write ``total`` as ``parts`` positive multiples of ``step``, in order; with
    ``slots`` (:func:`autoplace.plan.stage_slots`), each part is that many blocks short of its
    multiple (the blocks plus the embedding / loss places make the multiples)."""
    slots = slots or (0,) * parts
    units = total + sum(slots)
    if units % step:
        return []
    out = []
    for cuts in itertools.combinations(range(1, units // step), parts - 1):
        bounds = (0, *cuts, units // step)
        out.append(tuple(step * (b - a) - s for a, b, s in zip(bounds, bounds[1:], slots, strict=False)))
    return out


def count_compositions(total: int, parts: int, step: int, slots: tuple[int, ...] | None = None) -> int:
    """``len(compositions(total, parts, step, slots))`` without listing them: C(units/step - 1, parts - 1)."""
    units = total + sum(slots or ())
    return math.comb(units // step - 1, parts - 1) if units % step == 0 and units >= parts * step else 0


def _options(counts: tuple[int, ...], fixed_mode: int | None, first: np.ndarray | None = None) -> np.ndarray:
    """Every recompute assignment for a stage with ``counts[k]`` blocks of kind k: [O, K, 3]
    (FIRST_FULL: full on the first b blocks and none after, ``first[b]`` of each kind full)."""
    if fixed_mode == FIRST_FULL:
        full = np.asarray(first, dtype=float)  # [n + 1, K]
        return np.stack([np.asarray(counts) - full, np.zeros_like(full), full], axis=-1)
    per_kind = []
    for n in counts:
        if fixed_mode is not None:
            row = [0, 0, 0]
            row[fixed_mode] = n
            per_kind.append([row])
        else:
            per_kind.append([[n - a - b, a, b] for a in range(n + 1) for b in range(n + 1 - a)])
    return np.array([list(combo) for combo in itertools.product(*per_kind)], dtype=float)


class _Stage(NamedTuple):
    """One stage's best recompute counts and what they cost."""

    time: float
    comm: float
    memory: float
    tail: float
    modes: list[Any]


def best_inner(scored: Scored, i: int, problem: Problem) -> tuple[tuple[Any, ...], list[int], list[Any]] | None:
    """Best split and recompute counts of configuration ``i``, or None when nothing fits."""
    cf, t, table = scored.configs[i], scored.terms, scored.table
    P, v, m = cf.pp, cf.vpp, cf.grad_accum
    fixed_mode = recompute_of(scored.configs, i, problem.fixed_mode)
    splits = compositions(table.blocks, P, v, config_slots(cf))
    forced = split_of(scored.configs, i, problem)
    if forced is not None:
        splits = [s for s in splits if s == forced]
    prefix = np.vstack([np.zeros(len(table.kinds)), np.cumsum(np.eye(len(table.kinds))[list(table.sequence)], axis=0)])

    @cache
    def stage(s: int, start: int, stop: int) -> _Stage | None:
        counts = tuple(int(x) for x in prefix[stop] - prefix[start])
        opts = _options(counts, fixed_mode, prefix[start:stop + 1] - prefix[start])  # [O, K, 3]
        N = opts.sum(-1)  # [O, K]
        static, per_block, mult = (x[i, s] for x in t.phases)
        mem = (static[None, :] + N @ per_block.T + mult[None, :] * (opts * t.act_block[i, 0]).sum((1, 2))[:, None]).max(-1)
        tim = t.t_static[i, s].sum() + (opts * t.t_block[i, s].sum(-1)).sum((1, 2))
        com = t.bytes_static[i, s].sum() + (opts * t.bytes_block[i, 0].sum(-1)).sum((1, 2))
        host = t.host_static[i, s] + N @ t.host_block[i, s]
        fits = (mem <= t.capacity[i, s]) & (host <= t.host_capacity[i, s])
        if not fits.any():
            return None
        key = {"time": (tim, mem), "comm": (com, tim), "memory": (mem, tim)}[problem.objective]
        order = np.lexsort((key[1], key[0], ~fits))
        j = int(order[0])
        tail = t.tail_at(i, np.asarray(s), N[j])
        return _Stage(float(tim[j]), float(com[j]), float(mem[j]), float(tail), opts[j].astype(int).tolist())

    best: tuple[tuple[Any, ...], list[int], list[Any]] | None = None
    for split in splits:
        bounds = np.concatenate([[0], np.cumsum(split)])
        found = [stage(s, int(bounds[s]), int(bounds[s + 1])) for s in range(P)]
        stages = [x for x in found if x is not None]
        if len(stages) < P:
            continue
        step = float(pipeline_time(np.array([x.time for x in stages]), m, v, BUBBLE_SHARE[cf.schedule])) + max(x.tail for x in stages)
        comm = max(x.comm for x in stages)
        mem = max(x.memory for x in stages)
        key = {"time": (step, comm), "comm": (comm, step), "memory": (mem, step)}[problem.objective]
        if best is None or key < best[0]:
            best = (key, list(split), [x.modes for x in stages])
    return best


class ExhaustiveSolver(Solver):
    """Enumerates the whole space; the oracle the contract tests compare CP-SAT against."""

    name = "exhaustive"

    def solve(self, problem: Problem, budget: Budget) -> SolveResult:
        start = time.perf_counter()
        configs = enumerate_configs(problem)
        L = layer_table(problem.model).blocks
        work = sum(count_compositions(L, c.pp, c.vpp, config_slots(c)) for c in configs)
        if work > MAX_WORK:  # known before any scoring: refuse at once
            raise SpecError(f"exhaustive search would enumerate {work:,} splits (its limit is {MAX_WORK:,}); "
                            "valid for this problem: cpsat", source="--solver")
        space = score_space(problem, configs)
        rows = space.configs  # each configuration once per recompute form
        scored = space.scored(range(len(rows)))
        found = []
        for i in range(len(rows)):
            inner = best_inner(scored, i, problem)
            if inner is not None:
                found.append((inner[0], i, inner[1], inner[2]))
            if time.perf_counter() - start > budget.time_limit_s * 50:
                raise SolverError("exhaustive search ran far past the time limit")
        found.sort(key=lambda f: f[0])
        chosen = [(rows[i], split, modes) for _, i, split, modes in found[: problem.top_k]]
        return finish(problem, space, chosen, "optimal" if found else "infeasible",
                      bound=None, start=start, n_evaluated=len(space.listed))


__all__ = ["ExhaustiveSolver", "best_inner", "compositions"]
