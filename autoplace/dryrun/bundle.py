"""A bundle as ``autoplace dryrun`` reads it: plan.json, the framework its launches run, the model and
cluster the plan was made for, and where the files now say something else than plan.json.

plan.json is the prediction; the files are what runs.  A dry run builds what the files say, and lists
where a user's edits made them differ from the plan (:func:`edits`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplace import frameworks
from autoplace.errors import AutoplaceError, SpecError
from autoplace.frameworks.base import Framework
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

PLAN = "plan.json"


@dataclass(frozen=True)
class Bundle:
    """A bundle directory, read.

    Attributes:
        path: the directory.
        doc: plan.json as written (its predictions: memory_per_stage_bytes, ...).
        framework: the framework its launch scripts run.
        plan: the plan plan.json describes.
        model: the model plan.json's ``inputs`` name, loaded with the same overrides.
        cluster: the cluster plan.json's ``inputs`` name.
    """

    path: Path
    doc: dict[str, Any]
    framework: Framework
    plan: Plan
    model: ModelSpec
    cluster: ClusterSpec

    def predicted(self, stage: int) -> dict[str, Any]:
        """plan.json's memory by state on pipeline stage ``stage`` (its worst stage when not per stage)."""
        stages = self.doc.get("memory_per_stage_bytes")
        if isinstance(stages, list) and 0 <= stage < len(stages) and isinstance(stages[stage], dict):
            return stages[stage]
        worst = self.doc.get("memory_per_device_bytes")
        return worst if isinstance(worst, dict) else {}


def read_bundle(path: Path) -> Bundle:
    """Read the bundle at ``path``.

    Raises:
        SpecError: not a bundle (no plan.json), a plan.json that names no framework its launches run,
            inputs that no longer load, or a plan the reader refuses -- each one line naming the file.
    """
    path = Path(path)
    source = path / PLAN
    if not path.is_dir():
        raise SpecError("not a directory; give the folder `autoplace solve --out DIR` wrote", source=str(path))
    if not source.is_file():
        raise SpecError(f"no {PLAN}: not an autoplace bundle (`autoplace solve --out DIR` writes one)",
                        source=str(path))
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read JSON ({exc})", source=str(source)) from None
    if not isinstance(doc, dict):
        raise SpecError("expected a JSON object", source=str(source))
    model, cluster = _inputs(doc, source)
    framework = _framework(doc, path)
    from autoplace.hook import read_config

    plan = read_config(source, model, cluster).plan
    return Bundle(path, doc, framework, plan, model, cluster)


def edits(bundle: Bundle) -> list[str]:
    """Where the framework's config now says something else than plan.json: one line per plan key
    (the framework's reader reads the file back, as ``autoplace check`` does); [] when they agree."""
    name = bundle.framework.config_file
    if name is None or not (bundle.path / name).is_file():
        return []
    try:
        read = bundle.framework.read(bundle.path / name, bundle.model, bundle.cluster).plan
    except AutoplaceError as exc:
        return [f"{name}: autoplace cannot read it back: {exc}"]
    planned, now = _keys(bundle.plan), _keys(read)
    return [f"{name}: {key}={now.get(key, '(unset)')}, {PLAN}: {key}={planned.get(key, '(unset)')}"
            for key in dict.fromkeys([*planned, *now]) if now.get(key) != planned.get(key)]


def _keys(plan: Plan) -> dict[str, str]:
    """The plan as its ``--plan`` keys and values (plan.to_string())."""
    return dict(item.split("=", 1) for item in plan.to_string().split(","))


def _inputs(doc: dict[str, Any], source: Path) -> tuple[ModelSpec, ClusterSpec]:
    """The model and cluster plan.json's ``inputs`` name (``solve --out`` records them), loaded again."""
    from autoplace.cli_inputs import cluster_from_args
    from autoplace.specs.model import read_model

    inputs = doc.get("inputs")
    if not isinstance(inputs, dict) or not isinstance(inputs.get("model"), str) or not isinstance(
            inputs.get("cluster"), str):
        raise SpecError("inputs: expected {model: PATH, cluster: PATH or NODESxGPUSxGPU} (autoplace solve --out "
                        "records them)", source=str(source))
    model_path = Path(inputs["model"])
    if not model_path.is_file():
        raise SpecError(f"inputs.model: {model_path} does not exist; the dry run reloads the model the plan was "
                        "made for", source=str(source))
    overrides = inputs.get("overrides", {})
    if not isinstance(overrides, dict):
        raise SpecError("inputs.overrides: expected an object", source=str(source))
    model = read_model(model_path, overrides=overrides, overrides_source=f"{source}: inputs.overrides")[0]
    return model, cluster_from_args(Path(inputs["cluster"]))


def _framework(doc: dict[str, Any], path: Path) -> Framework:
    """The framework the launch scripts run: plan.json's ``framework`` (a framework's own bundle), else
    README.txt's "launch scripts run TITLE" (the best plan's bundle)."""
    named = doc.get("framework")
    if isinstance(named, str) and named in frameworks.FRAMEWORKS:
        return frameworks.get(named)
    readme = path / "README.txt"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    for framework in frameworks.all_frameworks():
        if f"launch scripts run {framework.title}\n" in text:
            return framework
    raise SpecError("names no framework its launch scripts run (plan.json has no framework; README.txt no "
                    "'launch scripts run ...' line)", source=str(path / PLAN))
