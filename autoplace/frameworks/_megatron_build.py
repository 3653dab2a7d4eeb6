"""What Megatron-LM's training code builds from its arguments before step 1, on megatron-core's own classes.

Megatron-LM core_v0.16.1's glue between its ``args`` and megatron-core 0.16 is restated here, each
function citing the one it restates: the ``TransformerConfig`` (``arguments.py:
core_transformer_config_from_args``), the model chunks of a rank (``training.py: get_model`` calling
``gpt_builders.py: gpt_builder``), the DDP / Megatron-FSDP wrapping and its config (``get_model``), the
optimizer (``training.py: get_megatron_optimizer_config``, ``setup_model_and_optimizer``) and its
learning-rate scheduler (``get_optimizer_param_scheduler``).  Everything they call is megatron-core's.

Built without a GPU (:func:`cuda_as_meta`): what megatron-core puts on ``torch.cuda.current_device()``
or ``device="cuda"`` goes to the meta device, and meta tensors answer ``Tensor.type()`` as the CUDA
tensors they stand for (the distributed optimizer checks it).  No torch at import.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

# what cuda_as_meta redirects, said once (the dry run notes it)
REDIRECTED = ("tensors megatron-core allocates on torch.cuda.current_device() or device='cuda' are made on the "
              "meta device (shapes and dtypes only); meta tensors answer Tensor.type() as torch.cuda.* tensors "
              "(the distributed optimizer checks it); pinned host memory is plain host memory; CUDA streams are "
              "stand-ins")


@contextmanager
def cuda_as_meta() -> Iterator[None]:
    """Run megatron-core's CUDA allocations on the meta device (see :data:`REDIRECTED`)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def cuda(device: Any) -> bool:
        return isinstance(device, int) or (isinstance(device, str | torch.device) and str(device).startswith("cuda"))

    class _CudaAsMeta(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if cuda(kwargs.get("device")):
                kwargs = {**kwargs, "device": "meta"}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and cuda(args[1]):
                args = (args[0], "meta", *args[2:])
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return str(func(*args)).replace("torch.meta.", "torch.cuda.")
            return func(*args, **kwargs)

    class _Stream:  # torch.cuda.Stream: megatron-core only waits on it and enters it
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_stream(self, other: Any) -> None:
            pass

    with ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "meta"))
        stack.enter_context(mock.patch("torch.cuda.Stream", _Stream))
        stack.enter_context(mock.patch("torch.cuda.current_stream", lambda *a, **k: _Stream()))
        stack.enter_context(mock.patch("torch.cuda.default_stream", lambda *a, **k: _Stream()))
        # megatron-core's MLA takes the duplicated branch for TE's Linear: _ReplicatedLinear stands for it
        stack.enter_context(mock.patch("megatron.core.transformer.multi_latent_attention.HAVE_TE", False))
        stack.enter_context(mock.patch("megatron.core.transformer.multi_latent_attention.TELinear",
                                       _ReplicatedLinear))
        stack.enter_context(_CudaAsMeta())
        yield


# The Transformer Engine a launch's cluster has (Megatron-LM's default --transformer-impl transformer_engine;
# NVIDIA's PyTorch containers of core_v0.16's time ship TE 2.x): megatron-core's version checks answer for it
ASSUMED_TE = "2.10.0"
TE_ASSUMED = (f"Transformer Engine {ASSUMED_TE} is assumed installed on the cluster (not here): megatron-core's "
              "TE version checks answer for it and its fused RoPE counts as available; the layers are built "
              "from megatron-core's local specs (same parameters)")


