"""Megatron-LM core_v0.16.1's ``validate_args``, restated: what ``pretrain_gpt.py`` checks and derives
from its parsed arguments before it builds anything.

Restated from ``megatron/training/arguments.py: validate_args`` (and ``parse_args``'s RANK / WORLD_SIZE)
in its order, so the first check a launch fails is the one Megatron-LM would fail first, with its
message (a bare ``assert`` of Megatron-LM's reads "assert <its condition>").  Left out: RL
(``--perform-rl-step``), inference, YAML configs, heterogeneous layers, Kitchen quantization and
checkpoint conversion -- a GPT pre-training launch from autoplace sets none of them; a launch that
sets one is refused here by name rather than half-checked.

Environment-dependent checks take their facts as arguments: the launch's environment (the
``CUDA_DEVICE_MAX_CONNECTIONS`` rules) and the GPU's architecture (``get_device_arch_version``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from autoplace.frameworks._megatron_flags import parse_words

# Flags of features this restatement does not check (each needs code autoplace does not restate)
_UNCHECKED = {"perform_rl_step": "--perform-rl-step", "yaml_cfg": "--yaml-cfg",
              "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
              "heterogeneous_layers_config_encoded_json": "--heterogeneous-layers-config-encoded-json",
              "ckpt_convert_format": "--ckpt-convert-format", "inference_dynamic_batching":
              "--inference-dynamic-batching", "use_legacy_models": "--use-legacy-models"}
# pretrain_gpt.py's args_defaults
GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def megatron_arguments(words: Sequence[str], world: int, *, rank: int = 0, env: Mapping[str, str] | None = None,
                       arch: int = 9) -> argparse.Namespace:
    """``args`` as ``pretrain_gpt.py`` has them after ``parse_args`` and ``validate_args``.

    Args:
        words: the words after ``pretrain_gpt.py``.
        world: WORLD_SIZE.
        rank: RANK.
        env: the launch's environment (CUDA_DEVICE_MAX_CONNECTIONS, ...).
        arch: the GPU's CUDA major version (8 Ampere, 9 Hopper, 10 Blackwell).

    Raises:
        MegatronArgumentError: words the parser refuses.
        AssertionError, ValueError, RuntimeError: a check of validate_args, with Megatron-LM's message.
    """
    args = parse_words(words)
    args.rank, args.world_size = rank, world
    for dest, flag in _UNCHECKED.items():
        if getattr(args, dest, None):
            raise NotImplementedError(f"{flag}: autoplace does not restate what Megatron-LM checks for it")
    validate_args(args, env or {}, arch)
    return args


def _require(ok: Any, message: str) -> None:
    """An ``assert`` of validate_args (raised as Megatron-LM's AssertionError, message and all)."""
    if not ok:
        raise AssertionError(message)


def validate_args(args: argparse.Namespace, env: Mapping[str, str], arch: int) -> None:
    """validate_args (core_v0.16.1), section by section in its order."""
    _parallel_sizes(args)
    _deprecated_and_defaults(args)
    _batch_and_pipeline(args)
    _overlap_and_fsdp(args, env)
    _precision(args)
    _iterations(args)
    _shape(args)
    _model_checks(args, env, arch)
    _moe_and_checkpoint_checks(args)
    _feature_checks(args)
    _cuda_graph_and_te_checks(args, env)


def _parallel_sizes(args: argparse.Namespace) -> None:
    _require(args.non_persistent_ckpt_type in ("global", "local", None),
             "Currently only global and local checkpoints are supported")
    args.use_dist_ckpt = args.ckpt_format != "torch"  # training/utils.py update_use_dist_ckpt
    model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    _require(args.world_size % model_size == 0,
             f"world size ({args.world_size}) is not divisible by total_model_size (total_model_size={model_size})")
    if str(args.attention_backend.name) == "local":
        _require(args.spec and args.spec[0] == "local", "--attention-backend local is only supported with --spec local")
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // model_size
    if args.hierarchical_context_parallel_sizes:
        product = 1
        for size in args.hierarchical_context_parallel_sizes:
            product *= size
        _require(args.context_parallel_size == product,
                 "assert args.context_parallel_size == prod(args.hierarchical_context_parallel_sizes)")
    if "a2a+p2p" in args.cp_comm_type:
        _require(args.hierarchical_context_parallel_sizes is not None,
                 "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size


def _deprecated_and_defaults(args: argparse.Namespace) -> None:
    _require(args.batch_size is None, "--batch-size argument is no longer valid, use --micro-batch-size instead")
    _require(args.warmup is None, "--warmup argument is no longer valid, use --lr-warmup-fraction instead")
    _require(args.model_parallel_size is None,
             "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead")
    for name in ("batch_size", "warmup", "model_parallel_size"):
        delattr(args, name)
    if args.checkpoint_activations:  # validate_args prints this and exits
        raise SystemExit("--checkpoint-activations is no longer valid, use --recompute-activations, or, for "
                         "more control, --recompute-granularity and --recompute-method.")
    del args.checkpoint_activations
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    del args.recompute_activations
    if args.enable_cuda_graph or args.external_cuda_graph:
        _require(args.cuda_graph_impl == "none",
                 "Do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl.")
        _require(not args.enable_cuda_graph or not args.external_cuda_graph,
                 "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time.")
        args.cuda_graph_impl = "local" if args.enable_cuda_graph else "transformer_engine"
    for key, value in GPT_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.data_path is not None and args.split is None:
        args.split = "969, 30, 1"
    if args.data_path is not None or args.data_args_path is not None:
        _require(args.data_path is None or args.data_args_path is None,
                 "assert (args.data_path is None) or (args.data_args_path is None)")
    if args.phase_transition_iterations:
        args.phase_transition_iterations = sorted(int(x.strip()) for x in args.phase_transition_iterations.split(","))
        _require(args.rampup_batch_size is None, "multi-phase training does not support batch size ramp-up")


def _batch_and_pipeline(args: argparse.Namespace) -> None:
    _require(args.micro_batch_size is not None, "assert args.micro_batch_size is not None")
    _require(args.micro_batch_size > 0, "assert args.micro_batch_size > 0")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size > 0, "assert args.global_batch_size > 0")
    chosen = [args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank,
              args.pipeline_model_parallel_layout]
    _require(sum(c is not None for c in chosen) <= 1,
             "No more than one of the following arguments can be set at the same time: "
             "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,"
             "--pipeline-model-parallel-layout. "
             f"args.num_layers_per_virtual_pipeline_stage={chosen[0]!r}, "
             f"args.num_virtual_stages_per_pipeline_rank={chosen[1]!r}, "
             f"args.pipeline_model_parallel_layout={chosen[2]!r}.")
    args.virtual_pipeline_model_parallel_size = _virtual_size(args)
    if args.virtual_pipeline_model_parallel_size is not None:
        if args.overlap_p2p_comm:
            _require(args.pipeline_model_parallel_size > 1, "When interleaved schedule is used, pipeline-model-"
                     "parallel size should be greater than 1")
        else:
            _require(args.pipeline_model_parallel_size > 2,
                     "When interleaved schedule is used and p2p communication overlap is disabled, pipeline-model-"
                     "parallel size should be greater than 2 to avoid having multiple p2p sends and recvs between "
                     "same 2 ranks per communication batch")
    else:
        args.overlap_p2p_comm = False
        args.align_param_gather = False


def _layers_for_split(args: argparse.Namespace) -> int:
    layers = args.num_layers if args.num_layers is not None else args.decoder_num_layers
    return layers + int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)


