"""DeepSpeed's dry run: what ``train.py --deepspeed --deepspeed_config ds_config.json`` builds on one rank
before its first step, by DeepSpeed's own code on a fake process group and the meta device.

The bundle runs the user's script with the user's Hugging Face model, so the dry run builds DeepSpeed's side
of what that script does (:func:`dry_run`, step by step):

1. DeepSpeed's own arguments in the launch's words (``deepspeed.add_config_arguments``): the config file;
2. the config as DeepSpeed loads it (``load_ds_config``; the ``pipeline`` section by ``get_pipeline_config``);
3. the model (:mod:`autoplace.dryrun.hf_model`) -- for a pipeline, cut into DeepSpeed's ``PipelineModule`` with the
   config's ``stages`` and ``partition``, whose topology places the rank on its stage;
4. ``DeepSpeedConfig`` at the world size, with the pipeline's grid as its mpu (the data-parallel size the batch
   identity checks is world / stages, not the world: ECOSYSTEM.md's rank/world trap);
5. ZeRO-3: the model built under ``deepspeed.zero.Init``, each parameter partitioned as it is made;
6. ``deepspeed.initialize`` with a torch AdamW from the script's side: the engine and the ZeRO-1/2/3 (or bf16)
   optimizer over its flat fp32 partitions; ZeRO-Offload with a torch optimizer needs
   ``zero_force_ds_cpu_optimizer: false`` (DeepSpeed's CPU Adam is a JIT-built op, ~55 s), set in the dry run's
   copy of the config only, and said;
7. the optimizer state the first step creates (the basic optimizer stepped once over the meta partitions) and
   the gradient buffers the first backward allocates (:mod:`autoplace.frameworks._deepspeed_bytes`).

Where DeepSpeed cannot build without a GPU it is redirected to the meta device
(:mod:`autoplace.frameworks._deepspeed_meta`); NVMe offload needs libaio and DeepSpeed's AIO op: skipped.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.dryrun.hf_model import causal_lm, causal_lm_class, model_source
from autoplace.dryrun.launches import BUNDLE
from autoplace.frameworks._deepspeed_bytes import measure
from autoplace.frameworks._deepspeed_meta import deepspeed_world

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

ARGUMENTS = "DeepSpeed's arguments in the launch words (deepspeed.add_config_arguments)"
LR = 1e-4  # any: the dry run takes no real step


def dry_run(ctx: DryContext, steps: Steps) -> None:
    """Build rank ``ctx.rank`` of a DeepSpeed bundle (the module docstring lists the steps)."""
    with steps.step(ARGUMENTS, fix=_fix_arguments):
        path = config_path(ctx.launched.args, ctx.bundle)
    with steps.step(f"{path.name} as DeepSpeed loads it (load_ds_config, get_pipeline_config)"):
        from deepspeed.runtime.config import get_pipeline_config
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

        param_dict = load_ds_config(str(path))
        stages = get_pipeline_config(param_dict)["stages"]
    with steps.step("transformers' config of the model", fix=_fix_model):
        source = model_source(ctx)
    steps.note(source.said)
    with deepspeed_world(ctx, steps):
        build(ctx, steps, param_dict, source.config, stages if isinstance(stages, int) else 1)


def config_path(words: tuple[str, ...], bundle: Path) -> Path:
    """The config file the words give ``--deepspeed_config`` (parsed by DeepSpeed's own argument group),
    the bundle's directory written out.

    Raises:
        ValueError: the words do not enable DeepSpeed or name no config file.
    """
    import deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser(add_help=False))
    known, _ = parser.parse_known_args(list(words))
    if not known.deepspeed or not known.deepspeed_config:
        missing = "--deepspeed" if not known.deepspeed else "--deepspeed_config"
        raise ValueError(f"the program's words have no {missing}: the script would not run DeepSpeed with the "
                         "bundle's config")
    return Path(known.deepspeed_config.replace(BUNDLE, str(bundle)))


def build(ctx: DryContext, steps: Steps, param_dict: dict[str, Any], config: Any, stages: int) -> None:
    """Steps 3-7 of the module docstring, inside the fake world."""
    import deepspeed
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    name = type(config).__name__.replace("Config", "")
    module, mpu = None, None
    if stages > 1:
        with steps.step(f"transformers' {name} model on the meta device"):
            model = causal_lm(config)
        with steps.step(f"DeepSpeed's PipelineModule: {stages} stages, partition_method "
                        f"{param_dict['pipeline'].get('partition', 'parameters')!r}", fix=_fix_config):
            module = pipeline_module(model, stages, param_dict["pipeline"].get("partition", "parameters"))
            mpu = module.mpu()
        steps.stage(module.stage_id)
    with steps.step(f"DeepSpeedConfig at {ctx.world} ranks: data-parallel size, batch identity, ZeRO section",
                    fix=_fix_config):
        ds_config = DeepSpeedConfig(copy.deepcopy(param_dict), mpu)
    steps.note(f"DeepSpeed's data-parallel size {ds_config.world_size}: train_batch_size "
               f"{ds_config.train_batch_size} = micro-batch {ds_config.train_micro_batch_size_per_gpu} x accumulation "
               f"{ds_config.gradient_accumulation_steps} x {ds_config.world_size}")
    stage = ds_config.zero_optimization_stage
    if module is None:
        module = _model(steps, config, name, param_dict, stage)
        steps.stage(0)
    engine_config = _engine_config(steps, param_dict, ds_config)
    with steps.step(f"deepspeed.initialize: the engine and its ZeRO-{stage} optimizer (torch AdamW from the script)",
                    fix=_fix_config):
        client = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR, foreach=False)
        engine, optimizer, _, _ = deepspeed.initialize(model=module, optimizer=client, config=engine_config)
    steps.note(f"DeepSpeed's optimizer: {type(optimizer).__name__} over {type(engine.basic_optimizer).__name__}")
    with steps.step("the optimizer state and gradient buffers the first step creates"):
        first_step_state(engine)
    measure(engine, steps, planned_host(ctx.bundle))


def planned_host(bundle: Path) -> int | None:
    """plan.json's host bytes per GPU of the offloaded states (``host_memory_per_gpu_bytes.offloaded``)."""
    import json

    host = json.loads((bundle / "plan.json").read_text()).get("host_memory_per_gpu_bytes", {})
    return int(host["offloaded"]) if isinstance(host.get("offloaded"), int | float) else None


def _model(steps: Steps, config: Any, name: str, param_dict: dict[str, Any], stage: int) -> Any:
    """The model, built under ``deepspeed.zero.Init`` at ZeRO-3 (partitioned as it is made)."""
    import deepspeed

    if stage < 3:
        with steps.step(f"transformers' {name} model on the meta device"):
            return causal_lm(config)
    with steps.step(f"transformers' {name} model under deepspeed.zero.Init (each parameter partitioned as it is made)"):
        causal_lm_class(config)  # its module imported before zero.Init patches nn.Module's subclasses
        with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(param_dict)):
            return causal_lm(config)


