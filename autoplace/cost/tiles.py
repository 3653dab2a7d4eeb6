"""What a tiled matmul kernel spends outside its math, shared by the GEMM rates
(:mod:`autoplace.cost.compute`) and the attention kernels' head-dim rule (:mod:`autoplace.cost.attention`)."""

from __future__ import annotations

import numpy as np

Array = np.ndarray


def k_loop_share(k: Array | float, k_overhead: float) -> Array:
    """Share of an output tile's time spent in its K loop: ``k / (k + k_overhead)``.

    Each thread block of a tiled GEMM fills its multistage operand pipeline before the first
    tensor-core step (the prologue: one memory latency) and, after the loop, converts its fp32
    accumulators and writes the output tile through shared memory (the epilogue: CUTLASS's
    ``Epilogue``, the "tiled outer product" of NVIDIA's Matrix Multiplication Background
    User's Guide, Sec. 2.1); neither grows with K, so a GEMM with a short reduction
    dimension spends a larger share of each tile outside the math.  ``k_overhead`` is that
    fixed cost in K-loop elements (a profile field, 0 where not stated).
    """
    loop = np.maximum(np.asarray(k, dtype=float), 1.0)
    return np.asarray(loop / (loop + k_overhead))
