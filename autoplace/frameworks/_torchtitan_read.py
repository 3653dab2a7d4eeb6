"""Read a torchtitan 0.2 job TOML back into a Plan (:func:`autoplace.frameworks.torchtitan.plan_from_torchtitan`).

torchtitan's ConfigManager rejects unknown keys but not bad Literal values inside the TOML,
and only ``ParallelDims`` checks the degree product; both are checked here, with the
pipeline split worked out the way torchtitan 0.2.2 does (``pipeline_llm`` and
``generate_llm_fqn_per_model_part``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoplace.emit import _readkit as kit
from autoplace.emit._common import blocks, stage_counts_from_parts, training_dtype
from autoplace.errors import EmitError, SpecError
from autoplace.frameworks._torchtitan_pipeline import V_SHAPED, torch_stage_order
from autoplace.frameworks.schema import (
    PLAN_TO_TORCH_SCHEDULE,
    TORCH_PP_SCHEDULES,
    TORCHTITAN_FIELDS,
    TORCHTITAN_SECTIONS,
)
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

CUSTOM_FLAVOR = "autoplace"  # the flavor name a bundle registers for a model none of torchtitan's own fit
_SCHEDULES = {name: plan for plan, name in PLAN_TO_TORCH_SCHEDULE.items()}
_SINGLE_STAGE = {"1F1B", "GPipe"}  # torch's PipelineScheduleSingle subclasses among the plan's schedules


def read_torchtitan(cfg: kit.Doc | str | Path, model: ModelSpec, cluster: ClusterSpec,
                    titan_model: Callable[[ModelSpec], Any]) -> Plan:
    """A torchtitan 0.2 job config (+ model + cluster) as a Plan (``autoplace.frameworks.torchtitan.
    plan_from_torchtitan``; ``titan_model`` maps the model file to torchtitan's name and flavor).

    Raises:
        SpecError: unknown sections or keys, invalid choices, degrees whose product is not
            the cluster's GPU count, a schedule or split a Plan cannot state.
    """
    doc, src = kit.load(cfg, "toml", "<torchtitan config>")
    kit.check_keys(doc, TORCHTITAN_SECTIONS, src, "")
    par, train, ac = (kit.section(doc, name, src) for name in ("parallelism", "training", "activation_checkpoint"))
    for name, table in (("parallelism", par), ("training", train), ("activation_checkpoint", ac)):
        kit.check_keys(table, TORCHTITAN_FIELDS[name], src, f"{name}.")
    _check_model(kit.section(doc, "model", src), doc, titan_model, model, src)
    rep, shard, tp, cp, pp, ep = _degrees(par, cluster.gpus, src)
    zero = _zero(par, shard * cp, pp, src)
    _check_training(train, model, src)
    n = blocks(model)
    parts = _parts(par, pp, n, src) if pp > 1 else [n]
    schedule = _schedule(par, src) if pp > 1 else "1f1b"
    v_shaped = PLAN_TO_TORCH_SCHEDULE[schedule] in V_SHAPED
    if v_shaped and len(parts) != 2 * pp:  # ScheduleZBVZeroBubble.__init__ (torch 2.13)
        raise SpecError(f"{PLAN_TO_TORCH_SCHEDULE[schedule]} runs exactly 2 stages per pipeline rank; this split "
                        f"makes {len(parts)} stages on pp={pp}", source=src,
                        field="parallelism.pipeline_parallel_layers_per_stage")
    overlap = kit.boolean(par, "pipeline_parallel_expert_parallel_overlap", src, "parallelism.", default=True)
    if schedule == "dualpipev" and ep > 1 and not overlap:  # the plan's dualpipev is costed with it (terms_time)
        raise SpecError("false: a Plan's dualpipev overlaps the expert-parallel all-to-all with the paired chunk; "
                        "set true, or another schedule", source=src,
                        field="parallelism.pipeline_parallel_expert_parallel_overlap")
    mbs, ga = _batch(train, par, pp, rep * shard, src)
    offload = "cpu" if kit.boolean(train, "enable_cpu_offload", src, "training.") else "none"
    looped = torch_stage_order(parts, pp, PLAN_TO_TORCH_SCHEDULE[schedule])  # a V's stages back to ranks' chunks
    return Plan(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=rep, dp_shard=shard, vpp=len(parts) // pp, sp=tp > 1,
                zero=zero, mbs=mbs, grad_accum=ga, schedule=schedule, offload_optimizer=offload,
                offload_params=offload, recompute=_recompute(ac, parts, pp, src, v_shaped),
                layers_per_stage=stage_counts_from_parts(looped, pp), **_recipe(doc, par, model, tp, src))


def _fp8_model(model: ModelSpec) -> bool:
    return model.training.recipe().compute_dtype == "fp8"


def _recipe(doc: kit.Doc, par: kit.Doc, model: ModelSpec, tp: int, src: str) -> dict[str, Any]:
    """The recipe keys the config turns on: [compile] (with "loss" among its components: the
    fused loss), async TP, and the fp8 converter with its recipe."""
    comp = kit.section(doc, "compile", src)
    compiled = kit.boolean(comp, "enable", src, "compile.")
    components = comp.get("components", ["model", "loss"])
    if not isinstance(components, list) or not set(components) <= {"model", "loss"}:
        raise SpecError("expected a list of 'model' and 'loss'", source=src, field="compile.components")
    async_tp = kit.boolean(par, "enable_async_tensor_parallel", src, "parallelism.")
    converters = kit.section(doc, "model", src).get("converters", [])
    quant = kit.section(doc, "quantize", src).get("linear", {})
    fp8 = "none"
    if "quantize.linear.float8" in converters:
        # no recipe named: torchao's default (tensorwise), or the model file's own fp8 when it says fp8
        fp8 = str(quant.get("float8", {}).get("recipe_name") or ("none" if _fp8_model(model) else "tensorwise"))
        if fp8 not in ("none", "tensorwise", "rowwise"):
            raise SpecError(f"float8 recipe {fp8!r} is not modelled (modelled: tensorwise, rowwise)", source=src,
                            field="quantize.linear.float8.recipe_name")
    elif "quantize.linear.mx" in converters:
        fp8 = "mxfp8"
    return {"compile": compiled, "fused_loss": compiled and "loss" in components,
            "tp_overlap": "async" if async_tp and tp > 1 else "none", "fp8": fp8}


def _check_model(section: kit.Doc, doc: kit.Doc, titan_model: Callable[[ModelSpec], Any], model: ModelSpec,
                 src: str) -> None:
    """The job must train the model file's model: torchtitan's own flavor with its shapes, or the
    bundle's registered flavor.  Without ``[model]`` torchtitan 0.2.2 trains llama3 debugmodel."""
    name, flavor = section.get("name", "llama3"), section.get("flavor", "debugmodel")
    try:
        want = titan_model(model)
    except EmitError as exc:
        raise SpecError(str(exc), source=src, field="model.name") from None
    custom = flavor == CUSTOM_FLAVOR and kit.section(doc, "experimental", src).get("custom_import")
    if name != want.name or (flavor != want.flavor and not custom):
        said = "has no [model] section, so" if not section else "says"
        raise SpecError(f"the config {said} torchtitan trains {name} {flavor}, but the model file is {model.name} "
                        f"(torchtitan {want.name} flavor {want.flavor})", source=src, field="model.flavor")


def _schedule(par: kit.Doc, src: str) -> str:
    name = kit.choice(par, "pipeline_parallel_schedule", TORCH_PP_SCHEDULES, src, "parallelism.", default="1F1B")
    if name not in _SCHEDULES:
        raise SpecError(f"{name} is a torch schedule autoplace does not model; modelled: {', '.join(_SCHEDULES)}",
                        source=src, field="parallelism.pipeline_parallel_schedule")
    return _SCHEDULES[name]


def _degrees(par: kit.Doc, world: int, src: str) -> tuple[int, int, int, int, int, int]:
    where = "parallelism."
    rep, tp, cp, pp, ep = (kit.integer(par, key, src, where, default=1) or 1 for key in (
        "data_parallel_replicate_degree", "tensor_parallel_degree", "context_parallel_degree",
        "pipeline_parallel_degree", "expert_parallel_degree"))
    shard = par.get("data_parallel_shard_degree", -1)
    if shard == -1:  # torchtitan: the ranks left after the other degrees
        shard = world // (rep * cp * tp * pp) if world % (rep * cp * tp * pp) == 0 else 0
    else:
        shard = kit.integer(par, "data_parallel_shard_degree", src, where) or 1
    if shard < 1 or rep * shard * cp * tp * pp != world:
        raise SpecError(f"dp_replicate({rep}) * dp_shard({shard}) * cp({cp}) * tp({tp}) * pp({pp}) != "
                        f"the cluster's {world} GPUs", source=src, field=f"{where}data_parallel_shard_degree")
    if shard * cp == 1 and rep > 1 and rep != world:
        raise SpecError("torchtitan 0.2's DDP (dp_replicate without dp_shard or cp) is 1-D only", source=src,
                        field=f"{where}data_parallel_replicate_degree")
    return rep, shard, tp, cp, pp, ep


def _zero(par: kit.Doc, fsdp_group: int, pp: int, src: str) -> int:
    """ZeRO-3 when FSDP reshards after forward, ZeRO-2 when not (torchtitan's "default": not under PP)."""
    policy = kit.choice(par, "fsdp_reshard_after_forward", ("default", "always", "never"), src, "parallelism.",
                        default="default")
    if fsdp_group == 1:
        return 0  # no FSDP: DDP or a single data-parallel rank
    if policy == "default":
        return 2 if pp > 1 else 3
    return 3 if policy == "always" else 2


def _check_training(train: kit.Doc, model: ModelSpec, src: str) -> None:
    seq = kit.integer(train, "seq_len", src, "training.", default=2048)
    if seq != model.seq_len:
        raise SpecError(f"seq_len {seq} differs from the model's seq_len {model.seq_len}", source=src,
                        field="training.seq_len")
    if "mixed_precision_param" in train:
        dtype = kit.choice(train, "mixed_precision_param", ("bfloat16", "float32"), src, "training.", default="")
        kit.check_dtype({"bfloat16": "bf16", "float32": "fp32"}[dtype], training_dtype(model), src,
                        "training.mixed_precision_param")
    # 0.2.2 declares Literal["float32"]: its command line refuses anything else, and only the TOML
    # loader lets "bfloat16" through unchecked, so a bf16 reduction is not a torchtitan setting
    kit.choice(train, "mixed_precision_reduce", ("float32",), src, "training.", default="float32")


def _batch(train: kit.Doc, par: kit.Doc, pp: int, dp: int, src: str) -> tuple[int, int]:
    """(micro-batch, micro-batches per step) as torchtitan 0.2.2's trainer computes them."""
    local = kit.integer(train, "local_batch_size", src, "training.", default=8) or 8
    gb = train.get("global_batch_size", -1)
    gb = local * dp if gb == -1 else kit.integer(train, "global_batch_size", src, "training.") or local * dp
    if gb % (local * dp):
        raise SpecError(f"global_batch_size {gb} is not a multiple of local_batch_size({local}) * dp({dp})",
                        source=src, field="training.global_batch_size")
    accum = gb // (local * dp)
    if pp == 1:
        return local, accum
    micro = kit.integer(par, "pipeline_parallel_microbatch_size", src, "parallelism.", default=1) or 1
    if local % micro:
        raise SpecError(f"local_batch_size {local} is not a multiple of pipeline_parallel_microbatch_size {micro}",
                        source=src, field="parallelism.pipeline_parallel_microbatch_size")
    return micro, local // micro * accum


def _parts(par: kit.Doc, pp: int, n: int, src: str) -> list[int]:
    """Blocks per model chunk, in virtual-stage order."""
    where = "parallelism."
    fqns = par.get("module_fqns_per_model_part")
    if fqns is not None:
        return _parts_from_fqns(fqns, pp, n, src)
    schedule = par.get("pipeline_parallel_schedule", "1F1B")
    first = kit.integer(par, "pipeline_parallel_first_stage_less_layers", src, where, default=1, minimum=0) or 0
    last = kit.integer(par, "pipeline_parallel_last_stage_less_layers", src, where, default=1, minimum=0) or 0
    per = kit.integer(par, "pipeline_parallel_layers_per_stage", src, where)
    stages = pp * (1 if schedule in _SINGLE_STAGE else 2) if per is None else math.ceil((n + first + last) / per)
    if stages % pp or (schedule in _SINGLE_STAGE) != (stages == pp):
        raise SpecError(f"{stages} pipeline stages do not fit pp={pp} with schedule {schedule}", source=src,
                        field=f"{where}pipeline_parallel_layers_per_stage")
    return _torchtitan_split(stages, n, first, last, src)


def _torchtitan_split(stages: int, n: int, first: int, last: int, src: str) -> list[int]:
    """Layer counts torchtitan 0.2.2's generate_llm_fqn_per_model_part gives each stage."""
    effective = n + first + last
    base, extra = divmod(effective, stages)
    if base == 0 or first > base or last > base:
        raise SpecError(f"{stages} stages over {n} layers (+{first} embedding, +{last} head weight) leave a stage "
                        "empty", source=src, field="parallelism.pipeline_parallel_layers_per_stage")
    counts, left = [], n
    for i in range(stages):
        want = base + (i < extra) - (first if i == 0 else 0) - (last if i == stages - 1 else 0)
        take = min(max(want, 0), left)
        counts.append(take)
        left -= take
    if left:
        raise SpecError(f"torchtitan's split of {n} layers over {stages} stages leaves {left} layers unplaced",
                        source=src, field="parallelism.pipeline_parallel_layers_per_stage")
    return counts


def _parts_from_fqns(fqns: object, pp: int, n: int, src: str) -> list[int]:
    field = "parallelism.module_fqns_per_model_part"
    if not isinstance(fqns, list) or not fqns or not all(isinstance(p, list) for p in fqns) or len(fqns) % pp:
        raise SpecError(f"expected a list of pp*k lists of module names (pp={pp})", source=src, field=field)
    order = [int(m.group(1)) for part in fqns for name in part if (m := re.fullmatch(r"layers\.(\d+)", str(name)))]
    if order != list(range(n)):
        raise SpecError(f"the chunks must hold layers.0 .. layers.{n - 1} once each, in order", source=src,
                        field=field)
    if "tok_embeddings" not in fqns[0] or "output" not in fqns[-1]:
        raise SpecError("the first chunk must hold tok_embeddings and the last output", source=src, field=field)
    return [sum(1 for name in part if str(name).startswith("layers.")) for part in fqns]


def _recompute(ac: kit.Doc, parts: list[int], pp: int, src: str, v_shaped: bool) -> tuple[str, ...]:
    n = sum(parts)
    mode = kit.choice(ac, "mode", ("selective", "full", "memory_budget", "none"), src, "activation_checkpoint.",
                      default="selective")
    if mode == "memory_budget":
        raise SpecError("compiler memory-budget checkpointing is not modelled by autoplace", source=src,
                        field="activation_checkpoint.mode")
    if mode != "selective":
        return (mode,) * n
    option = str(ac.get("selective_ac_option", "2"))
    if option == "op":
        return ("selective",) * n
    if not option.isdigit():
        raise SpecError(f"expected 'op' or a whole number, got {option!r}", source=src,
                        field="activation_checkpoint.selective_ac_option")
    every = int(option)
    return ("full",) * n if every <= 1 else layer_sac_pattern(parts, pp, every, v_shaped)


def layer_sac_pattern(parts: list[int], pp: int, every: int, v_shaped: bool = False) -> tuple[str, ...]:
    """Which blocks torchtitan's layer-level SAC (``selective_ac_option = N``) recomputes.

    torchtitan 0.2.2 counts blocks per process in the order its model chunks (``parts``, in stage
    order) are wrapped -- stage v * pp + r for v = 0, 1, ..., or stages r and 2 pp - 1 - r when
    ``v_shaped`` (its stage_ids_this_rank, style "v") -- and checkpoints every N-th one in full.
    """
    starts = [sum(parts[:i]) for i in range(len(parts))]
    modes = ["none"] * sum(parts)
    for r in range(pp):
        count = 0
        v = v_shaped and len(parts) == 2 * pp  # (a V of other lengths torch refuses: _torchtitan_pipeline)
        for chunk in ((r, 2 * pp - 1 - r) if v else range(r, len(parts), pp)):
            for j in range(starts[chunk], starts[chunk] + parts[chunk]):
                count += 1
                if count % every == 0:
                    modes[j] = "full"
    return tuple(modes)
