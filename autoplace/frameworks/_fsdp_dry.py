"""The FSDP2 bundle's dry run: what train_fsdp2.py builds on one rank before and during its first step.

The bundle's own code does the work, called in the order its ``main`` calls it (:mod:`autoplace.frameworks.
_fsdp_train`): the script is imported as torchrun runs it (its directory and the launch's ``PYTHONPATH`` on
``sys.path``), its own ``parse_args`` reads the launch's words, its ``load_model`` builds the causal LM,
the bundle's ``build_mesh()`` and ``parallelize(model, mesh)`` (DeviceMesh, DTensor TP/SP, activation
checkpointing, FSDP2 ``fully_shard``) run on a fake process group of the planned world, its
``build_optimizer`` makes the AdamW, and one micro-batch of the first step (``batches``, ``micro_step``,
``optimizer.step()``) runs on fake tensors, so FSDP2 allocates its gradient shards and AdamW its state
the way the first step does.

The model is built and parallelized on the meta device; FSDP2 refuses to run a step on meta parameters
("FSDP parameters should be materialized from meta device before training", torch 2.13
``_fsdp_param_group.py: _validate_no_meta_params``), so its shards then get storage the way FSDP2's
meta-device initialization gives it (``model.to_empty``), on fake tensors (``FakeTensorMode``: shapes and
dtypes, no storage).  Sharding on fake tensors instead would cost a fake tensor per shard of every
parameter (FSDP2 chunks each over the shard group: 508 s for Llama-3-405B over 2,048 ranks).  The
weights are never read: ``load_model`` builds from ``--model``'s config.json as ``--from-config`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from unittest import mock

from autoplace.dryrun.launches import BUNDLE
from autoplace.dryrun.steps import fake_world

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

SCRIPT, MODULE = "train_fsdp2.py", "fsdp2_parallelize.py"
MODEL_FIX = (f"give {SCRIPT} its model: --model \"$HF_MODEL\" in the launch line, as autoplace writes it, or "
             "`autoplace dryrun BUNDLE -- --model PATH_OR_HUB_ID` (the launch passes the words after its own to the script)")


def dry_run(ctx: DryContext, steps: Steps) -> None:
    """Build rank ``ctx.rank`` of the FSDP2 bundle's launch (see the module docstring)."""
    script_path = _script_path(ctx)
    if script_path is None:
        steps.skip(f"{SCRIPT}'s setup", f"the launch runs {ctx.launched.entry}, not the bundle's {SCRIPT}: autoplace "
                   "cannot tell what another script builds")
        return
    with _bundle_on_path(ctx, script_path.parent), fake_world(ctx.world, ctx.rank):
        with steps.step(f"import {SCRIPT} and {MODULE} (the bundle on sys.path, as the launch's PYTHONPATH)"):
            script = _import_script(script_path)
        with steps.step(f"{SCRIPT}'s arguments, by its own argparse", fix=_arguments_fix):
            args = _parse(script, script_path, ctx.launched.args)
        steps.stage(0)  # no pipeline: every rank holds every block
        built = _build(ctx, steps, script, args)
        with steps.step("the optimizer: build_optimizer(model, args)"):
            optimizer = script.build_optimizer(built.model, args)
        kept = _first_micro_batch(ctx, steps, script, built, optimizer)
        _measure(steps, built, optimizer, kept, _predicted_host(ctx.bundle))


def _predicted_host(bundle: Path) -> int | None:
    """plan.json's host bytes per GPU of the offloaded states (for the comparison only)."""
    doc = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
    host = doc.get("host_memory_per_gpu_bytes")
    return int(host["offloaded"]) if isinstance(host, dict) and isinstance(host.get("offloaded"), int | float) else None


def _script_path(ctx: DryContext) -> Path | None:
    """The bundle's train_fsdp2.py when the launch runs it (its words name ``$AUTOPLACE_BUNDLE/train_fsdp2.py``)."""
    entry = ctx.launched.entry
    if ctx.launched.program[:1] == ("-m",) or Path(entry).name != SCRIPT:
        return None
    path = Path(entry.replace(BUNDLE, str(ctx.bundle)))
    return path if path.is_file() else None


