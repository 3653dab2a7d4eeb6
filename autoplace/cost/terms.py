"""Per-stage cost terms, linear in the layer counts: the tables both the evaluator and the
CP-SAT model use (one source of truth, DESIGN.md).

For candidate ``c``, stage ``s``, block kind ``k`` and recompute mode ``r`` (none,
selective, full), with ``n[c, s, k, r]`` blocks placed there:

* memory(s)      = max over two phases f of
                   static(s, f) + sum n * live(s, f) * state_block(k) + mult(s, f) * sum n * act_block(k, r)
* micro-batch(s) = static(s) + sum n * t_block(s, k, r)           (seconds, by part)
* dp tail(s)     = max(0, reduce(s) - overlap * backward(s)) + gather(s);  optimizer(s) likewise linear

The two phases are the moments a training step's memory can peak (FSDPMemTracker shows
both): the start of backward (every in-flight micro-batch's activations, the loss's fp32
workspace, gradients only if an earlier micro-batch of the step already made them) and the
end of the first backward (one micro-batch's activations freed, every gradient allocated).
A plan fits when both do, so each stays linear and the CP-SAT model adds one constraint each.

Per-block exposures (ZeRO-3 gathers hidden behind that block's compute with prefetch, the
CP ring behind its attention) are computed per block, which keeps the stage sums linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from autoplace.cost import comm
from autoplace.cost.assumptions import Assumptions
from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import (
    block_activation_bytes,
    gather_buffer_bytes,
    inflight_microbatches,
    reserve_bytes,
    state_bytes,
)
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import Precision

Array = np.ndarray
MEMORY_PHASES = ("bwd start", "bwd end")  # start of backward; end of the first backward
MB_PARTS = ("compute", "tp", "ep", "cp", "pp", "zero", "offload")
COMM_PARTS = ("dp", "tp", "pp", "cp", "ep", "offload")


@dataclass(frozen=True)
class StageTerms:
    """Coefficient tables; shapes in brackets (C candidates, S stages, K kinds, R=3 modes)."""

    state_block: Array  # [C, 1, K, 3]  params, grads, optimizer bytes per block
    act_block: Array  # [C, 1, K, R]   activation bytes per block per in-flight micro-batch
    state_live: Array  # [C, S, 2, 3]  share of each state alive in each memory phase
    act_mult: Array  # [C, S, 2]      in-flight micro-batches (whole stages) in each phase
    mem_static: Array  # [C, S, 2, 6] MEMORY_PARTS for the edges, buffers and reserve per phase
    t_block: Array  # [C, S, K, R, 7] seconds per micro-batch by MB_PARTS
    t_static: Array  # [C, S, 7]
    reduce_block: Array  # [C, S, K]   seconds of the once-per-step gradient reduction
    reduce_static: Array  # [C, S]
    gather_block: Array  # [C, S, K]   seconds of the once-per-step parameter gather
    gather_static: Array  # [C, S]
    opt_block: Array  # [C, S, K]      optimizer step seconds
    opt_static: Array  # [C, S]
    bytes_block: Array  # [C, 1, K, R, 6] bytes sent per step by COMM_PARTS
    bytes_static: Array  # [C, S, 6]
    flops_block: Array  # [C, 1, K, R]  hardware FLOPs per step per device
    flops_static: Array  # [C, S]
    dp_overlap: float
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
        states = np.einsum("csk,cokp->csp", per_stage, self.state_block)
        acts = np.einsum("cskr,cokr->cs", n, self.act_block)
        phases = self.mem_static.copy()  # [C, S, 2, 6]
        phases[..., :3] += states[:, :, None, :] * self.state_live
        phases[..., 3] += self.act_mult * acts[..., None]
        fuller = phases.sum(-1).argmax(-1)  # [C, S]
        return np.take_along_axis(phases, fuller[..., None, None], axis=2)[:, :, 0], fuller, phases[:, :, 1, :3]

    @cached_property
    def phases(self) -> tuple[Array, Array, Array]:
        """Each memory phase as ``static + sum_k count_k * per_block_k + mult * sum n * act_block``.

        Returns ``static [C, S, 2]``, ``per_block [C, S, 2, K]`` (state bytes of one block)
        and ``mult [C, S, 2]``; a stage fits when every phase does.
        """
        per_block = np.einsum("cokp,csfp->csfk", self.state_block, self.state_live)
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

    def stage_parts(self, n: Array) -> Array:
        """Seconds per micro-batch of every stage by MB_PARTS, ``[C, S, 7]``."""
        return self.t_static + np.einsum("cskr,cskrp->csp", n, self.t_block)

    def tail(self, n: Array) -> Array:
        """Once-per-step seconds of every stage: exposed data-parallel comm, optimizer ``[C, S, 2]``."""
        per_stage = n.sum(axis=-1)
        reduce = self.reduce_static + np.einsum("csk,csk->cs", per_stage, self.reduce_block)
        gather = self.gather_static + np.einsum("csk,csk->cs", per_stage, self.gather_block)
        # the window that hides the reduction: backward compute without recompute (2/3 of
        # fwd+bwd), so recompute choices never buy overlap and the search stays separable
        backward = (self.t_static[..., 0] + np.einsum("csk,csk->cs", per_stage, self.t_block[..., 0, 0])) * (2.0 / 3.0)
        dp = np.maximum(reduce - self.dp_overlap * backward, 0.0) + gather
        opt = self.opt_static + np.einsum("csk,csk->cs", per_stage, self.opt_block)
        return np.stack([dp, opt], axis=-1)

    def comm_bytes(self, n: Array) -> Array:
        return self.bytes_static + np.einsum("cskr,cokrp->csp", n, self.bytes_block)

    def hardware_flops(self, n: Array) -> Array:
        """FLOPs per step summed over all devices, recompute included (Megatron's counting)."""
        return self.flops_static.sum(axis=1) + np.einsum("cskr,cokr->c", n, self.flops_block)


def group_layout(tp: Array, cp: Array, ep: Array, dp_shard: Array, dp_rep: Array, pp: Array) -> dict[str, tuple[Array, Array]]:
    """(size, stride) of each communication group in Megatron's rank order tp-cp-ep-dp-pp.

    ``dp`` is the dense-gradient group (data x context parallel), ``zero`` the ZeRO/FSDP shard
    group, ``rep`` the HSDP replica group, ``edp``/``ezero`` their expert counterparts.
    """
    dp = dp_shard * dp_rep
    return {
        "tp": (tp, np.ones_like(tp)),
        "cp": (cp, tp),
        "ep": (ep, tp * cp),
        "dp": (dp * cp, tp),
        "edp": (np.maximum(dp * cp // ep, 1), tp * ep),
        "zero": (dp_shard * cp, tp),
        "ezero": (np.maximum(dp_shard * cp // ep, 1), tp * ep),
        "rep": (dp_rep, tp * cp * dp_shard),
        "pp": (pp, tp * cp * dp),
    }


def stage_terms(table: LayerTable, cluster: ClusterSpec, cand: object, recipe: Precision,
                assume: Assumptions) -> StageTerms:
    """Build every coefficient table for the candidates (see the module docstring)."""
    from autoplace.cost.evaluate import stage_hardware

    c = cand  # Candidates; typed loosely to avoid an import cycle
    C, S = c.counts.shape[:2]  # type: ignore[attr-defined]
    hw = stage_hardware(cluster, c, recipe.compute_dtype)  # type: ignore[arg-type]
    G = cluster.gpus_per_node
    pb, gb, ob, ab = recipe.param_bytes, recipe.grad_bytes, recipe.optimizer_bytes, table.act_bytes
    pgb, rgb = recipe.gather_bytes, recipe.reduce_bytes  # on the wire and in unshard buffers
    tp, cp, ep, pp = (x.astype(float) for x in (c.tp, c.cp, c.ep, c.pp))  # type: ignore[attr-defined]
    sp = c.sp  # type: ignore[attr-defined]
    sp_div = np.where(sp, tp, 1.0)
    ga = c.ga.astype(float)  # type: ignore[attr-defined]
    zero = c.zero  # type: ignore[attr-defined]
    off_opt, off_par = c.off_opt, c.off_par  # type: ignore[attr-defined]
    groups = group_layout(c.tp, c.cp, c.ep, c.dp_shard, c.dp_rep, c.pp)  # type: ignore[attr-defined]
    n_in = {k: comm.members_per_node(size, stride, G) for k, (size, stride) in groups.items()}
    size = {k: v[0].astype(float) for k, v in groups.items()}
    tokens = c.mbs * table.seq_len / cp  # type: ignore[attr-defined]  # per micro-batch per device

    def col(x: Array) -> Array:  # [C] -> [C, 1, 1, 1]
        return np.asarray(x, dtype=float).reshape(C, 1, 1, 1)

    def kind(attr: str) -> Array:  # [K] -> [1, 1, K, 1]
        return np.array([getattr(k, attr) for k in table.kinds], dtype=float).reshape(1, 1, -1, 1)

    full = np.array([0.0, 0.0, 1.0]).reshape(1, 1, 1, 3)
    sel = np.array([0.0, 1.0, 0.0]).reshape(1, 1, 1, 3)

    # ---- memory -----------------------------------------------------------------------
    dense_local = kind("params_tp") / col(tp) + kind("params_rep")  # [C,1,K,1]
    exp_local = kind("params_expert") / col(ep * tp)
    z_sh, ez_sh = col(size["zero"]), col(size["ezero"])
    z = col(zero)

    # Without a separate master copy (fp32 training, FSDP2's fp32 shards) the stored weights are
    # the master: ZeRO-2 shards them like optimizer state and keeps the gathered copy (FSDP2's
    # reshard_after_forward=False; DeepSpeed's fp32 partitions) for the whole step.
    shard_and_gathered = (z == 2) & (not recipe.master_copy)
    p_sharded = (z >= 3) | shard_and_gathered

    def states(dense: Array, expert: Array) -> Array:
        kept = np.where(shard_and_gathered, (dense + expert) * pgb, 0.0)
        return np.concatenate([
            state_bytes(dense, pb, z_sh, p_sharded, col(off_par)) + state_bytes(expert, pb, ez_sh, p_sharded, col(off_par))
            + kept,
            state_bytes(dense, gb, z_sh, z >= 2, False) + state_bytes(expert, gb, ez_sh, z >= 2, False),
            state_bytes(dense, ob, z_sh, z >= 1, col(off_opt)) + state_bytes(expert, ob, ez_sh, z >= 1, col(off_opt)),
        ], axis=-1)

    state_block = states(dense_local, exp_local)  # [C,1,K,3]
    act_block = block_activation_bytes(col(tokens), col(tp), col(sp), kind("act_rep"), kind("act_tp"),
                                       kind("act_score"), kind("act_input"))[..., 0, :]  # [C,1,K,3]
    stage = np.arange(S)[None, :]
    first = (stage == 0).astype(float)
    last = (stage == (c.pp[:, None] - 1)).astype(float)  # type: ignore[attr-defined]
    inflight = inflight_microbatches(c.schedule[:, None], c.pp[:, None], c.vpp[:, None], c.ga[:, None], stage)  # type: ignore[attr-defined]
    # Phase 0, the start of backward, holds every in-flight micro-batch; phase 1, the end of
    # the first backward, one fewer (one chunk of 1/vpp of the stage with interleaving).
    act_mult = np.stack([inflight, np.maximum(inflight - 1 / c.vpp[:, None], 0.0)], axis=-1)  # type: ignore[attr-defined]
    # Gradients exist at the start of backward when they live in persistent buffers (DDP's
    # buckets, Megatron's grad buffer: ZeRO <= 1) or an earlier micro-batch of the step has
    # finished its backward (more micro-batches than the stage holds in flight).  Sharded
    # gradients (ZeRO-2/3, FSDP2) are otherwise allocated at the step's first reduce-scatter
    # and freed by zero_grad(set_to_none=True), PyTorch's default since 2.0.
    live = ((zero <= 1)[:, None] | (c.ga[:, None] > inflight + 1e-9)).astype(float)  # type: ignore[attr-defined]
    ones = np.ones((C, S))
    state_live = np.stack([np.stack([ones, live, ones], axis=-1), np.ones((C, S, 3))], axis=2)  # [C,S,2,3]
    e, h = table.embed, table.head
    head_tp = np.where((c.pp == 1) & table.tied, 0.0, h.params_tp)  # type: ignore[attr-defined]
    edge_dense = first * (e.params_tp / tp + e.params_rep)[:, None] + last * (head_tp / tp + h.params_rep)[:, None]
    edge_states = states(edge_dense[..., None, None], np.zeros((1, 1, 1, 1)))[:, :, None, 0, :] * state_live  # [C,S,2,3]
    tok = tokens[:, None]
    edge_act = (first * tok * (e.act_rep / sp_div)[:, None]
                + last * tok * (h.act_rep / sp_div + h.act_tp / tp)[:, None])[..., None] * act_mult  # [C,S,2]
    # ZeRO-3 / FSDP2: blocks are gathered one unit at a time (plus prefetch); the root unit
    # (embedding, final norm, head) stays gathered from forward to backward (FSDP2 does not
    # reshard the root after forward).  Without ZeRO-3, gradient buckets (DDP, ZeRO-1/2).
    gathered = (zero >= 3) | off_par
    # FSDP units: a block, experts included; with ep > 1 its local experts are a unit of their own
    # over the expert-data-parallel group (torchtitan), so the largest unit is reduced while the
    # smaller ones are gathered
    dense_unit, exp_unit = dense_local.max(axis=(1, 2, 3)), exp_local.max(axis=(1, 2, 3))
    apart = c.ep > 1  # type: ignore[attr-defined]
    reduced = np.where(apart, np.maximum(dense_unit, exp_unit), dense_unit + exp_unit)
    next_unit = np.where(apart, np.minimum(dense_unit, exp_unit), dense_unit + exp_unit)
    root = np.where(gathered[:, None], edge_dense * pgb, 0.0)
    working = np.where(gathered, gather_buffer_bytes(reduced, next_unit, pgb, rgb, assume.zero3_prefetch_units),
                       2 * assume.comm_bucket_MiB * 2**20)[:, None]
    # the loss's fp32 temporaries on the last stage (gradients of the log-probabilities and of
    # the fp32 logits) are freed by the head's backward, before the first block's buffers
    # are needed (FSDPMemTracker, autoplace.fidelity)
    per_vocab = np.where(tp > 1, assume.loss_workspace_bytes_per_vocab_tp, assume.loss_workspace_bytes_per_vocab)
    loss = last * tok * (per_vocab * table.vocab / tp)[:, None]
    buffers = root[..., None] + np.stack(np.broadcast_arrays(np.maximum(loss, working), working), axis=-1)  # [C,S,2]
    reserve = np.broadcast_to(reserve_bytes(hw.capacity, assume.allocator_reserve_fraction,
                                            assume.framework_reserve_GiB), (C, S))[..., None] * np.ones(2)
    mem_static = np.concatenate([edge_states, edge_act[..., None], buffers[..., None], reserve[..., None]], axis=-1)

    # ---- time per micro-batch, per block ------------------------------------------------
    # matmul efficiency by the size of each block kind's main GEMM on one device (and the head's)
    gemm = np.stack([tokens * k.gemm_token_share * np.where(k.moe, c.ep, 1) * k.gemm_flops / tp  # type: ignore[attr-defined]
                     for k in table.kinds] + [tokens * h_gemm / tp for h_gemm in (table.head.gemm_flops,)], axis=-1) / 1e9
    eff = hw.efficiency(gemm)  # [C, S, K+1]
    rate = (hw.peak_flops[..., None] * eff / assume.compute_scale)[..., :-1, None]  # [C,S,K,1]
    head_rate = hw.peak_flops * eff[..., -1] / assume.compute_scale  # [C,S]
    flops_mb = col(tokens) * (3 * kind("flops") + sel * kind("flops_score") + full * kind("flops")) / col(tp)
    # memory-bound kernels (norms, activations, dropout, softmax, residual adds) stream the
    # stored activations: forward once, backward twice, and the forward again when recomputed
    traffic = act_block[..., :1] * (assume.elementwise_traffic + full)  # [C,1,K,3]
    hbm = (hw.hbm_Bps / assume.compute_scale)[..., None, None]
    compute = flops_mb / rate + traffic / hbm  # [C,S,K,3]
    attn = col(tokens) * kind("flops_score") * (3 + sel + full) / col(tp) / rate
    lk = comm.Links(hw.links.intra_Bps[..., None, None] / assume.bandwidth_scale, hw.links.intra_latency_s[..., None, None],
                    hw.links.inter_Bps[..., None, None] / assume.bandwidth_scale, hw.links.inter_latency_s[..., None, None], G)
    stage_links = comm.Links(lk.intra_Bps[..., 0, 0], lk.intra_latency_s[..., 0, 0],
                             lk.inter_Bps[..., 0, 0], lk.inter_latency_s[..., 0, 0], G)  # [C, S]
    passes = 4 + 2 * full  # collectives per block: 2 forward, 2 backward, 2 more when recomputed
    tp_on = col(tp > 1)
    tp_i, tp_x, tp_t = comm.allreduce(col(tokens) * kind("tp_allreduce") / 2, col(size["tp"]), col(n_in["tp"]), lk)
    tp_time = tp_on * passes * tp_t
    tp_bytes = tp_on * passes * (tp_i + tp_x)
    ep_i, ep_x, ep_t = comm.alltoall(col(tokens / sp_div) * kind("ep_alltoall"), col(size["ep"]), col(n_in["ep"]), lk)
    ep_time, ep_bytes = passes * ep_t, passes * (ep_i + ep_x)
    cp_fwd = col(tokens) * kind("cp_kv") / col(tp) * col(cp - 1)
    cp_inter = col(n_in["cp"] < c.cp)  # type: ignore[attr-defined]
    cp_bytes = cp_fwd * (3 + full)
    cp_time = comm.p2p(cp_bytes, col(cp - 1) * (3 + full), cp_inter > 0, lk)
    cp_exposed = np.maximum(cp_time - assume.cp_overlap * attn, 0.0)
    # ZeRO-2 reduce-scatters and ZeRO-3 gathers every micro-batch, overlapped block by block
    zd = dense_local * pgb
    _, _, ag_t = comm.allgather(zd, col(size["zero"]), col(n_in["zero"]), lk)
    _, _, eag_t = comm.allgather(exp_local * pgb, col(size["ezero"]), col(n_in["ezero"]), lk)
    _, _, rs_t = comm.reducescatter(dense_local * rgb, col(size["zero"]), col(n_in["zero"]), lk)
    _, _, ers_t = comm.reducescatter(exp_local * rgb, col(size["ezero"]), col(n_in["ezero"]), lk)
    z3_t = 2 * (ag_t + eag_t) + rs_t + ers_t
    zero_exposed = np.where(z >= 3, np.maximum(z3_t - assume.zero3_overlap * compute, 0.0),
                            np.where(z == 2, np.maximum(rs_t + ers_t - assume.dp_overlap * compute * 2 / 3, 0.0), 0.0))
    z_frac, ez_frac = (col(size["zero"]) - 1) / col(size["zero"]), (col(size["ezero"]) - 1) / col(size["ezero"])
    zero_bytes_mb = np.where(z >= 3, 2 * (zd * z_frac + exp_local * pgb * ez_frac)
                             + (dense_local * z_frac + exp_local * ez_frac) * rgb,
                             np.where(z == 2, (dense_local * z_frac + exp_local * ez_frac) * rgb, 0.0))
    shard_params = dense_local / np.where(z >= 3, z_sh, 1) + exp_local / np.where(z >= 3, ez_sh, 1)
    host_bps = (hw.host_Bps / assume.bandwidth_scale)[..., None, None]
    off_bytes_mb = col(off_par) * 2 * shard_params * pb
    off_exposed = np.maximum(off_bytes_mb / host_bps - assume.offload_overlap * compute, 0.0)
    zeros = np.zeros_like(compute)
    t_block = np.stack(np.broadcast_arrays(compute, tp_time, ep_time, cp_exposed, zeros, zero_exposed, off_exposed),
                       axis=-1)
    t_block = np.broadcast_to(t_block, (C, S, *t_block.shape[2:]))  # a view when hardware is uniform
    ones = np.ones((1, 1, 1, 3))
    bytes_block = np.stack(np.broadcast_arrays(
        col(ga) * zero_bytes_mb * ones, col(ga) * tp_bytes * ones, 0 * ones, col(ga) * cp_bytes * ones,
        col(ga) * ep_bytes * ones, col(ga) * off_bytes_mb * ones), axis=-1)[:, :1]

    # ---- time per micro-batch, edges and pipeline sends ---------------------------------
    head_flops = last * (tok * 3 * h.flops / tp[:, None])
    t_compute = head_flops / head_rate
    # the vocab-parallel embedding all-reduces its output; the head its input's gradient and the
    # loss's per-token statistics (three small all-reduces)
    edge_ar = first * e.tp_allreduce + last * h.tp_allreduce  # bytes per token
    emb_i, emb_x, emb_t = comm.allreduce(tok * edge_ar, size["tp"][:, None], n_in["tp"][:, None], stage_links)
    tp_on2 = (tp > 1)[:, None]
    t_tp = tp_on2 * (emb_t + last * 3 * 2 * (size["tp"][:, None] - 1) * stage_links.intra_latency_s)
    vpp = c.vpp[:, None].astype(float)  # type: ignore[attr-defined]
    sends = np.where(pp[:, None] > 1, 2 * vpp - first - last, 0.0)
    send_bytes = sends * tok * ab * table.hidden / sp_div[:, None]
    pp_inter = (groups["pp"][1] >= G)[:, None]
    t_pp = comm.p2p(send_bytes, sends, pp_inter, stage_links)
    edge_shard = edge_dense / np.where((zero >= 3)[:, None], size["zero"][:, None], 1)
    _, _, eag = comm.allgather(edge_dense * pgb, size["zero"][:, None], n_in["zero"][:, None], stage_links)
    _, _, ers = comm.reducescatter(edge_dense * rgb, size["zero"][:, None], n_in["zero"][:, None], stage_links)
    # edges are units too: ZeRO-3 gathers the root once per micro-batch (it stays gathered until
    # backward) and reduce-scatters its gradient; ZeRO-2 reduce-scatters their gradients
    t_zero = np.select([(zero >= 3)[:, None], (zero == 2)[:, None]], [eag + ers, ers], 0.0)
    t_off = off_par[:, None] * 2 * edge_shard * pb / (hw.host_Bps / assume.bandwidth_scale)
    zs = np.zeros((C, S))
    t_static = np.stack([t_compute, t_tp, zs, zs, t_pp, t_zero, t_off], axis=-1)
    zfrac_s = ((size["zero"] - 1) / size["zero"])[:, None]
    bytes_static = np.stack([
        ga[:, None] * edge_dense * zfrac_s * np.select([(zero >= 3)[:, None], (zero == 2)[:, None]], [pgb + rgb, rgb], 0.0),
        ga[:, None] * tp_on2 * (emb_i + emb_x), ga[:, None] * send_bytes, zs, zs,
        ga[:, None] * off_par[:, None] * 2 * edge_shard * pb], axis=-1)

    # ---- once per step: gradient reduction, parameter gather, optimizer -----------------
    red_blk, gat_blk, red_st, gat_st, dp_bytes_blk, dp_bytes_st = _dp_terms(
        dense_local[:, 0, :, 0], exp_local[:, 0, :, 0], edge_dense, zero, size, n_in, stage_links, pgb, rgb)
    opt_params_blk = (dense_local[:, 0, :, 0] / np.where(zero >= 1, size["zero"], 1)[:, None]
                      + exp_local[:, 0, :, 0] / np.where(zero >= 1, size["ezero"], 1)[:, None])
    opt_params_st = edge_dense / np.where(zero >= 1, size["zero"], 1)[:, None]
    gpu_opt = (2 * ob + gb + pb) / hw.hbm_Bps  # read+write states, read grads, write params
    cpu_opt = 1.0 / assume.cpu_adam_params_per_s + (gb + pb) / (hw.host_Bps / assume.bandwidth_scale)
    per_param = np.where(off_opt[:, None], cpu_opt, gpu_opt)  # [C,S]
    opt_block = opt_params_blk[:, None, :] * per_param[..., None]
    opt_static = opt_params_st * per_param
    off_step = off_opt[:, None] * (gb + pb)
    bytes_block[..., 0] += dp_bytes_blk[:, None, :, None]
    bytes_block[..., 5] += (off_step[:, :1] * opt_params_blk)[:, None, :, None]
    bytes_static[..., 0] += dp_bytes_st
    bytes_static[..., 5] += off_step * opt_params_st

    # ---- FLOPs -------------------------------------------------------------------------
    world = c.world.astype(float)  # type: ignore[attr-defined]
    mb_total = ga * world / (tp * pp * cp)  # micro-batches per step on all pipelines
    flops_block = flops_mb * col(mb_total * tp * cp)  # per step, over all devices of the stage
    flops_static = head_flops * (mb_total * tp * cp)[:, None]
    n_blocks = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds)).astype(float)
    fwd_tok = float((n_blocks * kind("flops").ravel()).sum() + h.flops)
    tokens_step = c.mbs * ga * c.dp * table.seq_len  # type: ignore[attr-defined]
    pools_peak = sum(p.gpus * p.gpu.peak_TFLOPS.for_dtype(recipe.compute_dtype) * 1e12 for p in cluster.pools)
    per_gpu_peak = pools_peak / cluster.gpus
    def per_stage(a: Array) -> Array:  # [C, 1 or S, ...] -> [C, S, ...] (a view)
        return np.broadcast_to(a, (C, S, *np.shape(a)[2:]))

    return StageTerms(
        state_block=state_block, act_block=act_block, state_live=state_live, act_mult=act_mult, mem_static=mem_static,
        t_block=t_block, t_static=per_stage(t_static), reduce_block=per_stage(red_blk), reduce_static=per_stage(red_st),
        gather_block=per_stage(gat_blk), gather_static=per_stage(gat_st), opt_block=per_stage(opt_block), opt_static=per_stage(opt_static),
        bytes_block=bytes_block, bytes_static=bytes_static, flops_block=flops_block[:, :1],
        flops_static=per_stage(flops_static), dp_overlap=assume.dp_overlap, capacity=per_stage(hw.capacity),
        model_flops=3 * fwd_tok * tokens_step, peak_total=world * per_gpu_peak, tokens_per_step=tokens_step)


def _dp_terms(dense: Array, expert: Array, edge: Array, zero: Array, size: dict[str, Array],
              n_in: dict[str, Array], lk: comm.Links, pb: float, gb: float) -> tuple[Array, ...]:
    """Once-per-step data-parallel collectives, linear in the parameters of a stage.

    ZeRO paper Sec. 7: DDP all-reduces gradients (2Ψ); ZeRO-1/2 reduce-scatter gradients and
    all-gather updated parameters (Ψ + Ψ); ZeRO-3 moves its gathers into every micro-batch
    (counted per block) and only all-reduces shards across replicas (HSDP).

    Returns:
        reduce seconds per block [C,S,K] and per stage of edges [C,S], the same for gathers,
        and bytes per step (blocks [C,K], edges [C,S]).
    """
    links = lk
    def one(params: Array, group: str, shard_group: str) -> tuple[Array, Array, Array]:
        # params: [C, X] local parameters -> (reduce seconds, gather seconds, bytes) per stage-broadcast
        p3 = params[:, None, :] if params.ndim == 2 and params.shape[1] != links.intra_Bps.shape[1] else params
        L = _bcast(links, p3)
        n, ni = size[group], n_in[group]
        ns, nis = size[shard_group], n_in[shard_group]
        nr, nir = size["rep"], n_in["rep"]
        z = zero
        ar = comm.allreduce(p3 * gb, _e(n, p3), _e(ni, p3), L)
        rs = comm.reducescatter(p3 * gb, _e(ns, p3), _e(nis, p3), L)
        ag = comm.allgather(p3 * pb, _e(ns, p3), _e(nis, p3), L)
        rep = comm.allreduce(p3 * gb / _e(ns, p3), _e(nr, p3), _e(nir, p3), L)
        zz = _e(z, p3)
        reduce_t = np.select([zz == 0, zz == 1], [ar[2], rs[2] + rep[2]], rep[2])
        gather_t = np.where((zz == 1) | (zz == 2), ag[2], 0.0)
        nbytes = np.select([zz == 0, zz == 1, zz == 2],
                           [ar[0] + ar[1], rs[0] + rs[1] + ag[0] + ag[1] + rep[0] + rep[1],
                            ag[0] + ag[1] + rep[0] + rep[1]], rep[0] + rep[1])
        return reduce_t, gather_t, nbytes

    r_d, g_d, b_d = one(dense[:, None, :], "dp", "zero")
    r_e, g_e, b_e = one(expert[:, None, :], "edp", "ezero")
    r_s, g_s, b_s = one(edge[:, :, None], "dp", "zero")
    return (r_d + r_e, g_d + g_e, r_s[..., 0], g_s[..., 0], (b_d + b_e)[:, 0, :], b_s[..., 0])


def _e(x: Array, like: Array) -> Array:
    return np.asarray(x).reshape((-1,) + (1,) * (like.ndim - 1))


def _bcast(links: comm.Links, like: Array) -> comm.Links:
    def f(v: Array) -> Array:
        v = np.asarray(v)
        return v[..., None] if like.ndim == 3 else v

    return comm.Links(f(links.intra_Bps), f(links.intra_latency_s), f(links.inter_Bps), f(links.inter_latency_s),
                      links.gpus_per_node)
