"""Issue 38: dualpipev (DeepSeek-V3's DualPipe in its V form, torch's DualPipeV) as a plan value, costed
(its bubble, its in-flight activations, its expert-parallel all-to-all hidden under the paired chunk),
refused by name by the frameworks that do not run it, searched where the configuration has expert
parallelism, and CP-SAT's optimum the oracle's with it in the space.

torchtitan's own schedule builder on dualpipev plans is in tests/test_emit_torchtitan.py (SCHEDULE_PLANS).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplace.cost.step import BUBBLE_SHARE, bubble_time, pipeline_time
from autoplace.errors import SpecError
from autoplace.evaluation import evaluate
from autoplace.frameworks import get
from autoplace.frameworks.search import problem_for
from autoplace.frameworks.torchtitan import emit_torchtitan, plan_from_torchtitan
from autoplace.plan import SCHEDULES, Plan, parse_plan_string
from autoplace.specs.model import model_from_dict
from solvers import get_solver
from solvers.base import Budget
from solvers.problem import Problem
from tests.helpers import gpu_cluster
from tests.test_cli import A100_8, MODELS, invoke
from tests.test_emit_plans import CLUSTER16, make_plan, small_model
from tests.test_solvers import ALL_FEATURES, _moe_model

MODEL = small_model(batch=64)  # dense, 8 blocks: on pp=2 x dp=8, 8 micro-batches a step
MOE = _moe_model(6, 1024, 16, 2048)  # one dense block, then five MoE blocks of 4 experts, top-2
# a DeepSeek-style model torchtitan pipelines (its deepseek_v3: MLA, YaRN, one dense block, then MoE):
# 8 blocks, so two chunks a rank on pp=2 (DeepSeek-V2-Lite's 27 make none)
LITE = model_from_dict({
    "name": "small-mla-moe", "layers": 8, "hidden": 512, "ffn_hidden": 2048, "heads": 8, "kv_heads": 8,
    "vocab": 4096, "seq_len": 2048,
    "attention": {"type": "mla", "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position": 1024, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1, "mscale_all_dim": 1},
    "moe": {"experts": 8, "top_k": 2, "expert_ffn_hidden": 512, "first_dense_layers": 1},
    "training": {"global_batch": 64}})
# one GPU a node, so the expert-parallel all-to-all crosses InfiniBand HDR: the all-to-all DualPipe hides
EP_CLUSTER = gpu_cluster(4, gpu="a100-sxm4-40gb", per_node=1)


def _rules(text: str) -> set[str]:
    return {v.message for v in evaluate(MODEL, CLUSTER16, make_plan(text, MODEL, CLUSTER16)).violations}


def test_dualpipev_is_a_plan_value_that_round_trips() -> None:
    text = "pp=2,vpp=2,zero=3,schedule=dualpipev"
    plan = make_plan(text, MODEL, CLUSTER16)
    assert plan.schedule == parse_plan_string(text)["schedule"] == "dualpipev"
    assert make_plan(plan.to_string(), MODEL, CLUSTER16) == plan
    assert Plan.from_dict(plan.to_dict()) == plan  # plan.json
    assert not _rules(text)
    assert "dualpipev" in SCHEDULES


@pytest.mark.parametrize("text, rule", [
    ("pp=2,vpp=4,zero=3,schedule=dualpipev", "dualpipev runs exactly 2 chunks per rank, got vpp=4"),
    ("pp=2,zero=3,schedule=dualpipev", "the dualpipev schedule needs vpp > 1"),
    ("pp=4,vpp=2,zero=3,mbs=4,schedule=dualpipev", "dualpipev needs grad_accum(4) >= 2*pp = 8"),
    ("pp=2,vpp=2,zero=3,pp_loss=true,schedule=dualpipev", "pp_loss is modelled on the looped placement's last rank"),
])
def test_dualpipev_states_what_it_needs(text: str, rule: str) -> None:
    assert any(rule in message for message in _rules(text)), _rules(text)


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(2, 32), m=st.integers(1, 256), seed=st.integers(0, 2**31))
def test_dualpipev_never_idles_more_than_1f1b(pp: int, m: int, seed: int) -> None:
    """DeepSeek-V3 report Table 2 at F = B_input = W: DualPipeV's (PP/2 - 1)(F&B + B - 3W) on its two
    chunks a rank is 1/3 of 1F1B's (PP - 1)(F + B) at the same pp and micro-batches, on any stage times;
    ZB-V's (0) is below it, two looped chunks' above."""
    times = np.random.default_rng(seed).uniform(0.0, 1.0, pp)
    one_f1b = bubble_time(times, 1)
    dual = bubble_time(times, 2, BUBBLE_SHARE["dualpipev"])
    assert dual == pytest.approx(one_f1b / 3, abs=1e-12)
    assert bubble_time(times, 2, BUBBLE_SHARE["zbv"]) <= dual <= bubble_time(times, 2) * (1 + 1e-12)
    assert pipeline_time(times, m, 2, BUBBLE_SHARE["dualpipev"]) <= pipeline_time(times, m, 1) * (1 + 1e-12)


def _evaluated(schedule: str, recompute: str = "none"):
    plan = make_plan(f"pp=2,vpp=2,ep=2,zero=1,mbs=1,recompute={recompute},schedule={schedule}", MOE, EP_CLUSTER)
    return evaluate(MOE, EP_CLUSTER, plan)


def test_the_all_to_all_hides_under_the_paired_chunk() -> None:
    """DualPipe runs each chunk's dispatch and combine under its paired chunk's compute (DeepSeek-V3 report
    Sec. 3.2.1): the evaluated ep time falls below ZB-V's, which exposes it, and the bubble
    lies between ZB-V's and interleaved 1F1B's (its share exactly: test_dualpipev_never_idles_more_than_1f1b)."""
    ev = {s: _evaluated(s) for s in ("interleaved", "zbv", "dualpipev")}
    assert ev["zbv"].time["ep"] > 0
    assert ev["dualpipev"].time["ep"] < 0.5 * ev["zbv"].time["ep"]
    assert ev["zbv"].time["bubble"] == 0 < ev["dualpipev"].time["bubble"] < ev["interleaved"].time["bubble"]
    assert ev["dualpipev"].step_time_s < ev["zbv"].step_time_s


def test_dualpipev_holds_pp_plus_one_chunks_and_the_model_once() -> None:
    """DualPipe's table (deepseek-ai/DualPipe README): PP + 1 chunk micro-batches a rank, PP = 2p chunks over
    p ranks -- p + 1/2 whole-stage ones, where ZB-V holds p; parameters 2x of a chunk, i.e. the rank's layers
    once (no copy, unlike the two-direction DualPipe): the same parameter bytes as ZB-V."""
    dense = {s: evaluate(MODEL, CLUSTER16, make_plan(f"pp=4,vpp=2,zero=3,schedule={s}", MODEL, CLUSTER16))
             for s in ("zbv", "dualpipev")}
    zbv, dual = ([stage for stage in dense[s].memory_per_stage] for s in ("zbv", "dualpipev"))
    for r in (1, 2):  # middle ranks: no embedding, no head
        assert dual[r]["activations"] == pytest.approx(zbv[r]["activations"] * 4.5 / 4, rel=1e-9)
        assert dual[r]["params"] == pytest.approx(zbv[r]["params"], rel=1e-12)


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "fsdp", "accelerate"])
def test_frameworks_that_do_not_run_it_refuse_it_by_name(framework: str) -> None:
    plan = make_plan("pp=2,vpp=2,zero=1,schedule=dualpipev", MODEL, CLUSTER16)
    why = get(framework).plan_check(MODEL)(plan)
    assert why is not None and why.startswith(f"{framework}: schedule=dualpipev: ") and "\n" not in why, why


@pytest.mark.parametrize("framework, schedule", [("megatron", "zbv"), ("deepspeed", "dualpipev"),
                                                 ("fsdp", "interleaved-zb")])
def test_a_pinned_schedule_the_framework_does_not_run_is_one_line_exit_2(framework: str, schedule: str) -> None:
    result = invoke("solve", MODELS / "llama-3-8b.json", A100_8, "--framework", framework,
                    "--fix", f"schedule={schedule}")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"--fix: {framework}: schedule={schedule}: " in lines[0], result.output
    assert "its schedules: 1f1b, gpipe, interleaved" in lines[0]


def test_torchtitan_runs_its_all_to_all_overlap_without_activation_checkpointing() -> None:
    """torchtitan 0.2.2 raises on EP + DualPipeV + activation checkpointing (get_dual_pipe_v_flag): its
    check refuses the plan, and its search states no recompute for such a configuration."""
    titan, cluster = get("torchtitan"), gpu_cluster(16)
    plan = make_plan("pp=2,vpp=2,ep=8,zero=2,mbs=1,recompute=full,schedule=dualpipev", LITE, cluster)
    assert "runs without activation checkpointing" in (titan.plan_check(LITE)(plan) or "")
    assert titan.plan_check(LITE)(dataclasses.replace(plan, recompute=("none",) * len(plan.recompute))) is None
    assert titan.recompute_modes(plan) == ("none",)
    assert titan.recompute_modes(dataclasses.replace(plan, schedule="zbv")) == titan.uniform_recompute


@pytest.mark.parametrize("text", ["pp=2,vpp=2,ep=8,zero=2,mbs=1,schedule=dualpipev",
                                  "pp=2,vpp=2,ep=8,zero=2,mbs=1,schedule=dualpipev,layers=2:6"])
def test_torchtitan_emits_the_overlap_and_reads_its_config_back_as_the_plan(text: str) -> None:
    cluster = gpu_cluster(16)
    plan = make_plan(text, LITE, cluster)
    doc = emit_torchtitan(plan, LITE, cluster)
    assert doc["parallelism"]["pipeline_parallel_schedule"] == "DualPipeV"
    assert doc["parallelism"]["pipeline_parallel_expert_parallel_overlap"] is True
    assert doc["activation_checkpoint"]["mode"] == "none"
    assert plan_from_torchtitan(doc, LITE, cluster) == plan
    doc["parallelism"]["pipeline_parallel_expert_parallel_overlap"] = False  # not the schedule the plan prices
    with pytest.raises(SpecError, match="a Plan's dualpipev overlaps the expert-parallel all-to-all"):
        plan_from_torchtitan(doc, LITE, cluster)


def test_searched_only_where_there_is_an_all_to_all_to_hide() -> None:
    """With ep > 1 the V shapes include dualpipev; without expert parallelism they do not (it is ZB-V's V
    with a larger bubble there); torchtitan's search keeps it, Megatron-LM's never builds it."""
    from solvers.space import enumerate_configs

    cluster = gpu_cluster(16)
    for ep, present in ((8, True), (1, False)):
        problem = problem_for("torchtitan", LITE, cluster, fixed={"pp": 2, "ep": ep}, features=set(ALL_FEATURES))
        schedules = {c.schedule for c in enumerate_configs(problem)}
        assert ("dualpipev" in schedules) == present and "zbv" in schedules, schedules
    problem = problem_for("megatron", MOE, EP_CLUSTER, fixed={"pp": 2, "ep": 2}, features=set(ALL_FEATURES))
    assert "dualpipev" not in {c.schedule for c in enumerate_configs(problem)}


def test_cpsat_optimum_equals_exhaustive_with_dualpipev() -> None:
    """Expert parallelism over InfiniBand with pp pinned: the optimum is a dualpipev plan and CP-SAT proves
    the oracle's (and its top 3)."""
    problem = Problem(MOE, EP_CLUSTER, top_k=3, features=ALL_FEATURES, fixed={"pp": 2, "ep": 2})
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=120))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=120))
    assert a.status == b.status == "optimal"
    assert b.plans[0].plan.schedule == "dualpipev"
    assert [ev.step_time_s for ev in a.plans] == pytest.approx([ev.step_time_s for ev in b.plans], rel=1e-6)
