"""Communication compression as a placement choice (autoplace.compression, cost/compress.py):
the byte formulas against their papers and PyTorch's own rule, the composition rule, and the
search choosing compression only where communication costs step time."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.cost.compress import powersgd_elements
from autoplace.errors import SpecError
from autoplace.evaluation import evaluate
from autoplace.plan import Plan, build_plan, parse_plan_string
from autoplace.specs.cluster import cluster_from_dict
from autoplace.specs.model import model_from_dict
from solvers.problem import DEFAULT_FEATURES, Budget, Problem
from solvers.registry import get_solver
from tests.helpers import gpu_cluster
from tests.test_cli import invoke, strict_json


def _model(precision: str = "bf16", batch: int = 64, layers: int = 8, hidden: int = 1024, vocab: int = 32000):
    return model_from_dict({"name": "small", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                            "heads": 16, "kv_heads": 8, "vocab": vocab, "seq_len": 2048, "ffn": "swiglu",
                            "training": {"global_batch": batch, "precision": precision}})


def _cluster(nodes: int, per_node: int, inter_GBps: float = 25.0):
    return cluster_from_dict({"name": "c", "nodes": nodes, "gpus_per_node": per_node, "gpu": "a100-sxm4-80gb",
                              "intra_node": "nvlink3", "inter_node": {"bandwidth_GBps": inter_GBps, "latency_us": 5}})


def _evaluate(model, cluster, text: str):
    plan = build_plan(parse_plan_string(text), world=cluster.gpus, blocks=model.layers,
                      global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)
    return evaluate(model, cluster, plan)


def test_zeropp_cuts_cross_node_volume_from_3m_to_075m() -> None:
    """Wang et al. 2023 (ZeRO++, arXiv 2306.10209): ZeRO-3 moves 3M across nodes per step (two weight
    gathers and a gradient reduce-scatter); qwZ halves the forward gather, hpZ keeps backward's
    gather inside the node and qgZ quarters the reduce-scatter: 0.5M + 0 + 0.25M = 0.75M.  With one
    GPU per node every byte crosses nodes, so the per-device bytes show the ratio directly.  (A tiny
    vocabulary: the root unit -- embedding and head -- is gathered once per micro-batch, not twice.)"""
    model, cluster = _model(vocab=16), _cluster(nodes=8, per_node=1)
    plain = _evaluate(model, cluster, "zero=3")
    zpp = _evaluate(model, cluster, "zero=3,compress=zeropp")
    assert not zpp.violations
    assert zpp.comm["dp"] / plain.comm["dp"] == pytest.approx(0.75 / 3, rel=1e-4)


def test_zeropp_pays_for_its_secondary_shard_in_memory() -> None:
    """hpZ keeps a 16-bit secondary shard of the weights over the node (Wang et al. 2023):
    8 GPUs per node, bf16 weights -> 2 / 8 bytes per parameter more on every device."""
    model, cluster = _model(vocab=16), _cluster(nodes=2, per_node=8)
    plain = _evaluate(model, cluster, "zero=3")
    zpp = _evaluate(model, cluster, "zero=3,compress=zeropp")
    extra = zpp.memory["params"] - plain.memory["params"]
    per_block = 2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 4096  # q, o; k, v (8 of 16 heads); SwiGLU
    assert extra == pytest.approx(2 / 8 * per_block * model.layers, rel=1e-3)  # + the norms' and edges' shards


def test_bf16_reduction_halves_an_fp32_reduction() -> None:
    """FSDP2's MixedPrecisionPolicy(reduce_dtype=fp32) (the bf16-fsdp2 recipe) reduce-scatters 4 bytes
    per gradient; reduce_dtype=bf16 sends 2.  ZeRO-2's step moves one reduce-scatter of gradients and
    one all-gather of bf16 weights (ZeRO Sec. 7): (4 + 2) -> (2 + 2)."""
    model, cluster = _model("bf16-fsdp2"), _cluster(nodes=2, per_node=8)
    plain = _evaluate(model, cluster, "zero=2,mbs=4")
    bf16 = _evaluate(model, cluster, "zero=2,mbs=4,compress=bf16")
    assert bf16.comm["dp"] / plain.comm["dp"] == pytest.approx(4 / 6, rel=1e-6)
    assert bf16.memory == plain.memory


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20_000), m=st.integers(1, 20_000), rank=st.integers(1, 8))
def test_powersgd_sends_what_torchs_rule_says(n: int, m: int, rank: int) -> None:
    """Our count of the elements one n x m gradient sends equals PyTorch's own decision
    (powerSGD_hook._should_compress with its default min_compression_rate = 2)."""
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    compress, full, factors = hook._should_compress(n, m, rank, 2)
    import numpy as np

    assert float(powersgd_elements(float(n), float(m), np.array(float(rank)))) == (factors if compress else full)


def test_powersgd_sends_factors_and_keeps_an_error_buffer() -> None:
    """Vogels et al. 2019, Alg. 1-2: rank-r factors instead of the gradient, and an error-feedback
    copy of the gradient kept between steps."""
    model, cluster = _model(), _cluster(nodes=2, per_node=8)
    plain = _evaluate(model, cluster, "zero=0,mbs=4")
    r1 = _evaluate(model, cluster, "zero=0,mbs=4,compress=powersgd,powersgd_rank=1")
    r4 = _evaluate(model, cluster, "zero=0,mbs=4,compress=powersgd,powersgd_rank=4")
    assert not r1.violations and not r4.violations
    assert r1.comm["dp"] < r4.comm["dp"] < plain.comm["dp"] / 20
    assert r4.memory["grads"] == pytest.approx(2 * plain.memory["grads"])


@pytest.mark.parametrize("text, rule", [
    ("zero=1,compress=zeropp", "compress"),  # ZeRO++ is a ZeRO-3 feature
    ("zero=3,compress=powersgd", "compress"),  # PowerSGD is a DDP comm hook
    ("zero=2,compress=bf16", "compress"),  # the bf16 recipe already reduces in bf16
])
def test_compression_outside_its_rule_is_a_named_violation(text: str, rule: str) -> None:
    ev = _evaluate(_model(), _cluster(2, 8), text)
    assert rule in {v.rule for v in ev.violations}


def test_a_rank_without_powersgd_is_bad_input() -> None:
    with pytest.raises(SpecError, match="powersgd_rank=2 needs compress=powersgd"):
        _evaluate(_model(), _cluster(2, 8), "zero=0,powersgd_rank=2")


def test_plan_string_and_dict_round_trip_compression() -> None:
    model, cluster = _model(), _cluster(2, 8)
    plan = _evaluate(model, cluster, "zero=0,compress=powersgd,powersgd_rank=2").plan
    assert "compress=powersgd" in plan.to_string() and "powersgd_rank=2" in plan.to_string()
    assert Plan.from_dict(plan.to_dict()) == plan
    again = build_plan(parse_plan_string(plan.to_string()), world=cluster.gpus, blocks=model.layers,
                       global_batch=model.training.global_batch)
    assert again == plan


def test_compression_is_searched_only_when_allowed() -> None:
    model, cluster = _model(batch=16), _cluster(nodes=4, per_node=8, inter_GBps=0.5)
    off = get_solver("cpsat").solve(Problem(model, cluster, top_k=3), Budget(time_limit_s=600))
    assert all(ev.plan.compress == "none" for ev in off.plans)
    on = get_solver("cpsat").solve(Problem(model, cluster, top_k=1, features=DEFAULT_FEATURES | {"compress"}),
                                   Budget(time_limit_s=600))
    assert on.status == "optimal"
    # on a 0.5 GB/s network with 16 sequences per step, communication dominates: compression wins
    assert on.plans[0].plan.compress != "none"
    assert on.plans[0].step_time_s < off.plans[0].step_time_s


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inter=st.sampled_from([0.25, 1.0, 4.0, 25.0, 100.0, 1000.0]), batch=st.sampled_from([16, 64, 256]),
       precision=st.sampled_from(["bf16", "bf16-fsdp2"]))
def test_compression_is_chosen_only_where_communication_costs_step_time(inter: float, batch: int,
                                                                         precision: str) -> None:
    """When the best plan compresses, the same plan uncompressed is strictly slower, and by no more
    than its data-parallel communication costs (exposed, plus what it takes from the compute it
    hides under): compression can only buy back communication time."""
    model, cluster = _model(precision, batch=batch), _cluster(nodes=4, per_node=8, inter_GBps=inter)
    result = get_solver("cpsat").solve(Problem(model, cluster, top_k=1, features=DEFAULT_FEATURES | {"compress"}),
                                       Budget(time_limit_s=600))
    best = result.plans[0]
    if best.plan.compress == "none":
        return
    twin = evaluate(model, cluster, dataclasses.replace(best.plan, compress="none", powersgd_rank=0))
    saved = twin.step_time_s - best.step_time_s
    assert saved > 0
    assert saved <= twin.time["dp"] + twin.time["zero"] + 1e-9


def test_a_fast_network_hidden_reduction_keeps_gradients_uncompressed() -> None:
    """One NVLink node with a large batch: the reduction hides under backward, and every lossy
    option adds kernel time, so the search keeps full-precision gradients."""
    model = _model(batch=512)
    result = get_solver("cpsat").solve(Problem(model, gpu_cluster(8), top_k=1,
                                               features=DEFAULT_FEATURES | {"compress"}), Budget(time_limit_s=600))
    assert result.plans[0].plan.compress == "none"


def _slow_files(tmp_path):
    """A small model on four 8-GPU nodes behind 0.5 GB/s per GPU: communication-bound."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"name": "small", "layers": 8, "hidden": 1024, "ffn_hidden": 4096, "heads": 16,
                                 "kv_heads": 8, "vocab": 32000, "seq_len": 2048, "ffn": "swiglu",
                                 "training": {"global_batch": 32}}))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("name: slow\nnodes: 4\ngpus_per_node: 8\ngpu: a100-sxm4-80gb\nintra_node: nvlink3\n"
                       "inter_node: {bandwidth_GBps: 0.5, latency_us: 5}\n")
    return model, cluster


