"""Per-layer numbers of a model, independent of the plan: parameters, FLOPs, activation and
communication coefficients per token.

A model is a sequence: an embedding, ``L`` blocks and a head.  Blocks come in a few *kinds*
(dense, MoE); everything the cost model needs about a kind is a :class:`BlockKind`, with
per-token coefficients that the plan-dependent functions in :mod:`memory`, :mod:`comm` and
:mod:`compute` scale by micro-batch, sequence, TP/SP/CP degrees and recompute mode.

Activation coefficients follow Korthikanti et al. 2022 (arXiv 2205.05198, Sec. 4.1): per
layer, per token, with 16-bit activations and 1-byte dropout masks, split into the part that
tensor parallelism shards (``act_tp``), the part only sequence parallelism shards
(``act_rep``) and the attention-score part (``act_score``, per token *per key*, gone with
flash attention or selective recompute).  For the GPT layer they give the paper's
``sbh(34 + 5as/h)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autoplace.cost import finetune, shards
from autoplace.cost.shards import Rows
from autoplace.specs.model import GraphSpec, ModelSpec, TransformerSpec


@dataclass(frozen=True)
class Gemm:
    """One forward matmul of a block, per token: ``[tokens x k] @ [k x n]``.

    Attributes:
        n, k: output and reduction widths before tensor parallelism.
        split: the dimension tensor parallelism divides: ``"n"`` (column-parallel), ``"k"``
            (row-parallel) or ``""`` (replicated across TP).
        experts: for a routed expert's matmul, how many experts it stands for (0: dense);
            each sees ``tokens * top_k / experts`` tokens of the EP group.
        top_k: experts per token (routed matmuls only).
    """

    n: float
    k: float
    split: str = ""
    experts: int = 0
    top_k: int = 0

    @property
    def flops(self) -> float:
        """Forward FLOPs per token (2 per multiply-add)."""
        return 2 * self.n * self.k * (self.top_k if self.experts else 1)


@dataclass(frozen=True)
class BlockKind:
    """Plan-independent numbers of one kind of block (all per token unless named otherwise).

    Attributes:
        name: label ("dense", "moe", or a graph layer's name).
        params_tp: parameters sharded by tensor parallelism (QKV/out/MLP weights, column biases).
        params_rep: parameters replicated across TP (norms, row-parallel biases, router).
        params_expert: routed-expert parameters (all experts), sharded by EP then TP.
        flops: forward FLOPs per token (matmuls + attention), the 2-FLOPs-per-MAC convention.
        flops_score: forward FLOPs per token of the attention core (QK^T and scores x V).
        act_rep: activation bytes per token not sharded by TP (sharded by SP).
        act_tp: activation bytes per token sharded by TP.
        act_score: attention-score bytes per token per key (x seq), sharded by TP.
        act_input: the block input per token (what full recompute keeps).
        tp_allreduce: bytes per token all-reduced across TP per forward (x2 backward).
        ep_alltoall: bytes per token sent in one all-to-all (dispatch or combine) across EP.
        cp_kv: bytes per token of K and V exchanged around the CP ring per forward.
        moe: whether the block routes tokens to experts.
        act_fused: activation bytes per token, sharded by TP, that a compiled (fused) MLP does
            not keep: its activation function's outputs, recomputed in the fused backward
            (eager SwiGLU keeps four f-wide tensors, a fused one two; GeLU two, fused one).
        act_glu: bytes per token, sharded by TP, of one f-wide tensor of a gated (SwiGLU) MLP:
            eager PyTorch keeps four (``SWIGLU_KEPT``), Megatron-Core's fused bias-SwiGLU three
            (``Assumptions.swiglu_kept``); 0 for ungated MLPs.
        act_norm_upcast: bytes per token its RMSNorms keep beyond a fused kernel's when they run
            as transformers' eager modules (:func:`_norm_upcast`; ``Assumptions.rmsnorm_upcast_kept``),
            sharded by SP (the q/k norms' part by TP, counted here all the same: they are small).
        gemms: the block's matmuls (their FLOPs plus ``flops_score`` make ``flops``).
        head_dim: width of one attention head (sets the attention kernel's efficiency).
        flash: whether attention runs as a fused flash kernel (else as matmuls + softmax).
    """

    name: str
    params_tp: float
    params_rep: float
    params_expert: float
    flops: float
    flops_score: float
    act_rep: float
    act_tp: float
    act_score: float
    act_input: float
    tp_allreduce: float
    ep_alltoall: float
    cp_kv: float
    moe: bool = False
    act_fused: float = 0.0
    act_glu: float = 0.0
    act_norm_upcast: float = 0.0
    gemms: tuple[Gemm, ...] = ()
    head_dim: float = 128.0
    flash: bool = True
    # fine-tuning with a frozen base (LoRA, QLoRA; autoplace.cost.finetune): trainable adapter
    # parameters and the base's parameters stored in 4 bit (QLoRA), each TP-sharded /
    # replicated / routed-expert, and the frozen matmuls (no weight gradients)
    adapter_tp: float = 0.0
    adapter_rep: float = 0.0
    adapter_expert: float = 0.0
    quant_tp: float = 0.0
    quant_rep: float = 0.0
    quant_expert: float = 0.0
    frozen_flops: float = 0.0
    frozen_gemms: tuple[Gemm, ...] = ()
    # parameter tensors (weights, biases, norm scales and shifts): what a framework's
    # per-parameter host loops iterate over (DeepSpeed's ZeRO-3 reduce-scatter)
    tensors: float = 0.0
    # each parameter tensor's rows and elements per row, as FSDP2 pads its shards (autoplace.cost.shards);
    # a frozen base's adapters' likewise
    rows: tuple[Rows, ...] = ()
    adapter_rows: tuple[Rows, ...] = ()
    # the trainable tensors in the order Hugging Face registers them, (elements before parallelism,
    # "tp" | "rep" | "expert"): what a flat ZeRO-1/2 partition cuts through (autoplace.cost.flat)
    order: tuple[tuple[float, str], ...] = ()

    @property
    def params(self) -> float:
        return self.params_tp + self.params_rep + self.params_expert

    @property
    def adapters(self) -> float:
        return self.adapter_tp + self.adapter_rep + self.adapter_expert


@dataclass(frozen=True)
class Edge:
    """The embedding or the head: parameters, FLOPs and activations outside the blocks."""

    params_tp: float  # vocab-parallel table / head weight (sharded by TP)
    params_rep: float  # final norm, replicated
    flops: float  # forward FLOPs per token
    act_rep: float  # activation bytes per token not sharded by TP (sharded by SP)
    act_tp: float  # activation bytes per token sharded by TP (logits)
    tp_allreduce: float  # bytes per token all-reduced across TP per forward
    gemms: tuple[Gemm, ...] = ()  # its matmuls (the head's output layer)
    act_norm_upcast: float = 0.0  # the final norm's, as BlockKind.act_norm_upcast (not sharded by TP)
    rows_tp: tuple[Rows, ...] = ()  # the tensors of params_tp and params_rep (autoplace.cost.shards)
    rows_rep: tuple[Rows, ...] = ()


@dataclass(frozen=True)
class LayerTable:
    """Everything the cost model needs from a model, as plain numbers.

    Attributes:
        kinds: the distinct block kinds.
        sequence: kind index of every block, in order (length = number of blocks).
        embed, head: the two edges; ``tied`` says whether they share one matrix.
        hidden, seq_len, vocab, heads: shapes used for buffer and communication sizes.
        params: exact total parameter count (a tied matrix counted once).
        act_bytes: bytes per activation element (the precision recipe's).
        frozen: whether the base weights are frozen (LoRA, QLoRA): only the kinds' adapters train.
        paged_optimizer: optimizer states in paged memory the driver evicts to the host
            (bitsandbytes' paged optimizers): counted on the host, not the device.
        mtp: multi-token-prediction modules (DeepSeek-V3: 1), each one block of the last kind of
            ``kinds``, which no entry of ``sequence`` names: not a pipeline layer, it sits on the
            stage holding the loss (:func:`autoplace.cost.context.head_stage`), with a copy of the
            embedding there when that is not the first stage (Megatron-Core's ``GPTModel``
            builds the embedding where ``pre_process or mtp_process``).
    """

    name: str
    kinds: tuple[BlockKind, ...]
    sequence: tuple[int, ...]
    embed: Edge
    head: Edge
    tied: bool
    hidden: int
    seq_len: int
    vocab: int
    params: float
    act_bytes: float
    frozen: bool = False
    paged_optimizer: bool = False
    mtp: int = 0

    @property
    def blocks(self) -> int:
        return len(self.sequence)

    @property
    def trainable(self) -> float:
        """Parameters that get gradients: the adapters when the base is frozen, else all."""
        if not self.frozen:
            return self.params
        counts = np.bincount(np.asarray(self.sequence, dtype=int), minlength=len(self.kinds))
        return float(sum(int(c) * k.adapters for c, k in zip(counts, self.kinds, strict=True)))

    def kind_counts(self, start: int, stop: int) -> np.ndarray:
        """How many blocks of each kind lie in ``sequence[start:stop]``."""
        return np.bincount(np.asarray(self.sequence[start:stop], dtype=int), minlength=len(self.kinds))


_TABLES: dict[str, LayerTable] = {}


def layer_table(model: ModelSpec) -> LayerTable:
    """Build (and cache, keyed by the spec's JSON) the plan-independent table of a model."""
    key = f"{type(model).__name__}:{model.model_dump_json()}"
    if key not in _TABLES:
        _TABLES[key] = _graph_table(model) if isinstance(model, GraphSpec) else _transformer_table(model)
    return _TABLES[key]


def _attention_gemms(m: TransformerSpec) -> tuple[Gemm, ...]:
    """The attention block's projections (QKV and output; MLA's down and up projections)."""
    h = m.hidden
    if m.attention is not None:
        a = m.attention
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q_proj = ((Gemm(a.q_lora_rank, h), Gemm(m.heads * qk, a.q_lora_rank, "n")) if a.q_lora_rank
                  else (Gemm(m.heads * qk, h, "n"),))
        return (*q_proj, Gemm(a.kv_lora_rank + a.qk_rope_head_dim, h),
                Gemm(m.heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, "n"),
                Gemm(h, m.heads * a.v_head_dim, "k"))
    q, kv = m.heads * m.dim_head, m.n_kv_heads * m.dim_head
    return Gemm(q + 2 * kv, h, "n"), Gemm(h, q, "k")


def _tensors(m: TransformerSpec, gemms: tuple[Gemm, ...]) -> float:
    """Parameter tensors of a block: a weight per matmul (one per routed expert), its bias when the
    model has biases, and each norm's scale (and shift, for layernorm).  The table fuses QKV and
    gate/up as Megatron's GPT does; code that keeps them apart (Hugging Face Llama) has more."""
    weights = sum(max(g.experts, 1) for g in gemms)
    norms = m.block_norms * (2 if m.norm == "layernorm" else 1) + (2 if m.qk_norm is not None else 0)
    return float(weights * (2 if m.bias else 1) + norms)


def _order(m: TransformerSpec, k: BlockKind) -> tuple[tuple[float, str], ...]:
    """``k``'s parameter tensors in the order Hugging Face registers them (:attr:`BlockKind.order`):
    attention's weights, a MoE block's router and routed experts (transformers 5 stores each expert
    projection as one 3-D tensor), the MLP's (or shared experts') weights, each fused as the family
    fuses them (:func:`autoplace.cost.finetune.module_projections`), then the rest -- norms, biases --
    as one small tensor per split, so the tensors add up to the kind's parameters."""
    split = {"n": "tp", "k": "tp", "": "rep"}
    attention, mlp = finetune.module_projections(m, k.moe)
    order = [(p.out * p.inp, split[p.split]) for p in attention]
    if k.moe and m.moe is not None:
        e, gated = m.moe, m.ffn == "swiglu"
        order += [(e.experts * m.hidden, "rep"), (e.experts * (2 if gated else 1) * e.expert_ffn_hidden * m.hidden, "expert"),
                  (e.experts * m.hidden * e.expert_ffn_hidden, "expert")]
    order += [(p.out * p.inp, split[p.split]) for p in mlp]
    totals = {"tp": k.params_tp, "rep": k.params_rep, "expert": k.params_expert}
    rest = [(totals[s] - sum(n for n, t in order if t == s), s) for s in totals]
    return tuple(order + [(n, s) for n, s in rest if n > 0])


def _mlp_gemms(h: int, f: int, gated: bool, experts: int = 0, top_k: int = 0) -> tuple[Gemm, ...]:
    """An MLP's up (and gate) projection and its down projection."""
    return Gemm((2 if gated else 1) * f, h, "n", experts, top_k), Gemm(h, f, "k", experts, top_k)


def _attention(m: TransformerSpec) -> tuple[float, float, float, int, int, int]:
    """Attention parameters (tp-sharded, replicated) and the q/k/v widths after projection.

    Returns:
        (params_tp, params_rep, bias_rep, q_width, k_width, v_width)
    """
    h, heads = m.hidden, m.heads
    bias = m.bias
    if m.attention is not None:  # DeepSeek MLA (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1)
        a = m.attention
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q_down, q = h * a.q_lora_rank, a.q_lora_rank * heads * qk  # down + up projection
            q_norm = a.q_lora_rank
        else:
            q_down, q, q_norm = 0, h * heads * qk, 0
        kv_down = h * (a.kv_lora_rank + a.qk_rope_head_dim)  # shared latent + decoupled rope key
        kv_up = a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
        out = heads * a.v_head_dim * h
        # the down projections and their norms are replicated across TP: megatron-core 0.16's Transformer
        # Engine MLA spec builds both as TELinear(parallel_mode="duplicated") (gpt_layer_specs.py)
        rep = q_down + kv_down + q_norm + a.kv_lora_rank
        return q + kv_up + out, rep, 0.0, heads * qk, heads * qk, heads * a.v_head_dim
    d = m.dim_head
    qw, kw = heads * d, m.n_kv_heads * d
    weights = h * (qw + 2 * kw) + qw * h
    col_bias = (qw + 2 * kw) if m.qkv_bias else 0  # column-parallel: sharded (qkv_bias follows bias unless stated)
    row_bias = h if bias else 0  # row-parallel output bias: replicated
    return weights + col_bias, row_bias, row_bias, qw, kw, kw


def _mlp_params(h: int, f: int, gated: bool, bias: bool) -> tuple[float, float]:
    """(tp-sharded, replicated) parameters of one MLP of width ``f``."""
    mats = 3 if gated else 2
    col_bias = (2 * f if gated else f) if bias else 0
    return mats * h * f + col_bias, (h if bias else 0)


def _mlp_act(h: int, f: int, gated: bool, dropout: bool, b: float) -> tuple[float, float]:
    """(act_rep, act_tp) bytes per token of an MLP (Korthikanti Sec. 4.1: 19sbh for 4h GeLU).

    Kept for backward: the fc1 input (2h, replicated), the activation input and output
    (GeLU: 2f + 2f), the dropout mask (h bytes).  Eager SwiGLU (PyTorch, torchtitan, the FSDP2
    module autoplace emits) keeps four f-wide tensors: w1 x, silu(w1 x), w3 x and the product
    (measured with FSDPMemTracker, autoplace.fidelity); Megatron-Core's fused kernel keeps three,
    so Megatron users see a slight over-estimate.
    """
    inner = (SWIGLU_KEPT if gated else 2) * f * b
    return h * b + (h if dropout else 0), inner


SWIGLU_KEPT = 4  # f-wide tensors eager SwiGLU keeps for backward


def _mlp_fused(f: int, gated: bool, b: float) -> float:
    """Bytes per token a fused MLP activation does not keep: SwiGLU's silu(w1 x) and product
    (two of its four f-wide tensors), GeLU's output (one of two)."""
    return (2 if gated else 1) * f * b


def _norm_stats(m: TransformerSpec) -> float:
    """fp32 statistics one norm keeps per token: RMSNorm its rstd, LayerNorm mean and rstd
    (the small '2sb' terms Korthikanti Sec. 4.1 leaves out)."""
    return 8.0 if m.norm == "layernorm" else 4.0


def _norm_upcast(m: TransformerSpec, width: float) -> float:
    """Bytes per token an RMSNorm over ``width`` keeps beyond a fused kernel's ``b * width`` input
    and fp32 rstd when it runs as transformers' eager module (``LlamaRMSNorm.forward``,
    transformers 5 models/llama/modeling_llama.py, copied by Mistral, Qwen, Mixtral...): its input
    cast to fp32 is what ``pow(2)`` and the multiply by rstd save, and the normalized tensor cast back
    is what the multiply by ``weight`` saves, in place of the input: ``4 * width`` more at 16 bit
    (and at 32 bit, where the cast is the input itself but the normalized tensor is new).  Read from
    the ops' autograd formulas; autoplace.fidelity.saved measures it.  LayerNorm runs as
    ``F.layer_norm``, one kernel that keeps its input and mean / rstd: nothing more."""
    return 4.0 * width if m.norm == "rmsnorm" else 0.0


def _norm_params(m: TransformerSpec) -> int:
    return (2 if m.norm == "layernorm" else 1) * m.hidden


def _qk_norm_params(m: TransformerSpec) -> int:
    """RMSNorm weights on q and k: one head's width each (Qwen3, Gemma 3) or all heads' (OLMo 2)."""
    if m.qk_norm == "head":
        return 2 * m.dim_head
    if m.qk_norm == "layer":
        return (m.heads + m.n_kv_heads) * m.dim_head
    return 0


def _transformer_table(m: TransformerSpec) -> LayerTable:
    b = m.training.recipe().activation_bytes
    h, s = m.hidden, m.seq_len
    att_tp, att_rep, _, qw, kw, vw = _attention(m)
    norms = m.block_norms * _norm_params(m) + _qk_norm_params(m)
    drop = 1.0 if m.dropout else 0.0
    # Attention (Korthikanti: 11sbh + 5as^2b): QKV input 2h and dropout mask h are replicated;
    # Q, K, V and the output projection's input (heads x v_head_dim wide, also under GQA) are
    # sharded; per token per key the softmax output (b bytes), and with dropout its 1-byte mask
    # and the dropped scores (b bytes): 5a at 16 bit.
    o_in = m.heads * (m.attention.v_head_dim if m.attention is not None else m.dim_head)
    att_act_rep = b * h + drop * h
    att_act_tp = b * (qw + kw + vw) + b * o_in
    score = m.heads * (b + drop * (b + 1))
    if m.flash_attention:  # no s x s scores are kept (Dao et al. 2022): only fp32 log-sum-exp per head
        att_act_tp += 4 * m.heads
        score = 0.0
    # each hidden-wide norm keeps its input and fp32 stats (two norms: Korthikanti's 4sbh); q/k norms
    # keep q and k (per head: an fp32 rstd per head; over the layer: one per token for each)
    norm_act = m.block_norms * (b * h + _norm_stats(m))
    upcast = m.block_norms * _norm_upcast(m, h)
    if m.qk_norm is not None:
        att_act_tp += b * (qw + kw) + (4 * (m.heads + m.n_kv_heads) if m.qk_norm == "head" else 0)
        norm_act += 8 if m.qk_norm == "layer" else 0
        upcast += _norm_upcast(m, qw + kw)
    att_flops = 2 * (att_tp - (qw + 2 * kw if m.qkv_bias else 0))  # 2 FLOPs per weight
    att_flops += 2 * att_rep if m.attention is not None else 0
    flops_score = 2 * s * qw + 2 * s * o_in  # QK^T and scores x V per token (full, not causal: Megatron Eq. 3)
    kinds: list[BlockKind] = []
    dense_tp, dense_rep = _mlp_params(h, m.ffn_hidden, m.ffn == "swiglu", m.bias)
    mlp_rep, mlp_tp = _mlp_act(h, m.ffn_hidden, m.ffn == "swiglu", m.dropout, b)
    common = dict(flops_score=flops_score, act_score=score * s, act_input=b * h, act_norm_upcast=upcast,
                  tp_allreduce=2 * b * h, cp_kv=b * (kw + vw), head_dim=qw / m.heads, flash=m.flash_attention)
    attention = _attention_gemms(m)
    gated = m.ffn == "swiglu"
    dense_gemms = (*attention, *_mlp_gemms(h, m.ffn_hidden, gated))
    kinds.append(BlockKind(
        name="dense", params_tp=att_tp + dense_tp, params_rep=att_rep + norms + dense_rep, params_expert=0.0,
        flops=att_flops + 2 * (3 if m.ffn == "swiglu" else 2) * h * m.ffn_hidden + flops_score,
        act_rep=att_act_rep + norm_act + mlp_rep, act_tp=att_act_tp + mlp_tp, ep_alltoall=0.0,
        act_fused=_mlp_fused(m.ffn_hidden, gated, b), act_glu=gated * m.ffn_hidden * b, gemms=dense_gemms,
        tensors=_tensors(m, dense_gemms), rows=shards.block_rows(m, moe=False), **common))  # type: ignore[arg-type]
    sequence = [0] * m.layers
    if m.moe is not None:
        e = m.moe
        gated = m.ffn == "swiglu"
        expert_tp, expert_rep = _mlp_params(h, e.expert_ffn_hidden, gated, m.bias)
        shared_tp, shared_rep = (_mlp_params(h, e.shared_ffn_hidden or e.expert_ffn_hidden, gated, m.bias)
                                 if e.shared_experts else (0.0, 0.0))
        shared_tp *= e.shared_experts
        shared_rep *= e.shared_experts
        router = h * e.experts
        ex_rep, ex_tp = _mlp_act(h, e.expert_ffn_hidden, gated, m.dropout, b)
        sh_rep, sh_tp = (_mlp_act(h, e.shared_ffn_hidden or e.expert_ffn_hidden, gated, m.dropout, b)
                         if e.shared_experts else (0.0, 0.0))
        mats = 3 if gated else 2
        # routing keeps, per token: the router's input; per routed copy, the expert's output (for
        # the gate's gradient) and the gated output (the index_add_ combine of Hugging Face's
        # Mixtral saves its source); int64 token/slot indices and fp32 + 16-bit gates, 32 B
        # (measured with FSDPMemTracker on autoplace.runtime.moe, autoplace.fidelity)
        routing = (1 + 2 * e.top_k) * b * h + 32 * e.top_k
        moe_gemms = (*attention, Gemm(e.experts, h), *_mlp_gemms(h, e.expert_ffn_hidden, gated, e.experts, e.top_k),
                     *(_mlp_gemms(h, e.shared_experts * (e.shared_ffn_hidden or e.expert_ffn_hidden), gated)
                       if e.shared_experts else ()))
        kinds.append(BlockKind(
            name="moe", params_tp=att_tp + shared_tp, params_rep=att_rep + norms + shared_rep + router,
            params_expert=e.experts * (expert_tp + expert_rep),
            flops=(att_flops + 2 * router + flops_score
                   + 2 * mats * h * (e.top_k * e.expert_ffn_hidden + e.shared_experts * (e.shared_ffn_hidden or e.expert_ffn_hidden))),
            act_rep=att_act_rep + norm_act + e.top_k * ex_rep + e.shared_experts * sh_rep + 4 * e.experts + routing,
            act_tp=att_act_tp + e.top_k * ex_tp + e.shared_experts * sh_tp,
            ep_alltoall=e.top_k * b * h, moe=True,
            act_fused=(e.top_k * _mlp_fused(e.expert_ffn_hidden, gated, b)
                       + e.shared_experts * _mlp_fused(e.shared_ffn_hidden or e.expert_ffn_hidden, gated, b)),
            act_glu=gated * b * (e.top_k * e.expert_ffn_hidden
                                 + e.shared_experts * (e.shared_ffn_hidden or e.expert_ffn_hidden)),
            gemms=moe_gemms, tensors=_tensors(m, moe_gemms), rows=shards.block_rows(m, moe=True), **common))  # type: ignore[arg-type]
        sequence = [1 if e.is_moe_layer(i) else 0 for i in range(m.layers)]
    kinds = [dataclasses.replace(k, order=_order(m, k)) for k in kinds]
    if m.training.frozen_base:
        kinds = [_tuned(m, k, b) for k in kinds]
    kinds, sequence = _windowed(m, kinds, sequence)
    used = sorted(set(sequence))  # drop kinds no block has (e.g. dense in an all-MoE model)
    kinds, sequence = [kinds[k] for k in used], [used.index(k) for k in sequence]
    if m.mtp_layers:
        kinds.append(_mtp_kind(m, kinds[sequence[-1]], b))
    return _finish(m, kinds, sequence, b)


def _mtp_kind(m: TransformerSpec, last: BlockKind, b: float) -> BlockKind:
    """One multi-token-prediction module (DeepSeek-V3 report, arXiv 2412.19437, Sec. 2.2; Megatron-Core
    0.16 ``multi_token_prediction.py``): RMSNorms of the hidden state and of the next token's embedding
    (hnorm, enorm), their concatenation projected 2h -> h (eh_proj, column-parallel), one block of the
    model's last kind, its final norm, and one more pass of the shared output layer and loss.  It is not
    a pipeline layer: Megatron-LM builds it on the stage holding the loss (:data:`LayerTable.mtp`).
    Its activations: both norms' inputs and stats, the projection's 2h input, the block's, and the head's
    (its final norm, the shared output layer and fp32 logits: :func:`_head`)."""
    h = m.hidden
    norm, stats = _norm_params(m), _norm_stats(m)
    eh_proj, head = Gemm(h, 2 * h, "n"), _head(m, b)
    return dataclasses.replace(
        last, name="mtp", params_tp=last.params_tp + eh_proj.n * eh_proj.k, params_rep=last.params_rep + 3 * norm,
        flops=last.flops + eh_proj.flops + head.flops, gemms=(*last.gemms, eh_proj, *head.gemms),
        act_rep=last.act_rep + 2 * (b * h + stats) + 2 * b * h + head.act_rep,
        act_tp=last.act_tp + head.act_tp, tp_allreduce=last.tp_allreduce + head.tp_allreduce,
        act_norm_upcast=last.act_norm_upcast + 2 * _norm_upcast(m, h) + head.act_norm_upcast,
        tensors=last.tensors + 4, rows=(*last.rows, Rows(h, 2 * h, "rows"), *[Rows(h, 1.0)] * 3),
        order=(*last.order, (2.0 * h * h, "tp"), *[(float(norm), "rep")] * 3))


def _tuned(m: TransformerSpec, k: BlockKind, b: float) -> BlockKind:
    """``k`` with a frozen base and LoRA adapters (:mod:`autoplace.cost.finetune`): which of its
    weights QLoRA stores in 4 bit (every linear layer's), the adapters' parameters, matmuls
    (``x A`` then ``(x A) B``) and the ``r``-wide ``x A`` each keeps for its backward."""
    rank = m.training.lora.rank
    projections = finetune.adapted_projections(m, k.moe)
    adapter_tp, adapter_rep, adapter_expert = finetune.adapter_params(m, k.moe)
    adapter_gemms = tuple(g for p in projections for r in (rank * p.rank_factor,)
                          for g in (Gemm(r, p.inp, "k" if p.split == "k" else "", p.experts, p.top_k),
                                    Gemm(p.out, r, "n" if p.split == "n" else "", p.experts, p.top_k)))
    linear = {"tp": 0.0, "rep": 0.0, "expert": 0.0}
    for g in k.gemms:
        linear["expert" if g.experts else ("tp" if g.split else "rep")] += g.n * g.k * (g.experts or 1)
    quantized = m.training.method == "qlora"
    return dataclasses.replace(
        k, adapter_tp=adapter_tp, adapter_rep=adapter_rep, adapter_expert=adapter_expert,
        quant_tp=linear["tp"] * quantized, quant_rep=linear["rep"] * quantized,
        quant_expert=linear["expert"] * quantized, frozen_flops=sum(g.flops for g in k.gemms),
        order=tuple(t for p in projections for t in p.adapter_tensors(rank)),  # PEFT: lora_A, then lora_B
        frozen_gemms=k.gemms, gemms=(*k.gemms, *adapter_gemms), flops=k.flops + sum(g.flops for g in adapter_gemms),
        act_rep=k.act_rep + sum(rank * p.rank_factor * (p.top_k or 1) for p in projections) * b,
        adapter_rows=shards.adapter_rows(m, k.moe))


def _windowed(m: TransformerSpec, kinds: list[BlockKind], sequence: list[int]) -> tuple[list[BlockKind], list[int]]:
    """Sliding-window layers as kinds of their own: with flash attention a windowed layer's core
    sees ``min(seq_len, window)`` keys per query (Mistral, Gemma, Phi-3); every
    ``full_attention_every``-th layer keeps the whole sequence.  Without flash attention the
    masked s x s scores are still computed and kept."""
    if m.sliding_window is None or not m.flash_attention or m.sliding_window >= m.seq_len:
        return kinds, sequence
    keys = m.sliding_window / m.seq_len
    windowed = [dataclasses.replace(k, name=f"{k.name}-window", flops=k.flops - k.flops_score * (1 - keys),
                                    flops_score=k.flops_score * keys) for k in kinds]
    every = m.full_attention_every
    full_layer = [every is not None and i % every == every - 1 for i in range(len(sequence))]
    return kinds + windowed, [k if full else k + len(kinds) for k, full in zip(sequence, full_layer, strict=True)]


def _finish(m: TransformerSpec, kinds: list[BlockKind], sequence: list[int], b: float) -> LayerTable:
    h, v, s = m.hidden, m.vocab, m.seq_len
    pos = (m.max_position or s) * h if m.position == "learned" else 0
    drop = 1.0 if m.dropout else 0.0
    # Embedding: vocab-parallel table (Megatron), one all-reduce of its output; the dropout
    # mask on its output is Korthikanti's "sbhp/t" extra term.
    emb_norm = (_norm_params(m), b * h + _norm_stats(m)) if m.embedding_norm else (0, 0.0)  # BLOOM's
    embed_tp, embed_rep = shards.embed_rows(m)
    embed = Edge(params_tp=v * h, params_rep=pos + emb_norm[0], flops=0.0, act_rep=drop * h + emb_norm[1], act_tp=0.0,
                 tp_allreduce=b * h, rows_tp=embed_tp, rows_rep=embed_rep)
    head = _head(m, b)
    counts = np.bincount(sequence, minlength=len(kinds))
    counts[-1] += m.mtp_layers  # the last kind is the modules' when there are any (0 adds nothing)
    params = sum(int(c) * k.params for c, k in zip(counts, kinds, strict=True))
    params += embed.params_tp + embed.params_rep + head.params_rep + (0 if m.tied_embeddings else head.params_tp)
    return LayerTable(name=m.name, kinds=tuple(kinds), sequence=tuple(sequence), embed=embed, head=head,
                      tied=m.tied_embeddings, hidden=h, seq_len=s, vocab=v, params=float(params), act_bytes=b,
                      frozen=m.training.frozen_base, paged_optimizer=m.training.paged_optimizer,
                      mtp=m.mtp_layers)


def _head(m: TransformerSpec, b: float) -> Edge:
    """The head: final norm, then the (possibly tied) output layer.  Korthikanti App. A counts the
    norm input 2sbh, the output-layer input 2sbh (bytes at 16 bit) and fp32 logits 4sbv (sharded by
    TP).  Under TP its backward all-reduces its input's gradient (bh bytes) and the vocab-parallel
    loss all-reduces three fp32 numbers per token (max, sum-exp, target).  Gemma 2's final soft-cap
    keeps tanh(z / cap) for backward: one more vocab-wide tensor."""
    h, v = m.hidden, m.vocab
    softcap = b * v if m.final_logit_softcap else 0.0
    head_tp, head_rep = shards.head_rows(m)
    return Edge(params_tp=v * h, params_rep=_norm_params(m), flops=2 * h * v,
                act_rep=2 * b * h + _norm_stats(m), act_tp=4 * v + softcap, tp_allreduce=b * h + 12,
                gemms=(Gemm(v, h, "n"),), act_norm_upcast=_norm_upcast(m, h), rows_tp=head_tp, rows_rep=head_rep)


def _graph_table(g: GraphSpec) -> LayerTable:
    """A layer graph: each entry is a kind; only what the user gave is known.

    Assumptions (documented in the README): a ``tp_shardable`` layer splits its parameters
    and activations over TP and all-reduces its output (Megatron's pair of matmuls); the
    block input kept under full recompute is ``hidden`` activations.
    """
    b = g.training.recipe().activation_bytes
    kinds, sequence = [], []
    for entry in g.graph:
        shard = entry.tp_shardable
        kinds.append(BlockKind(
            name=entry.name, params_tp=entry.params if shard else 0.0, params_rep=0.0 if shard else entry.params,
            params_expert=0.0, flops=entry.flops_per_token, flops_score=0.0,
            act_rep=0.0 if shard else entry.activation_bytes_per_token,
            act_tp=entry.activation_bytes_per_token if shard else 0.0, act_score=0.0,
            act_input=b * g.hidden, tp_allreduce=2 * b * g.hidden if shard else 0.0, ep_alltoall=0.0, cp_kv=0.0,
            # what is known of its matmuls is their FLOPs: one square matmul of that size
            gemms=(Gemm(np.sqrt(entry.flops_per_token / 2), np.sqrt(entry.flops_per_token / 2), "n" if shard else ""),)
            if entry.flops_per_token else ()))
        sequence.extend([len(kinds) - 1] * entry.repeat)
    empty = Edge(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    params = float(sum(e.params * e.repeat for e in g.graph))
    return LayerTable(name=g.name, kinds=tuple(kinds), sequence=tuple(sequence), embed=empty, head=empty,
                      tied=False, hidden=g.hidden, seq_len=g.seq_len, vocab=g.vocab, params=params, act_bytes=b)
