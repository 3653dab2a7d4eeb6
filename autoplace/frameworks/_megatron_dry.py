"""A Megatron-LM bundle's dry run: what one rank of ``pretrain_gpt.py`` builds before step 1.

The steps follow Megatron-LM core_v0.16.1's ``pretrain`` (training.py) up to its first training step:
``initialize_megatron`` (parse_args, validate_args, the micro-batch calculator and the tokenizer of
``set_global_variables``, then ``initialize_model_parallel``), ``setup_model_and_optimizer`` (the
model chunks, DDP / Megatron-FSDP, the optimizer, the learning-rate scheduler, the checkpoint),
the data iterators, and what ``train`` sets up before its loop (the pipeline schedule).  Megatron-LM's
glue is restated (:mod:`._megatron_validate`, :mod:`._megatron_build`); everything it calls is
megatron-core's own code, run on a fake process group of the launch's world size and the meta device.

:func:`launch_refusal` runs the same steps but those that need a process group or build the model and
optimizer -- every check Megatron-LM makes of a launch's words before step 1 but theirs -- in milliseconds
once megatron-core is imported: the emit tests ask it of every launch autoplace writes.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import autoplace.frameworks._megatron_build as build
from autoplace.dryrun.steps import DryContext, StepFailed, Steps, fake_world, tensor_bytes
from autoplace.frameworks._megatron_args import interleaved_refusal
from autoplace.frameworks._megatron_fixes import eval_fix, lr_fix, suggest

# The argument step: Megatron-LM's parse_args + validate_args on the launch's words.  One function,
# so a fuller restatement can take its place.
Arguments = Callable[..., argparse.Namespace]
# CUDA major version of each GPU family (validate_args' CUDA_DEVICE_MAX_CONNECTIONS rule stops at 10,
# Blackwell); by the cluster profile's name (hardware_profiles/gpu)
_ARCH = {"v100": 7, "a100": 8, "l40s": 8, "h100": 9, "h200": 9, "b200": 10, "gb200": 10}
STAND_IN = "<"  # launches.py fills a required variable the user did not set with "<NAME>"
# what each tokenizer type of tokenizer.py build_tokenizer asserts it was given (HuggingFaceTokenizer hands
# --tokenizer-model to AutoTokenizer.from_pretrained, which refuses None)
_TOKENIZER_FILES = {"BertWordPieceLowerCase": ("vocab_file",), "BertWordPieceCase": ("vocab_file",),
                    "GPT2BPETokenizer": ("vocab_file", "merge_file"), "SentencePieceTokenizer": ("tokenizer_model",),
                    "GPTSentencePieceTokenizer": ("tokenizer_model",), "HuggingFaceTokenizer": ("tokenizer_model",),
                    "Llama2Tokenizer": ("tokenizer_model",), "TikTokenizer": ("tokenizer_model",),
                    "NullTokenizer": ("vocab_size",)}


def dry_run(ctx: DryContext, steps: Steps, arguments: Arguments | None = None) -> None:
    """Build rank ``ctx.rank`` of the bundle's ``pretrain_gpt.py`` launch, step by step (see the module)."""
    words = _typed_stand_ins(ctx, steps)
    args = _arguments(words, ctx.world, steps, arguments, rank=ctx.rank, env=ctx.launched.env, arch=gpu_arch(ctx))
    _tokenizer(args, steps)
    with megatron_globals():
        config, micro_batches = _config_and_micro_batches(args, steps)
        with fake_world(ctx.world, ctx.rank):
            _on_the_fake_world(args, config, micro_batches, steps)


def launch_refusal(words: Sequence[str], world: int, env: Mapping[str, str | None] | None = None,
                   arch: int = 9) -> str | None:
    """The first refusal Megatron-LM core_v0.16.1 makes of a launch passing ``words`` to ``pretrain_gpt.py``
    on ``world`` ranks with environment ``env`` (:func:`launch_checks`), as one line -- the step, the
    framework's own message and autoplace's fix -- or None."""
    try:
        launch_checks(words, world, env=env, arch=arch)
    except StepFailed as exc:
        return f"{exc}" + (f" (fix: {exc.fix})" if exc.fix else "")
    return None


