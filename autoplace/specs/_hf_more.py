"""Hugging Face families beyond Llama/GPT: Qwen3, Gemma 2/3, Phi-3, OLMo 2, Falcon, BLOOM, MPT,
StarCoder2 (GPTBigCode is next to GPT-2 in hf.py).

Each translator maps the config onto the shorthand with the same reader as
:mod:`autoplace.specs.hf`; where a family's block differs from the Llama/GPT block the
difference goes into one of the shorthand's optional fields (``qk_norm``, ``block_norms``,
``embedding_norm``, ``sliding_window``, ``final_logit_softcap``, ``position: alibi``).
Features that change the math but no shape go into their own fields too (``activation``,
``rotary_fraction``, ``rope_scaling``, ``attn_softcap``, ``norm_position``, ``parallel_block``,
``scaled_embeddings``); query scaling and ``clip_qkv`` are tolerated and not read.
"""

from __future__ import annotations

from typing import Any

from autoplace.specs._hf_read import (
    _activation,
    _alias,
    _decoder_shape,
    _dropout,
    _heads,
    _llama_biases,
    _norm_eps,
    _qwen_moe,
    _Reader,
    _rope_decoder,
    _rope_scaling,
    _seq_len,
    _window,
)

# BLOOM has no position limit (ALiBi); it was trained on 2048-token sequences
# (Le Scao et al. 2022, "BLOOM", Sec. 3.3), which is the default training length here.
BLOOM_SEQ_LEN = 2048
# Falcon's and MPT's configs default their context to 2048 (FalconConfig, MPTConfig).
FALCON_MAX_POSITIONS = 2048


def _softcap(r: _Reader, key: str = "final_logit_softcapping", field: str = "final_logit_softcap") -> dict[str, float]:
    """A soft-cap (cap * tanh(x / cap)) when set: final_logit_softcapping (the head keeps a tanh
    output for backward), or attn_logit_softcapping -> attn_softcap (Gemma 2's attention scores)."""
    cap = r.config.get(key)
    if cap is None:
        return {}
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
        raise r.error(key, f"must be a positive number or null, got {cap!r}")
    return {field: float(cap)}


def _rope_window(r: _Reader, out: dict[str, Any], *, pattern: int | None = None) -> dict[str, Any]:
    """``out`` with the sliding window of a RoPE decoder (context = max_position_embeddings)."""
    positions = r.integer("max_position_embeddings")
    return {**out, **_window(r, out["layers"], positions, pattern=pattern)}


def qwen3(r: _Reader) -> dict[str, Any]:
    """qwen3: Llama block with per-head RMSNorm on q and k, no q/k/v biases, explicit head_dim."""
    return _rope_window(r, {**_rope_decoder(r), **_llama_biases(r), "qk_norm": "head"})


def qwen3_moe(r: _Reader) -> dict[str, Any]:
    """qwen3_moe (Qwen3-30B-A3B, -235B-A22B): qwen3 attention, routed experts, no shared expert."""
    return {**qwen3(r), "moe": _qwen_moe(r)}


def _gemma(r: _Reader, *, pattern: int) -> dict[str, Any]:
    """Gemma 2/3 decoder: gated tanh-GeLU MLP (hidden_activation; the shorthand's gated 'swiglu'
    shapes), RMSNorm before and after attention and MLP (4 per block, "sandwich"), embeddings
    scaled by sqrt(hidden), tied head."""
    out = {**_rope_decoder(r), **_llama_biases(r), "block_norms": 4, "norm_position": "sandwich",
           "scaled_embeddings": True, "tied_embeddings": r.flag("tie_word_embeddings", True)}
    out.pop("activation", None)
    out.update(_activation(r, "swiglu", ("hidden_activation", "hidden_act"), default="gelu_pytorch_tanh"))
    return {**_rope_window(r, out, pattern=pattern), **_softcap(r),
            **_softcap(r, "attn_logit_softcapping", "attn_softcap")}


