"""Megatron-LM arguments: the right flags per plan, validated by Megatron-LM's checks and megatron-core's own
config classes.

What runs without a GPU: megatron-core (PyPI ``megatron-core``, 0.16 for Python 3.11) builds
``TransformerConfig`` on CPU, and its ``__post_init__`` checks the parallel and model settings
(pipeline split and layout, virtual stages, recompute, MoE, GQA...).  Megatron-LM's training code
is not in that wheel; the dry run's restatements of it take its place
(``autoplace.frameworks._megatron_dry.launch_checks``: Megatron-LM's parser from its own flag table,
``validate_args`` restated, ``core_transformer_config_from_args``, then megatron-core's micro-batch
calculator, vocabulary split and LR scheduler, the datasets' sizes, the pipeline schedule's checks).
They run here on the words every emitted launch passes (and on a bundle's, through bash).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplace.bundle import emit
from autoplace.dryrun.steps import StepFailed
from autoplace.errors import EmitError
from autoplace.frameworks import get
from autoplace.frameworks.megatron import block_pattern, emit_megatron, launch_args, megatron_environment
from autoplace.plan import Plan
from autoplace.specs.model import load_model
from tests.helpers import REPO, gpu_cluster
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan, small_model

LLAMA_70B = load_model(REPO / "examples/models/llama-3-70b.json")
C64 = gpu_cluster(64)
HF = REPO / "tests/data/hf"


def args_of(text: str, model=MODEL, cluster=CLUSTER16) -> list[str]:
    return emit_megatron(make_plan(text, model, cluster), model, cluster)


def value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_megatron_3d_plan() -> None:
    args = args_of("tp=8,pp=4,vpp=2,zero=1,recompute=selective", LLAMA_70B, C64)
    assert [value(args, f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                     "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
                                     "--global-batch-size", "--recompute-granularity")] == [
        "8", "4", "10", "1", "2048", "selective"]
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--swiglu", "--group-query-attention",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"} <= set(args)
    assert (value(args, "--num-query-groups"), value(args, "--normalization")) == ("8", "RMSNorm")


def test_uneven_splits_use_first_last_counts_or_an_explicit_layout() -> None:
    args = args_of("pp=4,zero=1,layers=1:3:3:1")
    assert (value(args, "--decoder-first-pipeline-num-layers"), value(args, "--decoder-last-pipeline-num-layers")) == (
        "1", "1")
    args = args_of("pp=2,vpp=2,zero=1,layers=2:6")
    assert value(args, "--pipeline-model-parallel-layout") == "Et|t*3|t|t*3L"  # chunks in virtual-stage order


def test_recompute_block_method_matches_first_k_layers_of_each_chunk() -> None:
    args = args_of("pp=2,zero=1,recompute_layers=f:f:n:n:f:f:n:n")
    assert [value(args, f) for f in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")] == [
        "full", "block", "2"]
    assert block_pattern([4, 4], 2) == ("full", "full", "none", "none") * 2
    assert value(args_of("zero=1,recompute=full"), "--recompute-method") == "uniform"


def test_zero_levels_and_offload() -> None:
    assert "--use-distributed-optimizer" not in args_of("zero=0")
    z1 = args_of("zero=1,preset=hsdp,offload_optimizer=cpu")
    assert {"--optimizer-cpu-offload", "--use-precision-aware-optimizer"} <= set(z1)
    assert value(z1, "--num-distributed-optimizer-instances") == "2"
    z3 = args_of("zero=3")
    assert (value(z3, "--data-parallel-sharding-strategy"), value(z3, "--ckpt-format")) == (
        "optim_grads_params", "fsdp_dtensor")
    assert value(args_of("zero=2"), "--data-parallel-sharding-strategy") == "optim_grads"


def test_precision_and_moe_shape() -> None:
    assert "--fp16" in args_of("zero=1", small_model("fp16"))
    assert "--accumulate-allreduce-grads-in-fp32" in args_of("zero=1", small_model("bf16-fp32-grads"))
    moe = small_model(moe={"experts": 8, "top_k": 2, "expert_ffn_hidden": 128, "first_dense_layers": 1})
    args = args_of("ep=4,zero=1", moe)
    assert [value(args, f) for f in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                                     "--moe-layer-freq")] == ["8", "2", "128", "[0,1,1,1,1,1,1,1]"]


def test_what_megatron_cannot_express_raises() -> None:
    for text, message in [("pp=2,zero=1,schedule=gpipe", "GPipe"), ("zero=3,offload_optimizer=cpu,offload_params=cpu",
                                                                    "parameter offload"),
                          ("zero=1,recompute_layers=f:n:f:n:f:n:f:n", "first k")]:
        with pytest.raises(EmitError, match=message):
            args_of(text)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_the_bundles_bash_array_gives_back_every_argument_unglobbed(tmp_path) -> None:
    moe = small_model(moe={"experts": 8, "top_k": 2, "expert_ffn_hidden": 128, "first_dense_layers": 1})
    plan = make_plan("ep=4,pp=2,vpp=2,zero=1,layers=2:6", moe, CLUSTER16)
    emit(plan, moe, CLUSTER16, ["megatron"], tmp_path)
    (tmp_path / "1").write_text("")  # a file the glob [0,1,...] would match if the values were unquoted
    printed = subprocess.run(["bash", "-c", 'source megatron_args.sh && printf "%s\\0" "${MEGATRON_ARGS[@]}"'],
                             cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert printed.split("\0")[:-1] == emit_megatron(plan, moe, CLUSTER16)
    assert "[0,1,1,1,1,1,1,1]" in printed and "Et|t*3|t|t*3L" in printed


# ---------------------------------------------------------------------------------------
# megatron-core's own validation


def megatron_core_config(args: list[str], plan: Plan) -> tuple[Any, argparse.Namespace]:
    """(TransformerConfig, validated args) as Megatron-LM builds them from a launch of ``args`` (a bundle's
    arguments, then the launch's placeholder words) in ``plan``'s world and launch environment: every
    check the dry run makes before it builds the model (``launch_checks``) passes first."""
    from autoplace.frameworks._megatron_dry import launch_checks

    namespace, config = launch_checks([*args, *launch_args(lambda var, what: SAMPLE_ENV[var])], plan.world,
                                      env=megatron_environment(plan))
    assert "--sequence-parallel" not in args or config.tensor_model_parallel_size > 1  # autoplace writes it so
    return config, namespace


# values for the launch's required variables (megatron.PLACEHOLDERS)
SAMPLE_ENV = {"DATA_PATH": "/data/corpus_text_document", "TOKENIZER_MODEL": "/models/tokenizer",
              "CHECKPOINT_DIR": "/checkpoints", "TRAIN_ITERS": "5000"}


@pytest.fixture(scope="module")
def mcore() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core", reason="megatron-core is in the test extra")
    import warnings

    with warnings.catch_warnings():  # megatron-core warns that Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.gpt_model  # noqa: F401


CORE_PLANS = [("tp=8,pp=4,vpp=2,zero=1,recompute=selective", 64), ("tp=8,pp=4,zero=1,layers=18:22:22:18", 64),
              ("tp=4,pp=2,zero=1,layers=36:44,recompute=full", 64), ("pp=4,vpp=2,zero=1,layers=16:24:24:16", 64),
              ("tp=2,cp=2,zero=3", 64), ("zero=2,preset=hsdp", 8), ("tp=8,zero=1,offload_optimizer=cpu", 64)]


@pytest.mark.parametrize("text, world", CORE_PLANS)
def test_megatron_core_accepts_the_llama3_arguments_and_reads_the_plan(text: str, world: int, mcore) -> None:
    cluster = gpu_cluster(world)
    plan = make_plan(text, LLAMA_70B, cluster)
    config, args = megatron_core_config(emit_megatron(plan, LLAMA_70B, cluster), plan)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size,
            config.virtual_pipeline_model_parallel_size or 1) == (plan.tp, plan.pp, plan.cp, plan.vpp)
    assert (args.micro_batch_size, args.global_batch_size) == (plan.mbs, plan.global_batch)
    m = LLAMA_70B
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size, config.num_attention_heads,
            config.num_query_groups, config.kv_channels) == (m.layers, m.hidden, m.ffn_hidden, m.heads, 8, 128)
    assert config.gated_linear_unit and not config.add_bias_linear and config.normalization == "RMSNorm"
    assert (args.position_embedding_type, args.rotary_base) == ("rope", 500000)  # Llama 3's RoPE base
    assert args.untie_embeddings_and_output_weights and args.seq_length == m.seq_len
    assert args.padded_vocab_size == m.vocab
    if plan.pp > 1 and len(set(plan.layers_per_stage)) > 1 and plan.vpp == 1:
        assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (
            plan.layers_per_stage[0], plan.layers_per_stage[-1])


@pytest.mark.parametrize("name, checks", [
    ("qwen2.5-0.5b.json", {"add_qkv_bias": True, "add_bias_linear": False}),
    ("deepseek-v2-lite.json", {"multi_latent_attention": True, "kv_lora_rank": 512, "q_lora_rank": None,
                               "num_moe_experts": 64, "moe_router_pre_softmax": True}),
    ("mixtral-8x7b-v0.1.json", {"num_moe_experts": 8, "moe_router_topk": 2})])
def test_megatron_core_accepts_other_architectures(name: str, checks: dict[str, Any], mcore) -> None:
    model, cluster = load_model(HF / name), gpu_cluster(16)
    plan = make_plan("tp=2,zero=1" + (",ep=4" if "mixtral" in name or "deepseek" in name else ""), model, cluster)
    config, args = megatron_core_config(emit_megatron(plan, model, cluster), plan)
    assert {k: getattr(config, k) for k in checks} == checks
    assert args.position_embedding_type == ("learned_absolute" if name == "gpt2.json" else "rope")
    assert args.untie_embeddings_and_output_weights == (not model.tied_embeddings)
    # gpt2's vocabulary (50257) is odd: tp=2 needs one padding row, the fewest Megatron allows
    assert args.padded_vocab_size - model.vocab == (1 if name == "gpt2.json" else 0)


def test_megatron_core_rejects_what_it_should(mcore) -> None:
    """The validation can fail: a split that does not add up is refused by megatron-core itself."""
    plan = make_plan("pp=4,zero=1,layers=1:3:3:1", MODEL, CLUSTER16)
    bad = emit_megatron(plan, MODEL, CLUSTER16)
    bad[bad.index("--decoder-first-pipeline-num-layers") + 1] = "6"  # 6 + 1 leaves 1 layer for 2 middle stages
    with pytest.raises(StepFailed, match="ValueError: number of layers at middle stage: 1 must be divisible"):
        megatron_core_config(bad, plan)


def test_rope_base_defaults_to_megatrons_and_must_be_whole() -> None:
    assert value(args_of("zero=1"), "--rotary-base") == "10000"
    with pytest.raises(EmitError, match="rotary-base is an integer"):
        args_of("zero=1", small_model(rope_theta=1e4 + 0.5))


def grad_reduce_in_fp32(args: argparse.Namespace) -> bool:
    """DistributedDataParallelConfig.grad_reduce_in_fp32 as Megatron-LM's ``get_model`` fills it from the
    validated args (``_megatron_build.ddp_config_from_args``)."""
    from autoplace.frameworks._megatron_build import ddp_config_from_args

    return bool(ddp_config_from_args(args, 0, args.data_parallel_size).grad_reduce_in_fp32)


@pytest.mark.parametrize("text", ["zero=1,compress=bf16", "tp=2,pp=2,zero=1,compress=bf16", "zero=3,compress=bf16"])
def test_bf16_reduction_is_megatrons_grad_reduce_in_bf16(text: str, mcore) -> None:
    """compress=bf16 replaces fp32 accumulation and reduction: Megatron's DDP config reduces in bf16."""
    model = small_model("bf16-fp32-grads")
    plan = make_plan(text, model, CLUSTER16)
    args = emit_megatron(plan, model, CLUSTER16)
    assert "--grad-reduce-in-bf16" in args and "--accumulate-allreduce-grads-in-fp32" not in args
    assert grad_reduce_in_fp32(megatron_core_config(args, plan)[1]) is False
    plain_plan = make_plan(text.replace(",compress=bf16", ""), model, CLUSTER16)
    plain = emit_megatron(plain_plan, model, CLUSTER16)
    assert grad_reduce_in_fp32(megatron_core_config(plain, plain_plan)[1]) is True


def test_bf16_reduction_needs_bf16_training_and_other_options_are_refused() -> None:
    with pytest.raises(EmitError, match="--grad-reduce-in-bf16 acts only with --bf16 training"):
        args_of("zero=1,compress=bf16", small_model("fp32"))
    for text, message in [("zero=3,compress=zeropp", "plan with compress=none"),
                          ("dp_replicate=16,zero=0,compress=powersgd", "plan with compress=none")]:
        with pytest.raises(EmitError, match=message):
            args_of(text)


# ---------------------------------------------------------------------------------------
# Megatron-LM's checks before step 1 (autoplace.frameworks._megatron_dry.launch_refusal)


def launch_words(text: str, model=LLAMA_70B, world: int = 64) -> list[str]:
    """The words a launch of ``text`` passes to pretrain_gpt.py: the bundle's arguments, then the
    placeholders with sample values."""
    cluster = gpu_cluster(world)
    args = emit_megatron(make_plan(text, model, cluster), model, cluster)
    return [*args, *launch_args(lambda var, what: SAMPLE_ENV[var])]


def drop(words: list[str], flag: str) -> list[str]:
    """``words`` without ``flag`` and its values."""
    i = words.index(flag)
    j = next((k for k in range(i + 1, len(words)) if words[k].startswith("--")), len(words))
    return words[:i] + words[j:]


def refusal(words: list[str], world: int, env: dict[str, str | None] | None) -> str | None:
    from autoplace.frameworks._megatron_dry import launch_refusal

    return launch_refusal(words, world, env)


INTERLEAVED = "tp=8,pp=4,vpp=2,zero=1,recompute=selective"  # 64 GPUs: dp 2, 1024 micro-batches per step
ONE_SET = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
# (what breaks it: extra words after the launch's, a flag dropped, the world, the environment), the flag the
# line names (in Megatron's message or autoplace's fix), and Megatron's message
BROKEN: list[tuple[list[str], str | None, int, dict[str, str | None], str, str]] = [
    ([], None, 48, ONE_SET, "--tensor-model-parallel-size",
     "world size (48) is not divisible by total_model_size (total_model_size=32)"),
    (["--tensor-model-parallel-size", "eight"], None, 64, ONE_SET, "--tensor-model-parallel-size", "invalid int value"),
    (["--normalization", "BatchNorm"], None, 64, ONE_SET, "--normalization", "invalid choice: 'BatchNorm'"),
    ([], "--micro-batch-size", 64, ONE_SET, "--micro-batch-size", "assert args.micro_batch_size is not None"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], None, 64, ONE_SET, "--num-virtual-stages-per-pipeline-rank",
     "No more than one of the following arguments can be set at the same time"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], None, 64, ONE_SET, "--num-layers-per-virtual-pipeline-stage",
     "number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage"),
    (["--pipeline-model-parallel-size", "2", "--no-overlap-p2p-communication"], None, 64, ONE_SET,
     "--pipeline-model-parallel-size", "pipeline-model-parallel size should be greater than 2"),
    ([], "--overlap-grad-reduce", 64, ONE_SET, "--overlap-grad-reduce",
     "Must use --overlap-param-gather with --overlap-grad-reduce"),
    (["--ckpt-format", "fsdp_dtensor"], None, 64, ONE_SET, "--ckpt-format",
     "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP"),
    (["--fp16"], None, 64, ONE_SET, "--bf16", "assert not args.bf16"),
    (["--train-samples", "100"], None, 64, ONE_SET, "--train-samples", "expected iteration-based training"),
    ([], "--hidden-size", 64, ONE_SET, "--hidden-size", "hidden_size argument is None"),
    ([], "--seq-length", 64, ONE_SET, "--seq-length", "assert args.encoder_seq_length is not None"),
    (["--num-attention-heads", "48"], "--kv-channels", 64, ONE_SET, "--num-attention-heads",
     "assert args.hidden_size % args.num_attention_heads == 0"),
    (["--context-parallel-size", "2", "--seq-length", "8190"], None, 64, ONE_SET, "--seq-length",
     "seq-length should be a multiple of 2 * context-parallel-size"),
    (["--max-position-embeddings", "4096"], None, 64, ONE_SET, "--max-position-embeddings",
     "max_position_embeddings (4096) must be greater than or equal to seq_length (8192)"),
    (["--min-lr", "1.0"], None, 64, ONE_SET, "--min-lr", "assert args.min_lr <= args.lr"),
    ([], "--save-interval", 64, ONE_SET, "--save-interval", "assert args.save_interval is not None"),
    (["--save-interval", "0"], None, 64, ONE_SET, "--save-interval", "assert args.save_interval > 0"),
    (["--recompute-method", "uniform"], None, 64, ONE_SET, "--recompute-method",
     "recompute method is not yet supported for selective recomputing granularity"),
    (["--tp-comm-overlap"], "--sequence-parallel", 64, ONE_SET, "--sequence-parallel",
     "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled"),
    ([], None, 64, {}, "CUDA_DEVICE_MAX_CONNECTIONS", "require setting the environment variable "
                                                      "CUDA_DEVICE_MAX_CONNECTIONS to 1"),
    (["--expert-model-parallel-size", "2"], None, 64, ONE_SET, "--expert-model-parallel-size",
     "num_experts must be non None to use expert model parallelism"),
    (["--mock-data"], None, 64, ONE_SET, "--data-path", "A single data source must be provided"),
    (["--optimizer-cpu-offload"], None, 64, ONE_SET, "--optimizer-cpu-offload",
     "The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`"),
    (["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"], None, 64, ONE_SET,
     "--mtp-num-layers", "Multi-Token Prediction (MTP) is not supported with learned_absolute"),
    (["--multi-latent-attention"], None, 64, ONE_SET, "--group-query-attention",
     "Group query attention is mutually exclusive with multi latent attention"),
    (["--global-batch-size", "2047"], None, 64, ONE_SET, "--global-batch-size",
     "global batch size (2047) is not divisible by micro batch size (1) times data parallel size (2)"),
    (["--tokenizer-type", "GPT2BPETokenizer"], None, 64, ONE_SET, "--vocab-file", "assert args.vocab_file is not None"),
    ([], "--tokenizer-model", 64, ONE_SET, "--tokenizer-model", "assert args.tokenizer_model is not None"),
    (["--num-query-groups", "3"], None, 64, ONE_SET, "--num-query-groups",
     "num_query_groups (3) must be a multiple or divisor of tensor_model_parallel_size (8)"),
    (["--padded-vocab-size", "128257"], None, 64, ONE_SET, "--padded-vocab-size", "128257 is not divisible by 8"),
    ([], "--train-iters", 64, ONE_SET, "--train-iters", "either train-iters or train-samples should be provided"),
    ([], "--lr", 64, ONE_SET, "--lr", "float() argument must be a string or a real number, not 'NoneType'"),
    (["--lr-warmup-init", "1.0"], None, 64, ONE_SET, "--lr-warmup-init", "assert self.init_lr <= self.max_lr"),
    (["--lr-warmup-fraction", "1.5"], None, 64, ONE_SET, "--lr-warmup-fraction",
     "assert self.lr_warmup_steps < self.lr_decay_steps"),
    (["--lr-decay-style", "WSD"], None, 64, ONE_SET, "--lr-wsd-decay-iters", "assert self.wsd_decay_steps is not None"),
    ([], "--eval-interval", 64, ONE_SET, "--eval-interval", "unsupported operand type(s) for //: 'int' and 'NoneType'"),
    ([], "--data-path", 64, ONE_SET, "--data-path", "no data source"),
    (["--global-batch-size", "2"], None, 64, ONE_SET, "--global-batch-size",
     "The number of contiguous micro-batches in a virtual pipeline stageshould range in [PP=4 , M=1]"),
]


