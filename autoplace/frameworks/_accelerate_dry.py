"""accelerate's dry run: what ``accelerate launch --config_file accelerate_config.yaml train.py`` builds on one
rank before its first step, by accelerate's own code on a fake process group, the model on the meta device.

The bundle runs the user's script with the user's Hugging Face model; the dry run builds accelerate's side of
it (:func:`dry_run`): the launch's validation and the environment it gives the program
(:func:`~autoplace.frameworks._accelerate_world.launch_environment`), ``Accelerator()`` built from that
environment (its FSDP plugin, ParallelismConfig and device mesh), then ``accelerator.prepare(model,
optimizer)``: FSDP2's ``fully_shard`` of every transformer block, the embedding and the tail over the mesh
(or DDP), with a torch AdamW stepped once for the state its first step makes.  The LoRA / QLoRA bundles run
the bundle's PEFT script instead (:mod:`autoplace.frameworks._peft_dry`).

Skipped, and said: accelerate's ``fsdp2_load_full_state_dict`` (rank 0 broadcasts the loaded weights into
the shards -- there are none, the shards are the meta DTensors ``fully_shard`` made -- and every other rank
would allocate each whole parameter on the host to receive it), and tensor parallelism
(transformers shards the model as it loads with ``tp_plan``; accelerate only checks it is sharded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from autoplace.dryrun.hf_model import causal_lm, model_source
from autoplace.dryrun.steps import tensor_bytes
from autoplace.frameworks._accelerate_world import accelerate_world, launch_environment
from autoplace.frameworks._deepspeed_bytes import quant_state_bytes

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

LAUNCH = "accelerate launch's words (its parser, _validate_launch_command, the environment its launcher sets)"
LOAD_SKIPPED = ("rank 0 broadcasts the loaded weights into every shard; a dry run has no weights (the shards are the "
                "meta DTensors fully_shard made), and every other rank would allocate each whole parameter on the host "
                "to receive it")
TP_SKIPPED = ("transformers shards the model by its tp_plan as it loads the weights (from_pretrained(tp_plan=...)); "
              "accelerate only checks the parameters are DTensors: no bytes are counted")
LR = 1e-4


def dry_run(ctx: DryContext, steps: Steps, planned: str) -> None:
    """Build rank ``ctx.rank`` of an accelerate bundle running the user's script (the module docstring);
    ``planned``: the distributed type plan.json's plan runs with (NO, MULTI_GPU, FSDP)."""
    with steps.step(LAUNCH, fix=_fix_launch):
        env = launch_environment(ctx.launched, str(ctx.bundle))
    if not env:
        steps.note(f"{ctx.launched.launcher} starts the program: it gets no accelerate config from the launch")
    with steps.step("transformers' config of the model"):
        source = model_source(ctx)
    steps.note(source.said)
    with accelerate_world(ctx, steps, env):
        accelerator = _accelerator(steps, planned)
        if accelerator.parallelism_config is not None and accelerator.parallelism_config.tp_enabled:
            steps.skip("accelerate's tensor parallelism (the model sharded by its tp_plan)", TP_SKIPPED)
            return
        with steps.step("transformers' model on the meta device, fp32 (accelerate's mixed precision autocasts)"):
            import torch

            model = causal_lm(source.config, torch.float32)
        model, optimizer = prepare(accelerator, steps, model)
        steps.stage(0)  # accelerate configures no pipeline: every rank holds the whole model's stage
        measure(steps, model, optimizer, accelerator)


def _accelerator(steps: Steps, planned: str) -> Any:
    """``Accelerator()`` as the script builds it, from the launch's environment; what it made, in a note.
    A launch that does not give the program the plan's FSDP (or DDP) fails the step."""
    from accelerate import Accelerator

    with steps.step("accelerate's Accelerator from the launch's environment: FSDP plugin, ParallelismConfig, device "
                    "mesh", fix=_fix_launch):
        accelerator = Accelerator()
        if accelerator.distributed_type.value != planned:
            raise ValueError(f"the launch's environment makes accelerate run {accelerator.distributed_type.value}; "
                             f"the plan runs {planned}")
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    said = f"FSDP{plugin.fsdp_version}, reshard_after_forward={plugin.reshard_after_forward}" if plugin else "no FSDP"
    mesh = accelerator.torch_device_mesh
    steps.note(f"accelerate's Accelerator: {accelerator.distributed_type.value}, {accelerator.num_processes} processes, "
               f"{said}, mixed precision {accelerator.mixed_precision}"
               + (f", device mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))}" if mesh else ""))
    return accelerator


def prepare(accelerator: Any, steps: Steps, model: Any, optimizer: Any = None) -> tuple[Any, Any]:
    """``accelerator.prepare(model, optimizer)`` (FSDP2 or DDP; the optimizer: a torch AdamW over the trainable
    parameters unless given), then the optimizer's first-step state."""
    import torch

    wrap = "FSDP2's fully_shard over the mesh" if accelerator.is_fsdp2 else accelerator.distributed_type.value
    if accelerator.is_fsdp2:
        steps.skip("accelerate's fsdp2_load_full_state_dict", LOAD_SKIPPED)
    with steps.step(f"accelerator.prepare(model, optimizer): {wrap}", fix=_fix_prepare), _no_weight_loading():
        if optimizer is None:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=False)
        model, optimizer = accelerator.prepare(model, optimizer)
    with steps.step("the optimizer state the first step creates (AdamW stepped once over the meta shards)"):
        first_step(optimizer.optimizer)
    return model, optimizer.optimizer


