"""Translate a Hugging Face ``config.json`` into autoplace's model shorthand.

Pure Python: the config is read as plain JSON data, never through ``transformers``.
Only the keys the shorthand needs are read, each with a type check; the dozens of
other keys a Hub config carries (token ids, ``rope_scaling``, ``torch_dtype``,
quantization settings, ...) are tolerated and ignored because they do not change
the shapes autoplace plans for.

One translator per family, chosen through ``_FAMILIES`` (model_type -> accepted
``architectures`` and translator). Every translator reads the config through a
``_Reader`` so that a missing or ill-typed key raises ``SpecError`` naming the
Hugging Face key and what would be valid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from autoplace.errors import SpecError
from autoplace.specs import _hf_more as more
from autoplace.specs._hf_read import (
    _ROPE_KEYS,
    SEQ_LEN_CAP,
    _activation,
    _decoder_shape,
    _dropout,
    _heads,
    _llama_biases,
    _moe,
    _norm_eps,
    _qwen_moe,
    _Reader,
    _rope_decoder,
    _rope_scaling,
    _rope_theta,
    _rotary_fraction,
    _seq_len,
    _window,
)

__all__ = ["SEQ_LEN_CAP", "hf_key", "shorthand_from_hf"]


# ---------------------------------------------------------------- families


def _llama(r: _Reader) -> dict[str, Any]:
    """llama (incl. Llama 3) and mistral: rope_scaling is ignored; Mistral-7B-v0.1's
    sliding_window (4096 of a 32k context) is kept."""
    out = {**_rope_decoder(r), **_llama_biases(r)}
    return {**out, **_window(r, out["layers"], r.integer("max_position_embeddings"))}


def _mixtral(r: _Reader) -> dict[str, Any]:
    """mixtral: every layer is MoE; each expert is an intermediate_size SwiGLU MLP."""
    out = _llama(r)
    out["moe"] = _moe(
        r, experts=r.integer("num_local_experts"), expert_ffn=out["ffn_hidden"],
        shared=0, shared_ffn=0, first_dense=0, layer_freq=1,
    )
    return out


def _qwen2(r: _Reader) -> dict[str, Any]:
    """qwen2: q/k/v carry biases, o_proj and the MLP do not (hard-coded in Qwen2Attention).

    sliding_window is read only when use_sliding_window is true (then refused: Qwen's
    max_window_layers split cannot be expressed); every published Qwen2 config has it false.
    """
    out = {**_rope_decoder(r), "qkv_bias": True}
    return {**out, **_window(r, out["layers"], r.integer("max_position_embeddings"))}


def _qwen2_moe(r: _Reader) -> dict[str, Any]:
    """qwen2_moe (Qwen1.5-MoE, Qwen2-MoE): routed experts plus one gated shared expert.

    layer_freq is decoder_sparse_step. Qwen counts MoE layers as (i + 1) % step == 0,
    which agrees with the every-layer case (step 1) used by the published models.
    """
    return {**_qwen2(r), "moe": _qwen_moe(r)}


def _mla(r: _Reader) -> dict[str, Any]:
    """DeepSeek multi-head latent attention sizes; q_lora_rank null means no Q compression."""
    if "q_lora_rank" not in r.config:
        raise r.error("q_lora_rank", "required key is missing (null for no Q compression, else an integer)")
    return {
        "type": "mla",
        "q_lora_rank": r.integer("q_lora_rank", default=0),
        "kv_lora_rank": r.integer("kv_lora_rank"),
        "qk_nope_head_dim": r.integer("qk_nope_head_dim"),
        "qk_rope_head_dim": r.integer("qk_rope_head_dim"),
        "v_head_dim": r.integer("v_head_dim"),
    }


def _deepseek(r: _Reader) -> dict[str, Any]:
    """deepseek_v2 / deepseek_v3: MLA attention, dense first layers, fine-grained MoE.

    intermediate_size is the dense-layer MLP; each routed and shared expert is a
    moe_intermediate_size SwiGLU MLP (DeepSeek fuses the n_shared_experts into one
    MLP of n_shared * moe_intermediate_size, which has the same parameters).
    DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers) are
    counted in mtp_layers: each is one more decoder block of the last kind (MoE) plus a
    2h -> h projection and norms, sharing the embedding and head (DeepSeek-V3 report, Sec. 2.2).
    """
    if r.flag("attention_bias", False):
        raise r.error("attention_bias", "MLA projections with biases are not supported; expected false")
    out = _rope_decoder(r, mla=True)
    out["attention"] = _mla(r)
    experts = r.integer("n_routed_experts", default=None)
    if experts is not None:  # null n_routed_experts: a dense DeepSeek model
        expert_ffn = r.integer("moe_intermediate_size")
        shared = r.integer("n_shared_experts", default=0, minimum=0)
        out["moe"] = _moe(
            r, experts=experts, expert_ffn=expert_ffn, shared=shared,
            shared_ffn=expert_ffn if shared else 0,
            first_dense=r.integer("first_k_dense_replace", default=0, minimum=0),
            layer_freq=r.integer("moe_layer_freq", default=1),
        ) | _deepseek_routing(r)
    mtp = r.integer("num_nextn_predict_layers", default=0, minimum=0)
    return {**out, **({"mtp_layers": mtp} if mtp else {})}


def _deepseek_routing(r: _Reader) -> dict[str, Any]:
    """DeepSeek's router: score function, top-k renormalisation and scaling, group-limited routing
    (V2's group_limited_greedy scores a group by its best expert; V3's noaux_tc by the sum of its
    top-2 bias-corrected scores) and V3's expert bias.  Defaults are DeepseekV2Config's."""
    scoring = r.config.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise r.error("scoring_func", f"must be softmax or sigmoid, got {scoring!r}")
    method = r.config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise r.error("topk_method", f"must be greedy, group_limited_greedy or noaux_tc, got {method!r}")
    scale = r.config.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise r.error("routed_scaling_factor", f"must be a positive number, got {scale!r}")
    out: dict[str, Any] = {"score_function": scoring, "normalize_top_k": r.flag("norm_topk_prob", False),
                           "topk_scaling": float(scale), "expert_bias": method == "noaux_tc"}
    if method != "greedy":
        out.update(groups=r.integer("n_group", default=1), group_top_k=r.integer("topk_group", default=1),
                   group_score="top2_sum" if method == "noaux_tc" else "max")
    return out


def _gpt2(r: _Reader, *, activation: str = "gelu_new") -> dict[str, Any]:
    """gpt2: LayerNorm, GELU 2-matrix MLP, biases everywhere, learned positions, tied head.

    GPT2Config ties the LM head by default and sets n_inner (null) to 4 * n_embd.
    """
    hidden = r.integer("n_embd")
    # n_ctx is the older spelling of n_positions; read it only when n_positions is absent.
    only_n_ctx = "n_positions" not in r.config and "n_ctx" in r.config
    positions = r.integer("n_ctx" if only_n_ctx else "n_positions")
    return {
        "layers": r.integer("n_layer"),
        "hidden": hidden,
        "ffn_hidden": r.integer("n_inner", default=4 * hidden),
        **_heads(r, hidden, "n_head", hidden_key="n_embd"),
        "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(positions),
        "ffn": "gelu",
        "norm": "layernorm",
        **_norm_eps(r),
        "bias": True,
        "qkv_bias": True,
        "tied_embeddings": r.flag("tie_word_embeddings", True),
        "position": "learned",
        "max_position": positions,
        "dropout": _dropout(r),
        **_activation(r, "gelu", ("activation_function",), default=activation),
    }


def _gpt_neox(r: _Reader) -> dict[str, Any]:
    """gpt_neox (Pythia, GPT-NeoX-20B): LayerNorm, GELU 2-matrix MLP, biases, (partial) RoPE.

    use_parallel_residual (attention and MLP in parallel) and rotary_pct (the rotated part of
    each head) default as in GPTNeoXConfig: true and 0.25.  The LM head is untied unless
    tie_word_embeddings is true.
    """
    if not r.flag("attention_bias", True):
        raise r.error("attention_bias",
                      "attention without biases next to a biased MLP cannot be expressed; expected true")
    key = next((k for k in ("rotary_pct", "partial_rotary_factor") if r.config.get(k) is not None), None)
    fraction = _rotary_fraction(r, key) if key else {"rotary_fraction": 0.25}
    return {
        **_decoder_shape(r),
        "ffn": "gelu",
        "norm": "layernorm",
        **_norm_eps(r),
        "bias": True,
        "qkv_bias": True,
        "tied_embeddings": r.flag("tie_word_embeddings", False),
        "position": "rope",
        **_rope_theta(r, "rotary_emb_base"),
        **_rope_scaling(r),
        **fraction,
        "parallel_block": r.flag("use_parallel_residual", True),
        **_activation(r, "gelu", default="gelu"),
        "dropout": _dropout(r),
    }


def _gpt_bigcode(r: _Reader) -> dict[str, Any]:
    """gpt_bigcode (StarCoder, SantaCoder): GPT-2 with multi-query attention (multi_query,
    default true: one k/v head shared by all heads)."""
    out = _gpt2(r, activation="gelu_pytorch_tanh")  # GPTBigCodeConfig's default
    if r.flag("multi_query", True):
        out["kv_heads"] = 1
    return out


# Shorthand field -> the Hugging Face keys its value is read from, first present one first
# (kv_heads defaults to the head count, gpt2's n_inner to 4 * n_embd).  Used to report an
# error the shorthand validator finds (a value out of range) under the config's own key.
_Keys = dict[str, tuple[str, ...]]
_LLAMA_KEYS: _Keys = {
    "layers": ("num_hidden_layers",), "hidden": ("hidden_size",), "ffn_hidden": ("intermediate_size",),
    "heads": ("num_attention_heads",), "kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "head_dim": ("head_dim",), "vocab": ("vocab_size",), "seq_len": ("max_position_embeddings",),
}
_TOP_K: _Keys = {"moe.top_k": ("num_experts_per_tok",)}
_MIXTRAL_KEYS: _Keys = {**_LLAMA_KEYS, **_TOP_K, "moe.experts": ("num_local_experts",),
                        "moe.expert_ffn_hidden": ("intermediate_size",)}
_QWEN2_MOE_KEYS: _Keys = {
    **_LLAMA_KEYS, **_TOP_K, "moe.experts": ("num_experts",), "moe.expert_ffn_hidden": ("moe_intermediate_size",),
    "moe.shared_experts": ("shared_expert_intermediate_size",),
    "moe.shared_ffn_hidden": ("shared_expert_intermediate_size",), "moe.layer_freq": ("decoder_sparse_step",),
}
_DEEPSEEK_KEYS: _Keys = {
    **_LLAMA_KEYS, **_TOP_K, "moe.experts": ("n_routed_experts",), "moe.expert_ffn_hidden": ("moe_intermediate_size",),
    "moe.shared_experts": ("n_shared_experts",), "moe.shared_ffn_hidden": ("moe_intermediate_size",),
    "moe.first_dense_layers": ("first_k_dense_replace",), "moe.layer_freq": ("moe_layer_freq",),
    **{f"attention.{k}": (k,) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                        "v_head_dim")},
}
_GPT2_KEYS: _Keys = {
    "layers": ("n_layer",), "hidden": ("n_embd",), "ffn_hidden": ("n_inner", "n_embd"), "heads": ("n_head",),
    "kv_heads": ("num_key_value_heads", "n_head"), "head_dim": ("head_dim",), "vocab": ("vocab_size",),
    "seq_len": ("n_positions", "n_ctx"), "max_position": ("n_positions", "n_ctx"),
}

_QWEN3_MOE_KEYS: _Keys = {k: v for k, v in _QWEN2_MOE_KEYS.items() if not k.startswith("moe.shared")}
_GEMMA3_KEYS: _Keys = {k: tuple(f"text_config.{key}" for key in v) for k, v in _LLAMA_KEYS.items()}
_FALCON_KEYS: _Keys = {
    **_LLAMA_KEYS, "layers": ("num_hidden_layers", "n_layer"), "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_kv_heads", "n_head_kv", "num_attention_heads", "n_head"),
    "ffn_hidden": ("ffn_hidden_size", "hidden_size"),
}
_BLOOM_KEYS: _Keys = {
    "layers": ("n_layer", "num_hidden_layers"), "hidden": ("hidden_size", "n_embed"),
    "ffn_hidden": ("hidden_size", "n_embed"), "heads": ("n_head",), "kv_heads": ("n_head",),
    "vocab": ("vocab_size",), "seq_len": ("seq_length",),
}
_MPT_KEYS: _Keys = {
    "layers": ("n_layers",), "hidden": ("d_model",), "ffn_hidden": ("expansion_ratio",), "heads": ("n_heads",),
    "kv_heads": ("attn_config.kv_n_heads", "n_heads"), "vocab": ("vocab_size",), "seq_len": ("max_seq_len",),
    "max_position": ("max_seq_len",),
}


@dataclass(frozen=True)
class _Family:
    """How one model_type is translated: its causal-LM classes, its translator and its key names."""

    architectures: frozenset[str]
    translate: Callable[[_Reader], dict[str, Any]]
    keys: _Keys


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(frozenset({"LlamaForCausalLM"}), _llama, _LLAMA_KEYS),
    "mistral": _Family(frozenset({"MistralForCausalLM"}), _llama, _LLAMA_KEYS),
    "mixtral": _Family(frozenset({"MixtralForCausalLM"}), _mixtral, _MIXTRAL_KEYS),
    "qwen2": _Family(frozenset({"Qwen2ForCausalLM"}), _qwen2, _LLAMA_KEYS),
    "qwen2_moe": _Family(frozenset({"Qwen2MoeForCausalLM"}), _qwen2_moe, _QWEN2_MOE_KEYS),
    "deepseek_v2": _Family(frozenset({"DeepseekV2ForCausalLM"}), _deepseek, _DEEPSEEK_KEYS),
    "deepseek_v3": _Family(frozenset({"DeepseekV3ForCausalLM"}), _deepseek, _DEEPSEEK_KEYS),
    "gpt2": _Family(frozenset({"GPT2LMHeadModel"}), _gpt2, _GPT2_KEYS),
    "gpt_neox": _Family(frozenset({"GPTNeoXForCausalLM"}), _gpt_neox, _LLAMA_KEYS),
    "gpt_bigcode": _Family(frozenset({"GPTBigCodeForCausalLM"}), _gpt_bigcode, _GPT2_KEYS),
    "qwen3": _Family(frozenset({"Qwen3ForCausalLM"}), more.qwen3, _LLAMA_KEYS),
    "qwen3_moe": _Family(frozenset({"Qwen3MoeForCausalLM"}), more.qwen3_moe, _QWEN3_MOE_KEYS),
    "gemma2": _Family(frozenset({"Gemma2ForCausalLM"}), more.gemma2, _LLAMA_KEYS),
    "gemma3_text": _Family(frozenset({"Gemma3ForCausalLM"}), more.gemma3, _LLAMA_KEYS),
    "gemma3": _Family(frozenset({"Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"}), more.gemma3,
                      _GEMMA3_KEYS),
    "phi3": _Family(frozenset({"Phi3ForCausalLM"}), more.phi3, _LLAMA_KEYS),
    "olmo2": _Family(frozenset({"Olmo2ForCausalLM"}), more.olmo2, _LLAMA_KEYS),
    "falcon": _Family(frozenset({"FalconForCausalLM", "RWForCausalLM"}), more.falcon, _FALCON_KEYS),
    "RefinedWebModel": _Family(frozenset({"RWForCausalLM", "FalconForCausalLM"}), more.falcon, _FALCON_KEYS),
    "RefinedWeb": _Family(frozenset({"RWForCausalLM", "FalconForCausalLM"}), more.falcon, _FALCON_KEYS),
    "bloom": _Family(frozenset({"BloomForCausalLM"}), more.bloom, _BLOOM_KEYS),
    "mpt": _Family(frozenset({"MPTForCausalLM", "MptForCausalLM"}), more.mpt, _MPT_KEYS),
    "starcoder2": _Family(frozenset({"Starcoder2ForCausalLM"}), more.starcoder2, _LLAMA_KEYS),
}


# ---------------------------------------------------------------- entry point


def _family(config: Mapping[str, Any], source: str) -> tuple[str, _Family]:
    """The model_type and its family; unknown types list the supported ones."""
    model_type = config.get("model_type")
    supported = ", ".join(sorted(_FAMILIES))
    if model_type is None:
        raise SpecError("required key is missing: a Hugging Face config.json names its model family here "
                        f"(the config.json the Hub serves has it, e.g. \"model_type\": \"llama\"); supported: "
                        f"{supported}", source=source, field="model_type")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise SpecError(f"{model_type!r} is not supported; supported: {supported}", source=source, field="model_type")
    return model_type, _FAMILIES[model_type]


def _check_architectures(r: _Reader, family: _Family) -> None:
    """Absent architectures are fine; present ones must be this family's causal-LM class."""
    architectures = r.config.get("architectures")
    if architectures is None:
        return
    valid = ", ".join(sorted(family.architectures))
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise r.error("architectures", f"must be a list of class names, got {architectures!r}")
    unsupported = [a for a in architectures if a not in family.architectures]
    if unsupported:  # repr: a name with a line break must not split the one-line error
        raise r.error("architectures", f"{', '.join(map(repr, unsupported))} is not supported for "
                                       f"model_type {r.model_type!r}; supported: {valid}")


