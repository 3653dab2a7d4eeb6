"""Communication volumes and times against the ZeRO paper and the alpha-beta ring model."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.cost import comm
from tests.helpers import gpt_model, gpu_cluster, score


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_zero_stage_volumes_relative_to_ddp(dp: int) -> None:
    """ZeRO Sec. 7.2: ZeRO-1/2 move the same 2Ψ as DDP's all-reduce; ZeRO-3 moves 3Ψ, 1.5x.

    (PyTorch agrees: FSDP2 with reshard_after_forward moves 2Ψ all-gather + Ψ reduce-scatter
    against DDP's 2Ψ all-reduce -- measured with CommDebugMode, ../shared/ECOSYSTEM.md.)
    """
    model = _blocks_only(dp)
    cluster = gpu_cluster(dp)
    dp_bytes = {z: score(model, cluster, f"dp={dp},zero={z},mbs=1").comm["dp"] for z in range(4)}
    assert dp_bytes[1] == pytest.approx(dp_bytes[0], rel=1e-12)
    assert dp_bytes[2] == pytest.approx(dp_bytes[0], rel=1e-12)
    assert dp_bytes[3] / dp_bytes[0] == pytest.approx(1.5, rel=1e-12)


def _blocks_only(batch: int):
    """Four identical blocks and nothing else (no embedding or head), in bf16."""
    from autoplace.specs.model import model_from_dict

    return model_from_dict({"name": "blocks", "hidden": 1024, "seq_len": 1024, "graph": [
        {"name": "block", "params": 12 * 1024 * 1024, "flops_per_token": 24 * 1024 * 1024,
         "activation_bytes_per_token": 34 * 1024, "repeat": 4}],
        "training": {"global_batch": batch, "precision": "bf16"}})


def test_zero3_keeps_the_root_gathered_like_fsdp2() -> None:
    """FSDP2 does not reshard the root (embedding, final norm, head) after forward, so it is
    gathered once per micro-batch: ZeRO-3 moves 3 x blocks + 2 x root, all in bf16."""
    from autoplace.cost.layers import layer_table

    dp = 8
    model = gpt_model(4, 1024, 16, batch=dp, precision="bf16")
    table = layer_table(model)
    root = table.embed.params_tp + table.embed.params_rep + table.head.params_rep  # tied head
    blocks = table.params - root
    ev = score(model, gpu_cluster(dp), f"dp={dp},zero=3,mbs=1")
    assert ev.comm["dp"] == pytest.approx((dp - 1) / dp * 2 * (3 * blocks + 2 * root), rel=1e-12)


def test_ddp_bytes_are_the_ring_all_reduce_of_the_gradients() -> None:
    dp = 8
    model = gpt_model(4, 1024, 16, batch=dp, precision="bf16")
    from autoplace.cost.layers import layer_table

    psi = layer_table(model).params
    ev = score(model, gpu_cluster(dp), f"dp={dp},zero=0,mbs=1")
    assert ev.comm["dp"] == pytest.approx(2 * (dp - 1) / dp * psi * 2, rel=1e-12)


def _links(intra_gbps: float = 300.0, inter_gbps: float = 25.0, per_node: int = 8) -> comm.Links:
    return comm.Links(intra_gbps * 1e9, 3e-6, inter_gbps * 1e9, 10e-6, per_node)


SIMPLE_BASE, LL_BASE = 8.4e-6, 6.6e-6  # NCCL tuning.cc baseLat, ring: Simple, LL


def test_ring_allreduce_alpha_beta_inside_a_node() -> None:
    """Thakur et al. 2005: T = 2(n-1) alpha + 2 (n-1)/n S / B, plus NCCL's base latency of the
    Simple protocol, which large messages use."""
    size, n = 1e9, 8
    intra, inter, t = comm.allreduce(np.array(size), np.array(n), np.array(n), _links())
    assert float(inter) == 0.0
    assert float(intra) == pytest.approx(2 * 7 / 8 * size)
    assert float(t) == pytest.approx(SIMPLE_BASE + 2 * 7 * 3e-6 + 2 * 7 / 8 * size / 300e9)


def test_small_messages_use_the_low_latency_protocol() -> None:
    """NCCL's LL protocol: a sixth of Simple's per-step NVLink latency (0.6 vs 3.4 us in
    tuning.cc) at half the bandwidth (4 data bytes per 8 sent); it wins for small messages."""
    size, n = 4096.0, 8
    _, _, t = comm.allreduce(np.array(size), np.array(n), np.array(n), _links())
    assert float(t) == pytest.approx(LL_BASE + 2 * 7 * 3e-6 * 0.6 / 3.4 + 2 * 7 / 8 * size / (300e9 * 0.5))
    # bus bandwidth grows with the message size, as nccl-tests shows
    sizes = np.array([2.0**k for k in range(10, 31, 2)])
    times = comm.allreduce(sizes, np.array(8), np.array(8), _links())[2]
    assert np.all(np.diff(2 * 7 / 8 * sizes / times) > 0)


def test_hierarchical_allreduce_across_nodes() -> None:
    """Intra-node reduce-scatter + inter-node all-reduce of S/n_in + intra all-gather, one
    collective: one base latency."""
    size, n, n_in = 1e9, 32, 8
    intra, inter, t = comm.allreduce(np.array(size), np.array(n), np.array(n_in), _links())
    n_out = n // n_in
    assert float(intra) == pytest.approx(2 * 7 / 8 * size)
    assert float(inter) == pytest.approx(2 * (n_out - 1) / n_out * size / n_in)
    # 4 nodes: the tree's 2 log2(4) = 4 network steps beat the ring's 2 (4 - 1) = 6
    expected = SIMPLE_BASE + (2 * 7 * 3e-6 + 2 * 7 / 8 * size / 300e9) + (4 * 10e-6 + float(inter) / 25e9)
    assert float(t) == pytest.approx(expected)


def test_tree_all_reduce_latency_grows_with_log_of_nodes() -> None:
    """Across 1,024 nodes NCCL's double binary tree takes 2 log2(1024) = 20 network steps, not
    the ring's 2 x 1,023."""
    _, _, t = comm.allreduce(np.array(8.0), np.array(8192), np.array(8), _links())
    ll = comm.PROTOCOLS[0]
    assert float(t) == pytest.approx(ll.base_s + 14 * 3e-6 * ll.intra_latency_share + 20 * 10e-6 * ll.inter_latency_share
                                     + (2 * 7 / 8 * 8 / 300e9 + 2 * 1023 / 1024 * 8 / 8 / 25e9) / ll.efficiency)


@pytest.mark.parametrize(("size", "stride", "per_node", "expected"), [
    (8, 1, 8, 8), (16, 1, 8, 8), (4, 8, 8, 1), (4, 2, 8, 4), (6, 1, 8, 2), (2, 4, 8, 2),
    # an NVL72 domain of 72 GPUs (18 trays of 4): groups across trays stay inside it, but a
    # group spanning 32 ranks straddles the boundary at 72 for some groups (worst: 2 inside)
    (8, 1, 72, 8), (8, 4, 64, 8), (8, 4, 72, 2), (2, 36, 72, 2), (4, 36, 72, 2), (144, 1, 72, 72)])
def test_members_per_domain(size: int, stride: int, per_node: int, expected: int) -> None:
    assert int(comm.members_per_domain(np.array(size), np.array(stride), per_node)) == expected


def test_tp_traffic_matches_megatron_per_layer_count() -> None:
    """Narayanan et al. 2021 Sec. 3.2: 2 all-reduces forward + 2 backward of b*s*h per layer per
    micro-batch (4 ring all-reduces of 2(t-1)/t * 2bsh bytes); full recompute adds 2 forward."""
    L, h, s, t, m = 4, 1024, 2048, 8, 4
    model = gpt_model(L, h, 16, seq=s, batch=m, precision="bf16")
    for recompute, passes in (("none", 4), ("full", 6)):
        ev = score(model, gpu_cluster(8), f"tp={t},mbs=1,sp=false,recompute={recompute}")
        per_allreduce = 2 * (t - 1) / t * s * h * 2
        embedding = per_allreduce  # the vocab-parallel embedding's one forward all-reduce
        # the head's input gradient in backward, and the vocab-parallel loss's 3 fp32 per token
        head = per_allreduce + 2 * (t - 1) / t * s * 12
        assert ev.comm["tp"] == pytest.approx(m * (L * passes * per_allreduce + embedding + head), rel=1e-12)
