"""Emitters: a plan written as the configs and launch scripts of the frameworks users run.

One orchestrator, :func:`emit`, calls a small emitter per format and writes a bundle with a
README.txt line per file.  Each emitter is a pure function of (plan, model, cluster) that
raises :class:`~autoplace.errors.EmitError` when the framework cannot express the plan.
Readers that turn existing configs back into a Plan are in :mod:`autoplace.emit.read`.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from autoplace.capabilities import FRAMEWORKS, FSDP2_FRAMEWORKS, ZERO_FRAMEWORKS, bf16_recipe
from autoplace.emit._common import comment_safe
from autoplace.emit.accelerate import emit_accelerate
from autoplace.emit.deepspeed import emit_deepspeed
from autoplace.emit.fsdp import emit_fsdp_module
from autoplace.emit.launch import (
    DEFAULT_LAUNCH,
    Launch,
    emit_accelerate_launch,
    emit_deepspeed_launch,
    emit_k8s,
    emit_slurm,
    emit_torchrun,
)
from autoplace.emit.megatron import emit_megatron
from autoplace.emit.torchtitan import emit_torchtitan, torchtitan_model_module, torchtitan_overrides, torchtitan_toml
from autoplace.errors import EmitError, SpecError
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

__all__ = ["FORMATS", "FILES", "Launch", "emit", "render", "emit_accelerate", "emit_deepspeed",
           "emit_deepspeed_launch", "emit_fsdp_module", "emit_k8s", "emit_megatron", "emit_slurm",
           "emit_torchrun", "emit_torchtitan", "torchtitan_overrides"]

log = logging.getLogger("autoplace")

FORMATS = ("deepspeed", "accelerate", "fsdp", "torchtitan", "megatron", "torchrun", "deepspeed-launch", "slurm",
           "k8s")
# format -> (file name, what the README says it is)
FILES = {
    "deepspeed": ("ds_config.json", "DeepSpeed config (deepspeed.initialize(config=...) or --deepspeed_config)"),
    "accelerate": ("accelerate_config.yaml", "accelerate config, FSDP2 (accelerate launch --config_file ...)"),
    "fsdp": ("fsdp2_parallelize.py", "PyTorch module applying the plan: DeviceMesh, DTensor TP, AC, FSDP2"),
    "torchtitan": ("torchtitan.toml", "torchtitan 0.2.2 job config (--job.config_file ...; set "
                                      "--model.hf_assets_path to your tokenizer)"),
    "torchtitan-model": ("autoplace_torchtitan_model.py", "torchtitan model flavor 'autoplace' with this model's "
                         'shapes, imported by torchtitan.toml (the launch scripts put the bundle on PYTHONPATH)'),
    "torchtitan-overrides": ("torchtitan_overrides.sh", 'the same job as torchtitan 0.2.2 overrides in a bash array: '
                             'source it, then pass "${TORCHTITAN_OVERRIDES[@]}"'),
    "megatron": ("megatron_args.sh", 'Megatron-LM arguments as a bash array: source it, then pass "${MEGATRON_ARGS[@]}" '
                                     "(tp/cp without Megatron-FSDP need CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell)"),
    "torchrun": ("launch_torchrun.sh", "torchrun launch, run on every node (MASTER_ADDR = first node)"),
    "deepspeed-launch": ("launch_deepspeed.sh", "deepspeed launcher with ds_config.json"),
    "slurm": ("job.sbatch", "Slurm batch script: sbatch job.sbatch"),
    "k8s": ("pytorchjob.yaml", "Kubeflow PyTorchJob manifest: set its image, create the bundle's ConfigMap "
                               "(the manifest's autoplace/bundle annotation), then kubectl apply -f pytorchjob.yaml"),
    "accelerate-launch": ("launch_accelerate.sh", "accelerate launch with accelerate_config.yaml, run on every node "
                                                  "(NODE_RANK or SLURM_NODEID, MASTER_ADDR)"),
}


def recipe_note(fmt: str, model: ModelSpec, plan: Plan | None = None) -> str:
    """A README remark when the framework of ``fmt`` splits the training states differently from
    the bf16 recipe the plan was costed with (the totals agree; the split and the bytes moved do not)."""
    recipe = model.training.recipe()
    if recipe.compute_dtype != "bf16" or fmt not in FRAMEWORKS:
        return ""
    want = bf16_recipe(fmt)
    if fmt in FSDP2_FRAMEWORKS and recipe.master_copy:  # the emitted fsdp module and torchtitan reduce in fp32
        fp32_reduce = fmt != "accelerate" and (plan is None or plan.compress != "bf16")  # bf16: reduce_dtype bf16
        return (" [costed with the ZeRO recipe, 2 + 2 + 12 B per parameter and 16-bit gradient reduction; FSDP2 "
                "keeps fp32 shards, 4 + 4 + 8 B" + (", and this config reduce-scatters in fp32" if fp32_reduce
                                                   else "") + f": plan with training.precision {want} for its exact bytes]")
    if fmt in ZERO_FRAMEWORKS and not recipe.master_copy:
        return (" [costed with FSDP2's recipe (fp32 shards, no master copy); this framework keeps 16-bit weights and "
                f"an fp32 master copy: plan with training.precision {want} for its exact bytes]")
    return ""


def _json(doc: Any) -> str:
    return json.dumps(doc, indent=2) + "\n"


def _yaml(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def bash_array(name: str, words: list[str], what: str) -> str:
    """A sourceable bash array of ``words``, one flag and its values per line, every word quoted.

    An array, not a plain list: ``$(cat file)`` would glob-expand values such as Megatron's
    layout ``Et*9|t*11`` or ``[0,1,1]``.
    """
    lines = [f"# {what} generated by autoplace", f"{name}=("]
    current: list[str] = []
    for word in words:
        if word.startswith("--") and current:
            lines.append("  " + " ".join(current))
            current = []
        current.append(shlex.quote(word))
    if current:
        lines.append("  " + " ".join(current))
    return "\n".join([*lines, ")"]) + "\n"


def _deepspeed_launch(plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> str:
    emit_deepspeed(plan, model, cluster)  # the launcher is no use without a config DeepSpeed accepts
    return emit_deepspeed_launch(plan, model, cluster, launch)


def _accelerate_launch(plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> str:
    emit_accelerate(plan, model, cluster)
    return emit_accelerate_launch(plan, model, cluster, launch)


Renderer = Callable[[Plan, ModelSpec, ClusterSpec, Launch], str]
RENDERERS: dict[str, Renderer] = {
    "deepspeed": lambda p, m, c, launch: _json(emit_deepspeed(p, m, c)),
    "accelerate": lambda p, m, c, launch: _yaml(emit_accelerate(p, m, c)),
    "fsdp": lambda p, m, c, launch: emit_fsdp_module(p, m, c),
    "torchtitan": lambda p, m, c, launch: torchtitan_toml(
        emit_torchtitan(p, m, c), f"torchtitan job config generated by autoplace\nplan: {p.to_string()}"),
    "torchtitan-model": lambda p, m, c, launch: torchtitan_model_module(p, m, c),
    "torchtitan-overrides": lambda p, m, c, launch: bash_array(
        "TORCHTITAN_OVERRIDES", torchtitan_overrides(p, m, c), "torchtitan 0.2.2 command-line overrides"),
    "megatron": lambda p, m, c, launch: bash_array("MEGATRON_ARGS", emit_megatron(p, m, c), "Megatron-LM arguments"),
    "torchrun": emit_torchrun,
    "deepspeed-launch": lambda p, m, c, launch: _deepspeed_launch(p, m, c, launch),
    "accelerate-launch": lambda p, m, c, launch: _accelerate_launch(p, m, c, launch),
    "slurm": emit_slurm,
    "k8s": lambda p, m, c, launch: _yaml(emit_k8s(p, m, c, launch)),
}


def render(fmt: str, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch = DEFAULT_LAUNCH) -> str:
    """The text of one format's file.

    Raises:
        SpecError: an unknown format (the message lists the valid ones).
        EmitError: the format cannot express the plan.
    """
    if fmt not in RENDERERS:
        raise SpecError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}", field="format")
    return RENDERERS[fmt](plan, model, cluster, launch)


def emit(plan: Plan, model: ModelSpec, cluster: ClusterSpec, formats: Sequence[str] | None, out_dir: str | Path,
         *, launch: Launch | None = None, strict: bool | None = None) -> dict[str, Path]:
    """Write the files of ``formats`` (all when None) into ``out_dir`` with a README.txt line per file.

    Args:
        plan, model, cluster: what to emit.
        formats: names from FORMATS.  When None, every format that can express the plan is
            written and the others are listed in README.txt with the reason; when given, a
            format that cannot express the plan raises.  torchtitan also writes its
            overrides (``torchtitan-overrides``) and, for a model that is none of its own
            flavors, the module registering its shapes (``torchtitan-model``).
        out_dir: the bundle directory (created).
        launch: script, arguments and job name for the launch scripts; a bundle directory
            left at its default (".") is found by the scripts at run time (the bundle moves).
        strict: raise when a format cannot express the plan (default: when ``formats`` is
            given); otherwise README.txt lists it with the reason.

    Returns:
        format -> path of the file written.

    Raises:
        SpecError: an unknown format name.
        EmitError: a requested format cannot express the plan.
    """
    strict = formats is not None if strict is None else strict
    wanted = list(FORMATS if formats is None else formats)
    for fmt in wanted:
        if fmt not in FORMATS:
            raise SpecError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}", field="format")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    launch = launch or DEFAULT_LAUNCH  # bundle_dir "." (the default): scripts find the bundle at run time
    for fmt, extra in _COMPANIONS.items():
        if fmt in wanted:
            wanted[wanted.index(fmt) + 1:wanted.index(fmt) + 1] = list(extra)
    written: dict[str, Path] = {}
    readme = [f"autoplace bundle for {comment_safe(model.name)} on {comment_safe(cluster.name)}",
              f"plan: {plan.to_string()}", ""]
    for fmt in dict.fromkeys(wanted):
        name, what = FILES[fmt]
        try:
            text = render(fmt, plan, model, cluster, launch)
        except EmitError as exc:
            if strict and fmt not in _COMPANION_FORMATS:  # companions come along; never asked for alone
                raise
            log.info("not emitted: %s", exc)
            if fmt not in _COMPANION_FORMATS:
                readme.append(f"(not written) {name}: {exc}")
            continue
        if not text:  # a companion with nothing to say (torchtitan's own flavor needs no model module)
            continue
        written[fmt] = _write(out / name, text, executable=fmt in _EXECUTABLE)
        readme.append(f"{name}: {what}{recipe_note(fmt, model, plan)}")
    (out / "README.txt").write_text("\n".join(readme) + "\n")
    return written


_EXECUTABLE = {"torchrun", "deepspeed-launch", "slurm", "accelerate-launch"}
# files written along with a format when it is written (never asked for alone)
_COMPANIONS = {"torchtitan": ("torchtitan-model", "torchtitan-overrides"), "accelerate": ("accelerate-launch",)}
_COMPANION_FORMATS = {f for extra in _COMPANIONS.values() for f in extra}


def _write(path: Path, text: str, *, executable: bool) -> Path:
    path.write_text(text)
    if executable:
        path.chmod(0o755)
    return path

