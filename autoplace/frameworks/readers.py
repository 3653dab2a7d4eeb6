"""Read DeepSpeed and accelerate configs users already have back into a Plan (``check``, ``evaluate``).

A DeepSpeed JSON or an accelerate YAML, together with the model and the cluster, becomes a
:class:`~autoplace.plan.Plan` (the frameworks' ``read`` methods call these; torchtitan's reader
is ``_torchtitan_read``).  Unlike the frameworks, the readers
reject what would be silently ignored (unknown top-level DeepSpeed keys, unknown
``fsdp_config`` keys) and contradictory values (a batch identity that does not hold, NVMe
offload without a path, partial optimizer offload below ZeRO-3), naming the file and the key.

What a format cannot state comes from keyword arguments (DeepSpeed's pipeline split is in
the user's code; accelerate has no batch size), with the defaults ``build_plan`` uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from autoplace.cost.comm import members_per_domain
from autoplace.emit import _readkit as kit
from autoplace.emit._common import blocks, training_dtype
from autoplace.errors import SpecError
from autoplace.frameworks.schema import (
    ACCELERATE_FSDP,
    ACCELERATE_PARALLELISM,
    ACCELERATE_TOP_LEVEL,
    DEEPSPEED_ACTIVATION_CHECKPOINTING,
    DEEPSPEED_OFFLOAD_OPTIMIZER,
    DEEPSPEED_OFFLOAD_PARAM,
    DEEPSPEED_PIPELINE,
    DEEPSPEED_REMOVED,
    DEEPSPEED_TOP_LEVEL,
    DEEPSPEED_ZERO,
)
from autoplace.plan import RECOMPUTE, Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

__all__ = ["PARTITION_METHOD", "deepspeed_split", "plan_from_accelerate", "plan_from_deepspeed"]

# PipelineModule(partition_method=...) that balances the transformer blocks: one unit of weight per
# layer whose class name matches (Hugging Face's <Family>DecoderLayer, GPT2Block, BloomBlock,
# GPTNeoXLayer), none for the embedding, norm and head.  The split it makes is deepspeed_split's.
PARTITION_METHOD = "type:(DecoderLayer|Block|Layer)$"


def deepspeed_split(blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage of ``PipelineModule(partition_method=PARTITION_METHOD)``: DeepSpeed's
    ``partition_balanced`` over one unit per block (runtime/utils.py), which gives the first
    ``blocks % stages`` stages one block more, as its ``partition_uniform`` does (checked against
    DeepSpeed 0.19 for up to 129 blocks on 16 stages, with and without the zero-weight embedding,
    norm and head around them)."""
    base, extra = divmod(blocks, stages)
    return tuple(base + 1 if s < extra else base for s in range(stages))


def bf16_optimizer_shards(zero: int, pp: int, dp: int, dtype: str) -> bool:
    """Whether DeepSpeed runs a ZeRO-0 plan as ZeRO-1: its pipeline engine trains bf16 weights without ZeRO
    through ``BF16_Optimizer`` (engine.py ``_do_optimizer_sanity_check``: bf16 gradients under a pipeline),
    which partitions the fp32 master weights and Adam's state over the data-parallel ranks
    (bf16_optimizer.py ``fp32_groups_flat_partition``) and all-gathers the updated bf16 weights -- ZeRO-1's
    states and traffic (its dry run measures them against a zero=1 plan)."""
    return zero == 0 and pp > 1 and dp > 1 and dtype == "bf16"


# ---------------------------------------------------------------------------------------
# DeepSpeed


