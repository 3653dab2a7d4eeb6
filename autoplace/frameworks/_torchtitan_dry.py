"""torchtitan 0.2.2's dry run: what one rank of a bundle's launch builds before step 1, by torchtitan's own code.

torchtitan's ``Trainer.__init__`` needs CUDA (``set_device``) even with ``--comm.mode fake_backend``, so the
dry run goes below it and calls, in the trainer's order (torchtitan/train.py, 0.2.2), the pieces it calls:
``ConfigManager.parse_args`` on the launch's words, ``ParallelDims`` and its ``build_mesh`` on the fake
process group, the experimental ``custom_import`` and the train spec's flavor, ``model_cls`` on the meta
device (its float8 / mx converters, which check for an SM89+ GPU, skipped), the batch check, the train
spec's loss, its ``pipelining_fn`` (split, the rank's
stages, ``parallelize_fn`` per chunk, ``build_pipeline_schedule``) or ``parallelize_fn`` alone,
``build_optimizers_fn`` and ``build_lr_schedulers_fn``.  Optimizer state, which torch creates at the
first step, is created by torch's own ``Adam._init_group`` on the meta shards; the bytes per state
come from FSDP2's own structures (:mod:`autoplace.frameworks._torchtitan_bytes`).

What is redirected (and said with ``steps.note``): torchtitan's device type (``cuda`` on a machine
without an accelerator) is ``cpu`` for the mesh and the pipeline stages; without triton, the one
torchtitan module that imports it (the MoE permute kernel, used only in a forward) is a stand-in.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import io
import sys
import types
from collections.abc import Iterator
from typing import Any

from autoplace.dryrun.launches import BUNDLE
from autoplace.dryrun.steps import DryContext, Fix, StepFailed, Steps, fake_world
from autoplace.frameworks._torchtitan_bytes import patched
from autoplace.frameworks._torchtitan_fixes import (
    batch_fix,
    config_fix,
    degrees_fix,
    flavor_fix,
    schedule_fix,
    seq_fix,
    split_fix,
)

KERNELS = "torchtitan.models.moe.kernels"  # the one torchtitan module that imports triton (0.2.2)


def import_torchtitan() -> types.ModuleType:
    """``import torchtitan``, with a stand-in for its MoE permute kernel module where triton is not
    installed (``import torchtitan`` imports it through the quantization converters; ECOSYSTEM.md).

    The stand-in stays in ``sys.modules`` (a real import would fail the same way each time); calling its
    kernel raises, naming triton -- only a MoE forward calls it, and a dry run runs none.
    """
    if importlib.util.find_spec("triton") is None and KERNELS not in sys.modules:
        kernels = types.ModuleType(KERNELS)
        kernels.__doc__ = "autoplace's stand-in: triton is not installed (torchtitan's MoE permute kernel needs it)"

        def needs_triton(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torchtitan's MoE permute kernel needs triton, which is not installed here")

        kernels.autoplace_stand_in = True  # type: ignore[attr-defined]
        kernels.generate_permute_indices = needs_triton  # type: ignore[attr-defined]
        kernels.fill_indices_wrapper = needs_triton  # type: ignore[attr-defined]
        sys.modules[KERNELS] = kernels
    return importlib.import_module("torchtitan")


def dry_run(ctx: DryContext, steps: Steps) -> None:
    """Build rank ``ctx.rank`` of the bundle's torchtitan launch (see the module docstring)."""
    with steps.step("import torchtitan 0.2.2", fix=lambda exc: "install torchtitan 0.2.2 (pip install "
                    "torchtitan==0.2.2 --no-deps tyro tomli tokenizers)" if isinstance(exc, ImportError) else None):
        import_torchtitan()
    if getattr(sys.modules.get(KERNELS), "autoplace_stand_in", False):
        steps.note(f"triton is not installed: {KERNELS} (the MoE permute kernel, called in a forward only) "
                   "is a stand-in")
    if ctx.launched.entry != "torchtitan.train":
        steps.note(f"the launch runs {ctx.launched.entry}, not torchtitan.train: its words are read as "
                   "torchtitan.train reads them")
    with _launch_path(ctx), _restored_globals(), fake_world(ctx.world, ctx.rank):
        _build(ctx, steps)


