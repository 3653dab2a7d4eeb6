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
from typing import Any

from autoplace.errors import SpecError

# The shorthand's seq_len is a training choice, not the model's context limit:
# max_position_embeddings is often 32k-160k (RoPE-extended), far beyond what a
# training run uses by default. Cap it; the user overrides seq_len explicitly.
SEQ_LEN_CAP = 8192

# Dropout probabilities that act inside the trained network. Classification-head
# dropouts (summary_first_dropout, classifier_dropout) are left out on purpose:
# the causal-LM head does not use them.
_DROPOUT_KEYS = (
    "attention_dropout",
    "attn_pdrop",
    "attention_probs_dropout_prob",
    "hidden_dropout",
    "hidden_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
)

_REQUIRED = object()  # sentinel: the key has no default and must be present


class _Reader:
    """Typed access to one config; every failure names the HF key and the source file."""

    def __init__(self, config: Mapping[str, Any], source: str, model_type: str) -> None:
        self.config = config
        self.source = source
        self.model_type = model_type

    def error(self, key: str, message: str) -> SpecError:
        """A SpecError about ``key`` in this config."""
        return SpecError(message, source=self.source, field=key)

    def integer(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
        """An integer >= ``minimum``; ``default`` when the key is absent or null.

        Args:
            key: Hugging Face config key.
            default: value when absent or null; omit to make the key required.
            minimum: smallest valid value (1 for sizes, 0 for counts that may be zero).

        Returns:
            The integer, or ``default``.
        """
        value = self.config.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(key,
                                 f"required key is missing (a {self.model_type} config must set it)")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key,
                             f"must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """A JSON boolean; ``default`` when the key is absent or null."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r} ({type(value).__name__})")
        return value

    def probability(self, key: str) -> float:
        """A number in [0, 1]; 0.0 when the key is absent or null."""
        value = self.config.get(key)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise self.error(key, f"must be a probability in [0, 1], got {value!r}")
        return float(value)


# ---------------------------------------------------------------- shared pieces


def _seq_len(max_positions: int) -> int:
    """Default training sequence length: the model's limit, capped at SEQ_LEN_CAP."""
    return min(max_positions, SEQ_LEN_CAP)


def _dropout(r: _Reader) -> bool:
    """True iff any attention/hidden/residual dropout probability is > 0."""
    return any(r.probability(key) > 0.0 for key in _DROPOUT_KEYS)


def _heads(r: _Reader, hidden: int, heads_key: str, *, hidden_key: str = "hidden_size",
           mla: bool = False) -> dict[str, Any]:
    """heads, kv_heads and (only when it differs from hidden/heads) head_dim.

    kv_heads defaults to heads, as in LlamaConfig (multi-head attention). With MLA
    (DeepSeek) head sizes come from the MLA keys, so head_dim is not read.
    """
    heads = r.integer(heads_key)
    kv_heads = r.integer("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise r.error("num_key_value_heads", f"must divide {heads_key}={heads}, got {kv_heads}")
    out: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads}
    if mla:
        return out
    head_dim = r.integer("head_dim", default=None)
    if head_dim is None and hidden % heads:
        raise r.error(heads_key, f"must divide {hidden_key}={hidden} unless head_dim is set, got {heads}")
    if head_dim is not None and head_dim * heads != hidden:
        out["head_dim"] = head_dim
    return out


def _llama_biases(r: _Reader) -> dict[str, bool]:
    """bias/qkv_bias from LlamaConfig's attention_bias (q,k,v,o) and mlp_bias.

    The shorthand has only "every linear layer" and "q/k/v only"; attention biases
    without MLP biases (which include o_proj) cannot be expressed, so they are refused.
    """
    attention_bias = r.flag("attention_bias", False)
    mlp_bias = r.flag("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise r.error(
            "attention_bias",
            f"attention_bias={attention_bias} with mlp_bias={mlp_bias} cannot be expressed "
            "(shorthand supports biases on every linear layer, or none)",
        )
    return {"bias": attention_bias, "qkv_bias": attention_bias}


def _rope_decoder(r: _Reader, *, mla: bool = False) -> dict[str, Any]:
    """Fields shared by the Llama-style decoders (pre-RMSNorm, SwiGLU MLP, RoPE).

    Used for llama, mistral, mixtral, qwen2, qwen2_moe and deepseek; families
    override bias/qkv_bias and add moe/attention afterwards.
    """
    hidden = r.integer("hidden_size")
    heads = _heads(r, hidden, "num_attention_heads", mla=mla)
    return {
        "layers": r.integer("num_hidden_layers"),
        "hidden": hidden,
        "ffn_hidden": r.integer("intermediate_size"),
        **heads,
        "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(r.integer("max_position_embeddings")),
        "ffn": "swiglu",
        "norm": "rmsnorm",
        "bias": False,
        "qkv_bias": False,
        "tied_embeddings": r.flag("tie_word_embeddings", False),
        "position": "rope",
        **_rope_theta(r, "rope_theta"),
        "dropout": _dropout(r),
    }


def _rope_theta(r: _Reader, key: str) -> dict[str, float]:
    """The RoPE base when the config states it (a positive number), else nothing."""
    value = r.config.get(key)
    if value is None:
        return {}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise r.error(key, f"must be a positive number, got {value!r}")
    return {"rope_theta": float(value)}


