"""``autoplace solve`` as named, typed steps, each testable alone.

load (:class:`Inputs`) -> the problem (:func:`build_problem`) -> the search (:func:`run_search`)
-> annotate the plans (:func:`annotate`: who runs each, the 95% band, hints) -> with ``--out``,
each framework's best plan (:func:`search_per_framework`, within what is left of the time limit)
-> the bundles (:func:`write_bundles`, which only writes) -> one solution document.  The CLI only
calls them in this order and prints.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace.frameworks import ANY, NONE, search
from autoplace.ranking import DEFAULT_RANK, depth, rerank
from autoplace.ranking import annotate as annotate_ranking
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec


@dataclass(frozen=True)
class Inputs:
    """What was loaded: the model and cluster, where the model came from (which of its numbers
    are defaults), and how plan.json names both."""

    model: ModelSpec
    cluster: ClusterSpec
    origin: dict[str, Any]
    refs: dict[str, Any]


@dataclass(frozen=True)
class Request:
    """What the user asked the search for (solve's options, validated)."""

    framework: str = ANY
    top: int = 3
    objective: str = "time"
    time_limit_s: float = 10.0
    solver: str = "cpsat"
    fixed: dict[str, Any] = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    workers: int = 2
    seed: int = 0
    assumptions: Any = None
    band: tuple[float, float] | None = None  # the calibration's 95% band, when it has one
    rank: str = DEFAULT_RANK  # robust: simpler plans first within the band (autoplace/ranking.py); fastest
    started: float = field(default_factory=time.perf_counter)

    def budget(self, progress: Any = None, left: float | None = None) -> Any:
        """The solver Budget: the time limit (or what is ``left`` of it), workers, seed."""
        from solvers.problem import Budget

        limit = self.time_limit_s if left is None else max(left, 0.1)
        return Budget(time_limit_s=limit, workers=self.workers, seed=self.seed, progress=progress)

    def left(self) -> float:
        """Seconds of the time limit not yet spent (it bounds the whole command)."""
        return self.time_limit_s - (time.perf_counter() - self.started)

    def search_options(self) -> dict[str, Any]:
        """The Problem fields besides model, cluster, limits and top-K."""
        from autoplace.cost.assumptions import DEFAULT

        # cost to a token budget on a fixed cluster is GPUs x time: the time ranking
        objective = "time" if self.objective == "cost" else self.objective
        return {"objective": objective, "assumptions": self.assumptions or DEFAULT}


def build_problem(inputs: Inputs, request: Request) -> Any:
    """The solver Problem (the model costed as ``request.framework`` runs it)."""
    return search.problem_for(request.framework, inputs.model, inputs.cluster, fixed=dict(request.fixed),
                              features=set(request.features), top_k=depth(request.top, request.rank),
                              **request.search_options())


def run_search(problem: Any, request: Request, progress: Any = None) -> Any:
    """The ranked plans (a ranking.Ranked) within the time limit: the search asks for a few more
    than ``request.top`` and :func:`autoplace.ranking.rerank` orders and cuts them."""
    from solvers.registry import get_solver

    result = search.solve(request.framework, get_solver(request.solver), problem,
                          request.budget(progress, left=request.left()), depth(request.top, request.rank))
    return rerank(result, problem.model, problem.cluster, step_band(problem.cluster, request.band)[0], request.top,
                  request.rank)


def annotate(result: Any, problem: Any, inputs: Inputs, request: Request) -> dict[str, Any]:
    """The solution document (``autoplace.solution/v1``): the plans with who runs each and their
    95% band, notes and the compression hint."""
    from autoplace.cost.layers import layer_table

    m, c = problem.model, inputs.cluster
    runners = _runners(inputs, request).refusals([ev.plan for ev in result.plans])
    doc = {"schema": "autoplace.solution/v1", "status": result.status, "objective": result.objective,
           "solve_seconds": round(time.perf_counter() - request.started, 3), "bound": result.bound, "gap": result.gap,
           "disagreement": result.disagreement, "advice": result.advice, "framework": request.framework,
           "phases_s": {k: round(v, 3) for k, v in result.phases.items()}, "cpsat_model": result.model_size,
           "model": {"name": m.name, "params": int(layer_table(m).params), **inputs.origin}, "cluster": c.summary(),
           "plans": [{**ev.to_dict(rank=i + 1), "frameworks": [f for f, why in runners[i].items() if why is None]}
                     for i, ev in enumerate(result.plans)], "notes": list(result.notes)}
    if request.framework == NONE:
        doc["notes"] = ["theoretical optimum (--framework none): the search ignored what frameworks can run; "
                        "'frameworks' lists who can run each plan", *result.notes]
    # the calibration's prediction interval when it has one (>= 4 trials), else the development set's
    add_band(doc["plans"], c, request.band)
    annotate_ranking(doc, getattr(result, "ranking", {}))
    above_published(doc, result, m, c)
    if result.nearest is not None:
        doc["nearest"] = nearest_doc(result.nearest, problem)
    hint = compression_hint(problem, result)
    if hint:
        doc["notes"].append(hint)
    return doc


def above_published(doc: dict[str, Any], result: Any, model: Any, cluster: ClusterSpec) -> None:
    """Each plan whose MFU is past the best published on its GPU gets ``above_published`` (autoplace.sanity),
    and the best plan's, a warning note naming the term that lifts it."""
    from autoplace.sanity import mfu_check

    for i, (plan, ev) in enumerate(zip(doc["plans"], result.plans, strict=True)):
        above = mfu_check(ev, model, cluster)
        if above is not None:
            plan["above_published"] = above.to_dict()
            if i == 0:
                doc["notes"].insert(0, f"warning: plan 1's {above.line()}")


def nearest_doc(nearest: Any, problem: Any) -> dict[str, Any]:
    """The nearest plan of an infeasible solve (``doc["nearest"]``): the plan, by how much it misses
    device memory (``short_by_bytes``) and host memory (``host_short_by_bytes``), never negative, and
    the pins it does not keep (``breaks``: key, pinned value, the plan's; it keeps them all unless
    the search's own rules differ from the pins')."""
    from solvers.common import broken_pins

    mem, host = nearest.memory, nearest.host
    return {**nearest.to_dict(), "short_by_bytes": max(mem["total"] - mem["capacity"], 0.0),
            "host_short_by_bytes": max(host["offloaded"] - host["capacity"], 0.0),
            "breaks": [{"key": k, "pinned": p, "value": v} for k, p, v in broken_pins(problem, nearest.plan)]}


def _runners(inputs: Inputs, request: Request) -> search.Runners:
    """Who runs the plans: each framework's costing from the model and assumptions as given (a
    single framework's Problem holds its own costing, which must not leak into the others')."""
    return search.Runners(inputs.model, inputs.cluster, request.search_options()["assumptions"])


def add_band(plans: list[dict[str, Any]], cluster: ClusterSpec, calibrated: tuple[float, float] | None) -> None:
    """Each plan's 95% step-time band (``step_time_band_95_s``, :func:`step_band`) and where it
    comes from, in its JSON: solve's plans, evaluate's and explain's plan alike."""
    band, source = step_band(cluster, calibrated)
    for plan in plans:
        plan["step_time_band_95_s"] = [plan["step_time_s"] * band[0], plan["step_time_s"] * band[1]]
        plan["step_time_band_source"] = source


def step_band(cluster: ClusterSpec, calibrated: tuple[float, float] | None) -> tuple[tuple[float, float], str]:
    """The 95% band of a predicted step time: the calibration's when one is given, otherwise
    from the development-set error of the cluster's least well predicted GPU."""
    if calibrated is not None:
        return calibrated, "calibration"
    sigma = max(p.gpu.throughput_error for p in cluster.pools)
    gpu = max(cluster.pools, key=lambda p: p.gpu.throughput_error).gpu.name
    return (math.exp(-1.96 * sigma), math.exp(1.96 * sigma)), f"published runs on {gpu}"


def compression_hint(problem: Any, result: Any) -> str | None:
    """What compression would buy the best plan when the search left it out (cheap: a few evaluations)."""
    if "compress" in problem.features or not result.plans:
        return None
    from autoplace.explain import compression_hint as hint

    model, assumptions = problem.costing_of(result.plans[0].plan)
    return hint(model, problem.cluster, result.plans[0], assumptions)


def add_batch_hint(doc: dict[str, Any], problem: Any, result: Any, request: Request) -> None:
    """When the global batch divides badly among the GPUs, the nearest batches that divide well,
    solved as this solve was (a quarter of the time limit each, within what is left of it), and
    what each gains (autoplace/batch_hint.py): ``batch_hint`` and a note in ``doc``."""
    from autoplace.batch_hint import batch_hint
    from solvers.registry import get_solver

    quick = request.budget(left=min(request.time_limit_s / 4, request.left() / 2))
    deep, band = depth(1, request.rank), step_band(problem.cluster, request.band)[0]
    hint = batch_hint(problem, result, lambda p: rerank(  # each batch's plan ranked as this solve's
        search.solve(request.framework, get_solver(request.solver), p, quick, deep), p.model, p.cluster, band, 1,
        request.rank))
    if hint:
        doc["batch_hint"] = hint
        doc["notes"].append(hint["note"])


# framework -> (its best plan's Evaluation, the model costed as it runs it), or (None, why there is none)
FrameworkBests = dict[str, tuple[Any, Any]]


def search_per_framework(result: Any, inputs: Inputs, request: Request) -> FrameworkBests:
    """Each framework's best plan, searched alone (:func:`autoplace.frameworks.search.best_per_framework`)
    within what is left of the time limit, unless one framework was asked for (its plans are ``result``'s);
    {} when the search found no plan."""
    from solvers.registry import get_solver

    if not result.plans or request.framework not in (ANY, NONE):
        return {}
    left = dataclasses.replace(request.budget(), time_limit_s=max(request.left(), 0.0))  # none: none searched
    band = step_band(inputs.cluster, request.band)[0]
    return search.best_per_framework(inputs.model, inputs.cluster, get_solver(request.solver), left,
                                     fixed=dict(request.fixed), features=set(request.features),
                                     fallback=result.plans[0].plan, depth=depth(1, request.rank),
                                     pick=lambda found, p: rerank(found, p.model, p.cluster, band, 1, request.rank),
                                     **request.search_options())


def write_bundles(doc: dict[str, Any], result: Any, problem: Any, inputs: Inputs, request: Request, out: Path,
                  bests: FrameworkBests) -> dict[str, Any]:
    """Write the best plan's bundle in ``out`` and, unless one framework was asked for, each framework's
    best plan (``bests``, :func:`search_per_framework`) in ``out/<framework>/``; record both in ``doc``.
    Returns framework -> FrameworkBundle."""
    from autoplace.bundle import LAUNCHERS, write_bundle, write_framework_bundles

    best = result.plans[0]
    if request.framework not in (ANY, NONE):  # its files, and launch scripts that run it
        files = write_bundle(best, problem.model, inputs.cluster, out, inputs=inputs.refs,
                             formats=(request.framework, *LAUNCHERS), framework=request.framework)
        doc["bundle"] = {k: str(v) for k, v in files.items()}
        return {}
    unfit = _runners(inputs, request).unfit(best.plan)
    files = write_bundle(best, problem.model, inputs.cluster, out, inputs=inputs.refs, unfit=unfit)
    doc["bundle"] = {k: str(v) for k, v in files.items()}
    per_framework = write_framework_bundles(best, bests, inputs.cluster, out, inputs=inputs.refs)
    doc["framework_bundles"] = {f: b.to_dict() for f, b in per_framework.items()}
    return per_framework


def framework_summary(result: Any, inputs: Inputs, request: Request, bests: FrameworkBests) -> dict[str, Any]:
    """Per framework (``doc["per_framework"]``, for the report): whether it runs the best plan and
    why not (:func:`who_runs`), and its own best plan (:func:`search_per_framework`) -- the plan string, step time and
    ``slowdown`` over the best plan's, as ``--out`` writes it -- or why it has none."""
    best = result.plans[0]
    out = who_runs(_runners(inputs, request), best.plan)
    for name, (ev, costed) in bests.items():
        entry = out.setdefault(name, {"runs_plan": False, "why_not": str(costed) if ev is None else None})
        if ev is None:
            entry["own_best"] = {"reason": str(costed)}
        else:
            entry["own_best"] = {"plan": ev.plan.to_string(), "step_time_s": round(ev.step_time_s, 6),
                                 "slowdown": ev.step_time_s / best.step_time_s - 1.0}
    return out


def who_runs(runners: search.Runners, plan: Any) -> dict[str, Any]:
    """Per framework: ``runs_plan`` and, when it does not, ``why_not`` (its config cannot express
    the plan, or the plan does not fit as it runs it: :class:`search.Runners`)."""
    return {name: {"runs_plan": why is None, "why_not": why} for name, why in runners.refusals([plan])[0].items()}
