"""torchtitan 0.2.2: its job config from a plan -- the TOML, the same job as command-line overrides,
and, for a model that is none of torchtitan's own flavors, a module that registers its shapes.

torchtitan 0.2.2 reads ``--job.config_file x.toml`` (sections ``[model]``, ``[parallelism]``,
``[training]``, ``[activation_checkpoint]``) and takes every field as ``--section.option`` on
the command line.  The model is chosen by name and flavor (``torchtitan/models/<name>``); a
TOML without ``[model]`` trains llama3 ``debugmodel``, so every config names both.  Three of
torchtitan's model families are used: ``llama3`` (RMSNorm, SwiGLU, RoPE with Llama 3.1's
scaling or none, GQA, no biases, untied head), ``qwen3`` (adds per-head QK-norm, an explicit
head_dim, a tied head and mixture-of-experts layers) and ``deepseek_v3`` (MLA, YaRN RoPE, dense
first layers, routed and shared experts).  Whatever none of them implements (biases, LayerNorm,
GeLU, post-norms, windows, soft-capping, ...) is refused by :func:`model_refusal`, naming it.
Names are those of ``torchtitan/config/job_config.py`` (0.2.2).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.emit._common import (
    check_compression,
    check_cpu_offload_together,
    fail,
    model_parts,
    recompute_runs,
    training_dtype,
    uniform_recompute,
)
from autoplace.emit.launch import Launch, bash_array, input_words
from autoplace.errors import EmitError
from autoplace.frameworks._torchtitan_pipeline import SPLIT_BACKWARD, V_SHAPED, schedule_refusal, torch_stage_order
from autoplace.frameworks._torchtitan_read import CUSTOM_FLAVOR, layer_sac_pattern, read_torchtitan
from autoplace.frameworks.base import BundleFile, Framework, PlanCheck, Program, ReadConfig, check_recipe, checked
from autoplace.frameworks.schema import PLAN_TO_TORCH_SCHEDULE
from autoplace.plan import SCHEDULES, Config, Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec, TransformerSpec

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

FMT = "torchtitan"
_PARAM_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
# torchtitan 0.2.2 reads the tokenizer from model.hf_assets_path (default ./tests/assets/tokenizer, its
# repository's test tokenizer): the model's own must be given
TOKENIZER_INPUT = ("HF_ASSETS_PATH", "the directory of the Hugging Face tokenizer files of the model")
CUSTOM_MODULE = "autoplace_torchtitan_model"  # the bundle file registering a custom flavor (custom_import)
# torchtitan 0.2.2's llama3 flavors (torchtitan/models/llama3/__init__.py) as the shapes they build:
# (dim, n_layers, n_heads, n_kv_heads, SwiGLU hidden, vocab, rope_theta); tests compare with torchtitan.
# All three keep RoPEScalingArgs' defaults: Llama 3.1's scaling (factor 8, low 1, high 4, 8192).
LLAMA3_FLAVORS = {
    "8B": (4096, 32, 32, 8, 14336, 128256, 500000.0),
    "70B": (8192, 80, 64, 8, 28672, 128256, 500000.0),
    "405B": (16384, 126, 128, 8, 53248, 128256, 500000.0),
}
LLAMA31_SCALING = {"scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # RoPEScalingArgs' defaults
# RoPEScalingArgs that leave every frequency as it is (torchtitan's llama3 always applies its scaling:
# with factor 1 both the scaled and the interpolated frequencies equal the unscaled ones)
NO_SCALING = {**LLAMA31_SCALING, "scaling_factor": 1.0}
# torchtitan 0.2.2's dense qwen3 flavors (torchtitan/models/qwen3/__init__.py): (dim, n_layers, n_heads,
# n_kv_heads, head_dim, hidden_dim, vocab, rope_theta, tied); every one has qk_norm and no RoPE scaling.
# Its MoE flavors are not listed: MoEArgs' default load_balance_coeff adds an expert bias (aux-loss-free
# balancing) that Qwen3-MoE's router does not have, so a MoE model gets a custom flavor without it.
QWEN3_FLAVORS = {
    "0.6B": (1024, 28, 16, 8, 128, 3072, 151936, 1000000.0, True),
    "1.7B": (2048, 28, 16, 8, 128, 6144, 151936, 1000000.0, True),
    "4B": (2560, 36, 32, 8, 128, 9728, 151936, 1000000.0, True),
    "8B": (4096, 36, 32, 8, 128, 12288, 151936, 1000000.0, False),
    "14B": (5120, 40, 40, 8, 128, 17408, 151936, 1000000.0, False),
    "32B": (5120, 64, 64, 8, 128, 25600, 151936, 1000000.0, False),
}
DEFAULT_ROPE_THETA = 10000.0  # TransformerModelArgs.rope_theta, and Hugging Face's default
# the norm epsilon of torchtitan 0.2.2's own flavors (no flavor sets one: the args classes' defaults,
# TransformerModelArgs.norm_eps and Qwen3ModelArgs.norm_eps)
FLAVOR_NORM_EPS = {"llama3": 1e-5, "qwen3": 1e-6}
# model name -> (the module's import lines, the args class, the flavor registry)
_FAMILY_CODE = {
    "llama3": ("from torchtitan.models.llama3 import TransformerModelArgs, llama3_args\n"
               "from torchtitan.models.llama3.model.args import RoPEScalingArgs\n", "TransformerModelArgs", "llama3_args"),
    "qwen3": ("from torchtitan.models.moe import MoEArgs\nfrom torchtitan.models.qwen3 import Qwen3ModelArgs, qwen3_args\n",
              "Qwen3ModelArgs", "qwen3_args"),
    "deepseek_v3": ("import dataclasses\n\nfrom torch import nn\n"
                    "from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, deepseekv3_args, "
                    "get_train_spec\nfrom torchtitan.models.moe import MoEArgs\n"
                    "from torchtitan.protocols.train_spec import register_train_spec\n",
                    "DeepSeekV3ModelArgs", "deepseekv3_args"),
}
# What a family's model cannot state through its args, set by the flavor module: torchtitan 0.2.2's
# DeepSeekV3Model builds its final RMSNorm without an eps (nn.RMSNorm then adds the input dtype's machine
# epsilon, 2**-7 in bf16), its other norms at norm_eps.  A TrainSpec registered under a model's name takes
# precedence over torchtitan's own (protocols/train_spec.py get_train_spec), so the module registers the
# family's spec with a model class whose final norm takes norm_eps too.
_FAMILY_FIXES = {"deepseek_v3": '''

class DeepSeekV3WithNormEps(DeepSeekV3Model):
    """torchtitan's DeepSeekV3Model with its final RMSNorm at norm_eps, as its other norms."""

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        super().__init__(model_args)
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)


