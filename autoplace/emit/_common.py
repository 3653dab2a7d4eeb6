"""Small helpers every emitter shares: precision, layer counts, pipeline chunks, launch geometry.

Nothing here knows a framework; each function answers one question about a plan, a model
or a cluster in the terms the emitters need, and raises :class:`EmitError` (naming the
format) when the plan cannot be put that way.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from autoplace.cost.layers import layer_table
from autoplace.errors import EmitError
from autoplace.plan import Plan, model_chunks, stage_slots
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

# The model recipe's compute dtype -> the 16-bit (or fp32) training mode frameworks configure.
# fp8 GEMMs run inside bf16 mixed precision (Transformer Engine / torchao recipes), so the
# config carries bf16 and the fp8 recipe is the model code's business.
_TRAINING_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16", "tf32": "fp32", "fp32": "fp32"}


def fail(fmt: str, message: str) -> EmitError:
    """An EmitError whose message starts with the format's name."""
    return EmitError(f"{fmt}: {message}")


def training_dtype(model: ModelSpec) -> str:
    """``bf16``, ``fp16`` or ``fp32``: the mixed-precision mode the model's recipe implies."""
    return _TRAINING_DTYPE[model.training.recipe().compute_dtype]


def fp32_grad_accumulation(model: ModelSpec) -> bool:
    """Whether the recipe keeps 16-bit weights but accumulates gradients in fp32 (Megatron's default)."""
    recipe = model.training.recipe()
    return recipe.param_bytes == 2 and recipe.grad_bytes == 4


def blocks(model: ModelSpec) -> int:
    """Number of repeated blocks (transformer layers) the plan splits over pipeline stages."""
    return layer_table(model).blocks


def uniform_recompute(plan: Plan) -> str | None:
    """The recompute mode shared by every block, or None when blocks differ."""
    modes = set(plan.recompute)
    if not modes:
        return "none"
    return modes.pop() if len(modes) == 1 else None


def recompute_runs(plan: Plan) -> str:
    """The per-block recompute modes as runs, for messages: ``full x3, none x77``."""
    runs: list[list] = []
    for mode in plan.recompute:
        if runs and runs[-1][0] == mode:
            runs[-1][1] += 1
        else:
            runs.append([mode, 1])
    return ", ".join(f"{mode} x{n}" for mode, n in runs)


def model_parts(plan: Plan, fmt: str) -> list[int]:
    """Blocks in each of the ``pp * vpp`` model chunks, in virtual-stage order
    (:func:`autoplace.plan.model_chunks`: chunk ``v * pp + r`` is the v-th chunk of pipeline
    rank r; with ``pp_embedding`` / ``pp_loss`` the first chunk holds the embedding and the last
    the loss in place of a block).

    Raises:
        EmitError: a stage's block count (with its embedding / loss place) is not a positive
            multiple of vpp.
    """
    parts = model_chunks(plan.layers_per_stage, plan.vpp, plan.pp_embedding, plan.pp_loss)
    if parts is None:
        slots = stage_slots(plan.pp, plan.pp_embedding, plan.pp_loss)
        r, n = next((r, n) for r, n in enumerate(plan.layers_per_stage)
                    if (n + slots[r]) % plan.vpp or n + slots[r] < plan.vpp)
        counted = f" (+{slots[r]} for the {'embedding' if r == 0 and plan.pp_embedding else 'loss'})" if slots[r] else ""
        raise fail(fmt, f"stage {r} holds {n} layers{counted}, not a positive multiple of vpp={plan.vpp}")
    return parts


def stage_counts_from_parts(parts: Sequence[int], pp: int) -> tuple[int, ...]:
    """Inverse of :func:`model_parts`: blocks per pipeline rank from the chunks in virtual order."""
    return tuple(sum(parts[r::pp]) for r in range(pp))


def launch_geometry(plan: Plan, cluster: ClusterSpec, fmt: str) -> tuple[int, int]:
    """(nodes, processes per node) that run the plan's ``world`` ranks.

    Raises:
        EmitError: pools with different GPUs per node (one launcher command line cannot
            start a different process count per node), or a world that fills no whole nodes.
    """
    per_node = {p.gpus_per_node for p in cluster.pools}
    if len(per_node) > 1:
        raise fail(fmt, f"node pools have different GPUs per node {sorted(per_node)}; "
                        "a launcher starts the same number of processes on every node")
    gpn = per_node.pop()
    if plan.world <= gpn:
        return 1, plan.world
    if plan.world % gpn:
        raise fail(fmt, f"world size {plan.world} is not a whole number of {gpn}-GPU nodes")
    return plan.world // gpn, gpn


def job_slug(name: str, *, limit: int = 63) -> str:
    """A name safe for Slurm job names and Kubernetes objects: lower-case ``[a-z0-9-]``.

    User text never reaches a scheduler directive or a manifest's name unfiltered.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:limit].strip("-")
    return slug or "autoplace-job"


def comment_safe(text: str) -> str:
    """User text for a ``#`` comment: printable, one line (a newline would end the comment)."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)[:200]


def check_cpu_offload_together(plan: Plan, fmt: str, knob: str) -> None:
    """FSDP2's CPU offload (accelerate, torchtitan) is one switch: host memory only, and
    parameters, gradients and the optimizer step move together.

    Raises:
        EmitError: NVMe offload, or parameters and optimizer offloaded differently.
    """
    if "nvme" in (plan.offload_params, plan.offload_optimizer):
        raise fail(fmt, f"offload_optimizer={plan.offload_optimizer}, offload_params={plan.offload_params}: {knob} "
                        "offloads to CPU memory only, not NVMe")
    if plan.offload_params != plan.offload_optimizer:
        raise fail(fmt, f"{knob} moves parameters, gradients and the optimizer step to the host together; "
                        f"offload_params={plan.offload_params} and offload_optimizer={plan.offload_optimizer} "
                        "must be equal")



# what each compression option is, for messages (autoplace.compression has the full facts)
_COMPRESSION_NAMES = {"bf16": "bf16 gradient reduction", "zeropp": "ZeRO++ (int8 weight gathers, hpZ, int4 gradients)",
                      "powersgd": "PowerSGD low-rank gradient compression"}


def check_compression(plan: Plan, fmt: str, supported: Collection[str]) -> None:
    """Refuse a ``compress`` option the framework of ``fmt`` cannot run: one rule for every
    framework, given the options it declares (``Framework.compressions``), so the search and
    the emitters agree on which framework runs which option.

    Raises:
        EmitError: naming the option, and compress=none.
    """
    if plan.compress == "none" or plan.compress in supported:
        return
    what = _COMPRESSION_NAMES.get(plan.compress, plan.compress)
    raise fail(fmt, f"compress={plan.compress}: {fmt} has no configuration for {what}; plan with compress=none "
                    "(solve --allow compress finds the frameworks that run it)")
