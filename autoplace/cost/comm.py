"""Collective communication: bytes per device and alpha-beta time, per link tier.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005; NCCL's ring): for a buffer of ``S``
bytes over ``n`` ranks each rank sends

* all-reduce: ``2 (n-1)/n * S`` in ``2 (n-1)`` steps,
* all-gather / reduce-scatter (``S`` = the full, gathered size): ``(n-1)/n * S`` in ``n-1`` steps,
* all-to-all (``S`` = a rank's send buffer): ``(n-1)/n * S``, one message per peer.

When a group spans NVLink domains the collective is hierarchical (reduce-scatter inside the
domain, all-reduce of a ``1/n_in`` shard over the network, all-gather inside the domain), each
GPU using its own NIC, so the network carries ``1/n_in`` of the data.  A domain is a node on
HGX/DGX machines and a whole rack on GB200 NVL72 (72 GPUs over 18 trays): "intra" below is
the NVLink tier of one domain, "inter" the network between domains.  All functions broadcast over numpy
arrays of candidates.

Time follows NCCL's own tuning model (NVIDIA/nccl ``src/graph/tuning.cc``): a collective
runs one protocol -- LL (low latency, half the bandwidth: every 8 bytes carry 4 of data and a
flag), LL128 (120 of every 128 bytes) or Simple (full bandwidth, the highest per-step
latency) -- and costs the protocol's base latency, plus its per-step latency on each link
tier, plus bytes over bandwidth times the protocol's efficiency.  NCCL picks the fastest, so
small messages run at LL's latency and large ones at Simple's bandwidth: bus bandwidth grows
with message size as nccl-tests shows.  All-reduce across nodes may also run as NCCL's double
binary tree, whose inter-node latency grows with ``log2`` of the node count instead of linearly.

Latency at scale.  NCCL runs all-gather and reduce-scatter as one flat ring over all ``n`` ranks
(its tree and CollNet algorithms serve all-reduce only), so a collective costs ``n - 1`` sequential
steps: ``nodes - 1`` of them cross the network and the other ``n - nodes`` are NVLink hops
(``tuning.cc``: ``nsteps = nRanks - 1``, ``nInterSteps = nNodes - 1``; a ring all-reduce twice
that).  Bytes per device follow the hierarchy (each node's ranks sit together on the ring, so
the network carries ``1/n_in`` of the data per GPU) but the latency grows linearly with ranks.
A buffer sent as ``count`` separate collectives (DeepSpeed gathers each module's parameters on
its own) pays the latency ``count`` times and the bytes once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

Array = np.ndarray


@dataclass(frozen=True)
class Links:
    """The two link tiers a group can use, as arrays broadcastable with the candidates: the
    NVLink fabric inside one domain (``intra``) and the network between domains (``inter``).

    Latencies are NCCL's per-step Simple-protocol latencies of each tier; the other protocols'
    follow from :data:`PROTOCOLS`.  ``gpus_per_node`` is the GPUs sharing one host (its CPUs).
    """

    intra_Bps: Array
    intra_latency_s: Array
    inter_Bps: Array
    inter_latency_s: Array
    gpus_per_node: int


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: its fixed latency per collective, its per-step latency on each tier as
    a share of Simple's, and the share of link bandwidth that carries data."""

    name: str
    base_s: float
    intra_latency_share: float
    inter_latency_share: float
    efficiency: float


# NVIDIA/nccl src/graph/tuning.cc (v2.18-2.21): baseLat for the ring algorithm (LL 6.6,
# LL128 14.0, Simple 8.4 us) and hwLat per step (NVLink LL 0.6 / LL128 1.9 / Simple 3.4 us;
# network LL 2.7 / LL128 4.0 / Simple 14.0 us), written as shares of Simple's so each link
# profile keeps one latency; LL moves 4 data bytes per 8 (a flag per word), LL128 120 per 128.
PROTOCOLS = (
    Protocol("LL", 6.6e-6, 0.6 / 3.4, 2.7 / 14.0, 0.5),
    Protocol("LL128", 14.0e-6, 1.9 / 3.4, 4.0 / 14.0, 120 / 128),
    Protocol("Simple", 8.4e-6, 1.0, 1.0, 1.0),
)


