"""The runtime's gradient accumulation, DeepSpeed path, interleaved pipeline and context parallel:
real 2-process gloo runs of the tiny model (fp32), checked against the cost model's bytes and
against one reference run.

Every plan here trains on the same data: 4 rows x 2 micro-batches per step (dp=2 x mbs=2, or
one data-parallel rank with mbs=4), so all of them must produce the losses of the FSDP2 ZeRO-2
reference run to fp32 reassociation (test_verify ties FSDP2 to one process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.frameworks import get
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from tests.test_runtime import CLUSTER, MODEL, _plan

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

N = 2  # ranks
FP32 = 4  # bytes per gradient / parameter element


def _run(text: str, directory: Path, framework: str = "native", **kw: Any) -> dict[str, Any]:
    from autoplace.runtime.launch import run_local

    out = run_local(load_model(MODEL), _plan(text), directory, timeout_s=240, steps=2, warmup=1,
                    framework=framework, **kw)
    assert out.ok, f"{out.status} {out.reason} {out.error} (log: {out.log})"
    return out.result


def _run_world(text: str, directory: Path, world: int) -> dict[str, Any]:
    from autoplace.runtime.launch import run_local

    out = run_local(load_model(MODEL), _plan(text, world=world), directory, timeout_s=240, steps=2, warmup=1)
    assert out.ok, f"{out.status} {out.reason} {out.error} (log: {out.log})"
    return out.result


def _ring_bytes(result: dict[str, Any], dim: str, collective: str) -> int:
    return sum(r["ring_bytes"] for r in result["collectives"]["by_collective"]
               if r["dim"] == dim and r["collective"] == collective)


def _predicted(text: str, framework: str | None = None) -> dict[str, float]:
    """The cost model's bytes for ``text``, as ``framework`` runs it (None: ZeRO's paper, FSDP2)."""
    return evaluate(load_model(MODEL), load_cluster(CLUSTER), _plan(text), DEFAULT.replace(**(get(framework).behaviour if framework else {}))).comm


def _assert_same_losses(result: dict[str, Any], reference: dict[str, Any]) -> None:
    assert len(result["losses"]) == len(reference["losses"]) == 3
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """FSDP2 ZeRO-2, dp=2, 2 micro-batches per step: the reference every other run is held to."""
    return _run("dp=2,zero=2,mbs=2", tmp_path_factory.mktemp("zero2"))


def test_fsdp2_reduce_scatters_every_micro_batch_like_the_cost_model(zero2: dict[str, Any]) -> None:
    """ZeRO-2 reduce-scatters the fp32 gradients once per micro-batch ((n-1)/n * Psi * 4 each) and
    all-gathers the updated parameters once per step -- the cost model's comm["dp"], exactly."""
    psi = layer_table(load_model(MODEL)).params
    assert _plan("dp=2,zero=2,mbs=2").grad_accum == 2
    one_reduce_scatter = (N - 1) / N * psi * FP32
    assert _ring_bytes(zero2, "dp", "reduce_scatter") == pytest.approx(2 * one_reduce_scatter, rel=1e-12)
    assert _ring_bytes(zero2, "dp", "all_gather") == pytest.approx(one_reduce_scatter, rel=1e-12)
    # the cost model charges one reduce-scatter per extra micro-batch (ga=1 -> ga=2) ...
    assert _predicted("dp=2,zero=2,mbs=2")["dp"] - _predicted("dp=2,zero=2,mbs=4")["dp"] == pytest.approx(
        one_reduce_scatter)
    # ... and the runtime moves what it predicts
    assert zero2["collectives"]["ring_bytes_by_dim"]["dp"] == pytest.approx(_predicted("dp=2,zero=2,mbs=2")["dp"],
                                                                             rel=1e-12)


def test_deepspeed_zero3_trains_with_the_emitted_config(zero2: dict[str, Any], tmp_path: Path) -> None:
    """DeepSpeed ZeRO-3 from ``emit_deepspeed``: same losses as FSDP2, parameters partitioned, and
    one reduce-scatter of the gradients per micro-batch -- the bytes the cost model charges."""
    r = _run("dp=2,zero=3,mbs=2", tmp_path, framework="deepspeed")
    assert r["framework"] == "deepspeed"
    _assert_same_losses(r, zero2)
    psi = layer_table(load_model(MODEL)).params
    assert r["memory"]["state_bytes_per_device"]["params"] == psi * FP32 / N
    assert _ring_bytes(r, "dp", "reduce_scatter") == pytest.approx(2 * (N - 1) / N * psi * FP32, rel=1e-12)
    assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0


