"""ClusterSpec: devices, memory, peak FLOP/s and link tiers, loaded strictly from cluster.yaml.

GPU and interconnect profiles are data (``hardware_profiles/``), referred to by name or
given inline.  A cluster is one or more node pools; a homogeneous cluster is written with
top-level ``nodes, gpus_per_node, gpu, intra_node`` and becomes a single pool.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import Field, PositiveInt, field_validator

from autoplace.errors import SpecError
from autoplace.specs._io import Strict, read_document, validate

Positive = Field(gt=0, allow_inf_nan=False)


class PeakTFLOPS(Strict):
    """Dense (no sparsity) peak TFLOP/s per dtype; None where unsupported."""

    bf16: float | None = Field(None, gt=0, allow_inf_nan=False)
    fp16: float | None = Field(None, gt=0, allow_inf_nan=False)
    fp8: float | None = Field(None, gt=0, allow_inf_nan=False)
    tf32: float | None = Field(None, gt=0, allow_inf_nan=False)
    fp32: float | None = Field(None, gt=0, allow_inf_nan=False)

    def for_dtype(self, dtype: str) -> float:
        """Peak for ``dtype``, falling back to the next wider supported type (fp8 -> bf16 -> fp32)."""
        for name in {"fp8": ("fp8", "bf16", "fp16", "fp32"), "bf16": ("bf16", "fp16", "fp32"),
                     "fp16": ("fp16", "bf16", "fp32"), "tf32": ("tf32", "fp32"), "fp32": ("fp32",)}[dtype]:
            value = getattr(self, name)
            if value is not None:
                return float(value)
        raise SpecError(f"no peak TFLOPS given for {dtype} or a wider type")


class LinkProfile(Strict):
    """A link tier: per-GPU, per-direction bandwidth and per-message latency (the alpha-beta model)."""

    name: str = "inline"
    bandwidth_GBps: float = Positive
    latency_us: float = Field(ge=0, allow_inf_nan=False)
    achievable_fraction: float = Field(1.0, gt=0, le=1)
    sources: dict[str, str] = {}

    @property
    def bytes_per_s(self) -> float:
        """Effective bandwidth collectives reach, bytes/s."""
        return self.bandwidth_GBps * 1e9 * self.achievable_fraction

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


class GPUProfile(Strict):
    """One accelerator model."""

    name: str = "inline"
    memory_GiB: float = Positive
    peak_TFLOPS: PeakTFLOPS
    hbm_bandwidth_TBps: float = Positive
    host_link: str | LinkProfile = "pcie4"
    matmul_efficiency: list[list[float]] = [[1.0, 0.5]]
    sources: dict[str, str] = {}

    @field_validator("matmul_efficiency")
    @classmethod
    def _sorted_fractions(cls, table: list[list[float]]) -> list[list[float]]:
        if not table or any(len(row) != 2 for row in table):
            raise ValueError("needs rows of [width, fraction]")
        widths = [w for w, _ in table]
        if widths != sorted(widths) or any(not 0 < f <= 1 for _, f in table):
            raise ValueError("rows must be [width, fraction] with increasing width and 0 < fraction <= 1")
        return table

    @property
    def memory_bytes(self) -> float:
        return self.memory_GiB * 2**30


class PoolInput(Strict):
    """A node pool as written in cluster.yaml (profiles by name or inline)."""

    name: str = "pool"
    nodes: PositiveInt
    gpus_per_node: PositiveInt
    gpu: str | GPUProfile
    intra_node: str | LinkProfile
    inter_node: str | LinkProfile | None = None
    host_memory_GB: float = Field(512, gt=0, allow_inf_nan=False)


class ClusterInput(Strict):
    """cluster.yaml: either the homogeneous top-level form or ``pools``."""

    name: str = "cluster"
    source: str = ""
    nodes: PositiveInt | None = None
    gpus_per_node: PositiveInt | None = None
    gpu: str | GPUProfile | None = None
    intra_node: str | LinkProfile | None = None
    inter_node: str | LinkProfile | None = None
    host_memory_GB: float | None = Field(None, gt=0, allow_inf_nan=False)
    pools: list[PoolInput] | None = Field(None, min_length=1)


class NodePool(Strict):
    """A resolved pool: every profile is an object."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPUProfile
    intra_node: LinkProfile
    inter_node: LinkProfile
    host_link: LinkProfile
    host_memory_GB: float

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class ClusterSpec(Strict):
    """The cluster the job runs on: one or more node pools sharing an inter-node network."""

    name: str
    pools: tuple[NodePool, ...]

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def homogeneous(self) -> bool:
        return len({p.gpu.name for p in self.pools}) == 1 and len({p.gpus_per_node for p in self.pools}) == 1

    @property
    def gpus_per_node(self) -> int:
        """GPUs per node; for mixed pools the smallest (the bound for node-local groups)."""
        return min(p.gpus_per_node for p in self.pools)

    @property
    def gpu_label(self) -> str:
        return "+".join(dict.fromkeys(p.gpu.name for p in self.pools))

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "gpus": self.gpus, "gpu": self.gpu_label,
                "nodes": sum(p.nodes for p in self.pools), "gpus_per_node": self.gpus_per_node}


