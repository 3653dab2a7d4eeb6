"""ClusterSpec: devices, memory, peak FLOP/s and link tiers, loaded strictly from cluster.yaml.

GPU and interconnect profiles are data (``hardware_profiles/``), referred to by name or
given inline.  A cluster is one or more node pools; a homogeneous cluster is written with
top-level ``nodes, gpus_per_node, gpu, intra_node`` and becomes a single pool.
"""

from __future__ import annotations

import math
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from autoplace.errors import SpecError
from autoplace.plan import FP8
from autoplace.specs._io import Strict, read_document, read_shipped, validate

# Bounds on hardware numbers.  The upper ones are ~1000x today's largest (B200: 180 GB, 8 TB/s HBM,
# 4.5 PFLOP/s fp8, 900 GB/s NVLink5); the lower ones (a millionth of a TFLOP/s or GB/s, a megabyte,
# a thousandth as an efficiency) are far below any real device.  Both keep every time, rate and
# byte count the cost model derives finite, so no score is ever inf or NaN.
MAX_NODES = 1_000_000
MAX_GPUS_PER_NODE = 1024
MAX_NVLINK_DOMAIN = 100_000  # GPUs on one NVLink fabric (NVLink 5 switches reach 576)
MIN_RATE = 1e-6  # TFLOP/s, GB/s, TB/s
MAX_TFLOPS = 1_000_000
MAX_LINK_GBPS = 1_000_000
MAX_HBM_TBPS = 1_000
MAX_LATENCY_US = 1_000_000  # one second per message
MIN_MEMORY = 1e-3  # GiB or GB: a megabyte
MAX_MEMORY_GIB = 100_000
MAX_HOST_MEMORY_GB = 1_000_000
MIN_FRACTION = 1e-3  # achievable bandwidth and GEMM efficiency fractions

Nodes = Annotated[int, Field(ge=1, le=MAX_NODES)]
GPUsPerNode = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]
GPUsPerDomain = Annotated[int, Field(ge=1, le=MAX_NVLINK_DOMAIN)]
NICsPerNode = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]
Peak = Annotated[float, Field(ge=MIN_RATE, le=MAX_TFLOPS, allow_inf_nan=False)]
HostMemory = Annotated[float, Field(ge=MIN_MEMORY, le=MAX_HOST_MEMORY_GB, allow_inf_nan=False)]

# compute dtype -> the peaks it may use, its own first, then wider types (fp8 -> bf16 -> fp32).
_FALLBACK = {"fp8": ("fp8", "bf16", "fp16", "fp32"), "bf16": ("bf16", "fp16", "fp32"),
             "fp16": ("fp16", "bf16", "fp32"), "tf32": ("tf32", "fp32"), "fp32": ("fp32",)}


class PeakTFLOPS(Strict):
    """Dense (no sparsity) peak TFLOP/s per dtype; None where unsupported.

    At least one of bf16, fp16, fp32 is required: every mixed-precision recipe computes in one
    of them or falls back to one (an fp8-only entry would leave a bf16 model without a peak).
    """

    bf16: Peak | None = None
    fp16: Peak | None = None
    fp8: Peak | None = None
    tf32: Peak | None = None
    fp32: Peak | None = None

    @model_validator(mode="after")
    def _has_a_fallback(self) -> PeakTFLOPS:
        if self.bf16 is None and self.fp16 is None and self.fp32 is None:
            raise ValueError("needs a peak for at least one of bf16, fp16, fp32 (the types every "
                             "compute dtype falls back to)")
        return self

    def supports(self, dtype: str) -> bool:
        """Whether ``dtype`` or a wider type has a peak."""
        return any(getattr(self, name) is not None for name in _FALLBACK[dtype])

    def for_dtype(self, dtype: str) -> float:
        """Peak for ``dtype``, falling back to the next wider supported type (fp8 -> bf16 -> fp32)."""
        for name in _FALLBACK[dtype]:
            value = getattr(self, name)
            if value is not None:
                return float(value)
        raise SpecError(f"no peak TFLOPS given for {dtype} or a wider type")


