"""The transformers model a model file describes, for dry runs of bundles that train the user's Hugging
Face model (the FSDP2 bundle's train_fsdp2.py; DeepSpeed's and accelerate's scripts train the same kind).

A Hugging Face config.json is handed to transformers nearly as it is: :func:`hf_config_args` undoes
the few spellings transformers 5 no longer reads (Falcon's ``RefinedWeb*`` model types; Gemma 3's
multimodal config, whose language model is the causal LM) and drops what needs remote code or a GPU
(``auto_map``, ``quantization_config``).  A model.json shorthand describes a transformers model only
when it is Llama-style (:func:`llama_config_args`): every other shorthand, and a layer graph, is
refused with one line naming the field ``LlamaConfig`` cannot state.

transformers is imported inside the functions that build a config (``autoplace solve`` imports no torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoplace.errors import SpecError
from autoplace.specs._io import read_document
from autoplace.specs.model import ModelSpec, TransformerSpec

PLAN = "plan.json"


def plan_model_file(bundle: Path) -> Path:
    """The model file plan.json's ``inputs`` name (``solve --out`` records it; the bundle reader checked it)."""
    return Path(json.loads((bundle / PLAN).read_text(encoding="utf-8"))["inputs"]["model"])


def hf_config_args(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, keyword arguments) for ``transformers.AutoConfig.for_model`` from a config.json's keys.

    Gemma 3's multimodal config gives its text config (``gemma3_text``: the causal LM autoplace plans);
    Falcon's pre-port ``RefinedWebModel`` / ``RefinedWeb`` types are transformers' ``falcon`` (the new
    decoder architecture for ``RefinedWeb``; ``n_layer`` and ``n_head`` under the port's names, which
    transformers 5's FalconConfig alone reads).
    """
    args = dict(config)
    kind = args.pop("model_type")
    if kind == "gemma3":
        args, kind = dict(args["text_config"]), "gemma3_text"
        args.pop("model_type", None)
    if kind in ("RefinedWebModel", "RefinedWeb"):
        kind = "falcon"
        args["new_decoder_architecture"] = config["model_type"] == "RefinedWeb"
        for old, key in (("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads")):  # the port's names
            if old in args:
                args[key] = args.pop(old)
    for key in ("auto_map", "quantization_config", "architectures"):
        args.pop(key, None)
    return kind, args


# shorthand field -> the value a Llama model has (anything else is a model LlamaConfig cannot state)
_LLAMA: dict[str, Any] = {
    "attention": None, "moe": None, "ffn": "swiglu", "norm": "rmsnorm", "position": "rope", "qk_norm": None,
    "block_norms": 2, "norm_position": "pre", "embedding_norm": False, "sliding_window": None,
    "final_logit_softcap": None, "attn_softcap": None, "mtp_layers": 0, "rotary_fraction": 1.0,
    "parallel_block": False, "scaled_embeddings": False,
}


def llama_config_args(spec: ModelSpec, source: str) -> dict[str, Any]:
    """``LlamaConfig`` keyword arguments for a Llama-style shorthand.

    Raises:
        SpecError: a layer graph, or a field whose value Llama does not have (one line naming it).
    """
    if not isinstance(spec, TransformerSpec):
        raise SpecError("a layer graph names no transformers model; give the model's config.json", source=source)
    for key, llama in _LLAMA.items():
        if getattr(spec, key) != llama:
            raise SpecError(f"{key}={getattr(spec, key)!r}: the shorthand is built as transformers' LlamaForCausalLM, "
                            f"which has {key}={llama!r}; give the model's config.json", source=source)
    if spec.activation not in (None, "silu"):
        raise SpecError(f"activation={spec.activation!r}: LlamaForCausalLM's MLP is SiLU-gated; give the model's "
                        "config.json", source=source)
    if spec.qkv_bias and not spec.bias:
        raise SpecError("qkv_bias=True: LlamaConfig biases all four attention projections or none; give the model's "
                        "config.json", source=source)
    scaling = spec.rope_scaling
    if scaling is not None and scaling.type != "llama3":
        raise SpecError(f"rope_scaling.type={scaling.type!r}: the Llama port here states llama3 scaling only; give "
                        "the model's config.json", source=source)
    args: dict[str, Any] = {
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim or spec.hidden // spec.heads, "max_position_embeddings": spec.max_position or
        spec.seq_len, "tie_word_embeddings": spec.tied_embeddings, "attention_bias": spec.bias, "mlp_bias": spec.bias}
    if spec.rope_theta is not None:
        args["rope_theta"] = spec.rope_theta
    if scaling is not None:
        args["rope_scaling"] = {"rope_type": "llama3", "factor": scaling.factor,
                                "low_freq_factor": scaling.low_freq_factor,
                                "high_freq_factor": scaling.high_freq_factor,
                                "original_max_position_embeddings": scaling.original_max_position}
    return args


def model_file_config(path: Path, spec: ModelSpec) -> tuple[Any, str]:
    """transformers' config for the model file at ``path`` (``spec`` is what autoplace read from it), and
    which kind it is, for messages ("config.json (llama)", "model.json shorthand as LlamaConfig").

    Raises:
        SpecError: a shorthand or graph no transformers model states (:func:`llama_config_args`).
    """
    import transformers

    data = read_document(path)
    if "model_type" in data:
        kind, args = hf_config_args(data)
        return transformers.AutoConfig.for_model(kind, **args), f"{path.name} ({kind})"
    return transformers.LlamaConfig(**llama_config_args(spec, str(path))), f"{path.name} as LlamaConfig"
