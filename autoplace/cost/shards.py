"""Parameter tensors as FSDP2 shards them, and the padding its per-tensor chunks add.

FSDP2 (``fully_shard``, torch 2.13) shards every parameter on its own: dim 0 of the rank's tensor
(after tensor parallelism) is cut with ``torch.chunk`` into chunks of ``ceil(rows / N)`` rows for a
shard group of ``N`` ranks, and every rank stores a full chunk: ``_chunk_with_empty`` and
``FSDPParam.padded_sharded_param_size`` ("0th always padded") in
torch/distributed/fsdp/_fully_shard/_fsdp_param.py.  A tensor of ``r`` rows of ``e`` elements thus
takes ``ceil(r / N) * e`` elements on each rank, not ``r * e / N``; its gradient's reduce-scatter output
and Adam's moments on rank 0 are that size, and its all-gather output (the unsharded copy) holds
``N`` padded chunks.  Llama-3.1-405B's K and V projections have 128 rows at tp=8: sharded 2,048 ways
each rank holds one row, 16 times its share.

DeepSpeed's ZeRO (stage 3 pads each flattened parameter to a multiple of the world,
``Init._padding_size`` in deepspeed/runtime/zero/partition_parameters.py; stages 1-2 pad the flat
group) and Megatron's distributed optimizer and Megatron-FSDP (flat buckets padded to a multiple of
the data-parallel size, ``_pad`` in megatron_fsdp/param_and_grad_buffer.py) pad fewer than ``N``
elements per tensor or bucket: nothing the cost model counts.  :func:`dim0_padding` is applied where a
framework's behaviour says its shards are FSDP2's (``Assumptions.fsdp2_dim0_padding``).

The tensors are laid out as the Hugging Face models (transformers 5) and torchtitan's hold them:
separate (or, in the families that fuse them, fused) projections, their biases, norm scales, the
router, and the routed experts stacked in one tensor per projection with the experts on dim 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoplace.cost import finetune
from autoplace.specs.model import TransformerSpec

Array = np.ndarray
# transformers' Conv1D stores its weight as (in, out): dim 0 is the input width (GPT-2)
TRANSPOSED_FAMILIES = frozenset({"gpt2"})


@dataclass(frozen=True)
class Rows:
    """One parameter tensor as FSDP2 cuts it: ``rows`` along dim 0 of ``elems`` elements each.

    Attributes:
        rows, elems: dim 0 and the product of the other dims, before tensor and expert parallelism.
        split: what tensor parallelism divides: ``"rows"`` (a column-parallel weight or bias, a
            vocabulary-parallel embedding or head), ``"elems"`` (a row-parallel weight; an expert's
            width) or ``""`` (replicated).
        expert: a routed expert's tensor, sharded over the expert shard group (``ezero``).
        stacked: the experts themselves are dim 0, which expert parallelism divides.
        linear: a linear layer's weight (QLoRA stores it in 4 bit, packed flat: no rows to pad).
    """

    rows: float
    elems: float
    split: str = ""
    expert: bool = False
    stacked: bool = False
    linear: bool = False


def _projection(p: finetune.Projection, transposed: bool, bias: bool) -> list[Rows]:
    """A linear layer's weight (``out x in``, or ``in x out`` when ``transposed``) and its bias."""
    split = {"n": "rows", "k": "elems"}.get(p.split, "")
    if transposed:
        weight = Rows(p.inp, p.out, {"rows": "elems", "elems": "rows"}.get(split, ""), linear=True)
    else:
        weight = Rows(p.out, p.inp, split, linear=True)
    return [weight] + ([Rows(p.out, 1.0, "rows" if p.split == "n" else "")] if bias else [])


def _norms(m: TransformerSpec) -> list[Rows]:
    """The block's norm scales (and shifts): hidden-wide norms, q/k norms, MLA's latent norms."""
    per = 2 if m.norm == "layernorm" else 1
    out = [Rows(m.hidden, 1.0)] * (m.block_norms * per)
    if m.qk_norm == "head":
        out += [Rows(m.dim_head, 1.0)] * 2
    elif m.qk_norm == "layer":
        out += [Rows(m.heads * m.dim_head, 1.0), Rows(m.n_kv_heads * m.dim_head, 1.0)]
    a = m.attention
    if a is not None:
        out += [Rows(a.kv_lora_rank, 1.0)] + ([Rows(a.q_lora_rank, 1.0)] if a.q_lora_rank else [])
    return out


def block_rows(m: TransformerSpec, moe: bool) -> tuple[Rows, ...]:
    """Every parameter tensor of one block (a MoE block's when ``moe``), as :class:`Rows`."""
    transposed = m.family in TRANSPOSED_FAMILIES
    attention = finetune.attention_projections(m)
    plain = m.attention is None  # MLA's projections have no biases
    out = [r for p in attention
           for r in _projection(p, transposed, plain and (m.qkv_bias if p.role in "qkv" else m.bias))]
    e = m.moe
    if not moe or e is None:
        mlp = finetune.mlp_projections(m, m.ffn_hidden)
        return (*out, *(r for p in mlp for r in _projection(p, transposed, m.bias)), *_norms(m))
    shared = e.shared_experts * (e.shared_ffn_hidden or e.expert_ffn_hidden)
    mlp = finetune.mlp_projections(m, shared) if shared else []
    out += [r for p in mlp for r in _projection(p, transposed, m.bias)]
    mats = 3 if m.ffn == "swiglu" else 2
    per_expert = mats * m.hidden * e.expert_ffn_hidden + ((mats - 1) * e.expert_ffn_hidden + m.hidden if m.bias else 0)
    # the router (replicated across TP), then the routed experts: one stacked tensor per projection,
    # merged here into one (they share dim 0, the experts, so they pad alike)
    out += [Rows(e.experts, m.hidden, linear=True),
            Rows(e.experts, per_expert, "elems", expert=True, stacked=True, linear=True)]
    return (*out, *_norms(m))


