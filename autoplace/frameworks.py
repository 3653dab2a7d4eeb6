"""Solving for one training framework: its precision recipe, and only plans its config can express.

``autoplace solve --framework F`` answers "the best plan I can run with F": the model is costed
with the recipe F really uses (FSDP2 keeps fp32 shards and reduces in fp32; DeepSpeed and
Megatron keep 16-bit weights and an fp32 master copy), the search leaves out what F can never
express (its degrees and schedules), and every returned plan is one F's emitter accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autoplace.errors import EmitError, SpecError
from autoplace.plan import Plan, even_split
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

# ZeRO-style frameworks keep 16-bit weights and an fp32 master copy; FSDP2-based ones keep fp32
# shards whatever the compute dtype (MixedPrecisionPolicy casts on all-gather)
ZERO_FRAMEWORKS = ("deepspeed", "megatron")
FSDP2_FRAMEWORKS = ("torchtitan", "fsdp", "accelerate")
FRAMEWORKS = ZERO_FRAMEWORKS + FSDP2_FRAMEWORKS
_BF16_RECIPES = ("bf16", "bf16-fsdp2")  # specs.model recipe names
# search features the framework never has (solvers.base.FEATURES) and degrees it pins to 1
_DENY = {"deepspeed": {"cp", "interleave"}, "accelerate": {"interleave", "ep"}, "fsdp": {"cp", "ep", "interleave"}}
_PIN = {"accelerate": {"pp": 1, "ep": 1}, "fsdp": {"pp": 1, "cp": 1, "ep": 1}}
# frameworks that recompute every block alike: the search runs once per mode they offer
_UNIFORM_RECOMPUTE = {"accelerate": ("none", "full"), "deepspeed": ("none", "selective", "full")}


def check(framework: str) -> None:
    if framework not in FRAMEWORKS:
        raise SpecError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}", field="--framework")


def bf16_recipe(framework: str) -> str:
    """The bf16 recipe (specs.model) ``framework`` implements."""
    return "bf16-fsdp2" if framework in FSDP2_FRAMEWORKS else "bf16"


def costed_model(model: ModelSpec, framework: str) -> ModelSpec:
    """``model`` with the bf16 recipe ``framework`` implements (other recipes are left alone)."""
    want = bf16_recipe(framework)
    if model.training.precision not in _BF16_RECIPES or model.training.precision == want:
        return model
    training = model.training.model_copy(update={"precision": want})
    return model.model_copy(update={"training": training})


def search_limits(framework: str, fixed: dict[str, Any], features: set[str]) -> tuple[dict[str, Any], set[str]]:
    """The user's ``--fix`` values with the framework's pinned degrees added, and the features left.

    Raises:
        SpecError: the user pinned a degree the framework cannot run.
    """
    pins = _PIN.get(framework, {})
    for key, value in pins.items():
        if key in fixed and int(fixed[key]) != value:
            raise SpecError(f"{framework} cannot run {key}={fixed[key]} (it supports only {key}={value})", field="--fix")
    return {**pins, **fixed}, features - _DENY.get(framework, set())


def admissible(framework: str, model: ModelSpec) -> Callable[[dict[str, Any]], bool]:
    """A solver configuration filter: whether ``framework`` can express the configuration (its
    degrees, ZeRO level, schedule and offload), judged on the configuration's plan with an even
    split and no recompute.  Per-layer recompute and uneven splits are checked on the final
    plans (:func:`unexpressible`)."""
    from autoplace.cost.layers import layer_table
    from autoplace.emit import accelerate, deepspeed, fsdp, megatron, torchtitan
    from solvers.space import plan_from

    checks: dict[str, Callable[[Plan], None]] = {
        "deepspeed": deepspeed.check_expressible, "megatron": megatron.check_expressible,
        "fsdp": fsdp.check_expressible, "accelerate": accelerate.check_expressible,
        "torchtitan": lambda plan: torchtitan.check_expressible(plan, model)}
    check, table = checks[framework], layer_table(model)

    def ok(config: dict[str, Any]) -> bool:
        split = even_split(table.blocks, config["pp"] * config["vpp"])
        stages = [sum(split[s::config["pp"]]) for s in range(config["pp"])]  # stage s holds chunks s, s+pp, ...
        starts = [sum(stages[:s]) for s in range(len(stages))]
        modes = [[[sum(1 for i in range(a, a + n) if table.sequence[i] == k), 0, 0] for k in range(len(table.kinds))]
                 for a, n in zip(starts, stages, strict=True)]
        try:
            check(plan_from(config, table, stages, modes))
        except EmitError:
            return False
        return True

    return ok


def unexpressible(plan: Plan, model: ModelSpec, cluster: ClusterSpec, framework: str) -> str | None:
    """Why ``framework``'s config cannot express ``plan`` (its emitter's reason), or None."""
    from autoplace.emit import render

    try:
        render(framework, plan, model, cluster)
    except EmitError as exc:
        return str(exc)
    return None


def solve_for(framework: str, solver: Any, problem: Any, budget: Any, top: int) -> Any:
    """Solve ``problem`` (built with :func:`costed_model`, :func:`search_limits` and
    :func:`admissible`) for ``framework`` and keep the ``top`` plans its emitter accepts.

    Frameworks that recompute all blocks alike are searched once per mode they offer, and the
    plans merged by the objective.  The search asks for ``4 * top`` plans (at most 20) because a
    plan's per-layer choices may still be something the framework cannot say; a note counts
    those left out.
    """
    import dataclasses

    from solvers.common import objective_key

    wide = dataclasses.replace(problem, top_k=min(20, 4 * top))
    modes = None if "recompute" in problem.fixed else _UNIFORM_RECOMPUTE.get(framework)
    runs = [dataclasses.replace(wide, fixed={**wide.fixed, "recompute": mode}) for mode in modes] if modes else [wide]
    results = [solver.solve(run, budget) for run in runs]
    plans = sorted((ev for r in results for ev in r.plans), key=lambda ev: objective_key(ev, problem.objective))
    notes = [note for r in results for note in r.notes]
    kept, reasons = [], []
    for ev in plans:
        why = unexpressible(ev.plan, problem.model, problem.cluster, framework)
        if why:
            reasons.append(why)
        else:
            kept.append(ev)
    if reasons:
        notes.append(f"{len(reasons)} of the {len(plans)} best plans left out: {framework} cannot express them "
                     f"(e.g. {reasons[0]})")
    proven = all(r.status in ("optimal", "infeasible") for r in results)
    status = ("optimal" if proven else "feasible") if kept else "infeasible"
    return dataclasses.replace(results[0], plans=kept[:top], status=status, notes=notes,
                               wall_s=sum(r.wall_s for r in results),
                               n_evaluated=sum(r.n_evaluated for r in results))
