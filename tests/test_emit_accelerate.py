"""accelerate accepts every emitted YAML: its loader, the launch command's validation, and the plugins.

The path is the one ``accelerate launch --config_file`` takes (ECOSYSTEM.md):
``load_config_from_file`` -> launch parser + ``_validate_launch_command`` ->
``prepare_multi_gpu_env`` -> ``FullyShardedDataParallelPlugin()`` / ``ParallelismConfig()``
built from that environment.  accelerate cannot run FSDP on CPU, so nothing is run.
"""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from autoplace.errors import EmitError, SpecError
from autoplace.frameworks.accelerate import emit_accelerate
from autoplace.frameworks.readers import plan_from_accelerate
from autoplace.frameworks.schema import ACCELERATE_FSDP, ACCELERATE_PARALLELISM, ACCELERATE_TOP_LEVEL
from autoplace.plan import Plan
from tests.helpers import gpu_cluster
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan, small_model

pytest.importorskip("torch", reason="accelerate needs torch")
launch = pytest.importorskip("accelerate.commands.launch", reason="accelerate is not installed")
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file  # noqa: E402
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.launch import prepare_multi_gpu_env  # noqa: E402

PLANS = ["zero=3", "zero=2,recompute=full", "zero=3,offload_optimizer=cpu,offload_params=cpu",
         "zero=3,preset=hsdp", "zero=0", "tp=2,sp=false,zero=3", "tp=4,sp=false,zero=3,preset=hsdp,recompute=full",
         "cp=2,zero=3", "zero=2,mbs=2,dp_replicate=2,dp_shard=8"]