def test_solve_without_compress_says_what_it_would_buy_and_with_it_flags_the_risk(tmp_path) -> None:
    """Data parallel only (pinned), on a slow network: the best plan's gradients dominate its step."""
    model, cluster = _slow_files(tmp_path)
    pins = ("--fix", "tp=1", "--fix", "pp=1", "--fix", "cp=1", "--framework", "none", "--time-limit", "600")
    plain = strict_json(invoke("solve", model, cluster, "--json", "--top", "1", *pins).stdout)
    hint = [n for n in plain["notes"] if n.startswith("compression was not searched")]
    assert len(hint) == 1 and "accuracy risk" in hint[0]
    result = invoke("solve", model, cluster, "--top", "1", "--allow", "compress", "--format", "csv", *pins)
    assert result.exit_code == 0, result.output
    row = next(csv.DictReader(io.StringIO(result.stdout)))
    assert row["compress"] != "none" and f"compress={row['compress']}" in row["plan"]
    doc = strict_json(invoke("solve", model, cluster, "--json", "--top", "1", "--allow", "compress", *pins).stdout)
    best = doc["plans"][0]
    assert best["compress_risk"] and best["step_time_s"] < plain["plans"][0]["step_time_s"]
    assert not any(n.startswith("compression was not searched") for n in doc["notes"])