@contextlib.contextmanager
def _bundle_on_path(ctx: DryContext, script_dir: Path) -> Iterator[None]:
    """``sys.path`` as the launched interpreter has it (the script's directory, then the launch's
    PYTHONPATH); afterwards the path and ``sys.modules`` as they were, so the next bundle imports its own."""
    pythonpath = ctx.launched.env.get("PYTHONPATH", "").replace(BUNDLE, str(ctx.bundle))
    entries = [str(script_dir), *(p for p in pythonpath.split(os.pathsep) if p)]
    saved_path, saved_modules = list(sys.path), dict(sys.modules)
    for name in (Path(SCRIPT).stem, Path(MODULE).stem):  # another bundle's copies must not be found
        sys.modules.pop(name, None)
    sys.path[:0] = entries
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in [n for n in sys.modules if n not in saved_modules]:
            if _inside(getattr(sys.modules[name], "__file__", None), entries):
                del sys.modules[name]
        sys.modules.update({k: v for k, v in saved_modules.items() if k not in sys.modules})


def _inside(file: str | None, dirs: Iterable[str]) -> bool:
    return file is not None and any(Path(file).resolve().is_relative_to(Path(d).resolve()) for d in dirs)


def _import_script(path: Path) -> ModuleType:
    """The script as a module named after its file (its ``if __name__ == "__main__"`` does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _parse(script: ModuleType, path: Path, words: Iterable[str]) -> argparse.Namespace:
    """The script's ``parse_args()`` on the launch's words, as the script sees them (``sys.argv``).

    Raises:
        SystemExit: argparse refused the words; its message (what it printed last) is the exception's.
    """
    printed = io.StringIO()
    with mock.patch.object(sys, "argv", [str(path), *words]), contextlib.redirect_stderr(printed), \
            contextlib.redirect_stdout(printed):
        try:
            return script.parse_args()
        except SystemExit as exc:
            lines = printed.getvalue().strip().splitlines()
            raise SystemExit(lines[-1] if lines else f"argparse exited with code {exc.code}") from None


def _arguments_fix(exc: BaseException) -> str | None:
    return MODEL_FIX if "--model" in str(exc) else None


@dataclass
class _Built:
    """What the script has built when its first micro-batch starts.

    Attributes:
        model: what ``parallelize`` returned (FSDP2 modules around the model; under PowerSGD the model
            DistributedDataParallel would wrap, :func:`_without_ddp`).
        vocab: the vocabulary ``main`` reads from the model's config before parallelizing it.
        fake: the FakeTensorMode the parameters were given storage in (the step runs in it).
        sharded: the parameters as parallelize left them (FSDP2's shards, TP's DTensors), by id.
        fsdp: parallelize applied FSDP2 (not only TP, or DDP under PowerSGD).
        offloaded: FSDP2 keeps its shards on the host (CPUOffloadPolicy).
    """

    model: Any
    vocab: int
    fake: Any
    sharded: frozenset[int]
    fsdp: bool
    offloaded: bool


def _build(ctx: DryContext, steps: Steps, script: ModuleType, args: argparse.Namespace) -> _Built:
    """The model the script loads, on the meta device; the bundle's mesh and parallelization of it; then
    its parameters given fake storage, as FSDP2's meta-device initialization does (``to_empty``)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FSDPModule

    with steps.step("the model: load_model(args), on the meta device"), \
            tempfile.TemporaryDirectory(prefix="autoplace-fsdp-") as scratch:
        directory, said = _model_directory(ctx, args, Path(scratch))
        steps.note(said)
        with torch.device("meta"):
            model = script.load_model(argparse.Namespace(**{**vars(args), "model": str(directory),
                                                              "from_config": True}))
        vocab = model.config.vocab_size  # as main reads it, before parallelize may wrap the model
    with steps.step("the device mesh: build_mesh()", fix=functools.partial(_mesh_fix, ctx.world)):
        mesh = script.build_mesh()
    module = sys.modules[Path(MODULE).stem]
    with steps.step("TP, activation checkpointing and FSDP2: parallelize(model, mesh)"), _unpinned(module, steps), \
            _without_ddp(module, steps):
        model = script.parallelize(model, mesh)
    # FSDP2 runs no step on meta parameters; its meta-device recipe gives them storage with to_empty
    # (fake storage here: shapes and dtypes only) before the first step
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # to_empty's inputs are the meta parameters
    with steps.step("the shards on fake tensors: model.to_empty(), as FSDP2's meta-device initialization"), fake:
        model.to_empty(device=torch.device("cpu"))
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    offloaded = fsdp and bool(getattr(module, "OFFLOAD_TO_CPU", False))
    return _Built(model, vocab, fake, frozenset(id(p) for p in model.parameters()), fsdp, offloaded)