@pytest.mark.parametrize("extra, dropped, world, env, flag, message", BROKEN,
                         ids=[f"{b[4]}{i}" for i, b in enumerate(BROKEN)])
def test_each_check_megatron_makes_before_step_one_names_its_flag(
        extra: list[str], dropped: str | None, world: int, env: dict[str, str | None], flag: str, message: str,
        mcore) -> None:
    """Each check fails on the launch broken its way, first, in one line: Megatron's own message and a flag to
    change (in the message or in autoplace's fix); a flag given again wins (argparse keeps the last value: the
    launch's "$@" overrides the bundle's)."""
    words = launch_words(INTERLEAVED)
    assert refusal(words, 64, ONE_SET) is None
    words = drop(words, dropped) if dropped else words
    why = refusal([*words, *extra], world, env)
    assert why is not None and message in why and flag in why and "\n" not in why, why


def test_a_word_before_any_flag_and_megatron_fsdp_with_one_connection_are_refused(mcore) -> None:
    assert "unrecognized arguments: pretrain_gpt.py" in (refusal(["pretrain_gpt.py", *launch_words(INTERLEAVED)], 64,
                                                                 ONE_SET) or "")
    fsdp = launch_words("tp=2,zero=3")
    assert refusal(fsdp, 64, {"CUDA_DEVICE_MAX_CONNECTIONS": None}) is None
    assert "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one" in (
        refusal(fsdp, 64, ONE_SET) or "")