def test_fix_pins_a_compression(tmp_path) -> None:
    model, cluster = _slow_files(tmp_path)
    doc = strict_json(invoke("solve", model, cluster, "--json", "--top", "1", "--framework", "none", "--fix",
                             "compress=powersgd", "--fix", "powersgd_rank=2", "--time-limit", "600").stdout)
    plan = doc["plans"][0]
    assert (plan["compress"], plan["powersgd_rank"], plan["zero_stage"]) == ("powersgd", 2, 0)


def test_scale_replicates_an_inline_network_and_searches_compression_when_allowed(tmp_path) -> None:
    """The unit cluster's links are kept as the file gives them (an inline inter_node too)."""
    model, cluster = _slow_files(tmp_path)

    def sweep(*extra: str) -> dict:
        result = invoke("scale", model, "--cluster", cluster, "--gpus", "8,32", "--json", *extra)
        assert result.exit_code == 0, result.output
        return strict_json(result.stdout)

    assert all(p["plan"]["compress"] == "none" for p in sweep()["points"])
    assert sweep("--allow", "compress")["points"][1]["plan"]["compress"] != "none"


def test_no_hint_for_a_compression_that_saves_almost_nothing() -> None:
    """Llama-3-70B on 64 H100 (NDR), the plan the README shows: bf16 would save a few
    millionths of its step, not worth an accuracy risk, so no hint (the slow-network test above
    shows one that pays)."""
    from autoplace.cost.assumptions import DEFAULT
    from autoplace.evaluation import evaluate
    from autoplace.explain import HINT_GAIN, compression_hint
    from autoplace.frameworks import get as get_framework
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    root = Path(__file__).resolve().parents[1] / "examples"
    cluster = load_cluster(root / "clusters" / "8x8-h100.yaml")
    model, _ = get_framework("megatron").costing(load_model(root / "models" / "llama-3-70b.json"), DEFAULT)
    plan = build_plan(parse_plan_string("dp=4,tp=4,pp=4,zero=1,mbs=1,fused_loss=true,tp_overlap=userbuffers,"
                                        "layers=18:21:21:20,recompute=none"), world=64, blocks=80,
                      global_batch=model.training.global_batch, gpus_per_node=8)
    best = evaluate(model, cluster, plan)
    saved = 1 - evaluate(model, cluster, dataclasses.replace(plan, compress="bf16")).step_time_s / best.step_time_s
    assert 0 < saved < HINT_GAIN
    assert compression_hint(model, cluster, best) is None
