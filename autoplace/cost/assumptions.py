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
            bucket_cap_mb = 25), double-buffered; the last bucket's reduction cannot start
            before backward ends, so it is always exposed.
        zero3_prefetch_units: units all-gathered ahead of use (FSDP2 default: 1).
        zero3_gather_unit: how ZeRO-3 issues a block's parameter all-gathers: ``block`` (FSDP2's
            ``fully_shard`` per block: one collective per block per pass) or ``module``
            (DeepSpeed: one per submodule fetch, a collective per weight matrix; every
            collective pays the ring latency, which grows with ranks:
            :func:`autoplace.cost.terms_time.zero3_collective_counts`).
        zero3_reduce_bucket_params: gradient elements per ZeRO-3 reduce-scatter; 0 for one per
            block (FSDP2), DeepSpeed's ``reduce_bucket_size`` default 5e8 otherwise.
        zero3_prefetch_bucket_params: how far ahead ZeRO-3 gathers, in parameters; 0 for a whole
            block (FSDP2's one-unit prefetch), DeepSpeed's ``stage3_prefetch_bucket_size``
            default 5e7 otherwise (modules larger than it hide only under their neighbour:
            :func:`autoplace.cost.terms_time.zero3_hidden`).
        zero3_buckets_per_hidden_sq: when > 0, ZeRO-3's reduce bucket is this times hidden^2
            elements and its prefetch bucket 0.9 times that, in place of the two above: the
            Hugging Face integration's "auto" rule, which autoplace's DeepSpeed config writes
            (``autoplace.frameworks.deepspeed.zero_section``).  0 (the absolute sizes) by default.
        zero3_offload_grad_copy_blocks: whether a ZeRO-3 backward with an offloaded optimizer
            waits for every gradient bucket's reduce-scatter: DeepSpeed 0.6-0.15 copy each
            reduced partition to the host with a blocking ``copy_`` (stage3.py
            ``__partition_grads``), 0.16 on without blocking
            (:func:`autoplace.cost.terms_time.zero3_reduce_blocks`).  False by default; a
            published run on an older DeepSpeed states its version.
        zero3_reduce_host_us: host microseconds per (parameter tensor, rank) the framework spends
            building each ZeRO-3 gradient reduce-scatter in Python
            (:func:`autoplace.cost.terms_time.zero3_reduce_host`): 0 for FSDP2 (C++); DeepSpeed's
            ``reduce_scatter_coalesced`` measured 5.0-7.6 us (median 5.2) on one core of this machine
            shared with other work (benchmarks/deepspeed_host_loops.py runs DeepSpeed's own function
            with the collective stubbed out), and DeepSpeed's behaviour keeps 5.0; on an idle core the
            same benchmark measures 1.5-3.2 (median 1.6).  The difference stands for a per-(tensor,
            rank) cost the model does not otherwise see: with 1.6 the development set's DeepSpeed
            0.6.2 runs at 1,024 ranks and micro-batch 1 go from +26% to +50% optimistic
            (benchmarks/published.py).  Before 0.6 the list-form loop (``zero3_list_reduces``)
            measures 1.9 more than the coalesced one beside it (3.5 idle:
            benchmarks/deepspeed_host_loops.py ``--legacy``).
        zero3_list_gathers, zero3_list_reduces: whether ZeRO-3 issues each parameter's all-gather
            (reduce-scatter) on its own in ``torch.distributed``'s list form, one output (input) view per
            rank: DeepSpeed before 0.5.6 (gathers; from 0.5.6 ``_all_gather_base`` where torch has it, 1.9 on) and
            before 0.6.0 (reduce-scatters: ``partition_parameters._reduce_scatter_gradients``, one
            collective per gradient, where 0.6 reduces a bucket in one).  PyTorch's NCCL process group
            copies a list's views out of (into) its flat buffer one ``copy_`` per rank on the NCCL stream
            (``ProcessGroupNCCL::allgather`` / ``reduce_scatter``), so each collective also runs one small
            copy kernel per rank (``kernel_overhead_us`` each) and its host loops cost
            ``zero3_gather_host_us`` / ``zero3_reduce_host_us`` per (tensor, rank)
            (:func:`autoplace.cost.terms_time.zero3_gather_host`).  False by default; a published run on
            an older DeepSpeed states its version (``autoplace.frameworks.deepspeed.run_assumptions``).
        zero3_gather_host_us: host microseconds per (parameter tensor, rank) of a list-form gather: the
            Python loop that cuts the gathered buffer into one view per rank and PyTorch's loop copying
            each out (DeepSpeed 0.3-0.5 ``_allgather_param``); 2.4 us on one idle core of this machine, the
            copies' launches not counted (benchmarks/deepspeed_host_loops.py ``--legacy``).  0 when gathers
            are flat.
        zero3_fetch_syncs: whether ZeRO-3 waits for the whole device at each module's fetch: DeepSpeed
            before 0.6 calls ``torch.cuda.synchronize()`` in ``_allgather_param`` and after every fetch
            (stage3.py ``_synchronize_communication``), so the host's collective loops run while the
            device idles, after its kernels rather than beside them (0.6's coordinator waits on events).
        zero3_fetch_norms: whether each module fetch reads every parameter it fetched once more: DeepSpeed
            0.3.15-0.5 build a debug string with ``param.norm()`` in it for every parameter of a fetched
            module (stage3.py ``fetch_sub_module``), evaluated whether or not it is printed, so each pass
            runs a norm over every gathered weight on the compute stream (and formatting the 0-d result
            waits for it: ``Tensor.__format__`` calls ``item()``).
        overlap_slowdown: share of a collective's time that still shows up as lost compute
            while it runs under compute: NCCL kernels take SMs and HBM bandwidth from the
            kernels beside them.  Lee et al. 2025 (arXiv 2507.03114) measure GPT and Llama
            training kernels on A100 and H100 18.9% slower on average while overlapped with
            collectives (tests/reference/kernels.yaml).  Default 0.19.
        cpu_adam_params_per_s: parameters per second one host's CPU Adam updates, shared by
            its GPUs: DeepSpeed's CPU-Adam updated 11.6B parameters in 8.2 s (DeepSpeed PR
            #735, 1.4e9/s) and a 10B GPT-2 in 6.3 s on a DGX-2 host (its ZeRO-Offload
            tutorial log, 1.6e9/s; tests/reference/kernels.yaml).  Default 1.5e9.
        host_reserve_fraction: share of host memory kept for the OS, data loaders and pinned
            staging buffers when states are offloaded (assumption).  Default 0.15.
        offload_grad_bytes: bytes per offloaded parameter the host keeps for its gradient
            (DeepSpeed ZeRO-Offload accumulates fp32 gradients in pinned host memory).
        nvme_GBps_per_gpu: NVMe bandwidth per GPU for states offloaded to NVMe (ZeRO-Infinity):
            a DGX A100 holds 4 PCIe Gen4 U.2 NVMe drives for 8 GPUs (NVIDIA DGX A100 user guide)
            at about 7 GB/s sequential read and 4 GB/s write each (Samsung PM1733 data sheet);
            an even mix over 8 GPUs is ~2.75 GB/s.  Default 2.75 (assumption for other nodes).
        elementwise_traffic: HBM passes over a block's stored activations made by its
            memory-bound kernels per micro-batch (norms, activation functions, dropout,
            softmax, residual adds, casts), a third in forward and two in backward; full
            recompute adds the forward's.  Eager PyTorch reads and writes every intermediate:
            Ivanov et al. 2021 ("Data Movement Is All You Need", MLSys) measure such operators
            at ~40% of BERT training time.  5.5 eager and 1.1 compiled are fitted on the
            development set (benchmarks/published.py: 38 eager and 35 compiled runs).  Which one
            a plan gets is its ``compile`` key (Ansel et al. 2024, "PyTorch 2", ASPLOS), as its
            ``fused_loss``, ``tp_overlap`` and ``fp8`` keys choose the rest of its recipe
            (autoplace.plan.Config).
        kernels_per_block: kernels one block launches in its forward (eager PyTorch Llama
            block: norms, projections, rotary, attention, SwiGLU, residuals, ~20); backward
            launches twice as many.
        kernel_overhead_us: fixed cost of one kernel beyond its work, the startup of a launch:
            2.6 us on A100 80GB and 2.4 us on H200 (RRZE-HPC gpu-benches, gpu-small-kernels
            fit of 10,000 back-to-back launches; tests/reference/kernels.yaml).  Default 2.5.
        host_dispatch_us: host (CPU) time to issue one kernel of an eager training step: the
            Python call, PyTorch's dispatcher, autograd's graph recording and the launch call;
            a block's forward and backward never run faster than the host issues their kernels
            (``kernels_per_block``; twice as many in backward).  benchmarks/host_dispatch.py
            measures eager PyTorch at 9-23 us per forward op (and about twice that per forward op in backward) on one shared core of this machine
            (tiny tensors, so the work is ~0); the PyTorch dispatch path is itemised at 5-25 us
            per op (Python ~1, pybind ~1, autograd 1-3, dispatcher 1-2, backend 1-5,
            cudaLaunchKernel 1-3 us).  Default 10.
        zero3_hook_ops_forward, zero3_hook_ops_backward: host work of a ZeRO-3 unit's hooks per block, in
            eager-op equivalents (each costs ``host_dispatch_us``): FSDP2's pre-forward all-gather
            copy-in, the copy-out into per-parameter views, the post-forward reshard, the
            pre-backward re-gather and the post-backward reduce-scatter bookkeeping, all Python
            per unit.  benchmarks/fsdp_hooks.py measures ``fully_shard`` per GPT-2 block (fake
            process group, world 8, so the collectives cost nothing) at 109-129 op-equivalents
            in forward and 152-176 in backward, 1.5-2.3 ms per block on one shared core of this
            machine; a published profile of FSDP2 (PyTorch issue #173680, torch 2.10, a Xeon host)
            shows ~1 ms per ``FSDP::pre_forward``, half of a small model's step.  A block runs
            no faster than the host issues its kernels and these (:func:`autoplace.cost.terms_time.
            host_bound`); large blocks hide them under their compute.  DeepSpeed's per-submodule
            hooks are assumed no cheaper.  Defaults 120 and 155.
        fp8_casts: whose casts an fp8 recipe runs, which sets the bytes each cast streams
            (:data:`autoplace.cost.compute.FP8_CASTS`): ``torchao`` (torchtitan's Float8Linear,
            the default) or ``transformer_engine`` (Megatron-LM; it also caches a weight's fp8
            copies over a step's micro-batches).
        fp8_rowwise_gemm_time: how much longer torchao's rowwise-scaled forward GEMM (its CUTLASS
            kernel, fast accumulation) runs than a per-tensor-scaled cuBLAS one; its backward
            GEMMs are cuBLAS tensorwise plus a rescale pass (:data:`autoplace.cost.compute.
            FP8_CASTS`).  1.4: the value at which the cost model gives the torchao float8 README's
            e2e table its rowwise / tensorwise ratio (Llama3-8B on 8 H100, torchtitan, compile,
            FSDP2: 6,768 vs 7,689.5 tokens/s = 0.880; pytorch/ao torchao/float8/README.md at
            50865d5, a development-set pair).  The asyncTP benchmark's rowwise runs (tp=8) are 26%
            below their tensorwise twins and stay over-predicted: not a GEMM rate.
        zero12_grad_reduce: how ZeRO-1/2 reduce gradients: ``reduce-scatter`` (ZeRO's paper,
            FSDP2, Megatron's distributed optimizer) or ``all-reduce`` (DeepSpeed 0.19 all-
            reduces its buckets, ``use_multi_rank_bucket_allreduce``; measured in
            tests/test_runtime_parallel.py: 2x the reduce-scatter bytes).
        swiglu_kept: f-wide tensors a SwiGLU MLP keeps for backward when the plan does not
            compile it: 4 in eager PyTorch (w1 x, silu(w1 x), w3 x and their product; measured
            with FSDPMemTracker), 3 with Megatron-Core's fused ``bias_swiglu_impl`` (its
            ``ctx.save_for_backward`` keeps the 2f-wide fc1 output; fc2 keeps the product:
            megatron/core/fusions/fused_bias_swiglu.py, a framework ``behaviour``).
        rmsnorm_upcast_kept: whether RMSNorms keep what transformers' eager ``LlamaRMSNorm`` keeps
            for backward: the input cast to fp32 and the normalized tensor, 4 bytes per element more
            than a fused kernel's 16-bit input (``BlockKind.act_norm_upcast``; 16-19% of a Llama
            layer's saved bytes, measured with MemTracker in autoplace.fidelity.saved).  A framework
            ``behaviour``: True where the bundle trains transformers' modelling code (accelerate,
            DeepSpeed's dry run, FSDP2's train_fsdp2.py); torchtitan's ``nn.RMSNorm`` and Transformer
            Engine's run one fused kernel keeping the input and rstd (False), as does a compiled model.
        fused_loss_fuses_mlp: whether a plan's ``fused_loss`` also fuses the MLP's activation
            (Liger ships fused SwiGLU/GeGLU beside its fused cross-entropy); Megatron's
            ``--cross-entropy-loss-fusion`` fuses only the loss (its behaviour: False).
        pipeline_defers_grad_sync: whether a pipeline drives FSDP2 so that its sharded gradients
            are unsharded until the step's last backward: torch.distributed.pipelining (torchtitan's
            pipelines) calls ``set_requires_gradient_sync(False)`` and
            ``set_reshard_after_backward(False)`` on every backward but the last (stage.py,
            ``backward_maybe_with_nosync``), so each stage accumulates its full gradients in the
            reduce dtype (FSDP2's ``unsharded_accumulated_grad``) and reduce-scatters them once; and
            each ZeRO-3 unit, resharded after its forward, stays unsharded from its backward to its
            next forward, so at the end of a backward every unit of the stage holds its all-gathered
            copy (the torchtitan dry run counts them).  A framework ``behaviour`` (torchtitan: True).
        fsdp2_dim0_padding: whether the ZeRO shards are FSDP2's, which cut each parameter's dim 0
            into chunks of ``ceil(rows / N)`` rows and pad every rank's to a full chunk
            (:mod:`autoplace.cost.shards`; torch 2.13 ``FSDPParam``): +28% parameters, gradients and
            optimizer state on Llama-3.1-405B's blocks at tp=8 sharded 2,048 ways, whose K and V
            projections have 128 rows.  DeepSpeed and Megatron pad a flat buffer by fewer than ``N``
            elements (False).  A framework ``behaviour`` (torchtitan, FSDP2, accelerate: True).
        replicas_keep_gathered: whether plain data parallelism (ZeRO-0) runs as FSDP2 over a shard
            group of one, which all-gathers every unit's parameters into a copy in the compute dtype
            and, not resharding after forward, keeps it until the unit's backward, as its ZeRO-2
            does: autoplace's FSDP2 module calls ``fully_shard`` on the (dp_replicate, dp_shard=1)
            mesh with reshard_after_forward=False (its dry run measures the copy: +2 bytes per
            parameter in bf16).  PowerSGD's DDP keeps none.  A framework ``behaviour`` (FSDP2: True).
        loss_workspace_bytes_per_vocab: fp32 temporaries of the loss per token per vocabulary
            entry on the last stage at the start of backward: the gradients of the
            log-probabilities and of the fp32 logits (4 + 4; measured with FSDPMemTracker).
        loss_workspace_bytes_per_vocab_tp: the same per local vocabulary entry when the head is
            vocabulary-parallel (tp > 1): PyTorch's ``loss_parallel`` keeps 12 (measured with
            FSDPMemTracker on Llama-3-8B widths, tp = 2; autoplace.fidelity).  Megatron-Core's
            vocab-parallel cross-entropy (unfused) saves the fp32 softmax it computes in place
            of an fp32 copy of the logits and writes the gradient into that same tensor, so
            only the 16-bit cast of the gradient is new: 2 for both (its behaviour;
            megatron/core/tensor_parallel/cross_entropy.py).
        qwz_dequant_bytes, qgz_quant_bytes: HBM bytes per parameter of ZeRO++'s kernels per
            micro-batch (Wang et al. 2023): dequantizing an int8 gather reads 1 and writes 2;
            quantizing a bf16 gradient to int4 reads 2 and writes 0.5, and dequantizing and
            reducing what the all-to-all brings back moves about as much again (5 in all).
        powersgd_hbm_passes: passes over each compressed gradient PowerSGD's hook makes per
            step (PyTorch ``powerSGD_hook``): add the error (read 2, write 1), P = MQ and
            Q = M^T P (a read each: rank-r matmuls are memory-bound), M = PQ^T (a write), the new
            error (read 2, write 1), and the copy into one flat buffer (read 1, write 1): 11.
        nf4_dequant_bytes: HBM bytes per 4-bit weight that QLoRA's dequantization moves before
            each use of the weight (forward, backward's input gradient, a recompute):
            bitsandbytes' ``dequantize_4bit`` reads the packed weight (0.5) and writes it in the
            compute dtype (2); its absmax constants are 1/64 of that.  Default 2.5.
        zero12_flat_partitions: whether ZeRO-1/2 flatten every trainable parameter into one buffer cut
            into dp equal parts, a rank's part ending wherever it falls (DeepSpeed 0.19 stage_1_and_2.py
            ``DeepSpeedZeroOptimizer.__init__``, ``get_partition_info``): a ZeRO-2 rank copies the whole
            gradient of every parameter overlapping its part into ``grads_in_partition``
            (``copy_grads_in_partition``), so the rank whose part overlaps most -- a large embedding it
            lies in, and a parameter at each end -- holds more than 1/dp; ZeRO-Offload stages the largest
            parameter's gradient on the device and the host (``temp_grad_buffer_for_gpu_offload`` /
            ``_cpu_offload``) and, while it accumulates, keeps every overlapping parameter's 16-bit
            gradient on the host (``async_accumulate_grad_in_cpu_via_gpu``).  Costed from the model's
            parameter tensors in the order it registers them (:mod:`autoplace.cost.flat`).  A framework
            ``behaviour`` (DeepSpeed: True); False shards each gradient exactly (FSDP2, Megatron).
        zero_master_clone: whether ZeRO (1-3) keeps an fp32 master copy of the rank's partition even when the
            weights are fp32 already: 4 + 8 bytes of optimizer state per parameter of the partition, not 8.
            DeepSpeed 0.19 clones it (stage_1_and_2.py ``single_partition_of_fp32_groups``: ``.clone()``
            whatever the dtype; stage3.py ``_create_fp32_partitions`` shares a partition already fp32 only
            when its device equals ``self.device``, the device's *name*, a str no torch.device equals, so it
            clones too); its dry run measures 12 bytes (tests/test_dryrun_deepspeed.py).  Without ZeRO it
            runs the torch optimizer on the weights.  A framework ``behaviour`` (DeepSpeed: True).
        zero3_grad_buffer_kept: whether ZeRO-3 allocates the rank's gradient partitions at initialize
            and keeps them, so they count at the start of backward even without accumulation (DeepSpeed
            0.19 stage3.py ``_setup_for_real_optimizer``: ``grad_partitions_flat_buffer``); False: they are
            allocated at the step's first reduce-scatter and freed by ``zero_grad`` (FSDP2).  A framework
            ``behaviour`` (DeepSpeed: True).
        zero3_adapters_fp32: whether LoRA adapters stay fp32 under ZeRO-3 (4 bytes a parameter, not the
            recipe's 2; their fp32 master is a copy all the same, as ``zero_master_clone`` says): PEFT makes
            them fp32 (``autocast_adapter_dtype``) after transformers built the 16-bit base under
            ``zero.Init``, and DeepSpeed partitions them without a cast (runtime/zero/parameter_offload.py
            ``_convert_to_zero_parameters``; engine.py ``_cast_module_mixed_precision`` casts nothing in a
            zero-init model).  QLoRA's 4-bit model is built outside ``zero.Init`` and cast whole; ZeRO-1/2
            cast every parameter.  DeepSpeed's LoRA behaviour.
        offload_host_partition_copy: whether ZeRO-Offload keeps one more 16-bit copy of the rank's
            partition on the host, pinned: ZeRO-3 its gradient partition buffer (stage3.py
            ``_setup_for_real_optimizer``, on the offload device), ZeRO-1/2 the weights it copies back from
            (stage_1_and_2.py ``param_buffer_of_bit16_for_cpu_offload_groups``).  A framework
            ``behaviour`` (DeepSpeed: True).
        reduce_buckets: the gradient buckets a data-parallel reduction holds: ``cap`` two of
            ``comm_bucket_MiB`` (DDP's ``bucket_cap_mb``, double-buffered) at every ZeRO level; ``size``
            the framework's ``reduce_bucket_size`` elements (:func:`autoplace.cost.terms_time.zero3_buckets`)
            in the gradient dtype, allocated at initialize: two at ZeRO-1/2 with ``overlap_comm`` outside
            a pipeline (which turns it off), one at ZeRO-3, none at ZeRO-0, whose engine all-reduces the
            ``.grad`` tensors themselves (DeepSpeed 0.19 stage_1_and_2.py / stage3.py ``ipg_buckets``;
            engine.py ``_configure_zero_optimizer``).  DeepSpeed: ``size``.
        ddp_bucket_copy: whether plain data parallelism keeps its reducer's flat buckets beside autograd's
            ``.grad`` (PyTorch DDP with ``gradient_as_bucket_view=False``, its default and accelerate's
            ``DistributedDataParallelKwargs``' default: torch/nn/parallel/distributed.py): two copies of
            every replicated gradient, the buckets from construction on.  accelerate's behaviour for the
            user's own script; the bundle's PEFT script passes ``gradient_as_bucket_view=True``.
        frozen_base_in_compute_dtype: whether a LoRA base is stored in the compute dtype rather than the
            recipe's ``param_bytes``: the bundle's PEFT script loads it with ``dtype=COMPUTE_DTYPE`` and
            accelerate upcasts only trainable parameters to fp32 for FSDP2 (accelerate 1.15
            utils/fsdp_utils.py ``fsdp2_prepare_model``; DDP casts nothing).  accelerate's behaviour.
        attention_kernel: which fused attention kernel a model with ``flash_attention`` runs, each at
            its own measured rates (:mod:`autoplace.cost.attention`, the profiles'
            ``attention_efficiency``): ``fa2`` FlashAttention-2 (PyTorch's SDPA flash backend, every
            framework autoplace emits for), ``fa1`` FlashAttention (runs before FlashAttention-2's
            release, July 2023), ``mem_efficient`` SDPA's memory-efficient (xformers cutlass) backend.
            Default ``fa2``; a published run states its own (``options.attention_kernel``).
        compute_scale, bandwidth_scale: calibration factors (measured / predicted compute
            time; predicted / measured link time); 1 when uncalibrated.
    """

    allocator_reserve_fraction: float = 0.05
    framework_reserve_GiB: float = 1.0
    comm_bucket_MiB: float = 25.0
    zero3_prefetch_units: int = 1
    zero3_gather_unit: str = "block"
    zero3_reduce_bucket_params: float = 0.0
    zero3_prefetch_bucket_params: float = 0.0
    zero3_buckets_per_hidden_sq: float = 0.0
    zero3_reduce_host_us: float = 0.0
    zero3_list_gathers: bool = False
    zero3_list_reduces: bool = False
    zero3_gather_host_us: float = 0.0
    zero3_fetch_syncs: bool = False
    zero3_fetch_norms: bool = False
    zero3_offload_grad_copy_blocks: bool = False
    overlap_slowdown: float = 0.19
    cpu_adam_params_per_s: float = 1.5e9
    host_reserve_fraction: float = 0.15
    offload_grad_bytes: float = 4.0
    nvme_GBps_per_gpu: float = 2.75
    elementwise_traffic: float = 5.5
    elementwise_traffic_compiled: float = 1.1
    kernels_per_block: float = 20.0
    kernels_per_block_compiled: float = 10.0
    kernel_overhead_us: float = 2.5
    host_dispatch_us: float = 10.0
    zero3_hook_ops_forward: float = 120.0
    zero3_hook_ops_backward: float = 155.0
    fp8_casts: str = "torchao"
    fp8_rowwise_gemm_time: float = 1.4
    zero12_grad_reduce: str = "reduce-scatter"
    swiglu_kept: float = 4.0
    rmsnorm_upcast_kept: bool = False
    fused_loss_fuses_mlp: bool = True
    pipeline_defers_grad_sync: bool = False
    replicas_keep_gathered: bool = False
    fsdp2_dim0_padding: bool = False
    loss_workspace_bytes_per_vocab: float = 8.0
    loss_workspace_bytes_per_vocab_tp: float = 12.0
    qwz_dequant_bytes: float = 3.0
    qgz_quant_bytes: float = 5.0
    powersgd_hbm_passes: float = 11.0
    nf4_dequant_bytes: float = 2.5
    zero12_flat_partitions: bool = False
    zero_master_clone: bool = False
    zero3_grad_buffer_kept: bool = False
    zero3_adapters_fp32: bool = False
    offload_host_partition_copy: bool = False
    reduce_buckets: str = "cap"
    ddp_bucket_copy: bool = False
    frozen_base_in_compute_dtype: bool = False
    attention_kernel: str = "fa2"
    compute_scale: float = 1.0
    bandwidth_scale: float = 1.0

    def replace(self, **changes: Any) -> Assumptions:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise SpecError(f"unknown assumption(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)


DEFAULT = Assumptions()
