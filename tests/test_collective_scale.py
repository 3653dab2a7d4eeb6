"""Sharded data parallel at scale (issue 25, item 1): collective latency that grows with ranks as
NCCL's ring does, the number of collectives each framework issues, NICs shared by a node's GPUs
(the cluster field ``nics_per_node``), and the published ZeRO-3 run that checks them in-sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _plain_collective_time(intra, intra_steps, inter, inter_steps, links, count=1.0):  # type: ignore[no-untyped-def]
    """comm.collective_time as it was: every protocol's time divided out and folded into a minimum."""
    best = np.asarray(np.inf)
    wire = intra / links.intra_Bps + inter / links.inter_Bps
    for p in comm.PROTOCOLS:
        latency = (p.base_s + intra_steps * p.intra_latency_share * links.intra_latency_s
                   + inter_steps * p.inter_latency_share * links.inter_latency_s)
        best = np.minimum(best, count * latency + wire / p.efficiency)
    return np.where((intra_steps + inter_steps) > 0, best, 0.0)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.floats(0, 1e11), min_size=1, max_size=6), per_node=st.sampled_from([1, 4, 8, 72]),
       nodes=st.integers(1, 300), count=st.sampled_from([1.0, 3.0, 17.5]), seed=st.integers(0, 2**16))
def test_collective_times_are_the_plain_formula(sizes: list[float], per_node: int, nodes: int, count: float,
                                                seed: int) -> None:
    """collective_time (each protocol's bytes-over-bandwidth shared, and an all-reduce's ring and
    tree sharing it) gives the plain formula's numbers, to the bit."""
    rng = np.random.default_rng(seed)
    size = np.array(sizes)[:, None]  # [C, S]-like against [C, 1] groups
    n_in = rng.choice([1, per_node], size=(len(sizes), 1))
    n = n_in * rng.integers(1, nodes + 1, size=(len(sizes), 1))
    n_out = n // n_in
    intra, inter, t = comm.allreduce(size, n, n_in, LINKS, count)
    ring = _plain_collective_time(intra, 2 * (n - n_out), inter, 2 * (n_out - 1), LINKS, count)
    tree = _plain_collective_time(intra, 2 * (n_in - 1), inter, 2 * np.ceil(np.log2(np.maximum(n_out, 1))), LINKS,
                                  count)
    assert np.array_equal(t, np.where(n_out > 1, np.minimum(ring, tree), ring))
    intra, inter, t = comm.allgather(size, n, n_in, LINKS, count)
    assert np.array_equal(t, _plain_collective_time(intra, n - n_out, inter, n_out - 1, LINKS, count))


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


# --- DeepSpeed's ZeRO-3 at scale: bucket counts, host loops, blocking offload copies (branch zero25)

def _runs(prefix: str):
    return [r for r in load_runs(REPO / "tests" / "reference" / "published_runs.yaml") if r.id.startswith(prefix)]


def _ctx(model: ModelSpec, cluster, plans: list[str], assume):
    table = layer_table(model)
    built = [build_plan(parse_plan_string(p), world=cluster.gpus, blocks=table.blocks,
                        global_batch=model.training.global_batch) for p in plans]
    return context(table, cluster, candidates_from_plans(built, table), model.training.recipe(), assume)


def test_the_reduce_host_loop_grows_with_ranks_and_tensors_and_is_zero_for_fsdp2() -> None:
    """DeepSpeed's reduce_scatter_coalesced loops over (tensor, rank): host time linear in the
    shard group; FSDP2 (zero3_reduce_host_us = 0) and ZeRO-1/2 plans have none."""
    model = gpt_model(4, 4096, 32, seq=2048, batch=4096, precision="bf16")
    cluster = _cluster(512, None)
    deepspeed = DEFAULT.replace(**frameworks.get("deepspeed").behaviour)
    plans = [f"dp={n},tp=1,pp=1,zero=3,mbs=1,recompute=full" for n in (8, 64, 512, 4096)]
    loop = terms_time.zero3_reduce_host(_ctx(model, cluster, plans, deepspeed))[:, 0, 0]
    assert np.all(np.diff(loop) > 0) and loop[-1] / loop[0] == pytest.approx(4096 / 8)
    tensors = layer_table(model).kinds[0].tensors
    assert loop[0] == pytest.approx(tensors * 8 * deepspeed.zero3_reduce_host_us * 1e-6)
    assert not terms_time.zero3_reduce_host(_ctx(model, cluster, plans, DEFAULT)).any()
    zero1 = _ctx(model, cluster, ["dp=4096,tp=1,pp=1,zero=1,mbs=1,recompute=full"], deepspeed)
    assert not terms_time.zero3_reduce_host(zero1).any()