def adapter_rows(m: TransformerSpec, moe: bool) -> tuple[Rows, ...]:
    """LoRA's trainable tensors of one block: per adapted projection ``A`` (``r x in``) and ``B``
    (``out x r``), as PEFT 0.21 builds them (``lora.Linear``; a 3-D expert parameter's ``ParamWrapper``
    stacks the experts' ranks: ``A`` is ``r*E x in``, ``B`` ``out x r*E``).  Tensor parallelism follows
    the projection (:mod:`autoplace.cost.finetune`): a column-parallel one splits ``B``'s rows, a
    row-parallel one ``A``'s columns."""
    rank = m.training.lora.rank
    out: list[Rows] = []
    for p in finetune.adapted_projections(m, moe):
        r = rank * p.rank_factor * max(p.experts, 1)
        expert = p.experts > 0
        out += [Rows(r, p.inp, "elems" if p.split == "k" else "", expert=expert),
                Rows(p.out, r, "rows" if p.split == "n" else "", expert=expert)]
    return tuple(out)


def embed_rows(m: TransformerSpec) -> tuple[tuple[Rows, ...], tuple[Rows, ...]]:
    """The embedding: (its vocabulary-parallel table, the rest: learned positions, BLOOM's embedding norm)."""
    rest = [Rows(m.max_position or m.seq_len, m.hidden)] if m.position == "learned" else []
    if m.embedding_norm:
        rest += [Rows(m.hidden, 1.0)] * (2 if m.norm == "layernorm" else 1)
    return (Rows(m.vocab, m.hidden, "rows"),), tuple(rest)


def head_rows(m: TransformerSpec) -> tuple[tuple[Rows, ...], tuple[Rows, ...]]:
    """The head: (its vocabulary-parallel output layer, the final norm); the output layer is the
    embedding's table when they are tied."""
    return (Rows(m.vocab, m.hidden, "rows"),), (Rows(m.hidden, 1.0),) * (2 if m.norm == "layernorm" else 1)


@dataclass(frozen=True)
class RowTable:
    """Tensors of several groups (block kinds), padded to one width ``T`` with empty tensors: each
    field ``[G, T]``."""

    rows: Array
    elems: Array
    rows_tp: Array  # tensor parallelism divides dim 0
    elems_tp: Array  # tensor parallelism divides the rest
    expert: Array
    stacked: Array


def row_table(groups: Sequence[Sequence[Rows]]) -> RowTable:
    """The tensors of ``groups`` as ``[G, T]`` arrays (an empty tensor pads nothing)."""
    width = max((len(g) for g in groups), default=0)

    def field(get: Callable[[Rows], float]) -> Array:
        return np.array([[get(r) for r in g] + [0.0] * (width - len(g)) for g in groups], dtype=float)

    return RowTable(rows=field(lambda r: r.rows), elems=field(lambda r: r.elems),
                    rows_tp=field(lambda r: r.split == "rows") > 0, elems_tp=field(lambda r: r.split == "elems") > 0,
                    expert=field(lambda r: r.expert) > 0, stacked=field(lambda r: r.stacked) > 0)


def dim0_padding(table: RowTable, tp: Array, ep: Array, shards: Array, expert_shards: Array) -> Array:
    """Elements FSDP2's dim-0 chunks add to each group's tensors on one rank's model, before sharding
    ``[C, G]``: per tensor ``(ceil(r / N) * N - r) * e`` with ``r`` its rows and ``e`` its elements per row
    on the rank (after TP and EP), ``N`` its shard group; a rank's shard is ``(params + padding) / N``.

    Stacked experts spread over more ranks than there are experts (expert shard group x EP) are
    sharded on dim 1 instead, evenly: torchtitan 0.2.2's ``apply_fsdp`` gives them ``Shard(1)`` when
    ``efsdp * ep > num_experts`` (models/llama4/infra/parallelize.py), the only FSDP2 framework with EP.

    Args:
        table: the tensors (:func:`row_table`).
        tp, ep, shards, expert_shards: each candidate's TP and EP degrees and the ranks of its dense
            and expert shard groups ``[C]``.
    """
    tp, ep = (np.asarray(x, dtype=float)[:, None, None] for x in (tp, ep))
    n = np.where(table.expert, np.asarray(expert_shards, dtype=float)[:, None, None],
                 np.asarray(shards, dtype=float)[:, None, None])  # [C, G, T]
    rows = table.rows / np.where(table.rows_tp, tp, 1.0) / np.where(table.stacked, ep, 1.0)
    elems = table.elems / np.where(table.elems_tp, tp, 1.0)
    even = table.stacked & (ep > 1) & (n * ep > table.rows)
    pad = np.where(even | (n <= 1), 0.0, (np.ceil(rows / n) * n - rows) * elems)  # a group of one stores it whole
    return pad.sum(axis=-1)