def plan_from_deepspeed(cfg: kit.Doc | str | Path, model: ModelSpec, cluster: ClusterSpec, *,
                        pp: int | None = None, recompute: str | None = None, notes: list[str] | None = None) -> Plan:
    """A DeepSpeed config (+ model + cluster) as a Plan.

    Hugging Face Trainer configs write ``"auto"`` for values the Trainer fills in; those are
    resolved here from the model (precision, batch) or, when they do not change the plan
    (bucket sizes, optimizer settings), listed as unresolved in ``notes``.

    Args:
        cfg: the parsed JSON or its path.
        pp: pipeline stages, when the config's ``pipeline.stages`` is absent or "auto"
            (DeepSpeed takes it from ``PipelineModule(num_stages=...)``).
        recompute: what the model code recomputes (none|selective|full); by default full when
            the config configures activation checkpointing, else none.
        notes: when given, receives one line per "auto" value resolved or left unresolved.

    Raises:
        SpecError: unknown or contradictory keys, naming the file and the key.
    """
    doc, src = kit.load(cfg, "json", "<deepspeed config>")
    doc = resolve_auto(doc, model, notes if notes is not None else [])
    for key in doc:
        if key in DEEPSPEED_REMOVED:
            raise SpecError("DeepSpeed 0.19 removed this feature and refuses the key", source=src, field=key)
    kit.check_keys(doc, DEEPSPEED_TOP_LEVEL, src, "", " (DeepSpeed would silently ignore it)")
    if kit.integer(doc, "sequence_parallel_size", src, default=1) != 1:
        raise SpecError("Ulysses sequence parallelism is not modelled by autoplace", source=src,
                        field="sequence_parallel_size")
    kit.check_dtype(_deepspeed_dtype(doc, src), training_dtype(model), src, "bf16/fp16")
    tp = max(1, kit.integer(kit.section(doc, "tensor_parallel", src), "autotp_size", src, "tensor_parallel.",
                            default=1, minimum=0) or 1)
    ep = _deepspeed_ep(doc, src)
    stages = _deepspeed_pipeline(doc, src, pp)
    zero = kit.section(doc, "zero_optimization", src)
    kit.check_keys(zero, DEEPSPEED_ZERO, src, "zero_optimization.")
    stage = kit.integer(zero, "stage", src, "zero_optimization.", default=0, minimum=0) or 0
    if stage > 3:
        raise SpecError(f"stage must be 0, 1, 2 or 3, got {stage}", source=src, field="zero_optimization.stage")
    offload_opt, offload_par = _deepspeed_offloads(zero, stage, src)
    if cluster.gpus % (tp * stages):
        raise SpecError(f"tp({tp}) * pp({stages}) does not divide the cluster's {cluster.gpus} GPUs",
                        source=src, field="tensor_parallel.autotp_size")
    dp = cluster.gpus // (tp * stages)
    mbs, ga = _deepspeed_batch(doc, dp, src)
    zeropp = _deepspeed_zeropp(zero, stage, tp, dp, cluster, src)
    runs = stage
    if bf16_optimizer_shards(stage, stages, dp, training_dtype(model)):
        runs = 1
        if notes is not None:
            notes.append(f"zero_optimization.stage 0 with {stages} pipeline stages in bf16: DeepSpeed runs "
                         "BF16_Optimizer, which shards the fp32 master and Adam's state over the data-parallel ranks: "
                         "read as zero=1")
    rep, shard = (1, dp) if zeropp else _deepspeed_dp_split(zero, runs, dp, src)
    acts = "activation_checkpointing" in doc or kit.section(doc, "pipeline", src).get("activation_checkpoint_interval")
    mode = recompute or ("full" if acts else "none")
    if mode not in RECOMPUTE:
        raise SpecError(f"{mode!r} is not valid; valid: {', '.join(RECOMPUTE)}", field="recompute")
    n = blocks(model)
    return Plan(tp=tp, pp=stages, ep=ep, dp_replicate=rep, dp_shard=shard, zero=runs, mbs=mbs, grad_accum=ga,
                offload_optimizer=offload_opt, offload_params=offload_par, recompute=(mode,) * n,
                layers_per_stage=deepspeed_split(n, stages), compress="zeropp" if zeropp else "none",
                overlap=kit.boolean(zero, "overlap_comm", src, "zero_optimization.", default=stage == 3) if stage else True)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DTYPE_SECTIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}


