"""What every cost term needs to know about a batch of candidates: their groups and where
those lie, tokens per micro-batch, local parameters per block, the hardware of each stage.

Shapes: ``[C]`` per candidate; blocks ``[C, 1, K, 1]`` (candidate, stage, kind, recompute
mode), so block terms broadcast against per-stage ``[C, S, 1, 1]`` hardware and the three
recompute modes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autoplace.cost import comm, finetune, shards
from autoplace.cost.assumptions import Assumptions
from autoplace.cost.candidates import Candidates
from autoplace.cost.compress import Wire, wire
from autoplace.cost.hardware import StageHardware, stage_hardware
from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import V_CODES
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import Precision

Array = np.ndarray
MODES = 3  # recompute: none, selective, full
# bytes per weight of a model loaded in the dtype its training computes in (fp8 GEMMs run on bf16 weights)
LOADED_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 2.0, "tf32": 4.0, "fp32": 4.0}


def group_layout(tp: Array, cp: Array, ep: Array, dp_shard: Array, dp_rep: Array, pp: Array) -> dict[str, tuple[Array, Array]]:
    """(size, stride) of each communication group in Megatron's rank order tp-cp-ep-dp-pp.

    ``dp`` is the dense-gradient group (data x context parallel), ``zero`` the ZeRO/FSDP shard
    group, ``rep`` the HSDP replica group, ``edp``/``ezero`` their expert counterparts.  A group
    whose ranks lie in one NVLink domain (``stride * size`` within the domain) runs on NVLink,
    whatever the nodes (``comm.members_per_domain``).
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


