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


# ---------------------------------------------------------------------------------------
# Context parallelism as accelerate runs it (issue 34: Gemma-2-9B got cp=2)

# config.json files that declare a window longer than the model's context: the spec leaves a window
# that never binds out (specs/_hf_read.py _window), accelerate still refuses their sliding_window
WINDOW_THAT_NEVER_BINDS = {"phi-3.5-mini-instruct.json", "phi-4-mini-instruct.json"}


def test_context_parallel_refusals_are_what_accelerate_and_sdpa_refuse() -> None:
    """For every Hugging Face config in tests/data/hf: autoplace refuses accelerate's cp > 1 exactly when
    accelerate's own CP hook (big_modeling._attach_context_parallel_hooks) refuses the model, or when
    transformers runs its attention without SDPA (the only attention torch's ring swaps in)."""
    import json
    import warnings

    import torch
    import transformers
    from accelerate.big_modeling import _attach_context_parallel_hooks

    from autoplace.frameworks.accelerate import context_parallel_refusal
    from autoplace.specs.model import load_model
    from tests.helpers import REPO

    disagree = set()
    for path in sorted((REPO / "tests" / "data" / "hf").glob("*.json")):
        config = {k: v for k, v in json.loads(path.read_text()).items() if k != "quantization_config"}
        if config["model_type"] in ("RefinedWebModel", "RefinedWeb"):  # the pre-port Falcon is transformers' falcon
            config["model_type"] = "falcon"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoConfig.for_model(**config)
        module = torch.nn.Module()
        module.config = hf
        try:
            _attach_context_parallel_hooks(module)
            refused = False
        except ValueError as exc:
            refused = "Context parallelism does not support attention layers" in str(exc)
        text = hf.get_text_config()
        sdpa = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]._supports_sdpa
        ours = context_parallel_refusal(load_model(path))
        if (ours is not None) != (refused or not sdpa):
            disagree.add(path.name)
        elif refused:
            assert ours is not None and ours.startswith("sliding-window attention"), (path.name, ours)
    assert disagree == WINDOW_THAT_NEVER_BINDS


def test_gemma2_plans_for_accelerate_keep_the_whole_sequence_per_rank() -> None:
    """The search treats cp > 1 as not runnable by accelerate for Gemma 2 (sliding windows), and says why."""
    import json

    from typer.testing import CliRunner

    from autoplace import frameworks
    from autoplace.cli import app
    from autoplace.specs.model import load_model
    from tests.helpers import REPO

    path = REPO / "tests" / "data" / "hf" / "gemma-2-9b.json"
    out = CliRunner().invoke(app, ["solve", str(path), "--cluster", "1x8xh100", "--framework", "accelerate", "--top",
                                   "3", "--json"])
    assert out.exit_code == 0, out.output
    plans = json.loads(out.stdout)["plans"]
    assert plans and all(p["degrees"]["cp"] == 1 for p in plans)
    model = load_model(path)
    plan = make_plan("dp_shard=4,cp=2,zero=3", model, gpu_cluster(8))
    why = frameworks.get("accelerate").refusal(plan, model)
    assert why is not None and why.startswith("accelerate: cp=2: sliding-window attention (window 4096)")
    pinned = CliRunner().invoke(app, ["solve", str(path), "--cluster", "1x8xh100", "--framework", "accelerate",
                                      "--fix", "cp=2"])
    assert pinned.exit_code == 2 and pinned.stderr.strip().splitlines() == [
        "autoplace: error: --fix: accelerate cannot run cp=2 for gemma-2-9b: sliding-window attention (window 4096): "
        "accelerate's context parallelism drops the attention mask and refuses sliding_attention layers; use cp=1, or "
        "Megatron-LM"]  # said before any search, not "no configuration satisfies the fixed keys"


@pytest.mark.parametrize("text", ["zero=3", "zero=2,recompute=full", "zero=3,offload_optimizer=cpu,offload_params=cpu",
                                  "zero=3,preset=hsdp", "zero=0"])
def test_the_peft_script_builds_the_plugins_accelerate_launch_builds(text: str, tmp_path, monkeypatch) -> None:
    """peft_train.py --accelerate_config builds its Accelerator's FSDP plugin, ParallelismConfig and mixed
    precision from the YAML itself (so any launcher runs the plan): the ones accelerate launch's own
    reading of the same YAML builds."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from autoplace.emit.peft_train import render_peft_train
    from tests.test_lora_train_script import script_function

    model = MODEL.model_copy(update={"training": MODEL.training.model_copy(update={"method": "lora"})})
    plan = make_plan(text, model, CLUSTER16)
    cfg = emit_accelerate(plan, model, CLUSTER16)
    ours = script_function(render_peft_train(plan, model, CLUSTER16), "accelerate_plugins")(cfg)
    env = accelerate_launch_env(cfg, tmp_path, monkeypatch)
    fsdp, par = plugins_from(env, monkeypatch)
    assert ours["mixed_precision"] == env["ACCELERATE_MIXED_PRECISION"]
    pc = ours.get("parallelism_config")
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == par if pc else par == (1, 1, 1, 1)
    assert ("fsdp_plugin" in ours) == (fsdp is not None)
    if fsdp is not None:
        mine = ours["fsdp_plugin"]
        fields = ("fsdp_version", "reshard_after_forward", "state_dict_type", "activation_checkpointing")
        assert [getattr(mine, f) for f in fields] == [getattr(fsdp, f) for f in fields]
        assert type(mine.cpu_offload) is type(fsdp.cpu_offload)
        assert mine.auto_wrap_policy is fsdp.auto_wrap_policy is transformer_auto_wrap_policy


def test_tensor_parallel_families_are_the_ones_transformers_has_a_plan_for() -> None:
    """accelerate's TP loads the model with transformers' tp_plan: every Hugging Face family autoplace reads
    is refused tp > 1 exactly when transformers' config class has no base_model_tp_plan."""
    import warnings

    import transformers

    from autoplace import frameworks
    from autoplace.frameworks.accelerate import NO_TP_PLAN
    from autoplace.specs.hf import _FAMILIES
    from autoplace.specs.model import load_model
    from tests.helpers import REPO

    without = set()
    for family in _FAMILIES:
        name = "falcon" if family.startswith("RefinedWeb") else family  # the pre-port Falcon
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = transformers.CONFIG_MAPPING[name]().get_text_config()
        if not getattr(text, "base_model_tp_plan", None):
            without.add(family)
    assert without == NO_TP_PLAN
    gpt2 = load_model(REPO / "tests" / "data" / "hf" / "gpt2.json")
    plan = make_plan("tp=2,sp=false,zero=3", gpt2, gpu_cluster(8))
    why = frameworks.get("accelerate").refusal(plan, gpt2)
    assert why is not None and why.startswith("accelerate: tp=2: transformers has no tensor-parallel plan for gpt2")