def resolve_auto(doc: kit.Doc, model: ModelSpec, notes: list[str]) -> dict[str, Any]:
    """``doc`` with the Hugging Face Trainer's ``"auto"`` values resolved (transformers
    ``integrations/deepspeed.py`` fills them from TrainingArguments and the model).

    Precision follows the model's recipe; an all-"auto" batch becomes the model's global batch
    with micro-batch 1 (the Trainer's per_device_train_batch_size is not known here); other
    "auto" values do not change the plan and are dropped, each listed in ``notes``.
    """
    unresolved: list[str] = []
    out = _without_auto(doc, "", unresolved)
    dtype = training_dtype(model)
    for path in [p for p in unresolved if p.endswith(".enabled") and p.split(".")[0] in _DTYPE_SECTIONS]:
        section = path.split(".")[0]
        out.setdefault(section, {})["enabled"] = _DTYPE_SECTIONS[section] == dtype
        notes.append(f'{path} "auto": {str(_DTYPE_SECTIONS[section] == dtype).lower()} (the model trains in {dtype})')
        unresolved.remove(path)
    batch_auto = [k for k in _BATCH_KEYS if k in unresolved]
    if batch_auto:
        for key in batch_auto:
            unresolved.remove(key)
        if "train_micro_batch_size_per_gpu" not in out and "train_batch_size" not in out:
            out["train_micro_batch_size_per_gpu"] = 1
        if "train_batch_size" not in out and "gradient_accumulation_steps" not in out:
            out["train_batch_size"] = model.training.global_batch
        notes.append(f'{", ".join(batch_auto)} "auto": resolved from the model\'s global batch '
                     f"{model.training.global_batch} (micro-batch {out.get('train_micro_batch_size_per_gpu', 'derived')}"
                     "); the HF Trainer sets them from its TrainingArguments")
    if unresolved:
        notes.append(f'unresolved "auto" (the HF Trainer fills them in; they do not change the plan): '
                     f"{', '.join(unresolved)}")
    return out