register_train_spec("deepseek_v3", dataclasses.replace(get_train_spec(), model_cls=DeepSeekV3WithNormEps))
'''}
_NESTED = {"rope_scaling_args": "RoPEScalingArgs", "moe_args": "MoEArgs"}  # args fields holding a dataclass


@dataclass(frozen=True)
class TitanModel:
    """Which torchtitan model trains the plan's model: ``name`` and ``flavor``, and the
    ``TransformerModelArgs`` keywords of a custom flavor (None for one of torchtitan's own)."""

    name: str
    flavor: str
    args: dict[str, Any] | None = None


def torchtitan_model(model: ModelSpec) -> TitanModel:
    """torchtitan's model for ``model``: one of its own flavors with the same architecture, or a
    custom flavor of the same family with the model's exact args.

    Raises:
        EmitError: an architecture torchtitan 0.2.2 does not implement (:func:`model_refusal`).
    """
    why = model_refusal(model)
    if why:
        raise fail(FMT, f"not written: {why}")
    assert isinstance(model, TransformerSpec)  # model_refusal refuses layer graphs
    if model.attention is not None:
        return TitanModel("deepseek_v3", CUSTOM_FLAVOR, _deepseek_args(model))
    if _needs_qwen3(model):
        return _qwen3_model(model)
    return _llama3_model(model)


def model_refusal(model: ModelSpec) -> str | None:
    """Why no torchtitan 0.2.2 model (llama3, qwen3, deepseek_v3) trains ``model``'s architecture,
    as one line "feature: why", or None."""
    if not isinstance(model, TransformerSpec):
        return "layer-graph model: torchtitan trains its own model code; a graph of layers has none"
    m = model
    common = [
        (m.qkv_bias and not m.bias, "q/k/v biases (Qwen2 style): torchtitan's attention has no biases"),
        (m.bias, "linear-layer biases: torchtitan's models have none"),
        (m.ffn != "swiglu", "a non-gated (GeLU) MLP: torchtitan's models use SwiGLU"),
        (m.ffn == "swiglu" and m.act != "silu", f"a {m.act}-gated MLP: torchtitan's models gate with SiLU"),
        (m.norm != "rmsnorm", "LayerNorm: torchtitan's models use RMSNorm"),
        (m.position != "rope", f"{m.position} position embeddings: torchtitan's models use RoPE"),
        (m.norm_position != "pre", f"{m.norm_position}-norm blocks (norms on the attention and MLP outputs): "
                                   "torchtitan's blocks are pre-norm"),
        (m.parallel_block, "parallel attention + MLP blocks: torchtitan's blocks are sequential"),
        (m.qk_norm == "layer", "QK-norm over all heads at once (OLMo 2): torchtitan's qwen3 normalises each head"),
        (m.sliding_window is not None, "sliding-window attention: torchtitan 0.2.2's models attend causally "
                                       "to the whole sequence"),
        (m.attn_softcap is not None, "attention logit soft-capping: torchtitan has none"),
        (m.final_logit_softcap is not None, "final logit soft-capping: torchtitan has none"),
        (m.rotary_fraction < 1, f"partial rotary ({m.rotary_fraction} of each head): torchtitan rotates whole heads"),
        (m.embedding_norm, "an embedding LayerNorm: torchtitan has none"),
        (m.scaled_embeddings, "embeddings scaled by sqrt(hidden): torchtitan has no embedding multiplier"),
        (m.mtp_layers > 0, "multi-token-prediction modules: torchtitan 0.2.2's deepseek_v3 has none"),
        (m.dropout, "dropout: torchtitan's models have no dropout layers"),
        (m.moe is not None and m.moe.shared_expert_gate, "a gated shared expert (Qwen-MoE): torchtitan's "
                                                         "shared experts are ungated"),
        (m.moe is not None and m.moe.groups > 1 and m.moe.group_score == "max",
         "group-limited routing scored by each group's best expert: torchtitan scores a group by its top-2 sum"),
        (m.moe is not None and m.moe.layer_freq > 1, "MoE on every k-th layer: torchtitan's MoE layers are "
                                                     "consecutive"),
        (m.moe is not None and m.moe.shared_experts > 0 and m.moe.shared_ffn_hidden != m.moe.expert_ffn_hidden,
         "shared experts wider than a routed expert: torchtitan sizes them as num_shared_experts x moe_inter_dim"),
    ]
    why = next((reason for refused, reason in common if refused), None)
    if why:
        return why
    if m.attention is not None:
        return _deepseek_refusal(m)
    if _needs_qwen3(m):
        return _qwen3_refusal(m)
    return _llama3_refusal(m)


def _needs_qwen3(m: TransformerSpec) -> bool:
    """What llama3 lacks and qwen3 has: QK-norm, head_dim != hidden/heads, a tied head, experts."""
    odd_head = m.hidden % m.heads != 0 or m.dim_head != m.hidden // m.heads
    return m.qk_norm is not None or odd_head or m.tied_embeddings or m.moe is not None


def _llama3_refusal(m: TransformerSpec) -> str | None:
    r = m.rope_scaling
    if r is not None and r.type != "llama3":
        return f"{r.type} RoPE scaling: torchtitan's llama3 implements Llama 3.1's scaling only"
    return None


def _qwen3_refusal(m: TransformerSpec) -> str | None:
    if m.rope_scaling is not None:
        return f"{m.rope_scaling.type} RoPE scaling: torchtitan's qwen3 has no RoPE scaling"
    if m.moe is not None and m.moe.first_dense_layers:
        return "dense first layers before the MoE layers: torchtitan's qwen3 makes every layer MoE"
    return None


def _deepseek_refusal(m: TransformerSpec) -> str | None:
    """torchtitan's deepseek_v3: YaRN (applied only beyond original_seq_len), one mscale, MoE layers."""
    r = m.rope_scaling
    if m.moe is None:
        return "dense MLA model: torchtitan's deepseek_v3 has mixture-of-experts layers"
    if r is None or r.type != "yarn":
        return "MLA without YaRN RoPE: torchtitan's deepseek_v3 always scales RoPE with YaRN"
    if m.seq_len <= (r.original_max_position or 4096):
        return (f"YaRN RoPE at seq_len {m.seq_len}: torchtitan's deepseek_v3 scales only sequences longer than "
                f"original_seq_len ({r.original_max_position or 4096}), Hugging Face's model always")
    if (r.mscale or 1.0) != (r.mscale_all_dim if r.mscale_all_dim is not None else r.mscale or 1.0):
        return "YaRN with mscale != mscale_all_dim: torchtitan's deepseek_v3 has one mscale"
    return None


def _moe_args(m: TransformerSpec) -> dict[str, Any]:
    """torchtitan MoEArgs for the model's experts; expert bias (load_balance_coeff) only if it has one."""
    moe = m.moe
    assert moe is not None
    out: dict[str, Any] = {"num_experts": moe.experts, "num_shared_experts": moe.shared_experts,
                           "top_k": moe.top_k, "score_func": moe.score_function, "route_norm": moe.normalize_top_k,
                           "route_scale": moe.topk_scaling, "score_before_experts": False}
    if moe.groups > 1:
        out.update(num_expert_groups=moe.groups, num_limited_groups=moe.group_top_k)
    out["load_balance_coeff"] = 1e-3 if moe.expert_bias else None  # MoEArgs' default coefficient
    return out


def _llama3_model(m: TransformerSpec) -> TitanModel:
    theta = m.rope_theta or DEFAULT_ROPE_THETA
    r = m.rope_scaling
    scaling = NO_SCALING if r is None else {
        "scaling_factor": r.factor, "low_freq_factor": r.low_freq_factor or 1.0,
        "high_freq_factor": r.high_freq_factor or 4.0,
        "original_max_position_embeddings": r.original_max_position or 8192}
    shape = (m.hidden, m.layers, m.heads, m.n_kv_heads, m.ffn_hidden, m.vocab, theta)
    for flavor, known in LLAMA3_FLAVORS.items():
        if shape == known and scaling == LLAMA31_SCALING and m.norm_eps in (None, FLAVOR_NORM_EPS["llama3"]):
            return TitanModel("llama3", flavor)
    # torchtitan sizes the SwiGLU hidden layer as multiple_of * ceil(int(mult * int(8 * dim / 3)) / multiple_of)
    # (llama3 FeedForward); multiple_of = ffn_hidden with mult = ffn_hidden / int(8 * dim / 3) gives it exactly.
    base = int(2 * 4 * m.hidden / 3)
    args = {"dim": m.hidden, "n_layers": m.layers, "n_heads": m.heads, "n_kv_heads": m.n_kv_heads,
            "vocab_size": m.vocab, "multiple_of": m.ffn_hidden, "ffn_dim_multiplier": m.ffn_hidden / base,
            "rope_theta": theta, "rope_scaling_args": scaling, **_norm_eps(m)}
    return TitanModel("llama3", CUSTOM_FLAVOR, args)


def _norm_eps(m: TransformerSpec) -> dict[str, float]:
    """The args' ``norm_eps`` (every family's args name it so) when the model states one."""
    return {} if m.norm_eps is None else {"norm_eps": m.norm_eps}


def _qwen3_model(m: TransformerSpec) -> TitanModel:
    theta = m.rope_theta or DEFAULT_ROPE_THETA
    shape = (m.hidden, m.layers, m.heads, m.n_kv_heads, m.dim_head, m.ffn_hidden, m.vocab, theta, m.tied_embeddings)
    if m.moe is None and m.qk_norm == "head" and m.norm_eps in (None, FLAVOR_NORM_EPS["qwen3"]):
        for flavor, known in QWEN3_FLAVORS.items():
            if shape == known:
                return TitanModel("qwen3", flavor)
    args: dict[str, Any] = {"dim": m.hidden, "n_layers": m.layers, "n_heads": m.heads, "n_kv_heads": m.n_kv_heads,
                            "vocab_size": m.vocab, "head_dim": m.dim_head, "hidden_dim": m.ffn_hidden,
                            "rope_theta": theta, "qk_norm": m.qk_norm == "head",
                            "enable_weight_tying": m.tied_embeddings, **_norm_eps(m)}
    if m.moe is not None:
        args.update(moe_enabled=True, moe_inter_dim=m.moe.expert_ffn_hidden, moe_args=_moe_args(m))
    return TitanModel("qwen3", CUSTOM_FLAVOR, args)


def _deepseek_args(m: TransformerSpec) -> dict[str, Any]:
    """DeepSeekV3ModelArgs for an MLA model (:func:`_deepseek_refusal` checked it)."""
    mla, moe, r = m.attention, m.moe, m.rope_scaling
    assert mla is not None and moe is not None and r is not None
    return {"vocab_size": m.vocab, "dim": m.hidden, "inter_dim": m.ffn_hidden, "moe_inter_dim": moe.expert_ffn_hidden,
            "n_layers": m.layers, "n_dense_layers": moe.first_dense_layers, "n_heads": m.heads,
            "moe_args": _moe_args(m), "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim, "original_seq_len": r.original_max_position or 4096,
            "rope_theta": m.rope_theta or DEFAULT_ROPE_THETA, "rope_factor": r.factor,
            "beta_fast": int(r.beta_fast or 32), "beta_slow": int(r.beta_slow or 1),
            "mscale": r.mscale if r.mscale is not None else 1.0, **_norm_eps(m)}


def emit_torchtitan(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> dict[str, Any]:
    """The torchtitan 0.2 job config of ``plan`` as a TOML-ready dict of sections.

    Raises:
        EmitError: fp16 training, ZeRO-1, TP without sequence parallelism, or a recompute
            pattern torchtitan's activation_checkpoint modes cannot produce.
    """
    del cluster
    check_expressible(plan, model)
    titan = torchtitan_model(model)
    doc: dict[str, Any] = {
        "model": {"name": titan.name, "flavor": titan.flavor},
        "training": training_section(plan, model),
        "parallelism": parallelism_section(plan),
        "activation_checkpoint": activation_checkpoint_section(plan, FMT),
    }
    for section, table in recipe_sections(plan, model).items():
        doc.setdefault(section, {}).update(table)
    if titan.args is not None:  # torchtitan imports it before looking the flavor up (Trainer.__init__)
        doc["experimental"] = {"custom_import": CUSTOM_MODULE}
    return doc


FP8_CONVERTERS = {"tensorwise": "quantize.linear.float8", "rowwise": "quantize.linear.float8",
                  "mxfp8": "quantize.linear.mx"}  # torchao's Float8Linear / MXLinear (job_config.py, 0.2.2)


def recipe_sections(plan: Plan, model: ModelSpec) -> dict[str, Any]:
    """The plan's recipe keys as torchtitan 0.2.2 states them: ``[compile]`` (``components``
    "model", and "loss" for fused_loss: torchtitan's fused cross-entropy is its compiled loss),
    async TP (``parallelism.enable_async_tensor_parallel``), and fp8 as a model converter with
    its recipe (the output head stays in bf16, ``filter_fqns``)."""
    out: dict[str, Any] = {}
    if plan.compile:
        out["compile"] = {"enable": True, "components": ["model", "loss"] if plan.fused_loss else ["model"]}
    if plan.fp8 != "none":
        converter = FP8_CONVERTERS[plan.fp8]
        out["model"] = {"converters": [converter]}
        out[converter] = {"recipe_name": "mxfp8_cublas" if plan.fp8 == "mxfp8" else plan.fp8, "filter_fqns": ["output"]}
    elif model.training.recipe().compute_dtype == "fp8":  # the model file's fp8: torchao's default recipe
        out["model"] = {"converters": [FP8_CONVERTERS["tensorwise"]]}  # the head in bf16 as costed (no default filter)
        out[FP8_CONVERTERS["tensorwise"]] = {"filter_fqns": ["output"]}
    return out


def torchtitan_model_module(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> str:
    """Python source registering the model's args as flavor ``autoplace`` of its torchtitan 0.2.2 family
    (and what its args cannot state: ``_FAMILY_FIXES``); empty when the model is one of torchtitan's own
    flavors (nothing to register).

    Raises:
        EmitError: an architecture torchtitan does not implement, or a plan it cannot run.
    """
    emit_torchtitan(plan, model, cluster)
    titan = torchtitan_model(model)
    if titan.args is None:
        return ""
    imports, cls, registry = _FAMILY_CODE[titan.name]
    fields = ",\n    ".join(f"{key}={_py_value(key, value)}" for key, value in titan.args.items())
    return (f'"""torchtitan 0.2.2 {titan.name} flavor {CUSTOM_FLAVOR!r} for {json.dumps(model.name)}, generated by '
            "autoplace.\n\n"
            "torchtitan.toml imports this module ([experimental] custom_import) before it looks the flavor up;\n"
            'run with the bundle on the import path: PYTHONPATH="$AUTOPLACE_BUNDLE:$PYTHONPATH".\n"""\n\n'
            f"{imports}\n"
            f"{registry}[{CUSTOM_FLAVOR!r}] = {cls}(\n    {fields},\n)\n{_FAMILY_FIXES.get(titan.name, '')}")


def _py_value(key: str, value: Any) -> str:
    """A flavor field as Python source: nested dataclasses (RoPEScalingArgs, MoEArgs) by constructor."""
    if key in _NESTED:
        return f"{_NESTED[key]}({', '.join(f'{k}={v!r}' for k, v in value.items())})"
    return repr(value)


def check_expressible(plan: Plan, model: ModelSpec) -> None:
    """Raise EmitError for what torchtitan's job config cannot state (the model included)."""
    expressible_check(model)(plan)


def expressible_check(model: ModelSpec, whole_plan: bool = True) -> Callable[[Plan], None]:
    """:func:`check_expressible` for one model, whose own rules are judged once: ``check(plan)``
    raises what ``check_expressible(plan, model)`` raises (the search judges thousands of plans);
    without ``whole_plan``, only the rules of its configuration (not its per-layer recompute or
    micro-batching: ``Framework.config_check``).

    Raises:
        EmitError: an architecture torchtitan does not implement (before any plan is read).
    """
    family = torchtitan_model(model).name
    fp16 = training_dtype(model) == "fp16"

    def check(plan: Plan) -> None:
        check_compression(plan, FMT, Torchtitan.compressions)
        check_recipe(plan, Torchtitan)
        if (plan.fused_loss or plan.tp_overlap != "none") and not plan.compile:
            what = "fused_loss=true" if plan.fused_loss else f"tp_overlap={plan.tp_overlap}"
            raise fail(FMT, f"{what} without compile: torchtitan fuses the loss and runs async TP only under "
                            "torch.compile ([compile] components)")
        if fp16:
            raise fail(FMT, "training.precision fp16: torchtitan trains in bf16 or fp32 (mixed_precision_param), "
                            "not fp16")
        if family == "qwen3" and plan.pp > 1:  # its TrainSpec has pipelining_fn=None
            raise fail(FMT, f"pp={plan.pp}: torchtitan 0.2.2's qwen3 model has no pipeline parallelism")
        _check_plan(plan)
        if whole_plan:
            activation_checkpoint_section(plan, FMT)  # every-N-th-block patterns only
            check_batching(plan)

    return check


def check_batching(plan: Plan) -> None:
    """Raise :func:`batching_refusal`'s line as EmitError."""
    why = batching_refusal(plan)
    if why:
        raise EmitError(why)


def _check_plan(plan: Plan) -> None:
    """The rules of :func:`check_expressible` that read the plan alone."""
    if plan.zero == 1 and plan.dp_shard * plan.cp > 1:
        raise fail(FMT, "zero=1: FSDP2 has no optimizer-only sharding; the nearest is zero=2 "
                        "(fsdp_reshard_after_forward = never)")
    if plan.zero == 0 and plan.dp_shard > 1:
        raise fail(FMT, f"dp_shard={plan.dp_shard} with zero=0 shards nothing; use dp_replicate")
    if plan.zero == 0 and plan.cp > 1:
        raise fail(FMT, f"cp={plan.cp} with zero=0: torchtitan always shards the weights over the context-parallel "
                        "group with FSDP; use zero=2 or 3")
    if plan.dp_shard * plan.cp == 1 and plan.dp_replicate > 1 and plan.world != plan.dp_replicate:
        raise fail(FMT, "torchtitan 0.2's DDP (dp_replicate without dp_shard or cp) is 1-D only; "
                        "shard the data-parallel group to combine it with tp/pp")
    if plan.tp > 1 and not plan.sp:
        raise fail(FMT, f"tp={plan.tp} without sp: torchtitan 0.2 always applies sequence parallelism with TP")
    check_cpu_offload_together(plan, FMT, "training.enable_cpu_offload")
    if plan.offload_params == "cpu" and (plan.zero < 2 or plan.dp_shard * plan.cp == 1):
        raise fail(FMT, "CPU offload needs FSDP: zero >= 2 over a shard group (dp_shard * cp) larger than one")
    if plan.ep > 1 and (plan.dp_shard * plan.cp * plan.tp) % plan.ep:
        raise fail(FMT, f"ep={plan.ep} must divide dp_shard*cp*tp = {plan.dp_shard * plan.cp * plan.tp} "
                        "(torchtitan carves experts from the FSDP x CP x TP ranks)")
    if plan.pp > 1:
        parts = stage_parts(plan)
        if any(n == 0 for n in parts[1:-1]):
            raise fail(FMT, f"a middle pipeline stage would hold no modules ({parts}); torchtitan needs one")
    torch_schedule = PLAN_TO_TORCH_SCHEDULE[plan.schedule]
    if plan.compile and torch_schedule in SPLIT_BACKWARD:
        raise fail(FMT, f"schedule={plan.schedule} with compile: torch's {torch_schedule} refuses torch.compile'd "
                        "stage modules (it splits their backward); set compile=false")
    if dualpipe_overlap(plan) and set(plan.recompute) != {"none"}:
        raise fail(FMT, f"schedule=dualpipev with ep={plan.ep}: torchtitan's DualPipeV all-to-all overlap runs without "
                        "activation checkpointing (dual_pipe_v.get_dual_pipe_v_flag); set recompute=none")


def dualpipe_overlap(plan: Config) -> bool:
    """Whether torchtitan overlaps the plan's expert-parallel all-to-all with DualPipeV's paired chunk
    (``parallelism.pipeline_parallel_expert_parallel_overlap``, on by default, takes effect with pp > 1 and
    ep > 1 only): the overlap the cost model prices for dualpipev (terms_time._block_comm)."""
    return plan.schedule == "dualpipev" and plan.pp > 1 and plan.ep > 1


def stage_parts(plan: Plan) -> list[int]:
    """Blocks in each model chunk in torchtitan's stage order for the plan's schedule
    (:func:`torch_stage_order`: the looped order, or a V for ZBVZeroBubble)."""
    return torch_stage_order(model_parts(plan, FMT), plan.pp, PLAN_TO_TORCH_SCHEDULE[plan.schedule])


def batching_refusal(config: Config) -> str | None:
    """Why torchtitan cannot build the pipeline schedule of ``config``'s micro-batching (its
    schedule builder's checks, :func:`schedule_refusal`), or None; it reads only pp, vpp, schedule,
    mbs and grad_accum (``Framework.batching_refusal``)."""
    if config.pp == 1:
        return None
    why = schedule_refusal(PLAN_TO_TORCH_SCHEDULE[config.schedule], config.pp, config.vpp, local_batch(config),
                           config.mbs)
    return f"{FMT}: {why}" if why else None


def local_batch(plan: Config) -> int:
    """``training.local_batch_size``: torchtitan's gradient accumulation is global / (local * dp).
    Without PP, local is one micro-batch; with PP, local is all micro-batches of a step
    (n_microbatches = local / pipeline_parallel_microbatch_size), so torchtitan accumulates once."""
    return plan.mbs * (plan.grad_accum if plan.pp > 1 else 1)


def training_section(plan: Plan, model: ModelSpec) -> dict[str, Any]:
    """``[training]``: batch sizes as torchtitan counts them (:func:`local_batch`), sequence length,
    precision, offload."""
    return {
        "local_batch_size": local_batch(plan),
        "global_batch_size": plan.global_batch,
        "seq_len": model.seq_len,
        "mixed_precision_param": _PARAM_DTYPE[training_dtype(model)],
        "enable_cpu_offload": plan.offload_params == "cpu",
    }


def parallelism_section(plan: Plan) -> dict[str, Any]:
    """``[parallelism]``: degrees, FSDP resharding, and the pipeline split when pp > 1."""
    out: dict[str, Any] = {
        "data_parallel_replicate_degree": plan.dp_replicate,
        "data_parallel_shard_degree": plan.dp_shard,
        "tensor_parallel_degree": plan.tp,
        "context_parallel_degree": plan.cp,
        "expert_parallel_degree": plan.ep,
        "pipeline_parallel_degree": plan.pp,
    }
    if plan.dp_shard * plan.cp > 1:  # FSDP is applied: ZeRO-3 reshards after forward, ZeRO-2 does not
        out["fsdp_reshard_after_forward"] = "always" if plan.zero == 3 else "never"
    if plan.tp_overlap == "async":
        out["enable_async_tensor_parallel"] = True
    if plan.pp > 1:
        out.update(pipeline_keys(plan))
    return out


def pipeline_keys(plan: Plan) -> dict[str, Any]:
    """Schedule, micro-batch size and split: a uniform layers-per-stage, else module FQNs per chunk.

    A uniform split is stated as ``pipeline_parallel_layers_per_stage`` with no layer
    discount for the embedding and head stages (torchtitan's ``*_less_layers`` = 0), which
    makes torchtitan's own splitter produce exactly the plan's chunks.
    """
    parts = stage_parts(plan)
    out: dict[str, Any] = {
        "pipeline_parallel_schedule": PLAN_TO_TORCH_SCHEDULE[plan.schedule],
        "pipeline_parallel_microbatch_size": plan.mbs,
    }
    if dualpipe_overlap(plan):
        out["pipeline_parallel_expert_parallel_overlap"] = True
    if len(set(parts)) == 1:
        out.update({"pipeline_parallel_layers_per_stage": parts[0],
                    "pipeline_parallel_first_stage_less_layers": 0,
                    "pipeline_parallel_last_stage_less_layers": 0})
    else:
        out["module_fqns_per_model_part"] = module_fqns(parts)
    return out


def module_fqns(parts: list[int]) -> list[list[str]]:
    """torchtitan module names per model chunk: embedding first, ``layers.i``, norm and head last."""
    out, start = [], 0
    for i, n in enumerate(parts):
        names = [f"layers.{j}" for j in range(start, start + n)]
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == len(parts) - 1:
            names += ["norm", "output"]
        out.append(names)
        start += n
    return out


def activation_checkpoint_section(plan: Plan, fmt: str) -> dict[str, Any]:
    """``[activation_checkpoint]``: none, full, op-level selective, or full on every N-th block."""
    mode = uniform_recompute(plan)
    if mode in ("none", "full"):
        return {"mode": mode}
    if mode == "selective":
        return {"mode": "selective", "selective_ac_option": "op"}
    if set(plan.recompute) == {"none", "full"}:
        parts = stage_parts(plan) if plan.pp > 1 else [len(plan.recompute)]
        v_shaped = PLAN_TO_TORCH_SCHEDULE[plan.schedule] in V_SHAPED
        for every in range(2, len(plan.recompute) + 1):
            if layer_sac_pattern(parts, plan.pp, every, v_shaped) == plan.recompute:
                return {"mode": "selective", "selective_ac_option": str(every)}
    raise fail(fmt, "torchtitan recomputes all blocks (full or op-selective) or every N-th block in full; "
                    f"this plan's per-layer recompute [{recompute_runs(plan)}] is neither")


def torchtitan_toml(doc: dict[str, Any], header: str = "") -> str:
    """Serialize the sections of :func:`emit_torchtitan` as TOML (tables of scalars and string lists)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, table in doc.items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def torchtitan_overrides(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """The same job as torchtitan 0.2.2 command-line overrides (``--section.option value``).

    Given after ``--job.config_file`` they win over the TOML; alone they describe the whole job.
    """
    doc = emit_torchtitan(plan, model, cluster)
    args: list[str] = []
    for section, table in doc.items():
        for key, value in table.items():
            args += _cli_words(section, key, value)
    return args


def _cli_words(section: str, key: str, value: Any) -> list[str]:
    if isinstance(value, bool):  # tyro turns booleans into --x / --no_x flags
        return [f"--{section}.{key}" if value else f"--{section}.no_{key}"]
    if isinstance(value, list) and value and isinstance(value[0], list):  # list[list[str]]: one comma-joined word
        return [f"--{section}.{key}", *(",".join(chunk) for chunk in value)]  # per chunk (torchtitan's list rule)
    if isinstance(value, list):  # list[str]: one comma-joined word (torchtitan's ConfigManager list_str_rule)
        return [f"--{section}.{key}", ",".join(map(str, value))]
    return [f"--{section}.{key}", str(value)]


CONFIG = "torchtitan.toml"


class Torchtitan(Framework):
    """torchtitan 0.2.2 (TOML-configured): FSDP2/HSDP, TP with SP, CP, EP, pipelines with its
    schedules, full / op-selective / every-N-th-block recompute.  FSDP2 keeps fp32 shards and
    reduces in fp32 (training.mixed_precision_reduce is Literal["float32"] in 0.2.2)."""

    name = FMT
    title = "torchtitan"
    bf16_recipe = "bf16-fsdp2"
    config_suffixes = (".toml",)
    config_file = CONFIG
    layer_recompute = "every"  # [activation_checkpoint] selective_ac_option = N
    batching_rules = True  # its pipeline schedules' micro-batch counts (batching_refusal)
    # torch.distributed.pipelining's classes it builds by name (parallelism.pipeline_parallel_schedule)
    schedules = frozenset(SCHEDULES)
    # its pipelines (torch.distributed.pipelining) hold FSDP2's gradient sync to the last micro-batch
    behaviour = {"pipeline_defers_grad_sync": True, "fsdp2_dim0_padding": True}
    # [compile], async TP, FSDP2's prefetch (always on), torchao's float8 and MX converters
    recipes = {"compile": (True, False), "fused_loss": (True, False), "tp_overlap": ("async", "none"),
               "overlap": (True,), "fp8": ("none", "tensorwise", "rowwise", "mxfp8")}

    def architecture_refusal(self, model: ModelSpec) -> str | None:
        why = model_refusal(model)
        return f"{FMT}: {why}" if why else None

    def plan_check(self, model: ModelSpec) -> PlanCheck:
        if model_refusal(model) is not None:
            return checked(lambda plan: check_expressible(plan, model))
        return checked(expressible_check(model))

    def config_check(self, model: ModelSpec) -> PlanCheck:
        if model_refusal(model) is not None:
            return self.plan_check(model)
        return checked(expressible_check(model, whole_plan=False))

    def batching_refusal(self, config: Config) -> str | None:
        return batching_refusal(config)

    def recompute_modes(self, config: Config) -> tuple[str, ...]:
        return ("none",) if dualpipe_overlap(config) else self.uniform_recompute  # _check_plan's DualPipeV rule

    def files(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        toml = torchtitan_toml(emit_torchtitan(plan, model, cluster),
                               f"torchtitan job config generated by autoplace\nplan: {plan.to_string()}")
        files = [BundleFile(CONFIG, "torchtitan 0.2.2 job config (the launch scripts pass it as --job.config_file; "
                            "add --model.hf_assets_path YOUR_TOKENIZER_DIR to their command line)", toml)]
        module = torchtitan_model_module(plan, model, cluster)
        if module:
            files.append(BundleFile(f"{CUSTOM_MODULE}.py", f"torchtitan model flavor {CUSTOM_FLAVOR!r} with this model's "
                                    "shapes, imported by torchtitan.toml (the launch scripts put the bundle on "
                                    "PYTHONPATH)", module))
        overrides = bash_array("TORCHTITAN_OVERRIDES", torchtitan_overrides(plan, model, cluster),
                               "torchtitan 0.2.2 command-line overrides")
        files.append(BundleFile("torchtitan_overrides.sh", "the same job as torchtitan 0.2.2 overrides in a bash "
                                'array: source it, then pass "${TORCHTITAN_OVERRIDES[@]}"', overrides))
        return files

    def program(self, plan: Plan, model: ModelSpec, launch: Launch) -> Program:
        """torchtitan's own entry point with the bundle's TOML (``-m torchtitan.train``) and the
        tokenizer's directory (a required input); a ``--script`` runs in its place, given the
        tokenizer's directory when it is set (:func:`input_words`)."""
        del plan, model
        q = shlex.quote
        entry = ("-m", "torchtitan.train") if launch.script is None else (q(launch.script),)
        var, what = TOKENIZER_INPUT
        return Program((*entry, "--job.config_file", f'"$AUTOPLACE_BUNDLE"/{CONFIG}',
                        *input_words("--model.hf_assets_path", var, launch), *(q(a) for a in launch.args), '"$@"'),
                       required={} if launch.script else {var: what})

    def read(self, path: Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
        return ReadConfig(plan_from_torchtitan(path, model, cluster), self.name, True)

    def dry_run(self, ctx: DryContext, steps: Steps) -> None:
        """torchtitan 0.2.2's own build below its trainer (which needs CUDA): ConfigManager on the launch's
        words, ParallelDims and the mesh, the model on the meta device, the pipeline split and schedule,
        parallelize_fn, the optimizers (:mod:`autoplace.frameworks._torchtitan_dry`)."""
        from autoplace.frameworks._torchtitan_dry import dry_run

        dry_run(ctx, steps)


def plan_from_torchtitan(cfg: Any, model: ModelSpec, cluster: ClusterSpec) -> Plan:
    """A torchtitan 0.2 job config (a TOML path or its parsed dict, + model + cluster) as a Plan;
    the job must train the model file's model (:func:`torchtitan_model`).

    Raises:
        SpecError: unknown sections or keys, invalid choices, degrees whose product is not the
            cluster's GPU count, a schedule or split a Plan cannot state, another model.
    """
    return read_torchtitan(cfg, model, cluster, torchtitan_model)
