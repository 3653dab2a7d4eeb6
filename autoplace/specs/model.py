"""ModelSpec: what is trained, loaded strictly from model.json or a Hugging Face config.json.

Two forms are accepted (DESIGN.md, "Inputs"):

* the transformer shorthand (``layers, hidden, ffn_hidden, heads, ...``), from which the
  cost model derives every layer exactly;
* an explicit layer graph (``graph: [{name, params, flops_per_token, ...}]``) for models
  that are not decoder-only transformers.

A Hugging Face ``config.json`` (recognised by its ``model_type`` key) is translated into
the shorthand by :mod:`autoplace.specs.hf` first, then validated like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationInfo, field_validator

from autoplace.errors import SpecError
from autoplace.specs._io import Strict, read_document, validate

Count = PositiveInt  # strict positive int


class Precision(Strict):
    """Bytes per parameter of each model state: the mixed-precision recipe.

    Default is bf16 mixed precision with Adam, ZeRO's K = 12 (Rajbhandari et al. 2020,
    Sec. 3.1): 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, momentum, variance).
    """

    name: str = "bf16"
    param_bytes: float = Field(2.0, gt=0, le=16)
    grad_bytes: float = Field(2.0, gt=0, le=16)
    optimizer_bytes: float = Field(12.0, ge=0, le=64)
    activation_bytes: float = Field(2.0, gt=0, le=8)
    compute_dtype: Literal["bf16", "fp16", "fp8", "tf32", "fp32"] = "bf16"


# name -> (param, grad, master weights, activations, compute dtype).  Optimizer bytes add
# the optimizer's own state per parameter (OPTIMIZER_STATE_BYTES) to the master copy.
_RECIPES: dict[str, tuple[float, float, float, float, str]] = {
    "bf16": (2, 2, 4, 2, "bf16"),  # ZeRO Sec. 3.1 with bf16 in place of fp16
    "fp16": (2, 2, 4, 2, "fp16"),  # ZeRO Sec. 3.1 exactly
    "bf16-fp32-grads": (2, 4, 4, 2, "bf16"),  # Megatron-LM default: fp32 main_grad accumulation
    "fp32": (4, 4, 0, 4, "fp32"),  # no master copy: the weights are fp32 already
    "fp8": (1, 2, 4, 1, "fp8"),  # fp8 GEMM copies of weights, bf16 grads, fp32 master (TE recipe)
}
# optimizer name -> bytes of state per parameter (fp32 unless the name says otherwise)
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adam": 8.0,  # momentum + variance in fp32
    "adamw": 8.0,
    "adam8bit": 2.0,  # Dettmers et al. 2022: two 8-bit states (+ small block quantisation stats)
    "sgd": 0.0,
    "sgd-momentum": 4.0,
    "adafactor": 0.0,  # factored second moment: O(rows + cols), negligible per parameter
}


class Training(Strict):
    """How the model is trained: batch, precision and optimizer."""

    global_batch: Count = 1024
    precision: str | Precision = "bf16"
    optimizer: str = "adam"

    @field_validator("precision")
    @classmethod
    def _known_recipe(cls, value: str | Precision) -> str | Precision:
        if isinstance(value, str) and value not in _RECIPES:
            raise ValueError(f"unknown precision; valid: {', '.join(_RECIPES)} or a mapping of byte counts")
        return value

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        if value not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"unknown optimizer; valid: {', '.join(OPTIMIZER_STATE_BYTES)}")
        return value

    def recipe(self) -> Precision:
        """The byte recipe, with the optimizer's state folded into ``optimizer_bytes``."""
        if isinstance(self.precision, Precision):
            return self.precision
        p, g, master, act, dtype = _RECIPES[self.precision]
        return Precision(
            name=f"{self.precision}+{self.optimizer}",
            param_bytes=p,
            grad_bytes=g,
            optimizer_bytes=master + OPTIMIZER_STATE_BYTES[self.optimizer],
            activation_bytes=act,
            compute_dtype=dtype,  # type: ignore[arg-type]
        )


