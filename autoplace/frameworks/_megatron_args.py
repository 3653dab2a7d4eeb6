"""Megatron-LM's launch arguments: what a run needs besides the plan to reach its first step, and
every check those arguments meet before that step, restated without Megatron's code.

Megatron-LM is not on PyPI, so its ``parse_args`` / ``validate_args`` cannot run here; these are
restated, each with its line, from Megatron-LM core_v0.16.1 (``git show core_v0.16.1:PATH`` in
NVIDIA/Megatron-LM): ``megatron/training/arguments.py`` (cited as ``arguments.py:N``),
``megatron/training/training.py``, ``megatron/training/tokenizer/tokenizer.py`` and ``pretrain_gpt.py``,
and from the megatron-core 0.16.1 code they call before step 1 (``megatron/core/...``, installed).
:func:`validate` is pure and fast: ``tests/test_emit_megatron.py`` runs it on every emitted launch
(and megatron-core's own config classes on what it builds), and ``autoplace dryrun`` may call it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

# ---------------------------------------------------------------- what a run needs besides the plan

# GPT-3's learning rates by model width (Brown et al. 2020, Table 2.1: d_model -> lr), decayed by a
# cosine to 10% of the peak; Megatron-LM's own GPT-3 175B example uses the 12288 row (6e-5 -> 6e-6)
GPT3_LR = ((768, 6.0e-4), (1024, 3.0e-4), (1536, 2.5e-4), (2048, 2.0e-4), (2560, 1.6e-4), (4096, 1.2e-4),
           (5140, 1.0e-4), (12288, 0.6e-4))
WARMUP_FRACTION = 0.001  # Megatron-LM's examples/gpt3 (GPT-3: 375M warmup tokens of 300B, 0.00125)
# Megatron-LM's examples (gpt3, mixtral: --eval-interval 1000 --eval-iters 10; llama3: --save-interval 1000)
SAVE_INTERVAL, EVAL_INTERVAL, EVAL_ITERS = 1000, 1000, 10
SPLIT = "969,30,1"  # what validate_args sets when --data-path comes without --split (arguments.py:468-472)


def peak_lr(hidden: int) -> float:
    """The learning rate GPT-3 trained a model of width ``hidden`` with (the widest row at or
    below it; the narrowest row's below 768)."""
    widths = [width for width, _ in GPT3_LR]
    return GPT3_LR[max(bisect.bisect_right(widths, hidden) - 1, 0)][1]


def run_args(hidden: int) -> list[str]:
    """The arguments a Megatron-LM run of a model of width ``hidden`` needs besides its plan, at
    defaults a user overrides by passing the flag again after them (argparse keeps the last value).

    ``--lr`` (default None: the LR scheduler takes float(None)) with cosine decay to a tenth and a
    short warmup; ``--save-interval`` (validate_args asserts it with ``--save``); ``--eval-interval``
    (default None: the validation set's size divides by it, training.py:3307) and ``--eval-iters``
    (default 100 steps of the global batch each time); ``--split`` stated.
    """
    lr = peak_lr(hidden)
    return ["--lr", repr(lr), "--min-lr", repr(lr / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-fraction", repr(WARMUP_FRACTION), "--save-interval", str(SAVE_INTERVAL),
            "--eval-interval", str(EVAL_INTERVAL), "--eval-iters", str(EVAL_ITERS), "--split", SPLIT]


# ---------------------------------------------------------------- reading the words

_INT = frozenset({
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--micro-batch-size", "--global-batch-size", "--num-layers", "--hidden-size",
    "--ffn-hidden-size", "--num-attention-heads", "--kv-channels", "--seq-length", "--max-position-embeddings",
    "--num-query-groups", "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--recompute-num-layers",
    "--num-distributed-optimizer-instances", "--train-iters", "--train-samples", "--save-interval",
    "--eval-interval", "--eval-iters", "--padded-vocab-size", "--vocab-size", "--make-vocab-size-divisible-by",
    "--rotary-base", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--lr-warmup-iters",
    "--lr-warmup-samples", "--lr-decay-iters", "--lr-decay-samples", "--lr-wsd-decay-iters", "--mtp-num-layers",
    "--microbatch-group-size-per-virtual-pipeline-stage"})
_FLOAT = frozenset({"--lr", "--min-lr", "--lr-warmup-fraction", "--lr-warmup-init", "--norm-epsilon",
                    "--rotary-percent", "--attention-dropout", "--hidden-dropout"})
_CHOICES = {  # argparse choices (arguments.py) and the Literal fields its dataclass groups turn into choices
    "--position-embedding-type": ("learned_absolute", "rope", "mrope", "relative", "none"),
    "--normalization": ("LayerNorm", "RMSNorm"), "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--lr-decay-style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "--ckpt-format": ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--tokenizer-type": ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                         "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                         "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"),
}
_NARGS = frozenset({"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"})  # nargs='*'


class Refusal(Exception):
    """A check the words fail, as the one line :func:`validate` returns."""


def flag_values(words: Sequence[str]) -> dict[str, list[str]]:
    """``--flag value ...`` words as flag -> its values (a switch has none; a repeated flag keeps the
    last, as argparse does).

    Raises:
        Refusal: a word before the first flag.
    """
    flags: dict[str, list[str]] = {}
    current: list[str] | None = None
    for word in words:
        if word.startswith("--"):
            current = flags[word] = []
        elif current is None:
            raise Refusal(f"{word}: expected a --flag first")
        else:
            current.append(word)
    return flags


class Args:
    """The launch's flags, each value checked against Megatron-LM's type or choices on reading
    (argparse's own errors, restated); the accessors give a flag's value or a default."""

    def __init__(self, words: Sequence[str]) -> None:
        self.flags = flag_values(words)
        for flag, values in self.flags.items():
            self._typed(flag, values)

    def _typed(self, flag: str, values: list[str]) -> None:
        kind = int if flag in _INT else float if flag in _FLOAT else None
        if flag in _NARGS:
            return
        if (kind or flag in _CHOICES) and len(values) != 1:
            raise Refusal(f"{flag}: expected one value, got {len(values)}")
        if kind is not None:
            try:
                kind(values[0])
            except ValueError:
                raise Refusal(f"{flag}: invalid {kind.__name__} value {values[0]!r}") from None
        if flag in _CHOICES and values[0] not in _CHOICES[flag]:
            raise Refusal(f"{flag}: {values[0]!r} is not one of {', '.join(_CHOICES[flag])}")

    def given(self, flag: str) -> bool:
        return flag in self.flags

    def text(self, flag: str, default: str | None = None) -> str | None:
        """A flag's (first) value, or ``default``."""
        values = self.flags.get(flag)
        return values[0] if values else default

    def whole(self, flag: str, default: int) -> int:
        """An integer flag's value (checked on reading), or ``default``."""
        value = self.text(flag)
        return default if value is None else int(value)

    def number(self, flag: str, default: float) -> float:
        """A numeric flag's value (checked on reading), or ``default``."""
        value = self.text(flag)
        return default if value is None else float(value)


# ---------------------------------------------------------------- the checks, in the order Megatron-LM runs them

Env = Mapping[str, "str | None"]
Check = Callable[[Args, int, "Env | None"], None]


def _refuse(ok: bool, flag: str, message: str) -> None:
    """Raise the Refusal "flag: message" unless ``ok``."""
    if not ok:
        raise Refusal(f"{flag}: {message}")


def degrees(a: Args) -> tuple[int, int, int, int]:
    """(tp, pp, cp, ep), each at least 1."""
    flags = [f"--{name}-parallel-size" for name in ("tensor-model", "pipeline-model", "context", "expert-model")]
    for flag in flags:
        _refuse(a.whole(flag, 1) >= 1, flag, f"must be at least 1, got {a.whole(flag, 1)}")
    tp, pp, cp, ep = (a.whole(flag, 1) for flag in flags)
    return tp, pp, cp, ep


def _world(a: Args, world: int, env: Env | None) -> None:
    tp, pp, cp, _ = degrees(a)
    _refuse(world >= 1, "world size", f"must be at least 1, got {world}")
    _refuse(world % (tp * pp * cp) == 0, "--tensor-model-parallel-size",
            f"tp({tp}) x pp({pp}) x cp({cp}) = {tp * pp * cp} does not divide the world size {world} (arguments.py:317)")


def _micro_batch(a: Args, world: int, env: Env | None) -> None:
    _refuse(a.whole("--micro-batch-size", 0) > 0, "--micro-batch-size",
            "required, a whole number > 0 (arguments.py:495-496)")
    _refuse(a.whole("--global-batch-size", 1) > 0, "--global-batch-size", "must be > 0 (arguments.py:500)")


def _micro_batches(a: Args, world: int, env: Env | None) -> None:
    tp, pp, cp, _ = degrees(a)
    mbs, dp = a.whole("--micro-batch-size", 1), world // (tp * pp * cp)
    batch = a.whole("--global-batch-size", mbs * dp)
    _refuse(batch % (mbs * dp) == 0, "--global-batch-size",
            f"{batch} is not a multiple of micro-batch {mbs} x data parallel {dp} (megatron-core "
            "num_microbatches_calculator.py:340)")


def virtual_stages(a: Args) -> int:
    """Model chunks per pipeline rank, as validate_args derives them (arguments.py:514-560; a layout's
    stages counted by its "|", as autoplace writes them)."""
    pp, layers = degrees(a)[1], a.whole("--num-layers", 0)
    if a.given("--pipeline-model-parallel-layout"):
        return len(str(a.text("--pipeline-model-parallel-layout")).split("|")) // pp
    if a.given("--num-virtual-stages-per-pipeline-rank"):
        return a.whole("--num-virtual-stages-per-pipeline-rank", 1)
    per = a.whole("--num-layers-per-virtual-pipeline-stage", 0)
    return layers // pp // per if per else 1


def _pipeline(a: Args, world: int, env: Env | None) -> None:
    _, pp, _, _ = degrees(a)
    ways = [f for f in ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                        "--pipeline-model-parallel-layout") if a.given(f)]
    _refuse(len(ways) <= 1, ways[-1] if ways else "", f"give only one of {', '.join(ways)} (arguments.py:503-512)")
    layers = a.whole("--num-layers", 0)
    uneven = a.given("--decoder-first-pipeline-num-layers") or a.given("--decoder-last-pipeline-num-layers")
    if a.given("--pipeline-model-parallel-layout"):
        stages = len(str(a.text("--pipeline-model-parallel-layout")).split("|"))
        _refuse(stages % pp == 0, "--pipeline-model-parallel-layout",
                f"{stages} stages do not divide over pp={pp} (arguments.py:517-523)")
    elif a.given("--num-layers-per-virtual-pipeline-stage"):
        per = a.whole("--num-layers-per-virtual-pipeline-stage", 1)
        _refuse(not uneven, "--num-layers-per-virtual-pipeline-stage",
                "not with --decoder-first/last-pipeline-num-layers (arguments.py:529-531)")
        _refuse(layers % pp == 0 and per > 0 and (layers // pp) % per == 0, "--num-layers-per-virtual-pipeline-stage",
                f"{layers} layers do not split into {pp} stages of chunks of {per} (arguments.py:543-548)")
    elif not uneven:
        _refuse(layers % pp == 0, "--pipeline-model-parallel-size",
                f"{layers} layers do not split evenly over pp={pp}; give --decoder-first/last-pipeline-num-layers "
                "or a layout (arguments.py:570-571)")
    if virtual_stages(a) > 1:
        least = 1 if not a.given("--no-overlap-p2p-communication") else 2
        _refuse(pp > least, "--pipeline-model-parallel-size",
                f"the interleaved schedule needs pp > {least} (arguments.py:574-582)")


def _overlap(a: Args, world: int, env: Env | None) -> None:
    if a.given("--overlap-param-gather"):
        _refuse(a.given("--use-distributed-optimizer") or a.given("--use-megatron-fsdp"), "--overlap-param-gather",
                "needs --use-distributed-optimizer or --use-megatron-fsdp (arguments.py:598-599)")
        _refuse(a.given("--overlap-grad-reduce"), "--overlap-param-gather",
                "needs --overlap-grad-reduce (arguments.py:600-601)")


def _fsdp(a: Args, world: int, env: Env | None) -> None:
    fmt = a.text("--ckpt-format", "torch_dist")
    if a.given("--use-megatron-fsdp"):
        _refuse(env is None or env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1", "--use-megatron-fsdp",
                "Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (arguments.py:687-688)")
        _refuse(fmt == "fsdp_dtensor", "--ckpt-format", f"Megatron-FSDP needs fsdp_dtensor, got {fmt} "
                                                       "(arguments.py:690-691)")
    _refuse(fmt != "fsdp_dtensor" or a.given("--use-megatron-fsdp"), "--ckpt-format",
            "fsdp_dtensor needs --use-megatron-fsdp (arguments.py:1049-1050)")
    _refuse(not (a.given("--fp16") and a.given("--bf16")), "--bf16", "not with --fp16 (arguments.py:703, 712)")


def _iterations(a: Args, world: int, env: Env | None) -> None:
    _refuse(not (a.whole("--train-iters", 0) and a.whole("--train-samples", 0)), "--train-samples",
            "not with --train-iters (arguments.py:758-776)")


def _shape(a: Args, world: int, env: Env | None) -> None:
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--max-position-embeddings",
                 "--seq-length"):  # arguments.py:796-799, and 822-827 for --seq-length
        _refuse(a.given(flag), flag, "required (arguments.py:796-827)")
    hidden, heads = a.whole("--hidden-size", 0), a.whole("--num-attention-heads", 1)
    _refuse(heads >= 1, "--num-attention-heads", f"must be at least 1, got {heads}")
    _refuse(a.given("--kv-channels") or hidden % heads == 0, "--num-attention-heads",
            f"{heads} heads do not divide hidden {hidden}; give --kv-channels (arguments.py:813-814)")
    _, _, cp, _ = degrees(a)
    seq = a.whole("--seq-length", 0)
    _refuse(cp == 1 or seq % (2 * cp) == 0, "--seq-length",
            f"{seq} is not a multiple of 2 x cp = {2 * cp} (arguments.py:817-820)")
    positions = a.whole("--max-position-embeddings", 0)
    _refuse(positions >= seq, "--max-position-embeddings",
            f"{positions} is below --seq-length {seq} (arguments.py:829-832)")


def _lr_bounds(a: Args, world: int, env: Env | None) -> None:
    if a.given("--lr"):
        lr, low = a.number("--lr", 0.0), a.number("--min-lr", 0.0)
        _refuse(low <= lr, "--min-lr", f"{low} must not exceed --lr {lr} (arguments.py:835-836)")


def _learning_rate(a: Args, world: int, env: Env | None) -> None:
    """get_optimizer_param_scheduler (training.py:1354-1405) and megatron-core's
    OptimizerParamScheduler (optimizer_param_scheduler.py:145-159)."""
    _refuse(a.whole("--train-iters", 0) > 0 or a.whole("--train-samples", 0) > 0, "--train-iters",
            "required (or --train-samples), > 0: the LR schedule's length (training.py:1386-1387)")
    _refuse(a.given("--lr"), "--lr", "required: OptimizerParamScheduler takes float(max_lr), and the default is "
                                     "None (training.py:1392)")
    lr, low = a.number("--lr", 0.0), a.number("--min-lr", 0.0)
    _refuse(low >= 0, "--min-lr", f"must be >= 0, got {low} (optimizer_param_scheduler.py:146)")
    _refuse(a.number("--lr-warmup-init", 0.0) <= lr, "--lr-warmup-init",
            f"must not exceed --lr {lr} (optimizer_param_scheduler.py:148)")
    steps = a.whole("--lr-decay-iters", a.whole("--train-iters", 0)) or a.whole("--lr-decay-samples",
                                                                         a.whole("--train-samples", 0))
    _refuse(steps > 0, "--lr-decay-iters", "the LR decay must last at least one step")
    fraction = a.given("--lr-warmup-fraction")
    warmup = steps * a.number("--lr-warmup-fraction", 0.0) if fraction else a.whole("--lr-warmup-iters", 0) or a.whole(
        "--lr-warmup-samples", 0)
    _refuse(warmup < steps, "--lr-warmup-fraction" if fraction else "--lr-warmup-iters",
            "the warmup must end before the LR decay does (optimizer_param_scheduler.py:156)")
    _refuse(a.text("--lr-decay-style") != "WSD" or a.given("--lr-wsd-decay-iters") or a.given("--lr-wsd-decay-samples"),
            "--lr-wsd-decay-iters", "required with --lr-decay-style WSD (optimizer_param_scheduler.py:158-159)")


def _checkpoints(a: Args, world: int, env: Env | None) -> None:
    if a.given("--save"):
        _refuse(a.whole("--save-interval", 0) > 0, "--save-interval",
                "required with --save, a whole number > 0 (arguments.py:837-839)")


def _evaluation(a: Args, world: int, env: Env | None) -> None:
    _refuse(a.whole("--eval-interval", 0) > 0 or a.given("--full-validation") or a.given("--skip-train"),
            "--eval-interval", "required, > 0: the validation set is sized train_iters // eval_interval "
                               "(training.py:3307)")


def _recompute(a: Args, world: int, env: Env | None) -> None:
    if a.text("--recompute-granularity") == "selective":
        _refuse(not a.given("--recompute-method"), "--recompute-method",
                "not with --recompute-granularity selective (arguments.py:899-902)")


def _tensor_parallel(a: Args, world: int, env: Env | None) -> None:
    tp, _, cp, _ = degrees(a)
    if a.given("--tp-comm-overlap"):  # validate_args turns sequence parallelism off at tp=1 (arguments.py:907-913)
        _refuse(tp > 1 and a.given("--sequence-parallel"), "--tp-comm-overlap",
                "needs --sequence-parallel with tp > 1 (arguments.py:915-916)")
    if env is not None and (tp > 1 or cp > 1) and not a.given("--use-megatron-fsdp"):  # before Blackwell
        _refuse(env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "CUDA_DEVICE_MAX_CONNECTIONS",
                "must be 1 with tensor or context parallelism (arguments.py:951-953)")


def _experts(a: Args, world: int, env: Env | None) -> None:
    _, _, _, ep = degrees(a)
    if ep > 1:
        experts = a.whole("--num-experts", 0)
        _refuse(experts > 0 and experts % ep == 0, "--expert-model-parallel-size",
                f"ep={ep} must divide --num-experts {experts or 'none'} (arguments.py:1025-1028)")


def _sources(a: Args) -> int:
    return sum([a.given("--mock-data"), bool(a.flags.get("--data-path")),
                any(a.flags.get(f) for f in ("--train-data-path", "--valid-data-path", "--test-data-path"))])


def _data_source(a: Args, world: int, env: Env | None) -> None:
    _refuse(_sources(a) <= 1, "--data-path", "one data source: --data-path, --mock-data or --train-data-path "
                                             "(arguments.py:1052-1056)")


def _data(a: Args, world: int, env: Env | None) -> None:
    _refuse(_sources(a) == 1, "--data-path", "required (or --mock-data): pretrain_gpt.py builds its training set "
                                             "from it (train_valid_test_datasets_provider)")


def _tokenizer(a: Args, world: int, env: Env | None) -> None:
    """build_tokenizer (megatron/training/tokenizer/tokenizer.py:21-110); pretrain_gpt.py's default
    tokenizer type is GPT2BPETokenizer."""
    kind = str(a.text("--tokenizer-type", "GPT2BPETokenizer"))
    needs = {"GPT2BPETokenizer": ("--vocab-file", "--merge-file"), "BertWordPieceLowerCase": ("--vocab-file",),
             "BertWordPieceCase": ("--vocab-file",), "NullTokenizer": ("--vocab-size",)}.get(
        kind, ("--tokenizer-model",))
    for flag in needs:
        _refuse(a.given(flag), flag, f"required by --tokenizer-type {kind} (tokenizer.py build_tokenizer)")


def _vocabulary(a: Args, world: int, env: Env | None) -> None:
    tp, _, _, _ = degrees(a)
    if a.given("--padded-vocab-size"):  # VocabParallelEmbedding splits the rows over TP (tensor_parallel/utils.py:118)
        rows = a.whole("--padded-vocab-size", 0)
        _refuse(rows > 0 and rows % tp == 0, "--padded-vocab-size", f"{rows} rows do not split over tp={tp}")


def _attention(a: Args, world: int, env: Env | None) -> None:
    """megatron-core's Attention.__init__ (transformer/attention.py:289-302) and arguments.py:1265-1266."""
    tp, _, _, _ = degrees(a)
    heads = a.whole("--num-attention-heads", 1)
    if a.given("--multi-latent-attention"):
        _refuse(not a.given("--group-query-attention"), "--group-query-attention", "not with --multi-latent-attention "
                                                                                   "(arguments.py:1265-1266)")
    groups = a.whole("--num-query-groups", heads) if a.given("--group-query-attention") else heads
    _refuse(groups >= 1, "--num-query-groups", f"must be at least 1, got {groups}")
    if groups < tp:
        _refuse(heads % groups == 0, "--num-query-groups", f"{groups} groups do not divide {heads} heads")
    else:
        _refuse(groups % tp == 0 and heads % tp == 0, "--tensor-model-parallel-size",
                f"tp={tp} must divide the {heads} heads and {groups} query groups")


def _extras(a: Args, world: int, env: Env | None) -> None:
    if a.given("--optimizer-cpu-offload"):
        _refuse(a.given("--use-precision-aware-optimizer"), "--optimizer-cpu-offload",
                "needs --use-precision-aware-optimizer (arguments.py:1190-1192)")
    if a.whole("--mtp-num-layers", 0):
        kind = a.text("--position-embedding-type", "learned_absolute")
        _refuse(kind in ("rope", "none"), "--mtp-num-layers", f"needs rope or no positions, got {kind} "
                                                             "(arguments.py:1229-1233)")


def interleaved_refusal(micro_batches: int, pp: int, group: int | None = None) -> str | None:
    """Why megatron-core 0.16.1's interleaved 1F1B (pipeline_parallel/schedules.py:997-1015) refuses
    ``micro_batches`` per step on ``pp`` stages, or None: it runs them in groups of
    ``microbatch_group_size_per_vp_stage`` (default pp, ModelParallelConfig.__post_init__), which
    must lie in [pp, micro-batches], the last group whole or at least pp."""
    group = pp if group is None else group
    if group < pp or group > micro_batches or 0 < micro_batches % group < pp:
        return (f"the interleaved schedule runs {micro_batches} micro-batch(es) per step in groups of {group} on "
                f"pp={pp}: it needs at least pp of them and whole groups (a multiple of pp)")
    return None


def _schedule(a: Args, world: int, env: Env | None) -> None:
    tp, pp, cp, _ = degrees(a)
    if pp > 1 and virtual_stages(a) > 1:
        mbs = a.whole("--micro-batch-size", 1)
        micro = a.whole("--global-batch-size", mbs) // (mbs * (world // (tp * pp * cp)))
        why = interleaved_refusal(micro, pp, a.whole("--microbatch-group-size-per-virtual-pipeline-stage", pp))
        _refuse(why is None, "--global-batch-size", why or "")


# Megatron-LM's order: validate_args, then set_global_variables (the micro-batch calculator, the tokenizer),
# the model (attention, embedding), the LR scheduler, the datasets, and the first step's schedule
CHECKS: tuple[Check, ...] = (_world, _micro_batch, _pipeline, _overlap, _fsdp, _iterations, _shape, _lr_bounds,
                             _checkpoints, _recompute, _tensor_parallel, _experts, _data_source, _extras,
                             _micro_batches, _tokenizer, _attention, _vocabulary, _learning_rate, _evaluation, _data,
                             _schedule)


def validate(words: Sequence[str], world: int, env: Env | None = None) -> str | None:
    """The first check Megatron-LM (core_v0.16.1) would fail, before its first step, on a launch that
    passes ``words`` to ``pretrain_gpt.py`` on ``world`` ranks: one line naming the flag, or None.

    Args:
        words: the argument words after ``pretrain_gpt.py``, as bash hands them over.
        world: the number of ranks.
        env: the launch's environment (CUDA_DEVICE_MAX_CONNECTIONS, None = unset); None skips its checks.
    """
    try:
        args = Args(words)
        for check in CHECKS:
            check(args, world, env)
    except Refusal as exc:
        return str(exc)
    return None