def _engine_config(steps: Steps, param_dict: dict[str, Any], ds_config: Any) -> dict[str, Any]:
    """The config deepspeed.initialize gets: the file's, with ``zero_force_ds_cpu_optimizer: false`` under
    ZeRO-Offload (DeepSpeed refuses a torch optimizer there; its CPU Adam is a JIT-built op) -- said."""
    engine_config = copy.deepcopy(param_dict)
    if ds_config.zero_config.offload_optimizer is not None and \
            str(ds_config.zero_config.offload_optimizer.device) not in ("none", "OffloadDeviceEnum.none"):
        engine_config["zero_force_ds_cpu_optimizer"] = False
        steps.note("ZeRO-Offload: the dry run steps a torch AdamW on the host partitions with "
                   "zero_force_ds_cpu_optimizer=false in its copy of the config (DeepSpeed's CPU Adam, which it "
                   "otherwise requires, is a JIT-built op; its fp32 states have the same shapes); the script must "
                   "pass DeepSpeedCPUAdam, or an optimizer section in ds_config.json")
    return engine_config


def pipeline_module(model: Any, stages: int, partition: str) -> Any:
    """DeepSpeed's ``PipelineModule`` over the model's layers in order: the base model's children (its
    block list expanded), then the LM head -- the sequence a pipeline of a Hugging Face model runs."""
    import torch
    from deepspeed.pipe import PipelineModule

    base = model.base_model
    layers: list[Any] = []
    for child in base.children():
        if isinstance(child, torch.nn.ModuleList):
            layers.extend(child)
        elif any(True for _ in child.parameters()):
            layers.append(child)
    head = model.get_output_embeddings()
    if head is not None:
        layers.append(head)
    return PipelineModule(layers=layers, num_stages=stages, partition_method=partition)


def first_step_state(engine: Any) -> None:
    """What the first step allocates before it updates: the gradient buckets (DeepSpeed's own
    ``setup_buckets``, ZeRO-1/2) and the basic optimizer's state (Adam's exp_avg and exp_avg_sq are made
    lazily by its first step): the optimizer is stepped once over its meta fp32 partitions with zero
    gradients -- at ZeRO-3 sub-group by sub-group, by DeepSpeed's own ``_optimizer_step``."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "setup_buckets"):
        optimizer.setup_buckets()
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3 steps each sub-group's fp32 partition
        for i, partition in enumerate(optimizer.fp32_partitioned_groups_flat):
            with _zero_grads([partition]):
                optimizer._optimizer_step(i)
        return
    basic = engine.basic_optimizer
    with _zero_grads([p for group in basic.param_groups for p in group["params"]]):
        basic.step()


@contextmanager
def _zero_grads(params: list[Any]) -> Iterator[None]:
    """Zero gradients (meta) on ``params`` that have none, taken back afterwards."""
    import torch

    lent = [p for p in params if p.grad is None]
    for p in lent:
        p.grad = torch.zeros_like(p)
    try:
        yield
    finally:
        for p in lent:
            p.grad = None


def _fix_arguments(exc: BaseException) -> str | None:
    del exc
    return ('pass DeepSpeed its config in the script\'s words: train.py --deepspeed --deepspeed_config '
            '"$AUTOPLACE_BUNDLE"/ds_config.json (deepspeed.add_config_arguments)')


def _fix_model(exc: BaseException) -> str | None:
    del exc
    return "give the Hugging Face model after --: autoplace dryrun BUNDLE -- --model DIR_OR_HUB_ID"


def _fix_config(exc: BaseException) -> str | None:
    """The fix for DeepSpeed's refusals of the config that autoplace knows."""
    text = str(exc)
    if "train_batch_size" in text or "micro_batch" in text or "gradient_acc" in text:
        return ("make train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                "data-parallel size (world / (pipeline stages x tensor parallel)) in ds_config.json, or re-run "
                "autoplace solve --out")
    if "must divide" in text:
        return "make pipeline.stages divide the world size (nodes x processes per node), or re-run autoplace solve"
    return None
