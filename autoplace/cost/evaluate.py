"""Assemble the cost terms into memory, communication and time per device, for many plans.

:func:`evaluate_batch` scores arrays of candidates (shape ``[C]``, with per-stage layer
counts ``[C, S, K, 3]``: stage, block kind, recompute mode) in one vectorized pass; it is
the single place where memory, bytes and seconds are computed.  :func:`evaluate` is the
same function applied to one :class:`~autoplace.plan.Plan`; the solvers build their
coefficient tables from :func:`stage_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.cost.candidates import Candidates, candidates_from_plans
from autoplace.cost.layers import LayerTable
from autoplace.cost.step import bubble_shares, bubble_time, pipeline_time
from autoplace.cost.terms import COMM_PARTS, MB_PARTS, StageTerms, stage_terms
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import Precision

Array = np.ndarray
__all__ = ["COMM_PARTS", "MEMORY_PARTS", "TIME_PARTS", "Batch", "Candidates", "candidates_from_plans", "evaluate_batch",
           "per_second"]
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "reserve")
TIME_PARTS = (*MB_PARTS, "bubble", "dp", "optimizer")


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
        host: host bytes per GPU of offloaded states ``[C, S]``; host_capacity what they may use.
        comm_bytes: bytes sent per device per step by dimension ``[C, S, 6]`` (COMM_PARTS).
        time: seconds per step by part ``[C, 10]`` (TIME_PARTS), summing to ``step_time``.
        stage_time: seconds per micro-batch of each stage ``[C, S]``.
        model_flops: model FLOPs per step (no recompute) ``[C]``; hardware_flops with it.
    """

    memory: Array
    memory_phase: Array
    states: Array
    capacity: Array
    host: Array
    host_capacity: Array
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
    def host_shortfall(self) -> Array:
        """Bytes per GPU by which the offloaded states exceed the host memory (<= 0: fits)."""
        return np.where(self.stage_mask, self.host - self.host_capacity, -np.inf).max(axis=1)

    @property
    def fits(self) -> Array:
        return (self.shortfall <= 0) & (self.host_shortfall <= 0)

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
    stage_t = np.where(mask, parts_all.sum(axis=-1), 0.0)
    m, v, share = cand.ga.astype(float), cand.vpp.astype(float), bubble_shares(cand.schedule)
    tail = np.where(mask[..., None], terms.tail(n), 0.0)
    worst_tail = tail.sum(axis=-1).argmax(axis=1)
    tail_parts = tail[np.arange(cand.size), worst_tail]  # [C, 2]: dp, optimizer
    step = pipeline_time(stage_t, m, v, share) + tail_parts.sum(axis=-1)
    # the slowest stage's own micro-batches by part, and the pipeline's bubble
    slow_idx = stage_t.argmax(axis=1)
    parts = parts_all[np.arange(cand.size), slow_idx] * m[:, None]  # [C, 7]
    time = np.concatenate([parts, bubble_time(stage_t, v, share)[:, None], tail_parts], axis=1)
    return Batch(memory=memory, memory_phase=phase, states=states, capacity=terms.capacity,
                 host=terms.host(n), host_capacity=terms.host_capacity, comm_bytes=terms.comm_bytes(n), time=time,
                 stage_time=stage_t, step_time=step, model_flops=terms.model_flops, hardware_flops=terms.hardware_flops(n),
                 peak_flops_total=terms.peak_total, tokens_per_step=terms.tokens_per_step, stage_mask=mask,
                 terms=terms)