def members_per_domain(size: Array, stride: Array, domain: int) -> Array:
    """How many ranks of one group share an NVLink domain of ``domain`` consecutive ranks, for a
    group of ``size`` ranks ``stride`` apart.

    Ranks are laid out with tensor parallel innermost (Megatron's order tp-cp-ep-dp-pp), so a
    dimension's stride is the product of the sizes inside it.  When groups do not align with
    domain boundaries the worst group is taken (the gcd).
    """
    size = np.asarray(size)
    stride = np.asarray(stride)
    per_domain = np.maximum(domain // np.maximum(stride, 1), 1)
    inside = np.gcd(size, per_domain)
    return np.where(stride < domain, inside, 1)


def collective_time(intra: Array, intra_steps: Array, inter: Array, inter_steps: Array, links: Links,
                    count: Array | float = 1.0) -> Array:
    """Seconds of ``count`` collectives moving ``intra`` and ``inter`` bytes per device in all,
    each in the given numbers of sequential steps on each tier, with the fastest NCCL protocol
    (chosen per message: ``count`` smaller messages lean towards LL); 0 when it moves nothing
    (a group of one)."""
    return _fastest(intra / links.intra_Bps + inter / links.inter_Bps, intra_steps, inter_steps, links, count)


def _fastest(wire: Array, intra_steps: Array, inter_steps: Array, links: Links, count: Array | float) -> Array:
    """:func:`collective_time` of collectives whose bytes take ``wire`` seconds at full bandwidth
    (every protocol's; an all-reduce's ring and tree share it)."""
    def seconds(p: Protocol) -> Array:
        latency = (p.base_s + intra_steps * p.intra_latency_share * links.intra_latency_s
                   + inter_steps * p.inter_latency_share * links.inter_latency_s)
        # array-wide passes are most of a scoring's time: none spent dividing by 1
        return count * latency + (wire if p.efficiency == 1.0 else wire / p.efficiency)

    best = functools.reduce(np.minimum, (seconds(p) for p in PROTOCOLS))
    return np.where((intra_steps + inter_steps) > 0, best, 0.0)


def ring_steps(n: Array, n_out: Array) -> tuple[Array, Array]:
    """(NVLink steps, network steps) of one ring pass over ``n`` ranks on ``n_out`` nodes (or
    NVLink domains): ``n - 1`` steps of which ``n_out - 1`` cross the network (NCCL
    ``tuning.cc``, ring latency of all-gather / reduce-scatter; an all-reduce makes two passes)."""
    n, n_out = np.asarray(n), np.asarray(n_out)
    return n - n_out, n_out - 1


def ring_bytes(size_bytes: Array | float, n: Array, n_in: Array) -> tuple[Array, Array]:
    """(NVLink, network) bytes each device sends in one hierarchical ring pass -- an all-gather or
    reduce-scatter of a buffer whose full size is ``size_bytes`` over ``n`` ranks, ``n_in`` of them
    in each NVLink domain; an all-reduce sends twice these (see the module docstring)."""
    n, n_in = np.asarray(n), np.asarray(n_in)
    n_out = n // n_in
    return (n_in - 1) / n_in * size_bytes, (n_out - 1) / n_out * size_bytes / n_in


def alltoall_bytes(send_bytes: Array | float, n: Array, n_in: Array) -> tuple[Array, Array]:
    """(NVLink, network) bytes of an all-to-all whose ``send_bytes`` spread evenly over ``n`` ranks,
    ``n_in`` of them in the sender's domain (its own share stays put)."""
    n, n_in = np.asarray(n), np.asarray(n_in)
    return (n_in - 1) / n * send_bytes, (n - n_in) / n * send_bytes


def allreduce(size_bytes: Array, n: Array, n_in: Array, links: Links,
              count: Array | float = 1.0) -> tuple[Array, Array, Array]:
    """Ring (hierarchical when ``n_in < n``) all-reduce of ``size_bytes`` in ``count``
    collectives; across nodes, NCCL's double binary tree when it is faster: its latency is
    ``2 (n_in - 1)`` NVLink and ``2 log2(nodes)`` network steps (``tuning.cc``) against the
    ring's two passes over all ``n`` ranks (:func:`ring_steps`).

    Returns:
        (intra-node bytes sent per device, inter-node bytes sent per device, seconds)
    """
    n, n_in = np.asarray(n), np.asarray(n_in)
    n_out = n // n_in
    intra, inter = (2 * x for x in ring_bytes(size_bytes, n, n_in))
    ring_in, ring_out = ring_steps(n, n_out)
    wire = intra / links.intra_Bps + inter / links.inter_Bps
    ring = _fastest(wire, 2 * ring_in, 2 * ring_out, links, count)
    tree_out = 2 * np.ceil(np.log2(np.maximum(n_out, 1)))
    tree = _fastest(wire, 2 * (n_in - 1), tree_out, links, count)
    return intra, inter, np.where(n_out > 1, np.minimum(ring, tree), ring)


def allgather(size_bytes: Array, n: Array, n_in: Array, links: Links,
              count: Array | float = 1.0) -> tuple[Array, Array, Array]:
    """All-gather (or reduce-scatter: same volume) of a buffer whose full size is ``size_bytes``,
    in ``count`` collectives; NCCL runs them as a ring only (:func:`ring_steps`)."""
    n, n_in = np.asarray(n), np.asarray(n_in)
    intra, inter = ring_bytes(size_bytes, n, n_in)
    ring_in, ring_out = ring_steps(n, n // n_in)
    return intra, inter, collective_time(intra, ring_in, inter, ring_out, links, count)


reducescatter = allgather


def alltoall(send_bytes: Array, n: Array, n_in: Array, links: Links) -> tuple[Array, Array, Array]:
    """All-to-all where every rank sends ``send_bytes`` spread evenly over the group.

    Intra- and inter-node peers are served concurrently, so the slower tier sets the time.
    """
    n, n_in = np.asarray(n), np.asarray(n_in)
    intra, inter = alltoall_bytes(send_bytes, n, n_in)
    zero = np.zeros_like(intra)
    t = np.maximum(collective_time(intra, n_in - 1, zero, zero, links),
                   collective_time(zero, zero, inter, n - n_in, links))
    return intra, inter, np.where(n > 1, t, 0.0)


def p2p(send_bytes: Array, messages: Array, inter_node: Array, links: Links) -> Array:
    """Seconds for ``messages`` point-to-point sends totalling ``send_bytes`` on one tier
    (each a send/recv pair: NCCL's Simple protocol, one step and its base latency each)."""
    bps = np.where(inter_node, links.inter_Bps, links.intra_Bps)
    lat = np.where(inter_node, links.inter_latency_s, links.intra_latency_s)
    simple = PROTOCOLS[-1]
    return messages * (lat + simple.base_s) + send_bytes / bps