def _build(ctx: DryContext, steps: Steps) -> None:
    """The trainer's build, step by step, on the fake world."""
    from autoplace.frameworks._torchtitan_bytes import create_optimizer_state, init_fsdp_dtypes, measure

    job, dims = _job_and_mesh(ctx, steps)
    with steps.step(f"the model's args: train spec {job.model.name!r}, flavor {job.model.flavor!r}"
                    + (f" (custom_import {job.experimental.custom_import})" if job.experimental.custom_import
                       else ""), fix=lambda exc: flavor_fix(exc, job, ctx)):
        spec, args = _model_args(job)
    with steps.step(f"{spec.model_cls.__name__} on the meta device, in the job's dtype ({job.training.dtype})"):
        model = _model(job, spec, args)
    if job.model.converters:
        steps.skip(f"the model converters ({', '.join(job.model.converters)})",
                   "torchao's float8 / mx converters check for an SM89+ GPU (and need torchao); they swap the "
                   "Linear layers' class, not their parameters, so the bytes below are the same")
    steps.skip("the tokenizer and the dataloader", "they read --model.hf_assets_path and the dataset, which the "
                                                    "bundle does not hold (nothing they build is the plan's)")
    with steps.step("the batch sizes Trainer.__init__ checks", fix=lambda exc: batch_fix(job, dims)):
        _accumulation(job, dims)
    with steps.step("the train spec's loss function"):
        loss_fn = spec.build_loss_fn(job, parallel_dims=dims)
    if dims.pp_enabled:
        parts, deferred = _pipeline(job, spec, args, model, dims, loss_fn, steps), True
    else:
        with steps.step(_parallelize_name(job, dims), fix=lambda exc: seq_fix(exc, job, dims)):
            parts, deferred = [spec.parallelize_fn(model, dims, job)], False
        steps.stage(0)
    _skip_device_work(job, steps)
    with steps.step("FSDP2's mixed-precision dtypes per unit, as its lazy init sets them at the first forward"):
        init_fsdp_dtypes(parts)
    with steps.step("the optimizers (the train spec's build_optimizers_fn)"):
        optimizers = spec.build_optimizers_fn(parts, job.optimizer, dims)
    with steps.step("the learning-rate schedulers (build_lr_schedulers_fn)"):
        spec.build_lr_schedulers_fn(optimizers, job.lr_scheduler, job.training.steps)
    with steps.step("the optimizer state, created as the first step creates it (torch.optim Adam._init_group)"):
        redirected = create_optimizer_state(optimizers)
    if redirected:
        steps.note("fused AdamW checks its parameters are on an accelerator when it creates their state; the "
                   "check is bypassed on the meta shards (the state is what the first step allocates)")
    measure(parts, optimizers, deferred=deferred, steps=steps)


def _job_and_mesh(ctx: DryContext, steps: Steps) -> tuple[Any, Any]:
    """The job from the launch's words (ConfigManager), its ParallelDims in the world and their mesh."""
    words = [w.replace(BUNDLE, str(ctx.bundle)) for w in ctx.launched.args]
    with steps.step("torchtitan's ConfigManager on the launch's words", fix=config_fix):
        job = _parse(words)
    p = job.parallelism
    with steps.step(f"ParallelDims: the job's degrees in a world of {ctx.world} ranks",
                    fix=lambda exc: degrees_fix(exc, job, ctx.world)):
        from torchtitan.distributed import ParallelDims

        dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                            pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                            etp=p.expert_tensor_parallel_degree, world_size=ctx.world)
    with steps.step("the device mesh (ParallelDims.build_mesh) on the fake process group"):
        dims.build_mesh()
    steps.note("torchtitan's device type is cpu for the mesh and the pipeline stages (this machine has no "
               "accelerator; torchtitan would take cuda); the model stays on the meta device")
    return job, dims


def _parse(words: list[str]) -> Any:
    """torchtitan's ConfigManager on ``words``; tyro's refusal (printed, then SystemExit) as an exception."""
    from torchtitan.config import ConfigManager

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            return ConfigManager().parse_args(words)
    except SystemExit:
        raise ValueError(_tyro_said(printed.getvalue())) from None


def _tyro_said(printed: str) -> str:
    """tyro's boxed refusal as one line: its lines between the title and "For full helptext" (the title
    dropped when a line repeats it, e.g. "Unrecognized options: loss")."""
    lines = [ln.strip(" │|\t") for ln in printed.splitlines()]
    said: list[str] = []
    for line in lines:
        if line.startswith("For full helptext"):
            break
        if line and not set(line) <= set("-─╭╮╰╯ "):
            said.append(line)
    said = [ln for ln in said if not any(other.startswith(ln + ":") for other in said)]
    return "; ".join(said) or "torchtitan's command line refused the words"


