"""Read Megatron-LM arguments (a ``megatron_args.sh`` bash array, or the words themselves) back into a Plan.

The reader is strict where Megatron is silent about meaning: the arguments must train the model
file's model (its layer count and hidden size), the degrees must divide the cluster, and a
recompute or split it cannot state as a Plan is refused with the flag named.  Flags that do not
change the placement (the model's other shape flags, data and tokenizer arguments) are ignored.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from autoplace.emit._common import blocks
from autoplace.errors import SpecError
from autoplace.plan import FP8, Plan, count_at, even_split, model_chunks
from autoplace.specs._io import read_text
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec, TransformerSpec

_STRATEGY = {"optim_grads": 2, "optim_grads_params": 3}
_SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--optimizer-cpu-offload",
             "--grad-reduce-in-bf16"}


def megatron_words(text: str, src: str = "<megatron arguments>") -> list[str]:
    """The argument words of a ``NAME=( ... )`` bash array file (comments skipped), or of plain words.

    Raises:
        SpecError: text bash would not split into words (an unclosed quote).
    """
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        raise SpecError(f"not bash words: {str(exc).lower()}", source=src) from None
    if words and words[0].endswith("=(") and words[-1] == ")":
        return words[1:-1]
    return words


def _flags(words: list[str], src: str) -> dict[str, list[str]]:
    """``--flag value ...`` words as flag -> values (switches have none)."""
    flags: dict[str, list[str]] = {}
    current: list[str] | None = None
    for word in words:
        if word.startswith("--"):
            current = flags.setdefault(word, [])
        elif current is None:
            raise SpecError(f"expected a --flag, got {word!r}", source=src)
        else:
            current.append(word)
    return flags


def _int(flags: dict[str, list[str]], flag: str, src: str, default: int | None = None, minimum: int = 1) -> int:
    """One whole number as Megatron's argparse reads it (``int(word)``), in [``minimum``, 2**31)."""
    values = flags.get(flag)
    if values is None:
        if default is None:
            raise SpecError("required to place the job", source=src, field=flag)
        return default
    try:
        (value,) = values
        number = int(value)
    except ValueError:
        raise SpecError(f"expected one whole number, got {' '.join(values) or 'nothing'}", source=src,
                        field=flag) from None
    return count_at(number, minimum=minimum, source=src, field=flag)


def plan_from_megatron(cfg: str | Path | list[str], model: ModelSpec, cluster: ClusterSpec) -> Plan:
    """Megatron-LM arguments (+ model + cluster) as a Plan.

    Raises:
        SpecError: arguments for another model, degrees that do not divide the cluster, a batch
            the degrees cannot make, or a recompute/split a Plan cannot state (the flag named).
    """
    src = str(cfg) if isinstance(cfg, (str, Path)) and Path(cfg).exists() else "<megatron arguments>"
    words = cfg if isinstance(cfg, list) else megatron_words(read_text(cfg) if src != "<megatron arguments>"
                                                             else str(cfg), src)
    flags = _flags(words, src)
    n = blocks(model)
    if isinstance(model, TransformerSpec):
        for flag, want in (("--num-layers", model.layers), ("--hidden-size", model.hidden)):
            got = _int(flags, flag, src, want)
            if got != want:
                raise SpecError(f"the arguments train {flag.strip('-')} {got}, but the model file {model.name} has "
                                f"{want}", source=src, field=flag)
    tp, pp, cp, ep = (_int(flags, f"--{name}-parallel-size", src, 1) for name in
                      ("tensor-model", "pipeline-model", "context", "expert-model"))
    if cluster.gpus % (tp * pp * cp):
        raise SpecError(f"tp({tp}) * pp({pp}) * cp({cp}) does not divide the cluster's {cluster.gpus} GPUs",
                        source=src, field="--tensor-model-parallel-size")
    dp = cluster.gpus // (tp * pp * cp)
    zero, replicate = _sharding(flags, dp, src)
    mbs, batch = _int(flags, "--micro-batch-size", src), _int(flags, "--global-batch-size", src)
    if mbs < 1 or batch % (mbs * dp):
        raise SpecError(f"global batch {batch} is not a multiple of micro-batch {mbs} x data parallel {dp}",
                        source=src, field="--global-batch-size")
    parts = _parts(flags, pp, n, src)
    vpp = len(parts) // pp
    stages = tuple(sum(parts[r::pp]) for r in range(pp))
    return Plan(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=replicate, dp_shard=dp // replicate, vpp=vpp,
                sp="--sequence-parallel" in flags and tp > 1, zero=zero, mbs=mbs, grad_accum=batch // (mbs * dp),
                schedule="interleaved" if vpp > 1 else "1f1b",
                offload_optimizer="cpu" if "--optimizer-cpu-offload" in flags else "none",
                compress="bf16" if "--grad-reduce-in-bf16" in flags else "none",
                recompute=_recompute(flags, parts, src), layers_per_stage=stages,
                **_recipe(flags, model, tp, src), **_slots(flags, parts, stages, vpp, src))


