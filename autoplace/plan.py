"""Placement semantics as code: states, modes, the Plan, named presets and the plan string.

Four training states -- parameters Θ, optimizer state Ω, gradients G, activations A -- each
placed in one of five modes (docs/ARCHITECTURE.md, "Vocabulary"):

    R replicated · S sharded · S* sharded-with-gather · M materialized · O offloaded

A :class:`Plan` fixes the degrees (dp = dp_replicate x dp_shard, tp, pp with virtual stages,
cp, ep), the ZeRO level and offloads (which decide the modes of Θ, Ω, G), micro-batching,
the recompute mode of every block (which decides A) and the layer-to-stage split.

Conventions, as in Megatron-LM and torchtitan: world = dp x tp x pp x cp; ep divides
dp x cp (experts are sharded over ranks carved out of the data-parallel group); ZeRO shards
over dp_shard x cp (context-parallel ranks hold identical weights).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self, TypeVar

from autoplace.errors import SpecError


class State(StrEnum):
    PARAMS = "params"
    OPTIMIZER = "optimizer"
    GRADS = "grads"
    ACTIVATIONS = "activations"


class Mode(StrEnum):
    REPLICATED = "R"
    SHARDED = "S"
    GATHERED = "S*"
    MATERIALIZED = "M"
    OFFLOADED = "O"


# The largest degree, micro-batch or step count + 1: the cost model packs them into int64 arrays and
# multiplies a few (no real job comes near); plan strings, plan.json and every config reader hold to it
MAX_COUNT = 2**31
RECOMPUTE = ("none", "selective", "full")
# The recompute forms the search gives a configuration's plans (solvers.problem.Problem.recompute_forms, as
# bits 1 << form): every block in one mode (0, 1, 2: RECOMPUTE's indices); full on the first k blocks and none
# after, on one stage (FIRST_FULL: Megatron-LM's block method without a pipeline); or any mix per layer
# (PER_LAYER, or the mode --fix pins).  It tries each form a configuration may take as a row of its own.
FIRST_FULL, PER_LAYER = 3, 4
FORMS = (0, 1, 2, FIRST_FULL, PER_LAYER)
# Pipeline schedules: GPipe, 1F1B and interleaved 1F1B (Narayanan et al. 2021); interleaved-zb and zbv
# split backward into its input- and weight-gradient passes (Qi et al. 2024, "Zero Bubble Pipeline
# Parallelism", ICLR): interleaved-zb is their ZB1P on looped chunks (torch's InterleavedZeroBubble), zbv
# their ZB-V on two chunks per rank placed in a V (torch's ZBVZeroBubble); dualpipev is DeepSeek-V3's
# DualPipe in its V form (DeepSeek-AI 2024, Sec. 3.2.1; torch's DualPipeV), two chunks a rank in ZB-V's V
# whose paired forward and backward chunks hide the expert-parallel all-to-all.  autoplace.rules states
# what each needs; autoplace.cost.step their bubbles.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
# the schedules that run vpp > 1 chunks a rank, and those of them that place two in a V (rank r: r, 2 pp - 1 - r)
MULTI_CHUNK = frozenset({"interleaved", "interleaved-zb", "zbv", "dualpipev"})
V_PLACED = frozenset({"zbv", "dualpipev"})
LOOPED = MULTI_CHUNK - V_PLACED  # chunk v * pp + r on rank r (Narayanan et al. 2021, Sec. 2.2)
# the backward split into B and W passes (feature zero-bubble; DualPipe's W passes fill its bubble too)
ZERO_BUBBLE = frozenset({"interleaved-zb", "zbv", "dualpipev"})
OFFLOAD = ("none", "cpu", "nvme")
# communication compression (autoplace.compression says what each moves, costs and risks)
COMPRESS = ("none", "bf16", "zeropp", "powersgd")
POWERSGD_RANKS = (1, 2, 4)  # searched ranks: "typically only 1-4" (PyTorch's powerSGD_hook docs)
# recipes (issue 24): how the framework runs the plan's kernels and collectives
TP_OVERLAP = ("none", "async", "userbuffers")  # torchtitan's async TP; Megatron's --tp-comm-overlap
FP8 = ("none", "tensorwise", "rowwise", "delayed", "mxfp8")  # torchao's recipes; Transformer Engine's delayed; MX
RECIPE_KEYS = ("compile", "fused_loss", "tp_overlap", "overlap", "fp8")
SLOT_KEYS = ("pp_embedding", "pp_loss")  # the embedding and the loss as pipeline layers (stage_slots)
# What the search may use (solvers.problem.Problem.features; --allow and --deny name them).  compress and fp8
# are opt-in: every option changes the numbers the optimizer sees (autoplace.compression; fp8 GEMMs, and only
# on GPUs with fp8 units); tp-across-nodes puts TP's all-reduces on the network.
# zero-bubble (the ZERO_BUBBLE schedules) adds shapes beside interleave's: a framework that runs none of
# them denies it, so only a search where one that does is admissible (torchtitan) builds them.
FEATURES = ("offload", "cp", "ep", "interleave", "zero-bubble", "tp-across-nodes", "hsdp", "compress", "fp8")
DEFAULT_FEATURES = frozenset({"cp", "ep", "interleave", "zero-bubble", "hsdp", "offload"})


@dataclass(frozen=True)
class Config:
    """Everything a placement fixes except the per-layer decisions (the layer-to-stage split and
    each block's recompute mode).  The solver enumerates these; a :class:`Plan` is a Config with
    its per-layer decisions, and :class:`~autoplace.cost.candidates.Candidates` is many of them
    as arrays.

    Attributes:
        dp_replicate, dp_shard: data parallel = replicate x shard groups (HSDP when both > 1).
        tp, pp, cp, ep: tensor, pipeline, context and expert parallel degrees.
        vpp: virtual pipeline stages per device (a MULTI_CHUNK schedule when > 1).
        sp: sequence parallelism over the TP group (Korthikanti et al. 2022).
        zero: 0 (DDP), 1 (optimizer sharded), 2 (+ gradients), 3 (+ parameters, i.e. FSDP).
        mbs: micro-batch size in sequences; grad_accum: micro-batches per step per pipeline.
        schedule: one of SCHEDULES: gpipe, 1f1b, interleaved, interleaved-zb, zbv or dualpipev.
        offload_optimizer, offload_params: none, cpu or nvme.
        compress: how gradients and gathered weights travel (:mod:`autoplace.compression`):
            none (the precision recipe's dtypes), bf16 (gradients reduced in bf16), zeropp
            (ZeRO++ at zero=3: int8 weight gathers, a node-local secondary shard for backward's
            gathers, int4 gradient reduce-scatter) or powersgd (DDP at zero=0: rank-
            ``powersgd_rank`` low-rank gradients with error feedback).
        powersgd_rank: the PowerSGD rank, > 0 exactly when ``compress`` is powersgd.
        compile: the blocks run under torch.compile (fewer, fused memory-bound kernels).
        fused_loss: hand-fused layers: a cross-entropy that never holds fp32 logits for the
            whole micro-batch (Liger, flash-attention's, Megatron's fused CE) and the fused MLP
            those kernel libraries ship with it.
        tp_overlap: none, async (torchtitan's async TP) or userbuffers (Megatron's
            ``--tp-comm-overlap``): TP collectives pipelined with the matmuls beside them.
        overlap: data-parallel gradient reduction and parameter gathers overlapped with
            compute (DDP buckets, FSDP2 prefetch, Megatron's ``--overlap-grad-reduce``);
            false: they run after (before) the compute, exposed.
        fp8: none, or the fp8 GEMM recipe: tensorwise / rowwise (torchao), delayed
            (Transformer Engine), mxfp8 (block-scaled, Blackwell).
        pp_embedding, pp_loss: the embedding (the output layer and loss) takes one layer's place
            in the pipeline split, as Megatron-LM's ``--account-for-embedding-in-pipeline-split``
            (``--account-for-loss-in-pipeline-split``) count it: the first stage's first model
            chunk (the last stage's last chunk) holds one block fewer than the stage's others
            (:func:`stage_slots`).  With interleaving this states splits such as Llama-3.1-405B's
            126 layers in 8 x 8 chunks (NVIDIA's published recipe).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    vpp: int = 1
    sp: bool = False
    zero: int = 0
    mbs: int = 1
    grad_accum: int = 1
    schedule: str = "1f1b"
    offload_optimizer: str = "none"
    offload_params: str = "none"
    compress: str = "none"
    powersgd_rank: int = 0
    compile: bool = False
    fused_loss: bool = False
    tp_overlap: str = "none"
    overlap: bool = True
    fp8: str = "none"
    pp_embedding: bool = False
    pp_loss: bool = False

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.mbs * self.grad_accum * self.dp

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Self:
        """``cls(**values)`` for ``values`` naming every field: the same object without the
        frozen dataclass's field-by-field ``object.__setattr__`` (several times faster; the
        solver builds tens of thousands), checked as ``__init__`` checks it (:func:`check_config`).

        Raises:
            TypeError: ``values`` does not name every field exactly once.
        """
        names = cls.__dataclass_fields__.keys()  # Config and Plan have no ClassVar pseudo-fields
        if values.keys() != names:
            raise TypeError(f"{cls.__name__} needs the fields {', '.join(names)}, got {', '.join(values)}")
        out = _instance(cls, values)
        check_config(out)
        return out

    def with_micro_batching(self, mbs: int, grad_accum: int) -> Self:
        """This configuration with micro-batches of ``mbs`` sequences, ``grad_accum`` per step:
        ``dataclasses.replace(self, mbs=mbs, grad_accum=grad_accum)``, several times faster (the
        solver makes one per micro-batching of every shape it enumerates)."""
        out = object.__new__(type(self))  # _instance, inlined: keyword arguments would cost a third more
        fields = out.__dict__
        fields.update(vars(self))
        fields["mbs"], fields["grad_accum"] = mbs, grad_accum
        return out

    def replaced(self, changes: dict[str, Any]) -> Self:
        """``dataclasses.replace(self, **changes)`` without its check (:func:`check_config`), for a
        caller whose values are valid by construction: the solver's enumeration, which checks each
        value it combines once and builds tens of thousands of configurations from them."""
        return _instance(type(self), vars(self) | changes)  # one dict merge: no keyword arguments to unpack

    def to_plan(self, layers_per_stage: Sequence[int], recompute: Sequence[str]) -> Plan:
        """This configuration with its per-layer decisions."""
        # vars(self) names every Config field (and on a Plan the three below): each Plan field once
        return _instance(Plan, vars(self), recompute=tuple(recompute), layers_per_stage=tuple(layers_per_stage),
                         extra={})


_DEGREES = ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "vpp", "mbs", "grad_accum")
_CHOICES = {"schedule": SCHEDULES, "offload_optimizer": OFFLOAD, "offload_params": OFFLOAD, "compress": COMPRESS,
            "tp_overlap": TP_OVERLAP, "fp8": FP8}
_FLAGS = ("sp", "compile", "fused_loss", "overlap", "pp_embedding", "pp_loss")


def check_config(config: Config) -> None:
    """The invariants every Config holds, named with their values (as torchtitan's ParallelDims does).

    Raises:
        SpecError: a degree or batch count below 1, a ZeRO level outside 0-3, an unknown choice,
            a PowerSGD rank without PowerSGD (or PowerSGD without a rank).
    """
    for name in _DEGREES:
        value = getattr(config, name)
        # an int passes without the slow Integral check (its type is not bool, a subclass)
        if (type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral))) \
                or value < 1:
            raise SpecError(f"{name} must be a whole number >= 1, got {value!r}", field=name)
        if int(value) >= MAX_COUNT:
            raise SpecError(f"{name} must be below 2**31, got {value!r}", field=name)
    if config.zero not in (0, 1, 2, 3):
        raise SpecError(f"zero must be 0, 1, 2 or 3, got {config.zero!r}", field="zero")
    for name in _FLAGS:
        if not isinstance(getattr(config, name), bool):
            raise SpecError(f"{name} must be true or false, got {getattr(config, name)!r}", field=name)
    for name, valid in _CHOICES.items():
        if getattr(config, name) not in valid:
            raise SpecError(f"{name} must be one of {', '.join(valid)}, got {getattr(config, name)!r}", field=name)
    if (config.compress == "powersgd") != (config.powersgd_rank > 0):
        raise SpecError(f"powersgd_rank={config.powersgd_rank} with compress={config.compress}: a rank > 0 goes "
                        "with compress=powersgd and only with it", field="powersgd_rank")


_C = TypeVar("_C", bound=Config)


def _instance(cls: type[_C], values: dict[str, Any], **changes: Any) -> _C:
    """An instance of the frozen dataclass ``cls`` holding ``values`` with ``changes``, which
    together must name each of its fields once (unchecked: the callers build them so)."""
    out = object.__new__(cls)
    fields = out.__dict__
    fields.update(values)
    fields.update(changes)
    return out


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config))  # read often: the solver builds many plans