def launch_checks(words: Sequence[str], world: int, *, env: Mapping[str, str | None] | None = None,
                  arch: int = 9) -> tuple[argparse.Namespace, Any]:
    """The dry run's steps that need no process group and no model, on a launch's words: parse_args and
    validate_args, the tokenizer's files, the TransformerConfig, the micro-batch calculator, then megatron-core's
    split of the embedding's rows over TP (the model's), the LR scheduler (on a stand-in optimizer), the
    datasets' sizes and source, and the pipeline schedule's checks.  Fast: no tokenizer, model or optimizer
    is built.

    Args:
        words: the words after ``pretrain_gpt.py``.
        world: WORLD_SIZE.
        env: the launch's environment (None values: unset).
        arch: the GPU's CUDA major version (9, Hopper, by default).

    Returns:
        (args as validate_args leaves them, megatron-core's TransformerConfig).

    Raises:
        StepFailed: the first step refused, with the framework's message and autoplace's fix.
    """
    steps = Steps(lambda event: None)
    args = _arguments(words, world, steps, None, rank=0, env=env or {}, arch=arch)
    with megatron_globals():
        config, micro_batches = _config_and_micro_batches(args, steps)
    fix = lambda e: suggest(e, args)  # noqa: E731 - the same rules for every step
    with steps.step("the embedding's rows over tensor parallelism (megatron-core's VocabParallelEmbedding split)",
                    fix=fix):
        _vocabulary_split(args)
    with steps.step(SCHEDULER, fix=lambda e: lr_fix(e, args)):
        build.scheduler(args, _stand_in_optimizer())
    _checkpoint_and_data(args, steps)
    with steps.step(SCHEDULE, fix=fix):
        schedule(args, config, _chunks(args), micro_batches)
    return args, config


def _arguments(words: Sequence[str], world: int, steps: Steps, arguments: Arguments | None, *, rank: int,
               env: Mapping[str, str | None], arch: int) -> argparse.Namespace:
    """parse_args and validate_args (``arguments``, :func:`._megatron_validate.megatron_arguments` by
    default), then the files the tokenizer type reads."""
    if arguments is None:
        from autoplace.frameworks._megatron_validate import megatron_arguments

        arguments = megatron_arguments
    with steps.step("Megatron-LM's arguments: parse_args and validate_args", fix=suggest):
        _requires_megatron_core()
        args = arguments(words, world, rank=rank, env={k: v for k, v in env.items() if v is not None}, arch=arch)
    _tokenizer_files(args, steps)
    return args


def _config_and_micro_batches(args: argparse.Namespace, steps: Steps) -> tuple[Any, int]:
    """megatron-core's TransformerConfig and micro-batch calculator (set inside :func:`megatron_globals`)."""
    with steps.step("megatron-core's TransformerConfig (core_transformer_config_from_args)",
                    fix=lambda e: suggest(e, args)):
        config = build.transformer_config(args)
    with steps.step("the micro-batch calculator (global batch = micro-batch x data-parallel x micro-batches)",
                    fix=lambda e: suggest(e, args)):
        micro_batches = _micro_batches(args)
    return config, micro_batches


