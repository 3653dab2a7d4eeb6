"""The visit that bounds the placement space before CP-SAT: configurations in order of their
cheap lower bound (:mod:`solvers.bounds`), each given its exact per-stage tables
(:mod:`solvers.tables`, :mod:`solvers.tables_mixed`), a split-DP lower bound and an upper
bound, until the cheap bound passes the K-th best plan seen.  Both bounds are sound, so the
configurations left (:class:`Bounded`) hold every top-K optimum.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from autoplace.cost.step import BUBBLE_SHARE, pipeline_weights
from autoplace.plan import split_units
from solvers.base import Problem
from solvers.space import Scored, Space, recompute_of, split_of
from solvers.splits import best_arc_split
from solvers.tables import StageTables, TableBound, bound_many
from solvers.tables_mixed import MixedTables, mixed_split_bounds, mixed_split_value, mixed_tables

Tables = StageTables | MixedTables  # one block kind: by stage size; several: by first block and size


VISIT_BATCH = 256  # configurations whose coefficient tables are built together while bounding
WAVES = (4, 64)  # the first and the most configurations whose stage tables and DPs are built at once


@dataclass
class Bounded:
    """The configurations that may hold a top-K optimum, scored (indexed 0..n-1), with what
    bounding learned: per-configuration lower bounds, a good split of each (the search's
    hint), the best plan seen (the fallback), and the K-th best known plan (the cap)."""

    scored: Scored
    tables: dict[int, Tables]
    lower: dict[int, float]
    splits: dict[int, list[int]]
    best: int | None
    upper: float
    stopped: bool = False  # the deadline passed while bounding


def bound_with_tables(problem: Problem, space: Space, deadline: float) -> Bounded | None:
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
    for chunk in by_lower_bound(space, caps.admits):
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
                                        list(build.values()), [split_of(batch.configs, k, problem) for k in build]))
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
    return _bounded(space, kept, caps.cap, stopped)


class _Found(NamedTuple):
    """What bounding learns of one configuration (:class:`solvers.tables.TableBound` has the
    same attributes): its split-DP lower bound, its best candidate split's objective, that
    split (None when none fits) and its tables."""

    lower: float
    upper: float
    split: list[int] | None
    tables: Tables


def _bounded(space: Space, kept: Mapping[int, _Found | TableBound], cap: float, stopped: bool) -> Bounded | None:
    """The configurations ``kept`` (by index into the space) whose lower bound is within the
    cap, as :class:`Bounded`; None when there are none."""
    rows = [i for i, b in kept.items() if b.lower <= cap * (1 + 1e-9)]
    if not rows:
        return None
    ubs = [kept[i].upper for i in rows]
    best = int(np.argmin(ubs)) if np.isfinite(min(ubs)) else None
    return Bounded(space.scored(rows), {j: kept[i].tables for j, i in enumerate(rows)},
                   {j: kept[i].lower for j, i in enumerate(rows)},
                   {j: sp for j, i in enumerate(rows) if (sp := kept[i].split) is not None}, best,
                   float(cap), stopped)


class _Caps:
    """The K best upper bounds seen while bounding, and the cap they make (the K-th)."""

    def __init__(self, k: int, lower_bound: np.ndarray, best: list[float] | None = None,
                 ceiling: float = np.inf) -> None:
        self.k, self.lower_bound, self.best = k, lower_bound, best or []  # best: sorted, at most k
        self.ceiling = ceiling  # the K-th best of K other plans known before the visit

    @property
    def cap(self) -> float:
        return min(self.best[self.k - 1] if len(self.best) >= self.k else np.inf, self.ceiling)

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
        return _Caps(self.k, self.lower_bound, list(self.best), self.ceiling)


def by_lower_bound(space: Space, wanted: Callable[[float], bool]) -> Iterator[list[int]]:
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


def bound_mixed(problem: Problem, space: Space, deadline: float) -> Bounded | None:
    """:func:`bound_with_tables` for several block kinds: the same visit in order of the
    cheap lower bound, with tables by first block and size (:mod:`solvers.tables_mixed`) and
    their split DPs over stage boundaries.  Both bounds are sound, so no optimum is lost --
    unless the deadline stops the visit, which the result says.  None when no configuration
    can fit.
    """
    L, objective = space.table.blocks, problem.objective
    caps = _Caps(problem.top_k, space.lower_bound, ceiling=np.inf if problem.fixed_split else _even_cap(problem, space))
    kept: dict[int, _Found] = {}  # by index into space.configs
    stopped = False
    for chunk in by_lower_bound(space, caps.admits):
        rows = [i for i in chunk if caps.within(i)]
        batch = space.scored(rows)
        for j, i in enumerate(rows):
            if not caps.within(i):
                break
            if time.perf_counter() > deadline and kept:  # deep pipelines' tables take milliseconds each
                stopped = True
                break
            cf, fixed_split = space.configs[i], split_of(batch.configs, j, problem)
            share = BUBBLE_SHARE[cf.schedule]
            tb = mixed_tables(batch, j, objective, recompute_of(batch.configs, j, problem.fixed_mode), caps.cap,
                              fixed_split)
            if objective == "time" and not fixed_split:  # the exact optimum over splits (or a bound and a split)
                w_max, w_sum = pipeline_weights(cf.grad_accum, cf.vpp, share)
                found = best_arc_split(tb.time, tb.tail, float(w_max), float(w_sum))
                lb, bottleneck = found.bound, found.split
            else:
                lb, bottleneck = mixed_split_bounds(tb, cf.vpp, cf.grad_accum, objective, share)
            if not np.isfinite(lb):
                continue
            even = list(split_units(L, cf.pp, cf.vpp, cf.pp_embedding, cf.pp_loss))
            splits = [list(fixed_split)] if fixed_split else [even, *([bottleneck] if bottleneck else [])]
            ub, split = min(((mixed_split_value(tb, sp, cf.vpp, cf.grad_accum, objective, share), sp) for sp in splits),
                            key=lambda x: x[0])
            caps.add(ub)
            kept[i] = _Found(lb, ub, split if np.isfinite(ub) else None, tb)
        if stopped:
            break
    return _bounded(space, kept, caps.cap, stopped)


def _even_cap(problem: Problem, space: Space) -> float:
    """The K-th best objective of the even splits (the forced ones where a configuration has one)
    of the first ``2 K`` configurations in the visit's order (inf when fewer fit): K plans, so a
    cap the visit may start from.

    The configurations the visit meets before it knows K plans would otherwise have tables
    of every stage size (no cap cuts them), by far the largest; an even split's tables hold
    one arc per stage.
    """
    L, k = space.table.blocks, problem.top_k
    first = next(by_lower_bound(space, lambda _: True), [])[:2 * k]
    if not first:  # nothing can fit (a space the time limit cut short may hold no plan)
        return np.inf
    batch, values = space.scored(first), []
    for j, i in enumerate(first):
        cf = space.configs[i]
        split = split_of(batch.configs, j, problem) or split_units(L, cf.pp, cf.vpp, cf.pp_embedding, cf.pp_loss)
        tb = mixed_tables(batch, j, problem.objective, recompute_of(batch.configs, j, problem.fixed_mode),
                          fixed_split=split)
        values.append(mixed_split_value(tb, list(split), cf.vpp, cf.grad_accum, problem.objective,
                                         BUBBLE_SHARE[cf.schedule]))
    return float(np.sort(values)[k - 1]) if len(values) >= k else np.inf