@pytest.mark.parametrize("text", ["tp=8,pp=4,vpp=2,zero=1", "tp=4,pp=2,zero=1,layers=36:44,recompute=full",
                                  "tp=2,cp=2,zero=3", "dp_replicate=64,zero=0", "pp=4,zero=1,layers=16:24:24:16"])
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_the_bundles_launch_passes_megatron_every_check_before_step_one(text: str, tmp_path, mcore) -> None:
    """Issue 34: launch_torchrun.sh, run by bash with the required variables set and a stand-in torchrun
    that records its words and environment, hands pretrain_gpt.py words Megatron-LM accepts (every
    check launch_refusal makes), the learning rate and the intervals included."""
    cluster = gpu_cluster(64)
    plan = make_plan(text, LLAMA_70B, cluster)
    emit(plan, LLAMA_70B, cluster, ["megatron", "torchrun"], tmp_path / "bundle")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$RECORD"\n'
                                    'printf "%s" "${CUDA_DEVICE_MAX_CONNECTIONS-unset}" > "$RECORD.env"\n')
    (tools / "torchrun").chmod(0o755)
    record = tmp_path / "words"
    env = {**os.environ, **SAMPLE_ENV, "PATH": f"{tools}:{os.environ['PATH']}", "RECORD": str(record)}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    subprocess.run(["bash", str(tmp_path / "bundle" / "launch_torchrun.sh")], env=env, check=True)
    words = record.read_text().split("\0")[:-1]
    words = words[words.index("pretrain_gpt.py") + 1:]
    connections = (tmp_path / "words.env").read_text()
    assert refusal(words, 64, {"CUDA_DEVICE_MAX_CONNECTIONS": None if connections == "unset" else connections}) is None
    assert {"--lr", "--save-interval", "--eval-interval", "--padded-vocab-size"} <= set(words)