def _on_the_fake_world(args: argparse.Namespace, config: Any, micro_batches: int, steps: Steps) -> None:
    """initialize_model_parallel, the model, DDP, optimizer and schedule of this rank."""
    fix = lambda e: suggest(e, args)  # noqa: E731 - the same rules for every step
    with steps.step("parallel_state.initialize_model_parallel (order tp-cp-ep-dp-pp)", fix=fix):
        stage, chunks = _model_parallel(args, config)
    steps.stage(stage, chunks)
    _skipped_at_start(args, steps)
    steps.note(build.TE_ASSUMED)
    steps.note(build.BUILT_HERE)
    steps.note(build.REDIRECTED)
    for note in build.layout_notes(args):
        steps.note(note)
    with steps.step("the model chunks: megatron-core's GPTModel per virtual stage (get_model)", fix=fix):
        model = build.model_chunks(args, config)
    if args.use_megatron_fsdp:
        optimizer = _without_fsdp(args, steps)
    else:
        with steps.step("megatron-core's DistributedDataParallel: parameter and gradient buffers", fix=fix):
            model = build.wrap_data_parallel(args, config, model)
        _measure_model(model, steps)
        with steps.step("the distributed optimizer: fp32 main-parameter shards" if args.use_distributed_optimizer
                        else "the mixed-precision optimizer: fp32 main parameters", fix=lambda e: lr_fix(e, args)):
            optimizer, optimizer_config = build.optimizer(args, model)
        if args.optimizer_cpu_offload:
            steps.note("optimizer state not measured: under --optimizer-cpu-offload megatron-core's "
                       "HybridDeviceOptimizer moves it to the host by each parameter's is_cuda, which a meta "
                       "tensor is not")
        else:
            _measure_optimizer(optimizer, optimizer_config, steps)
    with steps.step(SCHEDULER, fix=lambda e: lr_fix(e, args)):
        build.scheduler(args, optimizer)
    _checkpoint_and_data(args, steps)
    with steps.step(SCHEDULE, fix=fix):
        name = schedule(args, config, len(model), micro_batches)
    steps.note(f"schedule: {name}, {micro_batches} micro-batches of {args.micro_batch_size} per step")


SCHEDULER = "the learning-rate scheduler (OptimizerParamScheduler)"
SCHEDULE = "the pipeline schedule (get_forward_backward_func)"


def _chunks(args: argparse.Namespace) -> int:
    """How many model chunks ``get_model`` builds on a rank: one per virtual stage under a pipeline."""
    vp = args.virtual_pipeline_model_parallel_size
    return vp if args.pipeline_model_parallel_size > 1 and vp is not None else 1


def _vocabulary_split(args: argparse.Namespace) -> None:
    """megatron-core's split of --padded-vocab-size rows over the TP ranks, as VocabParallelEmbedding asks it
    (``VocabUtility.vocab_range_from_global_vocab_size``; without the flag the tokenizer's size is padded to a
    multiple of tp)."""
    from megatron.core.tensor_parallel.utils import VocabUtility

    if args.padded_vocab_size is not None:
        VocabUtility.vocab_range_from_global_vocab_size(args.padded_vocab_size, 0, args.tensor_model_parallel_size)


def _stand_in_optimizer() -> Any:
    """An optimizer of one parameter group: all the LR scheduler sets (each group's lr and weight decay)."""
    return types.SimpleNamespace(param_groups=[{"params": []}])


# what a numeric flag's stand-in is read as: a long run, so no schedule check trips on a short one
_STAND_IN_VALUES = {"int": "1000000", "float": "1.0"}


def _typed_stand_ins(ctx: DryContext, steps: Steps) -> list[str]:
    """The launch's words, a stand-in for an unset required variable (``<TRAIN_ITERS>``) given a value of
    its flag's type where the flag takes a number (Megatron-LM's parser would refuse the stand-in)."""
    from autoplace.frameworks._megatron_flags import value_type

    words = list(ctx.launched.args)
    stand_ins = {value: name for name, value in ctx.launched.stand_ins.items()}
    for i, word in enumerate(words[1:], start=1):
        kind = value_type(words[i - 1]) if word in stand_ins else None
        if kind in _STAND_IN_VALUES:
            words[i] = _STAND_IN_VALUES[kind]
            steps.note(f"{stand_ins[word]} is not set: {words[i - 1]} {word} read as {words[i]} (set {stand_ins[word]} "
                       "to check the value the job will run with)")
    return words