class LinkProfile(Strict):
    """A link tier: per-GPU, per-direction bandwidth and per-message latency (the alpha-beta model)."""

    name: str = "inline"
    bandwidth_GBps: float = Field(ge=MIN_RATE, le=MAX_LINK_GBPS, allow_inf_nan=False)
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, allow_inf_nan=False)
    achievable_fraction: float = Field(1.0, ge=MIN_FRACTION, le=1, allow_inf_nan=False)
    sources: dict[str, str] = {}

    @property
    def bytes_per_s(self) -> float:
        """Effective bandwidth collectives reach, bytes/s."""
        return self.bandwidth_GBps * 1e9 * self.achievable_fraction

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


Fraction = Annotated[float, Field(ge=MIN_FRACTION, le=1, allow_inf_nan=False)]
TableRows = list[list[Annotated[float, Field(allow_inf_nan=False)]]]


class DtypeFractions(Strict):
    """A fraction of the dense peak per compute dtype (None: use the next wider dtype's)."""

    bf16: Fraction | None = None
    fp16: Fraction | None = None
    fp8: Fraction | None = None
    tf32: Fraction | None = None
    fp32: Fraction | None = None

    def for_dtype(self, dtype: str, default: float) -> float:
        """The fraction for ``dtype``, falling back as peaks do (fp8 -> bf16 -> fp16 -> fp32)."""
        for name in _FALLBACK[dtype]:
            value = getattr(self, name)
            if value is not None:
                return float(value)
        return default


AttentionKernel = Literal["fa2", "fa1", "mem_efficient"]  # autoplace.cost.attention: which fused kernel a run uses
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)


class _AttentionRows(Strict):
    """Forward and backward rows of [sequence length > 0, fraction], in any order (sorted here, for
    interpolation in log length); a bad row or cell is reported at its own index."""

    forward: TableRows
    backward: TableRows

    @field_validator("forward", "backward")
    @classmethod
    def _rows(cls, table: list[list[float]], info: ValidationInfo) -> list[list[float]]:
        return _checked_table(table, str(info.field_name), "sequence length")


class AttentionTable(_AttentionRows):
    """One more measured attention setting beside the main rows: a kernel (``fa2`` FlashAttention-2,
    PyTorch SDPA's flash backend; ``fa1``; ``mem_efficient``, SDPA's and xformers' cutlass kernel),
    a head dim and a mask, with forward and backward rows as :class:`AttentionEfficiency`'s."""

    kernel: AttentionKernel = "fa2"
    head_dim: float = Field(ge=1, le=4096, allow_inf_nan=False)
    causal: bool = True


class AttentionEfficiency(_AttentionRows):
    """Fused (flash) attention: achieved fraction of the 16-bit dense peak by sequence length,
    forward and backward, counting the FLOPs the kernel executes (half the full ones when causal).
    Rows of [sequence length > 0, fraction], in any order (sorted here, for interpolation in log
    length); a bad row or cell is reported at its own index (``attention_efficiency.forward.1.0``).
    The main rows are FlashAttention-2, causal, at ``head_dim``; ``tables`` add other head dims,
    masks and kernels (:mod:`autoplace.cost.attention` interpolates between head dims).  Outside
    the head dims measured, a head dim runs at ``d / (d + head_dim_overhead)`` of the nearest
    table's relative to that table's own (each score's softmax work is fixed, its matmul work
    grows with d), never faster."""

    forward: TableRows = [[1.0, 0.5]]
    backward: TableRows = [[1.0, 0.4]]
    head_dim: float = Field(default=128.0, ge=1, le=4096, allow_inf_nan=False)
    head_dim_overhead: float = Field(default=0.0, ge=0, le=1e4, allow_inf_nan=False)
    tables: list[AttentionTable] = []


