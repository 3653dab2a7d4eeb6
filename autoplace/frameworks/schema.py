"""The keys each framework's config reader knows, as data.

autoplace never imports DeepSpeed, accelerate or torchtitan, yet must reject what they would
silently ignore (a misspelt top-level DeepSpeed key, an unknown ``fsdp_config`` key).  These
sets are read off the frameworks' own parsers; ``tests/test_emit_schema.py`` compares them
with the installed frameworks so a new release that adds or drops a key is noticed.

Sources (versions in ECOSYSTEM.md): DeepSpeed 0.19 ``runtime/config.py`` (every key
``DeepSpeedConfig._initialize_params`` and its helpers read), ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/activation_checkpointing/config.py``,
``runtime/config.py:get_pipeline_config`` and ``runtime/pipe/engine.py``; accelerate 1.15
``commands/config/config_args.py`` and the launch parser; torchtitan 0.2.2 ``config/job_config.py``.
"""

from __future__ import annotations

DEEPSPEED_TOP_LEVEL = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "steps_per_print", "dump_state", "disable_python_gc", "disable_allgather",
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "zero_optimization", "activation_checkpointing",
    "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16",
    "bfloat16", "torch_autocast", "optimizer", "scheduler", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "autotuning",
    "use_data_before_expert_parallelism", "hybrid_engine", "pipeline", "data_efficiency", "curriculum_learning",
    "checkpoint", "data_types", "aio", "dataloader_drop_last", "log_level", "datastates_ckpt",
    "weight_quantization", "compile", "timers", "tensor_parallel", "expert_parallel", "sparse_attention",
    "sparse_gradients", "elasticity", "eigenvalue", "progressive_layer_drop", "graph_harvesting",
    "vocabulary_size", "sequence_parallel_size",
})

# Top-level blocks DeepSpeed 0.19 refuses outright (removed features); named so our message can say so.
DEEPSPEED_REMOVED = frozenset({"nebula", "compression_training", "amp", "quantize_training"})

DEEPSPEED_ZERO = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
    "stage3_param_persistence_threshold", "param_persistence_threshold", "stage3_model_persistence_threshold",
    "model_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
    "stage3_max_reuse_distance", "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold", "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "allgather_sequential", "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters",
    "legacy_stage1", "round_robin_gradients", "parameter_alignment", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
})

DEEPSPEED_OFFLOAD_PARAM = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
DEEPSPEED_OFFLOAD_OPTIMIZER = frozenset({
    "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init", "ratio",
    "super_offload", "cpuadam_cores_perc",
})
DEEPSPEED_ACTIVATION_CHECKPOINTING = frozenset({
    "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing", "number_checkpoints",
    "synchronize_checkpoint_boundary", "profile",
})
# get_pipeline_config's defaults plus what PipelineEngine reads (use_reentrant).
DEEPSPEED_PIPELINE = frozenset({
    "stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned",
    "use_reentrant",
})

# accelerate: ClusterConfig (with BaseConfig) fields, the keys a config YAML may hold.
ACCELERATE_TOP_LEVEL = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config",
})
# The launch parser's --fsdp_* options (fsdp_config keys map to them one to one), plus
# fsdp_ignored_modules, which prepare_multi_gpu_env reads from the config without a flag.
ACCELERATE_FSDP = frozenset({
    "fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_forward_prefetch",
    "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
    "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload", "fsdp_ignored_modules",
})
ACCELERATE_PARALLELISM = frozenset({
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size", "parallelism_config_tp_size",
    "parallelism_config_cp_size", "parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy",
    "parallelism_config_sp_size", "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation",
})

# torchtitan 0.2.2 JobConfig: every section, and the fields of the sections autoplace interprets.
TORCHTITAN_SECTIONS = frozenset({
    "job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism", "checkpoint",
    "activation_checkpoint", "compile", "quantize", "comm", "memory_estimation", "fault_tolerance",
    "experimental", "validation", "debug",
})
TORCHTITAN_FIELDS = {
    "parallelism": frozenset({
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
        "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
        "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree", "context_parallel_load_balancer",
        "context_parallel_rotate_method", "expert_parallel_degree", "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
    }),
    "training": frozenset({
        "dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
        "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq", "gc_debug",
        "dataloader",
    }),
    "activation_checkpoint": frozenset({
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop",
        "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state", "determinism_check", "debug",
    }),
}
# Pipeline schedules torch 2.13's get_schedule_class accepts, and the ones a Plan can state.
TORCH_PP_SCHEDULES = frozenset({
    "1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
})
PLAN_TO_TORCH_SCHEDULE = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B",
                          "interleaved-zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
