"""Hugging Face accelerate: its config YAML (FSDP2) from a plan (accelerate 1.15, see ECOSYSTEM.md), its declaration.

accelerate starts FSDP2 through ``fsdp_config`` (``fsdp_version: 2``) and, for HSDP, tensor
and context parallelism, through ``parallelism_config``.  The tests check the result with
accelerate's own loader, launch validation and ``FullyShardedDataParallelPlugin``.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autoplace.emit._common import (
    check_compression,
    check_cpu_offload_together,
    fail,
    launch_geometry,
    training_dtype,
    uniform_recompute,
)
from autoplace.emit.launch import MODEL_INPUT, Launch, Launcher, emit_torchrun
from autoplace.emit.peft_train import render_peft_train
from autoplace.frameworks.base import (
    BundleFile,
    Framework,
    PlanCheck,
    Program,
    ReadConfig,
    check_recipe,
    checked,
    user_program,
)
from autoplace.frameworks.readers import plan_from_accelerate
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec, TransformerSpec

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

FMT = "accelerate"


def emit_accelerate(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> dict[str, Any]:
    """The accelerate config of ``plan`` as a YAML-ready dict.

    ZeRO-3 is FSDP2 with ``reshard_after_forward: true``; ZeRO-2 keeps the gathered
    parameters until backward (``false``, FSDP1's SHARD_GRAD_OP); ZeRO-0 is plain DDP.
    accelerate's FSDP2 reduces gradients in the ``mixed_precision`` dtype whatever the plan
    says (``FullyShardedDataParallelPlugin.set_mixed_precision``): compress=bf16 is its own
    behaviour, so the file is the same with or without it.

    Raises:
        EmitError: pipeline or expert parallelism, ZeRO-1, selective or per-layer
            recompute, or offloads accelerate's FSDP cannot state.
    """
    check_expressible(plan)
    nodes, _ = launch_geometry(plan, cluster, FMT)
    mixed = training_dtype(model)
    if plan.compress == "bf16" and mixed != "bf16":
        raise fail(FMT, f"compress=bf16: accelerate's FSDP reduces in its mixed_precision dtype, {mixed} here")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type(plan),
        "mixed_precision": "no" if mixed == "fp32" else mixed,
        "num_machines": nodes,
        "num_processes": plan.world,  # all processes of the job, across machines
        "machine_rank": 0,  # each node overrides it: accelerate launch --machine_rank N
        "rdzv_backend": "c10d" if nodes > 1 else "static",
        "same_network": True,
        "main_training_function": "main",
        "use_cpu": False,
        "debug": False,
    }
    if cfg["distributed_type"] == "FSDP":
        cfg["fsdp_config"] = fsdp_section(plan)
    parallelism = parallelism_section(plan)
    if parallelism:
        cfg["parallelism_config"] = parallelism
    return cfg


def check_expressible(plan: Plan) -> None:
    """Raise EmitError for what accelerate's FSDP2 / parallelism config cannot express."""
    check_compression(plan, FMT, Accelerate.compressions)
    check_recipe(plan, Accelerate)
    if plan.compress == "bf16" and distributed_type(plan) != "FSDP":
        raise fail(FMT, "compress=bf16: accelerate reduces in bf16 only under FSDP (its MixedPrecisionPolicy takes "
                        "reduce_dtype from mixed_precision); its DDP all-reduces the fp32 gradients autocast leaves: "
                        "use zero >= 2 over a shard group, or the fsdp module")
    for name, degree in (("pp", plan.pp), ("ep", plan.ep)):
        if degree > 1:
            raise fail(FMT, f"{name}={degree}: accelerate configures no pipeline or expert parallelism; "
                            "use torchtitan or Megatron-LM")
    if plan.zero == 1:
        raise fail(FMT, "zero=1: FSDP has no optimizer-only sharding; the nearest is zero=2 "
                        "(reshard_after_forward: false) or DeepSpeed")
    if plan.zero == 0 and plan.dp_shard > 1:
        raise fail(FMT, f"dp_shard={plan.dp_shard} with zero=0 shards nothing; use dp_replicate")
    if plan.zero == 0 and plan.cp > 1:
        raise fail(FMT, f"cp={plan.cp} with zero=0: accelerate's context parallelism needs FSDP2; use zero=2 or 3")
    if plan.tp > 1 and plan.sp:
        raise fail(FMT, f"sp with tp={plan.tp}: accelerate's tensor parallelism follows the model's tp_plan and "
                        "has no sequence-parallel switch; set sp=false or use the fsdp module")
    if (plan.tp > 1 or plan.cp > 1) and plan.dp_replicate > 1 and plan.dp_shard == 1:
        raise fail(FMT, "tp/cp with pure replication (dp_replicate > 1, dp_shard = 1) is rejected by accelerate's "
                        "ParallelismConfig; shard the data-parallel group (dp_shard > 1)")
    mode = uniform_recompute(plan)
    if mode not in ("none", "full"):
        raise fail(FMT, "fsdp_activation_checkpointing recomputes every block in full; this plan wants "
                        f"{plan.recompute_mode} recompute (use the fsdp module or torchtitan)")
    if mode == "full" and distributed_type(plan) != "FSDP":
        raise fail(FMT, "fsdp_activation_checkpointing exists only under FSDP (zero >= 2 over a shard group); "
                        "this plan recomputes without FSDP")
    _check_offload(plan)


def _check_offload(plan: Plan) -> None:
    check_cpu_offload_together(plan, FMT, "FSDP's CPU offload")
    if plan.offload_params != "none" and (plan.zero < 3 or plan.dp_shard * plan.cp == 1):
        raise fail(FMT, "FSDP CPU offload needs zero=3 over a shard group (dp_shard * cp) larger than one")


def distributed_type(plan: Plan) -> str:
    """accelerate's ``distributed_type`` for ``plan``: NO, MULTI_GPU (DDP) or FSDP."""
    if plan.world == 1:
        return "NO"
    # FSDP2 needs a dimension to shard over (dp_shard or cp); without one, replication is DDP
    # and a ZeRO level over a shard group of one shards nothing.
    return "FSDP" if plan.zero >= 2 and plan.dp_shard * plan.cp > 1 else "MULTI_GPU"


def fsdp_section(plan: Plan) -> dict[str, Any]:
    """``fsdp_config`` with FSDP2 fields only (FSDP1 names like sharding_strategy are left out)."""
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": plan.zero == 3,
        "fsdp_offload_params": plan.offload_params == "cpu",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # wraps the model's _no_split_modules blocks
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_activation_checkpointing": uniform_recompute(plan) == "full",
    }


