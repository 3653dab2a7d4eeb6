"""Torch-free helpers shared by the runtime and its callers (tune, verify, calibrate).

* :func:`scaled_model` shrinks a transformer spec the way ``--scale`` does, so a caller can
  score the very model the runtime builds with the cost model;
* :func:`scaled_plan` carries a plan over to the scaled model's layer count;
* :func:`launch_command` is the torchrun command line of one run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from autoplace.errors import BenchmarkError
from autoplace.plan import ZERO_BUBBLE, Plan, even_split
from autoplace.specs.model import ModelSpec, TransformerSpec, model_from_dict


def scaled_model(model: ModelSpec, scale: float) -> TransformerSpec:
    """The model the runtime builds for ``--scale scale``.

    Hidden size (through the head dimension, keeping the head counts so GQA and TP splits stay
    valid), FFN width, vocabulary and layer count are multiplied by ``scale``; the sequence
    length and batch are kept.  A MoE keeps its expert counts and top-k (routing and the
    expert-parallel split stay those of the full model) and shrinks the experts' widths like
    the FFN; ``first_dense_layers`` shrinks with the layers.  ``scale == 1`` returns the spec unchanged.

    Raises:
        BenchmarkError: a layer-graph or MLA model (the runtime builds Llama blocks, dense or MoE).
    """
    if not isinstance(model, TransformerSpec):
        raise BenchmarkError("the runtime builds Llama-style transformers only; a layer-graph model cannot be run")
    if model.attention is not None:
        raise BenchmarkError("the runtime builds Llama attention only (no MLA)")
    if not 0 < scale <= 1:
        raise BenchmarkError(f"scale must hold 0 < scale <= 1, but got scale={scale}")
    if scale == 1:
        return model
    head_dim = max(2, 2 * round(model.dim_head * scale / 2))  # even, for rotary embeddings
    data = model.model_dump(exclude_none=True)
    data.update(name=f"{model.name}@{scale:g}", layers=max(1, round(model.layers * scale)),
                hidden=head_dim * model.heads, ffn_hidden=max(8, round(model.ffn_hidden * scale)),
                vocab=max(64, round(model.vocab * scale)))
    if model.moe is not None:
        data["moe"] = _scaled_moe(data["moe"], scale)
    data.pop("head_dim", None)
    return model_from_dict(data, source="<scaled model>")  # type: ignore[return-value]


def _scaled_moe(moe: dict[str, Any], scale: float) -> dict[str, Any]:
    """The MoE fields of a scaled model: expert widths as the FFN's, dense prefix as the layers."""
    width = {k: max(8, round(moe[k] * scale)) for k in ("expert_ffn_hidden", "shared_ffn_hidden") if moe.get(k)}
    return {**moe, **width, "first_dense_layers": round(moe.get("first_dense_layers", 0) * scale)}