def _moe(r: _Reader, *, experts: int, expert_ffn: int, shared: int, shared_ffn: int,
         first_dense: int, layer_freq: int) -> dict[str, int]:
    """The shorthand's moe block; top_k is read here and checked against experts."""
    top_k = r.integer("num_experts_per_tok")
    if top_k > experts:
        raise r.error("num_experts_per_tok", f"must be <= the number of experts ({experts}), got {top_k}")
    return {
        "experts": experts,
        "top_k": top_k,
        "expert_ffn_hidden": expert_ffn,
        "shared_experts": shared,
        "shared_ffn_hidden": shared_ffn,
        "first_dense_layers": first_dense,
        "layer_freq": layer_freq,
    }


# ---------------------------------------------------------------- families


def _llama(r: _Reader) -> dict[str, Any]:
    """llama (incl. Llama 3) and mistral: rope_scaling and sliding_window are ignored."""
    return {**_rope_decoder(r), **_llama_biases(r)}


def _mixtral(r: _Reader) -> dict[str, Any]:
    """mixtral: every layer is MoE; each expert is an intermediate_size SwiGLU MLP."""
    out = _llama(r)
    out["moe"] = _moe(
        r, experts=r.integer("num_local_experts"), expert_ffn=out["ffn_hidden"],
        shared=0, shared_ffn=0, first_dense=0, layer_freq=1,
    )
    return out


def _qwen2(r: _Reader) -> dict[str, Any]:
    """qwen2: q/k/v carry biases, o_proj and the MLP do not (hard-coded in Qwen2Attention)."""
    return {**_rope_decoder(r), "qkv_bias": True}


def _qwen2_moe(r: _Reader) -> dict[str, Any]:
    """qwen2_moe (Qwen1.5-MoE, Qwen2-MoE): routed experts plus one gated shared expert.

    layer_freq is decoder_sparse_step. Qwen counts MoE layers as (i + 1) % step == 0,
    which agrees with the every-layer case (step 1) used by the published models.
    """
    out = _qwen2(r)
    if r.config.get("mlp_only_layers"):
        raise r.error("mlp_only_layers",
                      "per-layer dense overrides cannot be expressed; expected [] or absent")
    shared_ffn = r.integer("shared_expert_intermediate_size", default=0, minimum=0)
    out["moe"] = _moe(
        r, experts=r.integer("num_experts"), expert_ffn=r.integer("moe_intermediate_size"),
        shared=1 if shared_ffn else 0, shared_ffn=shared_ffn, first_dense=0,
        layer_freq=r.integer("decoder_sparse_step", default=1),
    )
    return out


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
    DeepSeek-V3's multi-token-prediction layer (num_nextn_predict_layers) is not
    part of the trained trunk described here.
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
        )
    return out


def _gpt2(r: _Reader) -> dict[str, Any]:
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
        "bias": True,
        "qkv_bias": True,
        "tied_embeddings": r.flag("tie_word_embeddings", True),
        "position": "learned",
        "max_position": positions,
        "dropout": _dropout(r),
    }


def _gpt_neox(r: _Reader) -> dict[str, Any]:
    """gpt_neox (Pythia, GPT-NeoX-20B): LayerNorm, GELU 2-matrix MLP, biases, (partial) RoPE.

    use_parallel_residual and rotary_pct change the dataflow, not the parameter shapes,
    and are ignored. The LM head is untied unless tie_word_embeddings is true.
    """
    if not r.flag("attention_bias", True):
        raise r.error("attention_bias",
                      "attention without biases next to a biased MLP cannot be expressed; expected true")
    hidden = r.integer("hidden_size")
    return {
        "layers": r.integer("num_hidden_layers"),
        "hidden": hidden,
        "ffn_hidden": r.integer("intermediate_size"),
        **_heads(r, hidden, "num_attention_heads"),
        "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(r.integer("max_position_embeddings")),
        "ffn": "gelu",
        "norm": "layernorm",
        "bias": True,
        "qkv_bias": True,
        "tied_embeddings": r.flag("tie_word_embeddings", False),
        "position": "rope",
        **_rope_theta(r, "rotary_emb_base"),
        "dropout": _dropout(r),
    }


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
}


# ---------------------------------------------------------------- entry point


def _family(config: Mapping[str, Any], source: str) -> tuple[str, _Family]:
    """The model_type and its family; unknown types list the supported ones."""
    model_type = config.get("model_type")
    supported = ", ".join(sorted(_FAMILIES))
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        shown = "missing" if model_type is None else repr(model_type)
        raise SpecError(f"{shown} is not supported; supported: {supported}",
                        source=source, field="model_type")
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


def _name(config: Mapping[str, Any], model_type: str) -> str:
    """_name_or_path when it is a non-empty string, else the model_type."""
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and name else model_type


def shorthand_from_hf(config: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """Translate a Hugging Face config.json (already parsed) into autoplace's model shorthand dict.

    seq_len is max_position_embeddings (n_positions for GPT-2) capped at SEQ_LEN_CAP
    (8192): the training sequence length is the user's choice, and a model's
    (often RoPE-extended) context limit is only an upper bound for it. The caller
    adds the "training" block; none is emitted here.

    Args:
        config: the parsed config.json of a supported causal-LM checkpoint.
        source: where the config came from (file or Hub id), used in errors and
            in the returned "source" field.

    Returns:
        The shorthand dict: name, layers, hidden, ffn_hidden, heads, kv_heads,
        [head_dim], vocab, seq_len, ffn, norm, bias, qkv_bias, tied_embeddings,
        position, [max_position], dropout, flash_attention, [moe], [attention], source.

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
        "name": _name(config, model_type),
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
    family = _FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
    keys = family.keys.get(field, ()) if family else ()
    return next((k for k in keys if config.get(k) is not None), keys[-1] if keys else None)