def _recipe(flags: dict[str, list[str]], model: ModelSpec, tp: int, src: str) -> dict[str, Any]:
    """The recipe keys the flags turn on; ``--fp8-format`` without ``--fp8-recipe`` is Megatron's
    default (delayed), or the model file's own fp8 when it says fp8."""
    fp8 = "none"
    if "--fp8-format" in flags:
        fp8 = (flags.get("--fp8-recipe") or ["none" if model.training.recipe().compute_dtype == "fp8" else "delayed"])[0]
        if fp8 not in FP8:
            raise SpecError(f"{fp8!r} is not modelled; modelled: {', '.join(FP8[1:])}", source=src, field="--fp8-recipe")
    return {"fused_loss": "--cross-entropy-loss-fusion" in flags,
            "tp_overlap": "userbuffers" if "--tp-comm-overlap" in flags and tp > 1 else "none",
            "overlap": "--overlap-grad-reduce" in flags, "fp8": fp8}


def _sharding(flags: dict[str, list[str]], dp: int, src: str) -> tuple[int, int]:
    """(ZeRO level, replicated groups): Megatron-FSDP's strategy, the distributed optimizer, or DDP."""
    if "--use-megatron-fsdp" in flags:
        strategy = (flags.get("--data-parallel-sharding-strategy") or ["optim_grads_params"])[0]
        if strategy not in _STRATEGY:
            raise SpecError(f"{strategy!r} is not modelled; modelled: {', '.join(_STRATEGY)}", source=src,
                            field="--data-parallel-sharding-strategy")
        return _STRATEGY[strategy], 1
    if "--use-distributed-optimizer" not in flags:
        return 0, dp
    replicate = _int(flags, "--num-distributed-optimizer-instances", src, 1)
    if replicate < 1 or dp % replicate:
        raise SpecError(f"{replicate} optimizer instances do not divide data parallel {dp}", source=src,
                        field="--num-distributed-optimizer-instances")
    return 1, replicate


def _slots(flags: dict[str, list[str]], parts: list[int], stages: tuple[int, ...], vpp: int,
           src: str) -> dict[str, Any]:
    """``pp_embedding`` / ``pp_loss``: the account-for flags, or the places a layout's chunks leave for
    the embedding and the loss (the first chunk of the first stage, the last of the last, one block
    short of the stage's others: :func:`autoplace.plan.model_chunks`).

    Raises:
        SpecError: a layout whose chunks no plan states (unequal chunks elsewhere on a stage).
    """
    if "--pipeline-model-parallel-layout" not in flags:
        return {"pp_embedding": "--account-for-embedding-in-pipeline-split" in flags,
                "pp_loss": "--account-for-loss-in-pipeline-split" in flags}
    for embedding, loss in ((False, False), (True, False), (False, True), (True, True)):
        if model_chunks(stages, vpp, embedding, loss) == parts:
            return {"pp_embedding": embedding, "pp_loss": loss}
    raise SpecError(f"chunks of {parts} blocks: a plan's stage holds {vpp} equal chunks, the embedding's and the "
                    "loss's one block short at most", source=src, field="--pipeline-model-parallel-layout")