def accelerate_launch_env(cfg: dict, tmp_path, monkeypatch) -> dict[str, str]:
    """Run accelerate's own loading and launch validation on ``cfg``; return the workers' environment."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    args = launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = launch._validate_launch_command(args)
    monkeypatch.setattr("accelerate.utils.launch.is_port_in_use", lambda port: False)
    return prepare_multi_gpu_env(args)


def plugins_from(env: dict[str, str], monkeypatch) -> tuple[FullyShardedDataParallelPlugin | None, tuple[int, ...]]:
    """The FSDP plugin accelerate builds from the launch environment, and the mesh sizes it reads."""
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    fsdp = FullyShardedDataParallelPlugin() if env.get("ACCELERATE_USE_FSDP") == "true" else None
    if int(env.get("PARALLELISM_CONFIG_TP_SIZE", "1")) > 1 and importlib.util.find_spec("transformers") is None:
        # accelerate's TP handler follows the model's transformers tp_plan and refuses to build without it.
        par = tuple(int(env[f"PARALLELISM_CONFIG_{k}_SIZE"]) for k in ("DP_REPLICATE", "DP_SHARD", "TP", "CP"))
    else:
        pc = ParallelismConfig()
        par = (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size)
    return fsdp, par


@pytest.mark.parametrize("text", PLANS)
def test_accelerate_loader_and_launch_validation_accept_emitted_yaml(text: str, tmp_path, monkeypatch) -> None:
    plan = make_plan(text, MODEL, CLUSTER16)
    cfg = emit_accelerate(plan, MODEL, CLUSTER16)
    env = accelerate_launch_env(cfg, tmp_path, monkeypatch)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    fsdp, par = plugins_from(env, monkeypatch)
    if "parallelism_config" in cfg:
        assert par == (plan.dp_replicate, plan.dp_shard, plan.tp, plan.cp)
    else:
        assert par == (1, 1, 1, 1) and plan.tp == plan.cp == 1
    if plan.zero >= 2 and plan.dp_shard * plan.cp > 1:
        _check_fsdp(fsdp, plan)
    else:
        assert fsdp is None and cfg["distributed_type"] == "MULTI_GPU"


def _check_fsdp(fsdp: FullyShardedDataParallelPlugin | None, plan: Plan) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert fsdp is not None and fsdp.fsdp_version == 2
    assert fsdp.reshard_after_forward is (plan.zero == 3)
    assert isinstance(fsdp.cpu_offload, CPUOffloadPolicy) == (plan.offload_params == "cpu")
    assert fsdp.activation_checkpointing == (plan.recompute_mode == "full")


def test_multi_node_yaml_sets_machines_and_all_processes(tmp_path, monkeypatch) -> None:
    plan = make_plan("zero=3", MODEL, CLUSTER16)
    cfg = emit_accelerate(plan, MODEL, CLUSTER16)
    assert (cfg["num_machines"], cfg["num_processes"]) == (2, 16)
    args = launch.launch_command_parser().parse_args(["--config_file", str(tmp_path / "a.yaml"), "train.py"])
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(cfg))
    args, _, _ = launch._validate_launch_command(args)
    monkeypatch.setattr("accelerate.utils.launch.is_port_in_use", lambda port: False)
    prepare_multi_gpu_env(args)
    assert (args.nnodes, args.nproc_per_node) == ("2", "8")


def test_fp16_and_fp32_recipes(tmp_path, monkeypatch) -> None:
    for precision, expected in (("fp16", "fp16"), ("fp32", "no")):
        model = small_model(precision)
        cfg = emit_accelerate(make_plan("zero=3", model, CLUSTER16), model, CLUSTER16)
        assert accelerate_launch_env(cfg, tmp_path, monkeypatch)["ACCELERATE_MIXED_PRECISION"] == expected


def test_what_accelerate_cannot_express_raises() -> None:
    for text, message in [("pp=2,zero=3", "pipeline"), ("zero=1", "optimizer-only"),
                          ("zero=3,recompute=selective", "selective"), ("tp=2,zero=3", "sequence-parallel"),
                          ("zero=3,offload_optimizer=cpu", "together"), ("zero=0,recompute=full", "only under FSDP")]:
        with pytest.raises(EmitError, match=message):
            emit_accelerate(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16)


def test_key_lists_match_accelerate() -> None:
    parser = launch.launch_command_parser()
    dests = {a.dest for a in parser._actions}
    assert {d for d in dests if d.startswith("fsdp_")} | {"fsdp_ignored_modules"} == ACCELERATE_FSDP
    assert {d for d in dests if d.startswith("parallelism_config_")} == ACCELERATE_PARALLELISM
    assert set(ClusterConfig.__dataclass_fields__) == ACCELERATE_TOP_LEVEL


def test_reader_rejects_unknown_fsdp_key_accelerate_would_ignore(tmp_path) -> None:
    cfg = emit_accelerate(make_plan("zero=3", MODEL, CLUSTER16), MODEL, CLUSTER16)
    cfg["fsdp_config"]["fsdp_reshard_after_forwards"] = False
    with pytest.raises(SpecError, match="fsdp_config.fsdp_reshard_after_forwards: unknown key .*silently ignore"):
        plan_from_accelerate(cfg, MODEL, CLUSTER16)


def test_reader_reads_fsdp1_hybrid_sharding() -> None:
    cfg = {"distributed_type": "FSDP", "num_machines": 2, "num_processes": 16, "mixed_precision": "bf16",
           "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_activation_checkpointing": True}}
    plan = plan_from_accelerate(cfg, MODEL, gpu_cluster(16))
    assert (plan.dp_replicate, plan.dp_shard, plan.zero, plan.recompute_mode) == (2, 8, 3, "full")


@pytest.mark.parametrize("text", ["zero=3,compress=bf16", "zero=2,compress=bf16", "tp=2,sp=false,zero=3,compress=bf16"])
def test_bf16_reduction_is_accelerates_fsdp_mixed_precision(text: str, tmp_path, monkeypatch) -> None:
    """accelerate's FSDP2 plugin takes reduce_dtype from mixed_precision, as AcceleratorState sets it
    (``fsdp_plugin.set_mixed_precision``): the file runs compress=bf16; its DDP would not."""
    import torch

    model = small_model("bf16-fsdp2")
    cfg = emit_accelerate(make_plan(text, model, CLUSTER16), model, CLUSTER16)
    env = accelerate_launch_env(cfg, tmp_path, monkeypatch)
    fsdp, _ = plugins_from(env, monkeypatch)
    assert fsdp is not None
    fsdp.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])  # what AcceleratorState does with it
    assert fsdp.mixed_precision_policy.reduce_dtype == torch.bfloat16
    for bad, message in [("dp_replicate=16,zero=0,compress=bf16", "only under FSDP"),
                         ("zero=3,compress=zeropp", "plan with compress=none")]:
        with pytest.raises(EmitError, match=message):
            emit_accelerate(make_plan(bad, model, CLUSTER16), model, CLUSTER16)
    fp32 = small_model("fp32")
    with pytest.raises(EmitError, match="mixed_precision dtype, fp32 here"):
        emit_accelerate(make_plan("zero=3,compress=bf16", fp32, CLUSTER16), fp32, CLUSTER16)