def _without_auto(doc: Mapping[str, Any], prefix: str, found: list[str]) -> dict[str, Any]:
    """A copy of ``doc`` without its "auto" leaves, whose dotted paths are appended to ``found``."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if value == "auto" and not (prefix == "zero_optimization." and key == "stage"):
            found.append(f"{prefix}{key}")
        elif isinstance(value, Mapping):
            out[key] = _without_auto(value, f"{prefix}{key}.", found)
        else:
            out[key] = value
    return out


def _deepspeed_dtype(doc: kit.Doc, src: str) -> str:
    bf16 = any(kit.boolean(kit.section(doc, k, src), "enabled", src, f"{k}.") for k in ("bf16", "bfloat16"))
    fp16 = kit.boolean(kit.section(doc, "fp16", src), "enabled", src, "fp16.")
    if bf16 and fp16:
        raise SpecError("bf16 and fp16 cannot both be enabled", source=src, field="fp16.enabled")
    autocast = kit.section(doc, "torch_autocast", src)
    if not (bf16 or fp16) and kit.boolean(autocast, "enabled", src, "torch_autocast."):
        return "fp16" if str(autocast.get("dtype", "bfloat16")) in ("float16", "torch.float16", "fp16") else "bf16"
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def _deepspeed_ep(doc: kit.Doc, src: str) -> int:
    ep = kit.section(doc, "expert_parallel", src)
    if not kit.boolean(ep, "enabled", src, "expert_parallel."):
        return 1
    return kit.integer(ep, "autoep_size", src, "expert_parallel.", default=1) or 1


def _deepspeed_pipeline(doc: kit.Doc, src: str, pp: int | None) -> int:
    pipe = kit.section(doc, "pipeline", src)
    kit.check_keys(pipe, DEEPSPEED_PIPELINE, src, "pipeline.", " (DeepSpeed would silently ignore it)")
    kit.check_keys(kit.section(doc, "activation_checkpointing", src), DEEPSPEED_ACTIVATION_CHECKPOINTING, src,
                   "activation_checkpointing.", " (DeepSpeed would silently ignore it)")
    stages = pipe.get("stages", "auto")
    if stages == "auto":
        if pipe and pp is None:
            raise SpecError("the pipeline degree comes from PipelineModule(num_stages=...); give it as an integer "
                            "here or pass pp", source=src, field="pipeline.stages")
        return pp or 1
    partition = pipe.get("partition", PARTITION_METHOD)
    if not isinstance(partition, str) or not (partition == "uniform" or partition.startswith("type:")):
        raise SpecError(f"{partition!r}: the split would follow each layer's parameter count in your code; autoplace "
                        f"reads the block-balanced split of partition {PARTITION_METHOD!r}", source=src,
                        field="pipeline.partition")
    found = kit.integer(pipe, "stages", src, "pipeline.") or 1
    if pp is not None and pp != found:
        raise SpecError(f"pipeline.stages is {found} but pp={pp} was given", source=src, field="pipeline.stages")
    return found


def _deepspeed_offloads(zero: kit.Doc, stage: int, src: str) -> tuple[str, str]:
    """(optimizer, params) offload devices, with DeepSpeed's rules checked (and the ones it leaves out)."""
    devices = []
    for key, known, legacy in (("offload_optimizer", DEEPSPEED_OFFLOAD_OPTIMIZER, "cpu_offload"),
                               ("offload_param", DEEPSPEED_OFFLOAD_PARAM, "cpu_offload_param")):
        where = f"zero_optimization.{key}."
        off = kit.section(zero, key, src, "zero_optimization.")
        kit.check_keys(off, known, src, where)
        device = kit.choice(off, "device", ("none", "cpu", "nvme"), src, where, default="none")
        if device == "none" and kit.boolean(zero, legacy, src, "zero_optimization."):
            device = "cpu"  # the deprecated boolean spelling
        if device == "nvme" and not off.get("nvme_path"):
            raise SpecError("device nvme needs nvme_path (DeepSpeed's parser does not check it)",
                            source=src, field=f"{where}nvme_path")
        if key == "offload_optimizer" and float(off.get("ratio", 1.0)) < 1.0 and stage != 3:
            raise SpecError("partial optimizer offload (ratio < 1) works at stage 3 only", source=src,
                            field=f"{where}ratio")
        devices.append(device)
    if devices[1] != "none" and stage != 3:
        raise SpecError(f"parameter offload needs stage 3, got stage {stage}", source=src,
                        field="zero_optimization.offload_param.device")
    if devices[0] != "none" and stage == 0:
        raise SpecError("optimizer offload needs stage 1, 2 or 3", source=src,
                        field="zero_optimization.offload_optimizer.device")
    return devices[0], devices[1]


def _deepspeed_batch(doc: kit.Doc, dp: int, src: str) -> tuple[int, int]:
    """(micro-batch, accumulation) from any two or three of the batch keys, as DeepSpeed fills them.

    DeepSpeed floors silently when the numbers do not divide; here that is an error.
    """
    tb = kit.integer(doc, "train_batch_size", src)
    mb = kit.integer(doc, "train_micro_batch_size_per_gpu", src)
    ga = kit.integer(doc, "gradient_accumulation_steps", src)
    if tb is None and mb is None:
        raise SpecError("give train_batch_size or train_micro_batch_size_per_gpu", source=src,
                        field="train_batch_size")
    if tb is None:
        return mb or 1, ga or 1
    if mb is None:
        ga = ga or 1
        if tb % (dp * ga):
            raise SpecError(f"train_batch_size {tb} is not a multiple of gradient_accumulation_steps({ga}) * "
                            f"data-parallel size({dp})", source=src, field="train_batch_size")
        return tb // (dp * ga), ga
    if ga is None:
        if tb % (mb * dp):
            raise SpecError(f"train_batch_size {tb} is not a multiple of train_micro_batch_size_per_gpu({mb}) * "
                            f"data-parallel size({dp})", source=src, field="train_batch_size")
        return mb, tb // (mb * dp)
    if tb != mb * ga * dp:
        raise SpecError(f"train_batch_size {tb} != train_micro_batch_size_per_gpu({mb}) * "
                        f"gradient_accumulation_steps({ga}) * data-parallel size({dp}) = {mb * ga * dp}",
                        source=src, field="train_batch_size")
    return mb, ga


