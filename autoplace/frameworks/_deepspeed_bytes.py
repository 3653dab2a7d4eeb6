"""The bytes DeepSpeed's engine holds on one rank, per training state, read from its own structures.

Each of DeepSpeed's optimizer wrappers keeps the model's 16-bit weights, its fp32 master copy and the
gradients in its own flat buffers; :func:`measure` reads them (meta tensors: elements x element size) and
says which structure each count comes from.  What the first backward allocates (ZeRO-2's gradient
partition, ZeRO-1's and plain DDP's ``.grad`` tensors) is counted from the same structures the way
DeepSpeed sizes it (cited per wrapper); the gradient buckets and Adam's state were made by
:func:`autoplace.frameworks._deepspeed_dry.first_step_state`.  What DeepSpeed keeps on the host (ZeRO-Offload's
fp32 partitions, their gradients and Adam's state; ZeRO-3's offloaded parameter partitions) is counted
apart: the states' device bytes go to ``steps.measured``, the host bytes to :class:`Counted`'s ``host``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoplace.dryrun.steps import tensor_bytes

if TYPE_CHECKING:
    from autoplace.dryrun.steps import Steps


@dataclass
class Counted:
    """Bytes per state on the device (and where they were counted), on the host, and what else to say."""

    device: dict[str, tuple[int, str]] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, state: str, nbytes: int, how: str, *, on_host: bool = False) -> None:
        if on_host:
            self.host[state] = self.host.get(state, 0) + nbytes
            self.device.setdefault(state, (0, "on the host"))
            return
        total, said = self.device.get(state, (0, ""))
        self.device[state] = (total + nbytes, f"{said} + {how}" if said and said != "on the host" else how)


def measure(engine: Any, steps: Steps, host_predicted: int | None = None) -> Counted:
    """Report the rank's bytes per state (``steps.measured``) as ``engine``'s optimizer holds them, and its
    host bytes beside plan.json's ``host_memory_per_gpu_bytes.offloaded`` (``host_predicted``) in a note."""
    optimizer = engine.optimizer
    kind = type(optimizer).__name__
    counters = {"DeepSpeedZeroOptimizer_Stage3": _zero3, "DeepSpeedZeroOptimizer": _zero12,
                "BF16_Optimizer": _bf16, "FP16_UnfusedOptimizer": _fp16}
    counted = counters.get(kind, _plain)(engine)
    for state, (nbytes, how) in counted.device.items():
        steps.measured(state, nbytes, how)
    if counted.host:
        steps.note(host_note(counted.host, host_predicted))
    for note in counted.notes:
        steps.note(note)
    return counted


HOST = "on the host (DeepSpeed's offload): "
# what plan.json's buffers hold besides: allocated during the step, not at initialize
LATER = "; the step's gather and loss buffers come later"


def host_note(host: dict[str, int], predicted: int | None) -> str:
    """The host bytes per state, and their error against plan.json's prediction."""
    total = sum(host.values())
    parts = ", ".join(f"{state} {nbytes:,}" for state, nbytes in host.items())
    versus = f"; plan.json: {predicted:,} ({total / predicted - 1:+.1%})" if predicted else ""
    return f"{HOST}{total:,} bytes ({parts}){versus}"


def state_bytes(optimizer: Any) -> int:
    """The basic optimizer's per-parameter state (Adam: exp_avg and exp_avg_sq), its 0-dim step counters aside."""
    return tensor_bytes(t for s in optimizer.state.values() for t in s.values()
                        if hasattr(t, "dim") and t.dim() > 0)


def quant_state_bytes(module: Any) -> int:
    """Bytes of the bitsandbytes quantization state of the 4-bit layers in ``module`` (QLoRA): the first-level
    absmax, and with double quantization its own absmax, the two code books and the offset -- the weight's
    ``quant_state``, or the layer's own copy (bitsandbytes nn/modules.py ``Params4bit._quantize`` keeps both)
    once FSDP2 has replaced the weight by its shard."""
    total, seen = 0, set()
    for layer in module.modules():  # PEFT's wrapper of a 4-bit layer shows its weight too: each state once
        state = getattr(getattr(layer, "weight", None), "quant_state", None)
        state = state if state is not None else getattr(layer, "quant_state", None)
        while state is not None and id(state) not in seen:
            seen.add(id(state))
            total += tensor_bytes(t for t in (state.absmax, state.code, state.offset) if t is not None and hasattr(t, "numel"))
            state = getattr(state, "state2", None)
    return total


def frozen(module: Any) -> tuple[int, str]:
    """The frozen base's bytes on the rank (LoRA / QLoRA): every parameter that trains not, whole (ZeRO-1/2 and
    the bf16 wrappers flatten only what the optimizer steps), with its 4-bit quantization state."""
    params = [p for p in module.parameters() if not p.requires_grad]
    if not params:
        return 0, ""
    quant = quant_state_bytes(module)
    return tensor_bytes(params) + quant, "the frozen base, whole" + (" (4-bit packed, + its quant_state)" if quant else "")