def test_a_block_counts_its_parameter_tensors() -> None:
    """Megatron's GPT block: QKV, out, fc1, fc2 with biases and two layernorms (scale + shift) = 12;
    a Llama block (no biases, RMSNorm) counts its fused matmuls and two norm scales."""
    assert layer_table(gpt_model(2, 1024, 16)).kinds[0].tensors == 12
    llama = gpt_model(2, 1024, 16, bias=False, norm="rmsnorm", ffn="swiglu")
    assert layer_table(llama).kinds[0].tensors == 6


@pytest.mark.parametrize("ranks", [64, 512, 1536])
def test_smaller_reduce_buckets_never_make_a_step_faster(ranks: int) -> None:
    """Smaller buckets, more reduce-scatters for the same bytes (DeepSpeed's reduce_bucket_size;
    a matrix larger than the bucket goes alone, after a flush of the small tensors before it):
    each pays the ring's latency over every rank, so the step is never faster, and slower at scale."""
    model = gpt_model(8, 12288, 96, seq=2048, batch=ranks, precision="bf16")
    cluster = _cluster(ranks // 8, None)
    plan = f"dp={ranks},tp=1,pp=1,zero=3,mbs=1,recompute=full"
    base = DEFAULT.replace(**frameworks.get("deepspeed").behaviour).replace(zero3_buckets_per_hidden_sq=0.0)
    steps = [_step(model, cluster, plan, base.replace(zero3_reduce_bucket_params=b)) for b in (5e8, 1.5e8, 9e7, 1e7)]
    assert all(b >= a for a, b in zip(steps, steps[1:], strict=False)), steps
    if ranks >= 512:
        assert steps[-1] > steps[0], steps


def test_deepspeed_buckets_follow_the_config_autoplace_writes() -> None:
    """zero_section writes reduce_bucket_size = h^2 and stage3_prefetch_bucket_size = 0.9 h^2;
    the DeepSpeed costing reads the same sizes."""
    from autoplace.frameworks.deepspeed import zero_section

    model = gpt_model(4, 12288, 96, seq=2048, batch=64, precision="bf16")
    plan = build_plan(parse_plan_string("dp=64,tp=1,pp=1,zero=3,mbs=1"), world=64, blocks=4, global_batch=64)
    written = zero_section(plan, model, "/tmp")
    ctx = _ctx(model, _cluster(8, None), ["dp=64,tp=1,pp=1,zero=3,mbs=1"],
               DEFAULT.replace(**frameworks.get("deepspeed").behaviour))
    reduce, prefetch = terms_time.zero3_buckets(ctx)
    assert reduce == written["reduce_bucket_size"]
    assert prefetch == pytest.approx(written["stage3_prefetch_bucket_size"], rel=1e-6)


def test_a_blocking_offload_copy_exposes_the_reduction_only_with_an_offloaded_optimizer() -> None:
    """DeepSpeed before 0.16 copies each reduced gradient partition to the host with a blocking
    copy_: with an offloaded optimizer the step is never faster (slower at 1,024 ranks); without
    offload the flag changes nothing."""
    model = gpt_model(8, 12288, 96, seq=1024, batch=1024, precision="fp16")
    cluster = _cluster(128, None)
    ds = DEFAULT.replace(**frameworks.get("deepspeed").behaviour)
    legacy = ds.replace(zero3_offload_grad_copy_blocks=True)
    offload = "dp=1024,tp=1,pp=1,zero=3,mbs=1,recompute=full,offload_optimizer=cpu"
    assert _step(model, cluster, offload, legacy) > _step(model, cluster, offload, ds)
    plain = "dp=1024,tp=1,pp=1,zero=3,mbs=1,recompute=full"
    assert _step(model, cluster, plain, legacy) == _step(model, cluster, plain, ds)


LEGACY_REDUCE = {"zero3_list_reduces": True, "zero3_fetch_syncs": True, "zero3_reduce_host_us": 6.9,
                 "zero3_fetch_norms": True}
LEGACY_GATHER = {"zero3_list_gathers": True, "zero3_gather_host_us": 2.4}


@pytest.mark.parametrize(("config", "expected"), [
    ({"reduce_bucket_size": 9e7}, {"zero3_reduce_bucket_params": 9e7, "zero3_buckets_per_hidden_sq": 0.0}),
    ({"version": "0.6.2"}, {"zero3_offload_grad_copy_blocks": True}),
    ({"version": "0.16.0"}, {"zero3_offload_grad_copy_blocks": False}),
    ({"version": "0.5.8"}, {"zero3_offload_grad_copy_blocks": False, **LEGACY_REDUCE}),
    ({"version": "0.5"}, {"zero3_offload_grad_copy_blocks": False, **LEGACY_REDUCE, **LEGACY_GATHER}),
    ({"version": "0.3.16"}, {"zero3_offload_grad_copy_blocks": False, **LEGACY_REDUCE, **LEGACY_GATHER}),
    ({"version": "0.3.14"}, {"zero3_offload_grad_copy_blocks": False, **LEGACY_REDUCE, **LEGACY_GATHER,
                             "zero3_fetch_norms": False}),
])
def test_a_runs_deepspeed_config_sets_its_assumptions(config: dict, expected: dict) -> None:
    from autoplace.frameworks.deepspeed import run_assumptions

    assert run_assumptions(config) == expected


@pytest.mark.parametrize("config", [{"reduce_bucket": 1}, {"version": "new"}])
def test_an_unknown_deepspeed_config_key_or_version_is_refused(config: dict) -> None:
    from autoplace.errors import SpecError
    from autoplace.frameworks.deepspeed import run_assumptions

    with pytest.raises(SpecError, match="framework_config"):
        run_assumptions(config)


# --- DeepSpeed before 0.6: list-form collectives, a device sync at every fetch (issue 35 item 3)

def _legacy(version: str):
    from autoplace.frameworks.deepspeed import run_assumptions

    ds = DEFAULT.replace(**frameworks.get("deepspeed").behaviour).replace(zero3_buckets_per_hidden_sq=0.0)
    return ds.replace(**run_assumptions({"version": version}))


def test_before_0_6_a_block_reduce_scatters_each_gradient_on_its_own() -> None:
    """DeepSpeed 0.3-0.5's _reduce_scatter_gradients: one collective per gradient tensor (12 in a GPT
    block), where 0.6 reduces a 5e8-element bucket in one (a matrix above it alone, after a flush)."""
    model = gpt_model(4, 12288, 96, seq=2048, batch=512, precision="fp16")
    plans = ["dp=512,tp=1,pp=1,zero=3,mbs=1,recompute=full"]
    counts = {v: terms_time.zero3_collective_counts(ctx := _ctx(model, _cluster(64, None), plans, _legacy(v)),
                                                    ctx.dense_local)[1] for v in ("0.5.8", "0.6.2")}
    assert np.all(counts["0.5.8"] == 12)
    assert np.all(counts["0.6.2"] < 12)


@pytest.mark.parametrize("version", ["0.3.16", "0.5.8"])
def test_before_0_6_zero3_pays_a_per_rank_cost_that_grows_with_the_shard_group(version: str) -> None:
    """List-form collectives loop over the ranks on the host and copy one view per rank on the
    device, and the host waits for the device at every fetch: at a fixed micro-batch the step
    grows over 0.6.2's with the shard group, from under 10% at 64 ranks; ZeRO-1 and 2 are untouched."""
    model = gpt_model(8, 12288, 96, seq=2048, batch=1536, precision="fp16")
    extra = []
    for ranks in (64, 384, 1536):
        cluster, plan = _cluster(ranks // 8, None), f"dp={ranks},tp=1,pp=1,zero=3,mbs=1,recompute=full"
        old, new = _step(model, cluster, plan, _legacy(version)), _step(model, cluster, plan, _legacy("0.6.2"))
        extra.append(old / new - 1)
        for below in (plan.replace("zero=3", "zero=1"), plan.replace("zero=3", "zero=2")):
            assert _step(model, cluster, below, _legacy(version)) == _step(model, cluster, below, _legacy("0.6.2"))
    assert 0 < extra[0] < 0.10 and extra[0] < extra[1] < extra[2], extra


def test_a_list_form_collective_runs_one_copy_kernel_per_rank() -> None:
    """PyTorch's NCCL process group copies a list's views out of (into) its flat buffer one copy_
    per rank: each of a GPT block's 4 gathers (12 reduce-scatters) costs that many more launches."""
    model = gpt_model(4, 12288, 96, seq=2048, batch=512, precision="fp16")
    plans = ["dp=512,tp=1,pp=1,zero=3,mbs=1,recompute=full"]
    legacy = _legacy("0.3.16")
    sh = {on: terms_time._shard_collectives(ctx := _ctx(model, _cluster(64, None), plans, legacy.replace(
        zero3_list_gathers=on)), ctx.train_dense, ctx.train_exp) for on in (True, False)}
    launch = legacy.kernel_overhead_us * 1e-6
    assert np.allclose(sh[True].ag_fwd - sh[False].ag_fwd, 4 * 512 * launch)
    assert np.allclose(sh[True].ag_bwd - sh[False].ag_bwd, 4 * 512 * launch)
    flat = terms_time._shard_collectives(ctx := _ctx(model, _cluster(64, None), plans, legacy.replace(
        zero3_list_reduces=False, zero3_reduce_bucket_params=1e12)), ctx.train_dense, ctx.train_exp)
    assert np.all(sh[True].rs - flat.rs >= 12 * 512 * launch)


def test_the_fetch_norms_read_every_gathered_weight_once_a_pass() -> None:
    """DeepSpeed 0.3.15-0.5 take each fetched parameter's norm: a GPT-175B block's 1.8e9 fp16 weights
    read twice a micro-batch (forward and backward) at the GPU's memory bandwidth: a small share of
    its step at micro-batch 4, and nothing below ZeRO-3."""
    model = gpt_model(8, 12288, 96, seq=2048, batch=1536, precision="fp16")
    cluster = _cluster(48, None)
    legacy = _legacy("0.3.16")
    plan = "dp=384,tp=1,pp=1,zero=3,mbs=4,recompute=full"
    extra = _step(model, cluster, plan, legacy) / _step(model, cluster, plan, legacy.replace(zero3_fetch_norms=False)) - 1
    assert 0.001 < extra < 0.05, extra
    zero1 = plan.replace("zero=3", "zero=1")
    assert _step(model, cluster, zero1, legacy) == _step(model, cluster, zero1, legacy.replace(zero3_fetch_norms=False))


def test_a_device_sync_at_every_fetch_never_makes_a_step_faster() -> None:
    """With the host waiting for the device at each fetch, the host's gather and reduce loops run
    after the block's kernels instead of beside them: never faster, and slower where the device's
    work would have covered them (a large block at 1,536 ranks)."""
    model = gpt_model(8, 12288, 96, seq=2048, batch=6144, precision="fp16")
    legacy = _legacy("0.3.16")
    for ranks, mbs in ((64, 1), (1536, 4), (1536, 1)):
        cluster, plan = _cluster(ranks // 8, None), f"dp={ranks},tp=1,pp=1,zero=3,mbs={mbs},recompute=full"
        synced, beside = _step(model, cluster, plan, legacy), _step(model, cluster, plan, legacy.replace(zero3_fetch_syncs=False))
        assert synced >= beside
    assert synced > beside


def test_zeropp_post_zero3_baselines_on_384_v100() -> None:
    """The ZeRO++ post's ZeRO-3 baselines (18B GPT, 384 V100 on 24 DGX-2 nodes, 100-800 Gb/s per
    node, 1K or 2K tokens per GPU): the network-bound runs (100 and 200 Gb/s per node) within 10%;
    the 400-800 Gb/s runs are predicted 23-36% optimistic, a gap left open (within 40%); all
    ordered as measured: more network, more throughput; twice the tokens per GPU, more."""
    runs = {r.id.rsplit("-", 2)[-2] + "-" + r.id.rsplit("-", 1)[-1]: r for r in _runs("zeropp-blog-zero3")}
    assert len(runs) == 6
    pred = {k: predict(r)[0] for k, r in runs.items()}
    for k, r in runs.items():
        band = 0.10 if k.startswith(("ib1", "200gbps")) else 0.40
        assert pred[k] == pytest.approx(r.measured, rel=band), (k, pred[k], r.measured)
    two_k = ["ib1-2k", "200gbps-2k", "ib4-2k", "800gbps-2k"]
    assert all(pred[a] < pred[b] for a, b in zip(two_k, two_k[1:], strict=False)), pred
    assert pred["ib1-1k"] < pred["ib1-2k"] and pred["ib4-1k"] < pred["ib4-2k"]


def test_deepspeed_on_azure_zero3_collapses_at_small_micro_batch_and_many_ranks() -> None:
    """DeepSpeed on Azure, Figure 5(b): GPT-175B ZeRO-3 at sequence 1,024 on 256-1,024 A100.
    Micro-batch 1 falls from 80.9 to 48.8 TFLOP/s per GPU as the ranks quadruple while micro-batch
    16 stays near 190 (ratio 0.26 at 1,024); predicted within 30% each at 256+ ranks (256-512
    within 10%, 1,024 at micro-batch 1-2 +23-26%), falling with ranks at micro-batch 1 as measured
    (collectives' ring latency over every rank, the blocking offload copy of DeepSpeed 0.6, the
    per-rank host loops), and under 0.4 of micro-batch 16 at 1,024."""
    runs = {(r.cluster.gpus, r.plan.mbs): r for r in _runs("deepspeed-azure-zero3-gpt-175b-seq1024")}
    pred = {k: predict(r)[0] for k, r in runs.items() if k[0] >= 256}
    for k, value in pred.items():
        band = 0.10 if k[0] <= 512 else 0.30
        assert value == pytest.approx(runs[k].measured, rel=band), (k, value, runs[k].measured)
    mbs1 = [pred[(n, 1)] for n in (256, 512, 1024)]
    assert mbs1[0] > mbs1[1] > mbs1[2], mbs1
    assert pred[(1024, 1)] < 0.4 * pred[(1024, 16)]


def test_the_sharded_runs_at_256_ranks_and_more_stay_in_band() -> None:
    """Every sharded development run at 256+ ranks: mean absolute error under 12% (17.3% and 40.1%
    for 256-1,023 and 1,024+ ranks before this branch's terms), none beyond 40%."""
    runs = [r for r in load_runs(REPO / "tests" / "reference" / "published_runs.yaml")
            if r.plan.zero >= 3 and r.plan.dp_shard * r.plan.cp >= 256]
    errors = np.array([predict(r)[0] / r.measured - 1 for r in runs])
    assert len(runs) >= 40
    assert np.mean(np.abs(errors)) < 0.12 and np.max(np.abs(errors)) < 0.40, errors


def test_the_blocking_offload_copy_costs_once_a_step_not_once_a_micro_batch() -> None:
    """The copy runs at the gradient-accumulation boundary: with four micro-batches a step pays it
    about once, as with one (not four times)."""
    cluster = _cluster(128, None)
    ds = DEFAULT.replace(**frameworks.get("deepspeed").behaviour)
    legacy = ds.replace(zero3_offload_grad_copy_blocks=True)
    extra = []
    for ga in (1, 4):
        plan = f"dp=1024,tp=1,pp=1,zero=3,mbs=1,ga={ga},recompute=full,offload_optimizer=cpu"
        m = gpt_model(8, 12288, 96, seq=1024, batch=1024 * ga, precision="fp16")
        extra.append(_step(m, cluster, plan, legacy) - _step(m, cluster, plan, ds))
    assert extra[0] > 0 and 0 < extra[1] < 2 * extra[0], extra
