"""The job-submission hook: plan a job, write its bundle, submit it -- or refuse one that
will run out of memory or break a composition rule.

Entry points for schedulers and wrappers (Slurm cli_filter scripts, CI, submitit):

* :func:`check` -- an existing DeepSpeed / accelerate / torchtitan config (or a plan.json)
  against a model and cluster: ``(ok, evaluation, reasons)``;
* :func:`submit` -- plan (or take a plan), write the bundle, then ``sbatch`` it or launch it
  locally with torchrun;
* :func:`submitit_parameters` -- the executor parameters a submitit job for the plan needs.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.cost.layers import layer_table
from autoplace.errors import AutoplaceError, Infeasible, SpecError
from autoplace.evaluation import Evaluation, evaluate
from autoplace.plan import Plan, build_plan, check_blocks, parse_plan_string, with_pins
from autoplace.specs.cluster import ClusterSpec, fp8_refusal
from autoplace.specs.model import ModelSpec

if TYPE_CHECKING:
    from autoplace.frameworks.base import ReadConfig

GiB = 2**30


@dataclass(frozen=True)
class Submission:
    """What :func:`submit` did: the job id (None for a dry run), the bundle and the command."""

    job_id: str | None
    bundle: Path
    command: list[str]
    evaluation: Evaluation


def reasons(ev: Evaluation) -> list[str]:
    """One line per broken rule, out-of-memory with its shortfall per stage."""
    return [f"{v.rule}: {v.message}" for v in ev.violations]


def plan_for(model: ModelSpec, cluster: ClusterSpec, plan: str | Plan | None = None,
             time_limit_s: float = 10.0) -> Evaluation:
    """The plan to run: ``plan`` as given (a --plan string or a Plan), else CP-SAT's best among
    the plans at least one supported framework can run (``solve --framework any``)."""
    if isinstance(plan, Plan):
        return evaluate(model, cluster, plan)
    if plan:
        values = with_pins(parse_plan_string(plan), model.training.recipe_pins.values(), source="--plan")
        built = build_plan(values, world=cluster.gpus, blocks=layer_table(model).blocks,
                           global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)
        return evaluate(model, cluster, built)
    from autoplace.frameworks import ANY, search
    from solvers.problem import Budget
    from solvers.registry import get_solver

    problem = search.problem_for(ANY, model, cluster, fixed={}, features=_default_features(), top_k=1)
    result = search.solve(ANY, get_solver("cpsat"), problem, Budget(time_limit_s=time_limit_s), 1)
    if not result.plans:
        near = result.nearest
        detail = "; ".join(result.advice) if result.advice else "no plan fits"
        raise Infeasible(f"no plan fits this job ({detail})" + (f"; nearest: {near.plan.to_string()}" if near else ""))
    return result.plans[0]


def read_config(path: str | Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
    """What a plan.json (``solve --out``) or a framework's config (by its suffix) runs."""
    from autoplace.frameworks import FRAMEWORKS
    from autoplace.frameworks import read_config as read_framework_config
    from autoplace.frameworks.base import ReadConfig
    from autoplace.specs._io import read_document

    p = Path(path)
    if p.suffix.lower() == ".json":
        doc = read_document(p, "json")  # bounded in size, strict JSON (no NaN), one value per key
        if "degrees" in doc:
            recipe = doc.get("recipe", {})  # the keys it leaves out: the model file's pins, else the defaults
            if isinstance(recipe, dict):
                doc = {**doc, "recipe": {**model.training.recipe_pins.values(), **recipe}}
            named = doc.get("framework")  # a framework's own bundle (solve --out DIR/<framework>/)
            runner = named if isinstance(named, str) and named in FRAMEWORKS else None
            return ReadConfig(Plan.from_dict(doc, source=str(path)), f"{runner} plan.json" if runner else "plan.json",
                              True, runner=runner)
    try:
        return read_framework_config(p, model, cluster)
    except SpecError as exc:  # a Plan the reader built refused a value: the file's
        if exc.source:
            raise
        raise SpecError(exc.detail, source=str(path), field=exc.field) from None


def _default_features() -> set[str]:
    from solvers.problem import DEFAULT_FEATURES

    return set(DEFAULT_FEATURES)


def plan_from_config(path: str | Path, model: ModelSpec, cluster: ClusterSpec) -> Plan:
    """A Plan from a plan.json (``solve --out``), DeepSpeed JSON, accelerate YAML or torchtitan TOML."""
    return read_config(path, model, cluster).plan


@dataclass(frozen=True)
class Checked:
    """The outcome of :func:`check_config`: the verdict, the evaluation, and what was read how."""

    ok: bool
    evaluation: Evaluation
    reasons: list[str]
    framework: str
    notes: tuple[str, ...]


