"""Bundles: a plan written as the files of the frameworks that run it, with launch scripts that run them.

One orchestrator, :func:`emit`, asks each framework (:mod:`autoplace.frameworks`) for its own
files and the launch line of its program, writes the generic launchers (torchrun, Slurm,
Kubernetes) around the primary framework's program, and a README.txt line per file.
:func:`write_bundle` adds plan.json; :func:`write_framework_bundles` writes each framework's
own best plan (``solve --out``) from the plans a search already found.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplace import frameworks
from autoplace.emit._common import comment_safe
from autoplace.emit.launch import DEFAULT_LAUNCH, Launch, emit_k8s, emit_slurm, emit_torchrun, manifest_yaml
from autoplace.errors import EmitError, SpecError
from autoplace.evaluation import Evaluation
from autoplace.frameworks.base import BundleFile, Framework, Program, user_program
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

__all__ = ["FORMATS", "LAUNCHERS", "FrameworkBundle", "emit", "render", "write_bundle", "write_framework_bundles"]

log = logging.getLogger("autoplace")

# the generic launchers, written around the primary framework's program
LAUNCHERS = {
    "torchrun": ("launch_torchrun.sh", "the job's launch, run on every node (MASTER_ADDR = first node)"),
    "slurm": ("job.sbatch", "Slurm batch script: sbatch job.sbatch"),
    "k8s": ("pytorchjob.yaml", "Kubeflow PyTorchJob manifest: set its image, create the bundle's ConfigMap "
                               "(the manifest's autoplace/bundle annotation), then kubectl apply -f pytorchjob.yaml"),
}
FORMATS = (*frameworks.FRAMEWORKS, *LAUNCHERS)


def recipe_note(framework: Framework, model: ModelSpec) -> str:
    """A README remark when ``framework`` splits the training states differently from the bf16
    recipe the plan was costed with (the totals agree; the split and the bytes moved do not)."""
    precision = model.training.precision
    if model.training.recipe().compute_dtype != "bf16" or precision == framework.bf16_recipe:
        return ""
    return (f" [costed with training.precision {precision}; {framework.title} runs {framework.bf16_recipe}: "
            f"plan with --framework {framework.name} for its exact bytes]")


def primary(plan: Plan, model: ModelSpec, wanted: Sequence[str] = frameworks.FRAMEWORKS) -> Framework | None:
    """The first framework of ``wanted`` (registry order) that runs ``plan``: the launch scripts run it."""
    for name in wanted:
        framework = frameworks.get(name)
        if framework.refusal(plan, model) is None:
            return framework
    return None


def render(fmt: str, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch = DEFAULT_LAUNCH,
           framework: Framework | None = None) -> list[BundleFile]:
    """The files of one format: a framework's own files, or a launcher running ``framework``'s
    program (default: the first framework that runs the plan; the user's script when none does).

    Raises:
        SpecError: an unknown format (the message lists the valid ones).
        EmitError: the framework cannot express the plan.
    """
    if fmt in frameworks.FRAMEWORKS:
        return frameworks.get(fmt).render(plan, model, cluster, launch)
    if fmt not in LAUNCHERS:
        raise SpecError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}", field="format")
    framework = framework or primary(plan, model)
    program = framework.program(plan, model, launch) if framework else Program(user_program(launch))
    name, what = LAUNCHERS[fmt]
    if fmt == "torchrun":
        return [BundleFile(name, what, emit_torchrun(plan, model, cluster, launch, program), executable=True)]
    if fmt == "slurm":
        return [BundleFile(name, what, emit_slurm(plan, model, cluster, launch, program), executable=True)]
    return [BundleFile(name, what, manifest_yaml(emit_k8s(plan, model, cluster, launch, program)))]


def emit(plan: Plan, model: ModelSpec, cluster: ClusterSpec, formats: Sequence[str] | None, out_dir: str | Path,
         *, launch: Launch | None = None, strict: bool | None = None,
         unfit: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Write the files of ``formats`` (all when None) into ``out_dir`` with a README.txt line per file.

    Args:
        plan, model, cluster: what to emit.
        formats: framework names and launchers (FORMATS).  When None, every framework that can
            express the plan writes its files and the others are listed in README.txt with the
            reason; when given, a framework that cannot express the plan raises.  The launchers
            run the first framework of ``formats`` (registry order) that expresses the plan.
        out_dir: the bundle directory (created).
        launch: script, arguments and job name for the launch scripts; a bundle directory
            left at its default (".") is found by the scripts at run time (the bundle moves).
        strict: raise when a format cannot express the plan (default: when ``formats`` is given).
        unfit: frameworks that express the plan but run out of memory running it (name -> why,
            :class:`autoplace.frameworks.search.Runners`): listed in README.txt, not written.

    Returns:
        file name -> path of every file written, README.txt last.

    Raises:
        SpecError: an unknown format name.
        EmitError: a requested format cannot express the plan.
    """
    strict = formats is not None if strict is None else strict
    wanted = list(FORMATS if formats is None else formats)
    for fmt in wanted:
        if fmt not in FORMATS:
            raise SpecError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}", field="format")
    launch = launch or DEFAULT_LAUNCH
    unfit = unfit or {}
    wanted = [f for f in wanted if f not in unfit]
    named = [f for f in wanted if f in frameworks.FRAMEWORKS]
    runner = primary(plan, model, named or [f for f in frameworks.FRAMEWORKS if f not in unfit])
    readme = [f"autoplace bundle for {comment_safe(model.name)} on {comment_safe(cluster.name)}",
              f"plan: {plan.to_string()}"]
    if runner is not None and any(f in LAUNCHERS for f in wanted):
        readme.append(f"launch scripts run {runner.title}")
    readme.append("")
    readme += [_not_written(name, why) for name, why in unfit.items()]
    files: list[BundleFile] = []
    for fmt in dict.fromkeys(wanted):
        try:
            written = render(fmt, plan, model, cluster, launch, runner)
        except EmitError as exc:
            if strict:
                raise
            log.info("not emitted: %s", exc)
            readme.append(_not_written(fmt, str(exc)))
            continue
        note = recipe_note(frameworks.get(fmt), model) if fmt in frameworks.FRAMEWORKS else ""
        files += [BundleFile(f.name, f.what + note, f.text, f.executable) for f in written]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for f in files:
        paths[f.name] = _write(out / f.name, f.text, executable=f.executable)
        readme.append(f"{f.name}: {f.what}")
    (out / "README.txt").write_text("\n".join(readme) + "\n")
    return {**paths, "README.txt": out / "README.txt"}


