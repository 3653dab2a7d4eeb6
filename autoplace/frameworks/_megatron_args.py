"""Megatron-LM's launch arguments beyond the plan: what a run needs besides the plan to reach its
first step (learning rate, intervals, split), and the micro-batch rule of megatron-core's interleaved
schedule, which the search asks of every plan.  Torch-free: ``autoplace solve`` imports it.

Megatron-LM's checks of a launch's words are restated once, in :mod:`._megatron_validate`
(validate_args) and :mod:`._megatron_dry` (what follows it before step 1).
"""

from __future__ import annotations

import bisect

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


# ---------------------------------------------------------------- the interleaved schedule's micro-batches


def interleaved_refusal(micro_batches: int, pp: int, group: int | None = None) -> Exception | None:
    """megatron-core 0.16.1's interleaved 1F1B refusing ``micro_batches`` per step on ``pp`` stages, as the
    exception it raises, message and all (restated from pipeline_parallel/schedules.py:995-1015, which raises
    before the first micro-batch); None when it runs them.  It runs them in groups of
    ``microbatch_group_size_per_vp_stage`` (default pp, ModelParallelConfig.__post_init__), which must lie in
    [pp, micro-batches], the last group whole or at least pp."""
    group = pp if group is None else group
    if group > micro_batches or group < pp:
        return ValueError("The number of contiguous micro-batches in a virtual pipeline stage"
                          f"should range in [PP={pp} , M={micro_batches}]")
    rest = micro_batches % group
    if 0 < rest < pp:
        return RuntimeError("The remainder of M (the total micro-batches) divided by N (number of contiguous "
                            "micro-batches in a virtual pipeline stage) should be 0, or larger than or equal to the "
                            f"pipeline-parallel size, but it is {rest}. Otherwise, it introduces dependency bubbles "
                            "in the pipeline and reduces throughput.")
    return None