def _virtual_size(args: argparse.Namespace) -> int | None:
    """The virtual pipeline size from the layout, the layers per virtual stage, or the stages per rank."""
    pp = args.transformer_pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        _require(stages % args.pipeline_model_parallel_size == 0,
                 "The length of pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size "
                 f"(num_stages={stages}, args.pipeline_model_parallel_size={args.pipeline_model_parallel_size})")
        vp = stages // args.pipeline_model_parallel_size
    elif args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank is not None:
        if args.num_virtual_stages_per_pipeline_rank is None:
            _require(args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None,
                     "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree "
                     "when enable uneven pipeline parallelism")
            layers = _layers_for_split(args)
            _require(layers % pp == 0, "number of layers of the model must be divisible pipeline model parallel size")
            _require((layers // pp) % args.num_layers_per_virtual_pipeline_stage == 0,
                     "number of layers per pipeline stage must be divisible number of layers per virtual pipeline "
                     "stage")
            vp = layers // pp // args.num_layers_per_virtual_pipeline_stage
        else:
            vp = args.num_virtual_stages_per_pipeline_rank
    else:
        if (args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None
                and args.num_layers is not None):
            _require(_layers_for_split(args) % pp == 0,
                     "Number of layers should be divisible by the pipeline-model-parallel size")
        return None
    return None if vp == 1 else vp


def _overlap_and_fsdp(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer or args.use_megatron_fsdp,
                 "--overlap-param-gather only supported with distributed optimizer or megatron fsdp")
        _require(args.overlap_grad_reduce, "Must use --overlap-param-gather with --overlap-grad-reduce")
    if args.use_torch_fsdp2:
        _require(args.pipeline_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with pipeline parallelism")
        _require(args.expert_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with expert parallelism")
        _require(not args.use_distributed_optimizer,
                 "--use-torch-fsdp2 is not supported with MCore's distributed optimizer")
        _require(not args.gradient_accumulation_fusion,
                 "--use-torch-fsdp2 is not supported with gradient accumulation fusion")
        _require(args.ckpt_format in ("torch_dist", "torch_dcp"),
                 "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp")
        _require(args.untie_embeddings_and_output_weights,
                 "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
        _require(not args.fp16, "--use-torch-fsdp2 not supported with fp16 yet")
        _require(env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1",
                 "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one")
    if args.overlap_param_gather_with_optimizer_step:
        _require(args.use_distributed_optimizer,
                 "--overlap-param-gather-with-optimizer-step only supported with distributed optimizer")
        _require(args.overlap_param_gather,
                 "Must use --overlap-param-gather-with-optimizer-step with --overlap-param-gather")
        _require(args.virtual_pipeline_model_parallel_size is not None,
                 "--overlap-param-gather-with-optimizer-step only supported with interleaved pipeline parallelism")
        _require(not args.use_dist_ckpt,
                 "--overlap-param-gather-with-optimizer-step not supported with distributed checkpointing yet")
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, name)
        setattr(args, name, value if isinstance(value, torch.dtype) else dtypes[value])
    if args.fp8_param_gather:
        _require(args.use_distributed_optimizer or args.use_torch_fsdp2 or args.use_megatron_fsdp,
                 "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or "
                 "inference mode")
    if args.fp4 and args.fp8:
        raise ValueError("--fp4-format and --fp8-format cannot be used simultaneously. Please choose one.")
    if args.fp4_param and not args.fp4:
        raise ValueError("--fp4-param-gather must be used together with --fp4-format.")
    if args.use_megatron_fsdp:
        args.use_custom_fsdp = True
        if args.data_parallel_sharding_strategy == "optim_grads_params":
            _require(args.check_weight_hash_across_dp_replicas_interval is None,
                     "check_weight_hash_across_dp_replicas_interval is not supported with optim_grads_params")
        _require(env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1",
                 "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one")
        _require(args.ckpt_format == "fsdp_dtensor", "Megatron FSDP only supports fsdp_dtensor checkpoint format")
    if args.fsdp_manual_registration:
        _require(args.use_megatron_fsdp, "FSDP manual registration is only supported with Megatron FSDP")
        _require(args.nccl_ub, "FSDP manual registration is only supported with nccl-ub option")


def _precision(args: argparse.Namespace) -> None:
    import torch

    args.params_dtype = torch.float
    if args.fp16:
        _require(not args.bf16, "assert not args.bf16")
        args.params_dtype = torch.half
        if not args.loss_scale:
            args.check_for_nan_in_loss_and_grad = False
    if args.bf16:
        _require(not args.fp16, "assert not args.fp16")
        args.params_dtype = torch.bfloat16
        if args.accumulate_allreduce_grads_in_fp32:
            _require(args.main_grads_dtype == torch.float32,
                     "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set")
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
        elif not args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype == torch.float32:
            args.accumulate_allreduce_grads_in_fp32 = True
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    _require(args.num_dataset_builder_threads > 0, "assert args.num_dataset_builder_threads > 0")
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    args.variable_seq_lengths = False


def _iterations(args: argparse.Namespace) -> None:
    if args.train_iters:
        _require(args.train_samples is None, "expected iteration-based training")
        _require(args.lr_decay_samples is None, "expected iteration-based learning rate decay")
        _require(args.lr_warmup_samples == 0, "expected iteration-based learning rate warmup")
        _require(args.rampup_batch_size is None, "expected no batch-size rampup for iteration-based training")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_iters == 0, "can only specify one of lr-warmup-fraction and lr-warmup-iters")
    if args.train_samples:
        _require(args.train_iters is None, "expected sample-based training")
        _require(args.lr_decay_iters is None, "expected sample-based learning rate decay")
        _require(args.lr_warmup_iters == 0, "expected sample-based learnig rate warmup")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_samples == 0,
                     "can only specify one of lr-warmup-fraction and lr-warmup-samples")


def _shape(args: argparse.Namespace) -> None:
    if args.num_layers is not None:
        _require(args.encoder_num_layers is None, "cannot have both num-layers and encoder-num-layers specified")
        args.encoder_num_layers = args.num_layers
    else:
        _require(args.encoder_num_layers is not None, "either num-layers or encoder-num-layers should be specified")
        args.num_layers = args.encoder_num_layers
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        _require(getattr(args, name) is not None, f"{name} argument is None")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 "assert args.hidden_size % args.num_attention_heads == 0")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.seq_length is not None and args.context_parallel_size > 1:
        _require(args.seq_length % (args.context_parallel_size * 2) == 0,
                 "seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1.")
    if args.seq_length is not None:
        _require(args.encoder_seq_length is None, "assert args.encoder_seq_length is None")
        args.encoder_seq_length = args.seq_length
    else:
        _require(args.encoder_seq_length is not None, "assert args.encoder_seq_length is not None")
        args.seq_length = args.encoder_seq_length
    _require(args.max_position_embeddings >= args.seq_length,
             f"max_position_embeddings ({args.max_position_embeddings}) must be greater than or equal to "
             f"seq_length ({args.seq_length}).")
    if args.decoder_seq_length is not None:
        _require(args.max_position_embeddings >= args.decoder_seq_length,
                 "assert args.max_position_embeddings >= args.decoder_seq_length")
    if args.lr is not None:
        _require(args.min_lr <= args.lr, "assert args.min_lr <= args.lr")
    if args.save is not None:
        _require(args.save_interval is not None, "assert args.save_interval is not None")
        _require(args.save_interval > 0, "assert args.save_interval > 0")
        if args.save_retain_interval is not None:
            _require(args.save_retain_interval > 0, "assert args.save_retain_interval > 0")
            _require(args.save_retain_interval % args.save_interval == 0,
                     "assert args.save_retain_interval % args.save_interval == 0")
    if args.log_memory_interval is not None:
        _require(args.log_memory_interval % args.log_interval == 0,
                 "assert args.log_memory_interval % args.log_interval == 0")
    if args.fp16_lm_cross_entropy:
        _require(args.fp16, "lm cross entropy in fp16 only support in fp16 mode.")
    if args.fp32_residual_connection:
        _require(args.fp16 or args.bf16, "residual connection in fp32 only supported when using fp16 or bf16.")


