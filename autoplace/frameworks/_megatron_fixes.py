"""The fix autoplace suggests for each refusal a Megatron-LM launch can meet before step 1.

Each rule matches the framework's own message (Megatron-LM's validate_args, megatron-core's
TransformerConfig, micro-batch calculator, scheduler, ...) and says which flag to change, and to
what, from the numbers the message and the launch's arguments give.  One rule per refusal, one
message per rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from autoplace.dryrun.steps import framework_message
from autoplace.frameworks._megatron_flags import option

# a rule's fix may decline (None) a message it matched: the next rule is asked
Rule = tuple[re.Pattern[str], Callable[[re.Match[str], Any], "str | None"]]


def suggest(exc: BaseException, args: Any = None) -> str | None:
    """The fix for ``exc`` (a framework's refusal, as the dry run shows it: a bare assert by its source line),
    given the parsed arguments when there are any."""
    text = framework_message(exc)
    for pattern, fix in _RULES:
        found = pattern.search(text)
        fixed = fix(found, args) if found else None
        if fixed:
            return fixed
    return None


def _batch(m: re.Match[str], args: Any) -> str:
    gbs, mbs, dp = (int(m.group(i)) for i in (1, 2, 3))
    per_step = mbs * dp
    lower, upper = gbs // per_step * per_step, -(-gbs // per_step) * per_step
    micro = [d for d in _divisors(gbs // dp) if d <= 2 * mbs][-3:] if gbs % dp == 0 else []
    fixes = [f"--global-batch-size to a multiple of {per_step} ({', '.join(str(b) for b in (lower, upper) if b)})"]
    if micro:
        fixes.insert(0, f"--micro-batch-size to a divisor of {gbs // dp} ({', '.join(map(str, micro))})")
    return (f"--global-batch-size {gbs} is not divisible by micro-batch {mbs} x dp {dp}: set "
            + " or ".join(fixes))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n <= 1 << 16 else [1]


def _world(m: re.Match[str], args: Any) -> str:
    world, size = int(m.group(1)), int(m.group(2))
    nodes = f" or run on a multiple of {size} GPUs (the next: {math.ceil(world / size) * size})"
    return (f"tp x pp x cp = {size} does not divide the {world} ranks: change --tensor-model-parallel-size, "
            f"--pipeline-model-parallel-size or --context-parallel-size so their product divides {world}{nodes}")


def _layers_per_stage(m: re.Match[str], args: Any) -> str:
    layers, pp = getattr(args, "num_layers", None), getattr(args, "pipeline_model_parallel_size", None)
    what = f"--num-layers {layers} over {pp} stages" if layers and pp else "the layers over the stages"
    return (f"{what} do not split evenly: give the uneven split with --decoder-first-pipeline-num-layers and "
            "--decoder-last-pipeline-num-layers (the middle stages share the rest equally), or "
            "--pipeline-model-parallel-layout")


def _experts(m: re.Match[str], args: Any) -> str:
    experts, ep = getattr(args, "num_experts", None), getattr(args, "expert_model_parallel_size", None)
    valid = [d for d in _divisors(experts or 1) if d <= (ep or 1) * 2] if experts else []
    return (f"--expert-model-parallel-size {ep} must divide --num-experts {experts}"
            + (f": use one of {', '.join(map(str, valid))}" if valid else ""))


def _heads(m: re.Match[str], args: Any) -> str:
    what, count, tp = m.group(1), int(m.group(2)), int(m.group(3))
    flag = "--num-query-groups" if what == "num_query_groups" else "--num-attention-heads"
    valid = [d for d in _divisors(count) if d <= max(tp, 8)]
    return (f"--tensor-model-parallel-size {tp} must divide {flag} {count} (the heads are split over the TP "
            f"ranks): use tp {' or '.join(map(str, valid[-3:]))}")


def _vocab_rows(m: re.Match[str], args: Any) -> str | None:
    rows, tp = getattr(args, "padded_vocab_size", None), getattr(args, "tensor_model_parallel_size", None)
    if rows != int(m.group(1)) or tp != int(m.group(2)):
        return None  # megatron-core's divide() refusing something else
    return (f"--padded-vocab-size {rows} rows do not split over --tensor-model-parallel-size {tp}: pad them to a "
            f"multiple of {tp} ({-(-rows // tp) * tp})")


def _required(m: re.Match[str], args: Any) -> str | None:
    flag = option(m.group(1))
    return f"add {flag}: Megatron-LM has no default for it" if flag else None


# a missing --lr: the optimizer (torch's Adam compares it with 0) or OptimizerParamScheduler (float(None)) refuses
NO_LR = "add --lr (the peak learning rate, e.g. --lr 3e-4): Megatron-LM has no default learning rate"


def eval_fix(exc: BaseException, args: Any = None) -> str | None:
    """The dataset sizes' fix: a missing --eval-interval (train_iters // None), else the general rules."""
    if args is not None and getattr(args, "eval_interval", 0) is None:
        return ("add --eval-interval N (steps between evaluations): the validation set is sized from it; or "
                "--full-validation")
    return suggest(exc, args)


def lr_fix(exc: BaseException, args: Any = None) -> str | None:
    """The optimizer and scheduler steps' fix: a missing --lr, else the general rules."""
    if args is not None and getattr(args, "lr", 0) is None:
        return NO_LR
    return suggest(exc, args)


def _fixed(text: str) -> Callable[[re.Match[str], Any], str]:
    return lambda m, args: text


_RULES: Sequence[Rule] = [(re.compile(p), f) for p, f in [
    (r"global batch size \((\d+)\) is not divisible by micro batch size \((\d+)\) times data parallel size "
     r"\((\d+)\)", _batch),
    (r"world size \((\d+)\) is not divisible by total_model_size \(total_model_size=(\d+)\)", _world),
    (r"assert args\.save_interval (?:is not None|> 0)", _fixed(
        "add --save-interval N > 0 (steps between checkpoints): Megatron-LM requires it whenever --save is given")),
    (r"either train-iters or train-samples should be provided", _fixed(
        "add --train-iters N (or --train-samples N): the learning-rate schedule is sized from it")),
    (r"require setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1", _fixed(
        "export CUDA_DEVICE_MAX_CONNECTIONS=1 in the launch (tensor and context parallelism overlap their "
        "communication on one stream before Blackwell)")),
    (r"FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS", _fixed(
        "unset CUDA_DEVICE_MAX_CONNECTIONS (or set it above 1) in the launch: Megatron-FSDP needs parallel streams")),
    (r"[Nn]umber of layers should be divisible by the pipeline-model-parallel size|"
     r"number of layers at middle stage|number of layers of the model must be divisible", _layers_per_stage),
    (r"Number of experts should be a multiple of expert model parallel_size", _experts),
    (r"num_experts must be non None to use expert model parallelism", _fixed(
        "set --expert-model-parallel-size 1: the model has no experts (--num-experts) to spread")),
    (r"(num_query_groups|num_attention_heads) \((\d+)\) must be a multiple (?:or divisor )?of "
     r"tensor_model_parallel_size \((\d+)\)", _heads),
    (r"seq-length should be a multiple of 2 \* context-parallel-size", _fixed(
        "--seq-length must be a multiple of 2 x --context-parallel-size (its load-balanced chunks): change one")),
    (r"pipeline-model-parallel size should be greater than 2", _fixed(
        "the interleaved schedule needs --pipeline-model-parallel-size above 2 without p2p overlap: drop "
        "--no-overlap-p2p-communication, the virtual stages or use more pipeline stages")),
    (r"number of contiguous micro-batches in a virtual pipeline stage|remainder of M", _fixed(
        "the interleaved schedule wants the micro-batches per step (global batch / (micro-batch x dp)) to be a "
        "multiple of --pipeline-model-parallel-size, and at least as many: raise --global-batch-size or lower "
        "--micro-batch-size")),
    (r"unrecognized arguments: (\S+)", lambda m, args: (
        f"remove {m.group(1)}: Megatron-LM core_v0.16.1's pretrain_gpt.py has no such flag")),
    (r"Tensor parallel communication/GEMM overlap can happen only when sequence parallelism", _fixed(
        "add --sequence-parallel (or drop --tp-comm-overlap)")),
    (r"--overlap-param-gather only supported with distributed optimizer", _fixed(
        "add --use-distributed-optimizer (or drop --overlap-param-gather)")),
    (r"Must use --overlap-param-gather with --overlap-grad-reduce", _fixed("add --overlap-grad-reduce")),
    (r"Megatron FSDP only supports fsdp_dtensor", _fixed("add --ckpt-format fsdp_dtensor")),
    (r"max_position_embeddings \((\d+)\) must be greater than or equal to seq_length \((\d+)\)", lambda m, args: (
        f"raise --max-position-embeddings to at least {m.group(2)} or lower --seq-length to {m.group(1)}")),
    (r"number of layers per pipeline stage must be divisible number of layers per virtual", _fixed(
        "--num-layers-per-virtual-pipeline-stage must divide the layers of each pipeline stage (or give "
        "--num-virtual-stages-per-pipeline-rank)")),
    (r"assert not args\.(?:bf16|fp16)$", _fixed("give one of --bf16 and --fp16")),
    (r"expected (?:iteration|sample)-based training", _fixed("give one of --train-iters and --train-samples")),
    (r"assert args\.hidden_size % args\.num_attention_heads == 0", _fixed(
        "--num-attention-heads does not divide --hidden-size: give the head size with --kv-channels, or a head "
        "count that divides the width")),
    (r"assert args\.min_lr <= args\.lr", _fixed("lower --min-lr to at most --lr (the decay's floor)")),
    (r"recompute method is not yet supported for selective", _fixed(
        "drop --recompute-method (selective recompute has none), or use --recompute-granularity full")),
    (r"A single data source must be provided", _fixed(
        "give one data source: --data-path, --mock-data, or --train-data-path / --valid-data-path / "
        "--test-data-path")),
    (r"optimizer cpu offload must be used in conjunction with", _fixed(
        "add --use-precision-aware-optimizer (or drop --optimizer-cpu-offload)")),
    (r"Multi-Token Prediction \(MTP\) is not supported with", _fixed(
        "--mtp-num-layers needs --position-embedding-type rope or none")),
    (r"Group query attention is mutually exclusive with multi latent", _fixed(
        "drop --group-query-attention: --multi-latent-attention compresses the keys and values instead")),
    (r"(\d+) is not divisible by (\d+)", _vocab_rows),
    (r"assert self\.init_lr <= self\.max_lr", _fixed("lower --lr-warmup-init to at most --lr")),
    (r"assert self\.lr_warmup_steps < self\.lr_decay_steps", _fixed(
        "end the warmup (--lr-warmup-fraction below 1, or --lr-warmup-iters) before the decay does "
        "(--lr-decay-iters, by default --train-iters)")),
    (r"assert self\.wsd_decay_steps is not None", _fixed(
        "add --lr-wsd-decay-iters N (or --lr-wsd-decay-samples) with --lr-decay-style WSD")),
    (r"assert args\.encoder_seq_length is not None", _fixed("add --seq-length (the training sequence length)")),
    # the general forms last: a flag without a value
    (r"assert args\.(\w+) is not None", _required),
    (r"(\w+) argument is None", _required),
]]
