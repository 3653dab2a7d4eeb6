"""Assemble the cost terms into memory, communication and time per device, for many plans.

:func:`evaluate_batch` scores arrays of candidates (shape ``[C]``, with per-stage layer
counts ``[C, S, K, 3]``: stage, block kind, recompute mode) in one vectorized pass; it is
the single place where memory, bytes and seconds are computed.  :func:`evaluate` is the
same function applied to one :class:`~autoplace.plan.Plan`; the solvers build their
coefficient tables from :func:`stage_terms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoplace.cost import comm
from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import SCHEDULE_CODES
from autoplace.cost.terms import MB_PARTS, StageTerms, stage_terms
from autoplace.plan import Plan, stage_mode_counts
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import Precision

Array = np.ndarray
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "reserve")
COMM_PARTS = ("dp", "tp", "pp", "cp", "ep", "offload")
TIME_PARTS = (*MB_PARTS, "bubble", "dp", "optimizer")


@dataclass(frozen=True)
class Candidates:
    """Plans as arrays: one entry per candidate; ``counts[c, s, k, r]`` blocks of kind k in
    recompute mode r on stage s (r: none, selective, full)."""

    tp: Array
    pp: Array
    cp: Array
    ep: Array
    dp_rep: Array
    dp_shard: Array
    vpp: Array
    sp: Array
    zero: Array
    mbs: Array
    ga: Array
    schedule: Array
    off_opt: Array
    off_par: Array
    counts: Array

    @property
    def size(self) -> int:
        return int(self.tp.shape[0])

    @property
    def dp(self) -> Array:
        return self.dp_rep * self.dp_shard

    @property
    def world(self) -> Array:
        return self.dp * self.tp * self.pp * self.cp


def candidates_from_plans(plans: Sequence[Plan], table: LayerTable) -> Candidates:
    """Pack plans into arrays (stages padded with empty ones up to the largest pp)."""
    stages = max(p.pp for p in plans)
    kinds = len(table.kinds)
    counts = np.zeros((len(plans), stages, kinds, 3))
    for c, plan in enumerate(plans):
        counts[c, : plan.pp] = np.asarray(stage_mode_counts(plan, table.sequence, kinds))

    def col(get: object, dtype: type = np.int64) -> Array:
        return np.array([get(p) for p in plans], dtype=dtype)  # type: ignore[operator]

    return Candidates(
        tp=col(lambda p: p.tp), pp=col(lambda p: p.pp), cp=col(lambda p: p.cp), ep=col(lambda p: p.ep),
        dp_rep=col(lambda p: p.dp_replicate), dp_shard=col(lambda p: p.dp_shard), vpp=col(lambda p: p.vpp),
        sp=col(lambda p: p.sp and p.tp > 1, bool), zero=col(lambda p: p.zero), mbs=col(lambda p: p.mbs),
        ga=col(lambda p: p.grad_accum), schedule=col(lambda p: SCHEDULE_CODES[p.schedule]),
        off_opt=col(lambda p: p.offload_optimizer != "none", bool),
        off_par=col(lambda p: p.offload_params != "none", bool), counts=counts)


# ---------------------------------------------------------------------------------------
# Hardware seen by each stage


@dataclass(frozen=True)
class StageHardware:
    """Per candidate and stage ``[C, S]``: the slowest / smallest GPU the stage's ranks use
    (``S`` is 1 when the cluster has one pool: every stage sees the same hardware)."""

    capacity: Array
    peak_flops: Array
    hbm_Bps: Array
    host_Bps: Array
    links: comm.Links
    span: Array  # [pools, C, S] which pools a stage's ranks lie in
    tables: tuple[Array, ...]  # per pool: [[GFLOP, fraction], ...]

    def efficiency(self, gemm_gflop: Array) -> Array:
        """Matmul efficiency ``[C, S, X]`` of GEMMs of ``gemm_gflop`` ``[C, X]`` GFLOP, on the
        least efficient pool of each stage (interpolated in log size, clamped at the ends)."""
        size = np.log(np.maximum(gemm_gflop, 1e-12))[:, None, :]
        per_pool = [np.interp(size, np.log(t[:, 0]), t[:, 1]) for t in self.tables]
        return np.where(self.span[..., None], np.stack(per_pool), np.inf).min(0)


def stage_hardware(cluster: ClusterSpec, cand: Candidates, dtype: str) -> StageHardware:
    """Map pipeline stages onto node pools (pp outermost, pools in file order)."""
    # one pool: every stage sees the same hardware, so keep a single stage column ([C, 1]);
    # it broadcasts against [C, S] and keeps the per-block tables S times smaller
    stages = cand.counts.shape[1] if len(cluster.pools) > 1 else 1
    s = np.arange(stages)[None, :]
    per_stage = (cand.world // cand.pp)[:, None]
    lo, hi = s * per_stage, (s + 1) * per_stage
    fields: dict[str, list[Array]] = {k: [] for k in ("cap", "peak", "hbm", "host", "ibw", "ilat", "xbw", "xlat")}
    start = 0
    spans = []
    for pool in cluster.pools:
        end = start + pool.gpus
        spans.append((lo < end) & (hi > start))
        for key, value in (("cap", pool.gpu.memory_bytes), ("peak", pool.gpu.peak_TFLOPS.for_dtype(dtype) * 1e12),
                           ("hbm", pool.gpu.hbm_bandwidth_TBps * 1e12), ("host", pool.host_link.bytes_per_s),
                           ("ibw", pool.intra_node.bytes_per_s), ("ilat", pool.intra_node.latency_s),
                           ("xbw", pool.inter_node.bytes_per_s), ("xlat", pool.inter_node.latency_s)):
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
    tables = tuple(np.asarray(p.gpu.matmul_efficiency_by_GFLOP, dtype=float) for p in cluster.pools)
    return StageHardware(worst("cap"), worst("peak"), worst("hbm"), worst("host"), links, span, tables)


# ---------------------------------------------------------------------------------------
# The assembled result


@dataclass(frozen=True)
class Batch:
    """Scores of many candidates.  ``[C, S]`` arrays are per stage; padded stages hold zeros.

    Attributes:
        memory: bytes per device by part ``[C, S, 6]`` (MEMORY_PARTS) at the stage's peak.
        memory_phase: when that peak happens ``[C, S]`` (an index into MEMORY_PHASES).
        states: params, grads, optimizer bytes once every gradient exists ``[C, S, 3]``.
        capacity: device memory ``[C, S]``.
        comm_bytes: bytes sent per device per step by dimension ``[C, S, 6]`` (COMM_PARTS).
        time: seconds per step by part ``[C, 10]`` (TIME_PARTS), summing to ``step_time``.
        stage_time: seconds per micro-batch of each stage ``[C, S]``.
        model_flops: model FLOPs per step (no recompute) ``[C]``; hardware_flops with it.
    """

    memory: Array
    memory_phase: Array
    states: Array
    capacity: Array
    comm_bytes: Array
    time: Array
    stage_time: Array
    step_time: Array
    model_flops: Array
    hardware_flops: Array
    peak_flops_total: Array
    tokens_per_step: Array
    stage_mask: Array
    terms: StageTerms

    @property
    def total_memory(self) -> Array:
        return self.memory.sum(axis=-1)

    @property
    def worst_stage(self) -> Array:
        """Index of the fullest stage (by memory use over capacity) per candidate."""
        ratio = np.where(self.stage_mask, self.total_memory / self.capacity, -np.inf)
        return ratio.argmax(axis=1)

    @property
    def peak_memory(self) -> Array:
        return self.total_memory.max(axis=1)

    @property
    def shortfall(self) -> Array:
        """Bytes by which the fullest stage exceeds its capacity (<= 0: fits)."""
        over = np.where(self.stage_mask, self.total_memory - self.capacity, -np.inf)
        return over.max(axis=1)

    @property
    def fits(self) -> Array:
        return self.shortfall <= 0

    @property
    def comm_total(self) -> Array:
        """Bytes per step of the busiest device."""
        return self.comm_bytes.sum(axis=-1).max(axis=1)

    @property
    def tokens_per_s(self) -> Array:
        return per_second(self.tokens_per_step, self.step_time)

    @property
    def mfu(self) -> Array:
        """Model FLOPs utilization (PaLM, Chowdhery et al. 2022, App. B): no recompute FLOPs."""
        return per_second(self.model_flops, self.step_time * self.peak_flops_total)


def per_second(amount: Array | float, seconds: Array | float) -> Array:
    """``amount / seconds``, and 0 where ``seconds`` is 0 (a model with nothing to compute) instead
    of inf or NaN, so every rate the evaluator reports is a finite number."""
    amount, seconds = np.broadcast_arrays(np.asarray(amount, dtype=float), np.asarray(seconds, dtype=float))
    return np.divide(amount, seconds, out=np.zeros(amount.shape), where=seconds > 0)


def evaluate_batch(table: LayerTable, cluster: ClusterSpec, cand: Candidates, recipe: Precision,
                   assume: Assumptions = DEFAULT) -> Batch:
    """Score every candidate: memory per stage, communication, step time.

    Args:
        table: the model's plan-independent numbers (:func:`autoplace.cost.layers.layer_table`).
        cluster: devices and links.
        cand: the candidates.
        recipe: bytes per parameter of each state.
        assume: modelling assumptions (or a calibration).
    """
    terms = stage_terms(table, cluster, cand, recipe, assume)
    n = cand.counts.astype(float)
    mask = np.arange(n.shape[1])[None, :] < cand.pp[:, None]
    memory, phase, states = terms.memory(n)
    parts_all = terms.stage_parts(n)
    stage_t = parts_all.sum(axis=-1)
    tail = terms.tail(n)
    m = cand.ga.astype(float)
    v = cand.vpp.astype(float)
    t_masked = np.where(mask, stage_t, 0.0)
    slowest = t_masked.max(axis=1)
    pipeline = m * slowest + (t_masked.sum(axis=1) - slowest) / v
    tail_total = np.where(mask[..., None], tail, 0.0)
    worst_tail = tail_total.sum(axis=-1).argmax(axis=1)
    tail_parts = tail_total[np.arange(cand.size), worst_tail]  # [C, 2]: dp, optimizer
    step = pipeline + tail_parts.sum(axis=-1)
    # split the pipeline time into its parts on the slowest stage, and the bubble
    slow_idx = t_masked.argmax(axis=1)
    parts = parts_all[np.arange(cand.size), slow_idx] * m[:, None]  # [C, 7]
    bubble = np.maximum(pipeline - parts.sum(axis=-1), 0.0)  # exact but for float noise
    time = np.concatenate([parts, bubble[:, None], tail_parts], axis=1)
    return Batch(memory=memory, memory_phase=phase, states=states, capacity=terms.capacity, comm_bytes=terms.comm_bytes(n), time=time,
                 stage_time=stage_t, step_time=step, model_flops=terms.model_flops, hardware_flops=terms.hardware_flops(n),
                 peak_flops_total=terms.peak_total, tokens_per_step=terms.tokens_per_step, stage_mask=mask,
                 terms=terms)
