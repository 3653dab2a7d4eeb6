"""Bytes on the wire per parameter under each compression option, and PowerSGD's compressed
sizes (:mod:`autoplace.compression` holds the facts; ``terms_time`` / ``terms_memory`` use these).

ZeRO++ (Wang et al. 2023, arXiv 2306.10209): qwZ all-gathers weights block-quantized to int8 (half of
bf16), hpZ keeps a secondary bf16 shard inside each node so backward's gathers never leave it,
and qgZ reduce-scatters gradients in int4 (a quarter of bf16) by hierarchical all-to-all; the
per-block scales (one fp32 per 2,048-element block in DeepSpeed) add 0.2% and are not counted.
PowerSGD (Vogels et al. 2019, Alg. 1; PyTorch's ``powerSGD_hook``): each weight matrix
``n x m`` travels as ``P`` (``n x r``) and ``Q`` (``m x r``), two all-reduces; a matrix whose
factors are not ``min_compression_rate`` (2) times smaller, and every vector, goes uncompressed.
The hook compresses parameter tensors, so a matmul the layer table fuses for its FLOPs is split
back into the weights a Llama-style model holds (:func:`weight_matrices`): Q, K and V, and a
gated MLP's gate and up projections, are separate matrices (Hugging Face Llama, torchtitan and
autoplace's runtime), each with factors of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autoplace.cost.candidates import Candidates
from autoplace.cost.layers import Gemm, LayerTable
from autoplace.plan import COMPRESS
from autoplace.specs.model import Precision

Array = np.ndarray
QWZ_BYTES = 1.0  # int8 weights (ZeRO++ qwZ)
QGZ_BYTES = 0.5  # int4 gradients (ZeRO++ qgZ)
POWERSGD_MIN_COMPRESSION = 2.0  # PowerSGDState(min_compression_rate=2), PyTorch's default


@dataclass(frozen=True)
class Wire:
    """Per candidate ``[C]``: bytes per element of each kind of collective, and which options are on."""

    gather_fwd: Array  # forward (ZeRO-3) and post-step (ZeRO-1/2) parameter all-gathers
    gather_bwd: Array  # ZeRO-3's backward re-gathers
    reduce: Array  # gradient reduce-scatters and all-reduces
    zeropp: Array  # bool: ZeRO++ (hpZ: backward gathers within the NVLink domain)
    rank: Array  # PowerSGD rank (0: off)


def wire(recipe: Precision, cand: Candidates) -> Wire:
    """The wire format of every candidate under its ``compress`` option."""
    code = cand.compress
    zeropp = code == COMPRESS.index("zeropp")
    bf16 = code == COMPRESS.index("bf16")
    pgb, rgb = recipe.gather_bytes, recipe.reduce_bytes
    ones = np.ones(code.shape)
    return Wire(gather_fwd=np.where(zeropp, QWZ_BYTES, pgb), gather_bwd=pgb * ones,
                reduce=np.where(bf16, min(rgb, 2.0), np.where(zeropp, QGZ_BYTES, rgb)),
                zeropp=zeropp, rank=cand.powersgd_rank.astype(float))


def powersgd_elements(n: Array | float, m: Array | float, rank: Array) -> Array:
    """Elements one ``n x m`` gradient matrix sends under PowerSGD of ``rank`` (0: uncompressed).

    As PyTorch's hook: the rank is capped at ``min(n, m)`` and a matrix is compressed only when
    its factors are strictly more than ``min_compression_rate`` times smaller."""
    n, m = np.asarray(n, dtype=float), np.asarray(m, dtype=float)
    r = np.minimum(rank, np.minimum(n, m))
    factors = r * (n + m)
    full = n * m
    compressed = (rank > 0) & (full > POWERSGD_MIN_COMPRESSION * factors)
    return np.where(compressed, factors, full)


def weight_matrices(gemms: tuple[Gemm, ...]) -> list[Gemm]:
    """The weight matrices behind a block's matmuls: the layer table's fused ones split apart.

    The table (:func:`autoplace.cost.layers._attention_gemms`, ``_mlp_gemms``) fuses QKV into one
    ``(q + 2 kv) x h`` matmul followed by the row-parallel output ``h x q``, and a gated MLP's gate
    and up into one ``2 f x h`` matmul followed by the down projection ``h x f``.  Recognised by
    position and shape: the attention pair opens the block (MLA's projections do not fit the
    pattern and stay as they are); a later column/row pair whose first width is twice the second's
    reduction is a gated MLP (dense or shared experts).  Everything else is one matrix as is.
    """
    out: list[Gemm] = []
    i = 0
    while i < len(gemms):
        g = gemms[i]
        nxt = gemms[i + 1] if i + 1 < len(gemms) else None
        pair = nxt is not None and g.split == "n" and nxt.split == "k" and g.k == nxt.n and g.experts == nxt.experts
        if pair and i == 0 and nxt is not None and g.n > nxt.k:  # fused QKV, then the output projection
            q, kv = nxt.k, (g.n - nxt.k) / 2
            out += [replace(g, n=q), replace(g, n=kv), replace(g, n=kv), nxt]
            i += 2
        elif pair and i > 0 and nxt is not None and g.n == 2 * nxt.k:  # gate and up, then down
            out += [replace(g, n=nxt.k), replace(g, n=nxt.k), nxt]
            i += 2
        else:
            out.append(g)
            i += 1
    return out


def block_reduce_elements(table: LayerTable, cand: Candidates, dense_local: Array) -> Array:
    """Gradient elements each block's dense parameters reduce per step on one device ``[C, K]``:
    ``dense_local`` itself, less what PowerSGD saves on the block's weight matrices."""
    return dense_local[:, 0, :, 0] - _saved(table, cand, cand.powersgd_rank, routed=False)