class GPUProfile(Strict):
    """One accelerator model.

    The efficiency numbers say how fast each class of kernel runs on it (autoplace.cost.compute):
    large GEMMs reach ``gemm_efficiency`` of the dtype's dense peak, less when their output
    tiles (``gemm_tile``, M x N) leave part of the last wave of ``sm_count`` SMs idle, and less
    when their reduction dimension K is shorter than ``gemm_efficiency_k`` (the measured shape's)
    beside a tile's fixed prologue and epilogue (``gemm_k_overhead`` K-loop elements); fused
    attention follows ``attention_efficiency``; memory-bound kernels stream at
    ``hbm_efficiency`` of the HBM bandwidth.  ``sustained_fraction`` is the share of those
    (short-benchmark) compute rates the GPU keeps through hours of training, at its power and
    thermal limits.  ``throughput_error`` is the root-mean-square log error of predicted
    throughput on the published runs of this GPU (benchmarks/published.py): the uncertainty
    shown beside every prediction that has no calibration of its own.
    """

    name: str = "inline"
    memory_GiB: float = Field(ge=MIN_MEMORY, le=MAX_MEMORY_GIB, allow_inf_nan=False)
    peak_TFLOPS: PeakTFLOPS
    hbm_bandwidth_TBps: float = Field(ge=MIN_RATE, le=MAX_HBM_TBPS, allow_inf_nan=False)
    host_link: str | LinkProfile = "pcie4"
    gemm_efficiency: DtypeFractions = DtypeFractions(bf16=0.7)
    sm_count: int = Field(100, ge=1, le=100_000)
    gemm_tile: list[Annotated[int, Field(ge=1, le=4096)]] = Field([128, 128], min_length=2, max_length=2)
    gemm_k_overhead: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False)
    gemm_efficiency_k: float = Field(default=4096.0, ge=1, le=1e7, allow_inf_nan=False)
    attention_efficiency: AttentionEfficiency = AttentionEfficiency()
    hbm_efficiency: Fraction = 0.8
    sustained_fraction: Fraction = 1.0
    throughput_error: float = Field(0.2, ge=0, le=10, allow_inf_nan=False)
    # the best MFU a published run reached on this GPU, per compute dtype (autoplace.sanity): a
    # prediction above it is reported with the term that lifts it; None or a dtype left out: unknown
    best_published_mfu: DtypeFractions | None = None
    # whether its tensor cores take MX block-scaled operands (OCP microscaling: a shared scale per 32
    # values), which the mxfp8 recipe needs: Blackwell's fifth-generation tensor cores (sources.mx_formats)
    mx_formats: bool = False
    # The vendor's reference node for this GPU (DGX/HGX), used when a cluster is given as
    # flags (--cluster 4x8xh100) or a cluster.yaml leaves the links out; see sources.defaults.
    aliases: list[str] = []
    default_gpus_per_node: GPUsPerNode | None = None
    default_intra_node: str | None = None
    default_inter_node: str | None = None
    default_host_memory_GB: HostMemory | None = None
    # GPUs sharing one NVLink fabric when wider than a node (GB200 NVL72: 72); None: the node
    default_nvlink_domain: GPUsPerDomain | None = None
    sources: dict[str, str] = {}

    @property
    def memory_bytes(self) -> float:
        return self.memory_GiB * 2**30


def _checked_table(table: list[list[float]], name: str, x_name: str) -> list[list[float]]:
    """``table`` sorted by its first column, or a ValidationError naming the bad row or cell."""
    if not table:
        raise ValueError(f"needs at least one [{x_name}, fraction] row")
    for i, row in enumerate(table):
        problem = _row_problem(i, row, table[:i], x_name)
        if problem is not None:
            loc, message, value = problem
            raise ValidationError.from_exception_data(name, [InitErrorDetails(
                type=PydanticCustomError("value_error", message), loc=loc, input=value)])
    return sorted(table)


def _row_problem(i: int, row: list[float], earlier: list[list[float]], x_name: str) -> tuple[tuple[int, ...], str, Any] | None:
    """What is wrong with row ``i`` of an efficiency table: (location, message, value), or None."""
    if len(row) != 2:
        return (i,), f"needs [{x_name}, fraction]", row
    x, fraction = row
    if x <= 0:
        return (i, 0), f"{x_name} must be > 0", x
    repeated = next((j for j, other in enumerate(earlier) if other[0] == x), None)
    if repeated is not None:
        return (i, 0), f"{x_name} repeats row {repeated}'s", x
    if not MIN_FRACTION <= fraction <= 1:
        return (i, 1), f"fraction must be in [{MIN_FRACTION:g}, 1]", fraction
    return None


