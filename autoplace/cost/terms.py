"""Per-stage cost terms, linear in the layer counts: the tables both the evaluator and the
CP-SAT model use (one source of truth).

For candidate ``c``, stage ``s``, block kind ``k`` and recompute mode ``r`` (none,
selective, full), with ``n[c, s, k, r]`` blocks placed there:

* memory(s)      = max over two phases f of
                   static(s, f) + sum n * live(s, f) * state_block(k) + mult(s, f) * sum n * act_block(k, r)
* host(s)        = host_static(s) + sum n * host_block(k)                 (offloaded states)
* micro-batch(s) = static(s) + sum n * t_block(s, k, r)                   (seconds, by part)
* tail(s)        = exposed_reduction(reduce(s), window(s), last_bucket(s)) + gather(s) + optimizer(s)

where reduce, window, gather and optimizer are linear in the counts (:mod:`autoplace.cost.step`
has the formula).  The two memory phases are the moments a training step's memory can peak
(FSDPMemTracker shows both): the start of backward (every in-flight micro-batch's
activations, the loss's fp32 workspace, gradients only if an earlier micro-batch of the step
already made them) and the end of the first backward (one micro-batch's activations freed,
every gradient allocated).  A plan fits when both do and its host memory does, so each stays
linear and the CP-SAT model adds one constraint each.

The tables come from :mod:`autoplace.cost.terms_memory` and :mod:`autoplace.cost.terms_time`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from autoplace.cost.assumptions import Assumptions
from autoplace.cost.candidates import Candidates
from autoplace.cost.context import context, head_stage
from autoplace.cost.layers import LayerTable
from autoplace.cost.step import exposed_reduction
from autoplace.cost.terms_memory import MemoryTerms, memory_terms
from autoplace.cost.terms_time import COMM_PARTS, MB_PARTS, TimeTerms, time_terms
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import Precision

Array = np.ndarray
MEMORY_PHASES = ("bwd start", "bwd end")  # start of backward; end of the first backward
__all__ = ["COMM_PARTS", "MB_PARTS", "MEMORY_PHASES", "StageTerms", "stage_terms"]


@dataclass(frozen=True)
class StageTerms(MemoryTerms, TimeTerms):
    """Coefficient tables; shapes in brackets (C candidates, S stages, K kinds, R=3 modes)
    are documented on :class:`MemoryTerms` and :class:`TimeTerms`."""

    flops_block: Array  # [C, 1, K, R]  hardware FLOPs per step per device
    flops_static: Array  # [C, S]
    slowdown: float  # share of hidden communication that still costs compute time
    capacity: Array  # [C, S]
    model_flops: Array  # [C]
    peak_total: Array  # [C]
    tokens_per_step: Array  # [C]

    # -- assembly (used by evaluate_batch; the CP-SAT model reads the tables directly) --

    def memory(self, n: Array) -> tuple[Array, Array, Array]:
        """Bytes per device by MEMORY_PARTS in the fuller memory phase ``[C, S, 6]``, that phase
        ``[C, S]`` (0: start of backward, 1: end of the first backward), and the model states
        once every gradient exists ``[C, S, 3]`` (the end of backward)."""
        per_stage = n.sum(axis=-1)  # [C, S, K]
        states = np.einsum("csk,cokp->csp", per_stage, self.state_block)[:, :, None, :] * self.state_live  # [C,S,2,4]
        acts = np.einsum("cskr,cokr->cs", n, self.act_block)
        phases = self.mem_static.copy()  # [C, S, 2, 6]
        phases[..., :3] += states[..., :3]
        phases[..., 0] += states[..., 3]  # the unsharded copies after a backward are params
        phases[..., 3] += self.act_mult * acts[..., None]
        fuller = phases.sum(-1).argmax(-1)  # [C, S]
        return np.take_along_axis(phases, fuller[..., None, None], axis=2)[:, :, 0], fuller, phases[:, :, 1, :3]

    @cached_property
    def phases(self) -> tuple[Array, Array, Array]:
        """Each memory phase as ``static + sum_k count_k * per_block_k + mult * sum n * act_block``.

        Returns ``static [C, S, 2]``, ``per_block [C, S, 2, K]`` (state bytes of one block)
        and ``mult [C, S, 2]``; a stage fits when every phase does.
        """
        block, live = self.state_block[:, :, None], self.state_live[:, :, :, None]  # [C,1,1,K,4], [C,S,F,1,4]
        # written out (an einsum over the columns runs four times slower): params and optimizer, then
        # gradients, then the unsharded copies a pipeline leaves after a backward
        per_block = ((block[..., 0] * live[..., 0] + block[..., 2] * live[..., 2]) + block[..., 1] * live[..., 1]
                     + block[..., 3] * live[..., 3])
        return self.mem_static.sum(-1), per_block, self.act_mult

    def binding_phases(self, i: int, stages: int) -> list[int]:
        """The phases of candidate ``i`` that can bind: a phase whose every coefficient is at
        most another's never does (with many micro-batches gradients are alive in both
        phases and the start of backward always holds more)."""
        static, per_block, mult = (x[i, :stages] for x in self.phases)

        def below(f: int, g: int) -> bool:
            return bool((static[:, f] <= static[:, g]).all() and (per_block[:, f] <= per_block[:, g]).all()
                        and (mult[:, f] <= mult[:, g]).all())

        return [0] if below(1, 0) else [1] if below(0, 1) else [0, 1]

    def host(self, n: Array) -> Array:
        """Host bytes per GPU of offloaded states on every stage ``[C, S]``."""
        return self.host_static + np.einsum("csk,csk->cs", n.sum(axis=-1), self.host_block)

    def stage_parts(self, n: Array) -> Array:
        """Seconds per micro-batch of every stage by MB_PARTS, ``[C, S, 7]``."""
        return self.t_static + np.einsum("cskr,cskrp->csp", n, self.t_block)

    def tail(self, n: Array) -> Array:
        """Once-per-step seconds of every stage: exposed data-parallel comm, optimizer ``[C, S, 2]``.

        The reduction hides under the backward of the step's last micro-batch without its
        recompute, so recompute choices never buy overlap and the search stays separable.
        """
        per_stage = n.sum(axis=-1)

        def linear(static: Array, block: Array) -> Array:
            return static + np.einsum("csk,csk->cs", per_stage, block)

        reduce = linear(self.reduce_static, self.reduce_block)
        window = linear(self.window_static, self.window_block)
        dp = exposed_reduction(reduce, window, self.last_bucket, self.slowdown) + linear(self.gather_static, self.gather_block)
        return np.stack([dp, linear(self.opt_static, self.opt_block)], axis=-1)

    def tail_at(self, i: int, s: Array, counts: Array) -> Array:
        """:meth:`tail` (dp + optimizer, summed) of candidate ``i``'s stages ``s`` holding
        ``counts[..., K]`` blocks of each kind (``s`` broadcasts against ``counts[..., 0]``)."""
        def linear(static: Array, block: Array) -> Array:
            return static[i, s] + (counts * block[i, s]).sum(axis=-1)

        reduce = linear(self.reduce_static, self.reduce_block)
        window = linear(self.window_static, self.window_block)
        return (exposed_reduction(reduce, window, self.last_bucket[i, s], self.slowdown)
                + linear(self.gather_static + self.opt_static, self.gather_block + self.opt_block))

    def comm_bytes(self, n: Array) -> Array:
        return self.bytes_static + np.einsum("cskr,cokrp->csp", n, self.bytes_block)

    def hardware_flops(self, n: Array) -> Array:
        """FLOPs per step summed over all devices, recompute included (Megatron's counting)."""
        return self.flops_static.sum(axis=1) + np.einsum("cskr,cokr->c", n, self.flops_block)


def stage_terms(table: LayerTable, cluster: ClusterSpec, cand: Candidates, recipe: Precision,
                assume: Assumptions) -> StageTerms:
    """Build every coefficient table for the candidates (see the module docstring)."""
    ctx = context(table, cluster, cand, recipe, assume)
    mem = memory_terms(ctx)
    ends = ctx.ends()  # a deep pipeline's time terms on its first, second and last stages only
    tim = time_terms(ends or ctx, mem.act_block[..., 0])
    if ends is not None:
        tim = TimeTerms(**{f.name: ends.spread(getattr(tim, f.name), ctx.S) for f in fields(TimeTerms)})
    c = cand
    tp, cp, pp = (x.astype(float) for x in (c.tp, c.cp, c.pp))
    ga = c.ga.astype(float)
    world = c.world.astype(float)
    full = np.array([0.0, 0.0, 1.0]).reshape(1, 1, 1, 3)
    sel = np.array([0.0, 1.0, 0.0]).reshape(1, 1, 1, 3)
    col, kind = ctx.col, ctx.kind
    mb_total = ga * world / (tp * pp * cp)  # micro-batches per step on all pipelines
    # forward, backward (a frozen matmul computes its input gradient only) and recompute
    trained = 3 * kind("flops") - kind("frozen_flops")
    flops_mb = col(ctx.tokens) * (trained + sel * kind("flops_score") + full * kind("flops")) / col(tp)
    flops_block = flops_mb * col(mb_total * tp * cp)  # per step, over all devices of the stage
    h = table.head
    head_passes = 2.0 if table.frozen else 3.0
    head_flops = ctx.last * (ctx.tokens[:, None] * head_passes * h.flops / tp[:, None])
    n_blocks = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds)).astype(float)
    n_blocks[-1] += table.mtp  # the multi-token-prediction modules' kind is the last (LayerTable.mtp)
    step_tok = float((n_blocks * trained.ravel()).sum() + head_passes * h.flops)  # model FLOPs per token
    tokens_step = c.mbs * ga * c.dp * table.seq_len
    pools_peak = sum(p.gpus * p.gpu.peak_TFLOPS.for_dtype(recipe.compute_dtype) * 1e12 for p in cluster.pools)
    parts = {f.name: getattr(mem, f.name) for f in fields(MemoryTerms)} | {f.name: getattr(tim, f.name) for f in fields(TimeTerms)}
    terms = StageTerms(
        **parts, flops_block=flops_block, flops_static=ctx.stage(head_flops * (mb_total * tp * cp)[:, None]),
        slowdown=assume.overlap_slowdown, capacity=ctx.stage(ctx.hw.capacity),
        model_flops=step_tok * tokens_step, peak_total=world * pools_peak / cluster.gpus, tokens_per_step=tokens_step)
    return _with_fixed_blocks(terms, mtp_counts(table, cand, terms.t_static.shape[1])) if table.mtp else terms


