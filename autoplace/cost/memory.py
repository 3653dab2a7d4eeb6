"""Memory per device: model states, activations, buffers and reserve.

Model states follow ZeRO (Rajbhandari et al. 2020, Sec. 5.1, Table 1): with Ψ parameters on
a device and ``N`` ranks sharing the states, bytes are
``param*Ψ/(N if zero>=3) + grad*Ψ/(N if zero>=2) + K*Ψ/(N if zero>=1)``.

Activations follow Korthikanti et al. 2022 (Sec. 4, Table 2) per layer, times the
micro-batches a pipeline stage holds in flight (Sec. 4.2.3 and Narayanan et al. 2021).
Everything broadcasts over numpy arrays of candidates (and stages).
"""

from __future__ import annotations

import numpy as np

from autoplace.plan import LOOPED, SCHEDULES, V_PLACED

Array = np.ndarray

# autoplace.plan.SCHEDULES as the integers the candidate arrays carry, and its looped and V placements
SCHEDULE_CODES = {name: code for code, name in enumerate(SCHEDULES)}
LOOPED_CODES = tuple(sorted(SCHEDULE_CODES[s] for s in LOOPED))
V_CODES = tuple(sorted(SCHEDULE_CODES[s] for s in V_PLACED))


def state_bytes(params: Array, bytes_per_param: float | Array, shards: Array, sharded: Array | bool,
                offloaded: Array | bool, padding: Array | float = 0.0) -> Array:
    """Bytes of one model state: ``Ψ * bytes / N`` when sharded, 0 on the device when offloaded.

    ``padding``: what sharding adds to ``params`` first (FSDP2's dim-0 chunks: :mod:`autoplace.cost.shards`)."""
    per = (params + np.where(sharded, padding, 0.0)) * bytes_per_param / np.where(sharded, shards, 1)
    return np.where(offloaded, 0.0, per)


def block_activation_bytes(tokens: Array, tp: Array, sp: Array, act_rep: Array, act_tp: Array,
                           act_score: Array, act_input: Array) -> Array:
    """Activation bytes one block keeps for backward, per recompute mode (last axis: none, selective, full).

    Args:
        tokens: tokens of one micro-batch on this device (``b*s/cp``).
        tp, sp: tensor-parallel degree and whether sequence parallelism shards the rest.
        act_rep, act_tp, act_score, act_input: the block kind's per-token coefficients.

    Korthikanti Table 2: none ``sbh(10 + 24/t + 5as/(ht))``; with SP ``sbh(34/t + 5as/(ht))``;
    selective recompute drops the ``5as/h`` score term; full recompute keeps only the input
    (``2sbh``, sharded by SP as Megatron-Core keeps it).
    """
    sp_div = np.where(sp, tp, 1)
    kept = act_rep / sp_div + act_tp / tp
    none = tokens * (kept + act_score / tp)
    selective = tokens * kept
    full = tokens * act_input / sp_div
    return np.stack(np.broadcast_arrays(none, selective, full), axis=-1)


def inflight_microbatches(schedule: Array, pp: Array, vpp: Array, microbatches: Array, stage: Array) -> Array:
    """Micro-batches whose activations a stage holds at its peak, in units of its whole layer set.

    GPipe keeps all ``m``.  1F1B keeps ``min(p - i, m)`` on stage ``i`` (Narayanan et al. 2021,
    Sec. 2.2.1).  Interleaved 1F1B with ``v`` chunks keeps ``2(p-i-1) + (v-1)p + 1`` chunk
    micro-batches (Megatron-LM's warm-up count), each ``1/v`` of the stage's layers; on stage 0
    that is Korthikanti's factor ``1 + (p-1)/(pv)`` (Sec. 4.2.3).

    The zero-bubble schedules hold what the schedule they refine holds: ZB1P (interleaved-zb) delays
    each W pass only into the bubbles, so every stage keeps 1F1B's in-flight micro-batches, and the
    activations a W pass still needs are among those (Qi et al. 2024, Sec. 2.1 and Table 1: W needs
    less than B, "peak memory no greater than 1F1B"); the looped chunks keep interleaved 1F1B's count.
    ZB-V keeps ``p`` whole-stage micro-batches on every rank, 1F1B's first stage's (its authors'
    comparison: activation memory 1x of 1F1B), its V balancing the ranks rather than loading the first.
    DualPipeV keeps ``PP + 1`` of its ``PP = 2p`` stages' micro-batches on every rank (deepseek-ai/DualPipe
    README's table, DeepSeek-V3 report Table 2's DualPipe row): ``p + 1/2`` whole-stage micro-batches.
    """
    m = microbatches
    one_f1b = np.minimum(pp - stage, m)
    chunks = np.minimum(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, m * vpp)
    interleaved = chunks / vpp
    zbv = np.minimum(pp, m) + 0 * stage
    dual = np.minimum(pp + 0.5, m) + 0 * stage
    codes = SCHEDULE_CODES
    return np.select([schedule == codes["gpipe"], np.isin(schedule, LOOPED_CODES), schedule == codes["zbv"],
                      schedule == codes["dualpipev"]],
                     [m, interleaved, zbv, dual], one_f1b).astype(float)