@dataclass(frozen=True)
class Context:
    """Derived arrays shared by the memory, time and byte terms."""

    table: LayerTable
    cand: Candidates
    recipe: Precision
    assume: Assumptions
    hw: StageHardware
    size: dict[str, Array]  # ranks per group [C]
    n_in: dict[str, Array]  # ranks of the group in one NVLink domain (a node, or an NVL72 rack) [C]
    tokens: Array  # tokens per micro-batch per device [C]
    dense_local: Array  # dense parameters of one block on one device [C, 1, K, 1]
    exp_local: Array  # routed-expert parameters of one block on one device [C, 1, K, 1]
    edge_dense: Array  # embedding / head parameters on each stage [C, S]
    links: comm.Links  # [C, S, 1, 1], calibrated
    stage_links: comm.Links  # [C, S]
    wire: Wire  # bytes per element on the wire under each candidate's compression [C]
    # what trains and what is frozen (LoRA, QLoRA): trainable parameters of one block / the
    # edges on one device (all of them in full training), and the frozen base's stored bytes
    train_dense: Array  # [C, 1, K, 1]
    train_exp: Array  # [C, 1, K, 1]
    train_edge: Array  # [C, S]
    frozen_dense: Array  # stored bytes [C, 1, K, 1]
    frozen_exp: Array  # stored bytes [C, 1, K, 1]
    frozen_edge: Array  # stored bytes [C, S]
    frozen_dense_wire: Array  # bytes an all-gather moves (and an unsharded copy holds) [C, 1, K, 1]
    frozen_exp_wire: Array  # [C, 1, K, 1]
    frozen_edge_wire: Array  # [C, S]
    quantized: Array  # 4-bit parameters of one block on one device (QLoRA) [C, 1, K, 1]
    # elements FSDP2's dim-0 chunks add before sharding (autoplace.cost.shards; 0 unless
    # Assumptions.fsdp2_dim0_padding): of the trainable parameters above, and of the frozen base's
    # tensors it does not store in 4 bit (bytes: times param_bytes stored, gather_bytes gathered)
    pad_dense: Array  # [C, 1, K, 1]
    pad_exp: Array  # [C, 1, K, 1]
    pad_edge: Array  # [C, S]
    pad_frozen_dense: Array  # [C, 1, K, 1]
    pad_frozen_exp: Array  # [C, 1, K, 1]
    pad_frozen_edge: Array  # [C, S]
    quant_state: Array  # bytes of their quantization constants, whole on every rank [C, 1, K, 1]
    stages: Array | None = None  # the stage each entry of the stage axis stands for (None: 0..S-1; see ends)

    @property
    def C(self) -> int:
        return self.cand.size

    @property
    def S(self) -> int:
        return int(self.cand.counts.shape[1])

    @property
    def deferred_sync(self) -> Array:
        """``[C]`` True where a pipeline holds FSDP2's gradient reduce-scatter to the step's last
        micro-batch (``Assumptions.pipeline_defers_grad_sync``: torch.distributed.pipelining's
        ``backward_maybe_with_nosync``, torchtitan's pipelines): ZeRO-2/3 with pp > 1 then keep
        unsharded gradients and reduce-scatter them once a step."""
        c = self.cand
        return (c.pp > 1) & (c.zero >= 2) & self.assume.pipeline_defers_grad_sync

    def col(self, x: Array | float) -> Array:
        """``[C]`` -> ``[C, 1, 1, 1]``."""
        return np.broadcast_to(np.asarray(x, dtype=float), (self.C,)).reshape(self.C, 1, 1, 1)

    def kind(self, attr: str) -> Array:
        """A block-kind attribute as ``[1, 1, K, 1]``."""
        return np.array([getattr(k, attr) for k in self.table.kinds], dtype=float).reshape(1, 1, -1, 1)

    def stage(self, a: Array) -> Array:
        """``[C, 1 or S, ...]`` -> ``[C, S, ...]`` (a view)."""
        return np.broadcast_to(a, (self.C, self.S, *np.shape(a)[2:]))

    @property
    def first(self) -> Array:
        """1.0 on each candidate's first stage ``[C, S]``."""
        return (self._stage_index()[None, :] == 0).astype(float)

    @property
    def last(self) -> Array:
        """1.0 on the stage that holds each candidate's head and loss ``[C, S]`` (:func:`head_stage`)."""
        return (self._stage_index()[None, :] == head_stage(self.cand)[:, None]).astype(float)

    @property
    def master_clone(self) -> Array:
        """Whether each candidate's ZeRO clones fp32 weights into a separate fp32 master ``[C]``
        (``Assumptions.zero_master_clone``; a recipe with a master copy has one already)."""
        return (self.cand.zero >= 1) & self.assume.zero_master_clone & (not self.recipe.master_copy)

    @property
    def base_bytes(self) -> float:
        """Bytes a frozen base's weight (one not stored in 4 bit) takes: :func:`frozen_base_bytes`."""
        return frozen_base_bytes(self.recipe, self.assume)

    def _stage_index(self) -> Array:
        return np.arange(self.S) if self.stages is None else self.stages

    def ends(self) -> Context | None:
        """This context on three stages that stand for all S: the first, the second and the last,
        when every candidate has S > 3 stages on hardware they all share (one pool); else None.

        Edge parameters (embedding, head) and the hardware are all that tell one stage from
        another outside memory (whose in-flight micro-batches count down the pipeline), so every
        term of a middle stage but memory's is the second stage's: computed once, not S - 2 times
        (:meth:`spread` copies it back), the same numbers for a deep pipeline's edges at a tenth of the work.
        """
        S = self.S
        if S <= 3 or self.hw.span.shape[-1] != 1 or not bool((self.cand.pp == S).all()):
            return None
        at = np.array([0, 1, S - 1])
        return dataclasses.replace(
            self, cand=dataclasses.replace(self.cand, counts=self.cand.counts[:, at]), stages=at,
            edge_dense=self.edge_dense[:, at], train_edge=self.train_edge[:, at], frozen_edge=self.frozen_edge[:, at],
            frozen_edge_wire=self.frozen_edge_wire[:, at], pad_edge=self.pad_edge[:, at],
            pad_frozen_edge=self.pad_frozen_edge[:, at])

    def spread(self, x: Array, stages: int) -> Array:
        """``x [C, 1 or 3, ...]`` of an :meth:`ends` context on all ``stages`` stages (the middle
        ones the second's copies; a stage-broadcast array stays a view)."""
        if x.ndim < 2 or x.shape[1] == 1:
            return x
        if x.strides[1] == 0:
            return np.broadcast_to(x[:, :1], (x.shape[0], stages, *x.shape[2:]))
        # (np.take lays the copy out row by row, as the full computation would: x[:, index] does not,
        # and numpy's sums over the stages then add in another order)
        return np.take(x, np.minimum(np.arange(stages), 1) + (np.arange(stages) == stages - 1), axis=1)


def head_stage(cand: Candidates) -> Array:
    """The pipeline rank holding the head and the loss ``[C]``: the last, but in a V (ZB-V, DualPipeV) the first,
    whose second chunk ends the V (torch's stage-to-rank mapping, style "v": rank r holds stages r
    and 2 pp - 1 - r; torchtitan 0.2.2 pipeline_module_split), beside the embedding."""
    return np.where(np.isin(cand.schedule, V_CODES), 0, cand.pp - 1)


