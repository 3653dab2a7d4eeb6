"""The search gives each configuration's plans only the recompute the frameworks that express it
can state (``Problem.recompute_forms``): every block in one mode, full recompute on the first
blocks of a single stage (Megatron-LM's block method), or any mix per layer.  One search finds
the best plan of each form; no framework's plan is left out for its recompute, and no search is
run again per uniform mode."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.frameworks import get
from autoplace.frameworks.search import problem_for, recompute_forms
from autoplace.plan import FIRST_FULL, PER_LAYER, RECOMPUTE, Config
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from solvers.problem import Problem
from tests.helpers import cpsat_and_oracle, gpu_cluster
from tests.test_cli import H100_64, MODELS, REPO, invoke, strict_json
from tests.test_solvers import _model, _moe_model

NONE, SELECTIVE, FULL = (RECOMPUTE.index(m) for m in RECOMPUTE)
ALL_MODES = 1 << NONE | 1 << SELECTIVE | 1 << FULL


def _taken(recompute: tuple[str, ...], forms: int) -> bool:
    """Whether per-block recompute ``recompute`` is one of the forms ``forms``."""
    if forms & 1 << PER_LAYER:
        return True
    if any(forms & 1 << RECOMPUTE.index(mode) and set(recompute) == {mode} for mode in RECOMPUTE):
        return True
    k = recompute.count("full")
    return bool(forms & 1 << FIRST_FULL) and recompute == ("full",) * k + ("none",) * (len(recompute) - k)


def _some_forms(config: Config) -> int:
    """Forms that differ between configurations, as frameworks' do (a fixed function of the degrees
    and sharding: forms are judged per shape, before the micro-batching)."""
    choice = (config.tp * 7 + config.pp * 3 + config.zero + config.dp_shard) % 4
    first = 1 << FIRST_FULL if config.pp == 1 else 1 << NONE | 1 << FULL
    return (1 << PER_LAYER, ALL_MODES, 1 << SELECTIVE | first, 1 << FULL)[choice]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.sampled_from([1, 2]), layers=st.sampled_from([4, 6]), gpus=st.sampled_from([4, 8]),
       objective=st.sampled_from(["time", "memory"]), seq=st.sampled_from([1024, 4096]))
def test_cpsat_equals_exhaustive_when_configurations_take_different_forms(kinds: int, layers: int, gpus: int,
                                                                         objective: str, seq: int) -> None:
    """CP-SAT's optimum is the oracle's when each configuration's plans take only its own forms,
    and every plan either returns is of its configuration's forms."""
    model = _model(layers, 1024, 16, seq) if kinds == 1 else _moe_model(layers, 1024, 16, seq, dense=1)
    cluster = gpu_cluster(gpus, gpu="a100-sxm4-40gb")
    problem = Problem(model, cluster, objective=objective, top_k=3, features=frozenset({"offload", "interleave"}),
                      recompute_forms=_some_forms)
    a, b = cpsat_and_oracle(problem)
    for ev in [*a.plans, *b.plans]:
        assert _taken(ev.plan.recompute, _some_forms(ev.plan)), ev.plan.to_string()


def test_forms_are_what_the_frameworks_that_express_a_configuration_state() -> None:
    """Megatron-LM alone (userbuffers TP overlap): each mode on every block, or its block method
    without a pipeline (which holds none and full); DeepSpeed: each mode on every block; a
    configuration FSDP2 expresses too: any mix per layer."""
    model, cluster = load_model(MODELS / "llama-3-8b.json"), load_cluster(H100_64)
    problem = problem_for("any", model, cluster, fixed={}, features={"offload"})
    base = Config(tp=2, pp=1, dp_shard=32, zero=1, sp=True, tp_overlap="userbuffers", fused_loss=True)
    assert problem.forms(base) == 1 << SELECTIVE | 1 << FIRST_FULL
    assert problem.forms(base.replaced({"pp": 2, "dp_shard": 16})) == ALL_MODES
    assert problem.forms(Config(dp_shard=64, zero=3)) == 1 << PER_LAYER
    megatron, deepspeed = get("megatron"), get("deepspeed")
    assert recompute_forms(deepspeed, base) == ALL_MODES
    assert recompute_forms(megatron, base, recompute_forms(deepspeed, base)) == 1 << SELECTIVE | 1 << FIRST_FULL
    pinned = dataclasses.replace(problem, fixed={"recompute": "full"})
    assert pinned.forms(base) == 1 << PER_LAYER  # the pinned mode, for every configuration


def test_deepseek_v3_is_one_search_whose_plans_all_run() -> None:
    """DeepSeek-V3 on 256 H100: the plans only Megatron-LM expresses take its recompute, so one
    search finds three runnable plans (the widest search used to find per-layer plans no one can
    state, then search again once per uniform mode, four searches in all)."""
    result = invoke("solve", str(REPO / "tests" / "data" / "hf" / "deepseek-v3.json"), "32x8xh100", "--top", "3",
                    "--json")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.output)
    assert doc["status"] == "optimal"
    assert sum("configurations scored" in note for note in doc["notes"]) == 1  # one search
    assert not any("recomputes all layers" in note for note in doc["notes"])  # none left out for its recompute
    assert len(doc["plans"]) == 3 and all(plan["frameworks"] for plan in doc["plans"])
