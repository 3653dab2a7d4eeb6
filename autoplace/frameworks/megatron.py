"""Megatron-LM: its command-line arguments from a plan, its launch line, and its declaration.

Flag names are those of ``megatron/training/arguments.py`` (many generated from the
``ModelParallelConfig`` / ``TransformerConfig`` dataclasses).  ZeRO maps onto Megatron's own
mechanisms: ZeRO-1 is the distributed optimizer (optionally with several optimizer instances
for HSDP-like replication), ZeRO-2/3 are Megatron-FSDP's ``optim_grads`` /
``optim_grads_params`` sharding strategies.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from autoplace.emit._common import (
    check_compression,
    fail,
    fp32_grad_accumulation,
    model_parts,
    recompute_runs,
    training_dtype,
    uniform_recompute,
)
from autoplace.emit.launch import Launch, bash_array
from autoplace.frameworks._megatron_read import plan_from_megatron
from autoplace.frameworks.base import BundleFile, Framework, PlanCheck, Program, ReadConfig, check_recipe, checked
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec, MoE, TransformerSpec

FMT = "megatron"
DEFAULT_ROTARY_BASE = 10000  # Megatron's --rotary-base default, and Hugging Face's rope_theta default
_FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def emit_megatron(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """Megatron arguments for ``plan`` (parallelism, batch, recompute, precision, model shape).

    Raises:
        EmitError: GPipe, parameter or NVMe offload, or a recompute pattern Megatron's
            uniform / block methods cannot produce.
    """
    del cluster
    check_expressible(plan)
    args = parallel_args(plan) + sharding_args(plan) + pipeline_args(plan)
    args += ["--micro-batch-size", str(plan.mbs), "--global-batch-size", str(plan.global_batch)]
    args += recompute_args(plan) + precision_args(model, plan) + recipe_args(plan)
    if isinstance(model, TransformerSpec):
        args += shape_args(model) + vocab_args(model, plan.tp)
    return args


def check_expressible(plan: Plan) -> None:
    """Raise EmitError for what Megatron has no argument for."""
    check_compression(plan, FMT, Megatron.compressions)
    check_recipe(plan, Megatron)
    if plan.tp_overlap == "userbuffers" and not plan.sp:
        raise fail(FMT, "tp_overlap=userbuffers without sp: Megatron's --tp-comm-overlap needs --sequence-parallel")
    if plan.pp > 1 and plan.schedule == "gpipe":
        raise fail(FMT, "schedule=gpipe: Megatron-LM runs 1F1B (or interleaved 1F1B), not GPipe")
    if plan.offload_params != "none":
        raise fail(FMT, f"offload_params={plan.offload_params}: Megatron has no parameter offload")
    if plan.offload_optimizer == "nvme":
        raise fail(FMT, "offload_optimizer=nvme: Megatron offloads optimizer state to CPU memory only, not NVMe")
    if plan.offload_optimizer == "cpu" and plan.zero != 1:
        raise fail(FMT, "--optimizer-cpu-offload works with the distributed optimizer (zero=1)")
    if plan.zero == 0 and plan.dp_shard > 1:
        raise fail(FMT, f"dp_shard={plan.dp_shard} with zero=0 shards nothing; use dp_replicate")
    if plan.zero >= 2 and plan.dp_replicate > 1:
        raise fail(FMT, "Megatron-FSDP with a replicated outer group (dp_replicate > 1) needs its hybrid-FSDP "
                        "process groups set up in code; use zero=1 or dp_replicate=1")


def parallel_args(plan: Plan) -> list[str]:
    """Degrees; sequence parallelism only where Megatron allows it (tp > 1)."""
    args = ["--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp),
            "--context-parallel-size", str(plan.cp), "--expert-model-parallel-size", str(plan.ep)]
    return args + (["--sequence-parallel"] if plan.sp and plan.tp > 1 else [])


def sharding_args(plan: Plan) -> list[str]:
    """ZeRO level: distributed optimizer (ZeRO-1) or Megatron-FSDP (ZeRO-2/3)."""
    if plan.zero == 1:
        args = ["--use-distributed-optimizer"]
        if plan.dp_replicate > 1:  # optimizer sharded within each dp_shard group, replicated across
            args += ["--num-distributed-optimizer-instances", str(plan.dp_replicate)]
        if plan.offload_optimizer == "cpu":
            args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
        return args
    if plan.zero >= 2:  # Megatron-FSDP (v1) runs on the distributed optimizer and its own checkpoint format
        return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", _FSDP_STRATEGY[plan.zero],
                "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
    return []


def pipeline_args(plan: Plan) -> list[str]:
    """The layer split: even (nothing to say), first/last stage counts, or an explicit layout.

    Megatron's layout string lists chunks in virtual-stage order, ``E`` (embedding) first,
    ``t`` per transformer layer, ``L`` (loss / head) last, chunks separated by ``|``.
    """
    if plan.pp == 1:
        return []
    parts = model_parts(plan, FMT)
    if len(set(parts)) == 1:
        return [] if plan.vpp == 1 else ["--num-layers-per-virtual-pipeline-stage", str(parts[0])]
    first, *middle, last = plan.layers_per_stage
    if plan.vpp == 1 and len(set(middle)) <= 1 and (not middle or middle[0] > 0):
        return ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]
    chunks = [f"t*{n}" if n > 1 else "t" * n for n in parts]
    chunks[0] = "E" + chunks[0]
    chunks[-1] += "L"
    return ["--pipeline-model-parallel-layout", "|".join(chunks)]


def recompute_args(plan: Plan) -> list[str]:
    """Selective, full (every layer), or full on the first k layers of every pipeline chunk (block).

    Megatron's ``block`` method recomputes the first ``--recompute-num-layers`` layers of each
    (virtual) pipeline chunk (Megatron-Core ``TransformerBlock._checkpointed_forward``).
    """
    mode = uniform_recompute(plan)
    if mode == "none":
        return []
    if mode == "selective":
        return ["--recompute-granularity", "selective"]
    if mode == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    k = _block_recompute_layers(plan)
    if k is None:
        raise fail(FMT, "Megatron recomputes all layers (selective or full) or the first k of every pipeline "
                        f"chunk; this plan's per-layer recompute [{recompute_runs(plan)}] is neither")
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(k)]


def _block_recompute_layers(plan: Plan) -> int | None:
    if set(plan.recompute) != {"none", "full"}:
        return None
    parts = model_parts(plan, FMT) if plan.pp > 1 else [len(plan.recompute)]
    for k in range(1, max(parts) + 1):
        if block_pattern(parts, k) == plan.recompute:
            return k
    return None


def block_pattern(parts: list[int], k: int) -> tuple[str, ...]:
    """Per-block recompute of Megatron's block method: the first k blocks of each chunk in full."""
    return tuple("full" if j < k else "none" for n in parts for j in range(n))