@dataclass(frozen=True)
class Plan(Config):
    """One placement of a training job: a :class:`Config` and its per-layer decisions.

    Attributes:
        recompute: the recompute mode of every block, in order.
        layers_per_stage: blocks on each pipeline stage (embedding on the first, head on the last).
    """

    recompute: tuple[str, ...] = ()
    layers_per_stage: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def config(self) -> Config:
        """The plan without its per-layer decisions."""
        return Config(**{name: getattr(self, name) for name in CONFIG_FIELDS})

    @property
    def recompute_mode(self) -> str:
        """The recompute mode shared by every block, or ``mixed``."""
        modes = set(self.recompute)
        return modes.pop() if len(modes) == 1 else ("none" if not modes else "mixed")

    def placement(self) -> dict[State, Mode]:
        """The mode of each state (docs/ARCHITECTURE.md): e.g. ZeRO-3 is (S*, S, S, R)."""
        params = Mode.OFFLOADED if self.offload_params != "none" else (
            Mode.GATHERED if self.zero >= 3 else Mode.REPLICATED)
        optimizer = Mode.OFFLOADED if self.offload_optimizer != "none" else (
            Mode.SHARDED if self.zero >= 1 else Mode.REPLICATED)
        grads = Mode.SHARDED if self.zero >= 2 else Mode.REPLICATED
        if self.recompute_mode != "none":
            acts = Mode.MATERIALIZED
        elif (self.sp and self.tp > 1) or self.cp > 1:
            acts = Mode.SHARDED
        else:
            acts = Mode.REPLICATED
        return {State.PARAMS: params, State.OPTIMIZER: optimizer, State.GRADS: grads, State.ACTIVATIONS: acts}

    def stage_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) block indices of every pipeline stage."""
        out, start = [], 0
        for n in self.layers_per_stage:
            out.append((start, start + n))
            start += n
        return out

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def recipe(self) -> dict[str, Any]:
        """The recipe keys (compile, fused_loss, tp_overlap, overlap, fp8) and their values."""
        return {name: getattr(self, name) for name in RECIPE_KEYS}

    def to_dict(self) -> dict[str, Any]:
        """The plan object of the CLI contract (docs/ARCHITECTURE.md, autoplace.solution/v1)."""
        modes = self.placement()
        out: dict[str, Any] = {
            "degrees": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep},
            "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
            "virtual_stages": self.vpp, "schedule": self.schedule, "sequence_parallel": self.sp,
            "micro_batch": self.mbs, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
            "zero_stage": self.zero,
            "placement": {s.value: m.value for s, m in modes.items()},
            "offload": {"params": self.offload_params, "optimizer": self.offload_optimizer},
            "recompute": self.recompute_mode,
            "layers_per_stage": list(self.layers_per_stage),
            "compress": self.compress, "powersgd_rank": self.powersgd_rank,
            "recipe": self.recipe(),
            "pp_embedding": self.pp_embedding, "pp_loss": self.pp_loss,
        }
        if self.recompute_mode == "mixed":
            out["recompute_per_layer"] = list(self.recompute)
        return out

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan.json") -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. the plan.json ``solve --out`` writes).

        Strict, as every reader: counts are ints (not floats such as 2.0, not booleans) below
        2**31 (:func:`count_at`), flags are booleans, choices are names from their lists, one
        block count per pipeline stage, and ``degrees.dp`` and ``global_batch`` agree with what
        they are made of.  Keys beyond the plan's own (an evaluation's memory, step time) are not read.

        Raises:
            SpecError: a missing or ill-typed key, named, with what is valid.
        """
        if not isinstance(d, dict):
            raise SpecError("expected a plan object", source=source)
        deg = _mapping(d, "degrees", source)
        zero = _count(d, "zero_stage", source, minimum=0)
        if zero > 3:
            raise SpecError(f"must be 0, 1, 2 or 3, got {zero}", source=source, field="zero_stage")
        tp, pp, cp, ep, dp = (_count(deg, key, source, "degrees.") for key in ("tp", "pp", "cp", "ep", "dp"))
        rep = _count(d, "dp_replicate", source) if "dp_replicate" in d else (1 if zero else dp)
        shard = _count(d, "dp_shard", source) if "dp_shard" in d else (dp if zero else 1)
        if rep * shard != dp:
            raise SpecError(f"dp_replicate ({rep}) x dp_shard ({shard}) is not degrees.dp ({dp})", source=source,
                            field="degrees.dp")
        layers = _counts(d, "layers_per_stage", source)
        if len(layers) != pp:
            raise SpecError(f"needs one block count per pipeline stage (pp={pp}), got {len(layers)}", source=source,
                            field="layers_per_stage")
        mode = _choice(d, "recompute", (*RECOMPUTE, "mixed"), source)
        recompute = _recompute_per_layer(d, sum(layers), source) if mode == "mixed" else (mode,) * sum(layers)
        offload = _mapping(d, "offload", source)
        plan = cls(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=rep, dp_shard=shard,
                   vpp=_count(d, "virtual_stages", source), sp=_flag(d, "sequence_parallel", source, default=tp > 1),
                   zero=zero, mbs=_count(d, "micro_batch", source), grad_accum=_count(d, "grad_accum", source),
                   schedule=_choice(d, "schedule", SCHEDULES, source),
                   offload_optimizer=_choice(offload, "optimizer", OFFLOAD, source, "offload."),
                   offload_params=_choice(offload, "params", OFFLOAD, source, "offload."),
                   compress=_choice(d, "compress", COMPRESS, source, default="none"),
                   powersgd_rank=_count(d, "powersgd_rank", source, minimum=0) if "powersgd_rank" in d else 0,
                   recompute=recompute, layers_per_stage=layers, **_recipe_dict(d.get("recipe", {}), source),
                   pp_embedding=_flag(d, "pp_embedding", source, default=False),
                   pp_loss=_flag(d, "pp_loss", source, default=False))
        if "global_batch" in d and d["global_batch"] != plan.global_batch:
            raise SpecError(f"{d['global_batch']!r} is not micro_batch x grad_accum x dp = {plan.mbs} x "
                            f"{plan.grad_accum} x {plan.dp} = {plan.global_batch}", source=source, field="global_batch")
        return plan

    def to_string(self) -> str:
        """The ``--plan`` string that rebuilds this plan."""
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}",
                 f"pp={self.pp}", f"cp={self.cp}", f"ep={self.ep}", f"vpp={self.vpp}",
                 f"sp={'true' if self.sp else 'false'}", f"zero={self.zero}", f"mbs={self.mbs}",
                 f"schedule={self.schedule}", f"offload_optimizer={self.offload_optimizer}",
                 f"offload_params={self.offload_params}",
                 *([f"compress={self.compress}"] if self.compress != "none" else []),
                 *([f"powersgd_rank={self.powersgd_rank}"] if self.powersgd_rank else []),
                 *(f"{k}={str(v).lower()}" for k, v in self.recipe().items() if v != RECIPE_DEFAULTS[k]),
                 *(f"{k}=true" for k in SLOT_KEYS if getattr(self, k)),
                 f"layers={':'.join(map(str, self.layers_per_stage))}"]
        if self.recompute_mode == "mixed":
            parts.append("recompute_layers=" + ":".join(r[0] for r in self.recompute))
        else:
            parts.append(f"recompute={self.recompute_mode}")
        return ",".join(parts)


