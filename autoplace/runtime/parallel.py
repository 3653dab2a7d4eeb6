"""Applying a plan with PyTorch-native parallelism (torch), in torchtitan's order:
pipeline split -> tensor (+ sequence) parallel -> context parallel -> expert parallel ->
activation checkpointing -> FSDP2 / DDP (:func:`parallelize`; the runtime's worker and the
tracker harness of :mod:`autoplace.fidelity.trackers` both apply plans through it).

Mapping of autoplace's ZeRO levels (docs/ARCHITECTURE.md placements) onto PyTorch:

* zero 0 (R,R,R,R): DDP (a comm hook counts and reduces the buckets); with tp > 1 and dp > 1
  the DTensor gradients are all-reduced over the dp group by hand after backward;
* zero 3 (S*,S,S,R): FSDP2 ``fully_shard(reshard_after_forward=True)`` per block and the root;
* zero 1 and 2 (R,S,R|S,R): FSDP2 ``fully_shard(reshard_after_forward=False)``.  PyTorch has
  no native ZeRO-1/2: FSDP2 without resharding keeps the gathered parameters from forward to
  backward (one all-gather + one reduce-scatter per micro-batch, the same bytes as ZeRO-2) but
  still frees them after backward, so between steps the parameters are sharded, not replicated
  (a labelled deviation of the trial, :func:`autoplace.runtime.spec.deviation`);
* HSDP (dp_replicate > 1 and zero >= 1): ``fully_shard`` over a 2-D (replicate, shard) mesh;
* offload_params / offload_optimizer = cpu: FSDP2 ``CPUOffloadPolicy`` (one policy for both, so
  optimizer-only offload also offloads the parameters: a labelled deviation; on a CPU host
  unpinned and its copies are host-to-host, so a CPU trial does not measure PCIe traffic);
* cp > 1: ring attention over a cp group (:func:`apply_cp`); gradients average over dp x cp;
* ep > 1: each rank of an expert-parallel group holds experts/ep of every MoE block's experts
  and routed tokens travel by all-to-all on a group of its own (:func:`apply_ep`).  Dense weights
  keep the dp x cp reduction above (DDP ignores the experts, FSDP2 shards the rest of the block);
  expert weights are reduced over the expert-data-parallel group only (:func:`reduce_expert_grads`
  by hand under DDP, FSDP2 on a mesh of their own otherwise).

Communication compression (``plan.compress``, :mod:`autoplace.compression`):

* bf16: every gradient reduction travels in bf16 -- FSDP2 ``MixedPrecisionPolicy(reduce_dtype=
  bfloat16)`` at zero >= 1, a bf16 DDP hook (:func:`~autoplace.runtime.comms.ddp_hook`) at zero 0,
  and bf16 copies for the by-hand reductions (tp/pp at zero 0, expert gradients);
* powersgd: DDP with PyTorch's ``powerSGD_hook`` (:func:`apply_ddp`), so zero 0 and tp = pp = 1;
* zeropp: refused (:func:`autoplace.runtime.spec.compress_reason`): ZeRO++ is DeepSpeed's and its
  quantized collectives need CUDA kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplace.errors import BenchmarkError
from autoplace.plan import Plan
from autoplace.runtime.comms import CommLog, count_all_reduces, ddp_hook
from autoplace.runtime.model import Transformer, blocks
from autoplace.runtime.moe import MoE
from autoplace.runtime.spec import compress_reason

log = logging.getLogger("autoplace")

# PowerSGD's plain all-reduce steps before it compresses: the smallest PyTorch allows with error
# feedback and warm start on (PowerSGDState), so a short trial reaches compressed steps; the
# worker counts a step after these (its warm-up is at least POWERSGD_START + 1 steps)
POWERSGD_START = 2


def reduce_dtype(compress: str) -> torch.dtype | None:
    """The dtype gradients are reduced in under ``compress`` (a plan's): bf16, else None (as they are)."""
    return torch.bfloat16 if compress == "bf16" else None


def all_reduce_as(grad: torch.Tensor, group: Any, dtype: torch.dtype | None) -> None:
    """Sum ``grad`` over ``group`` in place, on the wire in ``dtype`` (None: its own); the
    dispatch mode counts the collective in the dtype it travels in."""
    if dtype is None or dtype == grad.dtype:
        dist.all_reduce(grad, group=group)
        return
    wire = grad.to(dtype)
    dist.all_reduce(wire, group=group)
    grad.copy_(wire)


@dataclass
class Layout:
    """This rank's place in the plan: the mesh and its coordinates."""

    mesh: DeviceMesh
    dims: tuple[str, ...]
    pp_rank: int
    dp_rank: int  # index into the global batch (replicate x shard coordinates)
    tp_rank: int
    cp_rank: int = 0  # which chunk of the sequence this rank holds
    dp_group: Any = None  # the gradient-averaging group (replicate x shard x cp flattened), if larger than 1
    cp_group: Any = None  # attention's K/V exchange: a group of its own, so the counter tells it from gradients
    expert_mesh: DeviceMesh | None = None  # ("pp", "edp", "ep") when ep > 1: FSDP2 shards experts over "edp"
    ep_group: Any = None  # the token all-to-all: a group of its own, so it is counted as "ep"

    @property
    def edp_group(self) -> Any:
        """The expert-data-parallel group: ranks holding the same experts (size dp x cp / ep)."""
        return self.expert_mesh["edp"].get_group() if self.expert_mesh is not None else None

    def group(self, dim: str) -> Any:
        return self.mesh[dim].get_group() if dim in self.dims else None


def build_layout(plan: Plan, world: int, device: str) -> Layout:
    """The device mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` (torchtitan's order); size-1 dimensions are left out.

    Context-parallel ranks hold identical weights and disjoint tokens, so gradients are averaged
    over dp x cp (the cost model's "dp" group) and ZeRO shards over dp_shard x cp.

    Raises:
        BenchmarkError: the plan's world size differs from the launched one.
    """
    sizes = {"pp": plan.pp, "dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "cp": plan.cp, "tp": plan.tp}
    if plan.world != world:
        raise BenchmarkError(f"pp({plan.pp}) * dp_replicate({plan.dp_replicate}) * dp_shard({plan.dp_shard}) "
                             f"* tp({plan.tp}) * cp({plan.cp}) != WORLD_SIZE({world})")
    dims = tuple(d for d, n in sizes.items() if n > 1) or ("dp_shard",)
    mesh = init_device_mesh(device, tuple(sizes[d] for d in dims), mesh_dim_names=dims)
    coord = {d: mesh.get_local_rank(d) for d in dims}
    dp_rank = coord.get("dp_replicate", 0) * plan.dp_shard + coord.get("dp_shard", 0)
    grad_dims = tuple(d for d in dims if d.startswith("dp") or d == "cp")
    dp_group = None
    if plan.dp * plan.cp > 1:
        dp_group = mesh[grad_dims[0]].get_group() if len(grad_dims) == 1 else mesh[grad_dims]._flatten().get_group()
    cp_group = _own_group(mesh, "cp") if plan.cp > 1 else None
    lay = Layout(mesh, dims, coord.get("pp", 0), dp_rank, coord.get("tp", 0), coord.get("cp", 0), dp_group, cp_group)
    if plan.ep > 1:
        lay.expert_mesh = build_expert_mesh(plan, device)
        lay.ep_group = _own_group(lay.expert_mesh, "ep")
    return lay


def build_expert_mesh(plan: Plan, device: str) -> DeviceMesh:
    """The experts' view of the ranks, ``(pp, edp, ep)``: ep carved from dp x cp (tp = 1).

    Megatron's rank order tp-cp-ep-dp-pp (the cost model's ``group_layout``): an ep group is
    ``ep`` consecutive data-parallel ranks at the same cp coordinate (stride tp * cp), spilling
    into cp only when ep > dp; the edp group is what remains of dp x cp.  Any split would be
    correct (tokens may go to any rank); this one puts the all-to-all where the cost model does.
    """
    ranks = torch.arange(plan.world).view(plan.pp, plan.dp, plan.cp)  # the dense mesh's order (tp = 1)
    experts = ranks.permute(0, 2, 1).reshape(plan.pp, -1, plan.ep)  # dp innermost, ep consecutive
    return DeviceMesh(device, experts, mesh_dim_names=("pp", "edp", "ep"))


def _own_group(mesh: DeviceMesh, dim: str) -> Any:
    """A new process group over this rank's ``dim`` of the mesh (every rank creates every such
    group, as ``new_group`` requires)."""
    names = mesh.mesh_dim_names or ()
    rows = mesh.mesh.movedim(names.index(dim), -1).reshape(-1, mesh.size(names.index(dim))).tolist()
    mine = None
    for row in rows:
        group = dist.new_group(row)
        mine = group if dist.get_rank() in row else mine
    return mine


def fsdp_mesh(layout: Layout) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard x cp flattened, with dp_replicate as HSDP's outer dimension."""
    mesh, dims = layout.mesh, layout.dims
    shard: tuple[str, ...] = tuple(d for d in ("dp_shard", "cp") if d in dims)
    if len(shard) == 2:
        mesh[shard]._flatten("dp_shard_cp")
        shard = ("dp_shard_cp",)
    names = (("dp_replicate",) if "dp_replicate" in dims else ()) + shard
    return mesh[names]


def group_dims(layout: Layout) -> dict[str, str]:
    """Process-group name -> plan dimension, for the collective counter (gradient reductions over
    dp x cp count as "dp", as the cost model files them)."""
    out: dict[str, str] = {}
    for d in layout.dims:  # on the mesh, cp takes part only in gradient reductions and ZeRO shards
        out[layout.mesh[d].get_group().group_name] = "dp" if d.startswith("dp") or d == "cp" else d
    if layout.dp_group is not None:
        out[layout.dp_group.group_name] = "dp"
    if layout.cp_group is not None:
        out[layout.cp_group.group_name] = "cp"
    if layout.ep_group is not None:  # expert gradients over edp count as "dp", as in the cost model
        out[layout.edp_group.group_name] = "dp"
        out[layout.ep_group.group_name] = "ep"
    return out


def apply_tp(model: Transformer, mesh: DeviceMesh, sp: bool, loss_parallel: bool = False) -> None:
    """Megatron-style tensor parallel (+ sequence parallel) with DTensor, as torchtitan's apply_tp.

    Each block's attention and MLP input enters as one replicated DTensor, so the gradients of
    wq/wk/wv (and w1/w3) are summed before a single all-reduce: Megatron's ``f`` operator
    (Shoeybi et al. 2019, Fig. 3).  ``loss_parallel`` leaves the head's logits sharded over the
    vocabulary for ``torch.distributed.tensor.parallel.loss_parallel`` (torchtitan's default);
    otherwise they are gathered.  Tied embeddings (GPT): the vocab-parallel table and the
    column-parallel head both shard the ``(vocab, hidden)`` matrix by rows, so one ``Shard(0)``
    parameter serves both, as Megatron's shared word embedding does; ``parallelize_module``
    gives each module its own copy, so the head is re-tied to the table afterwards.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sp else Replicate()
    tied = model.output is not None and model.tok_embeddings is not None and (
        model.output.weight is model.tok_embeddings.weight)
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, mesh, top)
    if tied:
        model.output.weight = model.tok_embeddings.weight  # type: ignore[union-attr]
    for block in blocks(model):
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(input_layouts=(seq, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if "feed_forward.w3" in dict(block.named_modules()):
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)


def apply_cp(model: Transformer, group: Any) -> None:
    """Context parallel: this rank's tokens are chunk ``rank(group)`` of the sequence (rotary and
    learned positions start there) and every attention core runs ring attention over ``group``."""
    model.cp_rank = dist.get_rank(group)
    for block in blocks(model):
        block.get_submodule("attention.core").cp_group = group


def apply_ep(model: Transformer, group: Any) -> None:
    """Expert parallel: keep this rank's experts/ep consecutive experts of every MoE block, drop
    the rest (names keep their global expert index) and route tokens over ``group`` (see MoE)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for moe in _moe_layers(model):
        if moe.n_experts % n:
            raise BenchmarkError(f"ep={n} must divide experts={moe.n_experts}")
        local = range(rank * moe.n_experts // n, (rank + 1) * moe.n_experts // n)
        for key in [k for k in moe.experts if int(k) not in local]:
            del moe.experts[key]
        moe.ep_group = group


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_names(model: nn.Module) -> list[str]:
    """Qualified names of the routed experts' parameters (wrapper prefixes included, as DDP needs)."""
    return [n for n, _ in model.named_parameters() if _is_expert(n)]


def _is_expert(name: str) -> bool:
    """A routed expert's parameter (``...feed_forward.experts.<e>.w1.weight``; not ``shared_experts``)."""
    return ".experts." in name


def reduce_expert_grads(model: nn.Module, layout: Layout, fault: str, *, fsdp: bool,
                        dtype: torch.dtype | None = None) -> None:
    """Average expert gradients over the global batch when ep > 1 (DDP / manual paths and FSDP2).

    An expert's gradient already sums the contributions of its whole ep group (the all-to-all's
    backward brings them home), each computed from a rank-local mean loss; so summing it over
    the edp group and dividing by dp x cp gives the global-batch mean.  FSDP2 has averaged over
    edp already, which leaves the division by ep.  ``dtype``: the wire's under DDP (bf16
    compression; None: as they are); FSDP2 reduces in its policy's ``reduce_dtype``.
    """
    if fault == "desync":
        return
    edp, ep = layout.edp_group, dist.get_world_size(layout.ep_group)
    n = dist.get_world_size(edp)
    for name, p in model.named_parameters():
        if not _is_expert(name) or p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if not fsdp and n > 1:
            all_reduce_as(g, edp, dtype)  # counted by the dispatch mode, under "dp"
        if fault != "sum-grads":
            g.div_(ep if fsdp else ep * n)


def apply_ac(model: Transformer, recompute: tuple[str, ...]) -> None:
    """Per-block activation checkpointing: ``full`` wraps the block, ``selective`` wraps only the
    attention core (rotary + softmax(QK^T)V, Korthikanti et al. 2022 Sec. 5)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    block: Any
    for key, block in list(model.layers.items()):
        mode = recompute[int(key)] if int(key) < len(recompute) else "none"
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective":
            block.attention.core = checkpoint_wrapper(block.attention.core, preserve_rng_state=False)


# FSDP2 MixedPrecisionPolicy(param_dtype, reduce_dtype) of autoplace's FSDP2 recipes (specs.model):
# 16-bit gathers and compute, fp32 shards and gradient reduction, as torchtitan configures it
MIXED = {"bf16-fsdp2": (torch.bfloat16, torch.float32)}


def apply_fsdp(model: Transformer, mesh: DeviceMesh, *, reshard: bool, root_reshard: bool = False,
               precision: str = "fp32", offload: bool = False, expert_mesh: DeviceMesh | None = None,
               reduce: torch.dtype | None = None) -> None:
    """FSDP2: each block is one unit (gathered as a whole), the root holds embedding and head.

    With expert parallelism a MoE block's local experts form one unit of their own first, on
    the expert mesh's edp dimension: they are replicated over edp, not over dp x cp.

    Args:
        reshard: blocks' ``reshard_after_forward`` (True: ZeRO-3).
        root_reshard: the root's.  autoplace's emitter and torchtitan leave it False: its head is
            needed again at once by backward, so it is gathered once per micro-batch (the cost
            model's edge term).
        precision: ``fp32`` or a recipe of :data:`MIXED` (``MixedPrecisionPolicy``).
        offload: ``CPUOffloadPolicy`` -- parameters, gradients and the optimizer step on the host
            (FSDP2 has no optimizer-only offload); pinned only with an accelerator.
        reduce: the gradients' reduce dtype when the plan compresses them (bf16), overriding the
            recipe's (None: the recipe's).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param, recipe_reduce = MIXED.get(precision, (None, None))
    reduce = reduce or recipe_reduce
    pin = next(model.parameters()).device.type != "cpu"
    kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce),
                          "offload_policy": CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy()}
    for block in blocks(model):
        moe = _moe_layers(block)
        if expert_mesh is not None and moe:
            fully_shard(moe[0].experts, mesh=expert_mesh["edp"], reshard_after_forward=reshard, **kw)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, **kw)


