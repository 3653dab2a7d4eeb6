"""A plan runs with a framework when the framework's config expresses it *and* the plan fits memory
as the framework runs it.  ``--framework any`` searches under one shared costing, so a plan at the
capacity edge may be one that Megatron-LM expresses but runs out of memory with (its fp32 gradients,
its loss fusion that leaves the MLP unfused): it must not be labelled as running with Megatron, and
its bundle must not hold Megatron's arguments.  What such a filtered search proves: the best plan
it keeps is the runnable optimum, the bound its gap is measured from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplace import frameworks
from autoplace.bundle import write_bundle
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.frameworks.search import Runners
from autoplace.plan import Plan, build_plan, parse_plan_string
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from tests.test_cli import H100_64, MODELS, invoke, strict_json

LLAMA_8B = MODELS / "llama-3-8b.json"
# fits under the shared costing (65.5 GiB of 79.7), but not as Megatron-LM runs it (87.4 GiB):
# fp32 gradients, and its fused cross-entropy leaves the SwiGLU unfused
EDGE = "dp=64,tp=1,pp=1,zero=1,mbs=1,fused_loss=true"


def _plan(text: str) -> Plan:
    model = load_model(LLAMA_8B)
    return build_plan(parse_plan_string(text), world=64, blocks=layer_table(model).blocks,
                      global_batch=model.training.global_batch, gpus_per_node=8)


def _fits_as_run_by(name: str, plan: Plan) -> bool:
    model, cluster = load_model(LLAMA_8B), load_cluster(H100_64)
    costed, assumptions = frameworks.get(name).costing(model, DEFAULT)
    return evaluate(costed, cluster, plan, assumptions).fits


def test_a_plan_megatron_expresses_but_runs_out_of_memory_with_does_not_run_with_megatron() -> None:
    model, cluster = load_model(LLAMA_8B), load_cluster(H100_64)
    plan = _plan(EDGE + ",recompute=none")
    assert evaluate(model, cluster, plan).fits and frameworks.get("megatron").refusal(plan, model) is None
    assert not _fits_as_run_by("megatron", plan)
    runners = Runners(model, cluster)
    assert "megatron" not in runners.of(plan)
    [(name, why)] = runners.unfit(plan).items()
    assert name == "megatron" and why.startswith("megatron: out of memory as Megatron-LM runs it (87.")


@pytest.mark.parametrize("text", [EDGE + ",recompute=none", EDGE + ",recompute=full", "dp=64,zero=1,mbs=1",
                                  "dp=32,tp=2,zero=3,mbs=2,recompute=selective", "dp=8,tp=8,zero=1,mbs=4"])
def test_runs_with_means_expresses_and_fits_as_each_framework_runs_it(text: str) -> None:
    model, cluster = load_model(LLAMA_8B), load_cluster(H100_64)
    plan = _plan(text)
    expected = [f for f in frameworks.FRAMEWORKS
                if frameworks.get(f).refusal(plan, model) is None and _fits_as_run_by(f, plan)]
    assert Runners(model, cluster).of(plan) == expected


def test_solve_lists_only_frameworks_each_plan_fits_and_says_why_others_were_left_out() -> None:
    result = invoke("solve", LLAMA_8B, H100_64, "--fix", EDGE, "--top", "3", "--json", "--time-limit", "10")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["plans"]
    for p in doc["plans"]:
        assert p["frameworks"] and all(_fits_as_run_by(f, Plan.from_dict(p)) for f in p["frameworks"])
    # only Megatron-LM expresses the pinned fused loss without compile: the search costs it as Megatron
    # runs it, so it finds no plan Megatron runs out of memory with (tests/test_recipe_costing.py)
    assert {f for p in doc["plans"] for f in p["frameworks"]} == {"megatron"}
    assert not any("out of memory" in n for n in doc["notes"])
    # the same search pinned to no recompute finds nothing any framework runs
    pinned = invoke("solve", LLAMA_8B, H100_64, "--fix", EDGE + ",recompute=none", "--time-limit", "10")
    assert pinned.exit_code == 3, pinned.output


def test_a_bundle_leaves_out_the_framework_that_would_run_out_of_memory(tmp_path: Path) -> None:
    model, cluster = load_model(LLAMA_8B), load_cluster(H100_64)
    ev = evaluate(model, cluster, _plan(EDGE + ",recompute=none"))
    files = write_bundle(ev, model, cluster, tmp_path, unfit=Runners(model, cluster).unfit(ev.plan))
    assert "megatron_args.sh" not in files
    readme = (tmp_path / "README.txt").read_text()
    assert "(not written) megatron: out of memory as Megatron-LM runs it" in readme
    assert "launch scripts run Megatron-LM" not in readme  # nobody left runs it: the user's script


def test_notes_keep_square_brackets_in_the_table() -> None:
    """A reason naming a TOML table ("[compile]": torchtitan's, for a fused loss without compile)
    is printed as text, not read as rich markup."""
    from rich.console import Console

    from autoplace.report import print_solution

    model = load_model(LLAMA_8B)
    why = frameworks.get("torchtitan").refusal(_plan(EDGE + ",recompute=full"), model)
    assert why is not None and "[compile]" in why
    result = invoke("solve", LLAMA_8B, H100_64, "--top", "1", "--json", "--time-limit", "10")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    doc["notes"] = [*doc["notes"], f"1 of the 2 best plans left out: no supported framework can run them (e.g. {why})"]
    console = Console(record=True, width=100)
    print_solution(doc, None, console)
    assert "([compile] components)" in " ".join(console.export_text().split())


def test_check_costs_a_frameworks_config_as_that_framework_runs_it(tmp_path: Path) -> None:
    """The pre-submit hook on Megatron-LM's arguments for the edge plan: out of memory, as Megatron
    runs it, though the same plan fits under the shared costing (and as DeepSpeed would run it)."""
    from autoplace.bundle import emit

    model, cluster = load_model(LLAMA_8B), load_cluster(H100_64)
    plan = _plan(EDGE + ",recompute=none")
    emit(plan, model, cluster, ["megatron"], tmp_path)
    result = invoke("check", tmp_path / "megatron_args.sh", LLAMA_8B, H100_64, "--json")
    assert result.exit_code == 1, result.output
    doc = strict_json(result.stdout)
    assert doc["framework"] == "megatron" and not doc["ok"]
    assert any("out-of-memory" in r or "GiB" in r for r in doc["reasons"]), doc["reasons"]
    ev = evaluate(model, cluster, plan)  # the shared costing says it fits: the hook must not use it for Megatron
    assert ev.ok
    bundle = tmp_path / "megatron_plan.json"
    bundle.write_text(json.dumps({**ev.to_dict(), "framework": "megatron"}))
    framed = strict_json(invoke("check", bundle, LLAMA_8B, H100_64, "--json").stdout)
    assert framed["framework"] == "megatron plan.json" and not framed["ok"]
    bundle.write_text(json.dumps(ev.to_dict()))  # the overall best plan's plan.json: shared costing
    assert strict_json(invoke("check", bundle, LLAMA_8B, H100_64, "--json").stdout)["ok"]


def test_emit_leaves_out_or_warns_about_a_framework_that_would_run_out_of_memory(tmp_path: Path) -> None:
    model, cluster = load_model(LLAMA_8B), load_cluster(H100_64)
    plan_json = tmp_path / "plan.json"
    ev = evaluate(model, cluster, _plan(EDGE + ",recompute=none"))
    plan_json.write_text(json.dumps({**ev.to_dict(), "inputs": {"model": str(LLAMA_8B), "cluster": str(H100_64)}}))
    every = invoke("emit", plan_json, "--out", tmp_path / "all")
    assert every.exit_code == 0, every.output
    assert not (tmp_path / "all" / "megatron_args.sh").exists()
    assert "(not written) megatron: out of memory" in (tmp_path / "all" / "README.txt").read_text()
    asked = invoke("emit", plan_json, "--format", "megatron", "--out", tmp_path / "m")
    assert asked.exit_code == 0, asked.output
    assert (tmp_path / "m" / "megatron_args.sh").is_file()
    assert asked.stderr.strip().startswith("autoplace: warning: megatron: out of memory as Megatron-LM runs it")


def test_the_gap_is_plan_1s_distance_from_the_proven_runnable_optimum() -> None:
    """A proven search's bound is the best plan it keeps (every better one was found and left out),
    so a robust plan 1 reports how far it is from that optimum, and the fastest plan reports 0."""
    result = invoke("solve", LLAMA_8B, "1x8xh100", "--framework", "torchtitan", "--top", "3", "--json",
                    "--time-limit", "10")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["status"] == "optimal" and doc["ranking"]["reordered"]
    fastest = min(p["step_time_s"] for p in doc["plans"])
    assert doc["bound"] == pytest.approx(fastest, rel=1e-6)
    assert doc["gap"] == pytest.approx(1 - fastest / doc["plans"][0]["step_time_s"], abs=1e-6) and doc["gap"] > 0
    fastest_first = strict_json(invoke("solve", LLAMA_8B, "1x8xh100", "--framework", "torchtitan", "--top", "3",
                                       "--json", "--time-limit", "10", "--rank", "fastest").stdout)
    assert fastest_first["gap"] == pytest.approx(0, abs=1e-9)