def test_megatron_refuses_an_interleaved_plan_its_schedule_cannot_run() -> None:
    """megatron-core's interleaved 1F1B runs the micro-batches in groups of pp: the plan check (what the
    search and render ask) is the rule, and the message, the dry run's schedule step raises on a launch."""
    model = small_model(batch=32)
    plan = make_plan("pp=4,vpp=2,zero=1", model, CLUSTER16)  # 4 data-parallel ranks: 8 micro-batches
    assert get("megatron").plan_check(model)(plan) is None
    few = plan.replace(grad_accum=2)
    why = get("megatron").plan_check(model)(few)
    assert why == get("megatron").batching_refusal(few) and why is not None
    assert "refuses 2 micro-batch(es) per step on pp=4" in why and "should range in [PP=4 , M=2]" in why
    with pytest.raises(EmitError, match=r"refuses 2 micro-batch\(es\) per step"):
        emit_megatron(few, model, CLUSTER16)
    ragged = plan.replace(grad_accum=6)  # groups of 4, then 2: fewer than pp
    assert "but it is 2. Otherwise" in (get("megatron").batching_refusal(ragged) or "")


def test_the_learning_rate_is_gpt3s_for_the_width_and_the_vocabulary_the_models() -> None:
    """--lr from GPT-3's table (Brown et al. 2020, Table 2.1) by width; --padded-vocab-size is the
    model's vocabulary (Megatron-LM would otherwise size the embedding from len(tokenizer))."""
    from autoplace.frameworks._megatron_args import peak_lr

    assert [peak_lr(h) for h in (256, 768, 4096, 8192, 12288, 16384)] == [6e-4, 6e-4, 1.2e-4, 1e-4, 6e-5, 6e-5]
    words = launch_words("tp=8,zero=1")
    assert (value(words, "--lr"), value(words, "--min-lr"), value(words, "--lr-decay-style")) == (
        "0.0001", "1e-05", "cosine")
    assert value(words, "--padded-vocab-size") == "128256" and "--vocab-size" not in words
    qwen = load_model(HF / "qwen2.5-0.5b.json")
    assert value(launch_words("tp=2,zero=1", qwen, 16), "--padded-vocab-size") == "151936"


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_launch_refusal_answers_any_words_with_a_line_or_none(data: st.DataObject, mcore) -> None:
    """Whatever the words (a user's edited files), one line or None: every step is the dry run's, which reports
    whatever the framework raises as that step's refusal."""
    words = launch_words(INTERLEAVED)
    flags = [w for w in words if w.startswith("--")]
    for _ in range(data.draw(st.integers(1, 4))):
        flag = data.draw(st.sampled_from(flags))
        if data.draw(st.booleans()):
            words = drop(words, flag) if flag in words else words
        else:
            words = [*words, flag, *data.draw(st.lists(st.sampled_from(["0", "-1", "abc", "1e9", "2", "3.5", ""]),
                                                       max_size=2))]
    world = data.draw(st.sampled_from([0, 1, 3, 64]))
    why = refusal(words, world, data.draw(st.sampled_from([None, {}, ONE_SET])))
    assert why is None or (isinstance(why, str) and "\n" not in why and why)


def test_the_gpt3_example_is_megatrons_gpt_with_biases_on_every_linear_layer(mcore) -> None:
    """Issue 36: ``bias: true`` alone meant every linear layer but q/k/v (qkv_bias defaulted to false),
    which Megatron-LM refused for the shipped GPT-3 175B file; qkv_bias now follows bias unless
    stated, and megatron-core builds GPT-3's attention with its q/k/v biases (attention.py:
    ``bias=add_bias_linear or add_qkv_bias``)."""
    from autoplace.frameworks import get

    model, cluster = load_model(REPO / "examples/models/gpt-3-175b.json"), gpu_cluster(64)
    assert model.bias and model.qkv_bias and get("megatron").model_refusal(model) is None
    plan = make_plan("tp=8,pp=8,zero=1", model, cluster)
    words = emit_megatron(plan, model, cluster)
    config, _ = megatron_core_config(words, plan)
    # validate_args keeps add_qkv_bias in step with add_bias_linear (arguments.py:968-970, core_v0.16.1)
    assert config.add_bias_linear and config.add_qkv_bias and "--disable-bias-linear" not in words