_HW_KINDS = {"gpu": GPUProfile, "interconnect": LinkProfile}


def profile_names(kind: str) -> list[str]:
    """Names of the shipped profiles of ``kind`` ('gpu' or 'interconnect')."""
    folder = resources.files("hardware_profiles") / kind
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


@cache
def load_profile(kind: str, name: str) -> Any:
    """Load a shipped profile by name.

    Raises:
        SpecError: unknown name (the message lists the valid ones) or a malformed file.
    """
    if name not in profile_names(kind):
        raise SpecError(f"unknown {kind} profile {name!r}; valid: {', '.join(profile_names(kind))}")
    ref = resources.files("hardware_profiles") / kind / f"{name}.yaml"
    with resources.as_file(ref) as path:
        data = read_document(path)
    return validate(_HW_KINDS[kind], data, source=f"hardware_profiles/{kind}/{name}.yaml")


def _resolve(kind: str, value: Any, *, source: str, field: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return load_profile(kind, value)
    except SpecError as exc:
        if exc.source:  # the profile file itself is broken
            raise
        raise SpecError(exc.detail, source=source, field=field) from None


def cluster_from_dict(data: dict[str, Any], *, source: str = "<cluster>") -> ClusterSpec:
    """Validate a parsed cluster document and resolve its profile names."""
    raw = validate(ClusterInput, data, source=source)
    pools = raw.pools if raw.pools is not None else [_single_pool(raw, source)]
    if raw.pools is not None:
        for key in ("nodes", "gpus_per_node", "gpu", "intra_node", "host_memory_GB"):
            if getattr(raw, key) is not None:
                raise SpecError("give it per pool when 'pools' is used", source=source, field=key)
    resolved = []
    for i, pool in enumerate(pools):
        where = f"pools.{i}." if raw.pools is not None else ""
        inter = pool.inter_node or raw.inter_node
        if inter is None:
            if pool.nodes > 1 or len(pools) > 1:
                raise SpecError("required when there is more than one node", source=source, field=f"{where}inter_node")
            inter = pool.intra_node
        gpu = _resolve("gpu", pool.gpu, source=source, field=f"{where}gpu")
        resolved.append(NodePool(
            name=pool.name if raw.pools is not None else raw.name,
            nodes=pool.nodes,
            gpus_per_node=pool.gpus_per_node,
            gpu=gpu,
            intra_node=_resolve("interconnect", pool.intra_node, source=source, field=f"{where}intra_node"),
            inter_node=_resolve("interconnect", inter, source=source, field=f"{where}inter_node"),
            host_link=_resolve("interconnect", gpu.host_link, source=source, field=f"{where}gpu.host_link"),
            host_memory_GB=pool.host_memory_GB,
        ))
    return ClusterSpec(name=raw.name, pools=tuple(resolved))


def _single_pool(raw: ClusterInput, source: str) -> PoolInput:
    for key in ("nodes", "gpus_per_node", "gpu", "intra_node"):
        if getattr(raw, key) is None:
            raise SpecError("required key is missing (or give 'pools')", source=source, field=key)
    return PoolInput(name=raw.name, nodes=raw.nodes, gpus_per_node=raw.gpus_per_node, gpu=raw.gpu,  # type: ignore[arg-type]
                     intra_node=raw.intra_node, inter_node=raw.inter_node,  # type: ignore[arg-type]
                     host_memory_GB=raw.host_memory_GB or 512.0)


def load_cluster(path: str | Path) -> ClusterSpec:
    """Load cluster.yaml, resolving GPU and interconnect profile names."""
    return cluster_from_dict(read_document(path), source=str(path))