def _without_fsdp(args: argparse.Namespace, steps: Steps) -> Any:
    """--use-megatron-fsdp: its buffers and optimizer are not built (say why); the scheduler is built on a
    stand-in optimizer with one parameter group (it only sets each group's lr and weight decay)."""
    steps.skip("Megatron-FSDP's sharded parameter and gradient buffers (--use-megatron-fsdp)", build.FSDP_NOT_BUILT)
    steps.skip("the distributed optimizer over Megatron-FSDP's buffers", "built from Megatron-FSDP's buffers")
    steps.note("the learning-rate scheduler is built on a stand-in optimizer (one parameter group): Megatron-FSDP's "
               "is not built")
    return _stand_in_optimizer()


def _requires_megatron_core() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise ImportError("megatron-core is not installed: pip install 'autoplace[megatron]' (megatron-core 0.16, "
                          "the release Megatron-LM core_v0.16.1 runs on)") from None


def gpu_arch(ctx: DryContext) -> int:
    """The CUDA major version of the cluster's GPU (validate_args asks the GPU; 9, Hopper, when unknown)."""
    name = ctx.cluster.pools[0].gpu.name
    return next((arch for family, arch in _ARCH.items() if name.startswith(family)), 9)


@contextmanager
def megatron_globals() -> Iterator[None]:
    """megatron-core's globals this dry run sets (parallel_state's groups, the micro-batch calculator),
    reset afterwards so the next build in this process starts clean."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        destroy_num_microbatches_calculator()


def _micro_batches(args: argparse.Namespace) -> int:
    """megatron-core's micro-batch calculator as ``set_global_variables`` initialises it."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator

    init_num_microbatches_calculator(args.rank, args.rampup_batch_size, args.global_batch_size,
                                     args.micro_batch_size, args.data_parallel_size,
                                     args.decrease_batch_size_if_needed)
    return int(get_num_microbatches())


def _tokenizer_step(args: argparse.Namespace) -> str:
    return f"the tokenizer ({args.tokenizer_type}) and the embedding's rows"


def _tokenizer_files(args: argparse.Namespace, steps: Steps) -> None:
    """What build_tokenizer asserts its tokenizer type was given (:data:`_TOKENIZER_FILES`)."""
    needs = [flag for flag in _TOKENIZER_FILES.get(args.tokenizer_type, ()) if getattr(args, flag) is None]
    if needs:
        with steps.step(_tokenizer_step(args), fix=lambda e: f"add --{needs[0].replace('_', '-')} (--tokenizer-type "
                                                             f"{args.tokenizer_type} reads it)"):
            raise AssertionError(f"assert args.{needs[0]} is not None")


def _tokenizer(args: argparse.Namespace, steps: Steps) -> None:
    """The tokenizer ``set_global_variables`` builds (tokenizer.py ``build_tokenizer``), and the embedding's
    rows: --padded-vocab-size when given, else the tokenizer's size padded to the next multiple of
    --make-vocab-size-divisible-by x tp (``_vocab_size_with_padding``)."""
    model = str(args.tokenizer_model or "")
    name = _tokenizer_step(args)
    given = args.padded_vocab_size
    size = None
    if args.tokenizer_type == "NullTokenizer":
        size = args.vocab_size + 1  # _NullTokenizer.vocab_size: the ids and one end-of-document id
    elif args.tokenizer_type == "HuggingFaceTokenizer" and not model.startswith(STAND_IN):
        with steps.step(name, fix=lambda e: f"--tokenizer-model {model}: give a local Hugging Face tokenizer "
                                            "directory (or a Hub id in the cache)"):
            size = _hf_tokenizer_size(model, args.trust_remote_code)
    else:
        why = (f"--tokenizer-model {model} is a stand-in" if model.startswith(STAND_IN)
               else f"{args.tokenizer_type} reads vocabulary files")
        steps.skip(name, f"{why}: not built here")
    rows = given if given is not None else _padded(args, size if size is not None else args.vocab_size)
    if rows is None:
        with steps.step("the embedding's rows", fix=lambda e: "add --padded-vocab-size (the embedding's rows)"):
            raise ValueError("no tokenizer built here, and neither --padded-vocab-size nor --vocab-size to size "
                             "the embedding from")
    if given is None and size is None:
        steps.note(f"the tokenizer was not built: the embedding is sized from --vocab-size {args.vocab_size} "
                   f"({rows} rows), as Megatron-LM would size it from len(tokenizer); give --padded-vocab-size to "
                   "fix it")
    elif given is not None and size is not None and _padded(args, size) > given:
        steps.note(f"the tokenizer has {size} tokens, more than --padded-vocab-size {given} rows")
    args.padded_vocab_size = rows