def parallelize(model: Transformer, plan: Plan, layout: Layout, *, precision: str = "fp32", root_reshard: bool = False,
                loss_parallel: bool = False) -> str:
    """Apply ``plan`` to one model (chunk) in torchtitan's order: TP -> CP -> EP -> activation
    checkpointing -> FSDP2.  The runtime and the tracker harness both call this.

    Returns:
        what is left to the caller for the gradients: ``"none"`` (one replica), ``"fsdp"`` (done),
        ``"ddp"`` (zero 0, no tp/pp: wrap in :func:`apply_ddp`) or ``"manual"`` (zero 0 with tp or
        pp: :func:`reduce_dtensor_grads` after backward).

    Raises:
        BenchmarkError: a compression the runtime cannot run (:func:`~autoplace.runtime.spec.compress_reason`):
            running it uncompressed would measure another plan.
    """
    why = compress_reason(plan)
    if why:
        raise BenchmarkError(why)
    if plan.tp > 1:
        apply_tp(model, layout.mesh["tp"], plan.sp, loss_parallel)
    if plan.cp > 1:
        apply_cp(model, layout.cp_group)
    if plan.ep > 1:
        apply_ep(model, layout.ep_group)
    apply_ac(model, plan.recompute)
    if layout.dp_group is None:
        return "none"
    if plan.zero == 0:
        return "ddp" if plan.tp == 1 and plan.pp == 1 else "manual"
    apply_fsdp(model, fsdp_mesh(layout), reshard=plan.zero >= 3, root_reshard=root_reshard, precision=precision,
               offload="cpu" in (plan.offload_params, plan.offload_optimizer), expert_mesh=layout.expert_mesh,
               reduce=reduce_dtype(plan.compress))
    return "fsdp"


