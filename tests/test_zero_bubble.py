"""Issue 38: the zero-bubble pipeline schedules (interleaved-zb, zbv) as plan values, costed,
refused by the frameworks that do not run them, emitted for torchtitan and read back, and searched.

torchtitan's own schedule builder on every emitted schedule is in tests/test_emit_torchtitan.py
(SCHEDULE_PLANS); here, what the plan, the cost model, the frameworks and the solvers make of them.
"""

from __future__ import annotations

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
from autoplace.plan import ZERO_BUBBLE, Plan, parse_plan_string
from solvers import get_solver
from solvers.base import Budget
from solvers.problem import Problem
from tests.helpers import gpu_cluster
from tests.test_emit_plans import CLUSTER16, make_plan, small_model
from tests.test_solvers import ALL_FEATURES, _model

MODEL = small_model(batch=64)  # 8 blocks: on pp=2 x dp=8, 8 micro-batches a step


def _rules(text: str) -> set[str]:
    return {v.message for v in evaluate(MODEL, CLUSTER16, make_plan(text, MODEL, CLUSTER16)).violations}


def test_schedules_are_plan_values_that_round_trip() -> None:
    for text in ("pp=2,vpp=2,zero=3,schedule=zbv", "pp=2,vpp=4,zero=3,schedule=interleaved-zb"):
        plan = make_plan(text, MODEL, CLUSTER16)
        assert plan.schedule == parse_plan_string(text)["schedule"]
        assert make_plan(plan.to_string(), MODEL, CLUSTER16) == plan
        assert Plan.from_dict(plan.to_dict()) == plan  # plan.json
        assert not _rules(text)
    with pytest.raises(SpecError, match="'zb1p' is not valid; valid: gpipe, 1f1b, interleaved, interleaved-zb, zbv, dualpipev"):
        parse_plan_string("pp=2,vpp=2,schedule=zb1p")


@pytest.mark.parametrize("text, rule", [
    ("pp=2,vpp=4,zero=3,schedule=zbv", "zbv runs exactly 2 chunks per rank, got vpp=4"),
    ("pp=2,zero=3,schedule=interleaved-zb", "the interleaved-zb schedule needs vpp > 1"),
    ("pp=4,vpp=2,zero=3,mbs=4,schedule=zbv", "zbv needs grad_accum(4) >= 2*pp = 8"),
    ("pp=4,vpp=2,zero=3,mbs=2,ga=3,dp=4,schedule=interleaved-zb",
     "interleaved-zb needs grad_accum(3) to be a multiple of pp(4)"),
])
def test_each_schedule_states_what_it_needs(text: str, rule: str) -> None:
    assert any(rule in message for message in _rules(text)), _rules(text)


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "fsdp", "accelerate"])
@pytest.mark.parametrize("schedule", sorted(ZERO_BUBBLE))
def test_frameworks_that_do_not_run_them_refuse_them_by_name(framework: str, schedule: str) -> None:
    plan = make_plan(f"pp=2,vpp=2,zero=1,schedule={schedule}", MODEL, CLUSTER16)
    why = get(framework).plan_check(MODEL)(plan)
    assert why is not None and why.startswith(f"{framework}: schedule={schedule}: ") and "\n" not in why, why
    assert "zero-bubble" not in problem_for(framework, MODEL, CLUSTER16, fixed={}, features=set(ALL_FEATURES)).features
    assert "zero-bubble" in problem_for("torchtitan", MODEL, CLUSTER16, fixed={}, features=set(ALL_FEATURES)).features


@pytest.mark.parametrize("text", [
    "pp=2,vpp=2,zero=3,schedule=zbv,layers=2:6",  # uneven: module FQNs per stage, in the V's order
    "pp=2,vpp=2,zero=3,schedule=zbv,recompute_layers=n:f:n:f:n:f:n:f",  # every 2nd block, counted down the V
    "pp=2,vpp=4,zero=3,schedule=interleaved-zb,layers=4:4",
])
def test_torchtitan_reads_its_zero_bubble_configs_back_as_the_plan(text: str) -> None:
    plan = make_plan(text, MODEL, CLUSTER16)
    doc = emit_torchtitan(plan, MODEL, CLUSTER16)
    assert plan_from_torchtitan(doc, MODEL, CLUSTER16) == plan