def _numel_bytes(tensors: Iterable[Any], dtype: Any) -> int:
    """Bytes of as many ``dtype`` elements as ``tensors`` have."""
    import torch

    return sum(t.numel() for t in tensors) * torch.empty((), dtype=dtype).element_size()


def _zero3(engine: Any) -> Counted:
    """ZeRO-3 (stage3.py ``DeepSpeedZeroOptimizer_Stage3``): every parameter's ``ds_tensor`` partition, the
    flat gradient partition buffer and the fp32 partitions, all allocated at initialize; the reduce buckets
    (``ipg_buckets``) too, with contiguous gradients."""
    opt, out = engine.optimizer, Counted()
    offload_params = _offloads(engine.zero_offload_param())
    params = list(engine.module.parameters())
    out.add("params", tensor_bytes(p.ds_tensor for p in params), "ds_tensor partition of every parameter (zero.Init)",
            on_host=offload_params)
    quant = quant_state_bytes(engine.module)
    if quant:  # beside each 4-bit weight, never partitioned nor offloaded
        out.add("params", quant, "the 4-bit weights' quant_state, whole")
    host = _offloads(engine.zero_offload_optimizer())
    out.add("grads", tensor_bytes([opt.grad_partitions_flat_buffer]),
            "gradient partition buffer (grad_partitions_flat_buffer)", on_host=host)
    # a partition already fp32 on the optimizer's device is its own master (_create_fp32_partitions)
    fp32 = [f for f, bit16 in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat, strict=True)
            if f is not bit16]
    shared = len(opt.fp32_partitioned_groups_flat) - len(fp32)
    out.add("optimizer", tensor_bytes(fp32) + state_bytes(opt.optimizer),
            "fp32 master partitions (fp32_partitioned_groups_flat" + (f"; {shared} fp32 parameter partition(s) are "
                                                                      "their own master" if shared else "")
            + ") + Adam exp_avg + exp_avg_sq (first step)", on_host=host)
    if host:
        out.add("grads", tensor_bytes(p.grad for p in fp32 if p.grad is not None),
                "fp32 gradients of the fp32 partitions", on_host=True)
    buckets = [b.buffer for b in opt.ipg_buckets.values() if getattr(b, "buffer", None) is not None]
    out.add("buffers", tensor_bytes(buckets), f"reduce buckets (ipg_buckets, reduce_bucket_size each){LATER}")
    return out


def _zero12(engine: Any) -> Counted:
    """ZeRO-1/2 (stage_1_and_2.py ``DeepSpeedZeroOptimizer``): the flat 16-bit groups (every parameter), the
    fp32 partition of each group; gradients as the first backward allocates them: ZeRO-2 copies the
    partition's gradients into ``grads_in_partition`` (every parameter overlapping the partition, 16-bit) or,
    with fp32 accumulation, a compact fp32 partition; ZeRO-1 keeps each parameter's ``.grad`` to the step,
    offloaded or not.  ZeRO-Offload keeps the fp32 partitions, their fp32 gradients and Adam's state on the
    host."""
    opt, out = engine.optimizer, Counted()
    out.add("params", tensor_bytes(opt.bit16_groups_flat), "16-bit flat parameter groups (bit16_groups_flat)")
    _add_frozen(out, engine)
    host = bool(opt.cpu_offload)
    if host:
        out.add("grads", tensor_bytes(p.grad for p in opt.single_partition_of_fp32_groups),
                "fp32 gradient partitions (single_partition_of_fp32_groups' .grad)", on_host=True)
    if opt.partition_gradients and not host:  # offloaded, each reduced part goes to the host as its bucket fills
        for i, params in enumerate(opt.params_in_partition):
            if opt._use_compact_grad_partition_buffer(i):
                out.add("grads", _numel_bytes([opt.single_partition_of_fp32_groups[i]], opt.gradient_accumulation_dtype),
                        "fp32 gradient partition (compact buffer)")
            else:
                out.add("grads", _numel_bytes(params, opt.dtype),
                        "16-bit gradients of the parameters in the partition (grads_in_partition)")
        out.notes.extend(_fullest_partition(opt))
    elif not opt.partition_gradients:
        dtype = opt.gradient_accumulation_dtype if opt.use_grad_accum_attribute else opt.dtype
        out.add("grads", _numel_bytes((p for g in opt.bit16_groups for p in g), dtype),
                "every parameter's gradient (ZeRO-1 reduces" + (", and offloads," if host else "") + " at the step)")
    out.add("optimizer", tensor_bytes(opt.single_partition_of_fp32_groups) + state_bytes(opt.optimizer),
            "fp32 master partitions (single_partition_of_fp32_groups) + Adam exp_avg + exp_avg_sq (first step)",
            on_host=host)
    buckets = [t for b in opt.ipg_buckets.values() for t in b.buffer]
    out.add("buffers", tensor_bytes(buckets),
            f"reduce buckets (ipg_buckets: reduce_bucket_size, two with overlap_comm){LATER}")
    if host:
        out.add("buffers", tensor_bytes([opt.temp_grad_buffer_for_gpu_offload]),
                "offload staging buffer (temp_grad_buffer_for_gpu_offload: the largest parameter)")
        out.add("buffers", tensor_bytes([opt.temp_grad_buffer_for_cpu_offload, *opt.param_buffer_of_bit16_for_cpu_offload_groups]),
                "host staging: the largest parameter's gradient and a 16-bit copy of the partition", on_host=True)
    return out


