"""Compute time per micro-batch, per kernel class, on one GPU.

A block's forward runs three classes of kernel, each at its own measured speed (the tables
live in ``hardware_profiles/gpu/*.yaml``):

* GEMMs, by shape: ``2 M N K`` FLOPs at the dtype's large-GEMM efficiency, scaled by the
  share of SMs the output tiles keep busy (cuBLAS computes ``ceil(M / tm) ceil(N / tn)`` tiles
  in waves of one per SM; the last wave's idle SMs are the wave-quantization loss, NVIDIA's
  "Matrix Multiplication Background User's Guide"), and by the share of each tile's time spent in
  its K loop relative to the measured shape's (:func:`k_loop_share`: a tile's fixed prologue and
  epilogue cost ``k_overhead`` K-steps, which a short loop -- hidden sizes of 768 to 2,048 -- does
  not amortize; a longer loop than the measured shape's runs no faster, the measured rate being
  the best over shapes); never faster than streaming its three matrices through HBM (the roofline).  Backward runs two GEMMs of the same three dimensions (input
  and weight gradients), so twice the forward time.
* attention: a flash kernel at its measured efficiency for the kernel, head dim, sequence length
  and mask (:mod:`autoplace.cost.attention`), executing half the full ``QK^T`` and ``PV`` FLOPs
  when causal; backward executes 2.5x the forward FLOPs (FlashAttention-2 Sec. 4's count).
  Without flash, the score matmuls run as GEMMs and the softmax streams the score matrix (a
  memory-bound pass).
* memory-bound kernels (norms, activations, rotary, residual adds, casts): the bytes they
  stream over the achieved HBM bandwidth.

Each kernel also costs a fixed launch/host overhead, which dominates small models and small
micro-batches.  FP8 recipes run a block's GEMMs at the fp8 peak (the same tile, wave and K-loop
shape rules: a tile's fixed prologue and epilogue are twice as many fp8 K-steps, so short-K GEMMs
reach a lower share of the fp8 peak than of the bf16 one) and add the casts of their operands,
with their amax reductions, as memory-bound passes (:data:`FP8_CASTS`); attention, norms, the LM
head and the rest stay in 16 bit (Micikevicius et al. 2022, "FP8 Formats for Deep Learning";
Transformer Engine; torchao.float8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.cost.attention import AttentionRates
from autoplace.cost.layers import Gemm
from autoplace.cost.tiles import k_loop_share

Array = np.ndarray

ATTN_TABLE_HEAD_DIM = 128.0  # a head dim when none is given (Llama's, GPT-3's)


@dataclass(frozen=True)
class Kernels:
    """One GPU's kernel speeds (a pool's profile, as numbers)."""

    peak_flops: float  # dense peak of the compute dtype, FLOP/s
    peak16_flops: float  # dense 16-bit peak (attention and fp8 recipes' non-GEMM work)
    gemm_efficiency: float  # large-GEMM fraction of ``peak_flops``
    sm_count: int
    tile: tuple[int, int]  # output tile M x N
    attn: AttentionRates  # fused attention's rates (autoplace.cost.attention)
    hbm_Bps: float  # achieved HBM bandwidth, bytes/s
    k_overhead: float = 0.0  # a tile's fixed prologue + epilogue, in K-loop elements (GPUProfile)
    k_ref: float = 4096.0  # the K at which ``gemm_efficiency`` was measured: no K runs faster

    def wave_utilization(self, m: Array | float, n: Array | float) -> Array:
        """Share of SM-slots the output tiles fill over all waves (1 when tiles fill every wave)."""
        tiles = np.ceil(np.maximum(m, 1) / self.tile[0]) * np.ceil(np.maximum(n, 1) / self.tile[1])
        return tiles / (np.ceil(tiles / self.sm_count) * self.sm_count)

    def gemm(self, m: Array | float, n: Array | float, k: Array | float, elem_bytes: float,
             k_share: bool = True, out_bytes: float | None = None) -> Array:
        """Seconds of one ``[m x k] @ [k x n]`` GEMM (its roofline with shape-dependent efficiency).

        Backward's two GEMMs (``[m x n] @ [n x k]`` and ``[k x m] @ [m x n]``) tile other pairs of
        dimensions; with training's large token dimension they fill their waves as well, and are
        taken to pay the forward's K-loop share (the input gradient loops over ``n``, which over
        a block's pairs of matrices -- QKV and output projection, the MLP's two -- spans the
        forward's set of ``k``).  ``k_share=False`` leaves the K-loop share out (unfused
        attention's batched GEMMs: the score GEMM, K = head dim, is bound by writing its
        scores, the roofline's ``m n`` term, which is what its epilogue does).  ``out_bytes``: the
        output's bytes per element when not ``elem_bytes`` (an fp8 GEMM writes bf16).
        """
        share = np.minimum(1.0, k_loop_share(k, self.k_overhead) / k_loop_share(self.k_ref, self.k_overhead)) \
            if k_share else 1.0
        eff = self.gemm_efficiency * self.wave_utilization(m, n) * share
        math = 2 * m * n * k / (self.peak_flops * eff)
        out = elem_bytes if out_bytes is None else out_bytes
        memory = ((m * k + k * n) * elem_bytes + m * n * out) / self.hbm_Bps
        return np.maximum(math, memory)

    def attention(self, flops: Array, seq: Array, causal: bool = True,
                  head_dim: float = ATTN_TABLE_HEAD_DIM, kernel: str = "fa2") -> tuple[Array, Array]:
        """Forward and backward seconds of fused attention whose full (unmasked) forward costs
        ``flops``, over sequences of ``seq`` keys, with heads of ``head_dim``, run by ``kernel``
        (:meth:`autoplace.cost.attention.AttentionRates.seconds`)."""
        return self.attn.seconds(flops, seq, self.peak16_flops, head_dim, causal, kernel)

    def stream(self, nbytes: Array) -> Array:
        """Seconds of memory-bound kernels moving ``nbytes`` through HBM."""
        return nbytes / self.hbm_Bps


def gemms_forward(kernels: Kernels, gemms: tuple[Gemm, ...], tokens: Array, tp: Array, ep: Array | float,
                  elem_bytes: float, out_bytes: float | None = None) -> Array:
    """Forward seconds of a block's matmuls for ``tokens`` tokens on one device.

    Tensor parallelism divides each matmul's split dimension; a routed expert's matmul runs
    once per local expert (``experts / ep``) on the tokens routed to it (``tokens * ep *
    top_k / experts`` with balanced routing).
    """
    total = np.zeros(np.broadcast_shapes(np.shape(tokens), np.shape(tp), np.shape(ep)))
    for g in gemms:
        n = g.n / tp if g.split == "n" else g.n
        k = g.k / tp if g.split == "k" else g.k
        routed = tokens * ep * g.top_k / g.experts if g.experts else tokens
        count = g.experts / np.asarray(ep, dtype=float) if g.experts else 1.0
        total = total + count * kernels.gemm(routed, n, k, elem_bytes, out_bytes=out_bytes)
    return total


# HBM bytes per element the fp8 casts of one GEMM operand stream over a training step (forward and
# backward together), by scaling recipe: (activation input, weight, output gradient, and the backward
# GEMMs' outputs: the input gradient ``tokens x k`` and the weight gradient ``k x n``).  An amax pass
# reads the 16-bit tensor (2); a cast reads it (2) and writes fp8 (1) per layout it writes.
# torchao (torchao/testing/training/roofline_utils.py get_tensor_memory_traffic_ovhd_s, the model
# behind the torchao float8 README's per-shape speedup tables, pytorch/ao 36027d8, unfused):
#   tensorwise: amax (2) + one cast writing both layouts (2 + 1 + 1) = 6 for the input and the
#     output gradient; the weight is cast once per layout, forward and backward: 2 + 3 + 3 = 8;
#   rowwise: per-row amax fuses into the cast, but the transposed layout needs its own scales: a
#     16-bit transpose and a second cast: input / gradient 5 + 3 = 8, weight 3 + 4 + 3 = 10;
#   mxfp8 (torchao's mxfp8_cublas): two casts, one per layout, 3 + 3 = 6 each.
#   Unfused even when compiled: the roofline's fusion modeling (an activation's first read fused into
#   the op producing it) is off by default, and the README says torch.compile's limitations keep its
#   scaling kernels from the optimum (torchao/float8/README.md, "torch.compile behavior vs speedup");
#   fusing them here over-predicted the development set's compiled fp8 runs further (+3.8% signed).
# torchao's rowwise backward GEMMs run without fast accumulation, where "the rowwise CUTLASS-based kernel
# is so slow ... that we'd rather use the tensorwise cuBLAS-based kernel and do the scaling manually
# afterwards" (torchao/float8/float8_ops.py addmm_float8_unwrapped; config.py: only the forward GEMM
# has use_fast_accum=True): one more pass over each backward output, read and written in bf16 (2 + 2).
# Transformer Engine (Megatron-LM's --fp8-recipe): DelayedScaling takes its scale from the amax
# history of earlier steps (TE common API, recipe.DelayedScaling: "use scale factor from previous
# iteration"), so one fused cast-transpose reads the tensor once and writes both fp8 layouts (Hopper's
# fp8 GEMMs take TN operands only), recording the amax as it goes: 2 + 1 + 1 = 4; Float8CurrentScaling
# (tensorwise) computes the amax first (nvte_compute_amax, TE's C API) then casts: 2 + 4 = 6;
# MXFP8BlockScaling quantizes both layouts in one kernel with a 1-byte scale per 32 values: 4 + 2/32.
FP8_CASTS: dict[str, dict[str, tuple[float, float, float, float]]] = {
    "torchao": {"tensorwise": (6.0, 8.0, 6.0, 0.0), "rowwise": (8.0, 10.0, 8.0, 4.0), "mxfp8": (6.0, 6.0, 6.0, 0.0),
                "delayed": (4.0, 4.0, 4.0, 0.0)},  # torchao has no delayed recipe today: TE's
    "transformer_engine": {"tensorwise": (6.0, 6.0, 6.0, 0.0), "rowwise": (8.0, 10.0, 8.0, 4.0),  # no TE rowwise: torchao's
                           "mxfp8": (4.0625, 4.0625, 4.0625, 0.0), "delayed": (4.0, 4.0, 4.0, 0.0)},
}
# the recipe a model file's ``compute_dtype: fp8`` runs when the plan names none: Megatron-LM's
# --fp8-recipe default (megatron_lm_flags.json, core_v0.16.1) and torchtitan's float8 converter default
FP8_DEFAULT_RECIPE = {"torchao": "tensorwise", "transformer_engine": "delayed"}


def fp8_cast_bytes(gemms: tuple[Gemm, ...], tokens: Array, tp: Array, ep: Array,
                   per_operand: tuple[Array, Array, Array, Array]) -> tuple[Array, Array]:
    """Bytes the fp8 casts of a block's GEMM operands stream per micro-batch: the forward's (the
    activation inputs, ``tokens x k``, and weights, ``k x n``; a recomputed forward casts them
    again) and the backward's (the output gradients, ``tokens x n``, and any rescale of the
    backward GEMMs' outputs).  ``per_operand`` holds the bytes per element of each role
    (:data:`FP8_CASTS`, a weight cast cached over micro-batches already divided by them), each
    broadcastable against ``tokens``."""
    shape = np.broadcast_shapes(np.shape(tokens), np.shape(tp), np.shape(ep))
    forward, backward = np.zeros(shape), np.zeros(shape)
    b_in, b_weight, b_grad, b_rescale = per_operand
    for g in gemms:
        n = g.n / tp if g.split == "n" else g.n
        k = g.k / tp if g.split == "k" else g.k
        local = g.experts / ep if g.experts else 1.0
        rows = tokens * (g.top_k if g.experts else 1)  # balanced routing: every local expert's rows together
        forward = forward + b_in * rows * k + b_weight * n * k * local
        backward = backward + b_grad * rows * n + b_rescale * (rows * k + n * k * local)
    return forward, backward