def _model_checks(args: argparse.Namespace, env: Mapping[str, str], arch: int) -> None:
    if args.moe_grouped_gemm:
        _require(arch >= 8, "Unsupported compute capability for GroupedGEMM kernels.")
    if args.no_weight_decay_cond_type is not None:
        if args.no_weight_decay_cond_type != "apply_wd_to_qk_layernorm":
            raise ValueError(f"Invalid no_weight_decay_cond_type: {args.no_weight_decay_cond_type}")
        args.apply_wd_to_qk_layernorm, args.no_weight_decay_cond_type = True, None
    if args.weight_decay_incr_style == "constant":
        _require(args.start_weight_decay is None, "assert args.start_weight_decay is None")
        _require(args.end_weight_decay is None, "assert args.end_weight_decay is None")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None, "assert args.start_weight_decay is not None")
        _require(args.end_weight_decay is not None, "assert args.end_weight_decay is not None")
    if args.distribute_saved_activations:
        _require(args.tensor_model_parallel_size > 1,
                 "can distribute recomputed activations only across tensor model parallel groups")
        _require(args.recompute_granularity == "full",
                 "distributed recompute activations is only application to full recompute granularity")
        _require(args.recompute_method is not None,
                 "for distributed recompute activations to work you need to use a recompute method ")
    if args.recompute_granularity == "selective":
        _require(args.recompute_method is None,
                 "recompute method is not yet supported for selective recomputing granularity")
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
    if args.tp_comm_overlap:
        _require(args.sequence_parallel, "Tensor parallel communication/GEMM overlap can happen only when sequence "
                                         "parallelism is enabled")
    if args.hybrid_context_parallel:
        _require(not args.pipeline_model_parallel_size > 1,
                 "Hybrid context parallelism not supported with pipeline parallelism")
        _require(not args.use_megatron_fsdp, "Hybrid context parallelism not supported with Megatron FSDP")
        _require(args.calculate_per_token_loss, "Hybrid context parallelism must be used with "
                                                "--calculate-per-token-loss")
    if (args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1) and arch < 10:
        if not (args.use_torch_fsdp2 or args.use_megatron_fsdp or args.overlap_moe_expert_parallel_comm):
            _require(env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1",
                     "Using tensor model parallelism or context parallelism require setting the environment "
                     "variable CUDA_DEVICE_MAX_CONNECTIONS to 1")
    if args.use_torch_fsdp2 or (args.use_megatron_fsdp and arch >= 10):  # high-priority streams for FSDP's groups
        groups = args.high_priority_stream_groups
        args.high_priority_stream_groups = [*groups, *(["dp_cp"] if "dp_cp" not in groups else []),
                                            *(["ep_dp"] if args.expert_model_parallel_size > 1
                                              and "ep_dp" not in groups else [])]
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    if args.add_bias_linear:
        args.add_qkv_bias = True
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.position_embedding_type != "rope":
        args.apply_rope_fusion = False
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise RuntimeError("--no-position-embedding is deprecated, use --position-embedding-type")
    if args.position_embedding_type == "relative":
        _require(args.transformer_impl == "transformer_engine", "Local transformer implementation currently does not "
                 "support attention bias-based position embeddings.")
    if args.position_embedding_type == "mrope":
        _require(args.mrope_section is not None,
                 "--mrope-section should be set when using --position-embedding-type mrope.")