def _deepspeed_dp_bytes(text: str) -> float:
    """The cost model's comm["dp"] costed for DeepSpeed 0.19, which all-reduces ZeRO-1/2 gradient
    buckets (``use_multi_rank_bucket_allreduce``): ZeRO-2 moves 5/3 of the reduce-scatter plan's
    bytes at two micro-batches, ZeRO-1 1.5x."""
    return _predicted(text, "deepspeed")["dp"]


@pytest.mark.parametrize("zero", [1, 2])
def test_deepspeed_zero12_bytes_and_states(zero: int, zero2: dict[str, Any], tmp_path: Path) -> None:
    """ZeRO-1 and ZeRO-2 as DeepSpeed runs them natively (an exact trial, no deviation): same losses,
    parameters replicated and optimizer state sharded between steps, and the counted data-parallel
    bytes are the cost model's with DeepSpeed's all-reduce in place of the reduce-scatter."""
    text = f"dp=2,zero={zero},mbs=2"
    r = _run(text, tmp_path, framework="deepspeed")
    _assert_same_losses(r, zero2)
    assert r["exact"] and r["deviation"] is None
    psi = layer_table(load_model(MODEL)).params
    states = r["memory"]["state_bytes_per_device"]
    assert states["params"] == psi * FP32 and states["optimizer"] == 2 * psi * FP32 / N
    # + the few scalar all-reduces of DeepSpeed's overflow check
    assert r["collectives"]["ring_bytes_by_dim"]["dp"] == pytest.approx(_deepspeed_dp_bytes(text), abs=64)


def test_deepspeed_zero2_all_reduces_every_micro_batch(zero2: dict[str, Any], tmp_path: Path) -> None:
    """DeepSpeed 0.19's ZeRO-2 all-reduces each gradient bucket (use_multi_rank_bucket_allreduce), once
    per micro-batch: twice the ring bytes of the reduce-scatter the cost model charges."""
    r = _run("dp=2,zero=2,mbs=2", tmp_path, framework="deepspeed")
    _assert_same_losses(r, zero2)
    psi = layer_table(load_model(MODEL)).params
    all_reduce = sum(x["tensor_bytes"] for x in r["collectives"]["by_collective"] if x["collective"] == "all_reduce")
    assert all_reduce == pytest.approx(2 * psi * FP32, abs=64)  # + a few scalar all-reduces (overflow check)
    assert _ring_bytes(r, "dp", "all_gather") == pytest.approx(_ring_bytes(zero2, "dp", "all_gather"), rel=1e-12)


@pytest.mark.skipif(os.environ.get("AUTOPLACE_JIT_TESTS") != "1",
                    reason="JIT-builds DeepSpeedCPUAdam (~55 s on a fresh machine); set AUTOPLACE_JIT_TESTS=1")
def test_deepspeed_zero3_with_cpu_optimizer_offload(zero2: dict[str, Any], tmp_path: Path) -> None:
    """Optimizer-only offload, natively (ZeRO-Offload: DeepSpeedCPUAdam on host copies, parameters
    stay on the device): an exact trial; the gradients are reduce-scattered once per micro-batch,
    the bytes the cost model charges, as without offload."""
    r = _run("dp=2,zero=3,mbs=2,offload_optimizer=cpu", tmp_path, framework="deepspeed")
    _assert_same_losses(r, zero2)
    assert r["exact"] and r["deviation"] is None
    psi = layer_table(load_model(MODEL)).params
    assert _ring_bytes(r, "dp", "reduce_scatter") == pytest.approx(2 * (N - 1) / N * psi * FP32, rel=1e-12)


def test_deepspeed_reports_what_the_emitter_cannot_express(tmp_path: Path) -> None:
    from autoplace.runtime.launch import run_local

    out = run_local(load_model(MODEL), _plan("cp=2"), tmp_path, framework="deepspeed")
    assert out.status == "unsupported" and "deepspeed: cp=2" in out.reason


def test_tensor_parallel_bytes_equal_the_cost_model(zero2: dict[str, Any], tmp_path: Path) -> None:
    """tp=2 without SP, the head vocabulary-parallel under ``loss_parallel`` (as the tracker harness
    measures it): same losses; two all-reduces forward and two backward per block, the cost
    model's comm["tp"] to the byte (the logits are never gathered)."""
    text = "tp=2,sp=false,mbs=4"
    r = _run(text, tmp_path)
    _assert_same_losses(r, zero2)
    assert r["collectives"]["ring_bytes_by_dim"]["tp"] == pytest.approx(_predicted(text)["tp"], rel=1e-12)


