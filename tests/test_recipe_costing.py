"""``--framework any`` costs each recipe as the framework that states it runs it: a plan with a
recipe only Megatron-LM states (userbuffers TP-comm overlap) is priced with Megatron's fp32
gradients and unfused SwiGLU, the number ``--framework megatron`` gives the same plan; a recipe
frameworks that cost apart all state keeps the shared costing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace import frameworks
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.frameworks.search import problem_for
from autoplace.plan import Config, Plan
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model, model_from_dict
from solvers.problem import objective_key
from solvers.space import _terms, costing_rows, enumerate_configs, to_candidates
from tests.helpers import cpsat_and_oracle, gpu_cluster
from tests.test_cli import H100_64, MODELS, invoke, strict_json

LLAMA_8B = MODELS / "llama-3-8b.json"
CLUSTER = H100_64


def _any_problem():  # type: ignore[no-untyped-def]
    model, cluster = load_model(LLAMA_8B), load_cluster(CLUSTER)
    return problem_for("any", model, cluster, fixed={"tp": 2, "pp": 1}, features={"offload"})


def test_a_configuration_only_megatron_expresses_is_costed_as_megatron_runs_it() -> None:
    problem = _any_problem()
    megatron = frameworks.get("megatron").costing(problem.model, DEFAULT)
    k = problem.costings.index(megatron) + 1
    userbuffers = Config(tp=2, dp_shard=32, zero=1, sp=True, fused_loss=True, tp_overlap="userbuffers")
    assert problem.admissible(userbuffers) and problem.costing_index(userbuffers) == k
    assert problem.costing_of(userbuffers) == megatron
    # DeepSpeed, FSDP2 and Megatron-LM, which cost apart, all express plain ZeRO-1 data parallelism: shared costing
    plain = Config(dp_shard=64, zero=1)
    assert problem.admissible(plain) and problem.costing_index(plain) == 0


def test_without_a_pipeline_torchtitan_and_fsdp2_cost_alike() -> None:
    """torchtitan's costing differs from FSDP2's only in how its pipelines drive FSDP2 (deferred gradient
    sync) and in its ZeRO-0 (DDP, not FSDP2 over one shard): a compiled ZeRO-2 plan without a pipeline
    that both (and nothing else) run is costed as both run it -- fp32 reduce-scatters -- not under the
    shared costing's 16-bit ones; with a pipeline, as torchtitan."""
    problem = _any_problem()
    flat = Config(tp=2, dp_shard=32, zero=2, sp=True, compile=True)
    k = problem.costing_index(flat)
    assert problem.admissible(flat) and k > 0
    model, assumptions = problem.costing_of(flat)
    assert model.training.precision == "bf16-fsdp2" and not assumptions.pipeline_defers_grad_sync
    table = layer_table(problem.model)
    plan = flat.to_plan([table.blocks], ["none"] * table.blocks)
    priced = [evaluate(m, problem.cluster, plan, a).step_time_s for m, a in (
        problem.costing_of(flat), frameworks.get("fsdp").costing(problem.model, DEFAULT),
        frameworks.get("torchtitan").costing(problem.model, DEFAULT))]
    assert priced[0] == priced[1] == priced[2] != evaluate(problem.model, problem.cluster, plan).step_time_s
    piped = problem_for("any", problem.model, problem.cluster, fixed={"tp": 2, "pp": 2}, features={"offload"})
    deep = Config(tp=2, pp=2, dp_shard=16, zero=2, sp=True, compile=True)
    assert piped.admissible(deep)
    assert piped.costing_of(deep) == frameworks.get("torchtitan").costing(problem.model, DEFAULT)