def apply_ddp(model: nn.Module, group: Any, comm: CommLog, bucket_mb: float, fault: str,
              ignore: list[str] | None = None, *, compress: str = "none", powersgd_rank: int = 0) -> nn.Module:
    """DDP with a counting comm hook; ``fault`` injects sum-not-average or no reduction.  Parameters
    named in ``ignore`` (expert-parallel experts) are left to :func:`reduce_expert_grads`.

    ``compress``: ``bf16`` reduces the buckets in bf16 (:func:`~autoplace.runtime.comms.ddp_hook`);
    ``powersgd`` registers PyTorch's PowerSGD hook (:func:`_powersgd`).

    Raises:
        BenchmarkError: a ``fault`` with PowerSGD (faults are injected by the uncompressed hook).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    # the only buffers are the rotary tables, constants built alike on every rank: no per-forward broadcast
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_mb, broadcast_buffers=False)
    if compress == "powersgd":
        if fault != "none":
            raise BenchmarkError(f"--break {fault} injects faults into the uncompressed DDP hook, not PowerSGD's")
        _powersgd(ddp, group, comm, powersgd_rank)
        return ddp
    dtype = reduce_dtype(compress)
    ddp.register_comm_hook(group, ddp_hook(comm, "dp", average=fault != "sum-grads", skip=fault == "desync",
                                           dtype=dtype))
    return ddp


def _powersgd(ddp: nn.Module, group: Any, comm: CommLog, rank: int) -> None:
    """Register PyTorch's PowerSGD hook of ``rank`` on ``ddp``, its all-reduces counted.

    Error feedback and warm start stay on (PyTorch's recommendation, and what the cost model's
    error-feedback memory assumes); the first :data:`POWERSGD_START` steps are plain all-reduces
    (PyTorch's default of 1,000 would leave a trial uncompressed).  ``min_compression_rate`` is
    PyTorch's default 2, the cost model's ``POWERSGD_MIN_COMPRESSION``.  The hook all-reduces the
    uncompressed tensors, then P, then Q per bucket, the last two from future callbacks on gloo's
    thread: :func:`~autoplace.runtime.comms.count_all_reduces` counts them there.  Under gloo
    the buckets are serialized (:func:`_one_bucket_at_a_time`).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                               start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True)
    count_all_reduces(psgd, comm)
    hook = psgd.powerSGD_hook
    if dist.get_backend(group) == "gloo":
        hook = _one_bucket_at_a_time(hook)
    ddp.register_comm_hook(state, hook)  # type: ignore[operator]