def check_config(config: str | Path, model: ModelSpec, cluster: ClusterSpec) -> Checked:
    """Pre-submit check of an existing config against the model and cluster.

    The config's own batch numbers are the truth: the plan is judged against the global batch
    the config states (the model file's batch is used only when the config states none).  A
    framework's config (or a framework's plan.json) is costed as that framework runs it: its
    precision recipe and behaviour (Megatron-LM's fp32 gradients, FSDP2's fp32 shards).

    Raises:
        SpecError: the config runs a recipe key at another value than the model file pins
            (``training.recipe``), or fp8 on GPUs without fp8 units -- one line each.
    """
    read = read_config(config, model, cluster)
    check_blocks(read.plan, layer_table(model).blocks, source=str(config))
    with_pins(read.plan.recipe(), model.training.recipe_pins.values(), source=str(config))
    why = fp8_refusal(cluster, read.plan.fp8)
    if why:
        raise SpecError(why, source=str(config), field="fp8")
    if read.batch_stated and read.plan.global_batch != model.training.global_batch:
        from autoplace.specs.model import with_overrides

        model = with_overrides(model, {"global_batch": read.plan.global_batch}, source=str(config))
    from autoplace import frameworks
    from autoplace.cost.assumptions import DEFAULT

    name = read.runner or read.framework
    costed, assumptions = frameworks.get(name).costing(model, DEFAULT) if name in frameworks.FRAMEWORKS else (
        model, DEFAULT)
    ev = evaluate(costed, cluster, read.plan, assumptions)
    return Checked(ev.ok, ev, reasons(ev), read.framework, read.notes)


def check(config: str | Path, model: ModelSpec, cluster: ClusterSpec) -> tuple[bool, Evaluation, list[str]]:
    """Pre-submit check of an existing config: fits and sound -> ``(True, ev, [])`` (see :func:`check_config`)."""
    checked = check_config(config, model, cluster)
    return checked.ok, checked.evaluation, checked.reasons


def submit(model: ModelSpec, cluster: ClusterSpec, script: str | None, args: tuple[str, ...] = (), *,
           scheduler: str = "slurm", out_dir: str | Path = "autoplace-job", plan: str | Plan | None = None,
           dry_run: bool = False, time_limit_s: float = 10.0) -> Submission:
    """Plan, refuse a job that will not fit, write the bundle, and submit it.

    Raises:
        Infeasible: no plan fits, or the given plan breaks a rule (reasons in the message).
        AutoplaceError: the scheduler refused the job or is missing.
    """
    from autoplace.bundle import LAUNCHERS, write_bundle
    from autoplace.emit.launch import Launch
    from autoplace.frameworks.search import Runners

    ev = plan_for(model, cluster, plan, time_limit_s)
    if not ev.ok:
        raise Infeasible("refusing to submit: " + "; ".join(reasons(ev)))
    files = write_bundle(ev, model, cluster, out_dir, Launch(script=script, args=tuple(args)),
                         unfit=Runners(model, cluster).unfit(ev.plan))
    if scheduler == "slurm":  # absolute: the command runs in the bundle directory
        command = ["sbatch", "--parsable", str(files[LAUNCHERS["slurm"][0]].resolve())]
    elif scheduler == "local":
        command = ["bash", str(files[LAUNCHERS["torchrun"][0]].resolve())]
    else:
        raise SpecError(f"unknown scheduler {scheduler!r}; valid: slurm, local", field="scheduler")
    if dry_run:
        return Submission(None, Path(out_dir), command, ev)
    return Submission(_run(command, scheduler, Path(out_dir)), Path(out_dir), command, ev)


def _run(command: list[str], scheduler: str, cwd: Path) -> str:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=None if scheduler == "local" else 60)
    except FileNotFoundError:
        raise AutoplaceError(f"{command[0]} is not installed or not on PATH") from None
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise AutoplaceError(f"{command[0]} failed with exit code {proc.returncode}: {last[0]}")
    if scheduler == "slurm":
        match = re.match(r"\s*(\d+)", proc.stdout)
        if not match:
            raise AutoplaceError(f"sbatch printed no job id: {proc.stdout.strip()!r}")
        return match.group(1)
    return "local"


def submitit_parameters(plan: Plan, cluster: ClusterSpec) -> dict[str, Any]:
    """``executor.update_parameters(**...)`` for a submitit job running ``plan`` (one task per
    GPU, so the job's tasks form the torch.distributed world)."""
    per_node = min(plan.world, cluster.gpus_per_node)
    params: dict[str, Any] = {"nodes": max(1, plan.world // per_node), "tasks_per_node": per_node}
    if any(p.gpu.name != "cpu" for p in cluster.pools):
        params["gpus_per_node"] = per_node
    return params
