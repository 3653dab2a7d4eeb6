"""The dry run of a LoRA / QLoRA bundle: the bundle's own ``peft_train.py``, run up to its first step.

The DeepSpeed and accelerate bundles of a model trained with LoRA or QLoRA run the bundle's PEFT script
(:mod:`autoplace.emit.peft_train`).  Its configuration is plain functions above a ``__main__`` guard, so the
dry run imports the script and calls them as its ``main()`` does (:func:`dry_run`):

1. ``parse_args`` on the words of every launch kind: each must hand the script the framework config the
   plan was costed with (``--deepspeed_config ds_config.json`` / ``--accelerate_config
   accelerate_config.yaml``) -- a launch that runs it without one trains without the plan's ZeRO / FSDP
   (issue 34 defect 4);
2. ``make_accelerator``: accelerate's DeepSpeedPlugin or FSDP plugin + ParallelismConfig from that file;
3. ``build_model`` with the script's ``lora_config()`` and ``quantization_config()``, its
   ``from_pretrained`` redirected to the model built from its config on the meta device (no weights); QLoRA:
   transformers' bitsandbytes quantizer replaces the linear layers and each 4-bit weight is quantized by
   bitsandbytes' own ``Params4bit._quantize`` on the meta device, which stores it packed with its
   quantization state as loading onto a GPU does;
4. PEFT's trainable parameter count beside autoplace's (``layer_table(model).trainable``);
5. ``accelerator.prepare(model, optimizer)`` and the optimizer's first-step state, measured as the framework
   holds it (:mod:`._deepspeed_bytes` for DeepSpeed's engine, :mod:`._accelerate_dry` for FSDP2 / DDP).

ZeRO-Offload: the script steps DeepSpeed's CPU Adam (a JIT-built op); the dry run gives prepare a torch
AdamW over the same parameters (``zero_force_ds_cpu_optimizer: false`` in accelerate's copy of the config).
A paged bitsandbytes optimizer needs CUDA: the same torch AdamW stands in.  Both are said in notes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.dryrun.hf_model import causal_lm, model_source
from autoplace.dryrun.launches import BUNDLE

if TYPE_CHECKING:
    from autoplace.dryrun.launches import Launched
    from autoplace.dryrun.steps import DryContext, Steps

# each framework's config and the script's flag for it (peft_train.parse_args)
CONFIG_FLAGS = {"deepspeed": ("--deepspeed_config", "ds_config.json"),
                "accelerate": ("--accelerate_config", "accelerate_config.yaml")}


def dry_run(ctx: DryContext, steps: Steps, framework: str) -> None:
    """Build rank ``ctx.rank`` of ``framework``'s PEFT bundle (the module docstring lists the steps)."""
    script_path = Path(ctx.launched.entry.replace(BUNDLE, str(ctx.bundle)))
    with steps.step(f"{script_path.name}, the bundle's PEFT script (imported: its functions above __main__)"):
        script = load_script(script_path)
    flag, wanted = CONFIG_FLAGS[framework]
    with steps.step(f"every launch kind hands {script_path.name} {wanted} (the script's parse_args of its words)",
                    fix=_fix_launches):
        args = launch_arguments(script, ctx, flag, wanted)
    with steps.step("transformers' config of the model"):
        source = model_source(ctx)
    steps.note(f"{source.said}; the launch's --model is {args.model!r}")
    with ExitStack() as stack:
        stack.enter_context(_world(ctx, steps, framework))
        with steps.step(f"{script_path.name}'s make_accelerator: accelerate's "
                        f"{'DeepSpeedPlugin' if framework == 'deepspeed' else 'FSDP plugin and ParallelismConfig'} "
                        f"from {wanted}"):
            accelerator = script.make_accelerator(args)
        model = _build_model(steps, script, accelerator, source.config)
        _trainable(steps, model, ctx)
        optimizer = _optimizer(steps, script, accelerator, model, args)
        _prepare_and_measure(steps, ctx, framework, accelerator, model, optimizer)


