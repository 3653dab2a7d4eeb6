"""Readers reject unknown and contradictory values with one line naming the file and the key."""

from __future__ import annotations

import json

import pytest

from autoplace.errors import SpecError
from autoplace.frameworks import plan_from_file
from autoplace.frameworks.deepspeed import emit_deepspeed
from autoplace.frameworks.readers import plan_from_accelerate, plan_from_deepspeed
from autoplace.frameworks.torchtitan import plan_from_torchtitan
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan, small_model


def ds(**zero) -> dict:
    """A valid ZeRO config for 16 GPUs with ``zero`` merged into zero_optimization."""
    return {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, **zero}}


DEEPSPEED_BAD = [
    (ds(stage=3, offload_param={"device": "nvme"}), "zero_optimization.offload_param.nvme_path", "needs nvme_path"),
    (ds(offload_optimizer={"device": "cpu", "ratio": 0.5}), "zero_optimization.offload_optimizer.ratio",
     "stage 3 only"),
    (ds(offload_param={"device": "cpu"}), "zero_optimization.offload_param.device", "needs stage 3"),
    (ds(stage=0, offload_optimizer={"device": "cpu"}), "zero_optimization.offload_optimizer.device",
     "stage 1, 2 or 3"),
    (ds(zero_hpz_partition_size=8), "zero_optimization.zero_hpz_partition_size", "stage 3 only"),
    (ds(stage=3, zero_hpz_partition_size=3), "zero_optimization.zero_hpz_partition_size", "must divide"),
    (ds(overlap_com=True), "zero_optimization.overlap_com", "did you mean 'overlap_comm'"),
    (ds(stage=4), "zero_optimization.stage", "0, 1, 2 or 3"),
    ({**ds(), "train_batch_size": 48}, "train_batch_size", r"!= .* \* data-parallel size\(16\) = 64"),
    ({**ds(), "gradient_accumulation_steps": 3, "train_micro_batch_size_per_gpu": None}, "train_batch_size",
     "not a multiple"),
    ({**ds(), "fp16": {"enabled": True}}, "fp16.enabled", "cannot both"),
    ({**ds(), "bf16": {"enabled": False}}, "bf16/fp16", "trains in fp32 but the model's precision recipe"),
    ({**ds(), "amp": {"enabled": True}}, "amp", "removed"),
    ({**ds(), "pipeline": {"stages": 2, "partitions": "uniform"}}, "pipeline.partitions", "silently ignore"),
    ({**ds(), "pipeline": {"activation_checkpoint_interval": 1}}, "pipeline.stages", "PipelineModule"),
    ({**ds(), "activation_checkpointing": {"partition_activation": True}},
     "activation_checkpointing.partition_activation", "did you mean 'partition_activations'"),
    ({**ds(), "sequence_parallel_size": 2}, "sequence_parallel_size", "Ulysses"),
    ({**ds(), "tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.autotp_size", "does not divide"),
]


@pytest.mark.parametrize("cfg, field, message", DEEPSPEED_BAD, ids=[f for _, f, _ in DEEPSPEED_BAD])
def test_deepspeed_reader_rejects(cfg: dict, field: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as err:
        plan_from_deepspeed(cfg, MODEL, CLUSTER16)
    assert err.value.field == field and err.value.source == "<deepspeed config>"


def test_deepspeed_reader_names_the_file(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ds(), "zero_optimisation": {}}))
    with pytest.raises(SpecError) as err:
        plan_from_file(path, MODEL, CLUSTER16)
    assert str(err.value).startswith(f"{path}: zero_optimisation: unknown key")
    path.write_text("{not json")
    with pytest.raises(SpecError, match=f"{path}: invalid JSON at line 1 column 2"):
        plan_from_deepspeed(path, MODEL, CLUSTER16)


def test_deepspeed_reader_fills_batch_sizes_as_deepspeed_does() -> None:
    plan = plan_from_deepspeed({"train_batch_size": 64, "gradient_accumulation_steps": 2,
                                "bf16": {"enabled": True}}, MODEL, CLUSTER16)
    assert (plan.mbs, plan.grad_accum, plan.dp) == (2, 2, 16)
    legacy = plan_from_deepspeed(ds(stage=3, cpu_offload=True), MODEL, CLUSTER16)
    assert legacy.offload_optimizer == "cpu"


def test_deepspeed_reader_takes_what_the_config_cannot_say_from_arguments() -> None:
    plan = make_plan("pp=2,zero=1,recompute=selective,sp=false", MODEL, CLUSTER16)
    cfg = emit_deepspeed(plan, MODEL, CLUSTER16)
    del cfg["pipeline"]["stages"]
    back = plan_from_deepspeed(cfg, MODEL, CLUSTER16, pp=2, recompute="selective")
    assert back == plan
    with pytest.raises(SpecError, match="pipeline.stages is 2 but pp=4"):
        plan_from_deepspeed(emit_deepspeed(plan, MODEL, CLUSTER16), MODEL, CLUSTER16, pp=4)


def acc(**extra) -> dict:
    return {"distributed_type": "FSDP", "num_processes": 16, "num_machines": 2, "mixed_precision": "bf16",
            "fsdp_config": {"fsdp_version": 2}, **extra}