def test_a_pipeline_that_defers_fsdp_sync_reduce_scatters_once_a_step() -> None:
    """torch.distributed.pipelining holds FSDP2's reduce-scatter to the step's last backward
    (``backward_maybe_with_nosync``; torchtitan's behaviour): ZeRO-2 under a pipeline then moves its
    gradients once a step, as ZeRO-1 does, and none of it is exposed per micro-batch; without the
    deferral, once per micro-batch."""
    model, cluster = load_model(LLAMA_8B), load_cluster(CLUSTER)
    table = layer_table(model)

    def scored(zero: int, defers: bool):  # type: ignore[no-untyped-def]
        shard = 16 if zero else 1
        plan = Config(tp=2, pp=2, dp_shard=shard, dp_replicate=16 // shard, zero=zero, sp=True, grad_accum=8).to_plan(
            [table.blocks // 2] * 2, ["none"] * table.blocks)
        return evaluate(model, cluster, plan, DEFAULT.replace(pipeline_defers_grad_sync=defers))

    deferred, eager, once, ddp = scored(2, True), scored(2, False), scored(1, True), scored(0, True)
    assert deferred.time["zero"] == 0 < eager.time["zero"]
    assert deferred.comm["dp"] == pytest.approx(once.comm["dp"], rel=1e-12)  # a reduce-scatter and a gather a step
    assert deferred.time["dp"] == pytest.approx(once.time["dp"], rel=1e-12) and deferred.time["dp"] > eager.time["dp"]
    # without the deferral 7 more reduce-scatters, each half a ring all-reduce of the same gradients (DDP's)
    assert eager.comm["dp"] - deferred.comm["dp"] == pytest.approx(7 * ddp.comm["dp"] / 2, rel=1e-9)


def test_any_prices_a_megatron_only_plan_as_megatron_does() -> None:
    result = invoke("solve", LLAMA_8B, CLUSTER, "--fix", "tp=2,tp_overlap=userbuffers", "--top", "3", "--json",
                    "--time-limit", "10")
    assert result.exit_code == 0, result.output
    model, cluster = load_model(LLAMA_8B), load_cluster(CLUSTER)
    costed, assumptions = frameworks.get("megatron").costing(model, DEFAULT)
    for p in strict_json(result.stdout)["plans"]:
        plan = Plan.from_dict(p)
        assert plan.tp_overlap == "userbuffers" and p["frameworks"] == ["megatron"]
        assert p["step_time_s"] == pytest.approx(evaluate(costed, cluster, plan, assumptions).step_time_s, rel=1e-6)
        shared = evaluate(model, cluster, plan).step_time_s  # the shared costing prices it apart
        assert shared != pytest.approx(p["step_time_s"], rel=1e-4)
    alone = strict_json(invoke("solve", LLAMA_8B, CLUSTER, "--framework", "megatron", "--fix",
                               "tp=2,tp_overlap=userbuffers", "--top", "1", "--json", "--time-limit", "10").stdout)
    assert alone["plans"][0]["step_time_s"] == pytest.approx(
        strict_json(result.stdout)["plans"][0]["step_time_s"], rel=1e-6)


def test_mixed_costings_score_each_row_as_its_own_costing_alone() -> None:
    """The coefficient tables of rows under several costings are, row by row, those each costing
    gives its rows scored alone."""
    problem = _any_problem()
    configs = enumerate_configs(problem)
    table = layer_table(problem.model)
    cand = to_candidates(configs, table)
    which = costing_rows(problem, configs)
    assert len(set(which.tolist())) >= 2
    mixed = _terms(problem, table, cand, which)
    for k in set(which.tolist()):
        rows = np.flatnonzero(which == k)
        model, assumptions = problem.costing(k)
        alone = _terms(dataclasses.replace(problem, model=model, assumptions=assumptions), table, cand.take(rows))
        for f in dataclasses.fields(mixed):
            got, want = getattr(mixed, f.name), getattr(alone, f.name)
            if isinstance(got, np.ndarray):
                np.testing.assert_array_equal(got[rows], want, err_msg=f.name)
            else:
                assert got == want


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([4, 6]), hidden=st.sampled_from([512, 1024]), gpus=st.sampled_from([4, 8]),
       objective=st.sampled_from(["time", "memory"]), seq=st.sampled_from([512, 2048]))
def test_cpsat_equals_exhaustive_over_several_costings(layers: int, hidden: int, gpus: int, objective: str,
                                                       seq: int) -> None:
    """With each configuration costed as the frameworks that express it run it, CP-SAT's optimum
    is still the oracle's, and each plan's numbers are its own costing's."""
    model = model_from_dict({"name": "small", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                             "heads": 8, "kv_heads": 4, "vocab": 4096, "seq_len": seq, "training": {"global_batch": 16}})
    cluster = gpu_cluster(gpus, gpu="a100-sxm4-40gb")
    problem = dataclasses.replace(problem_for("any", model, cluster, fixed={}, features={"offload", "interleave"}),
                                  objective=objective, top_k=1)
    assert problem.costings
    a, b = cpsat_and_oracle(problem)
    if b.plans:
        for ev in (a.plans[0], b.plans[0]):
            costed, assumptions = problem.costing_of(ev.plan)
            again = evaluate(costed, cluster, ev.plan, assumptions)
            assert objective_key(again, objective) == pytest.approx(objective_key(ev, objective), rel=1e-9)
