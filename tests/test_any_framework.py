"""``--framework any`` finds what each framework's own search finds (issue 36).

A framework that takes no explicit layer split (DeepSpeed's PipelineModule balances the blocks
itself) runs a configuration's plans only at its own split, so the search gives a configuration
that only such frameworks express that split (``Problem.forced_split``).  Before, the shared
search chose every configuration's best split freely, the final check refused every plan of the
configurations only DeepSpeed expresses, and a BLOOM-like model (which Megatron-LM and
torchtitan refuse, and whose batch no pp=1 layout divides) was called infeasible.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.errors import AutoplaceError
from autoplace.frameworks import FRAMEWORKS
from autoplace.frameworks.readers import deepspeed_split
from autoplace.frameworks.search import problem_for, solve
from autoplace.plan import Config, even_split
from autoplace.specs.model import model_from_dict
from solvers.problem import DEFAULT_FEATURES, Budget, Problem
from solvers.registry import get_solver
from tests.helpers import REPO, cpsat_and_oracle, gpu_cluster
from tests.test_cli import invoke, strict_json
from tests.test_solvers import _model, _moe_model

BLOOM_176B = REPO / "tests/data/bloom-like-176b.json"


def _bloom(layers: int, hidden: int = 1024, batch: int = 16):
    """A small BLOOM: biases, ALiBi and an embedding LayerNorm (Megatron-LM and torchtitan refuse it)."""
    return model_from_dict({"name": "small-bloom", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                            "heads": 8, "vocab": 8192, "seq_len": 512, "ffn": "gelu", "norm": "layernorm",
                            "bias": True, "tied_embeddings": True, "position": "alibi", "embedding_norm": True,
                            "training": {"global_batch": batch}})


def _best(framework: str, model, cluster, top: int = 1):
    """``solve --framework`` 's result, or None when the framework cannot train the model."""
    try:
        problem = problem_for(framework, model, cluster, fixed={}, features=set(DEFAULT_FEATURES), top_k=top)
        return solve(framework, get_solver("cpsat"), problem, Budget(time_limit_s=60), top)
    except AutoplaceError:
        return None


def test_a_configuration_only_deepspeed_expresses_takes_its_split() -> None:
    """DeepSpeed alone expresses a pipeline of this model (Megatron-LM and torchtitan refuse it,
    FSDP2 and accelerate run no pipeline): its split; one stage, or a model Megatron-LM also
    trains: the search chooses."""
    cluster = gpu_cluster(24)
    problem = problem_for("any", _bloom(10), cluster, fixed={}, features=set(DEFAULT_FEATURES))
    piped = Config(pp=3, dp_shard=8, zero=1)
    assert problem.admissible(piped)
    assert problem.split_of(piped) == deepspeed_split(10, 3) == (4, 3, 3) != even_split(10, 3)
    assert problem.split_of(Config(dp_shard=24 // 3, tp=3, zero=1)) is None
    llama = problem_for("any", _model(10, 1024, 16), cluster, fixed={}, features=set(DEFAULT_FEATURES))
    assert llama.split_of(piped) is None  # Megatron-LM writes any split
    pinned = problem_for("any", _bloom(10), cluster, fixed={"layers": "3:4:3"}, features=set(DEFAULT_FEATURES))
    assert pinned.split_of(piped) == (3, 4, 3)  # --fix layers overrides it


def test_any_finds_the_plan_deepspeeds_own_search_finds() -> None:
    """Small analogues of BLOOM-176B on 384 A100: 10 blocks on 24 GPUs, where ``any`` said
    infeasible, and on 12, where it kept a plan slower than DeepSpeed's own best."""
    for gpus in (24, 12):
        cluster = gpu_cluster(gpus, per_node=8 if gpus == 24 else 4)
        alone, anyone = _best("deepspeed", _bloom(10), cluster), _best("any", _bloom(10), cluster)
        assert alone.plans and anyone.status == "optimal", anyone.notes
        assert anyone.plans[0].plan.to_string() == alone.plans[0].plan.to_string()
        assert anyone.plans[0].plan.layers_per_stage == deepspeed_split(10, anyone.plans[0].plan.pp)
        assert not any("left out" in note for note in anyone.notes)


def test_bloom_176b_on_384_a100_has_a_plan() -> None:
    """The issue's case: ``solve`` said infeasible (exit 3) while ``--framework deepspeed`` planned it."""
    result = invoke("solve", BLOOM_176B, "48x8xa100", "--json", "--top", "1")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    plan = doc["plans"][0]
    assert doc["status"] == "optimal" and plan["frameworks"] == ["deepspeed"]
    assert tuple(plan["layers_per_stage"]) == deepspeed_split(70, plan["degrees"]["pp"])
    assert json.loads(BLOOM_176B.read_text())["layers"] == 70


def _some_split(config: Config) -> tuple[int, ...] | None:
    """Splits forced on some configurations only, as a framework's are (a function of the degrees):
    the first stages one block more, or the last ones."""
    blocks = 8 if config.pp <= 8 else 0
    if config.pp == 1 or not blocks or (config.tp + config.zero + config.dp_shard) % 2:
        return None
    split = deepspeed_split(blocks, config.pp)
    return split if config.zero % 2 else split[::-1]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.sampled_from([1, 2]), gpus=st.sampled_from([4, 8]), objective=st.sampled_from(["time", "memory"]),
       seq=st.sampled_from([1024, 4096]))
def test_cpsat_equals_exhaustive_when_configurations_have_forced_splits(kinds: int, gpus: int, objective: str,
                                                                        seq: int) -> None:
    """CP-SAT's optimum is the oracle's when some configurations' plans must take a given split,
    and every plan either returns takes its configuration's split when it has one."""
    model = _model(8, 1024, 16, seq) if kinds == 1 else _moe_model(8, 1024, 16, seq, dense=1)
    problem = Problem(model, gpu_cluster(gpus, gpu="a100-sxm4-40gb"), objective=objective, top_k=3,
                      features=frozenset({"offload"}), forced_split=_some_split)
    a, b = cpsat_and_oracle(problem)
    for ev in [*a.plans, *b.plans]:
        forced = _some_split(ev.plan)
        assert forced is None or ev.plan.layers_per_stage == forced, ev.plan.to_string()


FAMILIES = {
    "llama": {"ffn": "swiglu", "norm": "rmsnorm"},
    "gpt": {"ffn": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True, "position": "learned",
            "max_position": 2048},
    "bloom": {"ffn": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True, "position": "alibi",
              "embedding_norm": True},
}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(FAMILIES)), layers=st.sampled_from([4, 6, 10]),
       hidden=st.sampled_from([512, 2048]), gpus=st.sampled_from([(4, 4), (6, 2), (12, 4), (24, 8)]),
       batch=st.sampled_from([8, 12, 16]), gpu=st.sampled_from(["a100-sxm4-40gb", "v100-sxm2-32gb"]))
