"""Modelling assumptions: every one a named parameter with its default and its source.

Nothing here is hardware (that is data in hardware_profiles/); these are properties of the
software stack that the cost model cannot derive.  Calibration (``--calibration``) replaces
them with measured values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autoplace.errors import SpecError


@dataclass(frozen=True)
class Assumptions:
    """Named defaults of the cost model.

    Attributes:
        allocator_reserve_fraction: share of device memory lost to the caching allocator's
            fragmentation; PyTorch reports reserved - allocated of ~5-10% on LLM training
            (torch.cuda.memory_stats; Megatron-LM issue discussions).  Default 0.05.
        framework_reserve_GiB: CUDA context, cuBLAS workspaces and NCCL buffers not seen by
            the allocator (~0.5-1.5 GiB per process on A100/H100; NCCL_BUFFSIZE 4 MiB per
            channel per peer).  Default 1.0.
        comm_bucket_MiB: gradient bucket for DDP / ZeRO reductions (PyTorch DDP
            bucket_cap_mb = 25), double-buffered.
        zero3_prefetch_units: units all-gathered ahead of use (FSDP2 default: 1).
        dp_overlap: fraction of one micro-batch's backward that hides the data-parallel
            gradient reduction (bucketed overlap, Li et al. 2020, PyTorch DDP, VLDB).
        zero3_overlap: fraction of compute that hides ZeRO-3 gathers with prefetch.
        cp_overlap: fraction of attention compute that hides the ring KV exchange (Liu et
            al. 2023, Ring Attention).
        cpu_adam_params_per_s: parameters per second a host's CPU Adam updates per GPU
            (ZeRO-Offload, Ren et al. 2021: CPU-Adam is 5-7x faster than PyTorch's CPU Adam;
            order 1e9 parameters/s per socket).  An assumption to calibrate.
        offload_overlap: fraction of compute that hides parameter streaming over PCIe.
        loss_workspace_bytes_per_vocab: fp32 temporaries of the loss per token per vocabulary
            entry on the last stage at the start of backward: the gradients of the
            log-probabilities and of the fp32 logits (4 + 4; measured with FSDPMemTracker).
        loss_workspace_bytes_per_vocab_tp: the same per local vocabulary entry when the head is
            vocabulary-parallel (tp > 1): PyTorch's ``loss_parallel`` keeps 12 (measured with
            FSDPMemTracker on Llama-3-8B widths, tp = 2; autoplace.fidelity).
        elementwise_traffic: HBM passes over a block's stored activations made by its
            memory-bound kernels per micro-batch (norms, activation functions, dropout,
            softmax, residual adds): about one in forward and two in backward; full recompute
            adds a forward pass.  Ivanov et al. 2021 ("Data Movement Is All You Need",
            MLSys) measure such operators at ~40% of BERT training time.  Default 3.
    """

    allocator_reserve_fraction: float = 0.05
    framework_reserve_GiB: float = 1.0
    comm_bucket_MiB: float = 25.0
    zero3_prefetch_units: int = 1
    dp_overlap: float = 1.0
    zero3_overlap: float = 1.0
    cp_overlap: float = 1.0
    cpu_adam_params_per_s: float = 1.0e9
    offload_overlap: float = 1.0
    elementwise_traffic: float = 3.0
    loss_workspace_bytes_per_vocab: float = 8.0
    loss_workspace_bytes_per_vocab_tp: float = 12.0
    compute_scale: float = 1.0  # calibration: measured / predicted compute time
    bandwidth_scale: float = 1.0  # calibration: predicted / measured link time

    def replace(self, **changes: Any) -> Assumptions:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise SpecError(f"unknown assumption(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)


DEFAULT = Assumptions()