def expert_reduce_elements(table: LayerTable, cand: Candidates, exp_local: Array) -> Array:
    """Gradient elements each block's routed experts reduce per step on one device ``[C, K]``.

    With ep = 1 the experts are ordinary parameters of the DDP model, so PowerSGD compresses each
    expert's matrices like the dense ones (``exp_local`` less the savings of all ``experts`` of
    them); with ep > 1 the runtime reduces them over their own (edp) group by hand, outside the
    hook, uncompressed (``exp_local`` itself).
    """
    rank = np.where(cand.ep == 1, cand.powersgd_rank, 0)
    return exp_local[:, 0, :, 0] - _saved(table, cand, rank, routed=True)


def _saved(table: LayerTable, cand: Candidates, rank: Array, *, routed: bool) -> Array:
    """Elements PowerSGD of ``rank`` saves per block on one device ``[C, K]``: on the dense weight
    matrices, or (``routed``) on every routed expert's."""
    tp = cand.tp.astype(float)
    rank = np.asarray(rank, dtype=float)
    out = []
    for kind in table.kinds:
        saved = np.zeros(cand.size)
        for g in weight_matrices(kind.gemms):
            if bool(g.experts) == routed:
                n, m = _local(g, tp)
                saved += (g.experts or 1) * (n * m - powersgd_elements(n, m, rank))
        out.append(saved)
    return np.stack(out, axis=-1)


def edge_reduce_elements(table: LayerTable, cand: Candidates, edge_dense: Array, first: Array, last: Array) -> Array:
    """The same for the embedding and head on each stage ``[C, S]``: each one ``vocab/tp x hidden``
    matrix (a tied head on a one-stage pipeline is the embedding's), and a learned position table
    (the embedding's replicated ``positions x hidden`` parameters, GPT-2's ``wpe``) one more.

    An embedding norm is counted among those rows: its one or two hidden-wide vectors are never
    worth compressing alone, and beside a position table they add at most 2 rows to its factors.
    """
    tp = cand.tp.astype(float)
    rank = cand.powersgd_rank.astype(float)[:, None]
    rows = (table.vocab / tp)[:, None]
    full = rows * table.hidden
    saved = full - powersgd_elements(rows, float(table.hidden), rank)
    positions = table.embed.params_rep / max(table.hidden, 1)
    saved_pos = table.embed.params_rep - powersgd_elements(positions, float(table.hidden), rank)
    head = np.where(((cand.pp == 1) & table.tied)[:, None], 0.0, 1.0) * (table.head.params_tp > 0)
    has = first * (table.embed.params_tp > 0) + last * head
    return edge_dense - has * saved - first * saved_pos


def _local(g: Gemm, tp: Array) -> tuple[Array, Array]:
    """The weight's (n, k) on one device after tensor parallelism."""
    n = g.n / tp if g.split == "n" else g.n * np.ones_like(tp)
    k = g.k / tp if g.split == "k" else g.k * np.ones_like(tp)
    return n, k
