"""Sharded data parallel at scale (issue 25, item 1): collective latency that grows with ranks as
NCCL's ring does, the number of collectives each framework issues, NICs shared by a node's GPUs
(the cluster field ``nics_per_node``), and the published ZeRO-3 run that checks them in-sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoplace import frameworks
from autoplace.cost import comm, terms_time
from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.candidates import candidates_from_plans
from autoplace.cost.context import context
from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.cluster import cluster_from_dict, load_cluster
from autoplace.specs.model import ModelSpec
from autoplace.validation import load_runs, predict
from tests.helpers import gpt_model
from tests.test_cli import MODELS, invoke

REPO = Path(__file__).resolve().parents[1]
# one NVLink tier and one network tier with the shipped profiles' numbers (nvlink3, ib-hdr)
LINKS = comm.Links(np.asarray(300e9), np.asarray(3.4e-6), np.asarray(24e9), np.asarray(14e-6), 8)
RANKS = np.array([8, 16, 64, 128, 384, 768, 1536, 4096])


@pytest.mark.parametrize("collective", [comm.allgather, comm.reducescatter, comm.allreduce])
@pytest.mark.parametrize("size", [4.0, 2**20, 2**30])
def test_a_collective_never_gets_faster_with_more_ranks(collective, size: float) -> None:
    """Eight GPUs per node: the same buffer over more nodes costs at least as much."""
    t = collective(np.full(RANKS.shape, size), RANKS, np.full(RANKS.shape, 8), LINKS)[2]
    assert np.all(np.diff(t) >= 0), t


@pytest.mark.parametrize("collective", [comm.allgather, comm.reducescatter])
def test_gather_latency_grows_linearly_with_ranks(collective) -> None:
    """NCCL runs all-gather and reduce-scatter as a ring only: a tiny message over 1,536 ranks waits
    on ~4x the steps of one over 384 (tuning.cc: n - 1 steps, nodes - 1 of them on the network)."""
    t = collective(np.array([4.0, 4.0]), np.array([384, 1536]), np.array([8, 8]), LINKS)[2]
    assert 3.5 < t[1] / t[0] < 4.1, t
    assert t[1] > 1e-3  # 1,535 steps of microseconds each: milliseconds, not the 200 us of a per-node ring


def test_all_reduce_latency_grows_with_log_nodes_through_the_tree() -> None:
    """All-reduce may run as NCCL's double binary tree, so its small-message latency grows far slower
    than an all-gather's over the same ranks."""
    n, n_in, tiny = np.array([384, 1536]), np.array([8, 8]), np.array([4.0, 4.0])
    ar = comm.allreduce(tiny, n, n_in, LINKS)[2]
    ag = comm.allgather(tiny, n, n_in, LINKS)[2]
    assert ar[1] / ar[0] < 1.5 < ag[1] / ag[0]


@pytest.mark.parametrize("size", [4.0, 2**24, 2**32])
def test_more_collectives_for_the_same_bytes_never_cost_less(size: float) -> None:
    counts = np.array([1.0, 2.0, 4.0, 7.0, 30.0])
    for n in (8, 64, 1536):
        t = comm.allgather(np.full(counts.shape, size), np.full(counts.shape, n), np.full(counts.shape, 8), LINKS,
                           counts)[2]
        assert np.all(np.diff(t) > 0), (n, t)


def test_latency_bound_collectives_cost_their_count() -> None:
    """Tiny messages: four collectives cost four times one (each pays the ring's latency)."""
    one, four = comm.allgather(np.array([4.0, 4.0]), np.array([1536, 1536]), np.array([8, 8]), LINKS,
                               np.array([1.0, 4.0]))[2]
    assert four == pytest.approx(4 * one, rel=1e-6)