@contextmanager
def transformer_engine_assumed() -> Iterator[None]:
    """megatron-core's checks of Transformer Engine as on the cluster (see :data:`TE_ASSUMED`)."""
    from packaging.version import Version

    def fused_rope(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Transformer Engine's fused RoPE does not run in a dry run")

    with mock.patch("megatron.core.utils._te_version", Version(ASSUMED_TE)), \
            mock.patch("megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb", fused_rope):
        yield


# ------------------------------------------------------------------ the TransformerConfig


def transformer_config(args: Any) -> Any:
    """megatron-core's TransformerConfig (MLATransformerConfig under MLA) as Megatron-LM core_v0.16.1's
    ``arguments.py: core_transformer_config_from_args`` makes it from validated ``args``: every
    field the namespace has, then its own mappings.  Its ``__post_init__`` is megatron-core's check.
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    if args.heterogeneous_layers_config_path is not None:
        raise NotImplementedError("--heterogeneous-layers-config-path: autoplace's dry run builds GPT "
                                  "models with uniform layers only")
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if hasattr(args, f.name)}
    kw.update(persist_layer_norm=not args.no_persist_layer_norm, deallocate_pipeline_outputs=True,
              pipeline_dtype=args.params_dtype, batch_p2p_comm=not args.overlap_p2p_comm,
              num_moe_experts=args.num_experts, rotary_interleaved=args.rotary_interleaved,
              num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
              num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
              fp8_param=args.fp8_param_gather, config_logger_dir=args.config_logger_dir,
              inference_sampling_seed=args.seed, moe_latent_size=args.moe_latent_size,
              num_query_groups=args.num_query_groups if args.group_query_attention else None)
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=args.bias_swiglu_fusion)
    else:
        kw["bias_activation_fusion"] = args.bias_gelu_fusion
    if args.squared_relu:
        if args.swiglu:
            raise AssertionError("--squared-relu with --swiglu")  # core_transformer_config_from_args asserts
        kw["activation_func"] = squared_relu
    elif args.quick_geglu:
        if args.swiglu:
            raise AssertionError("--quick-geglu with --swiglu")
        kw.update(gated_linear_unit=True, activation_func=quick_gelu)
    if args.init_method_xavier_uniform:
        kw.update(init_method=torch.nn.init.xavier_uniform_, scaled_init_method=torch.nn.init.xavier_uniform_)
    if args.rope_type is None:
        kw.pop("rope_type", None)  # the config class's default
    elif not (args.multi_latent_attention or args.rope_type == "rope"):
        raise AssertionError(f'Common attention only support rope_type="rope", but got {args.rope_type}.')
    if len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    if args.is_hybrid_model:
        kw["is_hybrid_model"] = args.is_hybrid_model
    if args.te_precision_config_file:
        from megatron.core.quantization.utils import load_quantization_recipe

        kw["quant_recipe"] = load_quantization_recipe(args.te_precision_config_file)
    with transformer_engine_assumed():
        return config_class(**kw)


# ------------------------------------------------------------------ the model chunks


def model_chunks(args: Any, config: Any) -> list[Any]:
    """The GPTModel chunks this rank builds, as Megatron-LM core_v0.16.1's ``training.py: get_model``
    builds them: one per virtual stage, pre/post-process only on the first chunk of the first stage and
    the last chunk of the last stage; tensor-parallel attributes set on every parameter; wrapped in
    ``Float16Module`` under --bf16 / --fp16.  Built on the meta device, parameters not initialised
    (``use_cpu_initialization``, ``perform_initialization`` off: the dry run notes it).
    """
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    config = buildable(config)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    first, last = is_pp_first_stage(pg.pp), is_pp_last_stage(pg.pp)
    vp = args.virtual_pipeline_model_parallel_size
    stages: list[int | None] = list(range(vp)) if parallel_state.get_pipeline_model_parallel_world_size() > 1 \
        and vp is not None else [None]
    chunks = []
    with torch.device("meta"), cuda_as_meta(), local_norms_without_fused_kernels():
        for i in stages:
            pre = first and i in (None, 0)
            post = last and i in (None, len(stages) - 1)
            chunk = gpt_model(args, config, pre, post, i, pg)
            chunk.model_type = ModelType.encoder_or_decoder
            if i is not None:
                chunk.vp_stage = i
            chunks.append(chunk)
        for chunk in chunks:
            for param in chunk.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if args.fp16 or args.bf16:
            chunks = [Float16Module(config, chunk) for chunk in chunks]
    return chunks


# how the model is built here rather than on the cluster (the dry run notes it)
BUILT_HERE = ("model chunks built on the meta device with use_cpu_initialization and perform_initialization off "
              "(no weights initialised); gradient_accumulation_fusion off for megatron-core's local linear layers "
              "(Transformer Engine's layers take it on the cluster; the parameters are the same)")


def buildable(config: Any) -> Any:
    """A copy of ``config`` for building the model here (see :data:`BUILT_HERE`)."""
    config = copy.copy(config)
    config.use_cpu_initialization, config.perform_initialization = True, False
    config.gradient_accumulation_fusion = False
    return config


def gpt_model(args: Any, config: Any, pre_process: bool, post_process: bool, vp_stage: int | None,
              pg_collection: Any) -> Any:
    """megatron-core's GPTModel as Megatron-LM core_v0.16.1's ``gpt_builders.py: gpt_builder`` builds it,
    with megatron-core's local layer specs in place of Transformer Engine's (the same parameters: TE
    fuses each norm into the next linear layer as its ``layer_norm_weight``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    if args.spec is not None or args.experimental_attention_variant is not None or args.use_legacy_models:
        raise NotImplementedError("--spec, --experimental-attention-variant and --use-legacy-models models are "
                                  "not built by autoplace's dry run")
    if args.num_experts:
        spec: Any = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                               normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                               vp_stage=vp_stage)
    else:
        spec = _layer_spec(args, config)
    _as_transformer_engine(spec, args)
    mtp = None
    if args.mtp_num_layers is not None:
        if hasattr(spec, "layer_specs") and len(spec.layer_specs) == 0:
            last_layer = _layer_spec(args, config)
        else:
            last_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                                     normalization=args.normalization,
                                                     qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
        _as_transformer_engine(last_layer, args)
        mtp = get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                    parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, mtp_block_spec=mtp,
                    vp_stage=vp_stage, pg_collection=pg_collection)