def test_any_is_never_worse_than_a_frameworks_own_search(family: str, layers: int, hidden: int,
                                                          gpus: tuple[int, int], batch: int, gpu: str) -> None:
    """If some framework's own search finds a plan, ``any`` finds one, no slower than the best of
    theirs beyond its own proven gap."""
    model = model_from_dict({"name": family, "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                             "heads": 8, "vocab": 8192, "seq_len": 1024, **FAMILIES[family],
                             "training": {"global_batch": batch}})
    cluster = gpu_cluster(gpus[0], gpu=gpu, per_node=gpus[1])
    found = [r.plans[0].step_time_s for f in FRAMEWORKS if (r := _best(f, model, cluster)) and r.plans]
    anyone = _best("any", model, cluster)
    if not found:
        return
    assert anyone is not None and anyone.plans, (anyone.status, anyone.notes) if anyone else None
    assert anyone.plans[0].step_time_s * (1 - (anyone.gap or 0)) <= min(found) * (1 + 1e-9)


@pytest.mark.xfail(strict=True, reason="--framework any prices a configuration that frameworks which cost apart all "
                   "express (DeepSpeed's bf16 recipe, FSDP2's fp32 shards) with one shared costing; at the host-memory "
                   "edge that costing's best plan is slower than FSDP2's own (26.63 s against 25.28 s here). Searching "
                   "such a configuration once per costing would close it (issue 36, left for a follow-up)")
def test_any_under_the_shared_costing_is_not_slower_than_fsdp_at_the_host_memory_edge() -> None:
    from autoplace.specs.cluster import cluster_from_dict

    model = model_from_dict({"name": "llama", "layers": 32, "hidden": 6144, "ffn_hidden": 4 * 6144, "heads": 8,
                             "vocab": 8192, "seq_len": 4096, "training": {"global_batch": 8}})
    cluster = cluster_from_dict({"name": "2xa100-40gb", "nodes": 1, "gpus_per_node": 2, "gpu": "a100-sxm4-40gb",
                                 "intra_node": "nvlink3", "inter_node": "ib-hdr", "host_memory_GB": 384})
    fsdp, anyone = _best("fsdp", model, cluster), _best("any", model, cluster)
    assert fsdp.plans and anyone.plans
    assert anyone.plans[0].step_time_s <= fsdp.plans[0].step_time_s * (1 + 1e-9)
