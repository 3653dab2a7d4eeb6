"""The Hugging Face model a bundle trains, as transformers builds it, for the dry runs of the bundles
that run the user's transformers model (DeepSpeed, accelerate, their PEFT script).

The model comes from, in order: the user's ``--model DIR_OR_ID`` after ``--`` (``autoplace dryrun
BUNDLE -- --model DIR``: a directory with config.json or a Hub id in the local cache), else the
model file plan.json's ``inputs`` name -- a Hugging Face config.json as transformers reads it, or a
Llama-style model.json shorthand as the ``LlamaConfig`` it describes (any other shorthand is
refused in one line naming what LlamaConfig cannot state).  :func:`causal_lm` builds it on the
meta device: shapes and dtypes, no weights.

transformers is imported inside the functions: ``autoplace solve`` imports the framework modules.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.errors import SpecError

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext
    from autoplace.specs.model import ModelSpec

MODEL_FLAG = "--model"
# config.json keys transformers' from_config cannot use: remote code, a GPTQ loader (needs a GPU;
# same shapes), the class list (from_config picks the class from model_type)
_NOT_ARCHITECTURE = ("auto_map", "quantization_config", "architectures")
# Falcon's pre-port RefinedWeb config keys -> transformers' FalconConfig arguments (which ignores the old ones)
_FALCON_PORT = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_head_kv": "num_kv_heads"}


@dataclass(frozen=True)
class ModelSource:
    """transformers' config of the model to build, and where it came from (for the dry run's note)."""

    config: Any
    said: str


def model_source(ctx: DryContext) -> ModelSource:
    """The model the bundle trains: ``--model`` after ``--``, else plan.json's model file.

    Raises:
        SpecError: a --model that is neither a directory with config.json nor a cached Hub id, or a
            shorthand LlamaConfig cannot state (one line naming what).
    """
    user = flag_value(ctx.extra, MODEL_FLAG)
    if user is not None:
        path = _user_config(user)
        return ModelSource(hf_config(json.loads(path.read_text())), f"the model: {user} (--model after --)")
    path = _plan_model_path(ctx.bundle)
    doc = json.loads(path.read_text())
    if isinstance(doc, dict) and "model_type" in doc:
        return ModelSource(hf_config(doc), f"the model: {path.name}, the Hugging Face config plan.json was made for")
    return ModelSource(llama_config(ctx.model, source=str(path)),
                       f"the model: transformers' LlamaConfig of the shorthand {path.name} (plan.json's model)")


def flag_value(words: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``words`` (``--flag V`` or ``--flag=V``), or None."""
    found = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def hf_config(doc: dict[str, Any]) -> Any:
    """transformers' config for a config.json (Gemma 3: its text model; Falcon's pre-port
    ``RefinedWebModel`` / ``RefinedWeb`` configs: transformers' falcon, which reads both)."""
    import transformers

    cfg = {k: v for k, v in doc.items() if k not in _NOT_ARCHITECTURE}
    kind = cfg.pop("model_type")
    if kind == "gemma3":
        cfg, kind = dict(cfg["text_config"]), "gemma3_text"
        cfg.pop("model_type", None)
    if kind in ("RefinedWebModel", "RefinedWeb"):
        cfg["new_decoder_architecture"] = kind == "RefinedWeb"
        kind = "falcon"
        for old, new in _FALCON_PORT.items():  # FalconConfig takes the port's names (autoplace.specs._hf_more too)
            if old in cfg:
                cfg[new] = cfg.pop(old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(kind, **cfg)


def causal_lm_class(config: Any) -> Any:
    """transformers' causal-LM class for ``config``, its module imported (a framework that patches every
    ``nn.Module`` subclass while a model is built -- DeepSpeed's zero.Init -- must find it defined before)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def causal_lm(config: Any, dtype: Any = None) -> Any:
    """transformers' causal LM for ``config`` on the meta device (parameters with shapes, no data), in
    ``dtype`` (None: the config's own ``dtype``, as ``from_config`` takes it)."""
    import torch

    cls = causal_lm_class(config)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(config, **({"dtype": dtype} if dtype is not None else {}))


def llama_config(model: ModelSpec, *, source: str) -> Any:
    """transformers' ``LlamaConfig`` of a Llama-style shorthand.

    Raises:
        SpecError: the shorthand has a feature LlamaConfig cannot state (named), or is a layer graph.
    """
    import transformers

    from autoplace.specs.model import TransformerSpec

    if not isinstance(model, TransformerSpec):
        raise SpecError("a layer graph has no transformers model: give the Hugging Face model after --: "
                        f"autoplace dryrun BUNDLE -- {MODEL_FLAG} DIR_OR_ID", source=source)
    missing = unlike_llama(model)
    if missing:
        raise SpecError(f"transformers' LlamaConfig cannot state {', '.join(missing)}: give the Hugging Face model "
                        f"after --: autoplace dryrun BUNDLE -- {MODEL_FLAG} DIR_OR_ID", source=source)
    rope: dict[str, Any] = {}
    if model.rope_scaling is not None:
        s = model.rope_scaling
        rope["rope_scaling"] = {k: v for k, v in {
            "rope_type": s.type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position,
        }.items() if v is not None}
    fields: dict[str, Any] = {  # config.json's names, as a Llama checkpoint writes them
        "hidden_size": model.hidden, "intermediate_size": model.ffn_hidden, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
        "vocab_size": model.vocab, "max_position_embeddings": model.max_position or model.seq_len,
        "tie_word_embeddings": model.tied_embeddings, "rope_theta": model.rope_theta or 10000.0, **rope}
    return transformers.LlamaConfig(**fields)


def unlike_llama(model: Any) -> list[str]:
    """The shorthand's features a Llama block (LlamaConfig) does not have, by their model.json names."""
    checks = {
        "moe": model.moe is not None, "attention (MLA)": model.attention is not None,
        f"ffn={model.ffn}": model.ffn != "swiglu", f"norm={model.norm}": model.norm != "rmsnorm",
        f"position={model.position}": model.position != "rope", "bias": model.bias, "qkv_bias": model.qkv_bias,
        "qk_norm": model.qk_norm is not None, f"block_norms={model.block_norms}": model.block_norms != 2,
        "embedding_norm": model.embedding_norm, "sliding_window": model.sliding_window is not None,
        "final_logit_softcap": model.final_logit_softcap is not None, "attn_softcap": model.attn_softcap is not None,
        "mtp_layers": model.mtp_layers > 0, f"activation={model.activation}": model.activation not in (None, "silu"),
        "rotary_fraction": model.rotary_fraction != 1.0, f"norm_position={model.norm_position}":
            model.norm_position != "pre", "parallel_block": model.parallel_block,
        "scaled_embeddings": model.scaled_embeddings,
        "rope_scaling": model.rope_scaling is not None and model.rope_scaling.type not in ("llama3", "linear"),
    }
    return [name for name, differs in checks.items() if differs]


def _plan_model_path(bundle: Path) -> Path:
    """The model file plan.json's ``inputs.model`` names (the bundle reader checked it exists)."""
    doc = json.loads((bundle / "plan.json").read_text())
    return Path(doc["inputs"]["model"])


def _user_config(arg: str) -> Path:
    """config.json of ``--model ARG``: a directory holding one, or a Hub id in the local cache."""
    from autoplace.specs.hub import resolve_model

    path = Path(arg).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"{path} has no config.json", source=MODEL_FLAG)
        return path / "config.json"
    return resolve_model(arg)[0]