def chunk_inflight(pp: Array | int, vpp: Array | int, microbatches: Array | int, stage: Array | int,
                   chunk: Array | int) -> Array:
    """Micro-batches of model chunk ``chunk`` a stage holds at its peak under interleaved 1F1B.

    Megatron-LM's warm-up runs ``2(p-i-1) + (v-1)p + 1`` forward chunk passes on stage ``i``
    (:func:`inflight_microbatches`; megatron-core 0.16.1 pipeline_parallel/schedules.py
    ``num_warmup_microbatches``), taking the chunks in turn for each group of ``p`` micro-batches
    (``get_schedule_table`` with its default group of ``p``: the k-th forward runs chunk
    ``(k // p) % v``), so whole rounds give each chunk ``p`` and the last, partial round the
    first chunks what is left."""
    warmup = np.minimum(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, microbatches * vpp)
    rounds, left = np.divmod(warmup, pp * vpp)
    return rounds * pp + np.clip(left - chunk * pp, 0, pp)


def slot_inflight(pp: Array | int, vpp: Array | int, microbatches: Array | int, stage: Array | int,
                  units: Array | int, embedding: Array | int, loss: Array | int) -> tuple[Array, Array]:
    """In-flight micro-batches per block, at the start of backward and at the end of the first
    backward, on a stage of ``units`` units (blocks and the embedding / loss places,
    :func:`autoplace.plan.stage_slots`) whose first chunk holds ``embedding`` and last chunk
    ``loss`` in place of a block: the chunks' in-flight counts (:func:`chunk_inflight`) weighed by
    their blocks, over the stage's blocks.  The first chunk is in flight most (one block fewer
    there holds less than the stage average), the last least; the first backward frees one
    micro-batch of the last chunk.  Without those places, :func:`inflight_microbatches` and one
    average chunk fewer."""
    chunk = units / vpp
    warmup = np.minimum(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, microbatches * vpp)
    held = (chunk * warmup - embedding * chunk_inflight(pp, vpp, microbatches, stage, 0)
            - loss * chunk_inflight(pp, vpp, microbatches, stage, vpp - 1))
    blocks = np.maximum(units - embedding - loss, 1)
    return held / blocks, np.maximum(held - (chunk - loss), 0.0) / blocks


def gather_buffer_bytes(reduced: Array, gathered: Array, param_bytes: float, grad_bytes: float, prefetch: int) -> Array:
    """ZeRO-3 / FSDP unshard buffers at their fullest: the ``reduced`` unit's gradient in its
    reduce-scatter buffer while the next unit and ``prefetch`` more (``gathered`` parameters
    each) are all-gathered (FSDP2's all-gather / reduce-scatter buffers, measured with
    FSDPMemTracker; ZeRO-3's ``stage3_prefetch_bucket_size``)."""
    return reduced * grad_bytes + (1 + prefetch) * gathered * param_bytes


def reserve_bytes(capacity: Array, fraction: float, framework_GiB: float) -> Array:
    """Memory the job cannot use: allocator fragmentation share plus the framework's fixed part."""
    return capacity * fraction + framework_GiB * 2**30