@contextlib.contextmanager
def _without_ddp(module: ModuleType, steps: Steps) -> Iterator[None]:
    """Under PowerSGD the module wraps the model in DistributedDataParallel, which broadcasts the
    parameters' data and allocates its gradient buckets in C++ (real memory, the model's size): it is
    not built; the micro-batch runs on the model it would wrap."""
    if getattr(module, "COMPRESS", None) != "powersgd" or not hasattr(module, "apply_powersgd"):
        yield
        return
    steps.skip("DistributedDataParallel with the PowerSGD comm hook (apply_powersgd)",
               "DDP broadcasts the parameters' data and allocates its gradient buckets in C++: it cannot be built "
               "on fake tensors; the first micro-batch runs on the model it would wrap")
    with mock.patch.object(module, "apply_powersgd", lambda model, mesh: model):
        yield


@contextlib.contextmanager
def _unpinned(module: ModuleType, steps: Steps) -> Iterator[None]:
    """FSDP2's CPUOffloadPolicy pins its host shards (page-locked memory needs a GPU driver; fake tensors
    have no pinning): built with ``pin_memory=False``, which changes no byte count."""
    policy = getattr(module, "CPUOffloadPolicy", None)
    if not getattr(module, "OFFLOAD_TO_CPU", False) or policy is None:
        yield
        return
    steps.note("CPUOffloadPolicy() is built with pin_memory=False: pinning host memory needs a GPU driver "
               "(the shards are the same bytes, pinned or not)")
    with mock.patch.object(module, "CPUOffloadPolicy", functools.partial(policy, pin_memory=False)):
        yield


def _mesh_fix(world: int, exc: BaseException) -> str | None:
    if "WORLD_SIZE" not in str(exc):
        return None
    return (f"make DP_REPLICATE x DP_SHARD x TP in {MODULE} the launch's {world} ranks, or launch the world the "
            "plan was made for (launch_torchrun.sh: --nnodes x --nproc-per-node)")


def _model_directory(ctx: DryContext, args: argparse.Namespace, scratch: Path) -> tuple[Path, str]:
    """A directory holding the config.json ``load_model`` reads, and a line saying where it came from:
    ``--model`` when it names one here (a directory, or a Hub id in the local cache), else the plan's
    model file (a Hugging Face config.json, or a Llama-style shorthand as LlamaConfig)."""
    from autoplace.dryrun.hf_model import model_file_config, plan_model_file
    from autoplace.specs.hub import cached_config, parse_repo_id

    weights = "" if args.from_config else " (its weights are not read: built from its config.json as --from-config does)"
    given = Path(args.model)
    if (given / "config.json").is_file():
        return given, f"model: --model {args.model}{weights}"
    repo = parse_repo_id(args.model)
    cached = cached_config(*repo) if repo else None
    if cached is not None:
        return cached.parent, f"model: --model {args.model} from the local Hugging Face cache{weights}"
    config, kind = model_file_config(plan_model_file(ctx.bundle), ctx.model)
    config.save_pretrained(scratch)
    why = ("the launch's required input, filled in by the recording" if args.model in ctx.launched.stand_ins.values()
           else "no config.json here (not a directory, not in the local Hugging Face cache)")
    return scratch, f"model: --model {args.model} is {why}: built the plan's model file, {kind}"


def _first_micro_batch(ctx: DryContext, steps: Steps, script: ModuleType, built: _Built,
                       optimizer: Any) -> tuple[int, int]:
    """One micro-batch of the first step as ``main`` runs it (forward, backward, then the optimizer's
    step), on fake tensors: FSDP2's gradient shards and AdamW's state come to exist.

    Returns:
        bytes of the parameters FSDP2 holds gathered when the model's forward returns (kept until their
        backward: ``reshard_after_forward=False``): the blocks', and the whole model's.
    """
    import torch

    if getattr(sys.modules[Path(MODULE).stem], "COMPILE", False):
        steps.note("torch.compile of each block (COMPILE = True) is not run: torch._dynamo is disabled for the "
                   "step and the blocks run eagerly (compiling makes kernels for the GPU; it changes no state's bytes)")
    kept: list[tuple[int, int]] = []
    blocks = _blocks(built.model)

    def gathered(module: Any) -> int:  # FSDP2 registers a unit's gathered parameters while it is unsharded
        return storage_bytes(p for p in module.parameters() if id(p) not in built.sharded)

    hook = built.model.register_forward_hook(lambda *_: kept.append((gathered(blocks), gathered(built.model))))
    try:
        with steps.step("the first micro-batch: batches, micro_step(model, ids), optimizer.step(), on fake tensors"), \
                built.fake, torch._dynamo.config.patch(disable=True), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            data = script.batches(None, built.vocab, ctx.rank, ctx.world)
            script.micro_step(built.model, next(data))
            optimizer.step()
    finally:
        hook.remove()
    for text in dict.fromkeys(str(w.message).split(". ")[0] for w in said if "torch/distributed" in w.filename):
        steps.note(f"PyTorch warned: {text}")
    steps.note(f"the micro-batch is random tokens of the script's shape ({script.MICRO_BATCH} x {script.SEQ_LEN}); "
               "--data is not read")
    return kept[0] if kept else (0, 0)


