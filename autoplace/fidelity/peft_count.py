"""PEFT's own count of a LoRA model's trainable parameters, on a Hugging Face model built on the
meta device (no weights): the ground truth for ``layer_table(...).trainable`` (issue 28).

A family is cut to its first dense layers and two more (:func:`cut`): adapters are per layer, so
the per-layer count is what is compared, in seconds instead of minutes for DeepSeek-V3.
"""

from __future__ import annotations

import warnings
from typing import Any

from autoplace.errors import BenchmarkError
from autoplace.specs.lora import target_modules
from autoplace.specs.model import TransformerSpec

try:
    import peft
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - exercised only without them
    raise BenchmarkError("counting with PEFT needs torch, transformers and peft: pip install peft") from exc


def cut(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its first dense layers and two more (MoE ones where there are any); a GPTQ
    ``quantization_config`` is dropped (its loader needs a GPU; the shapes are the same)."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    dense = int(config.get("first_k_dense_replace") or 0)
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if key in config:
            config[key] = min(config[key], dense + 2)
    if isinstance(config.get("text_config"), dict):  # Gemma 3's multimodal config
        config["text_config"] = {**config["text_config"], "num_hidden_layers": 2}
    return config


def peft_trainable(config: dict[str, Any], spec: TransformerSpec) -> int:
    """PEFT's trainable count (``get_nb_trainable_parameters``) for the spec's LoRA on the Hugging
    Face causal LM of ``config``; of a multimodal model (Gemma 3), its language model's."""
    hf = dict(config)
    if hf["model_type"] in ("RefinedWebModel", "RefinedWeb"):  # the pre-port Falcon is transformers' falcon
        hf["model_type"] = "falcon"
        hf["num_hidden_layers"] = hf["n_layer"]  # transformers' FalconConfig no longer reads n_layer
    lora = spec.training.lora
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(**hf)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]  # typed int, scales by any number
            target_modules=target_modules(spec.family, lora.targets)))
    if any("language_model" in n for n, _ in wrapped.named_parameters()):
        return sum(p.numel() for n, p in wrapped.named_parameters() if p.requires_grad and "language_model" in n)
    trainable, _ = wrapped.get_nb_trainable_parameters()
    return int(trainable)