def mtp_counts(table: LayerTable, cand: Candidates, stages: int) -> Array:
    """``n[c, s, k, r]`` of the multi-token-prediction modules: ``table.mtp`` blocks of the last kind
    on the stage holding the loss, without recompute ([C, S, K, R]).  Megatron-Core 0.16 recomputes
    them only under uniform full recompute (``MultiTokenPredictionLayer._checkpointed_forward``):
    counted eager, their activations are an upper bound there."""
    n = np.zeros((cand.size, stages, len(table.kinds), 3))
    n[np.arange(cand.size), head_stage(cand), -1, 0] = table.mtp
    return n


def _with_fixed_blocks(t: StageTerms, n: Array) -> StageTerms:
    """``t`` with blocks ``n[c, s, k, r]`` that no split moves (the multi-token-prediction modules)
    folded into the static terms of their stages: every table stays linear in the blocks the split
    places, and a stage's totals are those of :meth:`StageTerms.memory`, :meth:`~StageTerms.stage_parts`
    and the rest with ``n`` added to its counts."""
    per_stage = n.sum(axis=-1)
    states = np.einsum("csk,cokp->csp", per_stage, t.state_block)[:, :, None, :] * t.state_live  # [C, S, 2, 4]
    mem = t.mem_static.copy()
    mem[..., :3] += states[..., :3]
    mem[..., 0] += states[..., 3]
    mem[..., 3] += t.act_mult * np.einsum("cskr,cokr->cs", n, t.act_block)[..., None]

    def linear(static: Array, block: Array) -> Array:
        return static + np.einsum("csk,csk->cs", per_stage, block)

    return dataclasses.replace(
        t, mem_static=mem, host_static=linear(t.host_static, t.host_block),
        t_static=t.t_static + np.einsum("cskr,cskrp->csp", n, t.t_block),
        reduce_static=linear(t.reduce_static, t.reduce_block), window_static=linear(t.window_static, t.window_block),
        gather_static=linear(t.gather_static, t.gather_block), opt_static=linear(t.opt_static, t.opt_block),
        bytes_static=t.bytes_static + np.einsum("cskr,cokrp->csp", n, t.bytes_block),
        flops_static=t.flops_static + np.einsum("cskr,cokr->cs", n, t.flops_block))
