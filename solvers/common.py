"""What every back end does after its search: build plans, re-score them, explain failure."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from autoplace.evaluation import Evaluation, evaluate_many
from autoplace.plan import RECOMPUTE, Config, Plan
from solvers.problem import Problem, SolveResult, objective_key
from solvers.space import Space, plan_from, split_of, to_candidates


def finish(problem: Problem, space: Space, chosen: list[tuple[Config, list[int], list[Any]]],
           status: str, *, bound: float | None, start: float, n_evaluated: int,
           notes: list[str] | None = None, model_values: list[float] | None = None,
           phases: dict[str, float] | None = None, model_size: dict[str, int] | None = None) -> SolveResult:
    """Re-score the chosen (config, split, recompute counts) with the evaluator; on failure
    find the nearest plan (smallest shortfall among uniform plans) and say what would fit.

    Args:
        model_values: the back end's own objective value of each chosen plan; the largest
            relative difference from the evaluator's is recorded (``disagreement``).
    """
    rescore = time.perf_counter()
    plans = evaluated(problem, [plan_from(cf, space.table, split, modes) for cf, split, modes in chosen])
    disagreement = None
    if model_values:
        rescored = [objective_key(ev, problem.objective)[0] for ev in plans]
        disagreement = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(model_values, rescored, strict=True))
    plans.sort(key=lambda ev: objective_key(ev, problem.objective))
    nearest = None if plans else nearest_plan(problem, space)
    pins_bind = problem.fixed_mode not in (None, FULL) or "layers" in problem.fixed  # else relaxed is nearest
    relaxed = nearest_plan(problem, space, pinned=False) if nearest is not None and pins_bind else None
    return SolveResult(plans=plans, status=status if plans or status == "unknown" else "infeasible", objective=problem.objective,
                       bound=bound, wall_s=time.perf_counter() - start, n_evaluated=n_evaluated, nearest=nearest,
                       notes=notes or [], advice=advice(problem, nearest, relaxed) if nearest else [],
                       disagreement=disagreement,
                       phases={**(phases or {}), "rescore": time.perf_counter() - rescore}, model_size=model_size or {})


def evaluated(problem: Problem, plans: list[Plan]) -> list[Evaluation]:
    """``plans`` by the evaluator, each under its recipe's costing (:meth:`Problem.costing_of`), in order."""
    out: list[Evaluation | None] = [None] * len(plans)
    which = [problem.costing_index(plan) for plan in plans]
    for k in sorted(set(which)):
        model, assumptions = problem.costing(k)
        rows = [i for i, w in enumerate(which) if w == k]
        evs = evaluate_many(model, problem.cluster, [plans[i] for i in rows], assumptions,
                            allow_tp_across_nodes="tp-across-nodes" in problem.features)
        for i, ev in zip(rows, evs, strict=True):
            out[i] = ev
    return [ev for ev in out if ev is not None]


def advice(problem: Problem, nearest: Evaluation, relaxed: Evaluation | None = None) -> list[str]:
    """What would make the nearest plan fit, from its shortfall (docs/ARCHITECTURE.md: infeasible
    output); first, when ``relaxed`` (the nearest plan without the recompute and split pins) fits,
    the pins it drops and what it needs."""
    out = _unpinned(problem, relaxed)
    worst = nearest.memory
    short = worst["total"] - worst["capacity"]
    states = worst["params"] + worst["grads"] + worst["optimizer"]
    host_short = nearest.host["offloaded"] - nearest.host["capacity"]
    host = ([f"its offloaded states need {host_short / 2**30:.1f} GiB per GPU more host memory than each GPU's share "
             f"({nearest.host['capacity'] / 2**30:.1f} GiB): hosts with more memory (host_memory_GB in the cluster "
             "file), more GPUs to shard the offloaded states, or less offload"] if host_short > 0 else [])
    if short <= 0:
        return out + host
    out += [f"the nearest plan misses by {short / 2**30:.1f} GiB per device on stage {nearest.worst_stage}", *host]
    if states > 0:
        # model states shrink about in proportion to the devices sharing them (ZeRO-3 / more stages)
        factor = states / max(states - short, 1e-9) if short < states else float("inf")
        out.append(f"more GPUs of this kind: {_in_nodes(problem, int(np.ceil(problem.cluster.gpus * factor)))}"
                   if np.isfinite(factor) else "more GPUs alone do not help: activations and buffers exceed memory")
    if "offload" not in problem.features:
        out.append("allow CPU offload of optimizer state and parameters (--allow offload)")
    if nearest.plan.recompute_mode != "full":
        out.append("recompute every layer (full)")
    if nearest.plan.mbs > 1:
        out.append("a smaller micro-batch (--fix mbs=1)")
    out.append("a shorter sequence (--seq-len) or a smaller global batch (--global-batch)")
    return out


