"""Fine-tuning with frozen base weights: LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023).

The base weights are a state with no gradient and no optimizer state; only the adapters train.
Per adapted projection ``W`` (``out x in``) LoRA adds ``B A`` with ``A`` (``r x in``) and ``B``
(``out x r``): ``r (in + out)`` trainable parameters (Hu et al. Sec. 4).  Under tensor
parallelism the adapter follows its projection: a column-parallel ``W`` splits ``B`` by rows
and keeps ``A`` whole; a row-parallel one splits ``A`` by columns and keeps ``B`` whole.

Storage of the frozen base: the precision recipe's weights (``param_bytes``: bf16 for the default
recipe, the dtype the train script loads the model in; fp32 shards under FSDP2's mixed precision)
and its all-gathers ``gather_bytes`` (:mod:`autoplace.cost.context`), or for QLoRA the linear layers' weights in
4-bit NormalFloat with double quantization (QLoRA Sec. 3): 4 bits per weight, one 8-bit absmax
per block of 64 weights and one fp32 constant per 256 of those blocks, ``8/64 + 32/(64*256)
= 0.127`` bits per weight of constants; embeddings, the LM head and norms stay in the compute
dtype (transformers keeps the output layer unquantized; bitsandbytes quantizes ``nn.Linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplace.specs.lora import PEFT_EXPERT_FAMILIES, adapted, role_modules
from autoplace.specs.model import TransformerSpec

NF4_BITS = 4.0
NF4_BLOCK = 64  # weights per first-level absmax (QLoRA Sec. 3, bitsandbytes' default blocksize)
NF4_BLOCK2 = 256  # first-level constants per second-level fp32 constant


def nf4_bytes_per_param(block: int = NF4_BLOCK, block2: int = NF4_BLOCK2) -> float:
    """Bytes per weight of NF4 with double quantization: 4 bits + 8/block + 32/(block*block2) bits."""
    return NF4_BITS / 8 + nf4_state_bytes_per_param(block, block2)


def nf4_state_bytes_per_param(block: int = NF4_BLOCK, block2: int = NF4_BLOCK2) -> float:
    """Bytes per weight of the quantization constants, 8/block + 32/(block*block2) bits: bitsandbytes keeps
    them in each ``Params4bit``'s ``quant_state`` (and its Linear4bit's), not in the packed parameter, so
    ZeRO-3 and FSDP2 partition the packed weights and every rank holds all of them (bitsandbytes
    nn/modules.py ``Params4bit._quantize``; measured by the DeepSpeed dry run)."""
    return (8 / block + 32 / (block * block2)) / 8


@dataclass(frozen=True)
class Projection:
    """One linear layer of a block: ``out x in`` weights, the dimension TP splits, its HF role."""

    role: str
    out: float
    inp: float
    split: str  # "n" column-parallel, "k" row-parallel, "" replicated across TP
    experts: int = 0  # a routed expert's projection: one adapter per expert
    top_k: int = 0
    rank_factor: int = 1  # PEFT doubles the rank of a fused gate_up expert adapter

    def adapter(self, rank: int) -> tuple[float, float, float]:
        """(TP-sharded, replicated, routed-expert) adapter parameters of rank ``rank``."""
        (a, a_split), (b, b_split) = self.adapter_tensors(rank)
        return tuple(a * (a_split == s) + b * (b_split == s) for s in ("tp", "rep", "expert"))  # type: ignore[return-value]

    def adapter_tensors(self, rank: int) -> tuple[tuple[float, str], tuple[float, str]]:
        """PEFT's ``lora_A`` then ``lora_B`` of rank ``rank`` as (elements, ``tp`` | ``rep`` | ``expert``): A
        follows a row-parallel projection's split input, B a column-parallel one's split output."""
        a, b = rank * self.rank_factor * self.inp, rank * self.rank_factor * self.out
        if self.experts:
            return (self.experts * a, "expert"), (self.experts * b, "expert")
        return (a, "tp" if self.split == "k" else "rep"), (b, "tp" if self.split == "n" else "rep")


def attention_projections(m: TransformerSpec) -> list[Projection]:
    """The attention projections of a block as the family's Hugging Face modules hold them (fused or not)."""
    h = m.hidden
    if m.attention is not None:  # DeepSeek MLA, the projections of layers._attention_gemms
        a = m.attention
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        query = ([Projection("q", a.q_lora_rank, h, ""), Projection("q", m.heads * qk, a.q_lora_rank, "n")]
             if a.q_lora_rank else [Projection("q", m.heads * qk, h, "n")])
        return [*query, Projection("k", a.kv_lora_rank + a.qk_rope_head_dim, h, ""),
                Projection("k", m.heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, "n"),
                Projection("o", h, m.heads * a.v_head_dim, "k")]
    q, kv = m.heads * m.dim_head, m.n_kv_heads * m.dim_head
    names = role_modules(m.family)
    fused = names["q"] == names["k"] == names["v"]
    qkv = ([Projection("q", q + 2 * kv, h, "n")] if fused else
           [Projection("q", q, h, "n"), Projection("k", kv, h, "n"), Projection("v", kv, h, "n")])
    return [*qkv, Projection("o", h, q, "k")]


