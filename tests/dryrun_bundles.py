"""Bundles as ``solve --out`` writes them, for the dry-run tests: a model file on disk, a plan costed as
the framework runs it, plan.json with its inputs, the framework's files and every launcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoplace import frameworks
from autoplace.bundle import LAUNCHERS, write_bundle
from autoplace.cli_inputs import cluster_from_args
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.model import load_model


def write_test_bundle(out: Path, model: Path | dict[str, Any], cluster: str, plan: str, framework: str) -> Path:
    """``framework``'s bundle of ``plan`` for ``model`` (a model file, or a shorthand dict written to
    ``out``/model.json) on ``cluster`` (NODESxGPUSxGPU or a cluster.yaml), as ``solve --out`` writes it."""
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, dict):
        path = out.parent / f"{out.name}-model.json"
        path.write_text(json.dumps(model))
        model = path
    spec, c = load_model(model), cluster_from_args(Path(cluster))
    costed, assume = frameworks.get(framework).costing(spec, DEFAULT)
    p = build_plan(parse_plan_string(plan), world=c.gpus, blocks=layer_table(costed).blocks,
                   global_batch=costed.training.global_batch, gpus_per_node=c.gpus_per_node)
    write_bundle(evaluate(costed, c, p, assume), costed, c, out, inputs={"model": str(Path(model).resolve()),
                                                                         "cluster": cluster},
                 formats=(framework, *LAUNCHERS), framework=framework)
    return out