class PoolInput(Strict):
    """A node pool as written in cluster.yaml (profiles by name or inline)."""

    name: str = "pool"
    nodes: Nodes
    gpus_per_node: GPUsPerNode | None = None  # default: the GPU profile's default_gpus_per_node
    gpu: str | GPUProfile
    intra_node: str | LinkProfile | None = None  # default: the GPU profile's default_intra_node
    inter_node: str | LinkProfile | None = None
    host_memory_GB: HostMemory = 512
    nvlink_domain: GPUsPerDomain | None = None  # default: the GPU profile's, else gpus_per_node
    nics_per_node: NICsPerNode | None = None  # default: one per GPU (DGX A100 / DGX H100)


class ClusterInput(Strict):
    """cluster.yaml: either the homogeneous top-level form or ``pools``."""

    name: str = "cluster"
    source: str = ""
    nodes: Nodes | None = None
    gpus_per_node: GPUsPerNode | None = None
    gpu: str | GPUProfile | None = None
    intra_node: str | LinkProfile | None = None
    inter_node: str | LinkProfile | None = None
    host_memory_GB: HostMemory | None = None
    nvlink_domain: GPUsPerDomain | None = None
    nics_per_node: NICsPerNode | None = None
    pools: list[PoolInput] | None = Field(None, min_length=1)


class NodePool(Strict):
    """A resolved pool: every profile is an object.

    ``nvlink_domain`` GPUs (consecutive ranks, a multiple of ``gpus_per_node``) share the
    ``intra_node`` fabric; hosts (host memory, the host link, CPUs) stay per node.
    ``nics_per_node`` network adapters, each at the ``inter_node`` profile's bandwidth, serve
    the node's GPUs: with fewer NICs than GPUs the GPUs share them.
    """

    name: str
    nodes: int
    gpus_per_node: int
    nvlink_domain: int
    gpu: GPUProfile
    intra_node: LinkProfile
    inter_node: LinkProfile
    host_link: LinkProfile
    host_memory_GB: float
    nics_per_node: int = 0  # 0: one per GPU

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_Bps_per_gpu(self) -> float:
        """Network bytes/s one GPU gets when every GPU of its node sends at once (collectives
        run on all ranks together): the node's NICs' bandwidth shared by its GPUs, never more
        than one NIC's."""
        nics = self.nics_per_node or self.gpus_per_node
        return self.inter_node.bytes_per_s * min(1.0, nics / self.gpus_per_node)


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
    def nvlink_domain(self) -> int:
        """GPUs per NVLink domain: the largest aligned block of consecutive ranks that lies in one
        domain of every pool (the gcd of the pools' domains, as pools start on domain boundaries)."""
        return math.gcd(*(p.nvlink_domain for p in self.pools))

    @property
    def gpu_label(self) -> str:
        return "+".join(dict.fromkeys(p.gpu.name for p in self.pools))

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "gpus": self.gpus, "gpu": self.gpu_label,
                "nodes": sum(p.nodes for p in self.pools), "gpus_per_node": self.gpus_per_node,
                "nvlink_domain": self.nvlink_domain}