def test_torchtitan_refuses_compile_with_a_split_backward() -> None:
    plan = make_plan("pp=2,vpp=2,zero=3,schedule=zbv,compile=true", MODEL, CLUSTER16)
    assert "ZBVZeroBubble refuses torch.compile'd stage modules" in (get("torchtitan").plan_check(MODEL)(plan) or "")


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(2, 32), v=st.integers(1, 4), m=st.integers(1, 256), seed=st.integers(0, 2**31))
def test_zero_bubble_never_idles_more_than_1f1b(pp: int, v: int, m: int, seed: int) -> None:
    """Qi et al. 2024: ZB1P's bubble is a third of 1F1B's, ZB-V's none (at T_F = T_B = T_W), at the
    same pp, chunks and micro-batches -- on any stage times, and so the step too."""
    times = np.random.default_rng(seed).uniform(0.0, 1.0, pp)
    plain = bubble_time(times, v)
    for schedule in ZERO_BUBBLE:
        share = float(BUBBLE_SHARE[schedule])
        assert bubble_time(times, v, share) <= plain * (1 + 1e-12)
        assert pipeline_time(times, m, v, share) <= pipeline_time(times, m, v) * (1 + 1e-12)
    assert bubble_time(times, v, float(BUBBLE_SHARE["interleaved-zb"])) == pytest.approx(plain / 3)


def test_evaluated_bubble_is_the_schedules() -> None:
    """The evaluator's bubble of one configuration under each schedule: 1/3 of interleaved's under
    interleaved-zb, none under zbv, same compute.  (ZB-V's memory: test_zbv_holds_1f1b_peak_on_every_rank;
    its head on rank 0 is held to torchtitan's own build in tests/test_dryrun_torchtitan.py.)"""
    evs = {s: evaluate(MODEL, CLUSTER16, make_plan(f"pp=2,vpp=2,zero=3,schedule={s}", MODEL, CLUSTER16))
           for s in ("interleaved", "interleaved-zb", "zbv")}
    bubble = {s: ev.time["bubble"] for s, ev in evs.items()}
    assert bubble["interleaved"] > 0
    assert bubble["interleaved-zb"] == pytest.approx(bubble["interleaved"] / 3)
    assert bubble["zbv"] == 0
    assert evs["zbv"].step_time_s < evs["interleaved-zb"].step_time_s < evs["interleaved"].step_time_s


def test_zbv_holds_1f1b_peak_on_every_rank() -> None:
    """ZB-V keeps 1F1B's peak, pp micro-batches, on every rank (Qi et al. 2024, Sec. 6), where 1F1B's
    stage i keeps pp - i: on the middle ranks of pp=4 (no embedding, no head), 4 against 1F1B's 3 and 2."""
    acts = {s: [stage["activations"] for stage in evaluate(MODEL, CLUSTER16, make_plan(
        f"pp=4,zero=3,{s}", MODEL, CLUSTER16)).memory_per_stage] for s in ("vpp=2,schedule=zbv", "schedule=1f1b")}
    zbv, one_f1b = acts["vpp=2,schedule=zbv"], acts["schedule=1f1b"]
    assert zbv[1] == pytest.approx(zbv[2], rel=1e-9)
    assert zbv[1] == pytest.approx(one_f1b[1] * 4 / 3, rel=1e-9)
    assert zbv[2] == pytest.approx(one_f1b[2] * 4 / 2, rel=1e-9)


@pytest.mark.parametrize("fixed, schedule", [({"pp": 4}, "zbv"), ({"pp": 2}, "interleaved-zb")])
def test_cpsat_optimum_equals_exhaustive_with_zero_bubble_schedules(fixed: dict[str, int], schedule: str) -> None:
    """A pipeline the search must use (pp pinned) with every feature on: the optimum is a zero-bubble
    plan and CP-SAT proves the oracle's.  (The pp=4 case caught solvers.bounds pruning ZB-V at 1F1B's
    bubble: CP-SAT kept mbs=1 at 0.152 s, the oracle found mbs=2 at 0.147 s.)"""
    problem = Problem(_model(8, 1024, 16, 2048), gpu_cluster(4, gpu="v100-sxm2-32gb"), top_k=1,
                      features=ALL_FEATURES, fixed=fixed)
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=120))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=120))
    assert a.status == b.status == "optimal"
    assert b.plans[0].plan.schedule == schedule
    assert a.plans[0].step_time_s == pytest.approx(b.plans[0].step_time_s, rel=1e-6)