def parallelism_section(plan: Plan) -> dict[str, Any]:
    """``parallelism_config`` when the mesh is more than one flat data-parallel group."""
    if plan.tp == 1 and plan.cp == 1 and (plan.dp_replicate == 1 or plan.dp_shard == 1):
        return {}
    return {
        "parallelism_config_dp_replicate_size": plan.dp_replicate,
        "parallelism_config_dp_shard_size": plan.dp_shard,
        "parallelism_config_tp_size": plan.tp,
        "parallelism_config_cp_size": plan.cp,
    }


CONFIG = "accelerate_config.yaml"


class Accelerate(Framework):
    """accelerate 1.15 with FSDP2 (``fsdp_version: 2``) or DDP, and its ``parallelism_config``
    (HSDP, TP, CP).  Its activation checkpointing is all blocks in full or none; its FSDP2 keeps
    fp32 shards and reduces in the mixed-precision dtype."""

    name = FMT
    title = "accelerate"
    bf16_recipe = "bf16-fsdp2"
    # its DDP keeps the reducer's buckets beside .grad (DistributedDataParallelKwargs' default
    # gradient_as_bucket_view=False) for the user's script; the bundle's PEFT script asks for views
    # (peft_train.make_accelerator) and loads a LoRA base in the compute dtype, which accelerate leaves
    # as it is (only trainable parameters are upcast: fsdp_utils.fsdp2_prepare_model); under QLoRA, PEFT's
    # prepare_model_for_kbit_training casts the 16-bit frozen parameters to fp32 (peft utils/other.py):
    # the recipe's 4 bytes
    # its FSDP2 is fully_shard (fsdp2_prepare_model); it trains transformers' modelling code, whose RMSNorm
    # keeps its input in fp32 for backward (Assumptions.rmsnorm_upcast_kept)
    behaviour = {"ddp_bucket_copy": True, "fsdp2_dim0_padding": True, "rmsnorm_upcast_kept": True}
    method_behaviour = {"lora": {"ddp_bucket_copy": False, "frozen_base_in_compute_dtype": True},
                        "qlora": {"ddp_bucket_copy": False}}
    denied_features = frozenset({"interleave", "ep"})
    pinned_degrees = {"pp": 1, "ep": 1}
    uniform_recompute = ("none", "full")
    layer_recompute = None
    compressions = frozenset({"bf16"})
    config_suffixes = (".yaml", ".yml")
    config_file = CONFIG
    methods = frozenset({"full", "lora", "qlora"})  # PEFT adapters on the HF model (peft_train.py)

    def degree_refusals(self, model: ModelSpec) -> dict[str, str]:
        return degree_refusals(model)

    def plan_check(self, model: ModelSpec) -> PlanCheck:
        mixed = training_dtype(model)
        degrees = degree_refusals(model)  # the model's own rules, judged once

        def check(plan: Plan) -> None:  # the rules emit_accelerate applies, without writing the config
            check_expressible(plan)
            parallelism_section(plan)
            if plan.compress == "bf16" and mixed != "bf16":
                raise fail(FMT, f"compress=bf16: accelerate's FSDP reduces in its mixed_precision dtype, {mixed} here")
            for name, why in degrees.items():
                if getattr(plan, name) > 1:
                    raise fail(FMT, f"{name}={getattr(plan, name)}: {why}")

        return checked(peft_checked(check, model, FMT))

    def files(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        cfg = yaml.safe_dump(emit_accelerate(plan, model, cluster), sort_keys=False)
        program = self.program(plan, model, launch)
        return [BundleFile(CONFIG, "accelerate config, FSDP2 (the launch scripts pass it as accelerate launch "
                           "--config_file)", cfg),
                BundleFile("launch_accelerate.sh", "accelerate launch with accelerate_config.yaml, run on every node "
                           "(NODE_RANK or SLURM_NODEID, MASTER_ADDR)",
                           emit_torchrun(plan, model, cluster, launch, program), executable=True),
                *peft_files(plan, model, cluster)]

    def program(self, plan: Plan, model: ModelSpec, launch: Launch) -> Program:
        """The user's script under ``accelerate launch --config_file`` with the bundle's YAML (LoRA /
        QLoRA: the bundle's PEFT script, given the YAML too); the machine rank and head come from
        the launcher's environment (NODE_RANK, else Slurm's SLURM_NODEID; MASTER_ADDR /
        MASTER_PORT), not from the YAML, whose one ``machine_rank`` cannot differ per node.
        Command-line values win over the config file."""
        del plan
        return (peft_program(model, launch, "--accelerate_config", CONFIG, accelerate_launcher)
                or Program(user_program(launch), launcher=accelerate_launcher))

    def read(self, path: Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
        plan = plan_from_accelerate(path, model, cluster)
        note = (f"accelerate configs state no batch size: took the model's global batch "
                f"{model.training.global_batch} with micro-batch {plan.mbs}")
        return ReadConfig(plan, self.name, False, (note,))

    def dry_run(self, ctx: DryContext, steps: Steps) -> None:
        """accelerate's own launch validation, Accelerator and prepare on the fake world (:mod:`._accelerate_dry`)."""
        if Path(ctx.launched.entry).name == PEFT_SCRIPT:
            from autoplace.frameworks._peft_dry import dry_run as peft_dry_run

            peft_dry_run(ctx, steps, self.name)
            return
        from autoplace.frameworks._accelerate_dry import dry_run

        dry_run(ctx, steps, distributed_type(ctx.plan))


def accelerate_launcher(nodes: int, per_node: int, job_id: str, head: str, port: str, node_rank: str) -> list[str]:
    """``accelerate launch`` with the bundle's config (see :class:`~autoplace.emit.launch.Program`)."""
    del job_id
    return [f'accelerate launch --config_file "$AUTOPLACE_BUNDLE"/{CONFIG} \\',
            f"  --num_machines {nodes} --num_processes {nodes * per_node} --machine_rank {node_rank} \\",
            f"  --main_process_ip {head} --main_process_port {port} \\"]


PEFT_SCRIPT = "peft_train.py"


def peft_files(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[BundleFile]:
    """The PEFT fine-tuning script, for a model trained with LoRA or QLoRA (none for full training)."""
    if not model.training.frozen_base:
        return []
    return [BundleFile(PEFT_SCRIPT, f"{model.training.method.upper()} fine-tuning script (PEFT LoraConfig"
                       f"{', bitsandbytes NF4' if model.training.method == 'qlora' else ''}) every launch script runs with "
                       "this bundle's framework config and HF_MODEL (--script runs yours instead)",
                       render_peft_train(plan, model, cluster))]


def peft_program(model: ModelSpec, launch: Launch, flag: str, config: str,
                 launcher: Launcher | None = None) -> Program | None:
    """The bundle's PEFT script for LoRA / QLoRA without a --script: given the framework config
    the plan was costed with (``flag`` and the bundle's ``config``: the script builds its
    Accelerator from it, whatever launcher starts it) and the model's weights (a required input)."""
    if not model.training.frozen_base or launch.script is not None:
        return None
    var, what = MODEL_INPUT
    words = (f'"$AUTOPLACE_BUNDLE"/{PEFT_SCRIPT}', flag, f'"$AUTOPLACE_BUNDLE"/{config}', "--model", f'"${var}"',
             *(shlex.quote(a) for a in launch.args), '"$@"')
    return Program(words, launcher=launcher, required={var: what})


# What the PEFT script (peft_train.py) does not set up, by degree: it trains the Hugging Face model
# as data parallel under the framework's sharding (accelerate's FSDP2, DeepSpeed's ZeRO).
_PEFT_DEGREES = {
    "tp": "peft_train.py loads no tensor-parallel model (transformers' tp_plan) and PEFT's adapters would need "
          "sharding beside it",
    "cp": "peft_train.py feeds whole sequences (no accelerate maybe_context_parallel around its steps)",
    "pp": "peft_train.py runs the Hugging Face model whole: accelerate's DeepSpeed plugin builds no PipelineModule",
}


def check_peft(plan: Plan, fmt: str) -> None:
    """Raise EmitError for a LoRA / QLoRA plan the bundle's PEFT script cannot run as planned.

    Raises:
        EmitError: tensor, context or pipeline parallelism (the script's data-parallel loop would
            run it as more data parallelism, on more memory per device than was costed).
    """
    for name, degree in (("tp", plan.tp), ("cp", plan.cp), ("pp", plan.pp)):
        if degree > 1:
            raise fail(fmt, f"{name}={degree} with LoRA/QLoRA: {_PEFT_DEGREES[name]}; use {name}=1")


def peft_checked(check: Callable[[Plan], None], model: ModelSpec, fmt: str) -> Callable[[Plan], None]:
    """``check``, and for a LoRA / QLoRA model :func:`check_peft` after it."""
    if not model.training.frozen_base:
        return check

    def both(plan: Plan) -> None:
        check(plan)
        check_peft(plan, fmt)

    return both


# Hugging Face model types whose transformers config has no base_model_tp_plan.  accelerate's tensor
# parallelism takes the model tensor-parallel already (accelerator.py prepare_model: "Model should
# undergo tensor parallel before passing it to accelerate ... from_pretrained(..., tp_plan='auto')"),
# which transformers builds from that plan.  tests/test_emit_accelerate.py holds the set to transformers'
# config classes for every family autoplace reads; RefinedWeb* is the pre-port Falcon.
NO_TP_PLAN = frozenset({"bloom", "falcon", "gpt2", "gpt_bigcode", "mpt", "RefinedWeb", "RefinedWebModel"})


def degree_refusals(model: ModelSpec) -> dict[str, str]:
    """Degrees accelerate cannot raise above 1 for ``model``: degree -> why (one line naming the feature)."""
    out = {}
    cp = context_parallel_refusal(model)
    if cp:
        out["cp"] = cp
    if isinstance(model, TransformerSpec) and model.family in NO_TP_PLAN:
        out["tp"] = (f"transformers has no tensor-parallel plan for {model.family} (base_model_tp_plan), which "
                     "accelerate's tensor parallelism loads the model with; use tp=1")
    return out


def context_parallel_refusal(model: ModelSpec) -> str | None:
    """Why accelerate 1.15's context parallelism cannot train ``model`` (one line naming the
    feature), or None.

    accelerate shards the sequence with torch's ``context_parallel``, which swaps SDPA's kernels
    for ring attention (torch 2.13 distributed/tensor/experimental/_context_parallel/_attention.py),
    and hooks every ``self_attn`` to drop the attention mask for ``is_causal=True``
    (accelerate big_modeling.py ``_attach_context_parallel_hooks``).  So:

    - sliding-window layers: refused by accelerate itself (any ``layer_types`` entry other than
      ``full_attention``, or a ``sliding_window`` without ``layer_types``): their mask would be dropped;
    - attention SDPA cannot run never reaches the ring: logit soft-capping (transformers' Gemma 2:
      ``_supports_sdpa = False``) and ALiBi's bias (torch's ring attention: "attn_bias is not
      supported yet"); each rank would attend to its own chunk only.

    The sequence must split into 2 x cp chunks (torch's head-tail load balancer): rules.py's
    sequence-split rule, for every framework.  FSDP2 is required (accelerate state.py): checked by
    :func:`check_expressible` (zero >= 2).
    """
    if not isinstance(model, TransformerSpec):
        return None
    if model.sliding_window is not None:
        return (f"sliding-window attention (window {model.sliding_window}): accelerate's context parallelism "
                "drops the attention mask and refuses sliding_attention layers; use cp=1, or Megatron-LM")
    if model.attn_softcap is not None:
        return ("attention logit soft-capping: accelerate's context parallelism runs SDPA, which has no soft-cap "
                "(transformers runs Gemma 2's attention eagerly); use cp=1")
    if model.position == "alibi":
        return "ALiBi position biases: torch's ring attention takes no attention bias; use cp=1"
    return None