def _model_args(job: Any) -> tuple[Any, Any]:
    """The train spec and the flavor's args as Trainer.__init__ takes them: custom_import first, then the
    flavor from the spec's registry, then ``update_from_config`` (on a copy: the registry is torchtitan's)."""
    import torchtitan.protocols.train_spec as train_spec_module

    if job.experimental.custom_import:
        importlib.import_module(job.experimental.custom_import)
    spec = train_spec_module.get_train_spec(job.model.name)
    args = copy.deepcopy(spec.model_args[job.model.flavor])
    args.update_from_config(job)
    return spec, args


def _model(job: Any, spec: Any, args: Any) -> Any:
    """The model on the meta device in the job's dtype (Trainer.__init__)."""
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils

    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
        return spec.model_cls(args)


def _accumulation(job: Any, dims: Any) -> int:
    """Gradient accumulation steps, with the checks of Trainer.__init__ ("verify batch sizes", train.py
    0.2.2): the global batch is a positive multiple of the local batch times the batch mesh's degree."""
    degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    local = job.training.local_batch_size
    global_batch = job.training.global_batch_size if job.training.global_batch_size >= 0 else local * degree
    if global_batch <= 0 or global_batch % (local * degree):
        raise AssertionError(f"global batch size must be multiple of local batch size times data-parallel "
                             f"degree ({global_batch} % ({local} * {degree}) != 0)")
    return global_batch // (local * degree)


def _parallelize_name(job: Any, dims: Any) -> str:
    """The parallelize step named by what torchtitan's parallelize_fn applies for this job."""
    what = [name for name, on in (("TP", dims.tp_enabled), ("async TP", dims.tp_enabled
                                                             and job.parallelism.enable_async_tensor_parallel),
                                  ("EP", dims.ep_enabled), ("CP", dims.cp_enabled),
                                  (f"AC {job.activation_checkpoint.mode}", job.activation_checkpoint.mode != "none"),
                                  ("compile wrappers", job.compile.enable and "model" in job.compile.components),
                                  ("HSDP" if dims.dp_replicate_enabled else "FSDP2", dims.fsdp_enabled),
                                  ("DDP", dims.dp_replicate_enabled and not dims.fsdp_enabled)) if on]
    return f"the train spec's parallelize_fn ({', '.join(what) or 'nothing to apply'})"