def _moe_and_checkpoint_checks(args: argparse.Namespace) -> None:
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.expert_model_parallel_size > 1:
        _require(args.num_experts is not None, "num_experts must be non None to use expert model parallelism")
        _require(args.num_experts % args.expert_model_parallel_size == 0,
                 "Number of experts should be a multiple of expert model parallel_size.")
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    if args.ckpt_format == "torch_dcp":
        _require(args.use_torch_fsdp2, "--ckpt-format torch_dcp is only tested with FSDP.")
        _require(args.tensor_model_parallel_size <= 1,
                 "--ckpt-format torch_dcp is not tested with megatron tensor parallelism.")
        _require(args.pipeline_model_parallel_size <= 1,
                 "--ckpt-format torch_dcp is not tested with megatron pipeline parallelism.")
    if args.ckpt_format == "fsdp_dtensor":
        _require(args.use_megatron_fsdp, "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.")
    sources = args.mock_data + bool(args.data_path) + any([args.train_data_path, args.valid_data_path,
                                                          args.test_data_path])
    _require(sources <= 1, "A single data source must be provided in training mode, else None")
    if args.fim_data:
        tokens = [args.fim_prefix_token, args.fim_middle_token, args.fim_suffix_token, args.fim_pad_token,
                  args.fim_eod_token]
        _require(not args.mock_data, "Mock dataset is not supported with FIM dataset.")
        _require(not args.legacy_tokenizer, "FIM dataset is not supported with legacy tokenizers.")
        _require(args.fim_rate, "--fim-rate should be specified.")
        _require(args.fim_spm_rate, "--fim-spm-rate should be specified.")
        _require(all(t is not None for t in tokens), "FIM extra tokens should be specified.")
    if args.deterministic_mode:
        _require(not args.use_flash_attn, "Flash attention can not be used in deterministic mode.")
        _require(not args.cross_entropy_loss_fusion, "Cross Entropy Fusion is currently not deterministic.")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if not args.enable_gloo_process_groups and args.use_distributed_optimizer:
        _require(args.use_dist_ckpt, "assert args.use_dist_ckpt")