ACCELERATE_BAD = [
    (acc(num_proceses=16), "num_proceses", "did you mean 'num_processes'"),
    (acc(distributed_type="DEEPSPEED"), "distributed_type", "is not valid"),
    (acc(mixed_precision="fp16"), "mixed_precision", "trains in fp16"),
    (acc(parallelism_config={"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 4}),
     "parallelism_config", r"!= num_processes\(16\)"),
    (acc(fsdp_config={"fsdp_version": 2, "fsdp_offload_param": True}), "fsdp_config.fsdp_offload_param",
     "did you mean 'fsdp_offload_params'"),
    (acc(fsdp_config={"fsdp_version": 1, "fsdp_sharding_strategy": "FULL"}), "fsdp_config.fsdp_sharding_strategy",
     "not valid"),
    (acc(distributed_type="MULTI_GPU", parallelism_config={"parallelism_config_dp_shard_size": 16}),
     "parallelism_config.parallelism_config_dp_shard_size", "without FSDP"),
    (acc(num_processes=None), "num_processes", "required"),
]


@pytest.mark.parametrize("cfg, field, message", ACCELERATE_BAD, ids=[f for _, f, _ in ACCELERATE_BAD])
def test_accelerate_reader_rejects(cfg: dict, field: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as err:
        plan_from_accelerate(cfg, MODEL, CLUSTER16)
    assert err.value.field == field


def test_accelerate_reader_fsdp1_names_and_the_batch_from_the_model() -> None:
    plan = plan_from_accelerate(acc(fsdp_config={"fsdp_sharding_strategy": 2}), MODEL, CLUSTER16, mbs=2)
    assert (plan.zero, plan.dp_shard, plan.mbs, plan.grad_accum) == (2, 16, 2, 2)
    with pytest.raises(SpecError, match="global batch 64 is not a multiple of mbs\\*dp = 3\\*16"):
        plan_from_accelerate(acc(), MODEL, CLUSTER16, mbs=3)


# MODEL is none of torchtitan's flavors: a job trains it as the bundle's registered flavor
TITAN_MODEL = {"model": {"name": "llama3", "flavor": "autoplace"},
               "experimental": {"custom_import": "autoplace_torchtitan_model"}}


def test_torchtitan_reader_rejects_unknown_keys_and_bad_splits() -> None:
    base = {**TITAN_MODEL, "training": {"seq_len": 512}}
    cases = [({"parallelism": {"tensor_parallel": 2}}, "parallelism.tensor_parallel", "tensor_parallel_degree"),
             ({"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 8,
                               "module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["layers.2", "output"]]}},
              "parallelism.module_fqns_per_model_part", "once each, in order"),
             ({"activation_checkpoint": {"mode": "memory_budget"}}, "activation_checkpoint.mode", "not modelled"),
             ({"training": {"seq_len": 512, "mixed_precision_param": "float32"}},
              "training.mixed_precision_param", "trains in fp32"),
             ({"parallelism": {"data_parallel_replicate_degree": 8, "tensor_parallel_degree": 2,
                               "data_parallel_shard_degree": 1}}, "parallelism.data_parallel_replicate_degree",
              "1-D only")]
    for patch, field, message in cases:
        with pytest.raises(SpecError, match=message) as err:
            plan_from_torchtitan({**base, **patch}, MODEL, CLUSTER16)
        assert err.value.field == field


def test_torchtitan_defaults_and_default_split() -> None:
    plan = plan_from_torchtitan({**TITAN_MODEL, "training": {"seq_len": 512, "local_batch_size": 2, "global_batch_size": 64},
                                 "parallelism": {"pipeline_parallel_degree": 2}}, MODEL, CLUSTER16)
    # torchtitan: dp_shard = 16 / 2 = 8; FSDP without resharding under PP; default selective (every 2nd layer);
    # 1F1B: one stage per rank, embedding and head each weigh one layer: 10 // 2 = 5 -> 4 and 4 layers;
    # 2 micro-batches of 1 per step (local 2) x 64 / (2 * 8) = 4 accumulation steps = 8 micro-batches
    assert (plan.dp_shard, plan.zero, plan.layers_per_stage, plan.mbs, plan.grad_accum) == (8, 2, (4, 4), 1, 8)
    assert plan.recompute == ("none", "full") * 4


def test_torchtitan_reader_checks_the_job_trains_the_model_file() -> None:
    """Without [model] torchtitan trains llama3 debugmodel; a flavor of other shapes is another model."""
    from autoplace.specs.model import load_model
    from tests.helpers import REPO, gpu_cluster

    base = {"training": {"seq_len": 512}, "parallelism": {"data_parallel_shard_degree": 16}}
    with pytest.raises(SpecError, match=r"has no \[model\] section, so torchtitan trains llama3 debugmodel"):
        plan_from_torchtitan(base, MODEL, CLUSTER16)
    llama8 = load_model(REPO / "tests/data/hf/llama-3.1-8b.json")
    job = {"model": {"name": "llama3", "flavor": "70B"}, "training": {"seq_len": 8192},
           "parallelism": {"data_parallel_shard_degree": 8}}
    with pytest.raises(SpecError, match=r"says torchtitan trains llama3 70B, but the model file is llama-3.1-8b "
                                        r"\(torchtitan llama3 flavor 8B\)"):
        plan_from_torchtitan(job, llama8, gpu_cluster(8))
    assert plan_from_torchtitan({**job, "model": {"name": "llama3", "flavor": "8B"}}, llama8, gpu_cluster(8)).zero == 3
    # Llama 3 8B (no RoPE scaling) is not torchtitan's 8B flavor (Llama 3.1's, scaled by 8)
    llama3 = load_model(REPO / "examples/models/llama-3-8b.json")
    with pytest.raises(SpecError, match=r"model file is llama-3-8b \(torchtitan llama3 flavor autoplace\)"):
        plan_from_torchtitan({**job, "model": {"name": "llama3", "flavor": "8B"}}, llama3, gpu_cluster(8))


def test_reader_by_extension_rejects_other_files(tmp_path) -> None:
    with pytest.raises(SpecError, match="expected a DeepSpeed .json"):
        plan_from_file(tmp_path / "job.ini", MODEL, CLUSTER16)
    assert small_model().name == MODEL.name
