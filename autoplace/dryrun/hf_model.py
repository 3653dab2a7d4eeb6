"""The transformers model a model file describes, for dry runs of bundles that train the user's Hugging
Face model (the FSDP2 bundle's train_fsdp2.py; DeepSpeed's and accelerate's scripts train the same kind).

A Hugging Face config.json is handed to transformers nearly as it is: :func:`hf_config_args` undoes
the few spellings transformers 5 no longer reads (Falcon's ``RefinedWeb*`` model types; Gemma 3's
multimodal config, whose language model is the causal LM) and drops what needs remote code or a GPU
(``auto_map``, ``quantization_config``).  A model.json shorthand describes a transformers model only
when it is Llama-style (:func:`llama_config_args`): every other shorthand, and a layer graph, is
refused with one line naming the field ``LlamaConfig`` cannot state.

For the dry runs that build the model themselves (DeepSpeed's and accelerate's, whose bundles run the user's
script), :func:`model_source` picks the model -- the user's ``--model DIR_OR_ID`` after ``--`` (a directory with
config.json, or a Hub id in the local cache), else plan.json's model file -- and :func:`causal_lm` builds it on
the meta device: shapes and dtypes, no weights.

transformers is imported inside the functions that build a config (``autoplace solve`` imports no torch).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.errors import SpecError
from autoplace.specs._io import read_document
from autoplace.specs.model import ModelSpec, TransformerSpec

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext

PLAN = "plan.json"
MODEL_FLAG = "--model"


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
        for old, key in (("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),  # the port's names
                         ("n_head_kv", "num_kv_heads")):
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


@dataclass(frozen=True)
class ModelSource:
    """transformers' config of the model a dry run builds, and where it came from (for the run's note)."""

    config: Any
    said: str


def model_source(ctx: DryContext) -> ModelSource:
    """The model the bundle trains: ``--model`` after ``--`` (``autoplace dryrun BUNDLE -- --model DIR``), else
    the model file plan.json names.

    Raises:
        SpecError: a --model that is neither a directory with config.json nor a cached Hub id, or a model file
            no transformers model states (:func:`llama_config_args`).
    """
    user = flag_value(ctx.extra, MODEL_FLAG)
    if user is not None:
        config, _ = model_file_config(_user_config(user), ctx.model)
        return ModelSource(config, f"the model: {user} (--model after --)")
    config, kind = model_file_config(plan_model_file(ctx.bundle), ctx.model)
    return ModelSource(config, f"the model: {kind}, the model file plan.json was made for")


def flag_value(words: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``words`` (``--flag V`` or ``--flag=V``), or None."""
    found = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


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


def _user_config(arg: str) -> Path:
    """config.json of ``--model ARG``: a directory holding one, or a Hub id in the local cache."""
    from autoplace.specs.hub import resolve_model

    path = Path(arg).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"{path} has no config.json", source=MODEL_FLAG)
        return path / "config.json"
    return resolve_model(arg)[0]
