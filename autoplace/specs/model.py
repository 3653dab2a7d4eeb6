"""ModelSpec: what is trained, loaded strictly from model.json or a Hugging Face config.json.

Two forms are accepted (docs/ARCHITECTURE.md, "Inputs"):

* the transformer shorthand (``layers, hidden, ffn_hidden, heads, ...``), from which the
  cost model derives every layer exactly;
* an explicit layer graph (``graph: [{name, params, flops_per_token, ...}]``) for models
  that are not decoder-only transformers.

A Hugging Face ``config.json`` (recognised by its ``model_type`` key) is translated into
the shorthand by :mod:`autoplace.specs.hf` first, then validated like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from autoplace.errors import SpecError
from autoplace.plan import FP8, TP_OVERLAP
from autoplace.specs._io import Strict, read_document, validate

# Upper bounds on sizes and counts.  Each is far beyond any model trained today (Llama 3 405B:
# 126 layers, hidden 16_384, 128k vocabulary; DeepSeek-V3: 256 experts), yet small enough that
# every derived quantity stays a finite float and every count fits in int64: a file with
# layers: 1e30 is refused here, naming the field, instead of overflowing in the evaluator.
MAX_LAYERS = 10_000
MAX_WIDTH = 10_000_000  # hidden, ffn, vocab, head and MLA dimensions
MAX_SEQ_LEN = 10_000_000
MAX_HEADS = 100_000
MAX_EXPERTS = 100_000
MAX_GLOBAL_BATCH = 100_000_000  # sequences per step
MAX_REPEAT = 100_000  # copies of one graph layer, and blocks in a whole graph
MAX_PARAMS = 10**15  # parameters of one graph layer
MAX_FLOPS_PER_TOKEN = 10**18  # forward FLOPs per token of one graph layer (1000x MAX_PARAMS)
MAX_ACTIVATION_BYTES_PER_TOKEN = 10**15


# Strict positive integers, each with its bound.
Layers = Annotated[int, Field(ge=1, le=MAX_LAYERS)]
Width = Annotated[int, Field(ge=1, le=MAX_WIDTH)]
SeqLen = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN)]
Heads = Annotated[int, Field(ge=1, le=MAX_HEADS)]
Experts = Annotated[int, Field(ge=1, le=MAX_EXPERTS)]


class Precision(Strict):
    """Bytes per parameter of each model state: the mixed-precision recipe.

    Default is bf16 mixed precision with Adam, ZeRO's K = 12 (Rajbhandari et al. 2020,
    Sec. 3.1): 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, momentum, variance).
    """

    name: str = "bf16"
    param_bytes: float = Field(2.0, gt=0, le=16, allow_inf_nan=False)
    grad_bytes: float = Field(2.0, gt=0, le=16, allow_inf_nan=False)
    optimizer_bytes: float = Field(12.0, ge=0, le=64, allow_inf_nan=False)
    activation_bytes: float = Field(2.0, gt=0, le=8, allow_inf_nan=False)
    compute_dtype: Literal["bf16", "fp16", "fp8", "tf32", "fp32"] = "bf16"
    # bytes per parameter on the wire (and in unshard buffers) when they differ from the
    # stored copy: FSDP2 stores fp32 shards but all-gathers bf16 (MixedPrecisionPolicy)
    param_comm_bytes: float | None = Field(None, gt=0, le=16, allow_inf_nan=False)
    grad_comm_bytes: float | None = Field(None, gt=0, le=16, allow_inf_nan=False)
    # whether optimizer_bytes holds an fp32 master copy of the weights (ZeRO's mixed precision);
    # without one the stored weights are the master, so ZeRO-2 shards them like optimizer state
    master_copy: bool = True

    @property
    def gather_bytes(self) -> float:
        """Bytes per parameter an all-gather (or an unsharded copy) moves."""
        return self.param_comm_bytes or self.param_bytes

    @property
    def reduce_bytes(self) -> float:
        """Bytes per gradient a reduce-scatter or all-reduce moves."""
        return self.grad_comm_bytes or self.grad_bytes


# name -> (param, grad, master weights, activations, compute dtype[, param and grad bytes on
# the wire]).  Optimizer bytes add the optimizer's own state per parameter
# (OPTIMIZER_STATE_BYTES) to the master copy.
_RECIPES: dict[str, tuple[Any, ...]] = {
    "bf16": (2, 2, 4, 2, "bf16"),  # ZeRO Sec. 3.1 with bf16 in place of fp16
    "fp16": (2, 2, 4, 2, "fp16"),  # ZeRO Sec. 3.1 exactly
    "bf16-fp32-grads": (2, 4, 4, 2, "bf16"),  # Megatron-LM default: fp32 main_grad accumulation
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default:
    # fp32 sharded weights and gradients (no separate master copy), bf16 all-gathers, fp32
    # reduce-scatters.  Same 16 bytes per parameter as "bf16", split 4 + 4 + 8.
    "bf16-fsdp2": (4, 4, 0, 2, "bf16", 2, 4),
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


# LoRA targets: the projections of a block, by role.  "q", "k", "v", "o" are attention's (with
# DeepSeek's MLA, "q" is its query projection(s), "k"/"v" its shared key-value projections);
# "gate", "up", "down" the MLP's (dense layers and shared experts; routed experts, which Hugging
# Face stores as fused 3-D parameters, are not adapted).  Which Hugging Face module each role is
# (and which roles one fused module serves) comes from the model's family: autoplace.specs.lora.
LoraRole = Literal["q", "k", "v", "o", "gate", "up", "down"]
LORA_ROLES: tuple[LoraRole, ...] = ("q", "k", "v", "o", "gate", "up", "down")


class LoRA(Strict):
    """Low-rank adapters (Hu et al. 2021): ``W + (alpha / rank) B A`` on each targeted projection.

    Defaults: rank 16, alpha 32 and every attention and MLP projection, the QLoRA paper's
    finding that adapting all linear layers is what matches full fine-tuning (Dettmers et al.
    2023, Sec. 4); PEFT's own ``LoraConfig`` defaults are r = 8 on q and v only.
    """

    rank: int = Field(default=16, ge=1, le=MAX_WIDTH)
    alpha: float = Field(default=32.0, gt=0, le=1e6, allow_inf_nan=False)
    # a tuple, so the spec stays hashable; a JSON list is accepted for it (strict=False)
    targets: tuple[LoraRole, ...] = Field(default=LORA_ROLES, min_length=1, strict=False)

    @field_validator("targets")
    @classmethod
    def _no_repeats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        repeated = sorted({t for t in value if value.count(t) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once; give each projection once")
        return value


def lora_refusal(method: str | None, lora_given: bool) -> str | None:
    """Why LoRA settings cannot go with ``method``: they train adapters, which method full has none of."""
    if method == "full" and lora_given:
        return "LoRA settings need method lora or qlora (training.method, or --method); the method is full"
    return None


class RecipePins(Strict):
    """The plan's recipe keys (:data:`autoplace.plan.RECIPE_KEYS`) the model file pins under
    ``training.recipe``: each one given is held at its value in every plan, as ``--fix`` holds
    it (a user who cannot compile writes ``compile: false``); one left out is searched."""

    compile: bool | None = None
    fused_loss: bool | None = None
    tp_overlap: str | None = None
    overlap: bool | None = None
    fp8: str | None = None

    @field_validator("tp_overlap", "fp8")
    @classmethod
    def _known_choice(cls, value: str | None, info: ValidationInfo) -> str | None:
        valid = {"tp_overlap": TP_OVERLAP, "fp8": FP8}[str(info.field_name)]
        if value is not None and value not in valid:
            raise ValueError(f"must be one of {', '.join(valid)}")
        return value

    def values(self) -> dict[str, Any]:
        """The pinned keys and their values (the keys the file leaves out are not in it)."""
        return {name: value for name, value in self if value is not None}


class Training(Strict):
    """How the model is trained: batch, precision, optimizer, method and pinned recipe keys.

    ``method``: ``full`` trains every weight; ``lora`` freezes the base weights (stored in the
    compute dtype) and trains ``lora`` adapters; ``qlora`` stores the frozen weights of the
    linear layers in 4-bit NF4 with double-quantized constants (Dettmers et al. 2023).
    ``paged_optimizer``: the optimizer's states live in paged (unified) memory that the driver
    evicts to the host under pressure (bitsandbytes' paged optimizers; QLoRA Sec. 3), so they
    are not counted on the device.
    ``recipe`` (:class:`RecipePins`, the attribute ``recipe_pins``: ``recipe()`` is the byte
    recipe of ``precision``): recipe keys every plan holds.
    """

    # the file's key is "recipe", read and written by that name (only): recipe() is the precision's
    model_config = ConfigDict(serialize_by_alias=True)

    global_batch: int = Field(default=1024, ge=1, le=MAX_GLOBAL_BATCH)
    precision: str | Precision = "bf16"
    optimizer: str = "adam"
    method: Literal["full", "lora", "qlora"] = "full"
    lora: LoRA = LoRA()
    paged_optimizer: bool = False
    recipe_pins: RecipePins = Field(default=RecipePins(), alias="recipe")

    @property
    def frozen_base(self) -> bool:
        """Whether the base weights are frozen (LoRA and QLoRA)."""
        return self.method != "full"

    @field_validator("lora")
    @classmethod
    def _adapters_need_a_frozen_base(cls, value: LoRA, info: ValidationInfo) -> LoRA:
        # settings other than the defaults beside method full change nothing: a mistake to name, in a
        # file as on the command line (with_overrides names the flags); the defaults pass, so a dumped
        # spec loads again
        why = lora_refusal(info.data.get("method"), value != LoRA())
        if why:
            raise ValueError(why)
        return value

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
        p, g, master, act, dtype, *wire = _RECIPES[self.precision]
        return Precision(
            master_copy=master > 0,
            param_comm_bytes=wire[0] if wire else None,
            grad_comm_bytes=wire[1] if wire else None,
            name=f"{self.precision}+{self.optimizer}",
            param_bytes=p,
            grad_bytes=g,
            optimizer_bytes=master + OPTIMIZER_STATE_BYTES[self.optimizer],
            activation_bytes=act,
            compute_dtype=dtype,  # type: ignore[arg-type]
        )


class MoE(Strict):
    """Mixture-of-experts MLP (Mixtral, DeepSeek-MoE, Qwen-MoE style)."""

    experts: Experts
    top_k: Experts
    expert_ffn_hidden: Width
    shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS)
    shared_ffn_hidden: int = Field(0, ge=0, le=MAX_WIDTH)
    first_dense_layers: int = Field(0, ge=0, le=MAX_LAYERS)
    layer_freq: Layers = 1
    # Routing.  Each default is Mixtral's router: softmax over the chosen top_k experts' logits
    # (the same as softmax over all, top_k, renormalised), weights used as they are.
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    # whether the top_k weights are renormalised to sum to 1 (HF norm_topk_prob); false for a
    # softmax router is Qwen1.5-MoE / DeepSeek-V2: softmax over all experts, top_k kept as they are
    normalize_top_k: bool = True
    topk_scaling: float = Field(1.0, gt=0, allow_inf_nan=False)  # DeepSeek routed_scaling_factor
    # group-limited routing (DeepSeek): experts in `groups` groups, tokens routed within the
    # best `group_top_k` groups, a group scored by its best expert ("max", DeepSeek-V2) or by the
    # sum of its top-2 (bias-corrected) scores ("top2_sum", DeepSeek-V3)
    groups: Experts = 1
    group_top_k: Experts = 1
    group_score: Literal["max", "top2_sum"] = "top2_sum"
    expert_bias: bool = False  # DeepSeek-V3's aux-loss-free e_score_correction_bias (a buffer)
    shared_expert_gate: bool = False  # Qwen-MoE: sigmoid(Linear(hidden, 1)) scales the shared expert

    @field_validator("top_k")
    @classmethod
    def _top_k_fits(cls, value: int, info: ValidationInfo) -> int:
        experts = info.data.get("experts")
        if experts is not None and value > experts:
            raise ValueError(f"top_k must be <= experts ({experts})")
        return value

    @field_validator("group_top_k")
    @classmethod
    def _groups_fit(cls, value: int, info: ValidationInfo) -> int:
        groups, experts = info.data.get("groups"), info.data.get("experts")
        if groups is not None and value > groups:
            raise ValueError(f"group_top_k must be <= groups ({groups})")
        if groups is not None and experts is not None and experts % groups:
            raise ValueError(f"groups ({groups}) must divide experts ({experts})")
        return value

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has the MoE MLP (DeepSeek's first_k_dense_replace, moe_layer_freq)."""
        return index >= self.first_dense_layers and (index - self.first_dense_layers) % self.layer_freq == 0


class MLA(Strict):
    """DeepSeek-V2/V3 multi-head latent attention projections."""

    type: Literal["mla"]
    q_lora_rank: int = Field(0, ge=0, le=MAX_WIDTH)
    kv_lora_rank: Width
    qk_nope_head_dim: Width
    qk_rope_head_dim: Width
    v_head_dim: Width


class RopeScaling(Strict):
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling`` states it.

    ``llama3`` (Llama 3.1): low/high_freq_factor and original_max_position; ``yarn`` (DeepSeek):
    original_max_position, beta_fast/slow, mscale/mscale_all_dim; ``linear`` divides positions by
    factor; ``dynamic`` (NTK) and ``longrope`` (Phi-3.5/4: per-frequency factor lists, not kept
    here) change frequencies by sequence length.
    """

    type: Literal["linear", "dynamic", "yarn", "llama3", "longrope"]
    factor: float = Field(1.0, gt=0, allow_inf_nan=False)
    original_max_position: SeqLen | None = None
    low_freq_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    high_freq_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    beta_fast: float | None = Field(None, gt=0, allow_inf_nan=False)
    beta_slow: float | None = Field(None, gt=0, allow_inf_nan=False)
    mscale: float | None = Field(None, ge=0, allow_inf_nan=False)
    mscale_all_dim: float | None = Field(None, ge=0, allow_inf_nan=False)


class TransformerSpec(Strict):
    """A decoder-only transformer in shorthand; every layer is derived from these numbers."""

    name: str = "model"
    source: str = ""
    layers: Layers
    hidden: Width
    # head_dim and attention come before heads: the heads check reads them
    head_dim: Width | None = None
    attention: MLA | None = None
    ffn_hidden: Width
    heads: Heads
    kv_heads: Heads | None = None
    vocab: Width
    seq_len: SeqLen
    ffn: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    # epsilon of every norm (Hugging Face rms_norm_eps / layer_norm_eps[ilon] / norm_epsilon); None =
    # unstated: each framework's own default (Megatron-LM 1e-5, torchtitan's llama3 1e-5, qwen3 1e-6)
    norm_eps: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)
    # biases on every linear layer (GPT-2/3, BLOOM, Falcon, ...); qkv_bias: on q/k/v, which follows
    # bias unless stated (_qkv_bias_follows_bias): stated alone, q/k/v only (Qwen2); false beside
    # bias, every linear layer but q/k/v
    bias: bool = False
    qkv_bias: bool = False
    tied_embeddings: bool = False
    position: Literal["rope", "learned", "alibi"] = "rope"  # ALiBi (BLOOM, MPT): no parameters
    # RoPE base (Hugging Face rope_theta); None = unknown, frameworks' default 10000 (Llama 3: 500000).
    # It changes no shape or cost; the emitters write it so the trained model is the one described.
    rope_theta: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_position: SeqLen | None = None
    dropout: bool = False
    flash_attention: bool = True
    moe: MoE | None = None
    # Block details of newer families.  Each default leaves a Llama/GPT block as it was.
    # q/k normalised before attention: per head (Qwen3, Gemma 3: head_dim weights each) or
    # over all heads at once (OLMo 2: heads x head_dim and kv_heads x head_dim weights)
    qk_norm: Literal["head", "layer"] | None = None
    # hidden-wide norms per block: 2 pre-norms; 4 with Gemma 2/3's post-norms; 1 when
    # attention and MLP share one (Falcon-7B's parallel block)
    block_norms: int = Field(2, ge=1, le=4)
    embedding_norm: bool = False  # a LayerNorm right after the embedding (BLOOM)
    # keys each query attends to in windowed layers (Mistral, Gemma, Phi-3, StarCoder2); with
    # full_attention_every=k every k-th layer (1-based) attends to the whole sequence instead
    sliding_window: SeqLen | None = None
    full_attention_every: Layers | None = None
    final_logit_softcap: float | None = Field(None, gt=0, allow_inf_nan=False)  # Gemma 2: cap*tanh(z/cap)
    mtp_layers: int = Field(0, ge=0, le=MAX_LAYERS)  # DeepSeek-V3 multi-token-prediction modules
    # the Hugging Face model_type it was read from (None: a shorthand file); names the modules
    # LoRA adapts (autoplace.specs.lora)
    family: str | None = None
    # Features that change the math but no shape (autoplace.specs.features lists every one).
    # The MLP's activation: None = the ffn's own (SiLU gating for swiglu, exact GeLU for gelu);
    # gelu_tanh is GeLU's tanh approximation (GPT-2, BLOOM; Gemma's gated MLP), relu2 squared ReLU
    activation: Literal["silu", "gelu", "gelu_tanh", "relu2"] | None = None
    rotary_fraction: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)  # GPT-NeoX rotary_pct, Phi-4
    rope_scaling: RopeScaling | None = None
    attn_softcap: float | None = Field(None, gt=0, allow_inf_nan=False)  # Gemma 2: logits cap*tanh(s/cap)
    # where the block's norms sit: before attention/MLP ("pre", Llama), on their outputs before
    # the residual add ("post", OLMo 2), or both ("sandwich", Gemma 2/3: 4 norms per block)
    norm_position: Literal["pre", "post", "sandwich"] = "pre"
    parallel_block: bool = False  # attention and MLP read the same input, outputs summed (GPT-NeoX, Falcon)
    scaled_embeddings: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    training: Training = Training()

    @model_validator(mode="before")
    @classmethod
    def _qkv_bias_follows_bias(cls, data: Any) -> Any:
        """``bias: true`` alone means biases on every linear layer, q/k/v included: the models that
        have biases have them there too (GPT-2/3, BLOOM, Falcon, GPT-NeoX); a model without them on
        q/k/v only states ``qkv_bias: false``, which Megatron-LM, for one, cannot train."""
        if isinstance(data, dict) and "qkv_bias" not in data and isinstance(data.get("bias"), bool):
            return {**data, "qkv_bias": data["bias"]}
        return data

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str | None) -> str | None:
        from autoplace.specs.hf import _FAMILIES

        if value is not None and value not in _FAMILIES:
            raise ValueError(f"unknown Hugging Face model_type; valid: {', '.join(sorted(_FAMILIES))}")
        return value

    @field_validator("full_attention_every")
    @classmethod
    def _needs_a_window(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("sliding_window") is None:
            raise ValueError("full_attention_every needs sliding_window (the other layers' window)")
        return value

    @field_validator("heads")
    @classmethod
    def _heads_divide_hidden(cls, value: int, info: ValidationInfo) -> int:
        # With MLA (DeepSeek) the head sizes are the attention block's own dimensions, so
        # hidden need not split evenly across heads (DeepSeek-V2-Lite: 2048 over 16 heads of 192).
        hidden = info.data.get("hidden")
        if info.data.get("attention") is not None or info.data.get("head_dim") is not None:
            return value
        if hidden is not None and hidden % value:
            raise ValueError(f"heads must divide hidden ({hidden}); or give head_dim explicitly")
        return value

    @field_validator("kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, value: int | None, info: ValidationInfo) -> int | None:
        heads = info.data.get("heads")
        if value is not None and heads is not None and heads % value:
            raise ValueError(f"kv_heads must divide heads ({heads})")
        return value

    @field_validator("norm_position")
    @classmethod
    def _sandwich_has_four_norms(cls, value: str, info: ValidationInfo) -> str:
        norms = info.data.get("block_norms")
        if norms is not None and (value == "sandwich") != (norms == 4):
            raise ValueError(f"norm_position sandwich goes with block_norms 4 (got {value} with {norms})")
        return value

    @property
    def attention_kind(self) -> str:
        """MLA, MHA, MQA (one k/v head) or GQA (fewer k/v heads than heads)."""
        if self.attention is not None:
            return "MLA"
        kv = self.n_kv_heads
        return "MHA" if kv == self.heads else "MQA" if kv == 1 else "GQA"

    @property
    def act(self) -> str:
        """The MLP's activation, the ffn's own when none is stated."""
        return self.activation or ("silu" if self.ffn == "swiglu" else "gelu")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads


class GraphLayer(Strict):
    """One entry of an explicit layer graph; ``repeat`` copies it in sequence."""

    name: str
    params: int = Field(ge=0, le=MAX_PARAMS)
    flops_per_token: float = Field(ge=0, le=MAX_FLOPS_PER_TOKEN, allow_inf_nan=False)
    activation_bytes_per_token: float = Field(ge=0, le=MAX_ACTIVATION_BYTES_PER_TOKEN, allow_inf_nan=False)
    repeat: int = Field(1, ge=1, le=MAX_REPEAT)
    tp_shardable: bool = False

    @field_validator("flops_per_token", "activation_bytes_per_token")
    @classmethod
    def _zero_or_whole(cls, value: float) -> float:
        # FLOPs and bytes are counts: a fraction of one per token is a unit mistake, and would
        # make a step time so small that throughput overflows to inf.
        if 0 < value < 1:
            raise ValueError("must be 0 or >= 1 (a count per token)")
        return value


class GraphSpec(Strict):
    """A model given as a sequence of layers (any architecture).

    The graph must hold something to train: a graph whose layers have neither parameters
    nor FLOPs is refused at load time (its step time would be zero, its throughput and MFU
    undefined).  A graph with parameters but no FLOPs loads; its MFU is 0.
    """

    name: str = "model"
    source: str = ""
    hidden: Width
    seq_len: SeqLen
    vocab: int = Field(0, ge=0, le=MAX_WIDTH)
    graph: list[GraphLayer] = Field(min_length=1)
    training: Training = Training()

    @field_validator("graph")
    @classmethod
    def _something_to_train(cls, graph: list[GraphLayer]) -> list[GraphLayer]:
        blocks = sum(layer.repeat for layer in graph)
        if blocks > MAX_REPEAT:
            raise ValueError(f"the layers repeat to {blocks} blocks in total; at most {MAX_REPEAT} are accepted")
        if not any(layer.params or layer.flops_per_token for layer in graph):
            raise ValueError("every layer has params 0 and flops_per_token 0: there is nothing to train")
        return graph

    @field_validator("training")
    @classmethod
    def _full_training(cls, value: Training) -> Training:
        # a graph names no projections, so there is nothing to put adapters on
        if value.frozen_base:
            raise ValueError(f"method {value.method!r} needs the transformer shorthand (a layer graph names no "
                             "projections to adapt); use method 'full'")
        return value


ModelSpec = TransformerSpec | GraphSpec


def model_from_dict(data: dict[str, Any], *, source: str = "<model>") -> ModelSpec:
    """Validate a parsed model document (shorthand, graph or Hugging Face config).

    Raises:
        SpecError: one line naming the field and what is valid.
    """
    if "model_type" in data or _looks_like_hf(data):  # (without model_type: the HF reader says it is missing)
        return _from_hf(data, source=source)
    if "graph" in data:
        return validate(GraphSpec, data, source=source)
    return validate(TransformerSpec, data, source=source)


HF_MARKERS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "architectures")


def _looks_like_hf(data: dict[str, Any]) -> bool:
    """A Hugging Face config.json (its keys, none of the shorthand's or a graph's) that lost its
    ``model_type``: worth naming that, not the shorthand's missing ``layers``."""
    return "layers" not in data and "graph" not in data and any(key in data for key in HF_MARKERS)


def _from_hf(config: dict[str, Any], *, source: str) -> TransformerSpec:
    """Translate a Hugging Face config and validate it; errors name the config's keys.

    The HF reader checks types and cross-key rules; what only the shorthand checks (the
    bounds) is reported under the key the value came from, e.g. ``num_hidden_layers``.
    """
    from autoplace.specs.hf import hf_key, shorthand_from_hf

    shorthand = {**shorthand_from_hf(config, source=source), "family": config["model_type"]}
    try:
        return validate(TransformerSpec, shorthand, source=source)
    except SpecError as exc:
        key = hf_key(config, exc.field) if exc.field else None
        if key is None:
            raise
        raise SpecError(f"{exc.detail} (autoplace's {exc.field})", source=source, field=key) from None


def load_model(path: str | Path, *, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Load a model file, optionally overriding training fields (``seq_len``, ``global_batch``).

    Args:
        path: model.json (shorthand or graph) or a Hugging Face config.json.
        overrides: top-level keys to replace, and ``global_batch`` inside ``training``.
    """
    return read_model(path, overrides=overrides)[0]


@dataclass(frozen=True)
class ModelOrigin:
    """What the loader read, recorded as it read it (the report's header needs no second read).

    Attributes:
        kind: ``hf`` (a Hugging Face config.json), ``graph`` or ``shorthand``.
        model_type: the HF config's ``model_type`` (None for autoplace's own files).
        defaulted: training fields autoplace assumed because neither the file nor an override gave them.
        seq_len_key, seq_len_value: the HF config key the default sequence length came from, and its value.
    """

    kind: str
    model_type: str | None
    defaulted: tuple[str, ...]
    seq_len_key: str | None = None
    seq_len_value: Any = None


def read_model(path: str | Path, *, overrides: dict[str, Any] | None = None,
               overrides_source: str | None = None) -> tuple[ModelSpec, ModelOrigin]:
    """:func:`load_model`, with the :class:`ModelOrigin` of what was read; ``overrides_source``: where
    the overrides come from when they are not the command line's flags (:func:`with_overrides`)."""
    from autoplace.specs.hf import hf_key

    data = read_document(path)
    spec = with_overrides(model_from_dict(data, source=str(path)), overrides or {}, source=overrides_source)
    given = {k for k, v in (overrides or {}).items() if v is not None}
    training: dict[str, Any] = data["training"] if isinstance(data.get("training"), dict) else {}
    defaulted = [] if "global_batch" in given or "global_batch" in training else ["global_batch"]
    if "model_type" not in data:
        return spec, ModelOrigin("graph" if "graph" in data else "shorthand", None, tuple(defaulted))
    key = None if "seq_len" in given else hf_key(data, "seq_len")
    value: Any = data
    for part in (key or "").split(".") if key else ():
        value = value.get(part) if isinstance(value, dict) else None
    if "seq_len" not in given:
        defaulted.append("seq_len")
    return spec, ModelOrigin("hf", str(data["model_type"]), tuple(defaulted), key, value if key else None)


def with_overrides(spec: ModelSpec, overrides: dict[str, Any], *, source: str | None = None) -> ModelSpec:
    """Return ``spec`` with ``seq_len``, ``global_batch``, the training ``method``, ``paged_optimizer``
    or a LoRA field (``lora_rank``, ``lora_alpha``, ``lora_targets``) replaced, validated like the file.

    ``method`` full drops the spec's LoRA settings unless LoRA overrides come with it: asked to
    train every weight, a LoRA fine-tuning file's adapter settings no longer apply.

    Args:
        source: where the overrides come from (a config file), named by an error; None: they are
            the command line's flags, and an error names the flag that set the value it refuses
            (``--lora-rank``: the command line's ``--lora-rank`` is the ``lora_rank`` override).

    Raises:
        SpecError: an override the spec refuses, named as above (the spec itself was valid).
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return spec
    unknown = sorted(set(given) - set(_OVERRIDES))
    if unknown:
        raise SpecError(f"cannot override {unknown[0]!r}; valid: {', '.join(_OVERRIDES)}", source=source)
    data = spec.model_dump(exclude_unset=True)  # what was given: a default stays a default
    training = data.setdefault("training", {})
    if given.get("method") == "full" and not given.keys() & _LORA_KEYS:
        training.pop("lora", None)
    for key, value in given.items():
        node = data
        *parents, leaf = _OVERRIDES[key].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    lora_flags = [k for k in given if k in _LORA_KEYS]  # given at all, the defaults' values too
    why = lora_refusal(training.get("method", "full"), bool(lora_flags))
    if why:
        raise SpecError(why, source=source or ", ".join(map(_flag, lora_flags)))
    try:
        return validate(type(spec), data, source=source or "")
    except SpecError as exc:
        if source is not None:
            raise
        flags = _flags_setting(exc.field or "", given)
        if flags:  # the field a flag sets, or one inside or around it (training.lora for --lora-rank)
            raise SpecError(exc.detail, source=", ".join(flags)) from None
        # another field the flags made invalid (a rule across fields): the flags and that field
        raise SpecError(exc.detail, source=", ".join(map(_flag, given)), field=exc.field) from None


# override key -> the field it sets; the command line's flag of each is --KEY with "-" for "_" (--lora-rank)
_OVERRIDES = {"seq_len": "seq_len", "global_batch": "training.global_batch", "method": "training.method",
              "paged_optimizer": "training.paged_optimizer", "lora_rank": "training.lora.rank",
              "lora_alpha": "training.lora.alpha", "lora_targets": "training.lora.targets"}
_LORA_KEYS = {"lora_rank", "lora_alpha", "lora_targets"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _flags_setting(field: str, given: dict[str, Any]) -> list[str]:
    """The flags among ``given`` whose field is ``field``, inside it, or holds it (a nested error)."""
    def related(path: str) -> bool:
        return bool(field) and (path == field or path.startswith(field + ".") or field.startswith(path + "."))

    return [_flag(k) for k in given if related(_OVERRIDES[k])]