def _feature_checks(args: argparse.Namespace) -> None:
    if args.load_main_params_from_ckpt:
        _require(args.no_load_optim, "--load-main-params-from-ckpt must be used with --no-load-optim.")
    if args.use_dist_ckpt and args.async_save and not args.use_persistent_ckpt_worker:
        args.async_save = False
    if args.moe_use_upcycling:
        _require(args.save is not None, "When using upcycling, the --save option must be specified.")
    if args.skip_train and not args.no_load_optim:
        args.no_load_optim = True
    if "muon" in args.optimizer:
        _require(not args.overlap_grad_reduce, "Muon optimizer does not support overlap grad reduce for now.")
        _require(not args.overlap_param_gather, "Muon optimizer does not support overlap param gather for now.")
        _require(not args.use_distributed_optimizer, "Muon optimizer does not support distributed optimizer for now.")
        _require(not args.use_megatron_fsdp, "Muon optimizer does not support Megatron-FSDP for now.")
    if args.optimizer_cpu_offload:
        _require(args.use_precision_aware_optimizer,
                 "The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`, as "
                 "the hybrid device optimizer reuses the code path of this flag.")
    if args.mtp_num_layers:
        _require(args.position_embedding_type in ("rope", "none"),
                 f"Multi-Token Prediction (MTP) is not supported with {args.position_embedding_type} position "
                 "embedding type.The supported position embedding types are rope and none.")
    if args.cpu_offloading_num_layers > 0:
        args.cpu_offloading = True
    if args.multi_latent_attention:
        _require(not args.group_query_attention,
                 "Group query attention is mutually exclusive with multi latent attention.")
    if args.moe_latent_size is not None:
        _require(args.moe_latent_size > 0, "MoE latent projection dimension has to be greater than zero.")
        _require(args.num_experts is not None, "MoE latent projections are applicable only for MoE models.")
    if args.tiktoken_special_tokens and not args.tokenizer_special_tokens:
        args.tokenizer_special_tokens = args.tiktoken_special_tokens


