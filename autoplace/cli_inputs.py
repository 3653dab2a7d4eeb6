"""Inputs and output choices shared by solve, evaluate and explain: the cluster given as a file
or as flags, the output format, the model's origin for the header, and how plan.json names
both.  The commands themselves live in :mod:`autoplace.cli`.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

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
