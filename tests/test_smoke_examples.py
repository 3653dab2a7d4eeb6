"""Smoke test: every shipped example and hardware profile loads and scores.

A new user's first command runs on these files, so each must load cleanly and every model x
cluster pair must evaluate to finite, sane numbers under a simple default plan.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autoplace.cost.layers import layer_table
from autoplace.evaluation import Evaluation, evaluate
from autoplace.plan import build_plan
from autoplace.specs.cluster import GPUProfile, LinkProfile, load_cluster, load_profile, profile_names
from autoplace.specs.model import ModelSpec, load_model, with_overrides

REPO = Path(__file__).resolve().parents[1]
MODEL_FILES = sorted((REPO / "examples" / "models").rglob("*.json"))
CLUSTER_FILES = sorted((REPO / "examples" / "clusters").glob("*.yaml"))

# Profile names promised by docs/ARCHITECTURE.md ("Inputs").
DESIGN_GPUS = {"v100-sxm2-32gb", "a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h100-pcie-80gb",
               "h200-sxm-141gb", "b200-sxm-180gb", "mi300x-192gb", "l40s-48gb", "cpu"}
DESIGN_LINKS = {"nvlink2", "nvlink3", "nvlink4", "nvlink5", "xgmi-mi300x", "pcie4", "pcie5", "ib-hdr", "ib-ndr",
                "roce-200", "roce-400"}


def _id(path: Path) -> str:
    return str(path.relative_to(REPO / "examples"))


def test_the_examples_are_all_found() -> None:
    assert len(MODEL_FILES) >= 7 and any(p.name == "config.json" for p in MODEL_FILES)
    assert len(CLUSTER_FILES) >= 5


@pytest.mark.parametrize("path", MODEL_FILES, ids=_id)
def test_model_example_loads(path: Path) -> None:
    model = load_model(path)
    table = layer_table(model)
    assert model.name and table.blocks > 0 and table.params > 0
    assert model.training.global_batch > 0


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_id)
def test_cluster_example_loads(path: Path) -> None:
    cluster = load_cluster(path)
    assert cluster.name and cluster.gpus > 0 and cluster.pools
    for pool in cluster.pools:
        assert pool.gpu.memory_bytes > 0 and pool.intra_node.bytes_per_s > 0 and pool.inter_node.bytes_per_s > 0


def test_design_profile_names_are_shipped() -> None:
    assert DESIGN_GPUS <= set(profile_names("gpu"))
    assert DESIGN_LINKS <= set(profile_names("interconnect"))


@pytest.mark.parametrize("name", profile_names("gpu"))
def test_gpu_profile_loads(name: str) -> None:
    gpu = load_profile("gpu", name)
    assert isinstance(gpu, GPUProfile) and gpu.name == name
    assert gpu.memory_GiB > 0 and gpu.hbm_bandwidth_TBps > 0
    assert gpu.peak_TFLOPS.for_dtype("fp32") > 0  # every dtype falls back to fp32 at worst
    host = gpu.host_link if isinstance(gpu.host_link, LinkProfile) else load_profile("interconnect", gpu.host_link)
    assert host.bytes_per_s > 0
    assert gpu.sources, "every profile cites its sources"


@pytest.mark.parametrize("name", profile_names("interconnect"))
def test_interconnect_profile_loads(name: str) -> None:
    link = load_profile("interconnect", name)
    assert isinstance(link, LinkProfile) and link.name == name
    assert link.bytes_per_s > 0 and link.latency_s >= 0
    assert link.sources, "every profile cites its sources"


def _batch_for(model: ModelSpec, gpus: int, source: str) -> ModelSpec:
    """The model with its global batch rounded up to a multiple of the GPU count (dp = world)."""
    batch = model.training.global_batch
    if batch % gpus == 0:
        return model
    return with_overrides(model, {"global_batch": -(-batch // gpus) * gpus}, source=source)


def _assert_sane(ev: Evaluation) -> None:
    numbers = {"step_time_s": ev.step_time_s, "tokens_per_s": ev.tokens_per_s, "mfu": ev.mfu,
               "tflops_per_gpu": ev.tflops_per_gpu}
    numbers.update({f"memory.{k}": v for k, v in ev.memory.items()})
    numbers.update({f"comm.{k}": v for k, v in ev.comm.items()})
    numbers.update({f"time.{k}": v for k, v in ev.time.items()})
    bad = {k: v for k, v in numbers.items() if not math.isfinite(v) or v < 0}
    assert not bad, bad
    assert ev.step_time_s > 0 and ev.tokens_per_s > 0 and 0 < ev.mfu <= 1
    assert 0 < ev.memory["total"] and ev.memory["capacity"] > 0
    json.dumps(ev.to_dict(), allow_nan=False)  # the --json output is valid JSON


@pytest.mark.parametrize("cluster_path", CLUSTER_FILES, ids=_id)
@pytest.mark.parametrize("model_path", MODEL_FILES, ids=_id)
def test_every_model_on_every_cluster_evaluates(model_path: Path, cluster_path: Path) -> None:
    """Pure data parallelism, as DDP and as ZeRO-3 (the one that fits the big models)."""
    cluster = load_cluster(cluster_path)
    model = _batch_for(load_model(model_path), cluster.gpus, str(model_path))
    blocks = layer_table(model).blocks
    for values in ({}, {"zero": 3}):
        plan = build_plan(values, world=cluster.gpus, blocks=blocks, global_batch=model.training.global_batch,
                          gpus_per_node=cluster.gpus_per_node)
        ev = evaluate(model, cluster, plan)
        _assert_sane(ev)
        assert {v.rule for v in ev.violations} <= {"out-of-memory"}, ev.violations
        assert ev.plan.world == cluster.gpus and ev.plan.global_batch == model.training.global_batch