def first_step(optimizer: Any) -> None:
    """Step ``optimizer`` once with zero gradients where a parameter has none (Adam makes its state lazily)."""
    import torch

    lent = [p for g in optimizer.param_groups for p in g["params"] if p.grad is None]
    for p in lent:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in lent:
        p.grad = None


def measure(steps: Steps, model: Any, optimizer: Any, accelerator: Any) -> None:
    """The rank's bytes per state as accelerate's wrapper holds them (:func:`_fsdp2_bytes`, :func:`_ddp_bytes`)
    and Adam's state made by the first step."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if any(isinstance(p, DTensor) for p in params):
        _fsdp2_bytes(steps, model, params, accelerator)
    else:
        _ddp_bytes(steps, model, params)
    state = [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "dim") and t.dim() > 0]
    steps.measured("optimizer", tensor_bytes(state), "Adam exp_avg + exp_avg_sq (first step)")


def _fsdp2_bytes(steps: Steps, model: Any, params: list[Any], accelerator: Any) -> None:
    """FSDP2: the local shards, and the unsharded copies of the units that stay gathered from the first forward
    to the end of backward (``reshard_after_forward=False``: every unit at ZeRO-2, counted with the parameters as
    plan.json does; at ZeRO-3 FSDP2's root and accelerate's tail unit, told in a note); a gradient per trainable
    shard in its dtype, the first backward's reduce-scatter output."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)  # one group may serve several modules
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}
    kept = sum(fp._orig_size.numel() * torch.empty((), dtype=g.mp_policy.param_dtype or fp.sharded_param.dtype).element_size()
               for g in groups.values() if g.post_forward_mesh_info is None for fp in g.fsdp_params)
    quant = quant_state_bytes(model)
    shards = tensor_bytes(params) + quant
    how = f"FSDP2's local shards ({_dtypes(params)})" + (" + the 4-bit weights' quant_state, whole" if quant else "")
    if accelerator.state.fsdp_plugin.reshard_after_forward:
        steps.note(f"FSDP2's root and accelerate's tail unit (final norm, LM head) stay unsharded from forward to "
                   f"backward: {kept:,} bytes (plan.json counts them in buffers)")
        steps.measured("params", shards, how)
    else:
        steps.measured("params", shards + kept, f"{how} + the units' unsharded copies kept from forward to backward "
                                                 "(reshard_after_forward=False)")
    trainable = [p for p in params if p.requires_grad]
    steps.measured("grads", tensor_bytes(trainable), "a gradient per trainable shard in its dtype (the first "
                                                      "backward's reduce-scatter output)")


def _ddp_bytes(steps: Steps, model: Any, params: list[Any]) -> None:
    """DDP: every parameter; every trainable one's ``.grad`` (autograd's) and DDP's reducer buckets, a second copy
    unless ``gradient_as_bucket_view`` (its own logging data: ``bucket_sizes``)."""
    steps.measured("params", tensor_bytes(params) + quant_state_bytes(model),
                   f"every parameter, whole ({_dtypes(params)})")
    grads = tensor_bytes(p for p in params if p.requires_grad)
    how = "every trainable parameter's .grad (the first backward)"
    logging = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    if logging and not logging.get("gradient_as_bucket_view"):
        grads += sum(int(b) for b in str(logging.get("bucket_sizes", "")).split(", ") if b)
        how += " + DDP's reducer buckets (bucket_sizes; gradient_as_bucket_view=False keeps this second copy)"
    steps.measured("grads", grads, how)


def _dtypes(params: list[Any]) -> str:
    return ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))


@contextmanager
def _no_weight_loading() -> Iterator[None]:
    """accelerate's FSDP2 weight broadcast skipped (see LOAD_SKIPPED), and a distinct address for every meta
    tensor: accelerate maps the optimizer's parameters to their shards by ``data_ptr()``
    (``Accelerator._prepare_fsdp2``, ``fsdp2_switch_optimizer_parameters``), which is 0 for every meta tensor."""
    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch
    from torch.overrides import TorchFunctionMode

    class _Addresses(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            if func is torch.Tensor.data_ptr and args[0].is_meta:
                return id(args[0])
            return func(*args, **(kwargs or {}))

    original = fsdp_utils.fsdp2_load_full_state_dict
    fsdp_utils.fsdp2_load_full_state_dict = lambda *args, **kwargs: None
    try:
        with _Addresses():
            yield
    finally:
        fsdp_utils.fsdp2_load_full_state_dict = original


def _fix_launch(exc: BaseException) -> str | None:
    text = str(exc)
    if "the launch's environment makes accelerate run" in text:
        return 'launch the script with accelerate launch --config_file "$AUTOPLACE_BUNDLE"/accelerate_config.yaml'
    if ("total_size" in text and "num_processes" in text) or "Mesh should not be bigger than default world size" in text:
        return ("make parallelism_config's dp_replicate x dp_shard x tp x cp equal num_processes in "
                "accelerate_config.yaml, or re-run autoplace solve --out")
    return None


def _fix_prepare(exc: BaseException) -> str | None:
    text = str(exc)
    if "sliding" in text.lower() or "context parallel" in text.lower():
        return "set parallelism_config_cp_size: 1 in accelerate_config.yaml, or re-run autoplace solve --out"
    return None