def _deepspeed_zeropp(zero: kit.Doc, stage: int, tp: int, dp: int, cluster: ClusterSpec, src: str) -> bool:
    """Whether the config runs ZeRO++ as autoplace costs it (compress=zeropp): stage 3, quantized weights
    and gradients, hpZ over the ZeRO group's ranks in one NVLink domain; anything partial is refused."""
    where = "zero_optimization."
    weights = kit.boolean(zero, "zero_quantized_weights", src, where)
    grads = kit.boolean(zero, "zero_quantized_gradients", src, where)
    if not (weights or grads):
        return False
    if not (weights and grads):
        raise SpecError("autoplace models ZeRO++ as quantized weights, hpZ and quantized gradients together; set "
                        "both or neither", source=src, field=where + ("zero_quantized_gradients" if weights else
                                                                       "zero_quantized_weights"))
    if stage != 3:
        raise SpecError(f"ZeRO++ applies to stage 3 only, got stage {stage}", source=src,
                        field=where + "zero_quantized_weights")
    hpz = kit.integer(zero, "zero_hpz_partition_size", src, where, default=1, minimum=0) or 1
    want = int(members_per_domain(np.array(dp), np.array(tp), cluster.nvlink_domain))
    if hpz != want:
        raise SpecError(f"autoplace costs ZeRO++ with hpZ over the ZeRO group's ranks in one NVLink domain, {want} "
                        f"here; got {hpz}", source=src, field=where + "zero_hpz_partition_size")
    return True


def _deepspeed_dp_split(zero: kit.Doc, stage: int, dp: int, src: str) -> tuple[int, int]:
    hpz = kit.integer(zero, "zero_hpz_partition_size", src, "zero_optimization.", default=1, minimum=0) or 1
    if hpz > 1:
        if stage != 3:
            raise SpecError(f"hpZ applies to stage 3 only, got stage {stage}", source=src,
                            field="zero_optimization.zero_hpz_partition_size")
        return kit.split_data_parallel(dp, hpz, src, "zero_optimization.zero_hpz_partition_size")
    return (dp, 1) if stage == 0 else (1, dp)


# ---------------------------------------------------------------------------------------
# accelerate

_FSDP1_STRATEGY = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2,
                   "1": 3, "2": 2, "3": 0, "4": 3, "5": 2}
_MULTI = {"MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
          "MULTI_NEURON", "MULTI_CPU"}