def test_ring_steps_add_up_to_a_pass_over_every_rank() -> None:
    intra, inter = comm.ring_steps(RANKS, RANKS // 8)
    assert np.array_equal(intra + inter, RANKS - 1)
    assert np.array_equal(comm.ring_steps(np.array([8]), np.array([1]))[1], [0])


def _cluster(nodes: int, nics: int | None, gpn: int = 8):
    doc = {"name": "c", "nodes": nodes, "gpus_per_node": gpn, "gpu": "a100-sxm4-80gb", "intra_node": "nvlink3",
           "inter_node": "ib-hdr"}
    return cluster_from_dict(doc if nics is None else {**doc, "nics_per_node": nics})


def _step(model: ModelSpec, cluster, plan: str, assume=DEFAULT) -> float:
    p = build_plan(parse_plan_string(plan), world=cluster.gpus, blocks=layer_table(model).blocks,
                   global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)
    return evaluate(model, cluster, p, assume).step_time_s


def test_the_default_is_one_nic_per_gpu() -> None:
    pool = _cluster(4, None).pools[0]
    assert pool.nics_per_node == 8
    assert pool.inter_Bps_per_gpu == pool.inter_node.bytes_per_s


@pytest.mark.parametrize("nics", [1, 2, 4, 6, 8])
def test_shared_nics_never_give_a_gpu_more_than_its_own(nics: int) -> None:
    pool = _cluster(4, nics).pools[0]
    assert pool.inter_Bps_per_gpu <= pool.inter_node.bytes_per_s
    assert pool.inter_Bps_per_gpu == pytest.approx(pool.inter_node.bytes_per_s * nics / 8)


def test_sharing_nics_never_makes_a_step_faster() -> None:
    """A ZeRO-3 step over four nodes with 8, 4, 2 and 1 NICs per node: never faster with fewer; on
    one node (nothing crosses the network) the NICs do not matter."""
    model = gpt_model(8, 4096, 32, seq=2048, batch=64, precision="bf16")
    plan = "dp=32,tp=1,pp=1,zero=3,mbs=2,recompute=full"
    steps = [_step(model, _cluster(4, nics), plan) for nics in (8, 4, 2, 1)]
    assert all(b >= a for a, b in zip(steps, steps[1:], strict=False)) and steps[-1] > steps[0], steps
    one = gpt_model(8, 4096, 32, seq=2048, batch=16, precision="bf16")
    single = "dp=8,tp=1,pp=1,zero=3,mbs=2,recompute=full"
    assert _step(one, _cluster(1, 2), single) == _step(one, _cluster(1, 8), single)


def test_deepspeed_module_gathers_cost_more_than_fsdp_block_gathers_at_scale() -> None:
    """The same ZeRO-3 plan over 1,536 ranks: DeepSpeed's gather per weight matrix pays the ring
    latency four times per block where FSDP2 pays it once; on one GPU nothing is gathered."""
    declared = frameworks.get("deepspeed").behaviour
    deepspeed = DEFAULT.replace(zero3_gather_unit=declared["zero3_gather_unit"],
                                zero3_reduce_bucket_params=declared["zero3_reduce_bucket_params"])
    assert deepspeed.zero3_gather_unit == "module" and DEFAULT.zero3_gather_unit == "block"
    model = gpt_model(96, 12288, 96, seq=2048, batch=1536, precision="bf16")
    plan = "dp=1536,tp=1,pp=1,zero=3,mbs=1,recompute=full"
    cluster = _cluster(192, None)
    assert _step(model, cluster, plan, deepspeed) > _step(model, cluster, plan)
    small = gpt_model(2, 1024, 16, seq=1024, batch=4, precision="bf16")
    one = _cluster(1, None, gpn=1)
    alone = "dp=1,tp=1,pp=1,zero=3,mbs=4,recompute=none"
    assert _step(small, one, alone, deepspeed) == _step(small, one, alone)


@pytest.mark.parametrize(("value", "words"), [("12", "at most one per GPU"), ("0", "nics_per_node"),
                                               ("four", "nics_per_node")])
def test_a_bad_nic_count_is_one_line_exit_2(tmp_path: Path, value: str, words: str) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes: 2\ngpus_per_node: 8\ngpu: a100-sxm4-80gb\nintra_node: nvlink3\ninter_node: ib-hdr\n"
                   f"nics_per_node: {value}\n")
    result = invoke("evaluate", MODELS / "tiny-llama.json", bad, "--plan", "dp=16")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output, result.output


def test_with_pools_the_nic_count_is_given_per_pool(tmp_path: Path) -> None:
    doc = {"nics_per_node": 4, "pools": [{"nodes": 2, "gpus_per_node": 8, "gpu": "a100-sxm4-80gb",
                                          "intra_node": "nvlink3", "inter_node": "ib-hdr"}]}
    with pytest.raises(Exception, match="per pool"):
        cluster_from_dict(doc)
    doc = {"pools": [{**doc["pools"][0], "nics_per_node": 4}]}  # type: ignore[index]
    assert cluster_from_dict(doc).pools[0].nics_per_node == 4