RECIPE_DEFAULTS = {name: Config.__dataclass_fields__[name].default for name in RECIPE_KEYS}


def count_at(value: Any, *, minimum: int, source: str, field: str) -> int:
    """``value`` as a count a document states (plan.json, a framework's config): an int in
    [``minimum``, 2**31) -- not a boolean, and not a float such as 2.0, which no framework takes
    for a degree or a batch size.

    Raises:
        SpecError: anything else, naming ``source`` and ``field``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < MAX_COUNT:
        raise SpecError(f"expected a whole number >= {minimum} and below 2**31, got {value!r}", source=source,
                        field=field)
    return value


def check_blocks(plan: Plan, blocks: int, *, source: str) -> None:
    """A plan read from a file places the model's ``blocks``: one count per pipeline stage adding
    up to them, and a recompute mode (a name from :data:`RECOMPUTE`) for each -- a plan for
    another model would index past them.

    Raises:
        SpecError: naming ``source`` and what does not add up.
    """
    layers = plan.layers_per_stage
    if len(layers) != plan.pp:
        raise SpecError(f"{len(layers)} block counts for pp={plan.pp} stages", source=source, field="layers_per_stage")
    if sum(layers) != blocks:
        raise SpecError(f"the stages hold {sum(layers)} blocks ({':'.join(map(str, layers))}) but the model has "
                        f"{blocks}: a plan for another model?", source=source, field="layers_per_stage")
    if len(plan.recompute) != blocks or any(r not in RECOMPUTE for r in plan.recompute):
        raise SpecError(f"needs {blocks} recompute modes, one per block, from {', '.join(RECOMPUTE)}; got "
                        f"{len(plan.recompute)}: {', '.join(sorted(set(map(str, plan.recompute))))}", source=source,
                        field="recompute")


def _mapping(d: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    if key not in d:
        raise SpecError("required key is missing", source=source, field=key)
    if not isinstance(d[key], dict):
        raise SpecError(f"expected an object, got {d[key]!r}", source=source, field=key)
    return d[key]


def _count(d: dict[str, Any], key: str, source: str, prefix: str = "", *, minimum: int = 1) -> int:
    if key not in d:
        raise SpecError("required key is missing", source=source, field=prefix + key)
    return count_at(d[key], minimum=minimum, source=source, field=prefix + key)


def _counts(d: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    """A non-empty list of block counts (>= 0) whose sum is a count too."""
    value = d.get(key)
    if not isinstance(value, list) or not value:
        raise SpecError(f"expected a list of block counts, one per pipeline stage, got {value!r}", source=source,
                        field=key)
    counts = tuple(count_at(n, minimum=0, source=source, field=f"{key}.{i}") for i, n in enumerate(value))
    count_at(sum(counts), minimum=1, source=source, field=key)
    return counts


def _flag(d: dict[str, Any], key: str, source: str, *, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"expected true or false, got {value!r}", source=source, field=key)
    return value


def _choice(d: dict[str, Any], key: str, valid: tuple[str, ...], source: str, prefix: str = "",
            default: str | None = None) -> str:
    if key not in d and default is None:
        raise SpecError("required key is missing", source=source, field=prefix + key)
    value = d.get(key, default)
    if value not in valid:  # a tuple's membership compares, so a list or mapping is simply not one
        raise SpecError(f"{value!r} is not valid; valid: {', '.join(valid)}", source=source, field=prefix + key)
    return str(value)


def _recompute_per_layer(d: dict[str, Any], blocks: int, source: str) -> tuple[str, ...]:
    modes = d.get("recompute_per_layer")
    if not isinstance(modes, list) or len(modes) != blocks or any(m not in RECOMPUTE for m in modes):
        raise SpecError(f"needs {blocks} modes from {', '.join(RECOMPUTE)}", source=source, field="recompute_per_layer")
    return tuple(modes)


def _recipe_dict(d: Any, source: str) -> dict[str, Any]:
    """The ``recipe`` object of a plan.json: known keys only, booleans as booleans."""
    if not isinstance(d, dict):
        raise SpecError("expected an object of recipe keys", source=source, field="recipe")
    unknown = sorted(set(d) - set(RECIPE_KEYS))
    if unknown:
        raise SpecError(f"unknown recipe key(s) {', '.join(unknown)}; valid: {', '.join(RECIPE_KEYS)}",
                        source=source, field="recipe")
    for name, value in d.items():
        if isinstance(RECIPE_DEFAULTS[name], bool) != isinstance(value, bool):
            raise SpecError(f"{value!r} is not valid", source=source, field=f"recipe.{name}")
    return dict(d)


# ---------------------------------------------------------------------------------------
# Building plans: presets and the key=value string of --plan / --fix

PLAN_KEYS = {
    "dp": int, "dp_replicate": int, "dp_shard": int, "tp": int, "pp": int, "cp": int, "ep": int,
    "vpp": int, "zero": int, "mbs": int, "ga": int, "sp": bool, "recompute": str, "schedule": str,
    "offload_optimizer": str, "offload_params": str, "layers": str, "recompute_layers": str, "preset": str,
    "compress": str, "powersgd_rank": int,
    "compile": bool, "fused_loss": bool, "tp_overlap": str, "overlap": bool, "fp8": str,
    "pp_embedding": bool, "pp_loss": bool,
}

PRESETS: dict[str, dict[str, Any]] = {
    "ddp": {"zero": 0},  # (R, R, R, R)
    "zero1": {"zero": 1},  # (R, S, R, R)
    "zero2": {"zero": 2},  # (R, S, S, R)
    "zero3": {"zero": 3},  # (S*, S, S, R)
    "fsdp": {"zero": 3},
    "hsdp": {"zero": 3, "hsdp": True},  # S* within a node-sized shard group, R across
    "megatron-3d": {"zero": 1, "sp": True, "schedule": "interleaved"},  # distributed optimizer + TP/SP + PP
}


def parse_plan_string(text: str, *, source: str = "--plan") -> dict[str, Any]:
    """Parse ``"dp=64,tp=8,zero=1,recompute=selective"`` into typed values.

    ``--fix`` words arrive joined by "," (``source`` names the flag), so a key given in two of
    them is a repeat like one given twice in a ``--plan`` string.

    Raises:
        SpecError: unknown key (listing the valid ones), a value of the wrong type, a key given
            twice (naming both values: neither silently wins).
    """
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> the value as written, for a repeat's message
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise SpecError(f"expected KEY=VALUE, got {item!r}", source=source)
        if key not in PLAN_KEYS:
            raise SpecError(f"unknown key; valid keys: {', '.join(PLAN_KEYS)}", source=source, field=key)
        if key in given:
            raise SpecError(f"given twice ({key}={given[key]} and {key}={value}); give it once", source=source,
                            field=key)
        given[key] = value
        out[key] = _typed(key, value, source)
    return out


def _typed(key: str, value: str, source: str) -> Any:
    kind = PLAN_KEYS[key]
    if kind is int:
        # ASCII digits only (int() refuses "²", which isdigit() accepts); below 2**31: the cost
        # model packs plans into int64 arrays, and no degree or batch comes near it
        if not (value.isascii() and value.isdigit()) or not (0 if key == "zero" else 1) <= int(value) < MAX_COUNT:
            raise SpecError(f"expected a positive whole number below 2**31, got {value!r}", source=source, field=key)
        return int(value)
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise SpecError(f"expected true or false, got {value!r}", source=source, field=key)
        return value.lower() in ("true", "1", "yes")
    choices = {"recompute": RECOMPUTE, "schedule": SCHEDULES, "offload_optimizer": OFFLOAD,
               "offload_params": OFFLOAD, "preset": tuple(PRESETS), "compress": COMPRESS,
               "tp_overlap": TP_OVERLAP, "fp8": FP8}.get(key)
    if choices and value not in choices:
        raise SpecError(f"{value!r} is not valid; valid: {', '.join(choices)}", source=source, field=key)
    return value


def with_pins(values: dict[str, Any], pins: dict[str, Any], *, source: str) -> dict[str, Any]:
    """``values`` (a parsed ``--plan`` or ``--fix``, or a config read back) with the recipe keys the
    model file pins (``training.recipe``) added: a pin is the value wherever ``values`` give none.

    Raises:
        SpecError: ``values`` give a pinned key another value -- one line naming both, rather than
            one of them silently winning.
    """
    for key, pin in pins.items():
        if key in values and values[key] != pin:
            raise SpecError(f"{key}={str(values[key]).lower()} contradicts the model file's training.recipe.{key}="
                            f"{str(pin).lower()} (drop one of them)", source=source, field=key)
    return {**values, **pins}


def even_split(blocks: int, stages: int) -> tuple[int, ...]:
    """Split ``blocks`` into ``stages`` contiguous counts differing by at most one.

    The extra blocks go to the middle stages: the first stage holds the embedding and (under
    1F1B) the most in-flight activations, the last holds the head and the logits.
    """
    base, extra = divmod(blocks, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), abs(i - (stages - 1) / 2)))
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)


def stage_slots(pp: int, embedding: bool, loss: bool) -> tuple[int, ...]:
    """Places in each pipeline stage's split that the embedding and the loss take (``pp_embedding``,
    ``pp_loss``): one on the first stage, one on the last.  A stage's *units* are its blocks plus
    these; with interleaving its units divide into ``vpp`` equal model chunks, the first chunk of the
    first stage holding the embedding in place of a block, the last chunk of the last stage the
    loss (Megatron-LM's ``--account-for-embedding/loss-in-pipeline-split``: megatron-core 0.16.1
    transformer_block.py ``get_num_layers_to_build``)."""
    slots = [0] * pp
    slots[0] += int(embedding)
    slots[-1] += int(loss)
    return tuple(slots)


def config_slots(config: Config) -> tuple[int, ...]:
    """:func:`stage_slots` of a configuration."""
    return stage_slots(config.pp, config.pp_embedding, config.pp_loss)


def split_units(blocks: int, pp: int, vpp: int = 1, embedding: bool = False, loss: bool = False) -> tuple[int, ...]:
    """The even split: blocks per stage when the blocks and the embedding and loss places
    (:func:`stage_slots`) are spread as evenly as whole model chunks of ``vpp`` units allow
    (:func:`even_split` of the chunks; of the units when ``vpp`` does not divide them, a split the
    interleave rule then refuses)."""
    slots = stage_slots(pp, embedding, loss)
    units = blocks + sum(slots)
    per = [q * vpp for q in even_split(units // vpp, pp)] if units % vpp == 0 else list(even_split(units, pp))
    return tuple(u - s for u, s in zip(per, slots, strict=True))


def schedule_batching(schedule: str, pp: int, grad_accum: int) -> str | None:
    """Why ``schedule`` cannot run ``grad_accum`` micro-batches a step on ``pp`` stages as the cost model
    prices it (one line), or None.  The looped schedules run whole rounds of ``pp`` micro-batches
    (Megatron-LM's interleaved 1F1B requires it; torch's Interleaved1F1B and InterleavedZeroBubble run
    rounds of equal size); ZB-V reaches its steady state, where its bubble is the one costed, only from
    ``2 pp`` micro-batches (Qi et al. 2024, Sec. 6); DualPipeV needs as many micro-batches as its ``2 pp``
    stages (torch's ScheduleDualPipeV.__init__, torch 2.13)."""
    if schedule in LOOPED and grad_accum % pp:
        name = "interleaved 1F1B" if schedule == "interleaved" else "interleaved-zb"
        return f"{name} needs grad_accum({grad_accum}) to be a multiple of pp({pp}) (whole rounds of pp)"
    if schedule == "zbv" and grad_accum < 2 * pp:
        return f"zbv needs grad_accum({grad_accum}) >= 2*pp = {2 * pp} (ZB-V's steady state, Qi et al. 2024)"
    if schedule == "dualpipev" and grad_accum < 2 * pp:
        return f"dualpipev needs grad_accum({grad_accum}) >= 2*pp = {2 * pp} (one micro-batch per stage of its V)"
    return None


def model_chunks(layers_per_stage: Sequence[int], vpp: int, embedding: bool = False,
                 loss: bool = False) -> list[int] | None:
    """Blocks in each of the ``pp * vpp`` model chunks, in virtual-stage order (chunk ``v * pp + r``
    is the v-th chunk of pipeline rank r: the looped placement of Narayanan et al. 2021, Sec. 2.2,
    used by Megatron-LM and torch.distributed.pipelining); None when a stage's units
    (:func:`stage_slots`) are not ``vpp`` chunks of at least one unit each."""
    pp = len(layers_per_stage)
    slots = stage_slots(pp, embedding, loss)
    units = [n + s for n, s in zip(layers_per_stage, slots, strict=True)]
    if any(u % vpp or u < vpp for u in units):
        return None
    chunks = [units[r] // vpp for v in range(vpp) for r in range(pp)]
    chunks[0] -= int(embedding)  # the first rank's first chunk holds the embedding
    chunks[-1] -= int(loss)  # the last rank's last chunk the loss
    return chunks


def build_plan(values: dict[str, Any], *, world: int, blocks: int, global_batch: int,
               gpus_per_node: int = 8, source: str = "--plan") -> Plan:
    """Complete a partial plan (from --plan or a preset) into a Plan with defaults.

    Defaults: missing dp = world / (tp*pp*cp); dp is fully sharded for zero >= 1 (fully
    replicated for zero 0; node-sized shard groups for the hsdp preset); sp on when tp > 1;
    interleaved schedule when vpp > 1 (unless given); grad_accum from the global batch; an even split.

    Raises:
        SpecError: values that cannot make a plan for this world size and batch.
    """
    v = dict(PRESETS.get(values.get("preset", ""), {}))
    v.update({k: x for k, x in values.items() if k != "preset"})
    tp, pp, cp, ep = (v.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    zero = v.get("zero", 0)
    if zero > 3:
        raise SpecError(f"zero must be 0, 1, 2 or 3, got {zero}", source=source, field="zero")
    model_par = tp * pp * cp
    if "dp" not in v and "dp_shard" not in v and "dp_replicate" not in v:
        if world % model_par:
            raise SpecError(f"tp*pp*cp = {model_par} does not divide the {world} GPUs", source=source, field="dp")
        v["dp"] = world // model_par
    dp_rep, dp_shard = _dp_split(v, zero, gpus_per_node // max(1, tp * cp), source)
    vpp = v.get("vpp", 1)
    schedule = v.get("schedule", "interleaved" if vpp > 1 else "1f1b")
    mbs = v.get("mbs", 1)
    dp = dp_rep * dp_shard
    if "ga" in v:
        ga = v["ga"]
    elif global_batch % (mbs * dp):
        raise SpecError(f"global batch {global_batch} is not a multiple of mbs*dp = {mbs}*{dp}",
                        source=source, field="mbs")
    else:
        ga = global_batch // (mbs * dp)
    slots = {k: v[k] for k in SLOT_KEYS if k in v}
    layers = _layers(v, pp, blocks, source, vpp if slots else 1, **slots)
    recompute = _recompute(v, blocks, source)
    compress, rank = _compress(v, source)
    return Plan(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_rep, dp_shard=dp_shard, vpp=vpp,
                sp=v.get("sp", tp > 1), zero=zero, mbs=mbs, grad_accum=ga, schedule=schedule,
                offload_optimizer=v.get("offload_optimizer", "none"), offload_params=v.get("offload_params", "none"),
                compress=compress, powersgd_rank=rank, recompute=recompute, layers_per_stage=layers,
                **{k: v[k] for k in RECIPE_KEYS if k in v}, **slots)


def _compress(v: dict[str, Any], source: str) -> tuple[str, int]:
    """(compress, powersgd_rank): the rank defaults to 4 under powersgd and is refused elsewhere."""
    compress = v.get("compress", "none")
    rank = v.get("powersgd_rank", 4 if compress == "powersgd" else 0)
    if rank and compress != "powersgd":
        raise SpecError(f"powersgd_rank={rank} needs compress=powersgd", source=source, field="powersgd_rank")
    return compress, rank


def _dp_split(v: dict[str, Any], zero: int, node_dp: int, source: str) -> tuple[int, int]:
    if "dp_replicate" in v or "dp_shard" in v:
        rep, shard = v.get("dp_replicate", 1), v.get("dp_shard", 1)
        if "dp" in v and rep * shard != v["dp"]:
            raise SpecError(f"dp_replicate({rep}) * dp_shard({shard}) != dp({v['dp']})", source=source, field="dp")
        return rep, shard
    dp = v["dp"]
    if zero == 0:
        return dp, 1
    if v.get("hsdp"):
        shard = max(1, min(dp, node_dp))
        while dp % shard:
            shard -= 1
        return dp // shard, shard
    return 1, dp


def _layers(v: dict[str, Any], pp: int, blocks: int, source: str, vpp: int = 1, pp_embedding: bool = False,
            pp_loss: bool = False) -> tuple[int, ...]:
    """The ``layers`` key, else the even split (with the embedding and loss places when set:
    :func:`split_units`)."""
    if "layers" not in v:
        if blocks < pp:
            raise SpecError(f"pp={pp} exceeds the model's {blocks} layers", source=source, field="pp")
        if pp > 1 and (pp_embedding or pp_loss):
            return split_units(blocks, pp, vpp, pp_embedding, pp_loss)
        return even_split(blocks, pp)
    layers = parse_layers(v["layers"], source=source)
    if len(layers) != pp or sum(layers) != blocks or min(layers) < 0:
        raise SpecError(f"needs {pp} counts (one per stage) adding up to {blocks} layers, got {v['layers']}",
                        source=source, field="layers")
    return layers


def parse_layers(text: str, *, source: str = "--plan") -> tuple[int, ...]:
    """``"8:8:8:8"`` -> blocks per stage (the one parser of the ``layers`` key).

    Raises:
        SpecError: not whole numbers joined by ':'.
    """
    try:
        return tuple(int(x) for x in str(text).split(":"))
    except ValueError:
        raise SpecError("expected counts joined by ':', e.g. 8:8:8:8", source=source, field="layers") from None


def _recompute(v: dict[str, Any], blocks: int, source: str) -> tuple[str, ...]:
    if "recompute_layers" in v:
        letters = v["recompute_layers"].split(":")
        names = {"n": "none", "s": "selective", "f": "full"}
        if len(letters) != blocks or any(x not in names for x in letters):
            raise SpecError(f"needs {blocks} letters n|s|f joined by ':'", source=source, field="recompute_layers")
        return tuple(names[x] for x in letters)
    return (v.get("recompute", "none"),) * blocks


def stage_mode_counts(plan: Plan, sequence: Sequence[int], kinds: int) -> list[list[list[int]]]:
    """counts[stage][kind][mode]: how many blocks of each kind and recompute mode each stage holds."""
    out = []
    for start, stop in plan.stage_ranges():
        grid = [[0, 0, 0] for _ in range(kinds)]
        for i in range(start, stop):
            grid[sequence[i]][RECOMPUTE.index(plan.recompute[i])] += 1
        out.append(grid)
    return out