_HW_KINDS: dict[str, type[Strict]] = {"gpu": GPUProfile, "interconnect": LinkProfile}


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
        data = read_shipped(path)
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
        for key in ("nodes", "gpus_per_node", "gpu", "intra_node", "host_memory_GB", "nvlink_domain", "nics_per_node"):
            if getattr(raw, key) is not None:
                raise SpecError("give it per pool when 'pools' is used", source=source, field=key)
    resolved = []
    for i, pool in enumerate(pools):
        where = f"pools.{i}." if raw.pools is not None else ""
        gpu = _resolve("gpu", pool.gpu, source=source, field=f"{where}gpu")
        intra, inter = _links(pool, raw.inter_node, gpu, several=pool.nodes > 1 or len(pools) > 1,
                              source=source, where=where)
        gpn = _default(pool.gpus_per_node, gpu.default_gpus_per_node, gpu, source=source, field=f"{where}gpus_per_node")
        resolved.append(NodePool(
            name=pool.name if raw.pools is not None else raw.name,
            nodes=pool.nodes,
            gpus_per_node=gpn,
            nvlink_domain=_nvlink_domain(pool, gpn, gpu, source=source, field=f"{where}nvlink_domain"),
            gpu=gpu,
            intra_node=intra,
            inter_node=inter,
            host_link=_resolve("interconnect", gpu.host_link, source=source, field=f"{where}gpu.host_link"),
            host_memory_GB=pool.host_memory_GB,
            nics_per_node=_nics_per_node(pool, gpn, source=source, field=f"{where}nics_per_node"),
        ))
    return ClusterSpec(name=raw.name, pools=tuple(resolved))


def _default(given: Any, default: Any, gpu: GPUProfile, *, source: str, field: str) -> Any:
    """``given``, else the GPU profile's default for it; neither is an error naming the field."""
    if given is not None:
        return given
    if default is None:
        raise SpecError(f"required: GPU profile {gpu.name!r} gives no default_{field.rsplit('.', 1)[-1]}",
                        source=source, field=field)
    return default


def _nvlink_domain(pool: PoolInput, gpus_per_node: int, gpu: GPUProfile, *, source: str, field: str) -> int:
    """GPUs per NVLink domain: as given, else the GPU profile's default, else one node.

    A domain is whole nodes, and the pool is whole domains, so every group the cost model
    places on consecutive ranks either lies in one domain or crosses domains evenly; a
    domain wider than the pool (a few trays of an NVL72 rack) is the whole pool.  The
    profile's default is cut to the largest such block (27 trays of NVL72 racks: 36 GPUs).

    Raises:
        SpecError: a domain that is not whole nodes, or that does not split the pool evenly.
    """
    gpus = pool.nodes * gpus_per_node
    if pool.nvlink_domain is None:  # the profile's rack, cut to what this pool holds of it
        default = gpu.default_nvlink_domain or gpus_per_node
        default = default if default % gpus_per_node == 0 else gpus_per_node
        return gpus if default >= gpus else math.gcd(default, gpus)
    domain = pool.nvlink_domain
    if domain % gpus_per_node:
        below, above = domain - domain % gpus_per_node, domain - domain % gpus_per_node + gpus_per_node
        raise SpecError(f"{domain} GPUs is not a whole number of nodes; valid: a multiple of gpus_per_node "
                        f"({gpus_per_node}), e.g. {' or '.join(str(d) for d in (below, above) if d)}",
                        source=source, field=field)
    if domain < gpus and gpus % domain:
        fit = math.gcd(domain, gpus)
        raise SpecError(f"{domain} GPUs does not divide the pool's {gpus} GPUs ({pool.nodes} nodes x {gpus_per_node}) "
                        f"into whole domains; valid: a multiple of gpus_per_node ({gpus_per_node}) dividing {gpus}, "
                        f"or >= {gpus} for one domain (e.g. {fit}: every group within {fit} GPUs stays on NVLink)",
                        source=source, field=field)
    return min(domain, gpus)


def _nics_per_node(pool: PoolInput, gpus_per_node: int, *, source: str, field: str) -> int:
    """The pool's network adapters per node: as given (at most one per GPU: the inter-node
    profile's bandwidth is per NIC and per GPU), else one per GPU as in the DGX reference nodes
    (DGX A100: 8 x 200 Gb/s HDR InfiniBand compute NICs for 8 GPUs; DGX H100: 8 x 400 Gb/s NDR
    ConnectX-7; NVIDIA DGX A100 / DGX H100 user guides)."""
    if pool.nics_per_node is None:
        return gpus_per_node
    if pool.nics_per_node > gpus_per_node:
        raise SpecError(f"{pool.nics_per_node} NICs for {gpus_per_node} GPUs per node: give at most one per GPU "
                        f"(the inter_node bandwidth is per NIC; e.g. nics_per_node: {gpus_per_node // 2} for "
                        "4 x 200 Gb/s per 8-GPU node)", source=source, field=field)
    return pool.nics_per_node


