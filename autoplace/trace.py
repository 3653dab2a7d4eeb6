"""``autoplace trace``: a model defined in PyTorch code becomes the layer graph the solver reads.

The factory builds the module on the meta device (no memory, no weights); one forward and one
backward pass of a ``batch x seq_len`` input then give, per block of the model's repeated
stack (its largest ``nn.ModuleList``) and for what runs before and after it:

* parameters -- counted once each (a tied head is its embedding's);
* forward FLOPs -- ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions and
  attention kernels, 2 FLOPs per multiply-add; elementwise ops are not counted, as in the
  shorthand's formulas); the backward pass is measured as a whole and reported beside it;
* saved-activation bytes -- every tensor autograd saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``, parameters (and views of them) excluded and
  each tensor counted once.  This is what *eager* PyTorch keeps; a fused or flash-attention
  kernel in the real job can keep less.

Per-token numbers are the totals divided by ``batch x seq_len``.  Only this module imports torch.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autoplace.errors import SpecError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Region:
    """What one part of the model holds and does: a block, or the parts before/after the blocks."""

    name: str
    params: int = 0
    flops: float = 0.0
    saved_bytes: float = 0.0


@dataclass
class Trace:
    """The measured model: regions in execution order, plus totals."""

    regions: list[Region]
    tokens: int
    hidden: int
    vocab: int
    forward_flops: float
    backward_flops: float
    blocks_path: str
    notes: list[str] = field(default_factory=list)


def load_factory(spec: str) -> Any:
    """``package.module:attr[.attr]`` -> the object it names.

    Raises:
        SpecError: not of that form, the module cannot be imported, or the attribute is missing.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"expected module:factory (e.g. transformers:LlamaForCausalLM), got {spec!r}",
                        source="FACTORY")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"cannot import {module_name!r} ({exc})", source="FACTORY") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"{module_name!r} has no attribute {attr!r}", source="FACTORY")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{spec} is not callable", source="FACTORY")
    return obj


def build(factory: Any, args: dict[str, Any], dtype: str) -> nn.Module:
    """The module ``factory(**args)`` builds, on the meta device in ``dtype``.

    A Hugging Face model class (it has ``config_class``) is built from its config:
    ``factory(factory.config_class(**args))`` -- a LlamaForCausalLM from LlamaConfig keys.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(_DTYPES[dtype])
    try:
        with torch.device("meta"):
            config_class = getattr(factory, "config_class", None)
            module = factory(config_class(**args)) if config_class is not None else factory(**args)
    except TypeError as exc:
        raise SpecError(f"the factory rejected the arguments: {exc}", source="--args") from None
    finally:
        torch.set_default_dtype(previous)
    if not isinstance(module, nn.Module):
        raise SpecError(f"the factory returned {type(module).__name__}, not a torch.nn.Module", source="FACTORY")
    return module


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """The repeated stack: the ``nn.ModuleList`` holding the most parameters, and its blocks."""
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise SpecError("the module has no nn.ModuleList of blocks to split the graph at", source="FACTORY")
    name, stack = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return name, list(stack)


def _dims(module: nn.Module, hidden: int | None) -> tuple[int, int]:
    """(hidden, vocab): from a Hugging Face config, else the first embedding, else ``hidden``."""
    config = getattr(module, "config", None)
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    h = hidden or getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    h = h or (embedding.embedding_dim if embedding is not None else None)
    if not h:
        raise SpecError("cannot tell the model's hidden size; pass --hidden", source="--hidden")
    vocab = getattr(config, "vocab_size", None) or (embedding.num_embeddings if embedding is not None else 0)
    return int(h), int(vocab)


def trace(module: nn.Module, *, seq_len: int, batch: int = 1, inputs: str = "tokens",
          hidden: int | None = None) -> Trace:
    """One forward and backward pass on meta tensors, measured per region (see the module docstring)."""
    h, vocab = _dims(module, hidden)
    path, blocks = find_blocks(module)
    regions = [Region("embed"), *(Region(f"block{i}") for i in range(len(blocks))), Region("head")]
    state = {"region": 0}
    hooks = []
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda *_, i=i: state.update(region=i + 1)))
        hooks.append(block.register_forward_hook(lambda *_: state.update(region=len(regions) - 1)))
    owner, counted = _param_regions(module, blocks, state, hooks)
    params_ids = {id(p) for p in module.parameters()}
    seen: set[tuple[Any, ...]] = set()
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        # once per region: a tensor every block saves (RoPE's cos/sin) counts in each block, so
        # identical blocks stay identical (a slight over-count of what is shared)
        key = (state["region"], id(base), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if id(t) not in params_ids and id(base) not in params_ids and key not in seen:
            seen.add(key)
            kept.append(t)
            regions[state["region"]].saved_bytes += t.numel() * t.element_size()
        return t

    shape = (batch, seq_len) if inputs == "tokens" else (batch, seq_len, h)
    try:
        x = (torch.zeros(*shape, dtype=torch.long, device="meta") if inputs == "tokens"
             else torch.zeros(*shape, device="meta", requires_grad=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as fwd:
            loss = _loss(module(x), x if inputs == "tokens" else None, vocab)
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - the user's model code, or torch refusing the shapes asked for
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise SpecError(f"its forward and backward on {inputs} of shape {shape} (--input, --batch, --seq-len) "
                        f"failed: {type(exc).__name__}: {first}", source="FACTORY") from exc
    finally:
        for hook in hooks:
            hook.remove()
    _split_flops(fwd, regions, module, path, len(blocks))
    for region, count in owner.items():
        regions[region].params += count
    regions[-1].params += sum(p.numel() for p in module.parameters() if id(p) not in counted)  # never ran
    tokens = batch * seq_len
    return Trace(regions, tokens, h, vocab, float(fwd.get_total_flops()), float(bwd.get_total_flops()), path)


def _param_regions(module: nn.Module, blocks: list[nn.Module], state: dict[str, int],
                   hooks: list[Any]) -> tuple[dict[int, int], set[int]]:
    """Region index -> parameters first used there (outside blocks: when their module first runs),
    filled in as the forward runs; and the ids of the parameters counted so far."""
    owner: dict[int, int] = {}
    counted: set[int] = set()
    for i, block in enumerate(blocks):
        for p in block.parameters():
            counted.add(id(p))
            owner[i + 1] = owner.get(i + 1, 0) + p.numel()
    inside = {id(m) for b in blocks for m in b.modules()}

    def claim(mod: nn.Module, *_: Any) -> None:
        for p in mod.parameters(recurse=False):
            if id(p) not in counted:
                counted.add(id(p))
                owner[state["region"]] = owner.get(state["region"], 0) + p.numel()

    for mod in module.modules():
        if id(mod) not in inside and any(True for _ in mod.parameters(recurse=False)):
            hooks.append(mod.register_forward_pre_hook(claim))
    return owner, counted


def _loss(out: Any, tokens: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Next-token cross-entropy over the logits when the output is vocab-wide, else the sum."""
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = next(t for t in logits if isinstance(t, torch.Tensor))
    if tokens is not None and vocab and logits.shape[-1] == vocab:
        return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens.reshape(-1))
    return logits.float().sum()