def mlp_projections(m: TransformerSpec, f: float) -> list[Projection]:
    """An MLP of width ``f`` as the family's Hugging Face modules hold it (gate and up fused or not)."""
    h = m.hidden
    down = Projection("down", h, f, "k")
    if m.ffn != "swiglu":
        return [Projection("up", f, h, "n"), down]
    names = role_modules(m.family)
    if names.get("gate") == names.get("up"):
        return [Projection("up", 2 * f, h, "n"), down]
    return [Projection("gate", f, h, "n"), Projection("up", f, h, "n"), down]


def _routed(m: TransformerSpec) -> list[Projection]:
    """Routed experts as PEFT adapts them in :data:`~autoplace.specs.lora.PEFT_EXPERT_FAMILIES`."""
    e = m.moe
    if e is None:
        return []
    h, f = m.hidden, e.expert_ffn_hidden
    fused = len({"gate", "up"} & set(m.training.lora.targets))
    gate_up = [Projection("up", 2 * f, h, "n", e.experts, e.top_k, fused)] if fused else []
    return [*gate_up, Projection("down", h, f, "k", e.experts, e.top_k)]


def module_projections(m: TransformerSpec, moe: bool) -> tuple[list[Projection], list[Projection]]:
    """A block's linear modules as Hugging Face registers them: attention's, then the dense MLP's (a
    MoE block's shared experts, one MLP of their summed width; its router and routed experts are no
    Projection here)."""
    if not moe:
        return attention_projections(m), mlp_projections(m, m.ffn_hidden)
    e = m.moe
    shared = e.shared_experts * (e.shared_ffn_hidden or e.expert_ffn_hidden) if e is not None else 0
    return attention_projections(m), (mlp_projections(m, shared) if shared else [])


def block_projections(m: TransformerSpec, moe: bool) -> list[Projection]:
    """The projections LoRA can adapt in a block: attention's, and the dense MLP's (a MoE
    block's shared experts, one MLP of their summed width as Hugging Face builds it); in
    :data:`~autoplace.specs.lora.PEFT_EXPERT_FAMILIES` the MLP roles name the routed experts instead."""
    if m.family in PEFT_EXPERT_FAMILIES:
        return attention_projections(m) + (_routed(m) if moe else [])
    attention, mlp = module_projections(m, moe)
    return attention + mlp


def adapted_projections(m: TransformerSpec, moe: bool) -> list[Projection]:
    """The block's projections whose module the targets name (:mod:`autoplace.specs.lora`)."""
    targets = m.training.lora.targets
    return [p for p in block_projections(m, moe) if adapted(m.family, targets, p.role)]


def adapter_params(m: TransformerSpec, moe: bool) -> tuple[float, float, float]:
    """(TP-sharded, replicated, routed-expert) trainable adapter parameters of one block."""
    parts = [p.adapter(m.training.lora.rank) for p in adapted_projections(m, moe)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)



def rank_refusal(m: TransformerSpec) -> str | None:
    """Why ``m``'s LoRA rank is too large for a projection it adapts, or None.

    ``B A`` of rank ``r`` on a ``d_in -> d_out`` projection has rank at most ``min(d_in, d_out)``
    (Hu et al. 2021, Sec. 4.1: ``r << min(d, k)``); a larger ``r`` adds parameters and
    optimizer state that cannot change what the adapter learns.  The projection with the
    smallest side among those adapted (in any kind of block the model has) is named.
    """
    if not m.training.frozen_base:
        return None
    kinds = {m.moe.is_moe_layer(i) for i in range(m.layers)} if m.moe is not None else {False}
    # the largest rank each projection takes: PEFT's fused gate_up expert adapter has rank_factor x r
    limits = [(min(p.out, p.inp) // p.rank_factor, p) for moe in sorted(kinds) for p in adapted_projections(m, moe)]
    if not limits:
        return None
    limit, p = min(limits, key=lambda pair: pair[0])
    rank = m.training.lora.rank
    if rank <= limit:
        return None
    fused = f" (PEFT gives its fused experts rank {p.rank_factor}r)" if p.rank_factor > 1 else ""
    return (f"rank {rank} exceeds the {p.role} projection, {int(p.inp)} -> {int(p.out)} features{fused}: an adapter "
            f"of rank r on a d_in x d_out projection needs r <= min(d_in, d_out); valid: 1 to {int(limit)} with "
            f"these targets ({','.join(m.training.lora.targets)})")