def precision_args(model: ModelSpec, plan: Plan) -> list[str]:
    """--bf16 / --fp16 from the recipe; fp32 gradient accumulation when the recipe keeps it, or
    bf16 gradient reduction under compress=bf16.

    Megatron-LM (core_v0.16.0 ``validate_args``) reads ``--grad-reduce-in-bf16`` only with
    ``--bf16``, and it then turns ``accumulate_allreduce_grads_in_fp32`` off (the DDP config's
    ``grad_reduce_in_fp32``): gradients are accumulated and reduced in bf16.

    Raises:
        EmitError: compress=bf16 without bf16 training (Megatron would ignore the flag).
    """
    dtype = training_dtype(model)
    args = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[dtype]
    if plan.fp8 != "none":  # Transformer Engine: e4m3 forward, e5m2 backward, the plan's scaling recipe
        args += ["--fp8-format", "hybrid", "--fp8-recipe", plan.fp8]
    elif model.training.recipe().compute_dtype == "fp8":
        args += ["--fp8-format", "hybrid"]  # Transformer Engine: e4m3 forward, e5m2 backward
    if plan.compress == "bf16":
        if dtype != "bf16":
            raise fail(FMT, f"compress=bf16: Megatron's --grad-reduce-in-bf16 acts only with --bf16 training, "
                            f"and this model trains in {dtype}")
        args += ["--grad-reduce-in-bf16"]
    elif dtype != "fp32" and fp32_grad_accumulation(model):
        args += ["--accumulate-allreduce-grads-in-fp32"]
    return args