def test_the_example_ethernet_cluster_states_one_nic_per_node() -> None:
    """examples/clusters/4x8-a100-100gbe.yaml: one 100 Gb/s port per 8-GPU node, 1.5625 GB/s a GPU."""
    pool = load_cluster(REPO / "examples" / "clusters" / "4x8-a100-100gbe.yaml").pools[0]
    assert pool.nics_per_node == 1
    assert pool.inter_Bps_per_gpu == pytest.approx(12.5e9 / 8)


def test_deepspeed_on_azure_gpt_175b_zero3_on_256_gpus() -> None:
    """DeepSpeed on Azure (microsoft/DeepSpeed docs/_posts/2022-07-26-deepspeed-azure.md): GPT 175B,
    ZeRO-3 data parallel alone on 256 A100 80GB (one 200 Gb/s HDR NIC per GPU), micro-batch 32 at
    sequence 512, measured 204.49 TFLOP/s per GPU (Megatron's count, recompute included).  Within
    10%: the error band of the development set's sharded-DP rows (benchmarks/published.py)."""
    runs = {r.id: r for r in load_runs(REPO / "tests" / "reference" / "published_runs.yaml", [])}
    run = runs["deepspeed-azure-zero3-gpt-175b-a100x256"]
    value, ev = predict(run)
    assert run.measured == pytest.approx(204.49)
    assert ev.fits
    assert value == pytest.approx(run.measured, rel=0.10), value


def test_the_header_names_shared_nics() -> None:
    example = REPO / "examples" / "clusters" / "4x8-a100-100gbe.yaml"
    result = invoke("evaluate", MODELS / "llama-3-8b.json", example, "--plan", "dp=32,zero=3,mbs=1", "--global-batch", "32")
    assert result.exit_code == 0, result.output
    assert "1 NIC per node" in result.output
    dgx = invoke("evaluate", MODELS / "llama-3-8b.json", "4x8xa100", "--plan", "dp=32,zero=3,mbs=1", "--global-batch", "32")
    assert dgx.exit_code == 0 and "NIC" not in dgx.output


def _deepspeed_prefetch(bucket: float):
    return DEFAULT.replace(zero3_prefetch_bucket_params=bucket)


def test_module_prefetch_never_hides_more_than_block_prefetch() -> None:
    """DeepSpeed's one-module-ahead prefetch against FSDP2's next-block prefetch, for the same
    collectives and compute: never cheaper, dearer when the modules are large and the compute short."""
    model = gpt_model(4, 12288, 96, seq=2048, batch=1536, precision="bf16")
    cluster = _cluster(192, None)
    table = layer_table(model)
    plan = build_plan(parse_plan_string("dp=1536,tp=1,pp=1,zero=3,mbs=1,recompute=full"), world=cluster.gpus,
                      blocks=table.blocks, global_batch=1536)
    rng = np.random.default_rng(0)
    seconds = rng.uniform(0, 0.2, (1, 1, len(table.kinds), 3))
    window = rng.uniform(0, 0.2, (1, 1, len(table.kinds), 3))
    costs = {}
    for bucket in (0.0, 5e7):
        ctx = context(table, cluster, candidates_from_plans([plan], table), model.training.recipe(),
                      _deepspeed_prefetch(bucket))
        costs[bucket] = [terms_time.zero3_hidden(ctx, seconds, window, backward=b) for b in (False, True)]
    for block, module in zip(costs[0.0], costs[5e7], strict=True):
        assert np.all(module >= block - 1e-15) and np.any(module > block)


def test_deepspeed_prefetch_depth_matters_only_for_modules_larger_than_its_bucket() -> None:
    big = gpt_model(96, 12288, 96, seq=2048, batch=1536, precision="bf16")
    plan = "dp=1536,tp=1,pp=1,zero=3,mbs=1,recompute=full"
    cluster = _cluster(192, None)
    assert _step(big, cluster, plan, _deepspeed_prefetch(5e7)) > _step(big, cluster, plan)
    small = gpt_model(24, 1024, 16, seq=2048, batch=64, precision="bf16")  # 4 x 1024^2 = 4.2M-parameter MLP matrices
    plan = "dp=64,tp=1,pp=1,zero=3,mbs=1,recompute=none"
    assert _step(small, _cluster(8, None), plan, _deepspeed_prefetch(5e7)) == _step(small, _cluster(8, None), plan)