def head_tables(table: LayerTable, cand: Candidates) -> tuple[Array, Array]:
    """The vocabulary tables the stage holding the loss keeps beside its final norm ``[C]`` each:
    (its output layer's -- 0 where it is the embedding's own, tied, on a one-stage pipeline -- and
    a copy of the embedding for the multi-token-prediction modules, ``table.mtp``, where that stage
    is not the first: Megatron-Core 0.16 ``GPTModel`` builds the embedding where ``pre_process or
    mtp_process``)."""
    output = np.where((cand.pp == 1) & table.tied, 0.0, 1.0)
    return output, ((head_stage(cand) > 0) & (table.mtp > 0)).astype(float)


def context(table: LayerTable, cluster: ClusterSpec, cand: Candidates, recipe: Precision,
            assume: Assumptions) -> Context:
    """The shared arrays for ``cand`` on ``cluster``."""
    hw = stage_hardware(cluster, cand, recipe.compute_dtype)
    G = cluster.gpus_per_node
    groups = group_layout(cand.tp, cand.cp, cand.ep, cand.dp_shard, cand.dp_rep, cand.pp)
    C = cand.size
    tp = cand.tp.astype(float).reshape(C, 1, 1, 1)
    ep = cand.ep.astype(float).reshape(C, 1, 1, 1)
    kind = np.array([[k.params_tp, k.params_rep, k.params_expert] for k in table.kinds], dtype=float)
    kind = kind.T.reshape(3, 1, 1, -1, 1)
    first = (np.arange(max(int(cand.counts.shape[1]), 1))[None, :] == 0).astype(float)
    last = (np.arange(int(cand.counts.shape[1]))[None, :] == head_stage(cand)[:, None]).astype(float)
    e, h = table.embed, table.head
    output, embed_copy = head_tables(table, cand)
    head_tp = output * h.params_tp + embed_copy * e.params_tp
    tpf = cand.tp.astype(float)
    edge_dense = (first * (e.params_tp / tpf + e.params_rep)[:, None]
                  + last * (head_tp / tpf + h.params_rep)[:, None])
    scale = assume.bandwidth_scale
    lk = hw.links
    links = comm.Links(lk.intra_Bps[..., None, None] / scale, lk.intra_latency_s[..., None, None],
                       lk.inter_Bps[..., None, None] / scale, lk.inter_latency_s[..., None, None], G)
    stage_links = comm.Links(lk.intra_Bps / scale, lk.intra_latency_s, lk.inter_Bps / scale, lk.inter_latency_s, G)
    dense_local, exp_local = kind[0] / tp + kind[1], kind[2] / (ep * tp)
    tuned = _frozen_split(table, recipe, frozen_base_bytes(recipe, assume), tp, ep, dense_local, exp_local, edge_dense)
    size = {k: v[0].astype(float) for k, v in groups.items()}
    padding = _padding(table, cand, size, first, last) if assume.fsdp2_dim0_padding else _no_padding(C, len(table.kinds),
                                                                                                       edge_dense)
    return Context(
        **tuned, **padding, table=table, cand=cand, recipe=recipe, assume=assume, hw=hw,
        size=size,
        n_in={k: comm.members_per_domain(size, stride, cluster.nvlink_domain) for k, (size, stride) in groups.items()},
        tokens=cand.mbs * table.seq_len / cand.cp.astype(float),
        dense_local=dense_local, exp_local=exp_local, edge_dense=edge_dense,
        links=links, stage_links=stage_links, wire=wire(recipe, cand))


def frozen_base_bytes(recipe: Precision, assume: Assumptions) -> float:
    """A frozen base as the training script stores it: the recipe's weights, or the dtype it computes
    in (Assumptions.frozen_base_in_compute_dtype)."""
    return LOADED_BYTES[recipe.compute_dtype] if assume.frozen_base_in_compute_dtype else recipe.param_bytes