def load_script(path: Path) -> types.ModuleType:
    """The PEFT script as a module: its top level runs (imports, constants, functions), ``main()`` does not."""
    spec = importlib.util.spec_from_file_location("autoplace_dryrun_peft_train", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python script")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_arguments(script: types.ModuleType, ctx: DryContext, flag: str, wanted: str) -> Any:
    """The script's ``parse_args`` of the primary launch's words, after checking every launch kind hands it
    ``flag`` naming the bundle's ``wanted`` file.

    Raises:
        ValueError: a kind whose words the script refuses (argparse's own message) or that name another file.
    """
    launches = dict(ctx.launches) or {ctx.launched.kind: ctx.launched}
    if not hasattr(script, "parse_args"):
        older_script(launches, wanted)
    for launched in launches.values():
        args = parse(script, launched, ctx.bundle)
        given = getattr(args, flag.lstrip("-"), None)
        if given is None or Path(given).name != wanted:
            words = " ".join(launched.program)
            raise ValueError(f"{launched.file}: {Path(launched.entry).name} gets {flag} {given} from the launch "
                             f"({words}); the plan needs {flag} {wanted}")
    return parse(script, ctx.launched, ctx.bundle)


def older_script(launches: dict[str, Launched], wanted: str) -> None:
    """A PEFT script written before the launches handed it its config (its ``main()`` built a bare
    ``Accelerator()``, configured only by ``accelerate launch``'s words): the first launch kind that starts it
    without the framework config, else that the script must be written again.

    Raises:
        ValueError: always (the script cannot be built as this dry run builds it).
    """
    from accelerate.commands.launch import launch_command_parser

    for launched in launches.values():
        given = None
        if launched.launcher == "accelerate":
            args = launch_command_parser().parse_args(list(launched.launcher_words[1:]))
            given = args.deepspeed_config_file if wanted == CONFIG_FLAGS["deepspeed"][1] else args.config_file
        if given is None or Path(given).name != wanted:
            raise ValueError(f"{launched.file}: {launched.launcher} starts {Path(launched.entry).name}, whose "
                             f"Accelerator() reads its config only from accelerate launch's words; it gets "
                             f"{given or 'none'}, the plan needs {wanted}")
    script = Path(next(iter(launches.values())).entry).name
    raise ValueError(f"{script} takes no framework config in its words (written by an older autoplace): re-run "
                     "autoplace solve --out")


def parse(script: types.ModuleType, launched: Launched, bundle: Path) -> Any:
    """The script's own ``parse_args`` of the launch's words (the bundle's directory written out).

    Raises:
        ValueError: argparse refused the words: its message, naming the launch file.
    """
    words = [w.replace(BUNDLE, str(bundle)) for w in launched.args]
    said = io.StringIO()
    program = sys.argv[0]
    try:
        sys.argv[0] = Path(launched.entry).name  # argparse names the program by it, as the script's own run does
        with contextlib.redirect_stderr(said):
            return script.parse_args(words)
    except SystemExit:
        lines = said.getvalue().strip().splitlines()
        raise ValueError(f"{launched.file}: {lines[-1] if lines else 'the script refuses its words'}") from None
    finally:
        sys.argv[0] = program


@contextmanager
def _world(ctx: DryContext, steps: Steps, framework: str) -> Iterator[None]:
    """The fake world the script's Accelerator runs on: DeepSpeed's (meta redirects included) with
    accelerate's state on top, or accelerate's alone."""
    from autoplace.frameworks._accelerate_world import accelerate_state, accelerate_world

    with ExitStack() as stack:
        if framework == "deepspeed":
            from autoplace.frameworks._deepspeed_meta import deepspeed_world

            stack.enter_context(deepspeed_world(ctx, steps))
            stack.enter_context(accelerate_state(ctx, steps, {}))
        else:
            stack.enter_context(accelerate_world(ctx, steps, {}))
        stack.enter_context(_bitsandbytes_caches())
        yield


def _build_model(steps: Steps, script: types.ModuleType, accelerator: Any, config: Any) -> Any:
    """The script's ``build_model``, its ``from_pretrained`` building the model from its config on the meta
    device (QLoRA: quantized by bitsandbytes there); its gradient-checkpointing choice as ``main()`` makes it."""
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    checkpointing = script.GRADIENT_CHECKPOINTING and not (fsdp and fsdp.activation_checkpointing)
    import torch

    with steps.step(f"the script's build_model: {'QLoRA (bitsandbytes NF4)' if script.METHOD == 'qlora' else 'LoRA'} "
                    "adapters by PEFT's get_peft_model on the meta model"), _from_config(script, config), \
            torch.device("meta"):  # PEFT makes the adapters on the default device: here, the meta one
        return script.build_model("<weights: none in a dry run>", checkpointing)


@contextmanager
def _from_config(script: types.ModuleType, config: Any) -> Iterator[None]:
    """The script's ``AutoModelForCausalLM.from_pretrained`` building ``config``'s model on the meta device."""

    class _OnMeta:
        @staticmethod
        def from_pretrained(model_id: str, dtype: Any = None, quantization_config: Any = None, **kwargs: Any) -> Any:
            del model_id, kwargs
            if quantization_config is None:
                return causal_lm(config, dtype)  # under ZeRO-3, transformers builds it inside zero.Init
            return quantized(config, dtype, quantization_config)

    original = vars(script)["AutoModelForCausalLM"]
    vars(script)["AutoModelForCausalLM"] = _OnMeta
    try:
        yield
    finally:
        vars(script)["AutoModelForCausalLM"] = original


def quantized(config: Any, dtype: Any, quantization_config: Any) -> Any:
    """The model as transformers loads it 4-bit: built on the meta device outside ZeRO-Init (transformers'
    ``get_init_context`` for a quantized model), its linear layers replaced by the bitsandbytes quantizer, each
    4-bit weight quantized by ``Params4bit._quantize`` on the meta device."""
    import bitsandbytes as bnb
    import torch
    from transformers.modeling_utils import set_quantized_state
    from transformers.quantizers import AutoHfQuantizer

    with set_quantized_state():
        model = causal_lm(config, dtype)
    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    quantizer.preprocess_model(model, device_map=None)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight: Any = module.weight  # a bitsandbytes Params4bit
            weight._quantize("meta")
            nested = weight.quant_state.state2 is not None
            if nested:  # the absmax' mean: a scalar state_dict() reads back (.item()); its value needs the weights
                weight.quant_state.offset = torch.tensor(0.0, dtype=weight.quant_state.offset.dtype, device="cpu")
    quantizer.postprocess_model(model)
    return model


def _trainable(steps: Steps, model: Any, ctx: DryContext) -> None:
    """PEFT's trainable count beside the cost model's; a difference fails the step (the plan's gradient and
    optimizer bytes are sized by autoplace's count)."""
    from autoplace.cost.layers import layer_table

    with steps.step("PEFT's trainable parameters (get_nb_trainable_parameters) against autoplace's"):
        trainable, total = model.get_nb_trainable_parameters()
        predicted = int(layer_table(ctx.model).trainable)
        if trainable != predicted:
            raise ValueError(f"PEFT trains {trainable:,} parameters; autoplace's cost model counts {predicted:,}")
    steps.note(f"PEFT: {trainable:,} trainable of {total:,} parameters (autoplace: {predicted:,})")


def _optimizer(steps: Steps, script: types.ModuleType, accelerator: Any, model: Any, args: Any) -> Any:
    """The script's ``optimizer_for``, except where it would take an optimizer that cannot run here (said)."""
    import torch

    host = script.offloads_optimizer(accelerator) if hasattr(script, "offloads_optimizer") else False
    if host:
        accelerator.state.deepspeed_plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False
        steps.note("ZeRO-Offload: the script steps DeepSpeed's CPU Adam (a JIT-built op); the dry run gives prepare a "
                   "torch AdamW over the same parameters (zero_force_ds_cpu_optimizer=false in accelerate's copy of the "
                   "config): its fp32 states have the same shapes")
    if script.PAGED_OPTIMIZER:
        steps.note("the script's paged AdamW (bitsandbytes, CUDA memory) is stood in for by a torch AdamW: the same "
                   "fp32 states, paged out to the host by CUDA on the GPU")
    if host or script.PAGED_OPTIMIZER:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, foreach=False)
    return script.optimizer_for(model, args.lr)