def _unpinned(problem: Problem, relaxed: Evaluation | None) -> list[str]:
    """The pins to drop for ``relaxed`` (a plan that fits), each with its pinned value and the
    plan's: "without --fix recompute=none (recompute=full instead), dp=1 tp=8 ... fits (36.3 of 79.7 GiB)"."""
    if relaxed is None or not relaxed.ok:
        return []
    breaks = broken_pins(problem, relaxed.plan)
    if not breaks:
        return []
    pins = ", ".join(f"{key}={pinned}" for key, pinned, _ in breaks)
    values = ", ".join(f"{key}={value}" for key, _, value in breaks)
    mem = relaxed.memory
    return [f"without the pin{'s' * (len(breaks) > 1)} {pins} ({values} instead), {_degrees(relaxed.plan)} fits "
            f"({mem['total'] / 2**30:.1f} GiB of {mem['capacity'] / 2**30:.1f} per device)"]


def _degrees(plan: Plan) -> str:
    """``dp=8 tp=8 pp=1 cp=1 ep=1 zero=1``: the degrees and ZeRO level of a plan, as the nearest line names them."""
    return f"dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} ep={plan.ep} zero={plan.zero}"


def _in_nodes(problem: Problem, gpus: int) -> str:
    """``gpus`` GPUs as whole nodes of the cluster's size (when every pool's nodes hold as many
    GPUs), against the cluster's own: "about 8 nodes of 8 GPUs (64 GPUs) instead of 1 (8 GPUs)"."""
    per_node = {pool.gpus_per_node for pool in problem.cluster.pools}
    have = problem.cluster.gpus
    if len(per_node) != 1:
        return f"about {gpus} GPUs instead of {have}"
    g = per_node.pop()
    nodes, now = -(-gpus // g), -(-have // g)
    return (f"about {nodes} node{'s' * (nodes != 1)} of {g} GPUs ({nodes * g} GPUs) instead of "
            f"{now} ({have} GPUs)")


FULL = RECOMPUTE.index("full")


def nearest_plan(problem: Problem, space: Space, *, pinned: bool = True) -> Evaluation:
    """The uniform plan whose fullest stage (or host) misses by the least: every block in the
    recompute mode ``--fix`` pins (else full, the least memory) on the split it pins or the one
    its frameworks make (else even) -- a plan that keeps every pin, so it misses by a positive
    shortfall when the search found none.  ``pinned=False``: full recompute on an even split,
    whatever the recompute and split pins (what dropping them would buy, :func:`advice`)."""
    mode = problem.fixed_mode if pinned and problem.fixed_mode is not None else FULL
    _, short = space.uniform(mode, pinned)
    i = int(np.argmin(short))
    config = space.listed[i]
    split = split_of(space.listed, i, problem) if pinned else None
    if split is None:
        counts = to_candidates([config], space.table, mode=mode).counts[0]
        split = tuple(int(counts[s].sum()) for s in range(config.pp))
    plan = config.to_plan(split, (RECOMPUTE[mode],) * space.table.blocks)
    return evaluated(problem, [plan])[0]


def broken_pins(problem: Problem, plan: Plan) -> list[tuple[str, str, str]]:
    """The pins (``--fix`` and the model file's recipe) ``plan`` does not keep: (key, the pinned
    value, the plan's), as ``--fix`` spells them."""
    out = []
    for key, pinned in problem.fixed.items():
        value = _value_of(plan, key)
        if value is not None and value != _spelled(pinned):
            out.append((key, _spelled(pinned), value))
    return out


def _value_of(plan: Plan, key: str) -> str | None:
    """``plan``'s value of a ``--fix`` key, spelled as ``--fix`` takes it (None: not a plan field)."""
    derived = {"dp": plan.dp, "ga": plan.grad_accum, "layers": ":".join(map(str, plan.layers_per_stage)),
               "recompute": plan.recompute_mode, "recompute_layers": ":".join(r[0] for r in plan.recompute)}
    if key in derived:
        return _spelled(derived[key])
    return _spelled(getattr(plan, key)) if hasattr(plan, key) else None


def _spelled(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
