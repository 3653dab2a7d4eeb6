"""Megatron-LM: its command-line arguments from a plan, its launch line, and its declaration.

Flag names are those of ``megatron/training/arguments.py`` (many generated from the
``ModelParallelConfig`` / ``TransformerConfig`` dataclasses).  ZeRO maps onto Megatron's own
mechanisms: ZeRO-1 is the distributed optimizer (optionally with several optimizer instances
for HSDP-like replication), ZeRO-2/3 are Megatron-FSDP's ``optim_grads`` /
``optim_grads_params`` sharding strategies.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autoplace.emit._common import (
    check_compression,
    fail,
    fp32_grad_accumulation,
    model_parts,
    recompute_runs,
    training_dtype,
    uniform_recompute,
)
from autoplace.emit.launch import Launch, bash_array, input_words
from autoplace.errors import EmitError
from autoplace.frameworks._megatron_args import interleaved_refusal, run_args
from autoplace.frameworks._megatron_read import plan_from_megatron
from autoplace.frameworks.base import BundleFile, Framework, PlanCheck, Program, ReadConfig, check_recipe, checked
from autoplace.plan import RECIPE_KEYS, SLOT_KEYS, Config, Plan, stage_slots
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import MLA, ModelSpec, MoE, RopeScaling, TransformerSpec

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

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
    why = model_refusal(model)
    if why:
        raise fail(FMT, why)
    check_expressible(plan)
    check_batching(plan)
    args = parallel_args(plan) + sharding_args(plan) + pipeline_args(plan)
    args += ["--micro-batch-size", str(plan.mbs), "--global-batch-size", str(plan.global_batch)]
    args += recompute_args(plan) + precision_args(model, plan) + recipe_args(plan)
    if isinstance(model, TransformerSpec):
        args += shape_args(model) + vocab_args(model, plan.tp) + run_args(model.hidden)
    return args


def batching_refusal(config: Config) -> str | None:
    """Why megatron-core's interleaved schedule cannot run ``config``'s micro-batches per step
    (:func:`~autoplace.frameworks._megatron_args.interleaved_refusal`), or None."""
    why = interleaved_refusal(config.grad_accum, config.pp) if config.vpp > 1 else None
    if why is None:
        return None
    return (f"{FMT}: megatron-core's interleaved schedule refuses {config.grad_accum} micro-batch(es) per step on "
            f"pp={config.pp} (it runs them in groups of pp): {why}")


def check_batching(plan: Plan) -> None:
    """Raise :func:`batching_refusal`'s line as EmitError."""
    why = batching_refusal(plan)
    if why:
        raise EmitError(why)