def _links(pool: PoolInput, shared_inter: Any, gpu: GPUProfile, *, several: bool, source: str,
           where: str) -> tuple[LinkProfile, LinkProfile]:
    """(intra, inter) link tiers: as given, else the GPU profile's defaults.

    One node alone never uses its inter-node link; without one it is the intra-node link.
    """
    intra = _default(pool.intra_node, gpu.default_intra_node, gpu, source=source, field=f"{where}intra_node")
    inter = pool.inter_node or shared_inter or gpu.default_inter_node
    if inter is None:
        if several:
            raise SpecError(f"required when there is more than one node (GPU profile {gpu.name!r} gives no "
                            "default_inter_node)", source=source, field=f"{where}inter_node")
        inter = intra
    return (_resolve("interconnect", intra, source=source, field=f"{where}intra_node"),
            _resolve("interconnect", inter, source=source, field=f"{where}inter_node"))


def _single_pool(raw: ClusterInput, source: str) -> PoolInput:
    for key in ("nodes", "gpu"):
        if getattr(raw, key) is None:
            raise SpecError("required key is missing (or give 'pools')", source=source, field=key)
    return PoolInput(name=raw.name, nodes=raw.nodes, gpus_per_node=raw.gpus_per_node, gpu=raw.gpu,  # type: ignore[arg-type]
                     intra_node=raw.intra_node, inter_node=raw.inter_node,  # type: ignore[arg-type]
                     host_memory_GB=raw.host_memory_GB or 512.0, nvlink_domain=raw.nvlink_domain,
                     nics_per_node=raw.nics_per_node)


def load_cluster(path: str | Path) -> ClusterSpec:
    """Load cluster.yaml, resolving GPU and interconnect profile names."""
    return cluster_from_dict(read_document(path), source=str(path))


def check_compute_dtype(cluster: ClusterSpec, dtype: str, *, source: str) -> None:
    """Check that every pool's GPU has a peak for the model's compute dtype or a wider type.

    A cluster loads with any of bf16/fp16/fp32 given; an fp32 or tf32 model on a GPU listing
    only bf16 is refused here, naming the cluster file, rather than deep in the cost model.

    Args:
        cluster: the loaded cluster.
        dtype: the model's compute dtype (``model.training.recipe().compute_dtype``).
        source: the cluster file, for the message.

    Raises:
        SpecError: naming ``gpu.peak_TFLOPS`` (``pools.N.gpu.peak_TFLOPS`` for several pools).
    """
    for i, pool in enumerate(cluster.pools):
        if not pool.gpu.peak_TFLOPS.supports(dtype):
            where = f"pools.{i}." if len(cluster.pools) > 1 else ""
            raise SpecError(f"GPU {pool.gpu.name!r} has no peak for {dtype} (the model's compute dtype) or a wider "
                            f"type; add a peak for {' or '.join(_FALLBACK[dtype])}",
                            source=source, field=f"{where}gpu.peak_TFLOPS")


def fp8_refusal(cluster: ClusterSpec, fp8: str) -> str | None:
    """Why the recipe ``fp8`` (a plan's ``fp8`` key) cannot run on ``cluster``: a GPU whose profile
    states no fp8 peak has no fp8 units (A100, V100), and its fp8 GEMMs would be costed at the
    bf16 peak as if they ran; mxfp8's block-scaled GEMMs need MX tensor cores (Blackwell:
    ``mx_formats``; Hopper's take one scale per tensor).  None when the recipe runs everywhere."""
    plain = [p.gpu.name for p in cluster.pools if p.gpu.peak_TFLOPS.fp8 is None]
    if fp8 == "none":
        return None
    if plain:
        return (f"{fp8} runs fp8 GEMMs and GPU profile {plain[0]!r} has no fp8 units (it states no fp8 peak); "
                "valid on this cluster: none")
    no_mx = [p.gpu.name for p in cluster.pools if not p.gpu.mx_formats]
    if fp8 == "mxfp8" and no_mx:
        valid = ", ".join(x for x in FP8 if x != "mxfp8")
        return (f"mxfp8 needs block-scaled (MX) tensor cores, Blackwell's, and GPU profile {no_mx[0]!r} has none "
                f"(mx_formats is false); valid on this cluster: {valid}")
    return None


