"""Typed reading of a Hugging Face ``config.json``: the reader and the pieces families share.

Every translator in :mod:`autoplace.specs.hf` and :mod:`autoplace.specs._hf_more` reads the
config through a :class:`_Reader`, so a missing or ill-typed key raises ``SpecError`` naming
the Hugging Face key and what would be valid.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def _decoder_shape(r: _Reader, *, mla: bool = False) -> dict[str, Any]:
    """The sizes most decoder configs name alike: layers, hidden, ffn_hidden, the heads
    (:func:`_heads`), vocab and seq_len."""
    hidden = r.integer("hidden_size")
    return {
        "layers": r.integer("num_hidden_layers"),
        "hidden": hidden,
        "ffn_hidden": r.integer("intermediate_size"),
        **_heads(r, hidden, "num_attention_heads", mla=mla),
        "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(r.integer("max_position_embeddings")),
    }


# Hugging Face activation names (transformers ``ACT2FN``) -> the shorthand's activation.
# gelu_new / gelu_pytorch_tanh / gelu_fast all compute GeLU's tanh approximation.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu2": "relu2"}
_DEFAULT_ACTIVATION = {"swiglu": "silu", "gelu": "gelu"}


def _activation(r: _Reader, ffn: str, keys: tuple[str, ...] = ("hidden_act",),
                default: str | None = None) -> dict[str, str]:
    """``{"activation": ...}`` when the config's MLP activation is not the ffn's own, else {}.

    Reads the first of ``keys`` that is set (``default`` when none is: the family's hard-coded
    activation); a name outside ``_ACTIVATIONS`` is refused, naming the key.
    """
    key = next((k for k in keys if r.config.get(k) is not None), None)
    name = r.config[key] if key else default
    if name is None:
        return {}
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise r.error(key or keys[0], f"activation {name!r} is not supported; valid: {', '.join(_ACTIVATIONS)}")
    act = _ACTIVATIONS[name]
    return {} if act == _DEFAULT_ACTIVATION[ffn] else {"activation": act}


# rope_scaling types (transformers ROPE_INIT_FUNCTIONS) -> the shorthand's; "su" is longrope's old name
_ROPE_TYPES = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3",
               "longrope": "longrope", "su": "longrope"}
# shorthand RopeScaling field -> rope_scaling key
_ROPE_KEYS = {"factor": "factor", "original_max_position": "original_max_position_embeddings",
              "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
              "mscale_all_dim": "mscale_all_dim"}


def _rope_scaling(r: _Reader) -> dict[str, Any]:
    """``{"rope_scaling": {...}}`` from the config's rope_scaling, {} when it has none (or "default").

    longrope's per-frequency factor lists are not kept (no framework but the HF model code runs
    them); its original context comes from the top-level original_max_position_embeddings.
    """
    scaling = r.config.get("rope_scaling")
    if scaling is None:
        return {}
    if not isinstance(scaling, dict):
        raise r.error("rope_scaling", f"must be a mapping or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return {}
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:  # (a list is unhashable: not a name)
        raise r.error("rope_scaling", f"rope type {kind!r} is not supported; valid: default, {', '.join(_ROPE_TYPES)}")
    out: dict[str, Any] = {"type": _ROPE_TYPES[kind]}
    for field, key in _ROPE_KEYS.items():
        value = scaling.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise r.error("rope_scaling", f"{key} must be a non-negative number, got {value!r}")
        out[field] = int(value) if field == "original_max_position" else float(value)
    if out["type"] == "longrope" and "original_max_position" not in out:
        out["original_max_position"] = r.integer("original_max_position_embeddings")
    if out["type"] in ("linear", "dynamic", "yarn", "llama3") and "factor" not in out:
        raise r.error("rope_scaling", f"a {kind} rope_scaling needs its factor")
    return {"rope_scaling": out}


def _rotary_fraction(r: _Reader, key: str = "partial_rotary_factor") -> dict[str, float]:
    """``{"rotary_fraction": f}`` when only part of each head is rotated (0 < f < 1), else {}."""
    value = r.config.get(key)
    if value is None or value == 1:
        return {}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise r.error(key, f"must be a fraction in (0, 1], got {value!r}")
    return {"rotary_fraction": float(value)}


def _rope_decoder(r: _Reader, *, mla: bool = False) -> dict[str, Any]:
    """Fields shared by the Llama-style decoders (pre-RMSNorm, SwiGLU MLP, RoPE).

    Used for llama, mistral, mixtral, qwen2, qwen2_moe and deepseek; families
    override bias/qkv_bias and add moe/attention afterwards.
    """
    return {
        **_decoder_shape(r, mla=mla),
        "ffn": "swiglu",
        "norm": "rmsnorm",
        **_norm_eps(r),
        "bias": False,
        "qkv_bias": False,
        "tied_embeddings": r.flag("tie_word_embeddings", False),
        "position": "rope",
        **_rope_theta(r, "rope_theta"),
        **_rope_scaling(r),
        **_rotary_fraction(r),
        **_activation(r, "swiglu"),
        "dropout": _dropout(r),
    }


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


def _alias(r: _Reader, keys: tuple[str, ...], default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
    """The integer under the first of ``keys`` that is set (old and new spellings of one key).

    Falcon's old RefinedWeb configs say ``n_layer``/``n_head``, the transformers port
    ``num_hidden_layers``/``num_attention_heads``; both are read, the first present wins.
    """
    for key in keys:
        if r.config.get(key) is not None:
            return r.integer(key, minimum=minimum)
    if default is _REQUIRED:
        raise r.error(keys[0], f"required key is missing (a {r.model_type} config must set "
                               f"{' or '.join(keys)})")
    return default


def _full_every(r: _Reader, layers: int, pattern: int | None) -> int | None:
    """Which layers attend globally: every ``k``-th (1-based), or None when every layer is windowed.

    Read from ``layer_types`` (transformers >= 4.53 writes it) or from a sliding-window
    pattern (Gemma 2: every 2nd, Gemma 3: ``sliding_window_pattern``, default 6).
    """
    types = r.config.get("layer_types")
    if types is None:
        return pattern
    valid = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in valid for t in types):
        raise r.error("layer_types", f"must list {layers} entries, each one of {', '.join(valid)}")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        return None
    every = full[0] + 1
    if full != list(range(every - 1, layers, every)):
        raise r.error("layer_types", f"global layers {full} are not every k-th layer; "
                                     "only a periodic pattern can be expressed")
    return every


def _window(r: _Reader, layers: int, positions: int, *, pattern: int | None = None) -> dict[str, int]:
    """sliding_window / full_attention_every when a window binds; {} otherwise.

    A window at least as long as the model's context never binds (Phi-3-128k sets 262144)
    and is left out, as is Qwen's window when ``use_sliding_window`` is false.  Qwen's
    per-layer ``max_window_layers`` split cannot be expressed and is refused.
    """
    if r.config.get("use_sliding_window") is True:
        raise r.error("use_sliding_window", "Qwen's max_window_layers split cannot be expressed; expected false")
    if r.config.get("use_sliding_window") is False:
        return {}
    window = r.integer("sliding_window", default=None)
    if window is None or window >= positions:
        return {}
    every = _full_every(r, layers, pattern)
    if every == 1:
        return {}
    return {"sliding_window": window, **({"full_attention_every": every} if every else {})}


# The key each family names its norms' epsilon with, and the default of its transformers config class
# (transformers 5: LlamaConfig.rms_norm_eps, GPT2Config.layer_norm_epsilon, ...) when a config leaves it out
_NORM_EPS: dict[str, tuple[str, float]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                     "gemma2", "gemma3_text"), ("rms_norm_eps", 1e-6)),
    "mixtral": ("rms_norm_eps", 1e-5), "phi3": ("rms_norm_eps", 1e-5), "olmo2": ("rms_norm_eps", 1e-5),
    "gpt_neox": ("layer_norm_eps", 1e-5), "starcoder2": ("norm_epsilon", 1e-5),
    **dict.fromkeys(("gpt2", "gpt_bigcode", "falcon", "RefinedWebModel", "RefinedWeb", "bloom", "mpt"),
                    ("layer_norm_epsilon", 1e-5)),
}


def _norm_eps(r: _Reader) -> dict[str, float]:
    """``{"norm_eps": e}``: the epsilon every norm of the model adds (its family's key, else the
    family's transformers default, which is what transformers builds without the key)."""
    key, default = _NORM_EPS[r.model_type]
    value = r.config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise r.error(key, f"must be a number between 0 and 1, got {value!r}")
    return {"norm_eps": float(value)}


def _rope_theta(r: _Reader, key: str) -> dict[str, float]:
    """The RoPE base when the config states it (a positive number), else nothing."""
    value = r.config.get(key)
    if value is None:
        return {}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise r.error(key, f"must be a positive number, got {value!r}")
    return {"rope_theta": float(value)}


def _qwen_moe(r: _Reader) -> dict[str, Any]:
    """The moe block of Qwen's MoE configs (qwen2_moe, qwen3_moe): routed experts, an optional
    gated shared expert, every decoder_sparse_step-th layer sparse; per-layer dense overrides refused."""
    if r.config.get("mlp_only_layers"):
        raise r.error("mlp_only_layers", "per-layer dense overrides cannot be expressed; expected [] or absent")
    shared_ffn = r.integer("shared_expert_intermediate_size", default=0, minimum=0)
    out = _moe(r, experts=r.integer("num_experts"), expert_ffn=r.integer("moe_intermediate_size"),
               shared=1 if shared_ffn else 0, shared_ffn=shared_ffn, first_dense=0,
               layer_freq=r.integer("decoder_sparse_step", default=1))
    # Qwen2MoeConfig / Qwen3MoeConfig default norm_topk_prob to false; the shared expert is
    # always gated (Qwen2MoeSparseMoeBlock.shared_expert_gate)
    return {**out, "normalize_top_k": r.flag("norm_topk_prob", False), "shared_expert_gate": bool(shared_ffn)}
