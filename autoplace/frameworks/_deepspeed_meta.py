"""DeepSpeed on the fake process group and the meta device: what a dry run redirects, and how it leaves
DeepSpeed as it found it.

DeepSpeed runs here on its CPU accelerator (``DS_ACCELERATOR=cpu``, deepspeed/accelerator/real_accelerator.py),
whose "device" is the host.  A dry run must allocate nothing the size of a model, so :func:`deepspeed_world`
redirects, and says so with ``steps.note``:

* the accelerator's device (``device_name`` / ``current_device_name``) to ``meta``: every tensor DeepSpeed
  puts on the GPU is a meta tensor of the same shape and dtype;
* host allocations (``device="cpu"``, ``.to("cpu")``, ``.cpu()``, ``pin_memory()``: ZeRO's staging buffers,
  ZeRO-Offload's optimizer partitions) to ``meta`` as well (:class:`HostToMeta`); which of DeepSpeed's
  buffers live on the host is read from its own structures when bytes are counted;
* the accelerator's free memory to "enough" (ZeRO-1/2 flatten on the host first when the device lacks room
  for the flat buffer: the buffer is the same);
* DeepSpeed's shared-memory CPU collectives (``ShareMemCommBuilder``, a JIT-built op) to none: the fake
  group's collectives return at once.

The environment is the one torchrun gives the rank (RANK, LOCAL_RANK, WORLD_SIZE, ...), with the words'
own environment; both are restored afterwards, and so are DeepSpeed's module globals (its comm backend,
process groups, ZeRO-Init context), so many bundles can be built in one process.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from autoplace.dryrun.launches import BUNDLE

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

# modules whose globals DeepSpeed (and accelerate, transformers' integration) set while building
_GLOBAL_MODULES = ("deepspeed.comm.comm", "deepspeed.utils.groups", "deepspeed.runtime.zero.partition_parameters",
                   "deepspeed.runtime.activation_checkpointing.checkpointing", "deepspeed.runtime.utils",
                   "deepspeed.runtime.pipe.p2p", "transformers.integrations.deepspeed")
REDIRECTS = ("DeepSpeed's accelerator (DS_ACCELERATOR=cpu) has the meta device as its device; its host allocations "
             "(staging buffers, offloaded partitions, pinned memory) are meta tensors too, counted as host bytes where "
             "DeepSpeed's own structures put them on the host; its free memory is unbounded (ZeRO-1/2 flatten on the "
             "device); its shared-memory CPU collectives (a JIT-built op) are not built: the fake group's are used")


def torchrun_env(ctx: DryContext) -> dict[str, str]:
    """The variables torchrun (and the deepspeed and accelerate launchers, which run it) give rank ``ctx.rank``."""
    per_node = max(ctx.launched.per_node, 1)
    return {"RANK": str(ctx.rank), "LOCAL_RANK": str(ctx.rank % per_node), "WORLD_SIZE": str(ctx.world),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(ctx.rank // per_node),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def launch_env(ctx: DryContext) -> dict[str, str]:
    """The environment the launch sets for its program, the bundle's directory written out."""
    return {k: v.replace(BUNDLE, str(ctx.bundle)) for k, v in ctx.launched.env.items()}