def gemma2(r: _Reader) -> dict[str, Any]:
    """gemma2: local (sliding) and global attention alternate, global on every 2nd layer.

    attn_logit_softcapping changes no stored tensor under a soft-capping flash kernel
    (flash-attn >= 2.6) but changes the math (attn_softcap); final_logit_softcapping keeps a
    vocab-wide tanh output.
    """
    return _gemma(r, pattern=2)


def gemma3(r: _Reader) -> dict[str, Any]:
    """gemma3_text, or gemma3's text_config (the vision tower is not part of the plan).

    Adds per-head q/k RMSNorm; every sliding_window_pattern-th layer (default 6) is global.
    """
    text = r.config.get("text_config")
    if r.model_type == "gemma3":
        if not isinstance(text, dict):
            raise r.error("text_config", "a gemma3 config must hold its language model in text_config")
        r = _Reader(text, r.source, "gemma3_text")
    pattern = r.integer("sliding_window_pattern", default=6)
    return {**_gemma(r, pattern=pattern), "qk_norm": "head"}


def phi3(r: _Reader) -> dict[str, Any]:
    """phi3 (Phi-3, Phi-3.5, Phi-4): Llama shapes with fused qkv/gate_up (same parameters)."""
    return _rope_window(r, {**_rope_decoder(r), **_llama_biases(r)})


def olmo2(r: _Reader) -> dict[str, Any]:
    """olmo2: Llama shapes, norms after attention and MLP (still 2 per block), and RMSNorm
    over all of q (heads x head_dim) and all of k (kv_heads x head_dim)."""
    return {**_rope_decoder(r), **_llama_biases(r), "qk_norm": "layer", "norm_position": "post"}


def falcon(r: _Reader) -> dict[str, Any]:
    """falcon, and the old RefinedWebModel (7B) / RefinedWeb (40B) configs.

    Kv heads: n_head_kv/num_kv_heads with the new decoder architecture (RefinedWeb always),
    else 1 with multi_query (FalconConfig's default), else the head count.  Norms: the new
    architecture has ln_attn and ln_mlp (num_ln_in_parallel_attn, 2); the old parallel block
    shares one input_layernorm; a sequential block has two.
    """
    new_arch = {"RefinedWeb": True, "RefinedWebModel": False}.get(r.model_type)
    if new_arch is None:
        new_arch = r.flag("new_decoder_architecture", False)
    hidden = r.integer("hidden_size")
    heads = _alias(r, ("num_attention_heads", "n_head"))
    if new_arch:
        kv_heads = _alias(r, ("num_kv_heads", "n_head_kv"), default=heads)
        norms = r.integer("num_ln_in_parallel_attn", default=2)
    else:
        kv_heads = 1 if r.flag("multi_query", True) else heads
        norms = 1 if r.flag("parallel_attn", True) else 2
    if heads % kv_heads or hidden % heads:
        raise r.error("hidden_size", f"hidden_size={hidden}, heads={heads}, kv heads={kv_heads} must divide evenly")
    alibi = r.flag("alibi", False)
    return {
        "layers": _alias(r, ("num_hidden_layers", "n_layer")),
        "hidden": hidden,
        "ffn_hidden": r.integer("ffn_hidden_size", default=4 * hidden),
        "heads": heads, "kv_heads": kv_heads,
        "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(r.integer("max_position_embeddings", default=FALCON_MAX_POSITIONS)),
        "ffn": "gelu", "norm": "layernorm", **_norm_eps(r),
        "bias": r.flag("bias", False), "qkv_bias": r.flag("bias", False),
        "tied_embeddings": r.flag("tie_word_embeddings", True),
        "position": "alibi" if alibi else "rope",
        **({} if alibi else _rope_scaling(r)),
        "dropout": _dropout(r),
        "block_norms": norms,
        # FalconDecoderLayer: parallel attention + MLP with the new architecture or parallel_attn
        "parallel_block": new_arch or r.flag("parallel_attn", True),
        **_activation(r, "gelu", ("activation",), default="gelu"),
    }