def _split_flops(mode: FlopCounterMode, regions: list[Region], module: nn.Module, path: str, blocks: int) -> None:
    """Forward FLOPs per block from the counter's per-module totals; the rest before/after."""
    counts = {name: sum(ops.values()) for name, ops in mode.get_flop_counts().items()}
    root = type(module).__name__
    for i in range(blocks):
        regions[i + 1].flops = float(counts.get(f"{root}.{path}.{i}", 0))
    rest = float(mode.get_total_flops()) - sum(r.flops for r in regions[1:-1])
    regions[-1].flops = rest  # embedding lookups count no FLOPs; the head's matmul is the rest


def to_graph(t: Trace, *, name: str, source: str, global_batch: int, seq_len: int) -> dict[str, Any]:
    """The layer-graph model.json (GraphSpec): embed, the blocks (identical neighbours merged
    with ``repeat``), head; every entry tensor-parallel shardable (Megatron's split)."""
    entries: list[dict[str, Any]] = []
    for region in t.regions:
        if not (region.params or region.flops or region.saved_bytes):
            continue
        entry = {"name": "block" if region.name.startswith("block") else region.name, "params": region.params,
                 "flops_per_token": _count(region.flops / t.tokens),
                 "activation_bytes_per_token": _count(region.saved_bytes / t.tokens), "repeat": 1,
                 "tp_shardable": True}
        last = entries[-1] if entries else None
        if last is not None and {k: v for k, v in last.items() if k != "repeat"} == {
                k: v for k, v in entry.items() if k != "repeat"}:
            last["repeat"] += 1
        else:
            entries.append(entry)
    return {"name": name, "source": source, "hidden": t.hidden, "seq_len": seq_len, "vocab": t.vocab,
            "graph": entries, "training": {"global_batch": global_batch}}


def _count(x: float) -> float:
    """A per-token count as the schema takes it: 0, or at least 1, rounded to 3 decimals."""
    return 0.0 if x < 0.5 else max(1.0, round(x, 3))


def trace_factory(spec: str, args_json: str | None, *, seq_len: int, batch: int, dtype: str, inputs: str,
                  hidden: int | None, global_batch: int, name: str | None) -> tuple[dict[str, Any], Trace]:
    """FACTORY and --args to the model.json document and the trace behind it."""
    try:
        args = json.loads(args_json) if args_json else {}
    except json.JSONDecodeError as exc:
        raise SpecError(f"not JSON: {exc}", source="--args") from None
    if not isinstance(args, dict):
        raise SpecError(f"must be a JSON object of keyword arguments, got {args!r}", source="--args")
    module = build(load_factory(spec), args, dtype)
    measured = trace(module, seq_len=seq_len, batch=batch, inputs=inputs, hidden=hidden)
    source = f"autoplace trace {spec}" + (f" --args '{args_json}'" if args_json else "") + \
        f" (seq_len {seq_len}, batch {batch}, {dtype}, eager PyTorch)"
    doc = to_graph(measured, name=name or spec.rsplit(":", 1)[-1], source=source, global_batch=global_batch,
                   seq_len=seq_len)
    ratio = measured.backward_flops / measured.forward_flops if measured.forward_flops else 0.0
    measured.notes.append(f"backward/forward FLOPs measured {ratio:.3f} (the cost model assumes 2)")
    return doc, measured
