"""Composition rules and the two correctness conditions, checked on any plan.

The seed paper's conditions: **gradient integrity** (every update uses the exact average of
the gradients over the global batch: each weight's gradient is reduced over exactly the
ranks that hold a copy of it) and **state consistency** (all copies of a replicated state
are identical when a collective reads them).  The remaining rules are what the frameworks
(Megatron-LM, DeepSpeed, torchtitan) require of degrees and shapes.  Each violation names
its rule, so users can look it up.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplace.compression import applies
from autoplace.cost.layers import LayerTable
from autoplace.plan import MULTI_CHUNK, V_PLACED, Plan, model_chunks, schedule_batching
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec, TransformerSpec


@dataclass(frozen=True)
class Violation:
    """A broken rule: ``rule`` is a stable name, ``message`` says what and by how much."""

    rule: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


def check_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec, table: LayerTable,
               *, allow_tp_across_nodes: bool = False) -> list[Violation]:
    """Every composition rule the plan breaks (memory is checked by the evaluator)."""
    out: list[Violation] = []

    def rule(ok: bool, name: str, message: str) -> None:
        if not ok:
            out.append(Violation(name, message))

    p = plan
    gb = model.training.global_batch
    rule(p.world == cluster.gpus, "world-size",
         f"dp({p.dp}) * tp({p.tp}) * pp({p.pp}) * cp({p.cp}) = {p.world}, but the cluster has {cluster.gpus} GPUs")
    rule(p.global_batch == gb, "gradient-integrity",
         f"mbs({p.mbs}) * grad_accum({p.grad_accum}) * dp({p.dp}) = {p.global_batch} sequences per update, "
         f"but the global batch is {gb}: the update would not average the global batch")
    rule((p.dp * p.cp) % p.ep == 0, "gradient-integrity",
         f"ep({p.ep}) must divide dp*cp ({p.dp * p.cp}) so each expert's gradient is reduced over all its copies")
    rule(p.zero > 0 or p.dp_shard == 1, "state-consistency",
         f"dp_shard({p.dp_shard}) > 1 with zero=0: a shard group that shards nothing; use dp_replicate")
    rule(allow_tp_across_nodes or p.tp <= cluster.nvlink_domain, "tp-within-node",
         f"tp={p.tp} exceeds {_domain(cluster)} (tensor parallel stays inside an NVLink domain "
         "unless tp-across-nodes is allowed)")
    rule(len(p.layers_per_stage) == p.pp and sum(p.layers_per_stage) == table.blocks and min(p.layers_per_stage) >= 0,
         "layer-split", f"layers_per_stage {list(p.layers_per_stage)} must give {p.pp} stages adding up to {table.blocks}")
    rule(len(p.recompute) == table.blocks, "layer-split", f"recompute needs one mode per layer ({table.blocks})")
    rule(p.vpp == 1 or (p.schedule in MULTI_CHUNK and p.pp > 1), "interleave",
         f"vpp={p.vpp} needs a schedule of several chunks per rank ({', '.join(sorted(MULTI_CHUNK))}) and pp > 1")
    rule(p.schedule not in MULTI_CHUNK or p.vpp > 1, "interleave", f"the {p.schedule} schedule needs vpp > 1")
    # torch's ZBVZeroBubble and DualPipeV: "requires exactly 2 stages per rank" (schedules.py, torch 2.13), in a V
    v_placed = p.schedule in V_PLACED
    rule(not v_placed or p.vpp in (1, 2), "interleave", f"{p.schedule} runs exactly 2 chunks per rank, got vpp={p.vpp}")
    # the places count the embedding in rank 0's first chunk, the V's too, and the loss in the looped placement's
    # last chunk, which a V puts on rank 0 beside it (autoplace.plan.stage_slots): the loss place is not modelled
    rule(not v_placed or not p.pp_loss, "layer-split",
         f"pp_loss is modelled on the looped placement's last rank; {p.schedule} ends its V on rank 0")
    rule(p.pp > 1 or not (p.pp_embedding or p.pp_loss), "layer-split",
         "pp_embedding / pp_loss count the embedding / the loss as a pipeline layer: they need pp > 1")
    rule(p.vpp == 1 or len(p.layers_per_stage) != p.pp or
         model_chunks(p.layers_per_stage, p.vpp, p.pp_embedding, p.pp_loss) is not None, "interleave",
         f"every stage's layer count {list(p.layers_per_stage)}{_slots_said(p)} must be a positive multiple of "
         f"vpp={p.vpp}")
    batching = schedule_batching(p.schedule, p.pp, p.grad_accum) if p.pp > 1 else None
    rule(batching is None, "interleave", batching or "")
    rule(p.offload_params == "none" or p.zero == 3, "offload-params-needs-zero3",
         f"offload_params={p.offload_params} needs zero=3 (ZeRO-Infinity / FSDP CPU offload of sharded parameters)")
    rule(p.offload_optimizer == "none" or p.zero >= 1, "offload-optimizer-needs-zero",
         f"offload_optimizer={p.offload_optimizer} needs zero >= 1 (ZeRO-Offload)")
    rule(applies(p, model.training.recipe().reduce_bytes), "compress", _compress_rule(p))
    seq = table.seq_len
    rule(seq % (p.cp * (2 if p.cp > 1 else 1)) == 0, "sequence-split",
         f"seq_len {seq} must be divisible by 2*cp = {2 * p.cp} (load-balanced context parallel)")
    rule(not p.sp or seq // p.cp % p.tp == 0, "sequence-split",
         f"sequence parallel needs seq_len/cp = {seq // p.cp} divisible by tp={p.tp}")
    if isinstance(model, TransformerSpec):
        _transformer_rules(p, model, rule)
    return out


def _transformer_rules(p: Plan, m: TransformerSpec, rule: object) -> None:
    check = rule  # callable(ok, name, message)
    check(m.heads % p.tp == 0, "tp-divides-heads", f"tp={p.tp} must divide heads={m.heads}")  # type: ignore[operator]
    check(m.n_kv_heads % p.tp == 0 or p.tp % m.n_kv_heads == 0, "tp-divides-heads",  # type: ignore[operator]
          f"tp={p.tp} and kv_heads={m.n_kv_heads} must divide one another")
    check(m.ffn_hidden % p.tp == 0, "tp-divides-ffn", f"tp={p.tp} must divide ffn_hidden={m.ffn_hidden}")  # type: ignore[operator]
    if m.moe is not None:
        check(m.moe.experts % p.ep == 0, "ep-divides-experts",  # type: ignore[operator]
              f"ep={p.ep} must divide experts={m.moe.experts}")
    else:
        check(p.ep == 1, "ep-needs-moe", f"ep={p.ep} but the model has no experts")  # type: ignore[operator]


def _slots_said(p: Plan) -> str:
    """How the embedding and the loss count in the interleave rule, in words (nothing when they do not)."""
    places = [name for name, on in (("the embedding on the first", p.pp_embedding), ("the loss on the last", p.pp_loss))
              if on]
    return f" (with {' and '.join(places)} stage counted as a layer)" if places else ""


def _compress_rule(p: Plan) -> str:
    """What ``compress`` needs (autoplace.compression.applies), in words."""
    if p.powersgd_rank and p.compress != "powersgd":
        return f"powersgd_rank={p.powersgd_rank} needs compress=powersgd"
    return {"bf16": "compress=bf16 needs a recipe that reduces gradients wider than bf16 (e.g. bf16-fsdp2)",
            "zeropp": "compress=zeropp (ZeRO++) needs zero=3 over more than one rank, without HSDP replicas",
            "powersgd": "compress=powersgd needs zero=0 (DDP), dp > 1 and powersgd_rank > 0"}.get(p.compress, "")


def _domain(cluster: ClusterSpec) -> str:
    """The fast-fabric bound in words: ``gpus_per_node=8``, or ``nvlink_domain=72`` when wider."""
    if cluster.nvlink_domain == cluster.gpus_per_node:
        return f"gpus_per_node={cluster.gpus_per_node}"
    return f"nvlink_domain={cluster.nvlink_domain}"