def test_interleaved_pipeline_trains_like_data_parallel(zero2: dict[str, Any], tmp_path: Path) -> None:
    """pp=2 x vpp=2 (ScheduleInterleaved1F1B, one block per virtual stage): same losses; each micro-batch
    crosses 3 stage boundaries each way, the cost model's 2 * vpp - 1 sends per rank pair."""
    text = "pp=2,vpp=2,mbs=4"
    assert _plan(text).schedule == "interleaved"
    r = _run(text, tmp_path)
    _assert_same_losses(r, zero2)
    # activations and gradients, plus a few bytes of the stages' shape handshake
    assert r["collectives"]["ring_bytes_by_dim"]["pp"] == pytest.approx(_predicted(text)["pp"], rel=1e-3)


def _kv_chunk_bytes(cp: int, rows: int = 4) -> float:
    """K and V of one rank's sequence chunk in one micro-batch of one block (fp32)."""
    m = load_model(MODEL)
    return rows * m.seq_len / cp * 2 * m.n_kv_heads * m.dim_head * FP32


def test_context_parallel_zero3_bytes(zero2: dict[str, Any], tmp_path: Path) -> None:
    """cp=2 with ZeRO-3 over the cp ranks: same losses; FSDP2 moves the cost model's dp bytes; ring
    attention sends each K/V chunk on cp-1 times forward and, in backward, K/V again plus the
    dK/dV accumulators: 3 (cp-1) chunks per block and micro-batch, the cost model's cp bytes."""
    text = "cp=2,zero=3,mbs=4"
    r = _run(text, tmp_path)
    _assert_same_losses(r, zero2)
    blocks, micro_batches = load_model(MODEL).layers, 2
    sends = 3 * (N - 1) * _kv_chunk_bytes(N) * blocks * micro_batches
    assert _ring_bytes(r, "cp", "send") == pytest.approx(sends, rel=1e-12)
    predicted = _predicted(text)
    assert r["collectives"]["ring_bytes_by_dim"]["cp"] == pytest.approx(predicted["cp"], rel=1e-12)
    assert r["collectives"]["ring_bytes_by_dim"]["dp"] == pytest.approx(predicted["dp"], rel=1e-12)
    assert r["exact"] and r["deviation"] is None


def test_ring_attention_on_four_ranks(zero2: dict[str, Any], tmp_path: Path) -> None:
    """cp=4 (DDP over the cp ranks): the ring takes 3 hops each way; same losses, and the counted
    K/V and dK/dV sends are the cost model's cp bytes (its cluster: four of cpu-2's ranks)."""
    from autoplace.specs.cluster import cluster_from_dict

    text = "cp=4,mbs=4"
    r = _run_world(text, tmp_path, 4)
    _assert_same_losses(r, zero2)
    blocks, micro_batches = load_model(MODEL).layers, 2
    assert _ring_bytes(r, "cp", "send") == pytest.approx(3 * 3 * _kv_chunk_bytes(4) * blocks * micro_batches,
                                                         rel=1e-12)
    cluster = cluster_from_dict({**yaml.safe_load(CLUSTER.read_text()), "gpus_per_node": 4})
    predicted = evaluate(load_model(MODEL), cluster, _plan(text, world=4)).comm
    assert r["collectives"]["ring_bytes_by_dim"]["cp"] == pytest.approx(predicted["cp"], rel=1e-12)


def test_context_parallel_matches_one_process() -> None:
    """cp=2 (gradients averaged over the cp ranks by DDP) against one process: 5 SGD steps, fp32
    (the single-process run is the one test_verify trains, shared within a session)."""
    from autoplace.verify import run_verify

    report = run_verify(load_model(MODEL), _plan("cp=2,mbs=4"), steps=5, world=N)
    assert report.ok, report.detail
    assert report.loss_rel_err <= 1e-5 and report.param_rel_err <= 1e-5


def test_hsdp_all_reduces_replicas_once_per_step(zero2: dict[str, Any], tmp_path: Path) -> None:
    """HSDP (2 replicas x 2 shards, 2 micro-batches): reduce-scatter within the shard group every
    micro-batch, all-reduce across replicas once per step (FSDP2's set_requires_all_reduce) --
    the bytes the cost model charges, exactly, and the losses of the reference run."""
    from autoplace.specs.cluster import cluster_from_dict

    text = "dp_replicate=2,dp_shard=2,zero=3,mbs=1"
    plan = _plan(text, world=4)
    assert (plan.dp_replicate, plan.dp_shard, plan.grad_accum) == (2, 2, 2)
    r = _run_world(text, tmp_path, 4)
    _assert_same_losses(r, zero2)
    cluster = cluster_from_dict({**yaml.safe_load(CLUSTER.read_text()), "gpus_per_node": 4})
    predicted = evaluate(load_model(MODEL), cluster, plan).comm
    assert r["collectives"]["ring_bytes_by_dim"]["dp"] == pytest.approx(predicted["dp"], rel=1e-12)