def core_attention_stand_in(args: Any) -> str | None:
    """Why core attention is built as a stand-in for these arguments (None: megatron-core's own)."""
    if args.multi_latent_attention:
        return "multi-latent attention's head sizes"
    if args.context_parallel_size > 1:
        return "context parallelism"
    return None


def layout_notes(args: Any) -> list[str]:
    """What :func:`_as_transformer_engine` changed in the local spec, for the dry run's notes."""
    notes = []
    why = core_attention_stand_in(args)
    if why:
        notes.append(f"core attention (softmax(QK^T)V, no parameters) built as a parameter-free stand-in: "
                     f"megatron-core's local DotProductAttention refuses {why}, which Transformer Engine's runs")
    if args.multi_latent_attention:
        notes.append("MLA's q/kv down projections built whole on every TP rank, as Transformer Engine's spec "
                     "builds them (TELinear, parallel_mode duplicated); the local spec would split them over TP")
    return notes


def _layer_spec(args: Any, config: Any) -> Any:
    """gpt_builders.py ``_get_transformer_layer_spec`` with use_te False: the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                    args.multi_latent_attention, moe_use_legacy_grouped_gemm=
                                    args.moe_use_legacy_grouped_gemm, normalization=args.normalization,
                                    use_kitchen=config.use_kitchen)


def _as_transformer_engine(spec: Any, args: Any) -> None:
    """Lay megatron-core's local layer spec out as Transformer Engine's (gpt_layer_specs.py,
    ``get_gpt_layer_with_transformer_engine_spec``) where the two differ in parameters or refusals:

    * MLA's q / kv down projections are TE ``Linear``s with ``parallel_mode="duplicated"`` (whole on every
      TP rank), where the local spec splits them over TP: :class:`_ReplicatedLinear` takes their place;
    * core attention -- softmax(QK^T)V, no parameters -- is a parameter-free stand-in where the local
      DotProductAttention refuses what TE's runs (context parallelism, MLA's head sizes).
    """
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        if core_attention_stand_in(args):
            attention.core_attention = _ParameterFree
        if args.multi_latent_attention:
            attention.linear_q_down_proj = attention.linear_kv_down_proj = _ReplicatedLinear


class _ParameterFree:
    """A module without parameters in place of one whose parameters are none (core attention)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        import torch

        return torch.nn.Identity()


class _ReplicatedLinear:
    """Transformer Engine's ``TELinear(parallel_mode="duplicated")``: a whole ``output x input`` weight on
    every tensor-parallel rank (no TE here: a plain linear layer with that weight)."""

    def __new__(cls, input_size: int, output_size: int, *, config: Any, bias: bool = False, **kwargs: Any) -> Any:
        import torch

        return torch.nn.Linear(input_size, output_size, bias=bias, dtype=config.params_dtype)


@contextmanager
def local_norms_without_fused_kernels() -> Iterator[None]:
    """megatron-core's local norm (PyTorch's LayerNorm / RMSNorm) refuses --sequence-parallel and
    persist_layer_norm, which Transformer Engine's and Apex's norm kernels take; it is built here with
    both off (its parameters are the same)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    built = WrappedTorchNorm.__new__

    def new(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        relaxed = copy.copy(config)
        relaxed.sequence_parallel, relaxed.persist_layer_norm = False, False
        return built(cls, relaxed, *args, **kwargs)

    with mock.patch.object(WrappedTorchNorm, "__new__", staticmethod(new)):
        yield


# ------------------------------------------------------------------ data parallelism


# Why Megatron-FSDP (--use-megatron-fsdp: zero=2/3 plans) is not built here
FSDP_NOT_BUILT = ("megatron-core 0.16's Megatron-FSDP copies every parameter's weights into its sharded buffers and "
                  "asserts none is on the meta device (fsdp/src/megatron_fsdp/param_and_grad_buffer.py), so it needs "
                  "the weights, which a dry run does not make")


def wrap_data_parallel(args: Any, config: Any, chunks: list[Any]) -> list[Any]:
    """The chunks wrapped for data parallelism as Megatron-LM core_v0.16.1's ``get_model`` wraps them:
    megatron-core's DistributedDataParallel, its config from the args, the bucket size defaulted from
    the data-parallel size, bucketing only on the first chunk.

    Raises:
        NotImplementedError: --use-megatron-fsdp (:data:`FSDP_NOT_BUILT`).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel

    ddp_config = ddp_config_from_args(args, sum(p.nelement() for c in chunks for p in c.parameters()),
                                      parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    if args.use_torch_fsdp2:
        raise NotImplementedError("--use-torch-fsdp2: autoplace's dry run wraps DDP and Megatron-FSDP only")
    if args.use_megatron_fsdp:
        raise NotImplementedError(FSDP_NOT_BUILT)
    with cuda_as_meta():
        return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                        disable_bucketing=i > 0 or args.overlap_param_gather_with_optimizer_step)
                for i, chunk in enumerate(chunks)]