def _frozen_split(table: LayerTable, recipe: Precision, base_bytes: float, tp: Array, ep: Array, dense_local: Array,
                  exp_local: Array, edge_dense: Array) -> dict[str, Array]:
    """Trainable parameters per device and the frozen base's bytes (the fields ``train_*``,
    ``frozen_*``, ``quantized`` and ``quant_state`` of :class:`Context`).  Full training: everything trains.

    A frozen weight is stored in ``base_bytes`` (the recipe's ``param_bytes``, or the compute dtype the
    script loads it in) and gathered as the recipe gathers weights (``gather_bytes``); under QLoRA the
    linear layers' are packed 4-bit in both (FSDP and ZeRO-3 shard and gather the packed storage), and
    their quantization constants are bitsandbytes' ``quant_state`` beside each weight, which no
    sharding partitions (:func:`autoplace.cost.finetune.nf4_state_bytes_per_param`).
    """
    zero = np.zeros_like(dense_local + exp_local)
    if not table.frozen:
        edge0 = np.zeros_like(edge_dense)
        return {"train_dense": dense_local, "train_exp": exp_local, "train_edge": edge_dense, "frozen_dense": zero,
                "frozen_exp": zero, "frozen_edge": edge0, "frozen_dense_wire": zero, "frozen_exp_wire": zero,
                "frozen_edge_wire": edge0, "quantized": zero, "quant_state": zero}

    def per_device(fmt: str) -> tuple[Array, Array]:
        k = np.array([[getattr(b, fmt % p) for p in ("tp", "rep", "expert")] for b in table.kinds], dtype=float)
        k = k.T.reshape(3, 1, 1, -1, 1)
        return k[0] / tp + k[1] + zero, k[2] / (ep * tp) + zero

    train_dense, train_exp = per_device("adapter_%s")
    quant_dense, quant_exp = per_device("quant_%s")
    packed = finetune.NF4_BITS / 8
    pgb = recipe.gather_bytes
    return {"train_dense": train_dense, "train_exp": train_exp, "train_edge": np.zeros_like(edge_dense),
            "frozen_dense": (dense_local - quant_dense) * base_bytes + quant_dense * packed,
            "frozen_exp": (exp_local - quant_exp) * base_bytes + quant_exp * packed, "frozen_edge": edge_dense * base_bytes,
            "frozen_dense_wire": (dense_local - quant_dense) * pgb + quant_dense * packed,
            "frozen_exp_wire": (exp_local - quant_exp) * pgb + quant_exp * packed, "frozen_edge_wire": edge_dense * pgb,
            "quantized": quant_dense + quant_exp,
            "quant_state": (quant_dense + quant_exp) * finetune.nf4_state_bytes_per_param()}



def _padding(table: LayerTable, cand: Candidates, size: dict[str, Array], first: Array, last: Array) -> dict[str, Array]:
    """FSDP2's padding of each block kind's and each stage's edge tensors (the ``pad_*`` fields of
    :class:`Context`, :func:`autoplace.cost.shards.dim0_padding`): the block's tensors and the edges'
    train in full training; under LoRA the adapters train and the base's tensors are frozen, those
    QLoRA stores in 4 bit (packed flat) padding nothing."""
    C, K = cand.size, len(table.kinds)
    qlora = any(k.quant_tp or k.quant_rep or k.quant_expert for k in table.kinds)
    base = [[r for r in k.rows if not (qlora and r.linear)] for k in table.kinds]
    groups = ([[r for r in g if not r.expert] for g in base] + [[r for r in g if r.expert] for g in base]
              + [[r for r in k.adapter_rows if not r.expert] for k in table.kinds]
              + [[r for r in k.adapter_rows if r.expert] for k in table.kinds]
              + [list(table.embed.rows_tp), list(table.embed.rows_rep), list(table.head.rows_tp),
                 list(table.head.rows_rep)])
    pad = shards.dim0_padding(shards.row_table(groups), cand.tp, cand.ep, size["zero"], size["ezero"])  # [C, 4K + 4]
    blocks = pad[:, :4 * K].reshape(C, 4, 1, K, 1)
    e_tp, e_rep, h_tp, h_rep = (pad[:, 4 * K + i, None] for i in range(4))
    output, embed_copy = head_tables(table, cand)
    head_tp = output[:, None] * h_tp + embed_copy[:, None] * e_tp
    edge = first * (e_tp + e_rep) + last * (head_tp + h_rep)  # as Context.edge_dense counts the edges
    if table.frozen:
        return {"pad_dense": blocks[:, 2], "pad_exp": blocks[:, 3], "pad_edge": np.zeros_like(edge),
                "pad_frozen_dense": blocks[:, 0], "pad_frozen_exp": blocks[:, 1], "pad_frozen_edge": edge}
    zero = np.zeros((C, 1, K, 1))
    return {"pad_dense": blocks[:, 0], "pad_exp": blocks[:, 1], "pad_edge": edge,
            "pad_frozen_dense": zero, "pad_frozen_exp": zero, "pad_frozen_edge": np.zeros_like(edge)}


def _no_padding(C: int, K: int, edge_dense: Array) -> dict[str, Array]:
    """The ``pad_*`` fields of :class:`Context` where shards are not FSDP2's (nothing counted)."""
    block, edge = np.zeros((C, 1, K, 1)), np.zeros_like(edge_dense)
    return {"pad_dense": block, "pad_exp": block, "pad_edge": edge, "pad_frozen_dense": block, "pad_frozen_exp": block,
            "pad_frozen_edge": edge}
