"""Collective communication: bytes per device and alpha-beta time, per link tier.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005; NCCL's ring): for a buffer of ``S``
bytes over ``n`` ranks each rank sends

* all-reduce: ``2 (n-1)/n * S`` in ``2 (n-1)`` steps,
* all-gather / reduce-scatter (``S`` = the full, gathered size): ``(n-1)/n * S`` in ``n-1`` steps,
* all-to-all (``S`` = a rank's send buffer): ``(n-1)/n * S``, one message per peer.

When a group spans nodes the collective is hierarchical (intra-node reduce-scatter, inter-
node all-reduce of a ``1/n_in`` shard, intra-node all-gather), each GPU using its own NIC,
so the inter-node tier carries ``1/n_in`` of the data.  All functions broadcast over numpy
arrays of candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Array = np.ndarray


@dataclass(frozen=True)
class Links:
    """The two link tiers a group can use, as arrays broadcastable with the candidates."""

    intra_Bps: Array
    intra_latency_s: Array
    inter_Bps: Array
    inter_latency_s: Array
    gpus_per_node: int


def members_per_node(size: Array, stride: Array, gpus_per_node: int) -> Array:
    """How many ranks of one group share a node, for a group of ``size`` ranks ``stride`` apart.

    Ranks are laid out with tensor parallel innermost (Megatron's order tp-cp-ep-dp-pp), so a
    dimension's stride is the product of the sizes inside it.  When groups do not align with
    node boundaries the worst group is taken (the gcd).
    """
    size = np.asarray(size)
    stride = np.asarray(stride)
    per_node = np.maximum(gpus_per_node // np.maximum(stride, 1), 1)
    inside = np.gcd(size, per_node)
    return np.where(stride < gpus_per_node, inside, 1)


def _tier_time(nbytes: Array, steps: Array, bps: Array | float, latency: Array | float) -> Array:
    return steps * latency + nbytes / bps


def allreduce(size_bytes: Array, n: Array, n_in: Array, links: Links) -> tuple[Array, Array, Array]:
    """Ring (hierarchical when ``n_in < n``) all-reduce of ``size_bytes``.

    Returns:
        (intra-node bytes sent per device, inter-node bytes sent per device, seconds)
    """
    n, n_in = np.asarray(n), np.asarray(n_in)
    n_out = n // n_in
    intra = 2 * (n_in - 1) / n_in * size_bytes
    inter = 2 * (n_out - 1) / n_out * size_bytes / n_in
    t = (_tier_time(intra, 2 * (n_in - 1), links.intra_Bps, links.intra_latency_s)
         + _tier_time(inter, 2 * (n_out - 1), links.inter_Bps, links.inter_latency_s))
    return intra, inter, t


def allgather(size_bytes: Array, n: Array, n_in: Array, links: Links) -> tuple[Array, Array, Array]:
    """All-gather (or reduce-scatter: same volume) of a buffer whose full size is ``size_bytes``."""
    n, n_in = np.asarray(n), np.asarray(n_in)
    n_out = n // n_in
    intra = (n_in - 1) / n_in * size_bytes
    inter = (n_out - 1) / n_out * size_bytes / n_in
    t = (_tier_time(intra, n_in - 1, links.intra_Bps, links.intra_latency_s)
         + _tier_time(inter, n_out - 1, links.inter_Bps, links.inter_latency_s))
    return intra, inter, t


reducescatter = allgather


def alltoall(send_bytes: Array, n: Array, n_in: Array, links: Links) -> tuple[Array, Array, Array]:
    """All-to-all where every rank sends ``send_bytes`` spread evenly over the group.

    Intra- and inter-node peers are served concurrently, so the slower tier sets the time.
    """
    n, n_in = np.asarray(n), np.asarray(n_in)
    intra = (n_in - 1) / n * send_bytes
    inter = (n - n_in) / n * send_bytes
    t = np.maximum(_tier_time(intra, n_in - 1, links.intra_Bps, links.intra_latency_s),
                   _tier_time(inter, n - n_in, links.inter_Bps, links.inter_latency_s))
    return intra, inter, np.where(n > 1, t, 0.0)


def p2p(send_bytes: Array, messages: Array, inter_node: Array, links: Links) -> Array:
    """Seconds for ``messages`` point-to-point sends totalling ``send_bytes`` on one tier."""
    bps = np.where(inter_node, links.inter_Bps, links.intra_Bps)
    lat = np.where(inter_node, links.inter_latency_s, links.intra_latency_s)
    return messages * lat + send_bytes / bps