def scaled_plan(plan: Plan, layers: int) -> Plan:
    """``plan`` for a model of ``layers`` blocks: stages re-split evenly, recompute resampled."""
    if sum(plan.layers_per_stage) == layers:
        return plan
    if layers < plan.pp * plan.vpp or layers % plan.vpp:
        raise BenchmarkError(f"the scaled model has {layers} layers: pp={plan.pp} stages of vpp={plan.vpp} "
                             "virtual stages need a multiple of vpp, at least pp * vpp")
    old = plan.recompute or ("none",)
    recompute = tuple(old[i * len(old) // layers] for i in range(layers))
    stages = tuple(n * plan.vpp for n in even_split(layers // plan.vpp, plan.pp))
    return plan.replace(layers_per_stage=stages, recompute=recompute)


def virtual_stages(plan: Plan, pp_rank: int) -> list[tuple[int, int, int]]:
    """(virtual stage index, first block, stop block) of every model chunk ``pp_rank`` holds.

    Megatron's interleaving: the model is cut into ``pp * vpp`` chunks in order and rank r
    holds chunks r, r + pp, r + 2 pp, ...; a chunk of rank r has ``layers_per_stage[r] / vpp``
    blocks (``rules`` checks the divisibility).  With vpp = 1 this is the plain stage split.
    """
    sizes = [plan.layers_per_stage[v % plan.pp] // plan.vpp for v in range(plan.pp * plan.vpp)]
    starts = [sum(sizes[:v]) for v in range(len(sizes))]
    return [(v, starts[v], starts[v] + sizes[v]) for v in range(pp_rank, len(sizes), plan.pp)]


def unsupported_reason(plan: Plan, framework: str = "native") -> str | None:
    """Why the runtime cannot run ``plan`` with ``framework`` (``native`` or ``deepspeed``), or None."""
    why = compress_reason(plan, framework)
    if why:
        return why
    if framework == "deepspeed":
        return _deepspeed_reason(plan)
    if "nvme" in (plan.offload_params, plan.offload_optimizer):
        return "NVMe offload is not implemented by the runtime"
    if plan.schedule in ZERO_BUBBLE:  # worker._schedule builds GPipe, 1F1B and Interleaved1F1B
        return f"schedule={plan.schedule}: the runtime runs gpipe, 1f1b and interleaved pipelines"
    if plan.pp_embedding or plan.pp_loss:  # virtual_stages cuts each rank's blocks into equal chunks
        return "pp_embedding / pp_loss: the runtime's pipelines cut equal chunks and do not count the embedding or loss"
    if plan.offload_optimizer != "none" and plan.zero == 0:
        return "optimizer offload needs zero >= 1 (FSDP2 CPUOffloadPolicy)"
    return None


def compress_reason(plan: Plan, framework: str = "native") -> str | None:
    """Why the runtime cannot run ``plan``'s communication compression with ``framework``, or None.

    A compressed plan must be refused rather than run uncompressed: its trial would be labelled
    with the plan but measure another one.  The native runtime runs bf16 (FSDP2's reduce dtype, a
    bf16 DDP hook) and PowerSGD (PyTorch's DDP hook, so zero 0 without tp or pp); the DeepSpeed
    path runs none (its trial config carries no compression keys).
    """
    c = plan.compress
    if c == "none":
        return None
    if c == "zeropp":
        return ("compress=zeropp (ZeRO++) cannot run in the runtime: its int8 weight gathers and int4 gradient "
                "reduce-scatters need DeepSpeed's CUDA quantization kernels (no CPU or PyTorch-native "
                "implementation); run the emitted DeepSpeed bundle on GPUs instead")
    if framework == "deepspeed":
        return f"compress={c} is not run by the DeepSpeed path (its config has no such option); use --trainer native"
    if c == "powersgd" and (plan.zero != 0 or plan.tp > 1 or plan.pp > 1):
        return (f"compress=powersgd runs as PyTorch's DDP comm hook, so the runtime needs zero=0 and tp=pp=1, "
                f"but got zero={plan.zero}, tp={plan.tp}, pp={plan.pp}")
    if c == "powersgd" and plan.dp * plan.cp == 1:
        return "compress=powersgd needs data-parallel replicas (dp * cp > 1): there is no gradient reduction to compress"
    return None


def deviation(plan: Plan, framework: str = "native") -> str | None:
    """How a trial of ``plan`` departs from the plan's semantics, or None when it runs them exactly.

    The trial still runs and is labelled with ``plan``; ``calibrate`` leaves deviating trials out
    of its fit (their memory, and with offload their traffic, are another plan's).  DeepSpeed
    runs ZeRO-1/2 and optimizer-only CPU offload natively; PyTorch-native FSDP2 has neither.
    """
    if framework == "deepspeed":
        return None
    notes = []
    sharded = plan.dp * plan.cp > 1  # FSDP2 is applied only with more than one data-parallel rank
    if plan.zero in (1, 2) and sharded:
        what = ("gradients reduce-scattered into shards on the last micro-batch, not all-reduced into replicated "
                "buffers; " if plan.zero == 1 else "")
        notes.append(f"zero{plan.zero} ran as FSDP2 reshard_after_forward=False: {what}parameters are sharded "
                     "between steps and gathered for the whole step (ZeRO keeps them replicated)")
    if plan.offload_optimizer == "cpu" and plan.offload_params != "cpu" and plan.zero >= 1 and sharded:
        notes.append("offload_optimizer=cpu ran as FSDP2 CPUOffloadPolicy: parameters and gradients are offloaded "
                     "too (FSDP2 has no optimizer-only offload)")
    if "cpu" in (plan.offload_optimizer, plan.offload_params) and not sharded:
        notes.append("offload not applied: with one data-parallel rank there is no FSDP2 unit to offload")
    return "; ".join(notes) or None


def _deepspeed_reason(plan: Plan) -> str | None:
    """The emitter's own verdict first (what DeepSpeed cannot express), then the runtime's limits."""
    from autoplace.errors import EmitError
    from autoplace.frameworks.deepspeed import check_expressible

    try:
        check_expressible(plan)
    except EmitError as exc:
        return str(exc)
    if plan.tp > 1 or plan.pp > 1 or plan.ep > 1:
        return ("the DeepSpeed path runs data-parallel plans only (tp = pp = ep = 1): DeepSpeed's pipeline engine, "
                "AutoTP and AutoEP need the model written as PipelineModule / under tp_model_init / with MoE layers")
    if "nvme" in (plan.offload_params, plan.offload_optimizer):
        return "NVMe offload cannot run here: DeepSpeed's async I/O op needs libaio"
    return None


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """A plan as the JSON the worker reads (every field, recompute per layer)."""
    return {"tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep, "dp_replicate": plan.dp_replicate,
            "dp_shard": plan.dp_shard, "vpp": plan.vpp, "sp": plan.sp, "zero": plan.zero, "mbs": plan.mbs,
            "grad_accum": plan.grad_accum, "schedule": plan.schedule, "offload_optimizer": plan.offload_optimizer,
            "offload_params": plan.offload_params, "compress": plan.compress, "powersgd_rank": plan.powersgd_rank,
            "pp_embedding": plan.pp_embedding, "pp_loss": plan.pp_loss,
            "recompute": list(plan.recompute), "layers_per_stage": list(plan.layers_per_stage)}


def plan_from_json(data: dict[str, Any]) -> Plan:
    """Inverse of :func:`plan_to_json`; unknown keys are refused."""
    fields = set(Plan.__dataclass_fields__) - {"extra"}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise BenchmarkError(f"unknown plan key(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    values = dict(data)
    for key in ("recompute", "layers_per_stage"):
        if key in values:
            values[key] = tuple(values[key])
    return Plan(**values)


def write_inputs(directory: Path, model: ModelSpec, plan: Plan) -> tuple[Path, Path]:
    """Write the model and plan JSON files a worker reads; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    model_path, plan_path = directory / "model.json", directory / "plan.json"
    model_path.write_text(json.dumps(model.model_dump(exclude_none=True)))
    plan_path.write_text(json.dumps(plan_to_json(plan)))
    return model_path, plan_path


def launch_command(world: int, plan_path: Path, model_path: Path, out: Path, *, steps: int = 3, warmup: int = 1,
                   scale: float = 1.0, backend: str = "gloo", framework: str = "native",
                   extra: list[str] | None = None) -> list[str]:
    """The torchrun command of one run on this host (``--standalone``: a fresh rendezvous per run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "autoplace.runtime.worker", "--plan-json", str(plan_path), "--model-json", str(model_path),
            "--out", str(out), "--steps", str(steps), "--warmup", str(warmup), "--scale", str(scale),
            "--backend", backend, "--framework", framework, *(extra or [])]