def _padded(args: argparse.Namespace, size: int | None) -> int | None:
    """tokenizer.py ``_vocab_size_with_padding``."""
    if size is None:
        return None
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-size // multiple) * multiple


def _hf_tokenizer_size(model: str, trust_remote_code: bool) -> int:
    """len() of the Hugging Face tokenizer (tokenizer.py ``_HuggingFaceTokenizer.vocab_size``), read from
    local files only (a dry run downloads nothing)."""
    import transformers

    return len(transformers.AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code,
                                                          local_files_only=True))


def _model_parallel(args: argparse.Namespace, config: Any) -> tuple[int, list[int]]:
    """initialize_model_parallel as ``initialize.py: _initialize_distributed`` calls it, and the rank's
    pipeline stage and virtual stages as parallel_state placed it."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_comm_backend=args.pipeline_model_parallel_comm_backend, use_sharp=args.use_sharp,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        hybrid_context_parallel=args.hybrid_context_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        get_embedding_ranks=lambda ranks, pp=None: embedding_ranks(args, config, ranks),
        create_gloo_process_groups=False, high_priority_stream_groups=args.high_priority_stream_groups,
        sharp_enabled_group=args.sharp_enabled_group, create_all_gather_group=args.create_all_gather_group)
    stage, stages = (parallel_state.get_pipeline_model_parallel_rank(),
                     parallel_state.get_pipeline_model_parallel_world_size())
    virtual = args.virtual_pipeline_model_parallel_size or 1
    return stage, [stage + i * stages for i in range(virtual)] if virtual > 1 else []


def embedding_ranks(args: argparse.Namespace, config: Any, pp_ranks: list[int]) -> list[int]:
    """pretrain_gpt.py ``get_embedding_ranks``: the first stage, the last when the output layer shares the
    embedding, and the stages holding MTP layers."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1:
        if not args.untie_embeddings_and_output_weights:
            ranks.append(pp_ranks[-1])
        ranks.extend(get_mtp_ranks(pp_ranks, config))
    return sorted(set(ranks))


# ------------------------------------------------------------------ what the rank allocated