def _blocks(model: Any) -> Any:
    """The model's block list, found by the bundle's own find_blocks (under DDP: in the module it wraps)."""
    inner = getattr(model, "module", model)
    module = sys.modules[Path(MODULE).stem]
    return module.find_blocks(inner, getattr(inner, "_autoplace_blocks", None))[1]


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages under ``tensors``, each storage once (a DTensor's local shard; FSDP2's padded
    shard behind an unpadded view; one reduce-scatter output behind a unit's gradient views)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    seen: dict[int, Any] = {}
    for t in tensors:
        for storage in get_untyped_storages(t):
            seen[id(storage)] = storage
    return sum(s.nbytes() for s in seen.values())


def _measure(steps: Steps, built: _Built, optimizer: Any, kept: tuple[int, int], predicted_host: int | None) -> None:
    """Params, grads and optimizer bytes on the rank, as FSDP2 and AdamW allocated them; on the GPU, or
    none there and the host's bytes said when FSDP2 offloads them.

    The 16-bit copies FSDP2 keeps gathered from forward to backward count as parameters when the blocks
    keep theirs (ZeRO-2: ``reshard_after_forward=False``; plan.json counts the whole gathered model then);
    when only the root keeps its copy (ZeRO-3), plan.json counts that copy with the all-gather buffers.
    """
    blocks, whole = kept
    params = list(built.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    counted = {"params": storage_bytes(params) + (whole if blocks else 0), "grads": storage_bytes(grads),
               "optimizer": storage_bytes(state)}
    how = {"params": _params_how(built, _dtypes(params), blocks, whole), "grads": _grads_how(built, _dtypes(grads)),
           "optimizer": f"AdamW exp_avg + exp_avg_sq ({_dtypes(state)}) as its first step creates them; the step "
                        "counters are host scalars"}
    for name, nbytes in counted.items():
        if built.offloaded:
            steps.measured(name, 0, f"none on the GPU: CPUOffloadPolicy keeps them on the host ({nbytes:,} B): {how[name]}")
        else:
            steps.measured(name, nbytes, how[name])
    if built.offloaded:
        steps.note(_host_line(sum(counted.values()), predicted_host))


def _params_how(built: _Built, dtypes: str, blocks: int, whole: int) -> str:
    if not built.fsdp:
        return f"the parameters parallelize leaves ({dtypes}; TP's local shards)"
    gathered = (f" + the 16-bit copies FSDP2 keeps gathered from forward to backward ({whole:,} B)" if blocks else
                f" (the root's gathered copy, {whole:,} B, is plan.json's buffers)" if whole else "")
    return f"FSDP2's parameter shards ({dtypes}, padded){gathered}"


def _grads_how(built: _Built, dtypes: str) -> str:
    if built.fsdp:
        return (f"FSDP2's gradient shards ({dtypes}), the reduce-scatter outputs (the unsharded gradients and "
                "reduce-scatter inputs are freed unit by unit: plan.json's buffers)")
    module = sys.modules[Path(MODULE).stem]
    if getattr(module, "COMPRESS", None) != "powersgd":
        return f"the gradients autograd leaves on the parameters ({dtypes})"
    return (f"the gradients autograd leaves on the parameters ({dtypes}); DDP's buckets and PowerSGD's error "
            f"feedback (a copy of each bucket from iteration {getattr(module, 'POWERSGD_START_ITER', '?')}) are "
            "not built")


def _dtypes(tensors: Iterable[Any]) -> str:
    """The tensors' dtypes, short ("fp32", "bf16", "fp32 + bf16")."""
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    found = dict.fromkeys(str(t.dtype).removeprefix("torch.") for t in tensors)
    return " + ".join(names.get(d, d) for d in found) or "none"


def _host_line(host: int, predicted: int | None) -> str:
    """The offloaded states' host bytes beside plan.json's ``host_memory_per_gpu_bytes.offloaded``."""
    said = f"{predicted:,} B, {host / predicted - 1:+.1%}" if predicted else "no prediction"
    return f"host memory of the offloaded states (params + grads + optimizer): {host:,} B (plan.json: {said})"
