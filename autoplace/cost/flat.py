"""ZeRO-1/2 as DeepSpeed partitions it: one flat buffer of every trainable parameter, cut in equal parts.

DeepSpeed 0.19's ``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py ``__init__``) flattens each
parameter group into one buffer, padded to a multiple of 2 x dp elements, and gives data-parallel rank r
the r-th of dp equal parts wherever their ends fall (``get_data_parallel_partitions``).
``get_partition_info`` lists every parameter overlapping a part; a ZeRO-2 rank copies those parameters'
gradients *whole* into its ``grads_in_partition`` (``copy_grads_in_partition``), so the rank whose part
overlaps most -- one lying in a large embedding, or one cut by a large tensor at each end -- holds more
than its 1/dp share.  With the optimizer offloaded, DeepSpeed stages the largest parameter's gradient on
the device and the host (``temp_grad_buffer_for_gpu_offload`` / ``_cpu_offload``).

The parameters are the model's trainable tensors in the order Hugging Face registers them (the
embedding, each block's :attr:`~autoplace.cost.layers.BlockKind.order`, the final norm, an untied head),
as one group -- the script's ``AdamW(model.parameters())``.  Experts under expert parallelism (AutoEP)
form a group of their own over the expert-data-parallel ranks.  Only a whole model (one pipeline stage)
is laid out: DeepSpeed's pipeline engine runs ZeRO-1 at most, whose gradients are whole.
"""

from __future__ import annotations

import numpy as np

from autoplace.cost.context import Context
from autoplace.cost.layers import BlockKind, LayerTable

Array = np.ndarray
ALIGN = 2  # stage_1_and_2.py nccl_start_alignment_factor: the buffer is a multiple of 2 x dp elements


def kind_order(kind: BlockKind) -> tuple[tuple[float, str], ...]:
    """A block's trainable tensors in order as (elements, ``tp`` | ``rep`` | ``expert``): its declared
    :attr:`~autoplace.cost.layers.BlockKind.order`, or (a layer graph's) one tensor per part."""
    if kind.order:
        return kind.order
    parts = ((kind.params_tp, "tp"), (kind.params_rep, "rep"), (kind.params_expert, "expert"))
    return tuple(p for p in parts if p[0] > 0)


def on_device(n: float, split: str, tp: int, ep: int) -> float:
    """Elements of a tensor of ``n`` on one device: TP splits ``tp`` tensors, EP and TP routed experts'."""
    return n / tp if split == "tp" else n / (ep * tp) if split == "expert" else n


def tensors(table: LayerTable, tp: int, ep: int) -> tuple[Array, Array]:
    """The trainable tensors one device of a whole-model stage holds, in order, as elements: the
    dense group, and the routed experts' group when ``ep`` > 1 (else they stay in the dense one)."""
    order: list[tuple[float, str]] = []
    if not table.frozen:  # a frozen base's embedding and head do not train
        order += [(table.embed.params_tp, "tp"), (table.embed.params_rep, "rep")]
    for k in table.sequence:
        order += kind_order(table.kinds[k])
    if not table.frozen:
        order += [(table.head.params_rep, "rep")] + ([] if table.tied else [(table.head.params_tp, "tp")])
    dense = [on_device(n, s, tp, ep) for n, s in order if n > 0 and (s != "expert" or ep == 1)]
    expert = [on_device(n, s, tp, ep) for n, s in order if n > 0 and s == "expert" and ep > 1]
    return np.array(dense, dtype=float), np.array(expert, dtype=float)


def most_overlapped(sizes: Array, parts: int) -> float:
    """The most elements the tensors overlapping one of ``parts`` equal parts of their flat buffer hold
    (``get_partition_info``: a tensor starting in the part, or running into it)."""
    if sizes.size == 0:
        return 0.0
    ends = np.cumsum(sizes)
    starts, total = ends - sizes, ends[-1]
    size = np.ceil(total / (ALIGN * parts)) * ALIGN  # each part, the buffer padded to ALIGN x parts
    lo = np.arange(parts) * size
    lo = lo[lo < total]  # parts of padding alone hold nothing
    hi = np.minimum(lo + size, total) - 1
    first, last = np.searchsorted(ends, lo, side="right"), np.searchsorted(ends, hi, side="right")
    return float((ends[last] - starts[first]).max())