def ddp_config_from_args(args: Any, num_parameters: int, dp_cp_size: int) -> Any:
    """megatron-core's DistributedDataParallelConfig as ``get_model`` fills it (core_v0.16.1)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributedDataParallelConfig)
          if hasattr(args, f.name)}
    kw.update(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
              check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
              check_for_large_grads=args.check_for_large_grads,
              pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
              reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
              average_in_collective=args.ddp_average_in_collective)
    if args.ddp_num_buckets is not None:
        if args.ddp_bucket_size is not None:
            raise AssertionError("Cannot specify both --ddp-num-buckets and --ddp-bucket-size")
        if args.ddp_num_buckets <= 0:
            raise AssertionError("--ddp-num-buckets must be greater than 0")
        kw["bucket_size"] = num_parameters // args.ddp_num_buckets
    else:
        kw["bucket_size"] = args.ddp_bucket_size
    config = DistributedDataParallelConfig(**kw)
    if config.bucket_size is None:
        config.bucket_size = max(40000000, 1000000 * dp_cp_size)
    if not config.overlap_grad_reduce:
        config.bucket_size = None
    return config


# ------------------------------------------------------------------ the optimizer


def optimizer(args: Any, chunks: list[Any]) -> tuple[Any, Any]:
    """megatron-core's optimizer for the wrapped chunks, as ``setup_model_and_optimizer`` asks for it
    (``get_megatron_optimizer_config``: Adam or SGD config fields from the args, the standard overrides).
    Gloo process groups are not used (the fake process group has none: --fake-process-group's rule).

    Returns:
        (the optimizer, its config).
    """
    from megatron.core.optimizer import (
        AdamOptimizerConfig,
        SGDOptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )

    if args.optimizer == "adam" or "muon" in args.optimizer:
        if "muon" in args.optimizer:
            raise NotImplementedError("--optimizer muon: autoplace's dry run builds Adam and SGD")
        config_class: Any = AdamOptimizerConfig
    elif args.optimizer == "sgd":
        config_class = SGDOptimizerConfig
    else:
        raise ValueError("Invalid optimizer type!")
    with transformer_engine_assumed():  # its precision-aware checks ask for TE's version
        config = config_class(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)
                                 if hasattr(args, f.name)})
    with cuda_as_meta(), transformer_engine_assumed():
        return get_megatron_optimizer(config, chunks, config_overrides=get_standard_config_overrides(config=config),
                                      use_gloo_process_groups=False), config


def scheduler(args: Any, optimizer: Any) -> Any:
    """megatron-core's OptimizerParamScheduler as ``training.py: get_optimizer_param_scheduler`` builds it
    (core_v0.16.1): iteration- or sample-based warmup and decay, from the args."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if args.train_iters:
        decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        decay = decay_iters * args.global_batch_size
        wd_steps = args.train_iters * args.global_batch_size
        wsd = args.lr_wsd_decay_iters * args.global_batch_size if args.lr_wsd_decay_iters is not None else None
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * args.global_batch_size)
    elif args.train_samples:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        wd_steps, wsd = args.train_samples, args.lr_wsd_decay_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
    else:
        raise Exception("either train-iters or train-samples should be provided.")
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_steps, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler, wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


# ------------------------------------------------------------------ the data


def dataset_sizes(args: Any) -> tuple[int, int | None, int]:
    """(train, validation, test) samples the datasets are built for, as ``training.py:
    get_train_valid_test_num_samples`` computes them at iteration 0 (core_v0.16.1)."""
    train = args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    valid = None
    if not args.full_validation:
        if args.skip_train:
            evals = args.eval_iters
        else:
            if args.train_iters is None:
                raise AssertionError("assert args.train_iters is not None")
            evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
        valid = evals * args.global_batch_size
    return train, valid, args.eval_iters * args.global_batch_size
