"""Inputs and output choices shared by solve, evaluate and explain: the cluster given as a file
or as flags, the output format, the model's origin for the header, and how plan.json names
both.  The commands themselves live in :mod:`autoplace.cli`.
"""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from autoplace.cli_usage import finite
from autoplace.errors import SpecError

OptClusterArg = Annotated[Path | None, typer.Argument(
    metavar="[CLUSTER]", help="cluster.yaml, or NODESxGPUSxGPU (4x8xh100); or use --cluster / --gpu --nodes",
    show_default=False)]
ClusterOpt = Annotated[str | None, typer.Option("--cluster", help="NODESxGPUSxGPU, e.g. 4x8xh100: the GPU's "
                                                "reference nodes, links from its profile", rich_help_panel="Cluster")]
GpuOpt = Annotated[str | None, typer.Option("--gpu", help="GPU profile or alias (h100, a100, ...)",
                                            rich_help_panel="Cluster")]
NodesOpt = Annotated[int | None, typer.Option("--nodes", min=1, help="Nodes (default 1).", rich_help_panel="Cluster")]
GpnOpt = Annotated[int | None, typer.Option("--gpus-per-node", min=1, help="Default: the GPU profile's.",
                                            rich_help_panel="Cluster")]
IntraOpt = Annotated[str | None, typer.Option("--intra-node", help="Link inside a node (default: the GPU profile's).",
                                              rich_help_panel="Cluster")]
InterOpt = Annotated[str | None, typer.Option("--inter-node", help="Link between nodes (default: the GPU profile's).",
                                              rich_help_panel="Cluster")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Apply a --calibration measured on other hardware or "
                                        "with another framework (warns instead of refusing).")]