_CACHE: dict[tuple[int, int, int, int, int], tuple[LayerTable, float]] = {}
CACHE_LIMIT = 4096  # layouts remembered (a search meets a few dozen per model); emptied when full


def excess(table: LayerTable, tp: int, ep: int, parts: int, expert_parts: int) -> float:
    """Elements the fullest rank's parameters overlapping its parts hold beyond its even share (the
    dense group over ``parts`` ranks, the experts' over ``expert_parts``), cached per layout."""
    key = (id(table), tp, ep, parts, expert_parts)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not table:
        dense, expert = tensors(table, tp, ep)
        more = (most_overlapped(dense, parts) - dense.sum() / parts
                + (most_overlapped(expert, expert_parts) - expert.sum() / expert_parts if expert.size else 0.0))
        if len(_CACHE) >= CACHE_LIMIT:  # each entry holds its table alive: keep a long process's bounded
            _CACHE.clear()
        hit = _CACHE[key] = (table, max(more, 0.0))
    return hit[1]


def largest(table: LayerTable, tp: int, ep: int) -> tuple[float, float, float]:
    """The largest trainable tensor on one device, in elements: among the blocks (every kind: the search
    moves the split), in the embedding, in the final norm and head (a tied head lives on the first stage)."""
    blocks = max((on_device(n, s, tp, ep) for k in set(table.sequence) for n, s in kind_order(table.kinds[k])),
                 default=0.0)
    if table.frozen:
        return blocks, 0.0, 0.0
    return (blocks, max(table.embed.params_tp / tp, table.embed.params_rep),
            max(table.head.params_rep, table.head.params_tp / tp))


def flat_terms(ctx: Context) -> tuple[Array, Array, Array]:
    """Bytes the flat partitions add per stage ``[C, S]`` under ``Assumptions.zero12_flat_partitions``:
    the fullest rank's ZeRO-2 gradients beyond its share (``grads_in_partition``), and with the optimizer
    offloaded at ZeRO-1/2 the largest parameter's 16-bit gradient staged on the device and on the host
    (``temp_grad_buffer_for_gpu_offload``, ``_cpu_offload``): (gradients, device buffers, host)."""
    c, table = ctx.cand, ctx.table
    zeros = np.zeros((ctx.C, ctx.S))
    if not ctx.assume.zero12_flat_partitions:
        return zeros, zeros, zeros
    whole = (c.zero == 2) & (c.pp == 1) & ~c.off_opt  # offloaded, ZeRO-2 reduces each part to the host
    layouts = np.stack([c.tp, c.ep, ctx.size["zero"], ctx.size["ezero"]], axis=1).astype(int)
    grads = np.zeros(ctx.C)
    if whole.any():
        keys, at = np.unique(layouts[whole], axis=0, return_inverse=True)
        grads[whole] = np.array([excess(table, *map(int, key)) for key in keys])[at.ravel()]
    offloaded = c.off_opt & (c.zero >= 1) & (c.zero <= 2)
    staged = zeros.copy()
    if offloaded.any():
        keys, at = np.unique(layouts[offloaded][:, :2], axis=0, return_inverse=True)
        sizes = np.array([largest(table, int(tp), int(ep)) for tp, ep in keys])[at.ravel()]  # [n, 3]
        first, last = ctx.first[0], ctx.last[offloaded]
        staged[offloaded] = np.maximum(sizes[:, :1], np.maximum(first * sizes[:, 1:2], last * sizes[:, 2:3]))
    pb = ctx.recipe.param_bytes  # DeepSpeed's 16-bit dtype: the weights'
    return ctx.first * (grads * ctx.recipe.grad_bytes)[:, None], staged * pb, staged * pb