def _one_bucket_at_a_time(hook: Any) -> Any:
    """``hook`` with each bucket waiting until the previous bucket's collectives are done.

    gloo completes a future on its own thread and runs its callbacks there, so PowerSGD's P and Q
    all-reduces of one bucket (issued from callbacks) race the next bucket's first all-reduce
    (issued by backward): the ranks can issue them in different orders, a collective mismatch
    that aborts gloo ("Received data size doesn't match expected size").  NCCL runs the callbacks
    in order on the issuing thread; gloo needs the wait, which costs the overlap of a bucket's
    compression with the next bucket's backward (a CPU trial's time is not a GPU's anyway).
    """
    last: list[Any] = []

    def serialized(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
        if last:
            last.pop().wait()
        fut = hook(state, bucket)
        last.append(fut)
        return fut

    return serialized


def reduce_dtensor_grads(model: nn.Module, group: Any, comm: CommLog, fault: str, *, experts: bool = True,
                         dtype: torch.dtype | None = None) -> None:
    """zero 0 with tp > 1 or pp > 1: all-reduce every gradient's local shard over the dp group
    (expert-parallel experts excepted, ``experts=False``: :func:`reduce_expert_grads` does them),
    on the wire in ``dtype`` (bf16 compression; None: as they are)."""
    n = dist.get_world_size(group)
    for name, p in model.named_parameters():
        if p.grad is None or fault == "desync" or (not experts and _is_expert(name)):
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        all_reduce_as(g, group, dtype)  # counted by the dispatch mode
        if fault != "sum-grads":
            g.div_(n)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full tensor, under its plain model name (collective)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        clean = name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
        out[clean] = t.detach().cpu().clone()
    return out


def check_heads(heads: int, kv_heads: int, tp: int) -> None:
    if heads % tp or kv_heads % tp:
        raise BenchmarkError(f"tp={tp} must divide heads({heads}) and kv_heads({kv_heads})")
