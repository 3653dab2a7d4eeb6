"""Bundles as ``solve --out`` writes them, for the dry-run tests: a model file on disk, a plan costed as
the framework runs it, plan.json with its inputs, the framework's files and every launcher."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from autoplace import frameworks
from autoplace.bundle import LAUNCHERS, write_bundle
from autoplace.cli_inputs import cluster_from_args
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.model import read_model


def write_test_bundle(out: Path, model: Path | dict[str, Any], cluster: str, plan: str, framework: str,
                      overrides: dict[str, Any] | None = None) -> Path:
    """``framework``'s bundle of ``plan`` for ``model`` (a model file, or a shorthand dict written to
    ``out``/model.json) on ``cluster`` (NODESxGPUSxGPU or a cluster.yaml), as ``solve --out`` writes it;
    ``overrides``: what solve's flags would change (``method``, ``global_batch``, ...), recorded in plan.json."""
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, dict):
        path = out.parent / f"{out.name}-model.json"
        path.write_text(json.dumps(model))
        model = path
    spec, c = read_model(model, overrides=overrides or {})[0], cluster_from_args(Path(cluster))
    costed, assume = frameworks.get(framework).costing(spec, DEFAULT)
    p = build_plan(parse_plan_string(plan), world=c.gpus, blocks=layer_table(costed).blocks,
                   global_batch=costed.training.global_batch, gpus_per_node=c.gpus_per_node)
    inputs: dict[str, Any] = {"model": str(Path(model).resolve()), "cluster": cluster}
    if overrides:
        inputs["overrides"] = overrides
    write_bundle(evaluate(costed, c, p, assume), costed, c, out, inputs=inputs, formats=(framework, *LAUNCHERS),
                 framework=framework)
    return out


CLUSTER = "1x8xa100-sxm4-80gb"  # 8 ranks: pipelines of 2 and 4 stages, ZeRO over 8


def hf_bundle(root: Path, family: str, plan: str, framework: str, method: str = "full", global_batch: int = 64,
              lora_rank: int | None = None) -> Path:
    """``framework``'s bundle of ``plan`` on 8 A100s for tests/data/hf/``family`` with its layers shrunk (as
    tests/test_architectures.py does), trained with ``method`` (full, lora, qlora) at ``global_batch``, its
    adapters of ``lora_rank`` (None: the model's)."""
    from tests.test_architectures import shrunk

    config = root / f"{Path(family).stem}-shrunk.json"
    if not config.is_file():
        config.write_text(json.dumps(shrunk(family)))
    name = (f"{framework}-{Path(family).stem}-{method}{lora_rank or ''}-{plan.replace(',', '_').replace('=', '')}"
            f"-{global_batch}")
    overrides = {"global_batch": global_batch, **({"method": method} if method != "full" else {}),
                 **({"lora_rank": lora_rank} if lora_rank else {})}
    return write_test_bundle(root / name, config, CLUSTER, plan, framework, overrides=overrides)


def unpadded(bundle: Path, stage: int = 0) -> dict[str, float]:
    """plan.json's bytes per state on ``stage`` as the cost model would predict them without FSDP2's dim-0
    padding (``Assumptions.fsdp2_dim0_padding``): what a test of the padding measures it against."""
    from autoplace.dryrun.bundle import read_bundle

    b = read_bundle(bundle)
    costed, assume = b.framework.costing(b.model, DEFAULT)
    return evaluate(costed, b.cluster, b.plan, assume.replace(fsdp2_dim0_padding=False)).memory_per_stage[stage]


def within(measured: int, predicted: int, tolerance: float) -> bool:
    """Whether ``measured`` agrees with ``predicted`` (0 predicted: 0 measured, as an offloaded state)."""
    return measured == 0 if predicted == 0 else abs(measured / predicted - 1) <= tolerance


def state_cases(cases: Iterable[str], differs: Mapping[tuple[str, str], str]) -> list[Any]:
    """(case, state) parameters for params, grads and optimizer; a strict xfail naming the cost-model term
    where ``differs`` says the cost model counts another thing than the framework allocates."""
    import pytest

    return [pytest.param(case, state, marks=[pytest.mark.xfail(strict=True, reason=differs[case, state])]
                         if (case, state) in differs else [])
            for case in cases for state in ("params", "grads", "optimizer")]
