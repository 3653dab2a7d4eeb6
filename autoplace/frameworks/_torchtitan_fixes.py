"""What a user can change when torchtitan refuses a bundle: autoplace's fix for each error its dry run can
hit (:mod:`autoplace.frameworks._torchtitan_dry`), naming the TOML key or launch word and the value to give.

Each takes the exception and what it needs of the job; None when autoplace knows no fix for it.
"""

from __future__ import annotations

import re
from typing import Any

from autoplace.dryrun.steps import DryContext


def config_fix(exc: BaseException) -> str | None:
    """ConfigManager refused the words: a list option in two words, an option torchtitan lacks, no TOML."""
    text = str(exc)
    unknown = re.search(r"Unrecognized options: (.+)", text)
    if unknown and not unknown.group(1).startswith("--"):
        return ("a list option takes one comma-joined word in torchtitan 0.2.2 (--compile.components model,loss): "
                f"join {unknown.group(1).strip()} to the word before it with commas")
    if unknown:
        return f"remove {unknown.group(1).split(',')[0].strip()}: torchtitan 0.2.2 has no such option " \
               "(python -m torchtitan.train --help lists them)"
    if isinstance(exc, FileNotFoundError):
        return "pass --job.config_file an existing TOML (the bundle's torchtitan.toml)"
    return None


def degrees_fix(exc: BaseException, job: Any, world: int) -> str | None:
    """ParallelDims refused the degrees: the data-parallel shard degree that makes their product the world."""
    p = job.parallelism
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree \
        * p.pipeline_parallel_degree
    if "Invalid parallel dims" not in str(exc):
        return None
    if world % others == 0:
        return (f"set [parallelism] data_parallel_shard_degree = {world // others} (or -1): the degrees' product "
                f"must be the world of {world} ranks")
    return (f"the other degrees multiply to {others}, which does not divide the world of {world} ranks: change "
            "them, or launch a world they divide")


def flavor_fix(exc: BaseException, job: Any, ctx: DryContext) -> str | None:
    """The flavor did not load: the bundle off PYTHONPATH (custom_import), an unknown flavor or model name."""
    if isinstance(exc, ModuleNotFoundError) and exc.name == job.experimental.custom_import:
        where = ctx.launched.env.get("PYTHONPATH")
        return (f"put the bundle on the program's PYTHONPATH (export PYTHONPATH=\"$AUTOPLACE_BUNDLE:$PYTHONPATH\" in "
                f"{ctx.launched.file}; it now sets {where or 'none'}): [experimental] custom_import "
                f"{job.experimental.custom_import} is the bundle's {job.experimental.custom_import}.py")
    if isinstance(exc, KeyError):
        import torchtitan.protocols.train_spec as train_spec_module

        flavors = sorted(train_spec_module.get_train_spec(job.model.name).model_args)
        return f"[model] flavor: one of {', '.join(flavors)}"
    if isinstance(exc, ValueError) and "is not registered" in str(exc):
        return "[model] name: one of llama3, qwen3, deepseek_v3 (torchtitan 0.2.2's own models autoplace writes)"
    return None


def batch_fix(job: Any, dims: Any) -> str:
    """The global batch is no multiple of the local batch times the data-parallel degree."""
    degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    local = job.training.local_batch_size
    return (f"set [training] global_batch_size to a multiple of local_batch_size x the data-parallel degree "
            f"({local} x {degree} = {local * degree})")


def seq_fix(exc: BaseException, job: Any, dims: Any) -> str | None:
    """parallelize_fn refused the sequence length: a multiple of tp x 2 x cp."""
    if "Sequence length" not in str(exc):
        return None
    step = dims.seq_len_divisor
    return (f"set [training] seq_len to a multiple of tp x 2 x cp = {step} "
            f"(e.g. {max(step, job.training.seq_len // step * step)})")


def split_fix(exc: BaseException) -> str | None:
    """pipeline_llm refused the split: stages per rank against the schedule and the layers."""
    if "pipeline_parallel_layers_per_stage" in str(exc) or "stages" in str(exc):
        return ("give [parallelism] module_fqns_per_model_part one list per stage (pp x stages per rank), or a "
                "pipeline_parallel_layers_per_stage that splits the layers into them")
    return None


def schedule_fix(exc: BaseException, job: Any, dims: Any, local_stages: int) -> str | None:
    """For torch's "Number of microbatches (m) must be greater than or equal to the number of stages (s)"
    and torchtitan's "Batch size b must be divisible by microbatch_size": a local batch that gives the
    schedule enough micro-batches and still divides the global batch, or what else can change."""
    text = str(exc)
    micro = job.parallelism.pipeline_parallel_microbatch_size
    global_batch = job.training.global_batch_size
    degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    if "divisible by microbatch_size" in text:
        return f"set [training] local_batch_size to a multiple of pipeline_parallel_microbatch_size ({micro})"
    needed = re.search(r"number of stages \((\d+)\)", text)
    if not needed:
        return None
    stages = int(needed.group(1))
    fits = [n for n in range(stages * micro, global_batch // degree + 1, micro)
            if global_batch % (n * degree) == 0] if global_batch > 0 else []
    if fits:
        return (f"set [training] local_batch_size = {fits[0]} ({fits[0] // micro} micro-batches of {micro} for "
                f"{stages} stages; {global_batch} = {fits[0]} x {degree} data-parallel ranks x "
                f"{global_batch // (fits[0] * degree)} accumulation steps)")
    smaller = f", lower pipeline_parallel_microbatch_size ({micro})" if micro > 1 else ""
    return (f"the {degree} data-parallel ranks get {global_batch // degree} sequences each of global_batch_size "
            f"{global_batch}, fewer than the {stages * micro} that {stages} micro-batches of {micro} take "
            f"({job.parallelism.pipeline_parallel_schedule} runs one per stage, {local_stages} stage(s) per rank): "
            f"raise global_batch_size to {stages * micro * degree} (local_batch_size {stages * micro}){smaller}, "
            f"use fewer pipeline stages or data-parallel ranks, or Interleaved1F1B (it runs fewer micro-batches "
            "than stages)")