def plan_from_accelerate(cfg: kit.Doc | str | Path, model: ModelSpec, cluster: ClusterSpec, *,
                         mbs: int = 1, grad_accum: int | None = None) -> Plan:
    """An accelerate config (FSDP1/FSDP2 or DDP, + model + cluster) as a Plan.

    Args:
        cfg: the parsed YAML or its path.
        mbs: micro-batch size (accelerate's config has none).
        grad_accum: micro-batches per step; default: the model's global batch / (mbs * dp).

    Raises:
        SpecError: unknown keys (accelerate ignores unknown ``fsdp_config`` keys), a
            distributed type autoplace does not model, or degrees that contradict num_processes.
    """
    doc, src = kit.load(cfg, "yaml", "<accelerate config>")
    kit.check_keys(doc, ACCELERATE_TOP_LEVEL, src, "")
    kind = kit.choice(doc, "distributed_type", {"NO", "FSDP", *_MULTI}, src, default="")
    world = 1 if kind == "NO" else kit.integer(doc, "num_processes", src)
    if world is None:
        raise SpecError("required for a distributed job", source=src, field="num_processes")
    mixed = kit.choice(doc, "mixed_precision", ("no", "bf16", "fp16", "fp8"), src, default="no")
    if mixed == "fp8":  # accelerate 1.15's fp8_config.backend: AO (torchao), TE or MSAMP; none is costed as accelerate
        raise SpecError("fp8: accelerate's fp8 backends (torchao, Transformer Engine, MS-AMP) are not modelled "
                        "for accelerate; valid: no, bf16, fp16 (fp8 recipes: torchtitan or Megatron-LM)",
                        source=src, field="mixed_precision")
    kit.check_dtype({"no": "fp32"}.get(mixed, mixed), training_dtype(model), src, "mixed_precision")
    fsdp = {(k if k.startswith("fsdp_") else f"fsdp_{k}"): v for k, v in kit.section(doc, "fsdp_config", src).items()}
    kit.check_keys(fsdp, ACCELERATE_FSDP, src, "fsdp_config.", " (accelerate would silently ignore it)")
    rep, shard, tp, cp = _accelerate_degrees(doc, kind, world, src)
    zero, hybrid = _accelerate_zero(fsdp, src) if kind == "FSDP" else (0, False)
    if hybrid:  # FSDP1 hybrid sharding: shard inside a node, replicate across nodes
        rep, shard = kit.split_data_parallel(rep * shard, world // (kit.integer(doc, "num_machines", src) or 1),
                                             src, "num_machines")
    if kind == "FSDP" and shard * cp == 1:
        raise SpecError("FSDP needs a dimension to shard over (dp_shard or cp > 1)", source=src,
                        field="parallelism_config")
    if kind != "FSDP" and shard > 1:
        raise SpecError(f"dp_shard={shard} without FSDP shards nothing", source=src,
                        field="parallelism_config.parallelism_config_dp_shard_size")
    offload = "cpu" if kit.boolean(fsdp, "fsdp_offload_params", src, "fsdp_config.") else "none"
    full = kit.boolean(fsdp, "fsdp_activation_checkpointing", src, "fsdp_config.")
    n, dp = blocks(model), rep * shard
    ga = grad_accum or kit.grad_accum_for(model.training.global_batch, mbs, dp, src)
    return Plan(tp=tp, cp=cp, dp_replicate=rep, dp_shard=shard, zero=zero, mbs=mbs, grad_accum=ga,
                offload_optimizer=offload, offload_params=offload, recompute=("full" if full else "none",) * n,
                layers_per_stage=(n,))


def _accelerate_degrees(doc: kit.Doc, kind: str, world: int, src: str) -> tuple[int, int, int, int]:
    par = kit.section(doc, "parallelism_config", src)
    kit.check_keys(par, ACCELERATE_PARALLELISM, src, "parallelism_config.")
    if not par:
        return (1, world, 1, 1) if kind == "FSDP" else (world, 1, 1, 1)
    where = "parallelism_config."
    rep, shard, tp, cp, sp = (kit.integer(par, f"parallelism_config_{k}_size", src, where, default=1) or 1
                              for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp"))
    if sp > 1:
        raise SpecError("DeepSpeed-Ulysses sequence parallelism is not modelled by autoplace", source=src,
                        field=f"{where}parallelism_config_sp_size")
    if rep * shard * tp * cp != world:
        raise SpecError(f"dp_replicate({rep}) * dp_shard({shard}) * tp({tp}) * cp({cp}) != num_processes({world})",
                        source=src, field="parallelism_config")
    return rep, shard, tp, cp


def _accelerate_zero(fsdp: kit.Doc, src: str) -> tuple[int, bool]:
    """(ZeRO level, FSDP1 hybrid) from the FSDP version and its resharding setting."""
    version = kit.integer(fsdp, "fsdp_version", src, "fsdp_config.", default=1)
    if version == 2:
        return (3 if kit.boolean(fsdp, "fsdp_reshard_after_forward", src, "fsdp_config.", default=True) else 2), False
    key = "fsdp_sharding_strategy" if "fsdp_sharding_strategy" in fsdp else "fsdp_reshard_after_forward"
    value = fsdp.get(key, "FULL_SHARD")  # a name, or ShardingStrategy's number
    strategy = kit.choice({key: str(value).upper()}, key, _FSDP1_STRATEGY, src, "fsdp_config.", default="")
    return _FSDP1_STRATEGY[strategy], strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "4", "5")