def _measure_model(model: Sequence[Any], steps: Steps) -> None:
    """Parameters and gradients as megatron-core's DDP laid them out: its contiguous buffers (param
    buffers exist under the distributed optimizer; grads always), padded as it pads them."""
    buffers = [b for chunk in model for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    in_buffers = {id(p) for b in buffers if b.param_data is not None for p in b.params}
    loose = [p for chunk in model for p in chunk.parameters() if id(p) not in in_buffers]
    params = sum(tensor_bytes([b.param_data]) for b in buffers if b.param_data is not None) + tensor_bytes(loose)
    dtypes = sorted({str(b.param_dtype).removeprefix("torch.") for b in buffers})
    where = ("DDP's contiguous param buffers, padded for the distributed optimizer" if len(in_buffers)
             else "parameter tensors")
    steps.measured("params", params, f"{'/'.join(dtypes)} {where}")
    grads = sum(tensor_bytes([b.grad_data]) for b in buffers)
    grad_dtypes = sorted({str(b.grad_dtype).removeprefix("torch.") for b in buffers})
    steps.measured("grads", grads, f"{'/'.join(grad_dtypes)} DDP grad buffers ({len(buffers)} buffers, "
                                   f"{sum(len(b.buckets) for b in buffers)} buckets, padded)")


def _measure_optimizer(optimizer: Any, config: Any, steps: Steps) -> None:
    """fp32 main parameters and Adam's moments: the state megatron-core's ``init_state_fn`` creates (what
    the first step's Adam creates: zeros like each main parameter), counted per optimizer of the chain."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    main = state = 0
    for part in parts:
        shards = [t for g in getattr(part, "shard_fp32_from_float16_groups", []) for t in g if t is not None]
        shards += [t for g in getattr(part, "fp32_from_float16_groups", []) for t in g if t is not None]
        main += tensor_bytes(shards)
        if part.optimizer is not None and part.init_state_fn is not None:
            part.init_state_fn(part.optimizer, config)
            state += tensor_bytes(v for s in part.optimizer.state.values() for v in s.values()
                                  if hasattr(v, "element_size"))
    sharded = "shards" if any(hasattr(p, "shard_fp32_from_float16_groups") for p in parts) else "copies"
    steps.measured("optimizer", main + state, f"fp32 main-parameter {sharded} + Adam exp_avg and exp_avg_sq "
                                              "(megatron-core's init_state_fn, as the first step makes them)")


def _skipped_at_start(args: argparse.Namespace, steps: Steps) -> None:
    """What initialize_megatron does after the process groups that needs the cluster's GPUs."""
    if args.tp_comm_overlap:
        steps.skip("Transformer Engine's userbuffers (--tp-comm-overlap)", "needs Transformer Engine and CUDA")
    steps.skip("CUDA RNG states, fused kernels and JIT warm-up", "need a GPU")


def _checkpoint_and_data(args: argparse.Namespace, steps: Steps) -> None:
    """The checkpoint (setup_model_and_optimizer's last step) and the data iterators (pretrain's next)."""
    if args.load is not None:
        steps.skip("the checkpoint at --load (load_checkpoint)", f"{args.load}: checkpoints are read on the "
                   "cluster (none there: Megatron-LM starts from scratch)")
    with steps.step("the datasets' sizes (get_train_valid_test_num_samples)", fix=lambda e: eval_fix(e, args)):
        train, valid, test = build.dataset_sizes(args)
    steps.note(f"datasets sized for {train} training, {valid} validation and {test} test samples")
    source = args.data_path or args.train_data_path or args.data_args_path or args.per_split_data_args_path
    name = "the datasets and data iterators (build_train_valid_test_data_iterators)"
    if not source and not args.mock_data:
        with steps.step(name, fix=lambda e: "add --data-path PREFIX (your Megatron-indexed dataset) or --mock-data"):
            raise ValueError("no data source: pretrain_gpt.py builds its GPTDataset from --data-path (or "
                             "--train-data-path, --data-args-path, --mock-data)")
    where = "mock data" if args.mock_data else " ".join(source) if isinstance(source, list) else source
    steps.skip(name, f"{where}: the data is read on the cluster")


def schedule(args: argparse.Namespace, config: Any, chunks: int, micro_batches: int) -> str:
    """megatron-core's forward_backward_func for the launch's pipeline and virtual sizes, and the checks its
    schedule makes before the first micro-batch, restated (schedules.py: model chunking; the interleaved
    schedule's micro-batch groups, :func:`~._megatron_args.interleaved_refusal`) on a rank's ``chunks``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp = args.pipeline_model_parallel_size
    func = get_forward_backward_func(pp, args.virtual_pipeline_model_parallel_size)
    interleaved = func.__name__ == "forward_backward_pipelining_with_interleaving"
    if not interleaved and chunks != 1:
        raise AssertionError("non-interleaved pipeline-parallel schedule does not support model chunking")
    if interleaved:
        if config.overlap_p2p_comm and config.batch_p2p_comm:
            raise ValueError("Can not use both overlap_p2p_comm and batch_p2p_comm")
        refused = interleaved_refusal(micro_batches, pp, config.microbatch_group_size_per_vp_stage)
        if refused is not None:
            raise refused
    elif pp > 1 and config.overlap_p2p_comm:
        raise ValueError("Non-interleaved pipeline parallelism does not support overlapping p2p communication")
    return str(func.__name__)