def _cuda_graph_and_te_checks(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """The CUDA-graph, Transformer Engine and replication checks (validate_args' later sections)."""
    if args.cuda_graph_impl == "local" and "full_iteration" in [getattr(s, "name", s) for s in args.cuda_graph_scope]:
        _require(not args.check_for_nan_in_loss_and_grad,
                 "--no-check-for-nan-in-loss-and-grad should be set with full_iteration CUDA graph")
    if args.qk_clip:
        _require(0.0 < args.qk_clip_alpha < 1.0, "--qk-clip-alpha must be between 0.0 and 1.0 when using --qk-clip.")
        _require(args.qk_clip_threshold > 0, "--qk-clip-threshold must be greater than 0 when using --qk-clip.")
    if args.inference_batch_times_seqlen_threshold > -1:
        _require(args.pipeline_model_parallel_size > 1, "--inference-batch-times-seqlen-threshold requires setting "
                                                        "--pipeline-model-parallel-size > 1.")
    if args.cuda_graph_impl == "local" and args.expert_model_parallel_size > 1:
        _require(args.moe_pad_experts_for_cuda_graph_inference, "--moe-pad-experts-for-cuda-graph-inference must be "
                 "set when using CUDA graphs with expert parallelism")
    if args.non_persistent_ckpt_type == "local":
        _require(args.non_persistent_local_ckpt_dir is not None,
                 "Tried to use local checkpointing without specifying --local-ckpt-dir!")
    if args.replication:
        _require(args.replication_jump is not None, "--replication requires the value of --replication-jump!")
        _require(args.non_persistent_ckpt_type == "local", "--replication requires args.non_persistent_ckpt_type == "
                 f"'local', but got: {args.non_persistent_ckpt_type}")
    elif args.replication_jump:
        args.replication_jump = None
    if args.delay_wgrad_compute:
        _require(args.transformer_impl == "transformer_engine",
                 "Delaying wgrad compute is only supported with transformer_engine implementation")
    if args.fine_grained_activation_offloading:
        _require(args.transformer_impl == "transformer_engine",
                 "Fine-grained activation offloading is only supported with transformer_engine implementation")
        _require(env.get("NVTE_CPU_OFFLOAD_V1", "0") == "1", "For fine-grained activation offloading with TE >= "
                 "2.10.0, NVTE_CPU_OFFLOAD_V1 should be set to 1 to avoid offloading weights.")
    if args.cuda_graph_impl != "none" and "transformer_engine" in (args.transformer_impl, args.cuda_graph_impl):
        args.te_rng_tracker = True
    if args.cuda_graph_scope == "full" or (isinstance(args.cuda_graph_scope, list) and "full" in args.cuda_graph_scope):
        if isinstance(args.cuda_graph_scope, list):
            _require(args.cuda_graph_scope == ["full"], "full scope cannot be used with other scopes.")
        args.cuda_graph_scope = []