def _name(config: Mapping[str, Any], model_type: str, source: str, given: str | None) -> str:
    """What the model is called: the Hub id it was fetched as, else ``_name_or_path``, else
    the file's name (its directory's for a file called config.json), else the model_type."""
    name = given or config.get("_name_or_path")
    if isinstance(name, str) and name:
        return name
    path = PurePath(source)
    stem = path.parent.name if path.stem == "config" else path.stem
    return stem or model_type


def shorthand_from_hf(config: Mapping[str, Any], *, source: str, name: str | None = None) -> dict[str, Any]:
    """Translate a Hugging Face config.json (already parsed) into autoplace's model shorthand dict.

    seq_len is max_position_embeddings (n_positions for GPT-2) capped at SEQ_LEN_CAP
    (8192): the training sequence length is the user's choice, and a model's
    (often RoPE-extended) context limit is only an upper bound for it. The caller
    adds the "training" block; none is emitted here.

    Args:
        config: the parsed config.json of a supported causal-LM checkpoint.
        source: where the config came from (file or Hub id), used in errors and
            in the returned "source" field.
        name: the model's name when the caller knows it (the Hub id it was read as).

    Returns:
        The shorthand dict: name, layers, hidden, ffn_hidden, heads, kv_heads,
        [head_dim], vocab, seq_len, ffn, norm, bias, qkv_bias, tied_embeddings,
        position, [max_position], dropout, flash_attention, [moe], [attention], source;
        and where a family has them: qk_norm, block_norms, embedding_norm, sliding_window,
        full_attention_every, final_logit_softcap, mtp_layers.

    Raises:
        SpecError: unsupported model_type or architectures, or a required key that
            is missing or ill-typed; ``field`` names the Hugging Face key.
    """
    if not isinstance(config, Mapping):
        raise SpecError(f"a config.json must hold a JSON object, got {type(config).__name__}",
                        source=source)
    model_type, family = _family(config, source)
    reader = _Reader(config, source, model_type)
    _check_architectures(reader, family)
    body = family.translate(reader)
    # moe/attention go last, after the flat fields, to keep the shorthand readable.
    extras: dict[str, Any] = {key: body.pop(key) for key in ("moe", "attention") if key in body}
    return {
        "name": _name(config, model_type, source, name),
        **body,
        "flash_attention": True,
        **extras,
        "source": f"{source} (Hugging Face config, model_type={model_type})",
    }


def hf_key(config: Mapping[str, Any], field: str) -> str | None:
    """The Hugging Face key a shorthand field (dotted, e.g. ``moe.top_k``) was read from.

    Args:
        config: the parsed config.json that :func:`shorthand_from_hf` translated.
        field: a field of the shorthand it returned.

    Returns:
        The key, or None when the field does not come from one key (``name``, ``ffn``, ...).
    """
    scaling = config.get("rope_scaling")
    if field.startswith("rope_scaling.") and isinstance(scaling, Mapping):  # a key of the config's rope_scaling
        key = _ROPE_KEYS.get(field.split(".", 1)[1])
        return f"rope_scaling.{key}" if key in scaling else None
    family = _FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
    keys = family.keys.get(field, ()) if family else ()
    return next((k for k in keys if config.get(k) is not None), keys[-1] if keys else None)
