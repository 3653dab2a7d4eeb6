"""Memory coefficient tables: device memory in two phases, and host memory of offloaded states.

Device memory (see :mod:`autoplace.cost.terms`): per stage and phase,
``static + sum n * live * state_block + mult * sum n * act_block``.  Host memory: what the
stage's GPUs offload (optimizer state with its fp32 gradients, parameters), per GPU, against
that GPU's share of its node's host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.cost import flat
from autoplace.cost.context import Context
from autoplace.cost.layers import SWIGLU_KEPT
from autoplace.cost.memory import (
    LOOPED_CODES,
    V_CODES,
    block_activation_bytes,
    gather_buffer_bytes,
    inflight_microbatches,
    reserve_bytes,
    slot_inflight,
    state_bytes,
)
from autoplace.cost.terms_time import zero3_buckets
from autoplace.plan import OFFLOAD

Array = np.ndarray
# the per-block state columns: the three model states, then the parameters' unsharded copies a
# pipeline leaves after a backward (alive at the end of the first backward, counted as params)
STATE_COLUMNS = ("params", "grads", "optimizer", "params after backward")
FP32 = 4.0  # bytes of an fp32 weight


@dataclass(frozen=True)
class MemoryTerms:
    state_block: Array  # [C, 1, K, 4]  STATE_COLUMNS bytes per block
    act_block: Array  # [C, 1, K, R]   activation bytes per block per in-flight micro-batch
    state_live: Array  # [C, S, 2, 4]  share of each column alive in each memory phase
    act_mult: Array  # [C, S, 2]      in-flight micro-batches (whole stages) in each phase
    mem_static: Array  # [C, S, 2, 6] MEMORY_PARTS for the edges, buffers and reserve per phase
    host_block: Array  # [C, S, K]     host bytes per block per GPU
    host_static: Array  # [C, S]
    host_capacity: Array  # [C, S]     host bytes per GPU the offloaded states may use


def memory_terms(ctx: Context) -> MemoryTerms:
    """Device and host memory tables of every candidate (see the module docstring)."""
    c, recipe, assume, table = ctx.cand, ctx.recipe, ctx.assume, ctx.table
    C, S = ctx.C, ctx.S
    col, kind = ctx.col, ctx.kind
    pb, gb = recipe.param_bytes, recipe.grad_bytes
    pgb, rgb = recipe.gather_bytes, recipe.reduce_bytes  # on the wire and in unshard buffers
    tp = c.tp.astype(float)
    sp_div = np.where(c.sp, tp, 1.0)
    zero = c.zero
    z_sh, ez_sh = col(ctx.size["zero"]), col(ctx.size["ezero"])
    z = col(zero)
    # a ZeRO that clones fp32 weights into an fp32 master keeps both (Assumptions.zero_master_clone);
    # LoRA adapters may stay fp32 under ZeRO-3 (Assumptions.zero3_adapters_fp32)
    clone = col(ctx.master_clone) > 0
    fp32_adapters = col((zero >= 3) & assume.zero3_adapters_fp32 & table.frozen) > 0
    pb_train = np.where(fp32_adapters, FP32, pb)
    ob = recipe.optimizer_bytes + np.where(clone, pb, 0.0)

    # Without a separate master copy (fp32 training, FSDP2's fp32 shards) the stored weights are
    # the master: ZeRO-2 shards them like optimizer state and keeps the gathered copy (FSDP2's
    # reshard_after_forward=False) for the whole step; so does ZeRO-0 run as FSDP2 over a shard
    # group of one (Assumptions.replicas_keep_gathered).
    replicas = (z == 0) & assume.replicas_keep_gathered & (col(ctx.wire.rank) == 0)
    shard_and_gathered = ((z == 2) | replicas) & (not recipe.master_copy) & ~clone
    p_sharded = (z >= 3) | shard_and_gathered
    # ZeRO++'s hpZ keeps a secondary 16-bit shard of the weights over the node-local part of the
    # shard group; PowerSGD keeps an error-feedback copy of every gradient it reduces (its hook's
    # error_dict, one per bucket) -- Wang et al. 2023 (hpZ), Vogels et al. 2019 Alg. 2 (error feedback)
    hpz = col(ctx.wire.zeropp) * ctx.wire.gather_bwd[:, None, None, None]
    error_feedback = col(ctx.wire.rank > 0)
    # DDP's reducer buckets beside autograd's .grad (Assumptions.ddp_bucket_copy): plain data parallelism
    ddp_copy = assume.ddp_bucket_copy & (ctx.size["dp"] > 1) & ((zero == 0) | (ctx.size["zero"] == 1))

    # a pipeline that defers FSDP2's gradient sync to the last micro-batch keeps every gradient
    # unsharded, in the reduce dtype, from the first backward on (Assumptions.pipeline_defers_grad_sync);
    # nor does it reshard after backward: each ZeRO-3 unit, resharded after its forward, is left
    # all-gathered by its backward until its next forward, so the end of a backward holds every
    # unit's unsharded copy (ZeRO-2's units keep theirs gathered anyway)
    deferred = col(ctx.deferred_sync) > 0
    after_backward = deferred & (z >= 3)
    # with the optimizer offloaded, ZeRO-2/3 reduce each gradient partition straight to the host
    # (DeepSpeed ZeRO-Offload; FSDP2's CPUOffloadPolicy): the device keeps only the buckets -- unless
    # the reduce is deferred: FSDP2 then accumulates the unsharded gradients on the device until the
    # schedule's last backward (FSDPParam.to_accumulated_grad_if_needed casts them where they are; only
    # the reduce-scatter output goes to the host: foreach_reduce, torch 2.13; the torchtitan dry run counts them)
    grads_off = (col(c.off_opt) * (z >= 2) > 0) & ~deferred
    g_sharded, g_bytes = (z >= 2) & ~deferred, np.where(deferred, rgb, gb)
    # optimizer states off the device: offloaded, or paged out to the host (paged optimizers)
    opt_off = col(c.off_opt) + table.paged_optimizer > 0

    def states(dense: Array, expert: Array, frozen: tuple[Array, Array, Array, Array],
               pad: tuple[Array, Array, Array, Array]) -> Array:
        """STATE_COLUMNS bytes of ``dense`` and ``expert`` trainable parameters and of a frozen
        base (``frozen``: dense and expert stored bytes, then their gathered bytes), which has no
        gradient and no optimizer state: ZeRO-3 shards it like any parameter, ZeRO-1/2 keep it
        whole, FSDP2's ZeRO-2 keeps it sharded and gathered.  ``pad``: FSDP2's padding elements of
        the dense, expert, frozen dense and frozen expert tensors (Context.pad_*)."""
        pd, pe, pfd, pfe = pad
        gathered = (dense + pd + expert + pe + pfd + pfe) * pgb + frozen[2] + frozen[3]  # all-gather outputs
        kept = np.where(shard_and_gathered, gathered, 0.0)
        secondary = hpz * (dense / col(ctx.n_in["zero"]) + expert / col(ctx.n_in["ezero"]))
        base = (state_bytes(frozen[0], 1.0, z_sh, p_sharded, col(c.off_par), pfd * ctx.base_bytes)
                + state_bytes(frozen[1], 1.0, ez_sh, p_sharded, col(c.off_par), pfe * ctx.base_bytes))
        return np.concatenate([
            state_bytes(dense, pb_train, z_sh, p_sharded, col(c.off_par), pd)
            + state_bytes(expert, pb_train, ez_sh, p_sharded, col(c.off_par), pe) + kept + secondary + base,
            state_bytes(dense, g_bytes, z_sh, g_sharded, grads_off, pd) * (1 + error_feedback + col(ddp_copy))
            + state_bytes(expert, g_bytes, ez_sh, g_sharded, grads_off, pe) * (1 + col(ddp_copy)),
            state_bytes(dense, ob, z_sh, z >= 1, opt_off, pd) + state_bytes(expert, ob, ez_sh, z >= 1, opt_off, pe),
            np.where(after_backward, gathered, 0.0),
        ], axis=-1)

    state_block = states(ctx.train_dense, ctx.train_exp, (ctx.frozen_dense, ctx.frozen_exp, ctx.frozen_dense_wire,
                                                          ctx.frozen_exp_wire),
                         (ctx.pad_dense, ctx.pad_exp, ctx.pad_frozen_dense, ctx.pad_frozen_exp))  # [C,1,K,4]
    state_block[..., :1] += ctx.quant_state  # QLoRA's constants: whole on every rank, never offloaded
    # compiled (fused) MLP activations keep fewer tensors (BlockKind.act_fused); uncompiled, the
    # framework's own SwiGLU kernel may keep fewer than eager PyTorch's four f-wide tensors
    # (Megatron-Core's bias_swiglu_impl saves only its 2f-wide input; fc2 keeps the product)
    eager_glu = kind("act_glu") * (SWIGLU_KEPT - assume.swiglu_kept)
    fused_mlp = c.compile | (c.fused_loss & assume.fused_loss_fuses_mlp)
    act_tp = kind("act_tp") - np.where(col(fused_mlp), kind("act_fused"), eager_glu)
    # transformers' eager RMSNorm keeps an fp32 copy of its input (Assumptions.rmsnorm_upcast_kept);
    # compiled, or replaced by Liger's kernels beside its fused loss, it keeps a fused kernel's
    upcast = np.where(col(fused_mlp), 0.0, float(assume.rmsnorm_upcast_kept))
    act_rep = kind("act_rep") + kind("act_norm_upcast") * upcast
    act_block = block_activation_bytes(col(ctx.tokens), col(tp), col(c.sp), act_rep, act_tp,
                                       kind("act_score"), kind("act_input"))[..., 0, :]  # [C,1,K,3]
    stage = np.arange(S)[None, :]
    first, last = ctx.first, ctx.last
    inflight = inflight_microbatches(c.schedule[:, None], c.pp[:, None], c.vpp[:, None], c.ga[:, None], stage)
    # Phase 0, the start of backward, holds every in-flight micro-batch; phase 1, the end of
    # the first backward, one fewer (one chunk of 1/vpp of the stage with interleaving).
    act_mult = np.stack([inflight, np.maximum(inflight - 1 / c.vpp[:, None], 0.0)], axis=-1)
    act_mult = _slot_stages(ctx, act_mult, stage)
    # Gradients exist at the start of backward when they live in persistent buffers (DDP's
    # buckets, Megatron's grad buffer: ZeRO <= 1) or an earlier micro-batch of the step has
    # finished its backward (more micro-batches than the stage holds in flight).  Sharded
    # gradients (ZeRO-2/3, FSDP2) are otherwise allocated at the step's first reduce-scatter
    # and freed by zero_grad(set_to_none=True), PyTorch's default since 2.0.
    # A framework may allocate ZeRO-3's gradient partitions at initialize (Assumptions.zero3_grad_buffer_kept).
    # DDP with a second copy keeps its buckets from construction on, autograd's .grad only while accumulating.
    accumulating = c.ga[:, None] > inflight + 1e-9
    kept_buffers = (zero <= 1) | ((zero >= 3) & assume.zero3_grad_buffer_kept)
    live = (kept_buffers[:, None] | accumulating).astype(float)
    state_live = np.ones((C, S, 2, len(STATE_COLUMNS)))
    state_live[:, :, 0, 1] = np.where(ddp_copy[:, None], (1 + accumulating) / 2, live)
    state_live[:, :, 0, 3] = 0.0  # a forward reshards each unit again before the next backward starts
    e, h = table.embed, table.head
    none = np.zeros((1, 1, 1, 1))
    ends = ctx.ends()  # the edges' states differ only on the first and last stages (Context.ends)
    on = ends or ctx
    edge_states = states(on.train_edge[..., None, None], none, (on.frozen_edge[..., None, None], none,
                                                                on.frozen_edge_wire[..., None, None], none),
                         (on.pad_edge[..., None, None], none, on.pad_frozen_edge[..., None, None], none))
    edge_states = (edge_states if ends is None else ends.spread(edge_states, S))[:, :, None, 0, :]
    flat_grads, staging, host_staging = flat.flat_terms(ctx)  # DeepSpeed's flat ZeRO-1/2 partitions
    none_yet = np.zeros_like(flat_grads)
    edge_states = edge_states + np.stack([none_yet, flat_grads, none_yet, none_yet], axis=-1)[:, :, None, :]
    edge_states = edge_states * state_live  # [C,S,2,4]
    edge_states = np.concatenate([edge_states[..., :1] + edge_states[..., 3:], edge_states[..., 1:3]], axis=-1)
    tok = ctx.tokens[:, None]
    # a fused cross-entropy keeps the 16-bit logits and writes their gradient in place, not fp32 copies
    head_tp = h.act_tp * np.where(c.fused_loss, table.act_bytes / 4, 1.0)
    # ZB-V and DualPipeV run the head in the V's last chunk, whose backward follows its forward at once: it holds
    # one micro-batch there, as 1F1B's last stage (Qi et al. 2024, Sec. 6), on rank 0 (context.head_stage)
    head_mult = np.where(np.isin(c.schedule, V_CODES)[:, None, None], np.array([1.0, 0.0]), act_mult)
    edge_act = (first * tok * (e.act_rep / sp_div)[:, None])[..., None] * act_mult + (
        last * tok * ((h.act_rep + h.act_norm_upcast * upcast[:, 0, 0, 0]) / sp_div + head_tp / tp)[:, None]
    )[..., None] * head_mult  # [C,S,2]
    # ZeRO-3 / FSDP2: blocks are gathered one unit at a time (plus prefetch); the root unit
    # (embedding, final norm, head) stays gathered from forward to backward (FSDP2 does not
    # reshard the root after forward).  Without ZeRO-3, gradient buckets (DDP, ZeRO-1/2).
    gathered = (zero >= 3) | c.off_par
    # FSDP units: a block, experts included; with ep > 1 its local experts are a unit of their own
    # over the expert-data-parallel group (torchtitan), so the largest unit is reduced while the
    # smaller ones are gathered
    # (a frozen base is gathered in its stored form, 4-bit under QLoRA; only adapters reduce;
    # FSDP2's buffers hold its padded chunks)
    dense, exp = ctx.train_dense + ctx.pad_dense, ctx.train_exp + ctx.pad_exp
    dense_unit, exp_unit = dense.max(axis=(1, 2, 3)), exp.max(axis=(1, 2, 3))
    dense_gather = (dense * pgb + ctx.frozen_dense_wire + ctx.pad_frozen_dense * pgb).max(axis=(1, 2, 3))
    exp_gather = (exp * pgb + ctx.frozen_exp_wire + ctx.pad_frozen_exp * pgb).max(axis=(1, 2, 3))
    apart = c.ep > 1
    reduced = np.where(apart, np.where(dense_gather >= exp_gather, dense_unit, exp_unit), dense_unit + exp_unit)
    next_unit = np.where(apart, np.minimum(dense_gather, exp_gather), dense_gather + exp_gather)
    root = np.where(gathered[:, None], (ctx.train_edge + ctx.pad_edge + ctx.pad_frozen_edge) * pgb + ctx.frozen_edge_wire,
                    0.0)
    working = np.where(gathered, gather_buffer_bytes(reduced, next_unit, 1.0, rgb, assume.zero3_prefetch_units), 0.0)
    # DDP's buckets come after the loss's temporaries; buckets allocated as backward starts (DeepSpeed's
    # reduce_bucket_size ones) and the offload staging buffer are held beside them
    buckets, held_from_start = reduce_bucket_bytes(ctx), assume.reduce_buckets == "size"
    working = (working + buckets * (not held_from_start))[:, None]
    held = (buckets * held_from_start)[:, None] + staging
    # the loss's fp32 temporaries on the last stage (gradients of the log-probabilities and of
    # the fp32 logits) are freed by the head's backward, before the first block's buffers
    # are needed (FSDPMemTracker, autoplace.fidelity)
    per_vocab = np.where(tp > 1, assume.loss_workspace_bytes_per_vocab_tp, assume.loss_workspace_bytes_per_vocab)
    loss = last * tok * (per_vocab * table.vocab / tp * ~c.fused_loss)[:, None]
    # at the end of a backward under a pipeline the edges' unsharded copies are params (after_backward)
    root_at = root[..., None] * np.stack(np.broadcast_arrays(1.0, ~after_backward[:, :, 0, 0]), axis=-1)
    buffers = root_at + held[..., None] + np.stack(np.broadcast_arrays(np.maximum(loss, working), working), axis=-1)
    reserve = np.broadcast_to(reserve_bytes(ctx.hw.capacity, assume.allocator_reserve_fraction,
                                            assume.framework_reserve_GiB), (C, S))[..., None] * np.ones(2)
    mem_static = np.concatenate([edge_states, edge_act[..., None], buffers[..., None], reserve[..., None]], axis=-1)
    host_block, host_static = host_bytes(ctx)
    host_static = host_static + host_staging
    return MemoryTerms(state_block=state_block, act_block=act_block, state_live=state_live, act_mult=act_mult,
                       mem_static=mem_static, host_block=host_block, host_static=host_static,
                       host_capacity=ctx.stage(ctx.hw.host_capacity * (1 - assume.host_reserve_fraction)))


def reduce_bucket_bytes(ctx: Context) -> Array:
    """The gradient buckets of each candidate's data-parallel reduction ``[C]`` (``Assumptions.reduce_buckets``):
    two of ``comm_bucket_MiB`` (DDP), or the framework's ``reduce_bucket_size`` elements in the gradient dtype
    -- two with overlap_comm at ZeRO-1/2 and no pipeline (DeepSpeed's engine turns it off under one), one at
    ZeRO-3, none at ZeRO-0 (DeepSpeed 0.19 stage_1_and_2.py ``setup_buckets``; stage3.py
    ``_setup_for_real_optimizer``)."""
    c, assume = ctx.cand, ctx.assume
    zero = c.zero
    if assume.reduce_buckets != "size":  # ZeRO-3's reductions are the gather buffers' (gather_buffer_bytes)
        return np.where((zero >= 3) | c.off_par, 0.0, 2 * assume.comm_bucket_MiB * 2**20)
    count = np.where(zero >= 3, 1, np.where(zero >= 1, np.where(c.overlap & (c.pp == 1), 2, 1), 0))
    return count * zero3_buckets(ctx)[0] * ctx.recipe.grad_bytes


def _slot_stages(ctx: Context, act_mult: Array, stage: Array) -> Array:
    """``act_mult`` ``[C, S, 2]`` with the first and last stages of interleaved candidates whose
    embedding or loss takes a block's place (``pp_embedding`` / ``pp_loss``) counted chunk by
    chunk (:func:`autoplace.cost.memory.slot_inflight`), at the even split's units on those
    stages (:func:`autoplace.plan.split_units`: the multiplier must not depend on the split, which
    the search chooses, for memory to stay linear in the blocks per stage)."""
    c = ctx.cand
    on = np.isin(c.schedule, LOOPED_CODES) & (c.pp > 1) & (c.pp_embedding | c.pp_loss)
    if not on.any():
        return act_mult
    pp, v = c.pp[:, None], c.vpp[:, None]
    e = (c.pp_embedding[:, None] & (stage == 0)).astype(float)
    l_ = (c.pp_loss[:, None] & (stage == pp - 1)).astype(float)
    chunks = (ctx.table.blocks + c.pp_embedding + c.pp_loss)[:, None] // v  # the even split, chunk by chunk
    base, extra = np.divmod(chunks, pp)
    units = (base + ((stage == 0) & (extra >= pp - 1))) * v  # even_split gives a stage at the ends one only then
    held = slot_inflight(pp, v, c.ga[:, None], stage, units, e, l_)
    slot = on[:, None] & ((e + l_) > 0)
    return np.where(slot[..., None], np.stack(held, axis=-1), act_mult)


def host_bytes(ctx: Context) -> tuple[Array, Array]:
    """Host memory per GPU of offloaded states: per block ``[C, S, K]`` and the edges ``[C, S]``.

    An offloaded optimizer keeps its states (fp32 master and moments, ``optimizer_bytes``, with a
    ZeRO-1/2 master cloned from fp32 weights) and fp32 gradients (``offload_grad_bytes``, DeepSpeed
    ZeRO-Offload's pinned gradient partitions) for the parameters this GPU updates, and where the
    framework does (``offload_host_partition_copy``) one more 16-bit copy of them: ZeRO-3's gradient
    partitions, ZeRO-1/2's weights; offloaded parameters keep their 16-bit copy.  States offloaded
    to NVMe (ZeRO-Infinity) leave the gradient partitions on the host.
    """
    c, recipe = ctx.cand, ctx.recipe
    on_host = OFFLOAD.index("cpu")
    paged = np.where(ctx.table.paged_optimizer, recipe.optimizer_bytes, 0.0)  # paged states: evicted here
    states = recipe.optimizer_bytes + np.where(ctx.master_clone, recipe.param_bytes, 0.0)
    copy = ctx.assume.offload_host_partition_copy * np.where(c.zero >= 3, recipe.grad_bytes, recipe.param_bytes)
    opt_per = np.where(c.off_opt, np.where(c.offload_optimizer == on_host, states, 0.0)
                       + ctx.assume.offload_grad_bytes + copy, paged)  # NVMe-offloaded states leave the host free
    par_per = np.where(c.offload_params == on_host, recipe.param_bytes, 0.0)
    frozen_par = (c.offload_params == on_host).astype(float)  # frozen weights offload in their stored form
    zero, ezero = ctx.size["zero"][:, None], ctx.size["ezero"][:, None]
    opt, par = (c.zero >= 1)[:, None], (c.zero >= 3)[:, None]  # sharded optimizer state, sharded parameters

    def share(x: Array, pad: Array, n: Array, sharded: Array) -> Array:
        """One GPU's share of ``x`` (FSDP2's padded chunk when sharded)."""
        return state_bytes(x, 1.0, n, sharded, False, pad)

    def block_of(x: Array) -> Array:
        return x[:, 0, :, 0]  # [C, 1, K, 1] -> [C, K]

    dense, expert, pd, pe = (block_of(x) for x in (ctx.train_dense, ctx.train_exp, ctx.pad_dense, ctx.pad_exp))
    f_dense, f_exp = block_of(ctx.frozen_dense), block_of(ctx.frozen_exp)
    pfd, pfe = block_of(ctx.pad_frozen_dense) * ctx.base_bytes, block_of(ctx.pad_frozen_exp) * ctx.base_bytes
    block = ((share(dense, pd, zero, opt) + share(expert, pe, ezero, opt)) * opt_per[:, None]
             + (share(dense, pd, zero, par) + share(expert, pe, ezero, par)) * par_per[:, None]
             + (share(f_dense, pfd, zero, par) + share(f_exp, pfe, ezero, par)) * frozen_par[:, None])
    edges = (share(ctx.train_edge, ctx.pad_edge, zero, opt) * opt_per[:, None]
             + share(ctx.train_edge, ctx.pad_edge, zero, par) * par_per[:, None]
             + share(ctx.frozen_edge, ctx.pad_frozen_edge * ctx.base_bytes, zero, par) * frozen_par[:, None])
    return ctx.stage(block[:, None, :]), edges
