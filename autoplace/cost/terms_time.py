"""Time and byte coefficient tables: seconds per micro-batch per block and per stage, the
once-per-step tail, and the bytes every collective moves.

Each collective's exposed time is computed from the compute it can hide under, mechanism by
mechanism (:mod:`autoplace.cost.step` has the two formulas):

* tensor parallelism: exposed, unless a comm-overlap mode runs it (torchtitan's async TP,
  Megatron's ``--tp-comm-overlap``: the plan's ``tp_overlap``), which pipelines each all-gather and
  reduce-scatter with the TP matmuls beside it; expert parallelism: exposed;
* ZeRO-3 / FSDP2: each block's all-gather is prefetched under the previous block's forward,
  and in backward the next gather plus this block's reduce-scatter run under its backward;
  the first gather and the last reduce-scatter of every micro-batch have nothing to hide
  under, nor has the root unit's (FSDP2 gathers it at the start, reduces it at the end);
* ZeRO-2: each micro-batch's reduce-scatter runs under that block's backward;
* DDP / ZeRO-1 (and HSDP's replica all-reduce): bucketed reduction under the last
  micro-batch's backward, the last bucket exposed; ZeRO-1/2's parameter all-gather after the
  optimizer step is exposed;
* context parallelism: each ring step's K/V transfer hides under that step's attention chunk;
* pipeline sends: exposed (warm-up and cool-down have nothing to hide them);
* offloaded parameters: PCIe copies (copy engines, no SM contention) under the block's compute;
  an offloaded optimizer: CPU Adam on the host, shared by the node's GPUs, after backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from autoplace.cost import comm, compress
from autoplace.cost.assumptions import Assumptions
from autoplace.cost.candidates import Candidates
from autoplace.cost.compute import FP8_CASTS, FP8_DEFAULT_RECIPE, Kernels, fp8_cast_bytes, gemms_forward
from autoplace.cost.context import Context
from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import SCHEDULE_CODES
from autoplace.cost.step import hidden
from autoplace.plan import FP8, OFFLOAD
from autoplace.specs.model import Precision

Array = np.ndarray
MB_PARTS = ("compute", "tp", "ep", "cp", "pp", "zero", "offload")
COMM_PARTS = ("dp", "tp", "pp", "cp", "ep", "offload")


@dataclass(frozen=True)
class BlockCompute:
    """Compute seconds of one block per micro-batch on each stage ``[C, S, K]`` (backward and
    total per recompute mode ``[C, S, K, 3]``)."""

    forward: Array
    backward: Array  # recompute included
    attn_forward: Array
    attn_backward: Array
    gemm_forward: Array  # the matmuls alone (what tensor-parallel comm can overlap with)

    @property
    def total(self) -> Array:
        return self.forward[..., None] + self.backward


@dataclass(frozen=True)
class TimeTerms:
    t_block: Array  # [C, S, K, R, 7] seconds per micro-batch by MB_PARTS
    t_static: Array  # [C, S, 7]
    reduce_block: Array  # [C, S, K] seconds of the once-per-step gradient reduction
    reduce_static: Array  # [C, S]
    window_block: Array  # [C, S, K] backward seconds (no recompute) the reduction hides under
    window_static: Array  # [C, S]
    last_bucket: Array  # [C, S] seconds of the reduction's last bucket
    gather_block: Array  # [C, S, K] seconds of the once-per-step parameter gather
    gather_static: Array  # [C, S]
    opt_block: Array  # [C, S, K] optimizer step seconds
    opt_static: Array  # [C, S]
    bytes_block: Array  # [C, 1, K, R, 6] bytes sent per step by COMM_PARTS
    bytes_static: Array  # [C, S, 6]


def block_compute(ctx: Context, act_none: Array) -> BlockCompute:
    """Per-block compute by kernel class (:mod:`autoplace.cost.compute`).

    Args:
        act_none: activation bytes a block keeps with no recompute ``[C, 1, K]``; the
            memory-bound kernels stream about that much per pass.
    """
    c, table, assume = ctx.cand, ctx.table, ctx.assume
    tp, ep = c.tp.astype(float)[:, None], c.ep.astype(float)[:, None]
    tokens = ctx.tokens[:, None]
    elem = gemm_operand_bytes(ctx.recipe)
    seq = np.full_like(tokens, float(table.seq_len))
    seq_local = seq / c.cp[:, None]
    recipe = fp8_recipe(ctx)[:, None]  # index into plan.FP8, 0 for 16-bit GEMMs
    fp8 = recipe > 0
    casts = FP8_CASTS[assume.fp8_casts]
    per_operand = [np.array([0.0, *(casts[r][i] for r in FP8[1:])])[recipe] for i in range(4)]
    # torchao's rowwise forward GEMM runs CUTLASS's rowwise kernel (Assumptions.fp8_rowwise_gemm_time)
    slower = np.where(recipe == FP8.index("rowwise"), assume.fp8_rowwise_gemm_time, 1.0)
    if assume.fp8_casts == "transformer_engine":  # Megatron-Core's TE layers cache the weight's fp8 copies
        per_operand[1] = per_operand[1] / c.ga[:, None]  # on a step's first micro-batch (is_first_microbatch)

    def per_kind(kern: Kernels, kern8: Kernels) -> tuple[Array, ...]:
        fwd, afwd, abwd, gemms, frozen, cast_f, cast_b = [], [], [], [], [], [], []
        for k in table.kinds:
            frozen.append(gemms_forward(kern, k.frozen_gemms, tokens, tp, ep, elem))
            gemm = gemms_forward(kern, k.gemms, tokens, tp, ep, elem)
            forward_bytes = backward_bytes = faster_backward = np.zeros_like(gemm)
            if fp8.any():  # e4m3/e5m2 operands, a bf16 output; backward's two GEMMs at the plain rate
                gemm8 = gemms_forward(kern8, k.gemms, tokens, tp, ep, 1.0, out_bytes=2.0)
                gemm = np.where(fp8, gemm8 * slower, gemm)
                faster_backward = np.where(fp8, 2 * gemm8 * (slower - 1), 0.0)
                forward_bytes, backward_bytes = fp8_cast_bytes(k.gemms, tokens, tp, ep, tuple(per_operand))
            score = tokens * k.flops_score / tp  # full (unmasked) forward FLOPs of the attention core
            if k.flash:
                a_f, a_b = kern.attention(score, seq_local, head_dim=k.head_dim, kernel=assume.attention_kernel)
            else:  # QK^T and PV as batched GEMMs per head (their softmax streams with the activations)
                heads = k.flops_score / (4 * table.seq_len * k.head_dim) / tp * c.mbs[:, None]
                a_f = heads * (kern.gemm(seq_local, seq, k.head_dim, elem, k_share=False)
                               + kern.gemm(seq_local, k.head_dim, seq, elem, k_share=False))
                a_b = 2 * a_f
            fwd.append(gemm + a_f)
            afwd.append(a_f)
            abwd.append(a_b)
            gemms.append(gemm)
            cast_f.append(kern.stream(forward_bytes))
            cast_b.append(kern.stream(backward_bytes) - faster_backward)
        return tuple(np.stack(x, -1) for x in (fwd, afwd, abwd, gemms, frozen, cast_f, cast_b))

    per_pool = [per_kind(k, k8) for k, k8 in zip(ctx.hw.kernels, ctx.hw.fp8_kernels, strict=True)]
    gemm_attn = ctx.hw.slowest([p[0] for p in per_pool])  # [C, S, K]
    attn_f = ctx.hw.slowest([p[1] for p in per_pool])
    attn_b = ctx.hw.slowest([p[2] for p in per_pool])
    cast_f = ctx.hw.slowest([p[5] for p in per_pool]) * assume.compute_scale
    cast_b = ctx.hw.slowest([p[6] for p in per_pool]) * assume.compute_scale
    gemm_f = ctx.hw.slowest([p[3] for p in per_pool]) * assume.compute_scale
    traffic, kernels = compiled_kernels(assume, c)
    stream = ctx.hw.slowest([act_none * traffic[:, None, None] / 3 / k.hbm_Bps for k in ctx.hw.kernels])
    overhead = (kernels * assume.kernel_overhead_us * 1e-6)[:, None, None]
    scale = assume.compute_scale
    fwd = (gemm_attn + stream + overhead) * scale + cast_f
    attn_f, attn_b = attn_f * scale, attn_b * scale
    # two GEMMs per forward GEMM, twice the streams and kernels; the backward's fp8 casts and rescales
    # (cast_b, less the forward's slower rowwise kernel where the backward runs cuBLAS's)
    bwd_none = 2 * (fwd - attn_f - cast_f) + attn_b + cast_b
    # a frozen weight needs no weight-gradient GEMM, only the input gradient's (LoRA); QLoRA
    # dequantizes its 4-bit weights before each use: forward, backward and a recompute
    bwd_none = bwd_none - ctx.hw.slowest([p[4] for p in per_pool]) * scale
    dequant = ctx.hw.slowest([ctx.quantized[..., 0] * assume.nf4_dequant_bytes / k.hbm_Bps for k in ctx.hw.kernels])
    fwd, bwd_none = fwd + dequant * scale, bwd_none + dequant * scale
    if assume.zero3_fetch_norms:  # DeepSpeed 0.3.15-0.5 take the norm of every parameter a ZeRO-3 fetch gathers
        gathered = (c.zero >= 3)[:, None, None] * (ctx.dense_local + ctx.exp_local)[..., 0] * ctx.recipe.param_bytes
        norms = ctx.hw.slowest([gathered / k.hbm_Bps for k in ctx.hw.kernels]) * scale
        fwd, bwd_none = fwd + norms, bwd_none + norms
    hooks = (c.zero >= 3)[:, None, None]  # a ZeRO-3 unit per block runs its hooks every pass
    fwd_ops = kernels[:, None, None] + hooks * assume.zero3_hook_ops_forward
    fwd, bwd_none = host_bound(fwd, bwd_none, fwd_ops, 2 * kernels[:, None, None] + hooks * assume.zero3_hook_ops_backward,
                               assume.host_dispatch_us)
    backward = bwd_none[..., None] + np.stack([np.zeros_like(fwd), attn_f, fwd], axis=-1)
    # the backward's host time: its kernels (twice the forward's, plus a recomputed forward's);
    # ZeRO-3's host loops: list-form gathers in each pass, the reduction's per-tensor, per-rank loops
    host = kernels[:, None, None, None] * assume.host_dispatch_us * 1e-6
    blocked = zero3_reduce_blocks(ctx) / ctx.cand.ga  # exposed in _block_comm instead
    gather = zero3_gather_host(ctx)
    loop = (zero3_reduce_host(ctx) * (1 - blocked)[:, None, None] + gather)[..., None]
    bwd_host = host * np.array([2.0, 2.0, 3.0])
    if assume.zero3_fetch_syncs:  # the loops run while the device idles, after its kernels
        fwd, backward = fwd + gather, np.maximum(backward, bwd_host) + loop
    else:  # the host issues ahead of the device: the longer of the two
        fwd = np.maximum(fwd, fwd_ops * assume.host_dispatch_us * 1e-6 + gather)
        backward = np.maximum(backward, bwd_host + loop)
    return BlockCompute(forward=fwd, backward=backward, attn_forward=attn_f, attn_backward=attn_b, gemm_forward=gemm_f)


def gemm_operand_bytes(recipe: Precision) -> float:
    """Bytes per element of a 16-bit GEMM's operands: the recipe's activations, or bf16 under an fp8
    recipe, whose casts only a block's GEMMs take (``ctx.hw.kernels`` are bf16 there; the head, the
    attention core and frozen GEMMs stay in bf16: :class:`autoplace.cost.hardware.StageHardware`)."""
    return 2.0 if recipe.compute_dtype == "fp8" else recipe.activation_bytes


def fp8_recipe(ctx: Context) -> Array:
    """``[C]`` each candidate's fp8 GEMM recipe as an index into :data:`autoplace.plan.FP8` (0: 16-bit
    GEMMs): the plan's ``fp8`` key, or, for a model file whose compute dtype is fp8 and a plan naming
    no recipe, the one its framework runs by default (:data:`~autoplace.cost.compute.FP8_DEFAULT_RECIPE`)."""
    if ctx.recipe.compute_dtype != "fp8":
        return ctx.cand.fp8
    default = FP8.index(FP8_DEFAULT_RECIPE[ctx.assume.fp8_casts])
    return np.where(ctx.cand.fp8 > 0, ctx.cand.fp8, default)


def host_bound(forward: Array, backward: Array, forward_ops: Array, backward_ops: Array,
               dispatch_us: float) -> tuple[Array, Array]:
    """A block's forward and backward seconds, no shorter than the host takes to issue them.

    The host issues kernels asynchronously, one eager op at a time (Python, the dispatcher,
    autograd's bookkeeping, the launch call: ``dispatch_us`` each); the GPU runs them as they
    come, so a block whose kernels finish faster than the host issues them is launch-bound
    (small models at small batches).  ``forward_ops`` and ``backward_ops`` count what the host
    does per pass in eager-op equivalents: the block's kernels (backward issues two per forward
    kernel) and, for a ZeRO-3 unit, its hooks (``Assumptions.zero3_hook_ops_forward`` / ``_backward``).
    """
    us = dispatch_us * 1e-6
    return np.maximum(forward, forward_ops * us), np.maximum(backward, backward_ops * us)


def zero3_reduce_blocks(ctx: Context) -> Array:
    """``[C]`` 1 where a candidate's ZeRO-3 backward waits for every gradient bucket's
    reduce-scatter, else 0: DeepSpeed 0.6-0.15 with an offloaded optimizer copies each reduced
    gradient partition into the host's fp32 gradient with a blocking ``copy_`` (stage3.py
    ``__partition_grads``: ``fp32_grad_tensor.copy_(grad_buffer)``; ``non_blocking=True`` from
    0.16), so the autograd thread stops at each bucket until its reduce-scatter and copy are
    done: the reduce-scatter and its host loops (:func:`zero3_reduce_host`) hide under nothing
    (``Assumptions.zero3_offload_grad_copy_blocks``).  The copy runs at the gradient-accumulation
    boundary only (``is_gradient_accumulation_boundary``): the last micro-batch of a step."""
    on = float(ctx.assume.zero3_offload_grad_copy_blocks)
    return np.where((ctx.cand.zero >= 3) & ctx.cand.off_opt, on, 0.0)


def zero3_reduce_host(ctx: Context) -> Array:
    """Host seconds ``[C, 1, K]`` one block's backward spends preparing its ZeRO-3 gradient
    reduce-scatter, per micro-batch: ``tensors x ranks x zero3_reduce_host_us``.

    DeepSpeed's ZeRO-3 reduces every gradient bucket through
    ``deepspeed/runtime/comm/coalesced_collectives.py`` ``reduce_scatter_coalesced`` (0.6 to 0.19,
    called by stage3's ``__avg_scatter_grads``): a Python list comprehension slices each gradient
    into one view per rank, a second Python loop interleaves the views rank by rank, and
    ``torch.cat`` joins them -- host work per (parameter tensor, rank), on the autograd thread
    that issues the backward's kernels, so a block whose backward is shorter than that waits on
    the host (at 1,024 ranks a GPT-175B block's 12 tensors take ~60 ms).  FSDP2 builds its
    reduce-scatter input with one ``torch.split`` + ``_chunk_cat`` per group in C++
    (``zero3_reduce_host_us`` = 0).  Before 0.6 (``zero3_list_reduces``) each gradient's own
    list-form reduce-scatter loops over the ranks as well (``_reduce_scatter_gradient``), at the
    microseconds that loop measures.  The block's tensors are :attr:`BlockKind.tensors`."""
    return _per_tensor_and_rank(ctx, [float(k.tensors) for k in ctx.table.kinds], ctx.assume.zero3_reduce_host_us)


def zero3_gather_host(ctx: Context) -> Array:
    """Host seconds ``[C, 1, K]`` one block's ZeRO-3 gathers take per pass when each is issued in
    list form (``Assumptions.zero3_list_gathers``, DeepSpeed before 0.5.6): ``_allgather_param``
    cuts the gathered buffer into one view per rank in a Python loop and PyTorch's NCCL process
    group copies each view out, so ``gathered tensors x ranks x zero3_gather_host_us``; the
    gathered tensors are the block's weight matrices (its biases and norms stay whole under
    ``stage3_param_persistence_threshold``: :func:`zero3_collective_counts`).  0 otherwise."""
    us = ctx.assume.zero3_gather_host_us if ctx.assume.zero3_list_gathers else 0.0
    return _per_tensor_and_rank(ctx, [float(len(k.gemms)) for k in ctx.table.kinds], us)


def _per_tensor_and_rank(ctx: Context, tensors: list[float], us: float) -> Array:
    """``[C, 1, K]`` seconds of a ZeRO-3 host loop costing ``us`` per (tensor, rank of the shard
    group), for ``tensors`` per block kind; 0 for candidates below ZeRO-3."""
    if us <= 0:
        return np.zeros((ctx.cand.size, 1, len(ctx.table.kinds)))
    per_kind = np.array(tensors).reshape(1, 1, -1)
    ranks = ctx.size["zero"].astype(float).reshape(-1, 1, 1)
    return np.where(ctx.cand.zero.reshape(-1, 1, 1) >= 3, per_kind * ranks * us * 1e-6, 0.0)


def compiled_kernels(assume: Assumptions, c: Candidates) -> tuple[Array, Array]:
    """Per candidate ``[C]``: the HBM passes of a block's memory-bound kernels over its
    activations and the kernels its forward launches, compiled (torch.compile fuses them:
    Ansel et al. 2024) or eager (:class:`~autoplace.cost.assumptions.Assumptions`)."""
    traffic = np.where(c.compile, assume.elementwise_traffic_compiled, assume.elementwise_traffic)
    return traffic, np.where(c.compile, assume.kernels_per_block_compiled, assume.kernels_per_block)


def time_terms(ctx: Context, act_none: Array) -> TimeTerms:
    """Every time and byte table (see the module docstring)."""
    blk = block_compute(ctx, act_none)
    t_block, bytes_block, units = _block_comm(ctx, blk)
    t_static, bytes_static, head_bwd = _edge_terms(ctx, units)
    step = _step_terms(ctx)
    overlap = ctx.cand.overlap.astype(float)  # without it the reduction waits for backward to end
    bytes_block[..., 0] += step.dp_bytes_block[:, None, :, None]
    bytes_block[..., 5] += step.offload_bytes_block[:, None, :, None]
    bytes_static[..., 0] += step.dp_bytes_static
    bytes_static[..., 5] += step.offload_bytes_static
    return TimeTerms(
        t_block=ctx.stage(t_block), t_static=ctx.stage(t_static), reduce_block=ctx.stage(step.reduce_block),
        reduce_static=ctx.stage(step.reduce_static), window_block=ctx.stage(blk.backward[..., 0] * overlap[:, None, None]),
        window_static=ctx.stage(head_bwd * overlap[:, None]), last_bucket=ctx.stage(step.last_bucket),
        gather_block=ctx.stage(step.gather_block), gather_static=ctx.stage(step.gather_static),
        opt_block=ctx.stage(step.opt_block), opt_static=ctx.stage(step.opt_static),
        bytes_block=bytes_block, bytes_static=bytes_static)


def _block_comm(ctx: Context, blk: BlockCompute) -> tuple[Array, Array, tuple[Array, Array]]:
    """Per-block seconds by MB_PARTS ``[C, S, K, 3, 7]``, bytes per step ``[C, 1, K, 3, 6]``,
    and the largest unit's (all-gather, reduce-scatter) seconds ``[C, S]`` for the edges."""
    c, col, kind, lk = ctx.cand, ctx.col, ctx.kind, ctx.links
    size, n_in, recipe = ctx.size, ctx.n_in, ctx.recipe
    kappa = ctx.assume.overlap_slowdown
    tp, cp = c.tp.astype(float), c.cp.astype(float)
    sp_div = np.where(c.sp, tp, 1.0)
    z = col(c.zero)
    full = np.array([0.0, 0.0, 1.0]).reshape(1, 1, 1, 3)
    fwd, bwd = blk.forward[..., None], blk.backward  # [C,S,K,1], [C,S,K,3]
    tokens = col(ctx.tokens)
    ga = col(c.ga)

    # tensor parallelism: 2 forward, 2 backward, 2 more when recomputed (all-reduces, or
    # all-gather + reduce-scatter with sequence parallelism: the same bytes)
    passes = 4 + 2 * full
    tp_on = col(tp > 1)
    tp_i, tp_x, tp_t = comm.allreduce(tokens * kind("tp_allreduce") / 2, col(size["tp"]), col(n_in["tp"]), lk)
    ep_i, ep_x, ep_t = comm.alltoall(tokens / col(sp_div) * kind("ep_alltoall"), col(size["ep"]), col(n_in["ep"]), lk)
    tp_time = tp_on * passes * tp_t
    # expert parallelism: dispatch and combine in forward, again in backward, again when recomputed.  DualPipe
    # pairs one micro-batch's forward chunk with another's backward chunk and runs each one's all-to-all under
    # the other's compute (DeepSeek-AI 2024, DeepSeek-V3 report Sec. 3.2.1, Fig. 4; torchtitan 0.2.2's DualPipeV
    # overlap_callback): the forward's under the paired backward, the backward's under the paired forward,
    # each max(0, a2a - compute) plus the SM share the hidden part takes (hidden).  The steady state's pairing:
    # the unpaired chunks of the warm-up and cool-down would expose theirs, which the model does not see.
    ep_time = np.where(col(c.schedule == SCHEDULE_CODES["dualpipev"]) > 0,
                       hidden(2 * ep_t, bwd, kappa) + hidden((2 + 2 * full) * ep_t, fwd, kappa), passes * ep_t)
    # async TP / userbuffers (the plan's tp_overlap): the collectives pipeline with the TP matmuls
    tp_time = np.where(col(c.tp_overlap > 0) > 0, hidden(tp_time, blk.gemm_forward[..., None] * (3 + full), kappa),
                       tp_time)

    # context parallelism, a ring: forward passes K/V around (cp - 1) steps; backward passes
    # K/V again with dK/dV; each step hides under one chunk of the attention
    cp_fwd = tokens * kind("cp_kv") / col(tp) * col(cp - 1)
    cp_inter = col(n_in["cp"] < c.cp) > 0
    cp_f_t = comm.p2p(cp_fwd, col(cp - 1), cp_inter, lk)
    cp_b_t = comm.p2p(2 * cp_fwd, 2 * col(cp - 1), cp_inter, lk)
    chunk = col((cp - 1) / cp)
    a_f, a_b = blk.attn_forward[..., None] * chunk, blk.attn_backward[..., None] * chunk
    cp_time = (1 + full) * hidden(cp_f_t, a_f, kappa) + hidden(cp_b_t, a_b, kappa)
    cp_bytes = cp_fwd * (3 + full)

    # ZeRO-3 gathers every block in forward and again in backward and reduce-scatters its
    # gradient; ZeRO-2 reduce-scatters (DeepSpeed: all-reduces) every micro-batch.  ZeRO++'s
    # (de)quantization kernels run on the compute stream: exposed.
    sh = _shard_collectives(ctx, ctx.train_dense, ctx.train_exp, ctx.frozen_dense_wire, ctx.frozen_exp_wire)
    all_reduce_12 = ctx.assume.zero12_grad_reduce == "all-reduce"
    grad_t = sh.ar if all_reduce_12 else sh.rs
    ov = col(c.overlap)  # overlap off: gathers and reductions run before / after the compute, exposed
    # DeepSpeed 0.6-0.15 with an offloaded optimizer copies each reduced gradient partition to the
    # host with a blocking copy (zero3_offload_grad_copy_blocks): its reduce-scatter never hides
    blocked = col(zero3_reduce_blocks(ctx)) / ga  # the copy runs at the accumulation boundary: once a step
    exposed = blocked * (sh.rs + zero3_reduce_host(ctx)[..., None])
    # a pipeline that defers the gradient sync reduce-scatters once a step (_step_terms), not per micro-batch
    per_mb = 1.0 - col(ctx.deferred_sync)
    zero_time = np.where(z >= 3, zero3_hidden(ctx, sh.ag_fwd, fwd * ov, backward=False)
                         + zero3_hidden(ctx, sh.ag_bwd + sh.rs * (1 - blocked) * per_mb, bwd * ov, backward=True)
                         + exposed + sh.quant, np.where(z == 2, hidden(grad_t, bwd * ov, kappa) * per_mb, 0.0))
    zero_bytes_mb = np.where(z >= 3, sh.z3_bytes - sh.rs_bytes * (1 - per_mb),
                             np.where(z == 2, (sh.ar_bytes if all_reduce_12 else sh.rs_bytes) * per_mb, 0.0))

    # offloaded parameters stream in over PCIe for forward and again for backward
    shard_bytes = ((ctx.train_dense * recipe.param_bytes + ctx.frozen_dense) / np.where(z >= 3, col(size["zero"]), 1)
                   + (ctx.train_exp * recipe.param_bytes + ctx.frozen_exp) / np.where(z >= 3, col(size["ezero"]), 1))
    host_bps = offload_Bps(ctx, c.offload_params)[..., None, None]
    off_bytes_mb = col(c.off_par) * 2 * shard_bytes
    off_time = hidden(off_bytes_mb / 2 / host_bps, fwd, 0.0) + hidden(off_bytes_mb / 2 / host_bps, bwd, 0.0)

    zeros = np.zeros_like(bwd)
    t_block = np.stack(np.broadcast_arrays(blk.total, tp_time, ep_time, cp_time, zeros,
                                           zero_time, off_time), axis=-1)
    ones = np.ones((1, 1, 1, 3))
    bytes_block = np.stack(np.broadcast_arrays(
        ga * zero_bytes_mb * ones, ga * tp_on * passes * (tp_i + tp_x) * ones, 0 * ones, ga * cp_bytes * ones,
        ga * passes * (ep_i + ep_x) * ones, ga * off_bytes_mb * ones), axis=-1)[:, :1]
    # the largest unit's gather and reduce-scatter: what the first and last of a micro-batch cost
    unit_ag = np.broadcast_to(sh.ag_fwd, fwd.shape).max(axis=(2, 3))
    unit_rs = np.broadcast_to(np.where(z >= 3, sh.rs, np.where(z == 2, grad_t, 0.0)) * per_mb, fwd.shape).max(axis=(2, 3))
    return t_block, bytes_block.copy(), (unit_ag, unit_rs)


class ShardCollectives(NamedTuple):
    """ZeRO's collectives of one block per micro-batch: seconds ``[C, S, K, 1]`` of the forward
    and backward all-gathers, the reduce-scatter, the all-reduce (DeepSpeed's ZeRO-1/2) and
    ZeRO++'s (de)quantization; bytes of ZeRO-3 (two gathers and a reduce-scatter), of a
    reduce-scatter and of an all-reduce."""

    ag_fwd: Array
    ag_bwd: Array
    rs: Array
    ar: Array
    quant: Array
    z3_bytes: Array
    rs_bytes: Array
    ar_bytes: Array


def _shard_collectives(ctx: Context, dense: Array, expert: Array, frozen_d: Array | float = 0.0,
                       frozen_e: Array | float = 0.0) -> ShardCollectives:
    """Gathering, reduce-scattering and all-reducing ``dense`` and ``expert`` local parameters
    over the shard groups, in each candidate's wire format (:mod:`autoplace.cost.compress`):
    ZeRO++ gathers int8 in forward, re-gathers its node-local secondary shard in backward (hpZ:
    the part of the group inside the NVLink domain) and reduce-scatters int4.  A frozen base
    (``frozen_*``: the bytes its gathers move) is gathered and never reduced."""
    col, lk, w, assume = ctx.col, ctx.links, ctx.wire, ctx.assume
    launch = assume.kernel_overhead_us * 1e-6
    zpp = col(w.zeropp) > 0
    groups = (("zero", dense, frozen_d), ("ezero", expert, frozen_e))
    parts: dict[str, list[tuple[Array, Array, Array]]] = {"ag_fwd": [], "ag_bwd": [], "rs": [], "ar": []}
    for g, p, f in groups:
        n, n_in = col(ctx.size[g]), col(ctx.n_in[g])
        gathers, reduces = zero3_collective_counts(ctx, p)
        n_bwd = np.where(zpp, n_in, n)
        ag_n = np.where(p + f > 0, gathers, 0.0)  # no parameters, no collective
        rs_n = np.where(p > 0, reduces, 0.0)
        # a list-form collective also copies each rank's view out of (into) its flat buffer: a kernel each
        ag_copies = ag_n * n * launch * assume.zero3_list_gathers
        rs_copies = rs_n * n * launch * assume.zero3_list_reduces
        ag_bwd = comm.allgather(p * col(w.gather_bwd) + f, n_bwd, np.minimum(n_in, n_bwd), lk, ag_n)
        parts["ag_fwd"].append(_plus_seconds(comm.allgather(p * col(w.gather_fwd) + f, n, n_in, lk, ag_n), ag_copies))
        parts["ag_bwd"].append(_plus_seconds(ag_bwd, ag_copies))
        parts["rs"].append(_plus_seconds(comm.reducescatter(p * col(w.reduce), n, n_in, lk, rs_n), rs_copies))
        parts["ar"].append(comm.allreduce(p * col(w.reduce), n, n_in, lk, rs_n))

    def total(name: str, i: int) -> Array:
        return sum((x[i] for x in parts[name]), np.zeros(1))

    def moved(name: str) -> Array:
        return total(name, 0) + total(name, 1)

    quant_bytes = (dense + expert) * (assume.qwz_dequant_bytes + assume.qgz_quant_bytes) * zpp
    quant = ctx.hw.slowest([quant_bytes / k.hbm_Bps for k in ctx.hw.kernels]) * assume.compute_scale
    return ShardCollectives(ag_fwd=total("ag_fwd", 2), ag_bwd=total("ag_bwd", 2), rs=total("rs", 2),
                            ar=total("ar", 2), quant=quant,
                            z3_bytes=moved("ag_fwd") + moved("ag_bwd") + moved("rs"), rs_bytes=moved("rs"),
                            ar_bytes=moved("ar"))


def _plus_seconds(collective: tuple[Array, Array, Array], seconds: Array) -> tuple[Array, Array, Array]:
    """A collective's (intra bytes, inter bytes, seconds) with ``seconds`` more."""
    intra, inter, t = collective
    return intra, inter, t + seconds


def zero3_collective_counts(ctx: Context, params: Array) -> tuple[Array, Array]:
    """Collectives one block issues per micro-batch for its ``params`` local parameters
    ``[C, S, K, 1]``, as the framework issues them (``Assumptions.zero3_gather_unit`` and
    ``zero3_reduce_bucket_params``): (all-gathers per pass, reduce-scatters).

    FSDP2 (``fully_shard`` per block) gathers each block in one collective and reduce-scatters
    its gradients in one.  DeepSpeed ZeRO-3 fetches parameters module by module
    (``PartitionedParameterCoordinator.fetch_sub_module``: one coalesced all-gather per
    submodule, prefetching at most ``stage3_prefetch_bucket_size`` = 5e7 elements ahead, which a
    large block's weights each exceed), so a block costs one gather per weight matrix (its
    GEMMs; norms and biases under ``stage3_param_persistence_threshold`` = 1e5 elements are
    never partitioned), and reduce-scatters its gradients in buckets of ``reduce_bucket_size``
    elements (:func:`zero3_buckets`): a weight matrix larger than the bucket on its own, after a
    flush of the small tensors gathered before it, the rest ``params / bucket``.  Before 0.6
    (``zero3_list_reduces``) it reduce-scatters every gradient on its own: one per tensor.
    The layer table fuses QKV, gate/up and each routed expert set into one GEMM, as Megatron's GPT
    does (four per dense block); code that keeps them apart (Hugging Face Llama: seven linears,
    one module per expert) issues more, so this is a lower bound there.
    """
    assume, table = ctx.assume, ctx.table
    per_module = np.array([float(len(k.gemms)) for k in table.kinds]).reshape(1, 1, -1, 1)
    gathers = per_module if assume.zero3_gather_unit == "module" else np.ones_like(per_module)
    tensors = np.array([k.tensors for k in table.kinds]).reshape(1, 1, -1, 1)
    bucket = zero3_buckets(ctx)[0]
    if bucket <= 0:
        reduces = np.ones_like(params)
    else:
        # DeepSpeed flushes its bucket before a gradient that would overflow it (stage3.py
        # reduce_independent_p_g_buckets_and_remove_grads): a weight matrix larger than the bucket
        # is reduced on its own and first flushes the small tensors (biases, norms) gathered before it
        share = module_shares(table)[0]  # [1, 1, K, 1, M]
        local = np.asarray(params)[..., None] * share
        big = (local >= bucket) & (share > 0)
        n_big = big.sum(axis=-1)
        flushed = np.minimum(n_big, np.maximum(tensors - n_big, 0))
        reduces = n_big + flushed + (params - (local * big).sum(axis=-1)) / bucket
    if assume.zero3_list_reduces:  # DeepSpeed < 0.6's ZeRO-3: one reduce-scatter per gradient, whatever the bucket
        reduces = np.where(ctx.col(ctx.cand.zero >= 3) > 0, tensors, reduces)
    return gathers, reduces


def zero3_buckets(ctx: Context) -> tuple[float, float]:
    """(reduce bucket, prefetch bucket) in elements, as the framework is configured: absolute
    (``zero3_reduce_bucket_params``, ``zero3_prefetch_bucket_params``), or scaled with the
    hidden size h (``zero3_buckets_per_hidden_sq``: h^2 and 0.9 h^2, the Hugging Face
    integration's "auto" sizes that autoplace's DeepSpeed config writes)."""
    assume = ctx.assume
    if assume.zero3_buckets_per_hidden_sq > 0:
        reduce = assume.zero3_buckets_per_hidden_sq * float(ctx.table.hidden) ** 2
        return reduce, 0.9 * reduce
    return assume.zero3_reduce_bucket_params, assume.zero3_prefetch_bucket_params


def module_shares(table: LayerTable) -> tuple[Array, Array]:
    """Per block kind, its modules in forward order (one per GEMM of the layer table, padded
    with zeros to the longest kind), ``[1, 1, K, 1, M]``: each module's share of the block's
    parameters, and its share of the block's forward compute (GEMM FLOPs; the attention core
    counts with the first module, the QKV projection it follows).  A kind without matmuls (a
    layer graph's embedding lookup: parameters, no FLOPs) is one module holding all of them, so
    every kind has a module whose gather a neighbour's compute can hide."""
    width = max(1, *(len(k.gemms) for k in table.kinds))
    params = np.zeros((len(table.kinds), width))
    flops = np.zeros_like(params)
    for i, k in enumerate(table.kinds):
        for j, g in enumerate(k.gemms):
            params[i, j] = g.n * g.k * max(g.experts, 1)
            flops[i, j] = g.flops
        if not k.gemms:
            params[i, 0] = 1.0  # its whole share
        flops[i, 0] += k.flops_score
    shares = [a / np.maximum(a.sum(axis=1, keepdims=True), 1e-30) for a in (params, flops)]
    return tuple(a.reshape(1, 1, len(table.kinds), 1, width) for a in shares)  # type: ignore[return-value]


def zero3_hidden(ctx: Context, seconds: Array, window: Array, *, backward: bool) -> Array:
    """What ZeRO-3's collectives of one block (``seconds``) cost beside its compute (``window``)
    (:func:`autoplace.cost.step.hidden`), by how far ahead the framework gathers.

    FSDP2 prefetches the next whole block (``zero3_prefetch_bucket_params`` = 0): the block's
    collectives hide under a block of compute.  DeepSpeed prefetches at most
    ``stage3_prefetch_bucket_size`` (5e7) elements ahead, and always at least one parameter
    (``PartitionedParameterCoordinator.fetch_sub_module``), so when a block's modules are larger
    than that each module's gather hides only under the module before it (in backward, the module
    after it): a large module after a small one (the MLP's first matrix after the attention's
    output projection) is partly exposed however long the block runs.  Never hides more than
    the block-wide prefetch."""
    kappa = ctx.assume.overlap_slowdown
    bucket = zero3_buckets(ctx)[1]
    if bucket <= 0:
        return hidden(seconds, window, kappa)
    seconds, window = np.broadcast_arrays(seconds, window)
    p, f = module_shares(ctx.table)
    # the module whose compute each module's gather runs beside: the one before it in forward,
    # the one after it in backward (the previous block's last / the next block's first at the edges)
    m = (p > 0).sum(axis=-1, keepdims=True)
    j = np.arange(p.shape[-1])
    other = np.where(backward, (j + 1) % m, (j - 1) % m)
    f_beside = np.take_along_axis(np.broadcast_to(f, other.shape), other, axis=-1) * (p > 0)
    under_modules = np.minimum(seconds[..., None] * p, window[..., None] * f_beside).sum(axis=-1)
    per_module = (ctx.dense_local + ctx.exp_local) / np.maximum(m[..., 0], 1)  # local parameters [C, 1, K, 1]
    under = np.where(per_module >= bucket, under_modules, np.minimum(seconds, window))
    return seconds - under + kappa * under


def _edge_terms(ctx: Context, units: tuple[Array, Array]) -> tuple[Array, Array, Array]:
    """Per-micro-batch seconds ``[C, S, 7]`` and bytes per step ``[C, S, 6]`` of the edges
    (embedding, head, loss), pipeline sends and the unhidden first/last FSDP collectives; and
    the head's backward seconds (part of the reduction's window) ``[C, S]``."""
    c, table, recipe, assume = ctx.cand, ctx.table, ctx.recipe, ctx.assume
    C, S = ctx.C, ctx.S
    first, last = ctx.first, ctx.last
    tp = c.tp.astype(float)
    sp_div = np.where(c.sp, tp, 1.0)
    tok = ctx.tokens[:, None]
    h = table.head
    zero = c.zero
    ga = c.ga.astype(float)[:, None]
    elem = gemm_operand_bytes(recipe)
    # the head's matmul (forward and two backward) and the loss streaming the logits
    traffic = compiled_kernels(assume, c)[0][:, None]
    head_fwd = ctx.hw.slowest([gemms_forward(k, h.gemms, tok, tp[:, None], 1.0, elem)
                               + k.stream(tok * (h.act_rep / sp_div + h.act_tp / tp)[:, None] * traffic / 3)
                               for k in ctx.hw.kernels]) * assume.compute_scale
    head_fwd = last * head_fwd
    head_passes = 2.0 if table.frozen else 3.0  # a frozen head computes no weight gradient
    t_compute = head_passes * head_fwd
    # the vocab-parallel embedding all-reduces its output; the head its input's gradient and the
    # loss's per-token statistics (three small all-reduces)
    lk = ctx.stage_links
    edge_ar = first * table.embed.tp_allreduce + last * h.tp_allreduce  # bytes per token
    size, n_in = ctx.size, ctx.n_in
    emb_i, emb_x, emb_t = comm.allreduce(tok * edge_ar, size["tp"][:, None], n_in["tp"][:, None], lk)
    tp_on = (tp > 1)[:, None]
    small_ar = comm.allreduce(np.full((C, 1), 4.0), size["tp"][:, None], n_in["tp"][:, None], lk)[2]
    t_tp = tp_on * (emb_t + last * 3 * small_ar)
    vpp = c.vpp[:, None].astype(float)
    sends = np.where(c.pp[:, None] > 1, 2 * vpp - first - last, 0.0)
    send_bytes = sends * tok * table.act_bytes * table.hidden / sp_div[:, None]
    pp_inter = (size["pp"] > 1)[:, None] & (ctx.n_in["pp"] < size["pp"])[:, None]
    t_pp = comm.p2p(send_bytes, sends, pp_inter, lk)
    edge_dense, frozen = ctx.train_edge, ctx.frozen_edge_wire  # trainable parameters, frozen bytes gathered
    pgb, rgb = ctx.wire.gather_fwd[:, None], ctx.wire.reduce[:, None]  # ZeRO-3 gathers the root once
    _, _, eag = comm.allgather(edge_dense * pgb + frozen, size["zero"][:, None], n_in["zero"][:, None], lk)
    _, _, ers = comm.reducescatter(edge_dense * rgb, size["zero"][:, None], n_in["zero"][:, None], lk)
    _, _, ear = comm.allreduce(edge_dense * rgb, size["zero"][:, None], n_in["zero"][:, None], lk)
    all_reduce_12 = assume.zero12_grad_reduce == "all-reduce"  # ZeRO-2's per-micro-batch reduction
    # edges are units too: ZeRO-3 gathers the root once per micro-batch (it stays gathered until
    # backward) and reduce-scatters its gradient; ZeRO-2 reduce-scatters their gradients.  The
    # first block's gather and the last block's reduce-scatter have no compute to hide under.
    unit_ag, unit_rs = units
    z3, z2 = (zero >= 3)[:, None], (zero == 2)[:, None]
    per_mb = 1.0 - ctx.deferred_sync[:, None]  # deferred: the edges' reduce-scatter joins the step's (_step_terms)
    t_zero = np.select([z3, z2], [eag + ers * per_mb + unit_ag + unit_rs, (ear if all_reduce_12 else ers) * per_mb
                                  + unit_rs], 0.0)
    edge_shard = (edge_dense * recipe.param_bytes + ctx.frozen_edge) / np.where(z3, size["zero"][:, None], 1)  # bytes
    t_off = c.off_par[:, None] * 2 * edge_shard / offload_Bps(ctx, c.offload_params)
    zs = np.zeros((C, S))
    t_static = np.stack(np.broadcast_arrays(t_compute, t_tp, zs, zs, t_pp, t_zero, t_off), axis=-1)
    zfrac = ((size["zero"] - 1) / size["zero"])[:, None]
    bytes_static = np.stack(np.broadcast_arrays(
        ga * zfrac * np.select([z3, z2], [edge_dense * (pgb + rgb * per_mb) + frozen,
                                          edge_dense * (2.0 if all_reduce_12 else 1.0) * rgb * per_mb], 0.0),
        ga * tp_on * (emb_i + emb_x), ga * send_bytes, zs, zs,
        ga * c.off_par[:, None] * 2 * edge_shard), axis=-1)
    return t_static, bytes_static.copy(), (head_passes - 1) * head_fwd


@dataclass(frozen=True)
class StepTerms:
    """Once-per-step seconds and bytes, linear in a stage's blocks: per block (``_block``, ``[C, S, K]``
    or ``[C, K]`` for bytes) and for the stage's edges (``_static``, ``[C, S]``)."""

    reduce_block: Array  # data-parallel gradient reduction (+ offloaded gradients going down)
    reduce_static: Array
    gather_block: Array  # ZeRO-1/2's all-gather of the updated parameters
    gather_static: Array
    last_bucket: Array  # [C, S] the reduction of the last bucket, which backward cannot hide
    dp_bytes_block: Array  # data-parallel bytes per step
    dp_bytes_static: Array
    opt_block: Array  # the optimizer step (GPU fused Adam or CPU Adam)
    opt_static: Array
    offload_bytes_block: Array  # PCIe bytes of an offloaded optimizer
    offload_bytes_static: Array


def _step_terms(ctx: Context) -> StepTerms:
    """Once per step, linear in a stage's blocks: gradient reduction, parameter gather and the
    optimizer; the last bucket's reduction; data-parallel and offload bytes (:class:`StepTerms`).

    ZeRO paper Sec. 7: DDP all-reduces gradients (2Ψ); ZeRO-1/2 reduce-scatter gradients and
    all-gather updated parameters (Ψ + Ψ); ZeRO-3 moves its gathers into every micro-batch
    (counted per block) and only all-reduces shards across replicas (HSDP).  DeepSpeed's
    ZeRO-1/2 all-reduce instead of reduce-scattering (``zero12_grad_reduce``).  Gradients
    travel in each candidate's wire format; PowerSGD all-reduces only its factors
    (:mod:`autoplace.cost.compress`) and adds its kernels to the step (on the compute stream).
    """
    c, recipe, assume = ctx.cand, ctx.recipe, ctx.assume
    zero = c.zero
    pb, gb, ob = recipe.param_bytes, recipe.grad_bytes, recipe.optimizer_bytes
    all_reduce_12 = assume.zero12_grad_reduce == "all-reduce"
    lk = ctx.stage_links

    def one(params: Array, sent: Array, group: str, shard_group: str,
            frozen: Array | float = 0.0) -> tuple[Array, Array, Array]:
        """(reduce seconds, gather seconds, bytes) of ``params`` ``[C, X]`` (stage-broadcast),
        whose DDP all-reduce sends ``sent`` elements; ``frozen`` bytes of a frozen base are
        gathered with them."""
        L = _bcast(lk, params)
        n, ni = _e(ctx.size[group], params), _e(ctx.n_in[group], params)
        ns, nis = _e(ctx.size[shard_group], params), _e(ctx.n_in[shard_group], params)
        nr, nir = _e(ctx.size["rep"], params), _e(ctx.n_in["rep"], params)
        zz = _e(zero, params)
        pgb, rgb = _e(ctx.wire.gather_fwd, params), _e(ctx.wire.reduce, params)
        ar = comm.allreduce(sent * rgb, n, ni, L)
        rs = comm.reducescatter(params * rgb, ns, nis, L)
        ag = comm.allgather(params * pgb + frozen, ns, nis, L)
        rep = comm.allreduce(params * rgb / ns, nr, nir, L)
        z1 = ar if all_reduce_12 else rs
        late = _e(ctx.deferred_sync, params)  # ZeRO-2/3 reduce-scattering once a step (Context.deferred_sync)
        reduce_t = np.select([zz == 0, zz == 1], [ar[2], z1[2] + rep[2]], rep[2] + late * z1[2])
        gather_t = np.where((zz == 1) | (zz == 2), ag[2], 0.0)
        nbytes = np.select([zz == 0, zz == 1, zz == 2],
                           [ar[0] + ar[1], z1[0] + z1[1] + ag[0] + ag[1] + rep[0] + rep[1],
                            ag[0] + ag[1] + rep[0] + rep[1]], rep[0] + rep[1]) + np.where(zz >= 2, late, 0) * (z1[0] + z1[1])
        return reduce_t, gather_t, nbytes

    # only trainable parameters are reduced, gathered after the step and updated (a frozen
    # base: its adapters, whose small matrices PowerSGD is not given)
    dense, expert = ctx.train_dense[:, 0, :, 0], ctx.train_exp[:, 0, :, 0]
    tuned = ctx.table.frozen
    sent_blk = dense if tuned else compress.block_reduce_elements(ctx.table, c, ctx.dense_local)  # [C, K]
    sent_st = ctx.train_edge if tuned else compress.edge_reduce_elements(ctx.table, c, ctx.edge_dense, ctx.first,
                                                                          ctx.last)  # [C, S]
    # FSDP2's ZeRO-2 (no master copy: reshard_after_forward=False) stores a frozen base sharded
    # and gathers it once per step; ZeRO-1/2 with a master copy keep it whole, ZeRO-3 gathers
    # it per micro-batch (_block_comm)
    regather = ((zero == 2) & (not recipe.master_copy))[:, None, None]
    r_d, g_d, b_d = one(dense[:, None, :], sent_blk[:, None, :], "dp", "zero",
                        regather * ctx.frozen_dense_wire[:, :, :, 0])
    sent_exp = expert if tuned else compress.expert_reduce_elements(ctx.table, c, ctx.exp_local)  # [C, K]
    r_e, g_e, b_e = one(expert[:, None, :], sent_exp[:, None, :], "edp", "ezero",
                        regather * ctx.frozen_exp_wire[:, :, :, 0])
    r_s, g_s, b_s = one(ctx.train_edge[:, :, None], sent_st[:, :, None], "dp", "zero",
                        regather * ctx.frozen_edge_wire[:, :, None])
    # the last bucket: its reduction cannot start before backward ends
    bucket = np.full((ctx.C, 1, 1), assume.comm_bucket_MiB * 2**20) / ctx.wire.reduce[:, None, None]
    last_bucket = one(bucket, bucket, "dp", "zero")[0][..., 0]  # [C, S]

    # optimizer: fused Adam streams its states through HBM (read + write moments and master,
    # read gradients, write parameters; without a separate master copy the parameters are the
    # master, read and written: FSDP2's fp32 shards); offloaded, CPU Adam runs on the host
    # (shared by the node's GPUs) and the updated parameters come back over PCIe
    z_opt, ez_opt = np.where(zero >= 1, ctx.size["zero"], 1), np.where(zero >= 1, ctx.size["ezero"], 1)
    opt_params_blk = dense / z_opt[:, None] + expert / ez_opt[:, None]  # [C, K]
    opt_params_st = ctx.train_edge / z_opt[:, None]  # [C, S]
    host_bps = ctx.hw.host_Bps / assume.bandwidth_scale  # [C, S]
    # PowerSGD's hook makes ``powersgd_hbm_passes`` passes over each gradient it compresses
    psgd = np.where(ctx.wire.rank > 0, assume.powersgd_hbm_passes * ctx.wire.reduce, 0.0)[:, None]
    param_passes = 1.0 if recipe.master_copy else 2.0
    gpu_opt = ctx.hw.slowest([(2 * ob + gb + param_passes * pb + psgd) / k.hbm_Bps * np.ones((ctx.C, 1)) for k in ctx.hw.kernels])
    # ZeRO-Infinity reads and writes the optimizer states of NVMe offload every step
    nvme = (c.offload_optimizer == OFFLOAD.index("nvme"))[:, None] * 2 * ob / offload_Bps(ctx, c.offload_optimizer)
    cpu_opt = ctx.links.gpus_per_node / assume.cpu_adam_params_per_s + pb / host_bps + nvme
    off = c.off_opt[:, None]
    per_param = np.where(off, cpu_opt, gpu_opt) * assume.compute_scale  # [C, S]
    opt_block = opt_params_blk[:, None, :] * per_param[..., None]
    opt_static = opt_params_st * per_param
    # offloaded gradients go down to the host during backward, with the reduction
    down = np.where(off, gb / host_bps, 0.0)
    reduce_block = r_d + r_e + opt_params_blk[:, None, :] * down[..., None]
    reduce_static = r_s[..., 0] + opt_params_st * down
    off_step = c.off_opt[:, None] * (gb + pb)
    return StepTerms(reduce_block=reduce_block, reduce_static=reduce_static, gather_block=g_d + g_e,
                     gather_static=g_s[..., 0], last_bucket=last_bucket, dp_bytes_block=(b_d + b_e)[:, 0, :],
                     dp_bytes_static=b_s[..., 0], opt_block=opt_block, opt_static=opt_static,
                     offload_bytes_block=off_step[:, :1] * opt_params_blk,
                     offload_bytes_static=off_step * opt_params_st)


def _e(x: Array, like: Array) -> Array:
    return np.asarray(x).reshape((-1,) + (1,) * (like.ndim - 1))


def _bcast(links: comm.Links, like: Array) -> comm.Links:
    def f(v: Array) -> Array:
        v = np.asarray(v)
        return v[..., None] if like.ndim == 3 else v

    return comm.Links(f(links.intra_Bps), f(links.intra_latency_s), f(links.inter_Bps), f(links.inter_latency_s),
                      links.gpus_per_node)


def offload_Bps(ctx: Context, codes: np.ndarray) -> np.ndarray:
    """Bytes/s an offloaded state streams at per GPU, ``[C, S]``: the host link (PCIe), or for
    NVMe the slower of it and the GPU's share of the node's drives (``nvme_GBps_per_gpu``)."""
    host = ctx.hw.host_Bps / ctx.assume.bandwidth_scale
    nvme = ctx.assume.nvme_GBps_per_gpu * 1e9 / ctx.assume.bandwidth_scale
    return np.where((codes == OFFLOAD.index("nvme"))[:, None], np.minimum(host, nvme), host)
