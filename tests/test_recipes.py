"""Recipes as plan keys (issue 24): typed in --plan, checked, packed, costed per plan, searched."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from autoplace.cost.candidates import PACKED
from autoplace.errors import SpecError
from autoplace.evaluation import evaluate
from autoplace.frameworks import get
from autoplace.frameworks.search import problem_for
from autoplace.plan import CONFIG_FIELDS, Config, Plan, parse_plan_string
from solvers.space import enumerate_configs
from tests.helpers import gpu_cluster
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan


def test_every_recipe_key_is_a_packed_config_field_and_typed_in_plan_strings() -> None:
    assert set(PACKED) == set(CONFIG_FIELDS)
    values = parse_plan_string("compile=true,fused_loss=false,tp_overlap=async,overlap=false,fp8=rowwise")
    assert values == {"compile": True, "fused_loss": False, "tp_overlap": "async", "overlap": False, "fp8": "rowwise"}
    with pytest.raises(SpecError, match="valid: none, tensorwise"):
        parse_plan_string("fp8=e4m3")
    with pytest.raises(SpecError, match="must be true or false"):
        Config(compile="yes")  # type: ignore[arg-type]


def test_a_plan_keeps_its_recipe_through_its_string_and_json() -> None:
    plan = make_plan("tp=2,zero=3,compile=true,tp_overlap=async,overlap=false,fp8=tensorwise", MODEL, CLUSTER16)
    assert make_plan(plan.to_string(), MODEL, CLUSTER16) == plan
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(SpecError, match="unknown recipe key"):
        Plan.from_dict({**plan.to_dict(), "recipe": {"jit": True}})


def test_each_recipe_key_moves_the_cost_the_way_it_should() -> None:
    plan = make_plan("tp=2,zero=3,mbs=2", MODEL, CLUSTER16)
    base = evaluate(MODEL, CLUSTER16, plan)

    def ev(**keys: Any) -> Any:
        return evaluate(MODEL, CLUSTER16, dataclasses.replace(plan, **keys))

    assert ev(compile=True).step_time_s < base.step_time_s
    assert ev(fused_loss=True).memory["total"] < base.memory["total"]
    assert ev(tp_overlap="async").step_time_s < base.step_time_s
    assert ev(overlap=False).step_time_s > base.step_time_s


def test_fp8_is_searched_only_when_allowed_and_never_without_fp8_units() -> None:
    h100 = gpu_cluster(16, "h100-sxm5-80gb")
    plain = problem_for("megatron", MODEL, h100, fixed={}, features={"cp"})
    assert {r["fp8"] for r in plain.recipes} == {"none"}
    allowed = problem_for("megatron", MODEL, h100, fixed={}, features={"cp", "fp8"})
    assert {r["fp8"] for r in allowed.recipes} == {"none", "delayed", "tensorwise"}
    a100 = problem_for("megatron", MODEL, CLUSTER16, fixed={}, features={"cp", "fp8"})
    assert {r["fp8"] for r in a100.recipes} == {"none"}
    with pytest.raises(SpecError, match="'a100-sxm4-80gb' has no fp8 units"):  # bad input, before any search
        problem_for("megatron", MODEL, CLUSTER16, fixed={"fp8": "delayed"}, features=set())


def test_the_search_takes_each_framework_best_recipe_and_honours_fix() -> None:
    configs = enumerate_configs(problem_for("torchtitan", MODEL, CLUSTER16, fixed={}, features=set()))
    assert all(c.compile and c.fused_loss for c in configs)
    assert all(c.tp_overlap == ("async" if c.tp > 1 else "none") for c in configs)
    fixed = enumerate_configs(problem_for("torchtitan", MODEL, CLUSTER16, fixed={"compile": False}, features=set()))
    assert fixed and not any(c.compile or c.fused_loss or c.tp_overlap != "none" for c in fixed)
    mega = enumerate_configs(problem_for("megatron", MODEL, CLUSTER16, fixed={}, features=set()))
    assert not any(c.compile for c in mega) and all(c.fused_loss for c in mega)
    assert get("megatron").refusal(make_plan("compile=true,zero=1", MODEL, CLUSTER16), MODEL) is not None