class Format(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"
    markdown = "markdown"


FormatOpt = Annotated[Format | None, typer.Option(
    "--format", help="table (rich text; never cut when piped), json (as --json), csv (the tables), markdown.")]
class Method(StrEnum):
    full = "full"
    lora = "lora"
    qlora = "qlora"


_TUNE = "Fine-tuning"
MethodOpt = Annotated[Method | None, typer.Option(
    "--method", help="full (every weight trains), lora (frozen base in the compute dtype + adapters) or qlora "
    "(frozen linear weights in 4-bit NF4 + adapters). Default: the model file's training.method, else full.",
    rich_help_panel=_TUNE)]
LoraRankOpt = Annotated[int | None, typer.Option("--lora-rank", min=1, help="Adapter rank r (default 16).",
                                                 rich_help_panel=_TUNE)]
LoraAlphaOpt = Annotated[float | None, typer.Option("--lora-alpha", callback=finite,
                                                   help="Adapter scale alpha (default 32).", rich_help_panel=_TUNE)]
LoraTargetsOpt = Annotated[str | None, typer.Option(
    "--lora-targets", help="Projections to adapt, comma-separated from q,k,v,o,gate,up,down (default: all).",
    rich_help_panel=_TUNE)]
PagedOpt = Annotated[bool | None, typer.Option(
    "--paged-optimizer/--no-paged-optimizer", help="Optimizer states in paged memory the driver evicts to the "
    "host (bitsandbytes' paged optimizers): not counted on the GPU.", rich_help_panel=_TUNE, show_default=False)]


def tuning_overrides(method: Method | None, rank: int | None, alpha: float | None, targets: str | None,
                     paged: bool | None) -> dict[str, Any]:
    """The model overrides --method, --lora-rank, --lora-alpha, --lora-targets and --paged-optimizer ask for."""
    roles = [t.strip() for t in targets.split(",") if t.strip()] if targets is not None else None
    from autoplace.specs.model import LORA_ROLES

    if roles == []:
        raise SpecError("--lora-targets names no projection; give some of q,k,v,o,gate,up,down", source="--lora-targets")
    unknown = [r for r in roles or [] if r not in LORA_ROLES]
    if unknown:
        raise SpecError(f"unknown projection {', '.join(map(repr, unknown))}; valid: {', '.join(LORA_ROLES)}",
                        source="--lora-targets")
    return {"method": method.value if method else None, "lora_rank": rank, "lora_alpha": alpha,
            "lora_targets": roles, "paged_optimizer": paged}


def check_lora_rank(model: Any, tuning: dict[str, Any], path: Path) -> None:
    """The LoRA rank must fit every projection it adapts (:func:`autoplace.cost.finetune.rank_refusal`),
    a rank given as --lora-rank as one the model file gives; the error names where the rank (or,
    with the file's rank, the --lora-targets that chose the projection) came from."""
    from autoplace.cost.finetune import rank_refusal
    from autoplace.specs.model import TransformerSpec

    why = rank_refusal(model) if isinstance(model, TransformerSpec) else None
    if why is None:
        return
    flag = next((f"--{k.replace('_', '-')}" for k in ("lora_rank", "lora_targets") if tuning.get(k) is not None), None)
    raise SpecError(why, source=flag or str(path), field=None if flag else "training.lora.rank")


class TraceInput(StrEnum):
    tokens = "tokens"
    hidden = "hidden"


class TraceDtype(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def cluster_from_args(path: Path | None, short: str | None = None, gpu: str | None = None, nodes: int | None = None,
             gpus_per_node: int | None = None, intra: str | None = None, inter: str | None = None) -> Any:
    """The cluster from CLUSTER (a file, or NODESxGPUSxGPU) or from the cluster flags, not both."""
    from autoplace.specs.cluster import SHORTHAND, cluster_from_flags, load_cluster, parse_cluster_shorthand

    flags = {"--cluster": short, "--gpu": gpu, "--nodes": nodes, "--gpus-per-node": gpus_per_node,
             "--intra-node": intra, "--inter-node": inter}
    given = [k for k, v in flags.items() if v is not None]
    if path is not None and not path.exists() and SHORTHAND.match(str(path)):
        path, short = None, short or str(path)  # CLUSTER written as 4x8xh100
    if path is not None:
        if given:
            raise SpecError(f"give the cluster once: a file or {', '.join(given)}", source=str(path))
        return load_cluster(path)
    if short is not None and gpu is not None:
        raise SpecError("give --cluster or --gpu, not both", source="--cluster")
    if short is not None:
        n, gpn, gpu = parse_cluster_shorthand(short)
        nodes, gpus_per_node = n, gpus_per_node or gpn
    if gpu is None:
        raise SpecError("a cluster is needed: a cluster.yaml, --cluster 4x8xh100, or --gpu h100 --nodes 4",
                        source="CLUSTER")
    return cluster_from_flags(gpu, nodes or 1, gpus_per_node=gpus_per_node, intra_node=intra, inter_node=inter)


def check_deadline(days: float | None, tokens: str | None) -> None:
    """``scale --days``: a positive, finite number of days, given with ``--tokens`` (what it trains by then).

    Raises:
        SpecError: one line naming ``--days``.
    """
    if days is None:
        return
    if not (math.isfinite(days) and days > 0):
        raise SpecError(f"the deadline must be a positive, finite number of days, got {days:g}", source="--days")
    if tokens is None:
        raise SpecError("needs --tokens: the token budget to train within the deadline", source="--days")


def output_format(fmt: Format | None, as_json: bool) -> str:
    """--json is --format json; the two must agree when both are given."""
    if as_json and fmt not in (None, Format.json):
        raise SpecError(f"--json and --format {fmt.value} disagree; give one", source="--format")
    return "json" if as_json else (fmt or Format.table).value


def model_origin_of(model: Path, m: Any, origin: Any) -> dict[str, Any]:
    """Where the model came from and which of its training numbers are defaults (the header),
    from what the loader recorded (``origin``)."""
    from autoplace.report import model_origin
    from autoplace.specs.hub import resolve_model

    path, repo = resolve_model(model)
    return model_origin(m, origin, path, repo)


def model_ref(model: Path) -> str:
    """How plan.json names the model: the file read (a Hub id's cached config.json)."""
    from autoplace.specs.hub import resolve_model

    return str(resolve_model(model)[0].resolve())


def cluster_ref(path: Path | None, cluster: Any) -> str:
    """How plan.json names the cluster: the file, or NODESxGPUSxGPU for a cluster built from flags
    (link overrides are not kept: the reference is the GPU's default node)."""
    if path is not None and path.exists():
        return str(path.resolve())
    pool = cluster.pools[0]
    return f"{pool.nodes}x{pool.gpus_per_node}x{pool.gpu.name}"
