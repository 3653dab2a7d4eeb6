"""The hardware each pipeline stage sees: the slowest and smallest GPU and links its ranks use.

Stages map onto node pools with pp outermost and pools in file order (a heterogeneous cluster
puts its first stages on its first pool).  With one pool every stage sees the same hardware,
so the stage axis has length 1 and broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.cost import comm
from autoplace.cost.attention import rates_of
from autoplace.cost.candidates import Candidates
from autoplace.cost.compute import Kernels
from autoplace.specs.cluster import ClusterSpec, GPUProfile

Array = np.ndarray


@dataclass(frozen=True)
class StageHardware:
    """Per candidate and stage ``[C, S]`` (``S`` is 1 when the cluster has one pool).

    Attributes:
        capacity: device memory of the smallest GPU the stage uses.
        host_capacity: host memory per GPU of the stage's nodes (``host_memory_GB / gpus_per_node``).
        host_Bps: host link (PCIe) bandwidth of the slowest GPU.
        links: the slowest intra- and inter-node tiers.
        span: ``[pools, C, S]`` which pools a stage's ranks lie in.
        kernels: each pool's kernel speeds in the compute dtype, 16 bit for an fp8 recipe (its
            attention, LM head and elementwise work stay in bf16: Transformer Engine converts its
            Linear modules only, Megatron-LM's output layer is a plain ColumnParallelLinear
            (gpt_model.py, core_v0.16.1), torchtitan's float8 converter skips ``output``).
        fp8_kernels: the same with GEMMs at the fp8 peak (a block's GEMMs under an fp8 recipe).
    """

    capacity: Array
    host_capacity: Array
    host_Bps: Array
    links: comm.Links
    span: Array
    kernels: tuple[Kernels, ...]
    fp8_kernels: tuple[Kernels, ...]

    def slowest(self, per_pool: list[Array]) -> Array:
        """The largest of ``per_pool`` values (one array per pool, each ``[C, 1 or S, ...]``)
        over the pools each stage spans, as ``[C, S, ...]``."""
        values = np.broadcast_arrays(*per_pool)
        mask = self.span.reshape(self.span.shape + (1,) * (values[0].ndim - 2))
        return np.where(mask, np.stack(values), -np.inf).max(axis=0)


def kernels_of(gpu: GPUProfile, dtype: str) -> Kernels:
    """The kernel speeds of ``gpu`` computing in ``dtype``.

    A tile's fixed prologue and epilogue (``gemm_k_overhead``, in bf16 K-loop elements) take the
    time in fp8 as in bf16 while each fp8 K-step runs at twice the rate, so it spans
    ``fp8 peak / bf16 peak`` times as many K elements of an fp8 loop: short-K GEMMs reach a lower
    share of the fp8 peak than of the bf16 one."""
    steps = gpu.peak_TFLOPS.for_dtype("fp8") / gpu.peak_TFLOPS.for_dtype("bf16") if dtype == "fp8" else 1.0
    return Kernels(
        peak_flops=gpu.peak_TFLOPS.for_dtype(dtype) * 1e12 * gpu.sustained_fraction,
        peak16_flops=gpu.peak_TFLOPS.for_dtype("bf16") * 1e12 * gpu.sustained_fraction,
        gemm_efficiency=gpu.gemm_efficiency.for_dtype(dtype, default=0.7),
        sm_count=gpu.sm_count, tile=(gpu.gemm_tile[0], gpu.gemm_tile[1]),
        attn=rates_of(gpu.attention_efficiency),
        hbm_Bps=gpu.hbm_bandwidth_TBps * 1e12 * gpu.hbm_efficiency, k_overhead=gpu.gemm_k_overhead * steps,
        k_ref=gpu.gemm_efficiency_k)


def stage_hardware(cluster: ClusterSpec, cand: Candidates, dtype: str) -> StageHardware:
    """Map pipeline stages onto node pools (pp outermost, pools in file order)."""
    stages = cand.counts.shape[1] if len(cluster.pools) > 1 else 1
    s = np.arange(stages)[None, :]
    per_stage = (cand.world // cand.pp)[:, None]
    lo, hi = s * per_stage, (s + 1) * per_stage
    fields: dict[str, list[Array]] = {k: [] for k in ("cap", "hostmem", "host", "ibw", "ilat", "xbw", "xlat")}
    start = 0
    spans = []
    for pool in cluster.pools:
        end = start + pool.gpus
        spans.append((lo < end) & (hi > start))
        for key, value in (("cap", pool.gpu.memory_bytes), ("hostmem", pool.host_memory_GB * 1e9 / pool.gpus_per_node),
                           ("host", pool.host_link.bytes_per_s),
                           ("ibw", pool.intra_node.bytes_per_s), ("ilat", pool.intra_node.latency_s),
                           ("xbw", pool.inter_Bps_per_gpu), ("xlat", pool.inter_node.latency_s)):
            fields[key].append(np.full(lo.shape, value))
        start = end
    span = np.stack(spans)
    span[0] |= ~span.any(axis=0)  # ranks beyond the cluster (a too-large plan): judge by pool 0

    def worst(key: str, high: bool = False) -> Array:
        values = np.stack(fields[key])
        if high:
            return np.where(span, values, -np.inf).max(axis=0)
        return np.where(span, values, np.inf).min(axis=0)

    links = comm.Links(worst("ibw"), worst("ilat", high=True), worst("xbw"), worst("xlat", high=True),
                       cluster.gpus_per_node)
    kernels = tuple(kernels_of(p.gpu, "bf16" if dtype == "fp8" else dtype) for p in cluster.pools)
    fp8 = tuple(kernels_of(p.gpu, "fp8") for p in cluster.pools)
    return StageHardware(worst("cap"), worst("hostmem"), worst("host"), links, span, kernels, fp8)