@contextmanager
def patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, and as it was afterwards (the frameworks set variables of their own:
    accelerate's ``ACCELERATE_USE_DEEPSPEED``, ...)."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def deepspeed_world(ctx: DryContext, steps: Steps) -> Iterator[None]:
    """Rank ``ctx.rank`` of a fake world of ``ctx.world`` ranks, with deepspeed.comm on it and DeepSpeed's
    allocations on the meta device (the module docstring lists each redirect); everything restored after."""
    from autoplace.dryrun.steps import fake_world

    with ExitStack() as stack:
        stack.enter_context(patched_environ({**launch_env(ctx), **torchrun_env(ctx), "DS_ACCELERATOR": "cpu"}))
        stack.enter_context(restored_globals(_GLOBAL_MODULES))
        stack.enter_context(fake_world(ctx.world, ctx.rank))
        stack.enter_context(_accelerator_on_meta())
        steps.note(REDIRECTS)
        with steps.step(f"deepspeed.comm on the fake process group of {ctx.world} ranks (deepspeed.init_distributed)"):
            import deepspeed

            deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        yield


@contextmanager
def restored_globals(names: tuple[str, ...]) -> Iterator[None]:
    """The module globals of ``names`` (imported ones, or imported while inside) as they were before."""
    import importlib

    saved: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        saved[name] = {k: _copied(v) for k, v in vars(module).items() if not k.startswith("__")}
    try:
        yield
    finally:
        for name, values in saved.items():
            namespace = vars(sys.modules[name])
            for key in [k for k in namespace if not k.startswith("__") and k not in values
                        and not isinstance(namespace[k], types.ModuleType)]:  # submodules imported meanwhile stay
                del namespace[key]
            namespace.update(values)


def _copied(value: Any) -> Any:
    """Containers copied (DeepSpeed fills its group dicts in place); everything else as it is."""
    return copy.copy(value) if isinstance(value, dict | list | set) else value


@contextmanager
def _accelerator_on_meta() -> Iterator[None]:
    """DeepSpeed's CPU accelerator with the meta device as its device and unbounded free memory, no
    shared-memory collectives, and its host allocations on the meta device (:class:`HostToMeta`)."""
    import importlib

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() not in ("cpu", "meta"):
        raise RuntimeError(f"DeepSpeed's accelerator is {accelerator.device_name()!r}; the dry run needs its CPU "
                           "accelerator (DS_ACCELERATOR=cpu before deepspeed is first imported)")
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    patches = {"device_name": lambda device_index=None: "meta", "current_device_name": lambda: "meta",
               "available_memory": lambda device_index=None: 1 << 62}
    build_shm = getattr(comm_torch, "build_shm_op")  # noqa: B009 - a module attribute mypy cannot see
    vars(accelerator).update(patches)
    setattr(comm_torch, "build_shm_op", lambda: None)  # noqa: B010
    _import_ahead()
    try:
        with HostToMeta():
            yield
    finally:
        for name in patches:
            vars(accelerator).pop(name, None)
        setattr(comm_torch, "build_shm_op", build_shm)  # noqa: B010


def _import_ahead() -> None:
    """What must exist before ZeRO-Init patches torch's tensor constructors and ``torch.Tensor.__new__``:
    torch._dynamo (its polyfills check ``__new__``'s signature at import and refuse ZeRO-Init's), the module
    DeepSpeed's optimizer check imports on first use, and ``torch.device``'s cached set of constructors
    (torch/utils/_device.py caches it on first use: made under ZeRO-Init, it would hold ZeRO-Init's
    wrappers, and ``with torch.device("meta")`` would stop placing anything on the meta device)."""
    import torch._dynamo  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401
    from torch.utils._device import _device_constructors

    _device_constructors()


VALUE_ELEMENTS = 1 << 16  # at most this many elements: a value DeepSpeed reads back, not a model-sized buffer


class HostToMeta:
    """A torch function mode placing on the meta device what DeepSpeed asks for on the host.

    A small tensor with data that DeepSpeed moves to the device (a parameter count it all-reduces and
    reads back with ``.tolist()``, the pipeline's loss scalar) stays on the host: a meta copy holds no
    value to read, and on the fake group the collective leaves it as it is.

    The model's parameters are meta tensors, so every host copy DeepSpeed makes of them (ZeRO-3's
    defragmenting staging buffer, ZeRO-Offload's fp32 partitions) would copy meta data; on the meta
    device the copy has the shape and dtype DeepSpeed asked for.  Tensors made without a device stay
    where torch puts them when they are small (scalars DeepSpeed reads with ``.item()``); larger ones made
    by size are host buffers, placed on the meta device too.
    """

    def __new__(cls) -> Any:
        import torch
        from torch.overrides import TorchFunctionMode

        def _to_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            return (device == "meta") or (isinstance(device, torch.device) and device.type == "meta")

        def _holds_a_value(tensor: Any) -> bool:
            return not tensor.is_meta and tensor.numel() <= VALUE_ELEMENTS

        def on_host(device: Any) -> bool:
            return (isinstance(device, str) and device.split(":")[0] == "cpu") or (
                isinstance(device, torch.device) and device.type == "cpu")

        # tensors made from Python values (Adam's step counter: torch.tensor(0.0, device="cpu")) keep
        # their device: they hold values torch reads back, never a model-sized buffer
        VALUES = (torch.tensor, torch.as_tensor, torch.scalar_tensor)
        # buffers made by size where torch puts them by default, the host (ZeRO-3's flat host buffer of
        # offloaded parameters: torch.empty(n, dtype=...))
        BY_SIZE = (torch.empty, torch.zeros, torch.ones, torch.full)

        def big(args: tuple[Any, ...]) -> bool:
            size = args[0] if args and isinstance(args[0], list | tuple | torch.Size) else args[:1]
            dims = [d for d in size if isinstance(d, int)]
            return len(dims) == len(size) and math.prod(dims) > VALUE_ELEMENTS

        class _HostToMeta(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                kwargs = dict(kwargs or {})
                if func in (torch.Tensor.cpu, torch.Tensor.pin_memory) and args[0].is_meta:
                    return args[0]
                if on_host(kwargs.get("device")) and func not in VALUES:
                    kwargs["device"] = "meta"
                if func in BY_SIZE and kwargs.get("device") is None and big(args):
                    kwargs["device"] = "meta"
                if func is torch.Tensor.to and len(args) > 1 and on_host(args[1]):
                    args = (args[0], "meta", *args[2:])
                if func is torch.Tensor.to and _to_meta(args, kwargs) and _holds_a_value(args[0]):
                    return args[0]
                return func(*args, **kwargs)

        return _HostToMeta()