def recipe_args(plan: Plan) -> list[str]:
    """The plan's recipe keys as Megatron-LM core_v0.16 flags (megatron-core's ModelParallelConfig
    ``cross_entropy_loss_fusion`` and ``tp_comm_overlap``; DistributedDataParallelConfig
    ``overlap_grad_reduce`` and ``overlap_param_gather``, the latter with the distributed optimizer)."""
    args = ["--cross-entropy-loss-fusion"] if plan.fused_loss else []
    if plan.tp_overlap == "userbuffers":
        args += ["--tp-comm-overlap"]
    if plan.overlap:
        args += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if plan.zero >= 1 else [])
    return args


def shape_args(m: TransformerSpec) -> list[str]:
    """The model's shape in Megatron's terms: sizes, positions (RoPE base), norm, MLP, biases, GQA, head.

    Megatron's defaults are GPT-2's (learned positions, LayerNorm, GeLU, biases, tied head), so
    every one of them is stated.  ``--rotary-base`` is an integer flag; RoPE bases are whole numbers.
    """
    args = ["--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.ffn_hidden),
            "--num-attention-heads", str(m.heads), "--kv-channels", str(m.dim_head),
            "--seq-length", str(m.seq_len), "--max-position-embeddings", str(m.max_position or m.seq_len),
            "--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"]
    if m.position == "rope":
        theta = m.rope_theta or DEFAULT_ROTARY_BASE
        if not float(theta).is_integer():
            raise fail(FMT, f"rope_theta {theta} is not a whole number; Megatron's --rotary-base is an integer")
        args += ["--position-embedding-type", "rope", "--rotary-base", str(int(theta))]
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    if m.n_kv_heads != m.heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.n_kv_heads)]
    if m.ffn == "swiglu":
        args.append("--swiglu")
    if not m.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not m.bias:
        args.append("--disable-bias-linear")
    if m.qkv_bias and not m.bias:
        args.append("--add-qkv-bias")
    if not m.dropout:
        args += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    if m.moe is not None:
        args += moe_args(m.moe, m.layers)
    return args