# ---------------------------------------------------------------- clusters from flags

# NODES x [GPUS_PER_NODE x] GPU, e.g. 4x8xh100, 2xa100-sxm4-80gb
SHORTHAND = re.compile(r"^(?P<nodes>\d+)x(?:(?P<gpn>\d+)x)?(?P<gpu>[a-z][a-z0-9-]*)$", re.IGNORECASE)


def gpu_profile_name(token: str, *, source: str = "--gpu") -> str:
    """The shipped GPU profile a name or alias (``h100``, ``a100``) refers to.

    Raises:
        SpecError: no profile has that name or alias (the message lists both).
    """
    names = profile_names("gpu")
    wanted = token.lower()
    if wanted in names:
        return wanted
    # parse only the profiles whose text names the alias (parsing all twelve was most of a
    # small solve's input time); the last in name order wins, as in the full map below
    folder = resources.files("hardware_profiles") / "gpu"
    for name in reversed(names):
        text = (folder / f"{name}.yaml").read_bytes().decode("utf-8", "replace").lower()
        if wanted in text and wanted in load_profile("gpu", name).aliases:
            return name
    by_alias = {alias: name for name in names for alias in load_profile("gpu", name).aliases}
    if wanted in by_alias:
        return by_alias[wanted]
    raise SpecError(f"unknown GPU {token!r}; valid: {', '.join(names)} (aliases: {', '.join(sorted(by_alias))})",
                    source=source)


def parse_cluster_shorthand(text: str) -> tuple[int, int | None, str]:
    """(nodes, gpus per node or None, GPU profile name) from ``4x8xh100`` or ``2xh100``.

    Raises:
        SpecError: not of that form, or an unknown GPU.
    """
    match = SHORTHAND.match(text.strip())
    if match is None:
        raise SpecError(f"expected NODESxGPUSxGPU (e.g. 4x8xh100) or NODESxGPU (e.g. 2xa100), got {text!r}",
                        source="--cluster")
    gpn = int(match["gpn"]) if match["gpn"] else None
    return int(match["nodes"]), gpn, gpu_profile_name(match["gpu"], source="--cluster")


def cluster_from_flags(gpu: str, nodes: int, *, gpus_per_node: int | None = None, intra_node: str | None = None,
                       inter_node: str | None = None, host_memory_GB: float | None = None,
                       name: str | None = None) -> ClusterSpec:
    """A homogeneous cluster of the GPU's reference nodes, every part overridable.

    Unset values come from the GPU profile's defaults (``default_gpus_per_node``,
    ``default_intra_node``, ``default_inter_node``, ``default_host_memory_GB``), so
    ``--cluster 8x8xh100`` is eight DGX H100 nodes, as examples/clusters/8x8-h100.yaml.

    Raises:
        SpecError: unknown GPU or link name, or a value out of range, naming the flag.
    """
    profile = gpu_profile_name(gpu)
    default = load_profile("gpu", profile)
    gpn = gpus_per_node or default.default_gpus_per_node
    doc: dict[str, Any] = {
        "name": name or f"{nodes}x{gpn}x{profile}", "nodes": nodes, "gpu": profile,
        **{k: v for k, v in (("gpus_per_node", gpus_per_node), ("intra_node", intra_node),
                             ("inter_node", inter_node)) if v is not None},
        "host_memory_GB": float(host_memory_GB or default.default_host_memory_GB or 512),
    }
    return cluster_from_dict(doc, source="--gpu/--cluster flags")