FULLEST = "DeepSpeed's ZeRO-2 gradient partitions hold whole parameters (copy_grads_in_partition): "


def _fullest_partition(opt: Any) -> list[str]:
    """Which data-parallel rank's ``grads_in_partition`` is the largest (what plan.json predicts for the stage):
    every rank's parameters in partition, from DeepSpeed's own group order, padding and partition size as
    ``get_partition_info`` walks them (vectorized: a 16k-rank world in milliseconds)."""
    import numpy as np
    import torch.distributed as dist

    totals: Any = None  # elements per data-parallel rank, over the groups
    group = None
    for i, tensors in enumerate(opt.round_robin_bit16_groups):
        if opt._use_compact_grad_partition_buffer(i):
            return []
        sizes = np.array([t.numel() for t in tensors], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes + np.array(opt.round_robin_bit16_padding[i]))[:-1]])
        ends, counted = starts + sizes, np.concatenate([[0], np.cumsum(sizes)])
        parts, size = len(opt.parallel_partitioned_bit16_groups[i]), int(opt.partition_size[i])
        lo = np.arange(parts) * size
        first = np.searchsorted(ends, lo, side="right")  # a tensor ending inside or after the part's start
        last = np.searchsorted(starts, lo + size, side="left")  # ... and starting before its end
        held = counted[np.maximum(last, first)] - counted[first]
        if totals is not None and totals.shape != held.shape:  # groups over other ranks (AutoEP's experts)
            return []
        totals = held if totals is None else totals + held
        group = opt.real_dp_process_group[i]
    if group is None or totals is None:
        return []
    fullest = int(np.argmax(totals))
    element = opt.bit16_groups_flat[0].element_size()
    return [f"{FULLEST}data-parallel rank {fullest} (global rank {dist.get_global_rank(group, fullest)}) holds the "
            f"most, {int(totals[fullest]) * element:,} bytes; this rank "
            f"{int(totals[dist.get_rank(group)]) * element:,} (plan.json predicts the stage's fullest rank)"]


def _bf16(engine: Any) -> Counted:
    """``BF16_Optimizer`` (bf16_optimizer.py; DeepSpeed's pipeline engine at ZeRO-0, or ZeRO-1 with fp32
    gradient accumulation): flat bf16 groups, a full fp32 gradient buffer, fp32 master partitions over the
    data-parallel group."""
    opt, out = engine.optimizer, Counted()
    out.add("params", tensor_bytes(opt.bf16_groups_flat), "bf16 flat parameter groups (bf16_groups_flat)")
    _add_frozen(out, engine)
    out.add("grads", tensor_bytes(opt.fp32_groups_gradients_flat),
            "full fp32 gradient buffer (fp32_groups_gradients_flat)")
    out.add("optimizer", tensor_bytes(opt.fp32_groups_flat_partition) + state_bytes(opt.optimizer),
            "fp32 master partitions (fp32_groups_flat_partition) + Adam exp_avg + exp_avg_sq (first step)")
    return out


def _fp16(engine: Any) -> Counted:
    """``FP16_UnfusedOptimizer`` (fp16/unfused_optimizer.py; DeepSpeed's 16-bit training without ZeRO and with
    a torch optimizer): the module's 16-bit weights and a full fp32 copy of each (``fp32_groups``); the engine
    all-reduces each parameter's 16-bit ``.grad``."""
    opt, out = engine.optimizer, Counted()
    params = [p for g in opt.fp16_groups for p in g]
    out.add("params", tensor_bytes(params), "16-bit weights (fp16_groups)")
    _add_frozen(out, engine)
    out.add("grads", tensor_bytes(params), "every parameter's 16-bit .grad (the engine all-reduces them)")
    out.add("optimizer", tensor_bytes(p for g in opt.fp32_groups for p in g) + state_bytes(opt.optimizer),
            "full fp32 master copy (fp32_groups) + Adam exp_avg + exp_avg_sq (first step)")
    return out


def _add_frozen(out: Counted, engine: Any) -> None:
    nbytes, how = frozen(engine.module)
    if nbytes:
        out.add("params", nbytes, how)


def _plain(engine: Any) -> Counted:
    """No wrapper (fp32 training without ZeRO): the module's parameters, a ``.grad`` each, Adam's state."""
    out, params = Counted(), [p for p in engine.module.parameters()]
    out.add("params", tensor_bytes(params) + quant_state_bytes(engine.module), "the module's parameters")
    out.add("grads", tensor_bytes(p for p in params if p.requires_grad), "every trainable parameter's .grad")
    out.add("optimizer", state_bytes(engine.basic_optimizer), "Adam exp_avg + exp_avg_sq (first step)")
    return out


def _offloads(config: Any) -> bool:
    """Whether DeepSpeed's parsed offload section puts the state on the host (cpu or nvme)."""
    return config is not None and str(getattr(config, "device", "none")).split(".")[-1] in ("cpu", "nvme")
