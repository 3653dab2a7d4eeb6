"""accelerate on the fake process group: the environment ``accelerate launch`` gives the program, and an
``Accelerator`` built from it as on the planned GPUs.

:func:`launch_environment` runs accelerate's own launch path on the launch's words -- its argument parser,
``_validate_launch_command`` (which loads the config file) and the environment builder its launcher runs
(``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``) -- and keeps what it adds to the environment:
the FSDP plugin's, ParallelismConfig's and mixed precision's variables the program's ``Accelerator()``
reads.  :func:`accelerate_world` then lets ``Accelerator`` run on the fake group, redirecting, and saying in
a note: ``PartialState`` takes its GPU branch (backend nccl, MULTI_GPU: on CPU it would fall back to a single
process, and FSDP with it); its device is the host (a device type the fake backend serves, for the device
mesh), and moving the model there leaves it on the meta device;
DDP is built without ``device_ids`` and without its cross-rank shape check, which reads values meta tensors
do not have.
accelerate's shared state is cleared afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from autoplace.dryrun.launches import BUNDLE
from autoplace.frameworks._deepspeed_meta import launch_env, patched_environ, torchrun_env

if TYPE_CHECKING:
    from autoplace.dryrun.launches import Launched
    from autoplace.dryrun.steps import DryContext, Steps

REDIRECTS = ("accelerate's PartialState takes its GPU branch (backend nccl, MULTI_GPU) on the fake process group, with "
             "the host as its device (ACCELERATE_TORCH_DEVICE=cpu: the device mesh's type); moving the model there leaves "
             "it on the meta device; DDP is built without device_ids (ACCELERATE_BYPASS_DEVICE_MAP) and without its "
             "cross-rank shape check (_verify_param_shape_across_processes reads values meta tensors do not have)")


def launch_environment(launched: Launched, bundle: str) -> dict[str, str]:
    """What ``accelerate launch`` adds to its program's environment, from its own parser, validation and
    environment builder; {} when another launcher starts the program.

    Raises:
        ValueError: (or accelerate's own errors) words or a config file accelerate refuses.
    """
    if launched.launcher != "accelerate":
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    words = [w.replace(BUNDLE, bundle) for w in launched.launcher_words]
    args = launch_command_parser().parse_args(words[1:])  # after "launch"
    args, _, _ = _validate_launch_command(args)
    before = dict(os.environ)
    if args.use_deepspeed:
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if before.get(k) != v}


@contextmanager
def accelerate_world(ctx: DryContext, steps: Steps, program_env: Mapping[str, str]) -> Iterator[None]:
    """The fake world with the program's environment (the launch's, accelerate launch's, torchrun's for the
    rank) and accelerate's state on it (the module docstring's redirects); everything restored after."""
    from autoplace.dryrun.steps import fake_world

    with fake_world(ctx.world, ctx.rank), accelerate_state(ctx, steps, program_env):
        yield


@contextmanager
def accelerate_state(ctx: DryContext, steps: Steps, program_env: Mapping[str, str]) -> Iterator[None]:
    """accelerate's state on a fake world already made (by :func:`accelerate_world`, or DeepSpeed's
    ``deepspeed_world`` for a script that runs DeepSpeed through accelerate), with the program's environment."""
    with ExitStack() as stack:
        stack.enter_context(patched_environ({**launch_env(ctx), **program_env, **torchrun_env(ctx),
                                             "ACCELERATE_TORCH_DEVICE": "cpu", "ACCELERATE_BYPASS_DEVICE_MAP": "true"}))
        stack.enter_context(_gpu_branch())
        stack.enter_context(_ddp_on_meta())
        stack.enter_context(_meta_stays())
        steps.note(REDIRECTS)
        yield


@contextmanager
def _meta_stays() -> Iterator[None]:
    """A meta tensor moved to the host (``.to("cpu")``, ``.cpu()``: accelerate places the model on its device)
    stays on the meta device; nothing else changes."""
    import torch
    from torch.overrides import TorchFunctionMode

    def to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        return str(device).split(":")[0] == "cpu" or (isinstance(device, torch.device) and device.type == "cpu")

    class _MetaStays(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            if args and isinstance(args[0], torch.Tensor) and args[0].is_meta and (
                    func is torch.Tensor.cpu or (func is torch.Tensor.to and to_host(args, kwargs))):
                return args[0]
            return func(*args, **kwargs)

    with _MetaStays():
        yield


@contextmanager
def _ddp_on_meta() -> Iterator[None]:
    """DDP's cross-rank parameter shape check skipped (it reads the sizes back with ``.item()``; every rank of
    the fake group builds the same model)."""
    import torch.nn.parallel.distributed as ddp

    original = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = original


@contextmanager
def _gpu_branch() -> Iterator[None]:
    """accelerate's ``PartialState`` answering as on a GPU node, its shared state cleared before and after."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    def on_gpus(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        del self, cpu, sagemaker_dp
        return backend or "nccl", DistributedType.MULTI_GPU

    original = PartialState.__dict__["_prepare_backend"]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._prepare_backend = on_gpus  # type: ignore[method-assign]
    try:
        yield
    finally:
        PartialState._prepare_backend = original  # type: ignore[method-assign]
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