def _not_written(fmt: str, why: str) -> str:
    """README.txt's line for a format left out (reasons usually start with the framework's name)."""
    return f"(not written) {why}" if why.startswith(f"{fmt}: ") else f"(not written) {fmt}: {why}"


def _write(path: Path, text: str, *, executable: bool) -> Path:
    path.write_text(text)
    if executable:
        path.chmod(0o755)
    return path


def write_bundle(ev: Evaluation, model: ModelSpec, cluster: ClusterSpec, out_dir: str | Path,
                 launch: Launch | None = None, inputs: dict[str, Any] | None = None,
                 formats: Sequence[str] | None = None, framework: str | None = None,
                 unfit: Mapping[str, str] | None = None) -> dict[str, Path]:
    """plan.json plus the files of every framework that can express the plan (README.txt lists them),
    or of ``formats`` only; not of those ``unfit`` names (see :func:`emit`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**ev.to_dict(), **({"framework": framework} if framework else {}), **({"inputs": inputs} if inputs else {})}
    (out / "plan.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    written = emit(ev.plan, model, cluster, formats, out, launch=launch, strict=False, unfit=unfit)
    return {"plan.json": out / "plan.json", **written}


@dataclass(frozen=True)
class FrameworkBundle:
    """One framework's best plan and the files written for it, or why there are none.

    Attributes:
        evaluation: its best plan, costed with the framework's own precision recipe.
        files: file name -> path, plan.json included.
        slowdown: predicted step time over the overall best plan's, minus one (0.05 = 5% slower).
        reason: why nothing was written (no plan the framework can express fits, or a --fix it cannot run).
    """

    evaluation: Evaluation | None = None
    files: dict[str, Path] | None = None
    slowdown: float | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.evaluation is None or self.files is None:
            return {"written": False, "reason": self.reason}
        return {"written": True, "dir": str(self.files["plan.json"].parent),
                "files": {k: str(v) for k, v in self.files.items()}, "slowdown": self.slowdown,
                "plan": self.evaluation.to_dict()}

    def summary(self) -> str:
        """One console line: the folder, its files and the predicted slowdown, or the reason."""
        if self.evaluation is None or self.files is None:
            return f"not written: {self.reason}"
        names = ", ".join(self.files)
        return (f"{self.files['plan.json'].parent}/: {names}; step {self.evaluation.step_time_s:.3f} s "
                f"({self.slowdown:+.1%} vs the best plan)")


def write_framework_bundles(best: Evaluation, per_framework: dict[str, tuple[Any, Any]], cluster: ClusterSpec,
                            out_dir: str | Path, *, launch: Launch | None = None,
                            inputs: dict[str, Any] | None = None) -> dict[str, FrameworkBundle]:
    """Each framework's best plan, with its files, into ``out_dir/<framework>/``.

    Args:
        best: the overall best plan, which each framework's step time is compared with.
        per_framework: name -> (its best Evaluation and the model it was costed with, or None and the reason).
    """
    out: dict[str, FrameworkBundle] = {}
    for name, (ev, costed) in per_framework.items():
        if ev is None:
            out[name] = FrameworkBundle(reason=str(costed))
            continue
        files = write_bundle(ev, costed, cluster, Path(out_dir) / name, launch, inputs,
                             formats=(name, *LAUNCHERS), framework=name)
        out[name] = FrameworkBundle(ev, files, ev.step_time_s / best.step_time_s - 1.0)
    return out
