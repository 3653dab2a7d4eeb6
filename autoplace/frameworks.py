"""Solving for one training framework: its precision recipe, and only plans its config can express.

``autoplace solve --framework F`` answers "the best plan I can run with F": the model is costed
with the recipe F really uses (FSDP2 keeps fp32 shards and reduces in fp32; DeepSpeed and
Megatron keep 16-bit weights and an fp32 master copy), the search leaves out what F can never
express (its degrees and schedules), and every returned plan is one F's emitter accepts.
``--framework any`` (the default) searches the configurations at least one framework can
express and keeps the plans one can run; ``none`` is the theoretical optimum, unfiltered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from autoplace.capabilities import (
    BF16_RECIPES,
    DENIED_FEATURES,
    FRAMEWORKS,
    PINNED_DEGREES,
    UNIFORM_MODES,
    UNIFORM_RECOMPUTE,
    bf16_recipe,
)
from autoplace.cost.assumptions import DEFAULT
from autoplace.errors import EmitError, Infeasible, SpecError
from autoplace.plan import RECOMPUTE, Config, Plan, even_split
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

ANY, NONE = "any", "none"  # solve --framework: runnable by at least one framework / no filter (theoretical optimum)


def check(framework: str) -> None:
    if framework not in (*FRAMEWORKS, ANY, NONE):
        raise SpecError(f"unknown framework {framework!r}; valid: {', '.join((ANY, NONE, *FRAMEWORKS))}",
                        field="--framework")


def costed_model(model: ModelSpec, framework: str) -> ModelSpec:
    """``model`` with the bf16 recipe ``framework`` implements (other recipes are left alone;
    ``any`` and ``none`` keep the model's own)."""
    if framework in (ANY, NONE):
        return model
    want = bf16_recipe(framework)
    if model.training.precision not in BF16_RECIPES or model.training.precision == want:
        return model
    training = model.training.model_copy(update={"precision": want})
    return model.model_copy(update={"training": training})


def search_limits(framework: str, fixed: dict[str, Any], features: set[str]) -> tuple[dict[str, Any], set[str]]:
    """The user's ``--fix`` values with the framework's pinned degrees added, and the features left.

    Raises:
        SpecError: the user pinned a degree the framework cannot run.
    """
    pins = PINNED_DEGREES.get(framework, {})
    for key, value in pins.items():
        if key in fixed and int(fixed[key]) != value:
            raise SpecError(f"{framework} cannot run {key}={fixed[key]} (it supports only {key}={value})", field="--fix")
    return {**pins, **fixed}, features - DENIED_FEATURES.get(framework, set())


def problem_for(framework: str, model: ModelSpec, cluster: ClusterSpec, *, fixed: dict[str, Any],
                features: set[str], **options: Any) -> Any:
    """The solver Problem for ``framework`` (``any``, ``none`` or a framework name): the model
    costed with its recipe and its communication, its pinned degrees and features, its admissible
    configurations.

    Args:
        options: the other Problem fields (objective, top_k, assumptions, ...).

    Raises:
        SpecError: an unknown framework, or a ``--fix`` the framework cannot run.
        Infeasible: a model the framework does not implement (torchtitan: Llama-style only).
    """
    from solvers.problem import Problem

    check(framework)
    model = costed_model(model, framework)
    if framework in FRAMEWORKS:
        why = unsupported_model(framework, model)
        if why:
            raise Infeasible(why)
        fixed, features = search_limits(framework, fixed, features)
        # and its communication as it runs it (DeepSpeed all-reduces ZeRO-1/2 gradients)
        options = {**options, "assumptions": options.get("assumptions", DEFAULT).for_framework(framework)}
    test = None if framework == NONE else admissible(framework, model)
    return Problem(model, cluster, fixed=fixed, features=frozenset(features), admissible=test, **options)


def unsupported_model(framework: str, model: ModelSpec) -> str | None:
    """Why ``framework`` cannot train ``model`` whatever the plan (its emitter's ``model_refusal``:
    an architecture feature its files cannot state), or None."""
    from autoplace.emit import accelerate, deepspeed, fsdp, megatron, torchtitan

    refusal = {"megatron": megatron.model_refusal, "torchtitan": torchtitan.model_refusal,
               "deepspeed": deepspeed.model_refusal, "fsdp": fsdp.model_refusal,
               "accelerate": accelerate.model_refusal}[framework]
    why = refusal(model)
    return f"{framework}: {why}" if why else None


def _checks(model: ModelSpec) -> dict[str, Callable[[Plan], None]]:
    """The emitter check of each framework that can train ``model``, ``check(plan)`` raising
    EmitError for what it cannot express; the most permissive first (Megatron-LM expresses
    nearly every configuration some framework can in the default space: ``any`` stops there)."""
    from autoplace.emit import accelerate, deepspeed, fsdp, megatron, torchtitan

    checks: dict[str, Callable[[Plan], None]] = {
        "megatron": megatron.check_expressible, "deepspeed": deepspeed.check_expressible,
        "fsdp": fsdp.check_expressible, "accelerate": accelerate.check_expressible}
    if unsupported_model("torchtitan", model) is None:
        checks["torchtitan"] = torchtitan.expressible_check(model)  # the model's own rules judged once
    return {name: check for name, check in checks.items() if unsupported_model(name, model) is None}


def admissible(framework: str, model: ModelSpec) -> Callable[[Config], bool]:
    """A solver configuration filter (``Problem.admissible``): whether ``framework`` -- or, for
    ``any``, at least one supported framework -- can express the configuration (its degrees,
    ZeRO level, schedule and offload), judged on the configuration's plan with an even split
    and no recompute.  Per-layer recompute and uneven splits are checked on the final plans
    (:func:`unexpressible`)."""
    from autoplace.cost.layers import layer_table

    all_checks = _checks(model)
    checks = list(all_checks.values()) if framework == ANY else [all_checks[framework]]
    table = layer_table(model)
    no_recompute = (RECOMPUTE[0],) * table.blocks
    layouts: dict[tuple[int, int], tuple[int, ...]] = {}  # (pp, vpp) -> blocks per stage: one split per depth

    def ok(config: Config) -> bool:
        key = (config.pp, config.vpp)
        if key not in layouts:
            split = even_split(table.blocks, config.pp * config.vpp)
            layouts[key] = tuple(sum(split[s::config.pp]) for s in range(config.pp))  # stage s: chunks s, s+pp, ...
        plan = config.to_plan(layouts[key], no_recompute)
        for check in checks:
            try:
                check(plan)
            except EmitError:
                continue
            return True
        return False

    return ok


def unexpressible(plan: Plan, model: ModelSpec, cluster: ClusterSpec, framework: str) -> str | None:
    """Why ``framework``'s config cannot express ``plan`` (its emitter's reason), or None.
    For ``any``: None when at least one framework can, else every framework's reason."""
    from autoplace.emit import render

    if framework == ANY:
        reasons = [unexpressible(plan, model, cluster, f) for f in FRAMEWORKS]
        return None if None in reasons else "; ".join(_clip(r) for r in reasons if r)
    try:
        render(framework, plan, model, cluster)
    except EmitError as exc:
        return str(exc)
    return None


def _clip(reason: str, limit: int = 100) -> str:
    return reason if len(reason) <= limit else reason[:limit - 3].rstrip() + "..."


def runnable_by(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """The frameworks whose config can express ``plan``."""
    return [f for f in FRAMEWORKS if unexpressible(plan, model, cluster, f) is None]


RESOLVE_SHARE = 0.25  # of --time-limit, kept from the wide search for the uniform re-solves it may need


def solve_for(framework: str, solver: Any, problem: Any, budget: Any, top: int) -> Any:
    """Solve ``problem`` (built with :func:`costed_model`, :func:`search_limits` and
    :func:`admissible`) for ``framework`` (or ``any``) and keep the ``top`` plans it can express.

    The search asks for ``4 * top`` plans (at most 20) because a plan's per-layer choices may
    still be something the framework cannot say; a note counts those left out.  Frameworks that
    recompute all blocks alike are searched once per mode they offer and the plans merged by
    the objective; for the others (and ``any``) those uniform searches run only when none of the
    wide search's per-layer plans can be expressed.
    """
    import dataclasses

    wide = dataclasses.replace(problem, top_k=min(20, 4 * top))
    modes = None if "recompute" in problem.fixed else UNIFORM_RECOMPUTE.get(framework)
    deadline = time.perf_counter() + budget.time_limit_s  # --time-limit bounds every solve below together
    uniform_later = modes is None and "recompute" not in problem.fixed  # may be needed after the wide search
    reserve = RESOLVE_SHARE * budget.time_limit_s if uniform_later else 0.0
    results = _solve_runs(solver, wide, budget, modes, framework, deadline - reserve)
    kept, reasons, plans = _keep(results, problem, framework)
    if not kept and uniform_later:  # every plan found recomputes per layer in a way no one can say
        results += _solve_runs(solver, wide, budget, UNIFORM_MODES, framework, deadline)
        kept, reasons, plans = _keep(results, problem, framework)
    pinned = _deepspeed_splits(wide, plans) if framework == "deepspeed" else []
    for run in pinned:  # the pipeline depths whose best split DeepSpeed cannot pin, searched at its own split
        try:
            results += _solve_runs(solver, run, budget, modes, framework, deadline)
        except Infeasible:  # nothing fits at that split
            continue
    if pinned:
        kept, reasons, plans = _keep(results, problem, framework)
    notes = [note for r in results for note in r.notes]
    if reasons:
        who = "no supported framework can" if framework == ANY else f"{framework} cannot"
        notes.append(f"{len(reasons)} of the {len(plans)} best plans left out: {who} express them "
                     f"(e.g. {reasons[0]})")
    proven = all(r.status in ("optimal", "infeasible") for r in results)
    status = ("optimal" if proven else "feasible") if kept else "infeasible"
    phases: dict[str, float] = {}
    for r in results:
        for name, seconds in r.phases.items():
            phases[name] = phases.get(name, 0.0) + seconds
    return dataclasses.replace(results[0], plans=kept[:top], status=status, notes=notes,
                               wall_s=sum(r.wall_s for r in results),
                               n_evaluated=sum(r.n_evaluated for r in results), phases=phases)


def _deepspeed_splits(problem: Any, plans: list[Any]) -> list[Any]:
    """``problem`` pinned, per pipeline depth among ``plans`` whose split is not the one DeepSpeed's
    PipelineModule makes (emit.deepspeed.deepspeed_split), to that depth and that split: DeepSpeed
    takes no explicit split, so its pipelines are searched at the split it will make."""
    import dataclasses

    from autoplace.emit.deepspeed import deepspeed_split

    if "layers" in problem.fixed:
        return []
    depths = sorted({ev.plan.pp for ev in plans if ev.plan.pp > 1 and tuple(ev.plan.layers_per_stage)
                     != deepspeed_split(sum(ev.plan.layers_per_stage), ev.plan.pp)})
    runs = []
    for pp in depths:
        split = deepspeed_split(sum(plans[0].plan.layers_per_stage), pp)
        runs.append(dataclasses.replace(problem, fixed={**problem.fixed, "pp": pp, "layers": ":".join(map(str, split))}))
    return runs


def _solve_runs(solver: Any, problem: Any, budget: Any, modes: tuple[str, ...] | None, framework: str,
                deadline: float) -> list[Any]:
    """One solve per uniform recompute mode (or one solve), within the deadline; an empty
    admissible space says whose."""
    import dataclasses

    runs = [dataclasses.replace(problem, fixed={**problem.fixed, "recompute": m}) for m in modes] if modes else [problem]
    out = []
    try:
        for k, run in enumerate(runs):  # the runs share what is left of the time limit
            left = max(deadline - time.perf_counter(), 0.1) / (len(runs) - k)
            out.append(solver.solve(run, dataclasses.replace(budget, time_limit_s=left)))
        return out
    except Infeasible as exc:
        who = "some supported framework" if framework == ANY else framework
        raise Infeasible(f"{exc}, among the configurations {who} can run (--framework none shows the "
                         "theoretical optimum)") from None


def _keep(results: list[Any], problem: Any, framework: str) -> tuple[list[Any], list[str], list[Any]]:
    """(plans the framework can express, best first and distinct; reasons for the others; all plans)."""
    from solvers.problem import objective_key

    plans = sorted((ev for r in results for ev in r.plans), key=lambda ev: objective_key(ev, problem.objective))
    kept, reasons, seen = [], [], set()
    for ev in plans:
        key = ev.plan.to_string()
        if key in seen:
            continue
        seen.add(key)
        why = unexpressible(ev.plan, problem.model, problem.cluster, framework)
        if why:
            reasons.append(why)
        else:
            kept.append(ev)
    return kept, reasons, plans