# Megatron-Core's RotaryEmbedding._apply_scaling (--use-rope-scaling) takes only the factor, and
# Megatron-LM core_v0.16.1's gpt_builders.py passes GPTModel rope_scaling but not
# --rope-scaling-factor: Llama 3.1's scaling is fixed at factor 8, low/high_freq_factor 1/4, 8192
_LLAMA3_FIXED = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192}
# MLATransformerConfig's YaRN fields Megatron-LM has no flag for (its defaults, DeepSeek's values)
_MLA_YARN_FIXED = {"original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def model_refusal(model: ModelSpec) -> str | None:
    """Why Megatron-LM's ``pretrain_gpt.py`` with these arguments would not train ``model``'s
    architecture, as one line "feature: why"; None when every feature has its flag.

    Checked against megatron-core 0.16's TransformerConfig / MLATransformerConfig and
    Megatron-LM core_v0.16.1's ``arguments.py``.
    """
    if not isinstance(model, TransformerSpec):
        return ("layer-graph model: pretrain_gpt.py builds its own GPT from shape arguments; "
                "a graph of layers has none")
    m = model
    reasons = [
        (m.position == "alibi", "ALiBi positions: Megatron-LM has no ALiBi (--position-embedding-type "
                                "learned_absolute, rope, mrope, relative, none)"),
        (m.embedding_norm, "embedding LayerNorm (BLOOM): GPTModel has no norm after the embedding"),
        (m.scaled_embeddings, "embeddings scaled by sqrt(hidden) (Gemma): GPTModel has no embedding multiplier"),
        (m.norm_position != "pre", f"{m.norm_position}-norm blocks: Megatron-Core's TransformerLayer normalises "
                                   "only before attention and MLP"),
        (m.parallel_block, "parallel attention + MLP blocks: Megatron-Core's TransformerLayer runs them one "
                           "after the other"),
        (m.qk_norm == "layer", "QK-norm over all heads at once (OLMo 2): --qk-layernorm normalises each head"),
        (m.attn_softcap is not None, "attention logit soft-capping: megatron-core 0.16 has no soft-cap option"),
        (m.final_logit_softcap is not None, "final logit soft-capping: megatron-core 0.16's output layer has none"),
        (m.bias and not m.qkv_bias, "biases on every linear layer but q/k/v: --add-qkv-bias goes with "
                                    "--disable-bias-linear only"),
    ]
    why = _activation_refusal(m) or next((reason for refused, reason in reasons if refused), None)
    return why or _rope_refusal(m) or (_moe_refusal(m.moe) if m.moe else None)


def _activation_refusal(m: TransformerSpec) -> str | None:
    """Megatron-Core's MLPs from Megatron-LM's flags (core_transformer_config_from_args): --swiglu
    (SiLU gate), --quick-geglu (quick-GeLU gate), --squared-relu, else exact GeLU.  --openai-gelu
    (tanh GeLU) reaches only the legacy models, not Megatron-Core's GPT."""
    gated = m.ffn == "swiglu"
    if gated and m.act != "silu":
        return (f"gated {m.act} MLP: Megatron-LM gates with SiLU (--swiglu) or quick-GeLU (--quick-geglu) "
                "only")
    if m.act == "gelu_tanh":
        return "tanh-approximated GeLU: Megatron-Core's GPT uses exact GeLU (--openai-gelu reaches legacy models only)"
    if not gated and m.act == "silu":
        return "non-gated SiLU MLP: Megatron-LM has no flag for it"
    return None


def _rope_refusal(m: TransformerSpec) -> str | None:
    theta = m.rope_theta or DEFAULT_ROTARY_BASE
    if m.position == "rope" and not float(theta).is_integer():
        return f"rope_theta {theta} is not a whole number: Megatron's --rotary-base is an integer"
    return _rope_scaling_refusal(m)


def _rope_scaling_refusal(m: TransformerSpec) -> str | None:
    """RoPE scaling Megatron-LM can state: Llama 3.1's (--use-rope-scaling) with its fixed constants,
    YaRN under MLA (MLATransformerConfig's fields).  gpt_builders.py passes GPTModel neither
    --rope-scaling-factor nor --rotary-seq-len-interpolation-factor."""
    r = m.rope_scaling
    if r is None or m.position != "rope":
        return None
    if m.attention is not None:
        fixed = [f"{k} {getattr(r, k)}" for k, v in _MLA_YARN_FIXED.items() if getattr(r, k) not in (None, v)]
        if r.type != "yarn" or fixed:
            return (f"{r.type} RoPE scaling{' with ' + ', '.join(fixed) if fixed else ''} under MLA: Megatron-LM's "
                    f"MLA takes YaRN with {_said(_MLA_YARN_FIXED)} only")
        return None
    if r.type == "llama3":
        fixed = [f"{k} {getattr(r, k)}" for k, v in _LLAMA3_FIXED.items() if getattr(r, k) not in (None, v)]
        return (f"llama3 RoPE scaling with {', '.join(fixed)}: Megatron-LM's GPT applies it with "
                f"{_said(_LLAMA3_FIXED)} only") if fixed else None
    return f"{r.type} RoPE scaling: Megatron-LM's GPT has a flag for Llama 3.1's scaling only"


def _said(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


def _moe_refusal(moe: MoE) -> str | None:
    """Router features Megatron-Core's TopKRouter cannot reproduce."""
    if moe.score_function == "sigmoid" and moe.normalize_top_k != (moe.top_k > 1):
        return (f"sigmoid routing {'with' if moe.normalize_top_k else 'without'} top-k renormalisation at "
                f"top_k={moe.top_k}: Megatron-Core renormalises sigmoid top-k weights exactly when top_k > 1")
    if moe.expert_bias and moe.score_function != "sigmoid":
        return "expert bias with softmax routing: Megatron-Core's expert bias needs sigmoid scores"
    if moe.groups > 1 and moe.group_score == "max":
        return ("group-limited routing scored by each group's best expert (DeepSeek-V2): Megatron-Core scores a "
                "group by the sum of its top top_k/group_top_k experts")
    return None


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
    if (plan.pp_embedding or plan.pp_loss) and plan.pp == 1:  # get_num_layers_to_build would build a layer fewer
        raise fail(FMT, "pp_embedding / pp_loss count the embedding / loss as a pipeline layer: they need pp > 1")
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
    """The layer split: even (nothing to say), first/last stage counts, the embedding and the loss
    counted as layers, or an explicit layout.

    Megatron's layout string lists chunks in virtual-stage order, ``E`` (embedding) first,
    ``t`` per transformer layer, ``L`` (loss / head) last, chunks separated by ``|``.
    """
    if plan.pp == 1:
        return []
    parts = model_parts(plan, FMT)
    if plan.pp_embedding or plan.pp_loss:
        return _slot_args(plan, parts)
    if len(set(parts)) == 1:
        return [] if plan.vpp == 1 else ["--num-layers-per-virtual-pipeline-stage", str(parts[0])]
    first, *middle, last = plan.layers_per_stage
    if plan.vpp == 1 and len(set(middle)) <= 1 and (not middle or middle[0] > 0):
        return ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]
    return layout_args(parts)


def layout_args(parts: list[int]) -> list[str]:
    """``--pipeline-model-parallel-layout`` of model chunks holding ``parts`` blocks (virtual-stage
    order), the embedding in the first and the loss in the last."""
    chunks = [f"t*{n}" if n > 1 else "t" * n for n in parts]
    chunks[0] = "E" + chunks[0]
    chunks[-1] += "L"
    return ["--pipeline-model-parallel-layout", "|".join(chunks)]


def _slot_args(plan: Plan, parts: list[int]) -> list[str]:
    """A split counting the embedding and / or the loss as a layer: Megatron-LM's own flags when every
    stage holds the same units (core_v0.16.1 arguments.py: ``--account-for-embedding-in-pipeline-split``
    and ``--account-for-loss-in-pipeline-split`` add one layer each to the count the stages share
    evenly, ``--num-layers-per-virtual-pipeline-stage`` cuts it into chunks; megatron-core 0.16.1
    ``get_num_layers_to_build`` then builds one layer fewer in the first chunk of the first stage
    and the last chunk of the last), else the same chunks as a layout (which the account-for flags
    cannot join: TransformerConfig refuses both)."""
    units = [n + s for n, s in zip(plan.layers_per_stage, stage_slots(plan.pp, plan.pp_embedding, plan.pp_loss),
                                   strict=True)]
    if len(set(units)) > 1:
        return layout_args(parts)
    args = ["--account-for-embedding-in-pipeline-split"] if plan.pp_embedding else []
    args += ["--account-for-loss-in-pipeline-split"] if plan.pp_loss else []
    return args + (["--num-layers-per-virtual-pipeline-stage", str(units[0] // plan.vpp)] if plan.vpp > 1 else [])


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
            "--num-attention-heads", str(m.heads)]
    if m.attention is None:  # MLA's head sizes are its own flags
        args += ["--kv-channels", str(m.dim_head)]
    args += ["--seq-length", str(m.seq_len), "--max-position-embeddings", str(m.max_position or m.seq_len),
             "--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"]
    if m.norm_eps is not None:  # TransformerConfig.layernorm_epsilon: every norm, QK and MLA latent norms too
        args += ["--norm-epsilon", repr(m.norm_eps)]
    if m.position == "rope":
        theta = m.rope_theta or DEFAULT_ROTARY_BASE
        if not float(theta).is_integer():
            raise fail(FMT, f"rope_theta {theta} is not a whole number; Megatron's --rotary-base is an integer")
        args += ["--position-embedding-type", "rope", "--rotary-base", str(int(theta))]
        args += rope_args(m)
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    if m.attention is not None:
        args += mla_args(m.attention, m.rope_scaling)
    elif m.n_kv_heads != m.heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.n_kv_heads)]
    if m.qk_norm == "head":
        args.append("--qk-layernorm")
    if m.sliding_window is not None:
        args += window_args(m.sliding_window, m.full_attention_every)
    args += activation_args(m)
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
    if m.mtp_layers:
        args += ["--mtp-num-layers", str(m.mtp_layers)]
    return args


def activation_args(m: TransformerSpec) -> list[str]:
    """The MLP: --swiglu (SiLU-gated), --squared-relu; exact GeLU is the default."""
    if m.ffn == "swiglu":
        return ["--swiglu"]
    return ["--squared-relu"] if m.act == "relu2" else []


def rope_args(m: TransformerSpec) -> list[str]:
    """Partial rotary (--rotary-percent) and, outside MLA, Llama 3.1's RoPE scaling (its factor is
    stated though gpt_builders.py applies GPTModel's default, the same 8)."""
    args = ["--rotary-percent", repr(m.rotary_fraction)] if m.rotary_fraction < 1 else []
    r = m.rope_scaling
    if r is None or m.attention is not None:
        return args
    return args + ["--use-rope-scaling", "--rope-scaling-factor", repr(r.factor)]  # llama3 (model_refusal)


def mla_args(mla: MLA, scaling: RopeScaling | None) -> list[str]:
    """Multi-latent attention (MLATransformerConfig): ranks and head dims, and its RoPE.

    ``--q-lora-rank`` is left out when queries are not compressed (Megatron-LM's default None);
    MLA defaults to YaRN RoPE, so a model without scaling says ``--rope-type rope``.  DeepSeek's
    RMSNorms on the q and kv latents are MLA's q/kv_layernorm, built only with ``--qk-layernorm``
    (megatron-core's layer specs: IdentityOp otherwise).
    """
    args = ["--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", str(mla.kv_lora_rank),
            "--qk-head-dim", str(mla.qk_nope_head_dim), "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim),
            "--v-head-dim", str(mla.v_head_dim)]
    if mla.q_lora_rank:
        args += ["--q-lora-rank", str(mla.q_lora_rank)]
    if scaling is None:
        return args + ["--rope-type", "rope"]
    return args + ["--rope-type", "yarn", "--rotary-scaling-factor", repr(scaling.factor),
                   "--mscale", repr(scaling.mscale if scaling.mscale is not None else 1.0),
                   "--mscale-all-dim", repr(scaling.mscale_all_dim if scaling.mscale_all_dim is not None else 0.0)]


def window_args(window: int, full_every: int | None) -> list[str]:
    """Sliding-window attention: ``--window-size (left,right)``.  A Hugging Face window of W keys
    includes the query's own position (transformers ``sliding_window_overlay``: kv > q - W), so
    W - 1 keys to the left; every k-th layer global is ``--window-attn-skip-freq k``."""
    args = ["--window-size", f"({window - 1},0)"]
    return args + (["--window-attn-skip-freq", str(full_every)] if full_every else [])


def vocab_args(m: TransformerSpec, tp: int) -> list[str]:
    """The embedding's rows, ``--padded-vocab-size``: the model's vocabulary, padded to a multiple of
    tp only when tp does not divide it (VocabParallelEmbedding splits the rows; those few padding rows
    are uncounted by the plan).

    Megatron-LM core_v0.16.1 sizes the embedding from ``--padded-vocab-size`` when given, else from
    the tokenizer (``build_tokenizer``: ``_vocab_size_with_padding(tokenizer.vocab_size)``, padded to
    a multiple of ``make_vocab_size_divisible_by`` x tp).  With the launch's ``--tokenizer-type
    HuggingFaceTokenizer`` that is ``len(tokenizer)``, not ``--vocab-size``: Qwen2.5's tokenizer has
    151,665 entries, its config 151,936 rows, and the model trained would not be the one planned (nor
    load its checkpoint).  Every tokenizer type honours ``--padded-vocab-size``.
    """
    return ["--padded-vocab-size", str(padded_vocab(m.vocab, 1, tp))]


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
        if moe.shared_expert_gate:
            args.append("--moe-shared-expert-gate")
    args += router_args(moe)
    pattern = [1 if moe.is_moe_layer(i) else 0 for i in range(layers)]
    if 0 in pattern:
        args += ["--moe-layer-freq", f"[{','.join(map(str, pattern))}]"]
    return args


def router_args(moe: MoE) -> list[str]:
    """The router (Megatron-Core TopKRouter).  Softmax without renormalised top-k weights is
    ``--moe-router-pre-softmax`` (softmax over all experts, then top-k); Megatron's default
    (top-k logits, then softmax) renormalises.  Sigmoid scores are renormalised for top_k > 1."""
    args = []
    if moe.score_function == "sigmoid":
        args += ["--moe-router-score-function", "sigmoid"]
    elif not moe.normalize_top_k:
        args.append("--moe-router-pre-softmax")
    if moe.topk_scaling != 1.0:
        args += ["--moe-router-topk-scaling-factor", repr(moe.topk_scaling)]
    if moe.groups > 1:
        args += ["--moe-router-num-groups", str(moe.groups), "--moe-router-group-topk", str(moe.group_top_k)]
    if moe.expert_bias:
        args.append("--moe-router-enable-expert-bias")
    return args


ARGS_FILE = "megatron_args.sh"
ENTRY = "pretrain_gpt.py"  # Megatron-LM's GPT pre-training entry point (the default --script)
# What the plan cannot know: each a required environment variable, so a job started without it
# stops at once with the variable's name (bash ${VAR:?message}).
TOKENIZER_WORDS = ("--tokenizer-type", "HuggingFaceTokenizer")  # the tokenizer is a Hugging Face one (TOKENIZER_MODEL)
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
    layer_recompute = "first"  # --recompute-method block
    pipeline_slots = True  # --account-for-embedding/loss-in-pipeline-split, or a layout with them
    builds_mtp = True  # --mtp-num-layers: the modules on the stage with the loss (multi_token_prediction.py)
    # what check_expressible and the compress=bf16 rule read (no cp, ep or vpp: Megatron runs them all)
    config_fields = ("tp", "pp", "dp_replicate", "dp_shard", "sp", "zero", "schedule", "offload_optimizer",
                     "offload_params", "compress", *RECIPE_KEYS, *SLOT_KEYS)
    # its fused bias-SwiGLU and in-place vocab-parallel cross-entropy, Transformer Engine's fp8 casts
    # (Assumptions' docs)
    behaviour = {"swiglu_kept": 3.0, "fused_loss_fuses_mlp": False, "loss_workspace_bytes_per_vocab": 2.0,
                 "loss_workspace_bytes_per_vocab_tp": 2.0, "fp8_casts": "transformer_engine"}
    config_suffixes = (".sh",)
    config_file = ARGS_FILE

    def architecture_refusal(self, model: ModelSpec) -> str | None:
        why = model_refusal(model)
        return f"{FMT}: {why}" if why else None

    def plan_check(self, model: ModelSpec) -> PlanCheck:
        config = self.config_check(model)

        def check(plan: Plan) -> None:  # the rules emit_megatron applies, without writing the arguments
            pipeline_args(plan)
            recompute_args(plan)
            check_batching(plan)

        split = checked(check)
        return lambda plan: config(plan) or split(plan)

    def config_check(self, model: ModelSpec) -> PlanCheck:
        dtype = training_dtype(model)

        def check(plan: Plan) -> None:
            check_expressible(plan)
            if plan.compress == "bf16" and dtype != "bf16":
                raise fail(FMT, f"compress=bf16: Megatron's --grad-reduce-in-bf16 acts only with --bf16 training, "
                                f"and this model trains in {dtype}")

        return checked(check)

    def batching_refusal(self, config: Config) -> str | None:
        return batching_refusal(config)

    def files(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        args = bash_array("MEGATRON_ARGS", emit_megatron(plan, model, cluster), "Megatron-LM arguments")
        return [BundleFile(ARGS_FILE, 'Megatron-LM arguments as a bash array: the launch scripts source it and pass '
                           '"${MEGATRON_ARGS[@]}" to pretrain_gpt.py (set DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, '
                           "TRAIN_ITERS first).  --lr (GPT-3's for this width), its schedule, --save-interval, "
                           "--eval-interval, --eval-iters and --split are defaults: pass your own after them (the last "
                           "value wins).  --padded-vocab-size fixes the embedding at the model's vocabulary: without "
                           "it Megatron-LM would size it from len(tokenizer)", args)]

    def read(self, path: Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
        return ReadConfig(plan_from_megatron(path, model, cluster), self.name, True)

    def dry_run(self, ctx: DryContext, steps: Steps) -> None:
        """What rank ``ctx.rank`` of ``pretrain_gpt.py`` builds before step 1 (:mod:`._megatron_dry`)."""
        from autoplace.frameworks._megatron_dry import dry_run

        dry_run(ctx, steps)

    def program(self, plan: Plan, model: ModelSpec, launch: Launch) -> Program:
        """``pretrain_gpt.py "${MEGATRON_ARGS[@]}"`` with the data, tokenizer and checkpoint
        placeholders (required inputs; a ``--script`` is given those set, :func:`input_words`), and
        CUDA_DEVICE_MAX_CONNECTIONS as Megatron's validate_args wants it."""
        del model
        q = shlex.quote
        inputs = [*TOKENIZER_WORDS, *(w for flag, var, _ in PLACEHOLDERS for w in input_words(flag, var, launch))]
        words = [q(launch.script or ENTRY), '"${MEGATRON_ARGS[@]}"', *inputs]
        return Program((*words, *(q(a) for a in launch.args), '"$@"'),
                       prelude=(f'source "$AUTOPLACE_BUNDLE"/{ARGS_FILE}',), env=megatron_environment(plan),
                       required={} if launch.script else {var: what for _, var, what in PLACEHOLDERS})


def launch_args(value: Callable[[str, str], str]) -> list[str]:
    """The words the launch passes after the bundle's arguments: the tokenizer type and each of
    :data:`PLACEHOLDERS` with ``value(VARIABLE, what it is)`` (the launch: the required variable's value)."""
    words = list(TOKENIZER_WORDS)
    for flag, var, what in PLACEHOLDERS:
        words += [flag, value(var, what)]
    return words


def megatron_environment(plan: Plan) -> dict[str, str | None]:
    """CUDA_DEVICE_MAX_CONNECTIONS by Megatron-LM's own rules (arguments.py validate_args): 1 when
    tensor or context parallelism overlaps its communication with compute on one stream (before
    Blackwell), and not 1 under Megatron-FSDP (zero >= 2), which refuses that value (None = unset)."""
    if plan.zero >= 2:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": None}
    if plan.tp > 1 or plan.cp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}