class MoE(Strict):
    """Mixture-of-experts MLP (Mixtral, DeepSeek-MoE, Qwen-MoE style)."""

    experts: Count
    top_k: Count
    expert_ffn_hidden: Count
    shared_experts: int = Field(0, ge=0)
    shared_ffn_hidden: int = Field(0, ge=0)
    first_dense_layers: int = Field(0, ge=0)
    layer_freq: Count = 1

    @field_validator("top_k")
    @classmethod
    def _top_k_fits(cls, value: int, info: ValidationInfo) -> int:
        experts = info.data.get("experts")
        if experts is not None and value > experts:
            raise ValueError(f"top_k must be <= experts ({experts})")
        return value

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has the MoE MLP (DeepSeek's first_k_dense_replace, moe_layer_freq)."""
        return index >= self.first_dense_layers and (index - self.first_dense_layers) % self.layer_freq == 0


class MLA(Strict):
    """DeepSeek-V2/V3 multi-head latent attention projections."""

    type: Literal["mla"]
    q_lora_rank: int = Field(0, ge=0)
    kv_lora_rank: Count
    qk_nope_head_dim: Count
    qk_rope_head_dim: Count
    v_head_dim: Count


class TransformerSpec(Strict):
    """A decoder-only transformer in shorthand; every layer is derived from these numbers."""

    name: str = "model"
    source: str = ""
    layers: Count
    hidden: Count
    head_dim: Count | None = None  # before heads: the heads check reads it
    ffn_hidden: Count
    heads: Count
    kv_heads: Count | None = None
    vocab: Count
    seq_len: Count
    ffn: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    bias: bool = False
    qkv_bias: bool = False
    tied_embeddings: bool = False
    position: Literal["rope", "learned"] = "rope"
    max_position: Count | None = None
    dropout: bool = False
    flash_attention: bool = True
    moe: MoE | None = None
    attention: MLA | None = None
    training: Training = Training()

    @field_validator("heads")
    @classmethod
    def _heads_divide_hidden(cls, value: int, info: ValidationInfo) -> int:
        hidden = info.data.get("hidden")
        if hidden is not None and info.data.get("head_dim") is None and hidden % value:
            raise ValueError(f"heads must divide hidden ({hidden}); or give head_dim explicitly")
        return value

    @field_validator("kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, value: int | None, info: ValidationInfo) -> int | None:
        heads = info.data.get("heads")
        if value is not None and heads is not None and heads % value:
            raise ValueError(f"kv_heads must divide heads ({heads})")
        return value

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads


class GraphLayer(Strict):
    """One entry of an explicit layer graph; ``repeat`` copies it in sequence."""

    name: str
    params: int = Field(ge=0)
    flops_per_token: float = Field(ge=0)
    activation_bytes_per_token: float = Field(ge=0)
    repeat: Count = 1
    tp_shardable: bool = False


class GraphSpec(Strict):
    """A model given as a sequence of layers (any architecture)."""

    name: str = "model"
    source: str = ""
    hidden: Count
    seq_len: Count
    vocab: int = Field(0, ge=0)
    graph: list[GraphLayer] = Field(min_length=1)
    training: Training = Training()


ModelSpec = TransformerSpec | GraphSpec


def model_from_dict(data: dict[str, Any], *, source: str = "<model>") -> ModelSpec:
    """Validate a parsed model document (shorthand, graph or Hugging Face config).

    Raises:
        SpecError: one line naming the field and what is valid.
    """
    if "model_type" in data:
        from autoplace.specs.hf import shorthand_from_hf

        data = shorthand_from_hf(data, source=source)
    if "graph" in data:
        return validate(GraphSpec, data, source=source)
    return validate(TransformerSpec, data, source=source)


def load_model(path: str | Path, *, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Load a model file, optionally overriding training fields (``seq_len``, ``global_batch``).

    Args:
        path: model.json (shorthand or graph) or a Hugging Face config.json.
        overrides: top-level keys to replace, and ``global_batch`` inside ``training``.
    """
    data = read_document(path)
    spec = model_from_dict(data, source=str(path))
    return with_overrides(spec, overrides or {}, source=str(path))


def with_overrides(spec: ModelSpec, overrides: dict[str, Any], *, source: str) -> ModelSpec:
    """Return ``spec`` with ``seq_len`` / ``global_batch`` replaced (validated like the file)."""
    if not overrides:
        return spec
    data = spec.model_dump(exclude_none=True)
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "global_batch":
            data.setdefault("training", {})["global_batch"] = value
        elif key == "seq_len":
            data["seq_len"] = value
        else:
            raise SpecError(f"cannot override {key!r}; valid: seq_len, global_batch", source=source)
    return validate(type(spec), data, source=source)