def vocab_args(m: TransformerSpec, tp: int) -> list[str]:
    """Vocabulary size and padding: Megatron pads the embedding to a multiple of
    ``make_vocab_size_divisible_by * tp`` (``_vocab_size_with_padding``; default 128).  The
    divisor chosen here is the largest that leaves the vocabulary as it is; when tp does not
    divide it, the few padding rows per TP rank are unavoidable (and uncounted by the plan).
    """
    divisor = math.gcd(m.vocab, 128 * tp)
    return ["--vocab-size", str(m.vocab), "--make-vocab-size-divisible-by",
            str(divisor // tp if divisor % tp == 0 else 1)]


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def moe_args(moe: MoE, layers: int) -> list[str]:
    """Mixture-of-experts shape (Megatron-Core MoE); dense layers appear in --moe-layer-freq as 0."""
    args = ["--num-experts", str(moe.experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.expert_ffn_hidden)]
    if moe.shared_experts:
        args += ["--moe-shared-expert-intermediate-size", str(moe.shared_experts * moe.shared_ffn_hidden)]
    pattern = [1 if moe.is_moe_layer(i) else 0 for i in range(layers)]
    if 0 in pattern:
        args += ["--moe-layer-freq", f"[{','.join(map(str, pattern))}]"]
    return args


ARGS_FILE = "megatron_args.sh"
ENTRY = "pretrain_gpt.py"  # Megatron-LM's GPT pre-training entry point (the default --script)
# What the plan cannot know: each a required environment variable, so a job started without it
# stops at once with the variable's name (bash ${VAR:?message}).
PLACEHOLDERS = (
    ("--data-path", "DATA_PATH", "your Megatron-indexed dataset prefix"),
    ("--tokenizer-model", "TOKENIZER_MODEL", "your Hugging Face tokenizer name or directory"),
    ("--save", "CHECKPOINT_DIR", "where checkpoints go"),
    ("--load", "CHECKPOINT_DIR", "where checkpoints go"),
    ("--train-iters", "TRAIN_ITERS", "how many steps to train"),
)


class Megatron(Framework):
    """Megatron-LM (core_v0.16): TP with sequence parallelism, CP, EP, 1F1B and interleaved
    pipelines with uneven first/last stages, the distributed optimizer (ZeRO-1) and Megatron-FSDP
    (ZeRO-2/3), full/selective/block recompute.  Under ``--bf16`` it accumulates and all-reduces
    gradients in fp32 (validate_args sets accumulate_allreduce_grads_in_fp32 unless
    ``--grad-reduce-in-bf16``, which is compress=bf16)."""

    name = FMT
    title = "Megatron-LM"
    bf16_recipe = "bf16-fp32-grads"
    compressions = frozenset({"bf16"})
    # its fused cross-entropy, userbuffer TP overlap, overlapped DP reduce/gather, Transformer Engine's fp8
    recipes = {"fused_loss": (True, False), "tp_overlap": ("userbuffers", "none"), "overlap": (True, False),
               "fp8": ("none", "delayed", "tensorwise", "mxfp8")}
    reports_hardware_flops = True
    config_suffixes = (".sh",)

    def model_refusal(self, model: ModelSpec) -> str | None:
        if isinstance(model, TransformerSpec) and model.position == "rope":
            theta = model.rope_theta or DEFAULT_ROTARY_BASE
            if not float(theta).is_integer():
                return f"{FMT}: rope_theta {theta} is not a whole number; Megatron's --rotary-base is an integer"
        return None

    def plan_check(self, model: ModelSpec) -> PlanCheck:
        dtype = training_dtype(model)

        def check(plan: Plan) -> None:  # the rules emit_megatron applies, without writing the arguments
            check_expressible(plan)
            pipeline_args(plan)
            recompute_args(plan)
            if plan.compress == "bf16" and dtype != "bf16":
                raise fail(FMT, f"compress=bf16: Megatron's --grad-reduce-in-bf16 acts only with --bf16 training, "
                                f"and this model trains in {dtype}")

        return checked(check)

    def render(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        args = bash_array("MEGATRON_ARGS", emit_megatron(plan, model, cluster), "Megatron-LM arguments")
        return [BundleFile(ARGS_FILE, 'Megatron-LM arguments as a bash array: the launch scripts source it and pass '
                           '"${MEGATRON_ARGS[@]}" to pretrain_gpt.py (set DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, '
                           "TRAIN_ITERS first)", args)]

    def read(self, path: Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
        return ReadConfig(plan_from_megatron(path, model, cluster), self.name, True)

    def program(self, plan: Plan, model: ModelSpec, launch: Launch) -> Program:
        """``pretrain_gpt.py "${MEGATRON_ARGS[@]}"`` with the data, tokenizer and checkpoint
        placeholders, and CUDA_DEVICE_MAX_CONNECTIONS as Megatron's validate_args wants it."""
        del model
        q = shlex.quote
        words = [q(launch.script or ENTRY), '"${MEGATRON_ARGS[@]}"', "--tokenizer-type", "HuggingFaceTokenizer"]
        for flag, var, what in PLACEHOLDERS:
            words += [flag, f'"${{{var}:?set {var} to {what}}}"']
        return Program("torchrun", (*words, *(q(a) for a in launch.args), '"$@"'),
                       prelude=(f'source "$AUTOPLACE_BUNDLE"/{ARGS_FILE}',), env=megatron_environment(plan))


def megatron_environment(plan: Plan) -> dict[str, str | None]:
    """CUDA_DEVICE_MAX_CONNECTIONS by Megatron-LM's own rules (arguments.py validate_args): 1 when
    tensor or context parallelism overlaps its communication with compute on one stream (before
    Blackwell), and not 1 under Megatron-FSDP (zero >= 2), which refuses that value (None = unset)."""
    if plan.zero >= 2:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": None}
    if plan.tp > 1 or plan.cp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}