def _prepare_and_measure(steps: Steps, ctx: DryContext, framework: str, accelerator: Any, model: Any,
                         optimizer: Any) -> None:
    """``accelerator.prepare(model, optimizer)``, the first step's optimizer state, the bytes per state."""
    if framework == "deepspeed":
        from autoplace.frameworks._deepspeed_bytes import measure
        from autoplace.frameworks._deepspeed_dry import first_step_state, planned_host

        with steps.step("accelerator.prepare(model, optimizer): deepspeed.initialize through accelerate"):
            engine, _ = accelerator.prepare(model, optimizer)
        with steps.step("the optimizer state and gradient buffers the first step creates"):
            first_step_state(engine)
        steps.stage(0)
        measure(engine, steps, planned_host(ctx.bundle))
        return
    from autoplace.frameworks._accelerate_dry import measure as measure_accelerate
    from autoplace.frameworks._accelerate_dry import prepare

    steps.stage(0)
    prepared, inner = prepare(accelerator, steps, model, optimizer)
    measure_accelerate(steps, prepared, inner, accelerator)


@contextmanager
def _bitsandbytes_caches() -> Iterator[None]:
    """bitsandbytes' quantization-map cache, filled on the host before the meta model is quantized and restored
    after: a map cached on the meta device would break a later quantization on a real device."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        yield
        return
    saved = dict(bnb_functional.name2qmap)
    # made here, on the host: under the meta device its values (read back with .tolist()) would not exist
    bnb_functional.name2qmap.setdefault("dynamic", bnb_functional.create_dynamic_map())
    try:
        yield
    finally:
        bnb_functional.name2qmap.clear()
        bnb_functional.name2qmap.update(saved)


def _fix_launches(exc: BaseException) -> str | None:
    del exc
    return ("re-run autoplace solve --out: every launch kind passes the PEFT script its framework config "
            "(--deepspeed_config ds_config.json / --accelerate_config accelerate_config.yaml)")
