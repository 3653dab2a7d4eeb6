"""plan -> config -> plan gives the same plan, for the fields each format can state.

Plans come from ``build_plan`` (as the CLI builds them); each format's projection says what
it cannot state and what its reader puts there instead.
"""

from __future__ import annotations

import json
import tomllib

import yaml
from hypothesis import HealthCheck, assume, given, settings

from autoplace.errors import EmitError
from autoplace.frameworks import plan_from_file
from autoplace.frameworks.accelerate import emit_accelerate
from autoplace.frameworks.deepspeed import emit_deepspeed
from autoplace.frameworks.readers import plan_from_accelerate, plan_from_deepspeed
from autoplace.frameworks.torchtitan import emit_torchtitan, plan_from_torchtitan, torchtitan_toml
from autoplace.plan import Plan, even_split
from tests.test_emit_plans import CLUSTER16, LAYERS, MODEL, build, make_plan, plan_values

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


def _emitted(emitter, plan: Plan):
    try:
        return emitter(plan, MODEL, CLUSTER16)
    except EmitError:
        assume(False)


def deepspeed_projection(plan: Plan) -> Plan:
    """DeepSpeed leaves the split to PipelineModule and which layers recompute to the model code."""
    return plan.replace(layers_per_stage=even_split(LAYERS, plan.pp), sp=False, schedule="1f1b",
                        recompute=("full" if plan.recompute_mode != "none" else "none",) * LAYERS)


@SETTINGS
@given(plan_values(tp=(1, 2), pp=(1, 2), zero=(0, 1, 2, 3), recompute="per-layer", offload=("none", "cpu", "nvme"),
                   sp=False, compress=("none", "zeropp")))
def test_deepspeed_round_trip(values) -> None:
    plan = build(values)
    assume(plan is not None)
    cfg = json.loads(json.dumps(_emitted(emit_deepspeed, plan)))
    assert plan_from_deepspeed(cfg, MODEL, CLUSTER16) == deepspeed_projection(plan)


def fsdp_projection(plan: Plan) -> Plan:
    """Without a shard group FSDP is not applied: the job is DDP, ZeRO-0."""
    zero = plan.zero if plan.dp_shard * plan.cp > 1 else 0
    return plan.replace(zero=zero, schedule="1f1b" if plan.pp == 1 else plan.schedule)


@SETTINGS
@given(plan_values(tp=(1, 2, 4), pp=(1,), cp=(1, 2), zero=(0, 2, 3), offload=("none", "cpu"), sp=False))
def test_accelerate_round_trip(values) -> None:
    plan = build(values)
    assume(plan is not None)
    cfg = yaml.safe_load(yaml.safe_dump(_emitted(emit_accelerate, plan)))
    back = plan_from_accelerate(cfg, MODEL, CLUSTER16, mbs=plan.mbs, grad_accum=plan.grad_accum)
    assert back == fsdp_projection(plan).replace(sp=False)


@SETTINGS
@given(plan_values(tp=(1, 2), pp=(1, 2, 4), cp=(1, 2), zero=(0, 2, 3), vpp=True,
                   schedules=("1f1b", "gpipe"), offload=("none", "cpu")))
def test_torchtitan_round_trip(values) -> None:
    plan = build(values)
    assume(plan is not None)
    doc = tomllib.loads(torchtitan_toml(_emitted(emit_torchtitan, plan)))
    assert plan_from_torchtitan(doc, MODEL, CLUSTER16) == fsdp_projection(plan).replace(sp=plan.tp > 1)


def test_uneven_and_interleaved_splits_round_trip_through_torchtitan() -> None:
    for text in ("pp=4,zero=3,layers=1:3:3:1,recompute=full", "pp=2,vpp=2,zero=2,layers=4:4,recompute=selective",
                 "pp=2,vpp=2,zero=3,layers=2:6",
                 "pp=2,zero=3,layers=3:5,recompute_layers=n:f:n:n:f:n:f:n"):
        plan = make_plan(text, MODEL, CLUSTER16)
        doc = tomllib.loads(torchtitan_toml(emit_torchtitan(plan, MODEL, CLUSTER16)))
        assert plan_from_torchtitan(doc, MODEL, CLUSTER16) == plan.replace(sp=False), text


def test_every_other_layer_recompute_uses_torchtitans_layer_option() -> None:
    plan = make_plan("zero=3,recompute_layers=n:f:n:f:n:f:n:f", MODEL, CLUSTER16)
    doc = emit_torchtitan(plan, MODEL, CLUSTER16)
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}


def test_files_round_trip_by_extension(tmp_path) -> None:
    plan = make_plan("zero=3,mbs=2,recompute=full,sp=false", MODEL, CLUSTER16)
    (tmp_path / "ds.json").write_text(json.dumps(emit_deepspeed(plan, MODEL, CLUSTER16)))
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(emit_accelerate(plan, MODEL, CLUSTER16)))
    (tmp_path / "tt.toml").write_text(torchtitan_toml(emit_torchtitan(plan.replace(sp=True), MODEL, CLUSTER16)))
    assert plan_from_file(tmp_path / "ds.json", MODEL, CLUSTER16) == plan
    assert plan_from_file(tmp_path / "tt.toml", MODEL, CLUSTER16) == plan
    assert plan_from_accelerate(tmp_path / "acc.yaml", MODEL, CLUSTER16, mbs=2) == plan


def test_zeropp_round_trips_through_deepspeed_and_stays_apart_from_hsdp() -> None:
    """hpZ alone is DeepSpeed's HSDP (dp_replicate x dp_shard); with quantized weights and gradients it
    is ZeRO++'s secondary shard over the whole data-parallel group (compress=zeropp)."""
    for text in ("zero=3,compress=zeropp,recompute=full", "zero=3,compress=zeropp,offload_optimizer=cpu",
                 "zero=3,preset=hsdp"):
        plan = make_plan(text, MODEL, CLUSTER16)
        cfg = json.loads(json.dumps(emit_deepspeed(plan, MODEL, CLUSTER16)))
        assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 8, text
        assert plan_from_deepspeed(cfg, MODEL, CLUSTER16) == deepspeed_projection(plan), text
