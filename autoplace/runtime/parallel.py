"""Applying a plan with PyTorch-native parallelism (torch), in torchtitan's order:
pipeline split -> tensor (+ sequence) parallel -> activation checkpointing -> FSDP2 / DDP.

Mapping of autoplace's ZeRO levels (DESIGN.md placements) onto PyTorch:

* zero 0 (R,R,R,R): DDP (a comm hook counts and reduces the buckets); with tp > 1 and dp > 1
  the DTensor gradients are all-reduced over the dp group by hand after backward;
* zero 3 (S*,S,S,R): FSDP2 ``fully_shard(reshard_after_forward=True)`` per block and the root;
* zero 1 and 2 (R,S,R|S,R): FSDP2 ``fully_shard(reshard_after_forward=False)``.  PyTorch has
  no native ZeRO-1/2: FSDP2 without resharding keeps the gathered parameters from forward to
  backward (one all-gather + one reduce-scatter per micro-batch, the same bytes as ZeRO-2) but
  still frees them after backward, so between steps the parameters are sharded, not replicated;
* HSDP (dp_replicate > 1 and zero >= 1): ``fully_shard`` over a 2-D (replicate, shard) mesh;
* offload_params / offload_optimizer = cpu: FSDP2 ``CPUOffloadPolicy`` (one policy for both; on a
  CPU host unpinned and its copies are host-to-host, so a CPU trial does not measure PCIe traffic);
* cp > 1: attention gathers K/V over a cp group (:func:`apply_cp`); gradients average over dp x cp.
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
from autoplace.runtime.comms import CommLog, ddp_hook
from autoplace.runtime.model import Transformer

log = logging.getLogger("autoplace")


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
    return Layout(mesh, dims, coord.get("pp", 0), dp_rank, coord.get("tp", 0), coord.get("cp", 0), dp_group, cp_group)


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
    return out


def apply_tp(model: Transformer, mesh: DeviceMesh, sp: bool) -> None:
    """Megatron-style tensor parallel (+ sequence parallel) with DTensor, as torchtitan's apply_tp."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, mesh, top)
    block: Any
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)


def apply_cp(model: Transformer, group: Any) -> None:
    """Context parallel: every attention core gathers K and V over ``group`` (see AttentionCore)."""
    block: Any
    for block in model.layers.values():
        block.attention.core.cp_group = group


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


def apply_fsdp(model: Transformer, mesh: DeviceMesh, plan: Plan) -> None:
    """FSDP2: each block is one unit (gathered as a whole), the root holds embedding and head.

    The root is never resharded after forward: its head is needed again at once by backward, so
    it is gathered once per micro-batch (the cost model's edge term; torchtitan does the same
    for the last layers, which FSDP would prefetch right after forward anyway).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = plan.zero >= 3
    # pinned host memory needs an accelerator; on a CPU host the policy still runs (sharded states and
    # the optimizer step on the host), its copies are host-to-host and cost nothing
    pin = next(model.parameters()).device.type != "cpu"
    offload = CPUOffloadPolicy(pin_memory=pin) if "cpu" in (plan.offload_params, plan.offload_optimizer) else OffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload)


def apply_ddp(model: nn.Module, group: Any, comm: CommLog, bucket_mb: float, fault: str) -> nn.Module:
    """DDP with a counting comm hook; ``fault`` injects sum-not-average or no reduction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(group, ddp_hook(comm, "dp", average=fault != "sum-grads", skip=fault == "desync"))
    return ddp


def reduce_dtensor_grads(model: nn.Module, group: Any, comm: CommLog, fault: str) -> None:
    """zero 0 with tp > 1: all-reduce every gradient's local shard over the dp group."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None or fault == "desync":
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(g, group=group)  # counted by the dispatch mode
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
