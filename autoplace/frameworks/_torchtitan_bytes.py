"""Bytes per training state on one rank of a torchtitan build, as FSDP2 and torch.optim allocate them.

Before step 1 a torchtitan rank holds only its parameters; gradients and optimizer state appear in the
first step.  They are counted from the framework's own structures, at the step's peak:

- parameters: FSDP2's sharded storage (``FSDPParam._sharded_param_data``, padded, in the parameter's
  dtype), plus the unsharded copies (the all-gather output, in the mixed-precision ``param_dtype``) of
  the units that do not reshard after forward (``post_forward_mesh_info is None``: torchtitan's
  ``fsdp_reshard_after_forward = "never"``), which live from a unit's first forward to its backward;
  parameters FSDP2 does not manage (TP or DDP only) in full, as their local tensors; under a pipeline
  schedule, at the end of a backward, the unsharded copies of the units that reshard after forward too
  (torch.distributed.pipelining calls ``set_reshard_after_backward(False)`` until the schedule's
  REDUCE_GRAD, stage.py ``backward_maybe_with_nosync``: each unit stays unsharded from its backward to
  its next forward), counted where plan.json's peak is the end of the first backward;
- gradients: FSDP2's reduce-scatter output, sharded, cast to the parameter's dtype (foreach_reduce in
  torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); under a pipeline schedule the unsharded
  gradients in the reduce dtype instead (``FSDPParam.to_accumulated_grad_if_needed``:
  torch.distributed.pipelining holds FSDP2's gradient sync to the schedule's REDUCE_GRAD, stage.py
  ``backward_maybe_with_nosync`` / ``perform_reduce_grad``); other parameters' gradients in full;
- optimizer: the state torch's ``Adam._init_group`` creates at the first step (exp_avg, exp_avg_sq, and
  fused Adam's step counters on the device).

States FSDP2 keeps on the host (``CPUOffloadPolicy``, torchtitan's ``enable_cpu_offload``) count as host
bytes, not device bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

from autoplace.dryrun.steps import Steps, tensor_bytes


def create_optimizer_state(optimizers: Iterable[Any]) -> bool:
    """Each optimizer's state as its first step creates it: torch.optim Adam's ``_init_group`` for every
    parameter group, each parameter given a gradient like itself (what the backward leaves), the
    gradients dropped after (``zero_grad(set_to_none=True)``).

    Returns:
        whether fused Adam's accelerator check was bypassed (it refuses meta tensors).
    """
    import torch
    import torch.optim.adam as adam

    optimizers = list(optimizers)
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Adam):
            raise TypeError(f"the dry run creates Adam and AdamW state; the job's optimizer is "
                            f"{type(optimizer).__name__}")
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    fused = any(g["fused"] for o in optimizers for g in o.param_groups)
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        with patched(adam, "_device_dtype_check_for_fused", _on_any_device) if fused else contextlib.nullcontext():
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    optimizer._init_group(group, [], [], [], [], [], [])
    finally:
        for p in params:
            p.grad = None
    return fused


def _on_any_device(param: Any, cuda_unsupported: bool = False) -> None:
    del param, cuda_unsupported


def measure(parts: list[Any], optimizers: Iterable[Any], *, deferred: bool, steps: Steps) -> None:
    """The rank's device bytes per state (params, grads, optimizer) with where they were counted
    (``steps.measured``; the unsharded copies a pipeline leaves after a backward as the params' part at
    the end of a backward); a note (``steps.note``) for what FSDP2 keeps on the host.

    Args:
        parts: the rank's model chunks, parallelized.
        optimizers: torchtitan's optimizers container, state created.
        deferred: the chunks run under a pipeline schedule (FSDP2's gradient sync deferred).
    """
    import torch

    units = _fsdp_params(parts)
    managed = {id(fp.sharded_param) for fp, _ in units}
    plain = list({id(p): p for part in parts for p in part.parameters() if id(p) not in managed}.values())
    offloaded = {id(fp.sharded_param) for fp, _ in units if fp.offload_to_cpu}

    def size(dtype: Any) -> int:
        return torch.empty((), dtype=dtype).element_size()

    sharded = {id(fp): fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp, _ in units}
    gathered = {id(fp): fp.padded_sharded_param_size.numel() * group.mesh_info.shard_mesh_size
                * size(fp.param_dtype or fp.orig_dtype) for fp, group in units}
    kept = [fp for fp, group in units if group.post_forward_mesh_info is None]
    on_device = [fp for fp, _ in units if not fp.offload_to_cpu]
    params = sum(sharded[id(fp)] for fp in on_device) + sum(gathered[id(fp)] for fp in kept) + tensor_bytes(plain)
    if deferred:
        grads = sum(_numel(fp._orig_size) * size(fp.reduce_dtype or fp.param_dtype or fp.orig_dtype)
                    for fp, _ in units)
    else:
        grads = sum(sharded[id(fp)] for fp in on_device)
    grads += tensor_bytes(plain)
    state = [(id(p), t) for o in optimizers for p, s in o.state.items() for t in s.values()
             if isinstance(t, torch.Tensor)]
    optimizer = tensor_bytes(t for pid, t in state if t.device.type == "meta" and pid not in offloaded)

    if offloaded:
        host = sum(sharded[id(fp)] for fp, _ in units if fp.offload_to_cpu)
        steps.note(f"CPU offload: {_gib(host)} of sharded parameters, as much again of sharded gradients and "
                   f"{_gib(tensor_bytes(t for pid, t in state if pid in offloaded and t.device.type == 'meta'))} "
                   "of optimizer state on the host (FSDP2's CPUOffloadPolicy)")
    resharded = [fp for fp, group in units if group.post_forward_mesh_info is not None] if deferred else []
    backward_end = (sum(gathered[id(fp)] for fp in resharded),
                    f"the unsharded copies of the {len(resharded)} tensors of units that reshard after forward, "
                    "left gathered by each backward until the next forward (torch.distributed.pipelining's "
                    "set_reshard_after_backward(False) until REDUCE_GRAD)") if resharded else None
    steps.measured("params", params, _params_how(units, kept, plain), backward_end=backward_end)
    steps.measured("grads", grads, _grads_how(units, plain, deferred))
    steps.measured("optimizer", optimizer, "Adam exp_avg + exp_avg_sq (+ fused Adam's step counters) of the rank's "
                                           "parameters on the device, created by torch.optim's Adam._init_group as "
                                           "the first step creates them")


def _params_how(units: list[Any], kept: list[Any], plain: list[Any]) -> str:
    parts = []
    if units:
        dtype = str(units[0][0].orig_dtype).removeprefix("torch.")
        parts.append(f"{dtype} sharded parameters of {len(units)} FSDP2-managed tensors (FSDP2's padded storage; "
                     "on the host with CPU offload)")
    if kept:
        dtype = str(kept[0].param_dtype or kept[0].orig_dtype).removeprefix("torch.")
        parts.append(f"their {dtype} unsharded copies in {len(kept)} tensors of units that do not reshard after "
                     "forward (all-gathered at the first forward)")
    if plain:
        parts.append(f"{len(plain)} parameters FSDP2 does not manage, whole (their local tensors)")
    return " + ".join(parts)


def _grads_how(units: list[Any], plain: list[Any], deferred: bool) -> str:
    parts = []
    if units and deferred:
        parts.append("FSDP2's unsharded gradients in the reduce dtype, accumulated from the first micro-batch's "
                     "backward until the schedule's REDUCE_GRAD (torch.distributed.pipelining defers the "
                     "reduce-scatter)")
    elif units:
        parts.append("FSDP2's sharded gradients (the reduce-scatter output in the parameters' dtype), from the first "
                     "backward's reduce-scatter to zero_grad (none yet at the start of the step's first backward); "
                     "none on the device with CPU offload")
    if plain:
        parts.append("whole gradients of the parameters FSDP2 does not manage (DDP's buckets, TP's local shards)")
    return " + ".join(parts)


def init_fsdp_dtypes(parts: list[Any]) -> int:
    """Each FSDP2 unit's mixed-precision dtypes, set as FSDP2's lazy init sets them at the first forward
    (``FSDPParamGroup._init_mp_dtypes``, which also checks a unit's parameters share one dtype).

    Returns:
        how many FSDP2 units the chunks hold.
    """
    groups = {id(group): group for _, group in _fsdp_params(parts)}
    for group in groups.values():
        group._init_mp_dtypes()
    return len(groups)


def _fsdp_params(parts: list[Any]) -> list[tuple[Any, Any]]:
    """(FSDPParam, its FSDPParamGroup) of every FSDP2 unit in the chunks (FSDP2's own state per module)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    state = cast(Any, fully_shard).state  # fully_shard's contract adds it; its type stubs do not say so
    groups = {}  # one state may hold several modules (torchtitan's fully_shard([norm, output]))
    for part in parts:
        for module in part.modules():
            group = state(module)._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None:
                groups[id(group)] = group
    return [(fp, group) for group in groups.values() for fp in group.fsdp_params]


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set to ``value`` for the block, then as it was."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)
