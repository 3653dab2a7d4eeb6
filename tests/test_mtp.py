"""DeepSeek-V3's multi-token-prediction modules (``mtp_layers``): one block of the model's last kind
plus eh_proj and three norms each, on the stage holding the loss, with an embedding copy there when
that is not the first stage (Megatron-Core 0.16 ``GPTModel``); the frameworks that build the Hugging
Face model train without them.  The Megatron dry run (tests/test_dryrun_megatron.py, deepseek-v3
ep-pp, last stage) checks the bytes against what megatron-core builds."""

from __future__ import annotations

import pytest

from autoplace import frameworks
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.specs.model import TransformerSpec, model_from_dict
from solvers.problem import Problem
from tests.helpers import cpsat_and_oracle, gpu_cluster, score


def _moe(mtp: int, layers: int = 4, hidden: int = 256) -> TransformerSpec:
    model = model_from_dict({"name": "small-moe", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                             "heads": 8, "kv_heads": 4, "vocab": 4096, "seq_len": 512, "mtp_layers": mtp,
                             "moe": {"experts": 4, "top_k": 2, "expert_ffn_hidden": hidden, "first_dense_layers": 1},
                             "training": {"global_batch": 16}}, source="test")
    assert isinstance(model, TransformerSpec)
    return model


def test_the_module_is_a_kind_of_its_own_that_no_pipeline_layer_names() -> None:
    plain, table = layer_table(_moe(0)), layer_table(_moe(1))
    h, v = 256, 4096
    mtp = table.kinds[-1]
    assert (mtp.name, table.mtp, table.blocks) == ("mtp", 1, plain.blocks)
    assert len(table.kinds) - 1 not in table.sequence
    moe = plain.kinds[plain.sequence[-1]]
    # one MoE block, eh_proj (2h -> h) and three RMSNorms; the embedding and the head are shared
    assert mtp.params == moe.params + 2 * h * h + 3 * h
    assert table.params == plain.params + mtp.params
    # its forward adds the projection and one more pass of the output layer
    assert mtp.flops == moe.flops + 2 * 2 * h * h + 2 * h * v


def _last_stage_params(model: TransformerSpec, plan: str, framework: str | None = None) -> float:
    if framework is not None:
        model, _ = frameworks.get(framework).costing(model, DEFAULT)
    return score(model, gpu_cluster(8, gpu="h100-sxm5-80gb"), plan).memory_per_stage[-1]["params"]


@pytest.mark.parametrize("pp", [1, 2])
def test_the_stage_with_the_loss_holds_the_module_and_an_embedding_copy(pp: int) -> None:
    plan = f"tp=2,pp={pp},ep=2,zero=0,mbs=1" + (",layers=2:2" if pp == 2 else "")
    extra = _last_stage_params(_moe(1), plan) - _last_stage_params(_moe(0), plan)
    table = layer_table(_moe(1))
    mtp = table.kinds[-1]
    embedding = table.embed.params_tp / 2 if pp > 1 else 0.0  # the first stage's own when pp == 1
    weights = mtp.params_tp / 2 + mtp.params_rep + mtp.params_expert / (2 * 2) + embedding  # experts: ep, then tp
    assert extra == pytest.approx(weights * 2, rel=1e-9)  # bf16 weights (Megatron's 2 bytes per parameter)


def test_megatron_builds_it_and_the_hugging_face_runners_train_without() -> None:
    model = _moe(1)
    for name in ("deepspeed", "accelerate", "fsdp"):
        assert frameworks.get(name).costing(model, DEFAULT)[0].mtp_layers == 0, name
    assert frameworks.get("megatron").costing(model, DEFAULT)[0].mtp_layers == 1
    plan = "tp=2,pp=2,ep=2,zero=0,mbs=1,layers=2:2"
    assert _last_stage_params(model, plan, "megatron") > _last_stage_params(model, plan, "deepspeed")


@pytest.mark.parametrize("gpus", [4, 8])
def test_cpsat_equals_the_oracle_with_the_module_on_the_last_stage(gpus: int) -> None:
    """The module is a fixed load on one stage (folded into its static terms): the split moves layers
    off that stage, and CP-SAT still finds the oracle's optimum."""
    problem = Problem(_moe(1, layers=6), gpu_cluster(gpus, gpu="a100-sxm4-40gb"), fixed={"pp": 2}, top_k=1)
    a, _ = cpsat_and_oracle(problem)
    plan = a.plans[0].plan
    assert plan.pp == 2 and a.status == "optimal"