class _Phases:
    """Consecutive steps inside one call of torchtitan's: :meth:`next` ends the open step and opens the
    next (``pipelining_fn`` splits, parallelizes and builds the schedule in one call)."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self._open: contextlib.AbstractContextManager[None] | None = None

    def next(self, name: str, fix: Fix | None = None) -> None:
        self.close()
        self._open = self._steps.step(name, fix)
        self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)

    def fail(self, exc: BaseException) -> None:
        """End the open step with ``exc`` (it raises StepFailed), or re-raise ``exc`` when none is open."""
        opened, self._open = self._open, None
        if opened is None or isinstance(exc, StepFailed):
            raise exc
        opened.__exit__(type(exc), exc, exc.__traceback__)
        raise exc  # not reached: a failed step raises StepFailed


def _pipeline(job: Any, spec: Any, args: Any, model: Any, dims: Any, loss_fn: Any, steps: Steps) -> list[Any]:
    """The train spec's pipelining_fn (torchtitan's ``pipeline_llm``): the split and the rank's stages, the
    parallelize_fn on each of its model chunks, then ``build_pipeline_schedule`` -- one step each."""
    import torch
    import torchtitan.distributed.pipeline_parallel as pipeline_parallel

    if spec.pipelining_fn is None:  # Trainer.__init__'s own check
        with steps.step("the train spec's pipelining_fn", fix=lambda exc: "set [parallelism] "
                        f"pipeline_parallel_degree = 1: torchtitan's {job.model.name} has no pipeline parallelism"):
            raise RuntimeError(f"Pipeline Parallel is enabled but {job.model.name} does not support pipelining")
    pp_rank = dims.get_mesh("pp").get_local_rank()
    build_schedule = pipeline_parallel.build_pipeline_schedule
    phases = _Phases(steps)
    chunks: list[Any] = []

    def parallelize(chunk: Any, parallel_dims: Any, job_config: Any) -> Any:
        if not chunks:
            phases.next(_parallelize_name(job, dims) + " on each model chunk",
                        fix=lambda exc: seq_fix(exc, job, dims))
        chunks.append(chunk)
        return spec.parallelize_fn(chunk, parallel_dims, job_config)

    def schedule(job_config: Any, stages: list[Any], loss: Any) -> Any:
        steps.stage(pp_rank, [stage.stage_index for stage in stages])
        phases.next(f"the pipeline schedule: {job.parallelism.pipeline_parallel_schedule} "
                    f"(build_pipeline_schedule)", fix=lambda exc: schedule_fix(exc, job, dims, len(stages)))
        return build_schedule(job_config, stages, loss)

    phases.next(f"the pipeline split and pp rank {pp_rank}'s stages (the train spec's pipelining_fn)",
                fix=split_fix)
    try:
        with patched(pipeline_parallel, "build_pipeline_schedule", schedule):
            _, parts, _, _ = spec.pipelining_fn(model, dims, job, torch.device("cpu"), args, parallelize, loss_fn)
    except BaseException as exc:  # noqa: BLE001 - the open step's verdict
        phases.fail(exc)
    phases.close()
    return list(parts)


def _skip_device_work(job: Any, steps: Steps) -> None:
    """The steps Trainer.__init__ takes on the GPU between parallelizing and the optimizers."""
    if job.compile.enable:
        steps.skip("torch.compile's compilation", f"inductor compiles the wrapped {', '.join(job.compile.components)} "
                                                  "at the first forward, on the GPU")
    device = "cpu (enable_cpu_offload)" if job.training.enable_cpu_offload else "cuda"
    steps.skip("to_empty + init_weights", f"they allocate and initialise the weights on {device}; the rank's "
                                          "model chunks stay on the meta device")


# --- leave nothing behind ------------------------------------------------------------------------------


@contextlib.contextmanager
def _launch_path(ctx: DryContext) -> Iterator[None]:
    """The launch's PYTHONPATH on sys.path (custom_import finds the bundle's module there), and the modules
    imported from the bundle forgotten after (another bundle's module of the same name is another model)."""
    entries = [e.replace(BUNDLE, str(ctx.bundle)) for e in ctx.launched.env.get("PYTHONPATH", "").split(":") if e]
    saved_path, before, bytecode = list(sys.path), set(sys.modules), sys.dont_write_bytecode
    sys.path[:0] = entries
    sys.dont_write_bytecode = True  # the dry run writes nothing into the bundle (no __pycache__)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        sys.dont_write_bytecode = bytecode
        for name in set(sys.modules) - before:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if any(where.startswith(e) for e in entries):
                del sys.modules[name]


@contextlib.contextmanager
def _restored_globals() -> Iterator[None]:
    """torchtitan's and torch's process-wide settings a build changes, as they were: the device type, the
    layer-SAC counter, the flavor registries and extra train specs, async TP's inductor flag, DDP's compile
    mode, the context-parallel SDPA dispatcher."""
    import torch._dynamo.config
    import torch._inductor.config
    import torchtitan.distributed.activation_checkpoint as ac
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.protocols.train_spec as train_spec_module
    from torch.distributed.tensor.experimental._attention import _disable_context_parallel_dispatcher

    registries = _flavor_registries()
    saved = [(r, dict(r)) for r in registries]
    extra = dict(train_spec_module._extra_train_specs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(parallel_dims, "device_type", "cpu"))
        stack.enter_context(patched(ac, "_layer_sac_count", ac._layer_sac_count))
        stack.enter_context(patched(torch._inductor.config, "_micro_pipeline_tp",
                                     torch._inductor.config._micro_pipeline_tp))
        stack.enter_context(patched(torch._dynamo.config, "optimize_ddp", torch._dynamo.config.optimize_ddp))
        try:
            yield
        finally:
            _disable_context_parallel_dispatcher()
            for registry, flavors in saved:
                registry.clear()
                registry.update(flavors)
            train_spec_module._extra_train_specs.clear()
            train_spec_module._extra_train_specs.update(extra)


def _flavor_registries() -> list[dict[str, Any]]:
    """The flavor registries of torchtitan's models autoplace writes (a bundle's custom_import adds to one)."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.qwen3 import qwen3_args

    return [llama3_args, qwen3_args, deepseekv3_args]