def _parts(flags: dict[str, list[str]], pp: int, n: int, src: str) -> list[int]:
    """Blocks per model chunk in virtual-stage order: a layout, first/last stage counts, the embedding and
    loss counted as layers, or even."""
    if pp == 1:
        return [n]
    if "--pipeline-model-parallel-layout" in flags:
        layout = "".join(flags["--pipeline-model-parallel-layout"])
        pieces = [chunk.replace("E", "").replace("L", "") for chunk in layout.split("|")]
        try:
            parts = [int(c[2:]) if c.startswith("t*") else c.count("t") if set(c) <= {"t"} else -1 for c in pieces]
        except ValueError:
            parts = [-1]
        if min(parts) < 0 or sum(parts) != n or len(parts) % pp:
            raise SpecError(f"layout {layout!r} is not {n} layers in chunks of 't' a whole number per stage",
                            source=src, field="--pipeline-model-parallel-layout")
        return parts
    if "--decoder-first-pipeline-num-layers" in flags or "--decoder-last-pipeline-num-layers" in flags:
        first = _int(flags, "--decoder-first-pipeline-num-layers", src, 0, minimum=0)
        last = _int(flags, "--decoder-last-pipeline-num-layers", src, 0, minimum=0)
        middle = n - first - last
        if pp < 2 or middle < 0 or (pp > 2 and middle % (pp - 2)) or (pp == 2 and middle):
            raise SpecError(f"first {first} and last {last} leave {middle} layers for {pp - 2} middle stages",
                            source=src, field="--decoder-first-pipeline-num-layers")
        return [first, *([middle // (pp - 2)] * (pp - 2) if pp > 2 else []), last]
    embedding = "--account-for-embedding-in-pipeline-split" in flags
    loss = "--account-for-loss-in-pipeline-split" in flags
    units = n + embedding + loss  # core_v0.16.1 arguments.py: the flags count them as layers
    per_chunk = _int(flags, "--num-layers-per-virtual-pipeline-stage", src, 0, minimum=0)
    count = units // per_chunk if per_chunk else pp
    if per_chunk and (units % per_chunk or count % pp):
        raise SpecError(f"{per_chunk} layers per virtual stage do not split {units} layers over {pp} stages",
                        source=src, field="--num-layers-per-virtual-pipeline-stage")
    if (embedding or loss) and units % pp:
        raise SpecError(f"{units} layers with the embedding / loss counted do not split evenly over pp={pp}",
                        source=src, field="--account-for-embedding-in-pipeline-split")
    if not (embedding or loss):
        return [per_chunk] * count if per_chunk else list(even_split(n, count))
    chunks = model_chunks([units // pp - embedding, *[units // pp] * (pp - 2), units // pp - loss], count // pp,
                          embedding, loss)
    if chunks is None:
        raise SpecError(f"{units // pp} layers per stage are not {count // pp} chunks of a layer or more", source=src,
                        field="--num-layers-per-virtual-pipeline-stage")
    return chunks


def _recompute(flags: dict[str, list[str]], parts: list[int], src: str) -> tuple[str, ...]:
    """Per-block recompute: none, selective, full (uniform), or full on the first k blocks of each chunk."""
    n = sum(parts)
    granularity = (flags.get("--recompute-granularity") or ["none"])[0]
    if granularity == "none":
        return ("none",) * n
    if granularity == "selective":
        return ("selective",) * n
    method = (flags.get("--recompute-method") or ["uniform"])[0]
    k = _int(flags, "--recompute-num-layers", src, 1)
    if granularity == "full" and method == "uniform" and k == 1:
        return ("full",) * n
    if granularity == "full" and method == "block":
        return tuple("full" if j < k else "none" for size in parts for j in range(size))
    raise SpecError(f"recompute {granularity}/{method} of {k} layers is not modelled (modelled: selective, full "
                    "uniform of 1 layer, full block)", source=src, field="--recompute-method")