def bloom(r: _Reader) -> dict[str, Any]:
    """bloom: GPT block (LayerNorm, 4h GeLU MLP, biases, tied head) with ALiBi and an
    embedding LayerNorm.  No position limit: seq_len is seq_length if set, else 2048."""
    hidden = _alias(r, ("hidden_size", "n_embed"))
    return {
        "layers": _alias(r, ("n_layer", "num_hidden_layers")),
        "hidden": hidden,
        "ffn_hidden": 4 * hidden,
        **_heads(r, hidden, "n_head"),
        "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(r.integer("seq_length", default=BLOOM_SEQ_LEN)),
        "ffn": "gelu", "norm": "layernorm", **_norm_eps(r), "bias": True, "qkv_bias": True,
        "tied_embeddings": r.flag("tie_word_embeddings", True),
        "position": "alibi", "dropout": _dropout(r), "embedding_norm": True,
        "activation": "gelu_tanh",  # BloomGelu: GeLU's tanh approximation, hard-coded
    }


def mpt(r: _Reader) -> dict[str, Any]:
    """mpt (MosaicML): d_model/n_layers/n_heads, expansion_ratio x d_model MLP, attn_config.

    ALiBi when attn_config.alibi, else learned positions (learned_pos_emb).  ``no_bias``
    removes every bias, including the LayerNorms' (the shorthand still counts LayerNorm as
    weight + bias: hidden parameters per norm too many, 0.004% of MPT-7B).
    """
    attn = r.config.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise r.error("attn_config", f"must be a mapping, got {attn!r}")
    a = _Reader(attn, r.source, r.model_type)
    hidden = r.integer("d_model")
    heads = r.integer("n_heads")
    kv_heads = a.integer("kv_n_heads", default=heads)
    if hidden % heads or heads % kv_heads:
        raise r.error("n_heads", f"must divide d_model={hidden} and be a multiple of kv_n_heads={kv_heads}")
    ratio = r.config.get("expansion_ratio", 4)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0 or (ratio * hidden) % 1:
        raise r.error("expansion_ratio", f"must be a positive number giving a whole MLP width, got {ratio!r}")
    ffn = r.config.get("ffn_config") or {}
    gated = isinstance(ffn, dict) and ffn.get("ffn_type") == "mptglu"
    positions = r.integer("max_seq_len", default=FALCON_MAX_POSITIONS)
    alibi = a.flag("alibi", False)
    learned = not alibi and r.flag("learned_pos_emb", True)
    bias = not r.flag("no_bias", False)
    return {
        "layers": r.integer("n_layers"), "hidden": hidden, "ffn_hidden": int(ratio * hidden),
        "heads": heads, "kv_heads": kv_heads, "vocab": r.integer("vocab_size"),
        "seq_len": _seq_len(positions),
        "ffn": "swiglu" if gated else "gelu", "norm": "layernorm", **_norm_eps(r), "bias": bias, "qkv_bias": bias,
        "tied_embeddings": r.flag("tie_word_embeddings", True),
        "position": "alibi" if alibi else ("learned" if learned else "rope"),
        **({"max_position": positions} if learned else {}),
        "dropout": any(x > 0 for x in (a.probability("attn_pdrop"), r.probability("resid_pdrop"),
                                        r.probability("emb_pdrop"))),
    }


def starcoder2(r: _Reader) -> dict[str, Any]:
    """starcoder2: GQA + RoPE + sliding window, LayerNorm, plain GeLU MLP (c_fc, c_proj),
    biases on every linear layer (use_bias), tied head by default."""
    bias = r.flag("use_bias", True)
    out = {
        **_decoder_shape(r),
        "ffn": "gelu", "norm": "layernorm", **_norm_eps(r), "bias": bias, "qkv_bias": bias,
        "tied_embeddings": r.flag("tie_word_embeddings", True), "position": "rope",
        **_rope_scaling(r), **_activation(r, "gelu", default="gelu_pytorch_tanh"),
        "dropout": _dropout(r) or any(r.probability(k) > 0 for k in ("residual_dropout", "embedding_dropout")),
    }
    return _rope_window(r, out)
