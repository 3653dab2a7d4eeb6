"""The benchmark runtime: real 2-process gloo runs of a tiny model (tests/ CPU tier).

Like-for-like byte check (DDP, fp32): DDP all-reduces the fp32 gradient buckets once per step
(no_sync on the other micro-batches), so each rank sends 2 (n-1)/n * Psi * 4 bytes under a
ring all-reduce -- the cost model's comm["dp"] for zero 0 with the fp32 recipe.  The runtime
counts every bucket in a DDP comm hook and applies the same ring formula to its size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.runtime.spec import scaled_model, scaled_plan, unsupported_reason
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "tiny-llama.json"
CLUSTER = REPO / "examples" / "clusters" / "cpu-2.yaml"


def _plan(text: str, world: int = 2):
    m = load_model(MODEL)
    return build_plan(parse_plan_string(text), world=world, blocks=layer_table(m).blocks,
                      global_batch=m.training.global_batch)


def test_scaled_model_keeps_heads_and_shrinks_the_rest() -> None:
    m = load_model(MODEL)
    s = scaled_model(m, 0.5)
    assert (s.heads, s.n_kv_heads, s.seq_len) == (m.heads, m.n_kv_heads, m.seq_len)
    assert s.hidden == m.hidden // 2 and s.layers == m.layers // 2 and s.vocab == m.vocab // 2
    p = scaled_plan(_plan("pp=2"), s.layers)
    assert p.layers_per_stage == (1, 1) and len(p.recompute) == 2
    assert scaled_model(m, 1.0) is m


def test_unsupported_plans_are_named() -> None:
    assert unsupported_reason(_plan("ep=2")) is None  # dense models refuse it when built (worker)
    assert "NVMe" in unsupported_reason(_plan("zero=3,offload_optimizer=nvme"))
    assert "pp_embedding" in unsupported_reason(_plan("pp=2,pp_embedding=true,pp_loss=true"))
    for text in ("dp=2,zero=3", "cp=2", "pp=2,vpp=2", "dp=2,zero=3,offload_optimizer=cpu,offload_params=cpu"):
        assert unsupported_reason(_plan(text)) is None, text


@pytest.mark.slow
def test_ddp_run_reports_and_its_bytes_equal_the_cost_model(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from autoplace.runtime.launch import run_local

    m, plan = load_model(MODEL), _plan("dp=2,zero=0")
    out = run_local(m, plan, tmp_path, timeout_s=180, steps=2, warmup=1)
    assert out.ok, out.error
    r = out.result
    assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and len(r["losses"]) == 3
    assert r["memory"]["peak_rss_bytes"] > 0
    psi = layer_table(m).params
    assert r["memory"]["state_bytes_per_device"]["params"] == psi * 4  # fp32, replicated
    predicted = evaluate(m, load_cluster(CLUSTER), plan).comm["dp"]
    measured = r["collectives"]["ring_bytes_by_dim"]["dp"]
    assert predicted == pytest.approx(2 * (2 - 1) / 2 * psi * 4)
    assert measured == pytest.approx(predicted, rel=1e-9)


@pytest.mark.slow
def test_pipeline_run_counts_its_sends(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from autoplace.runtime.launch import run_local

    m, plan = load_model(MODEL), _plan("pp=2,mbs=2,schedule=gpipe")
    out = run_local(m, plan, tmp_path, timeout_s=180, steps=1, warmup=1)
    assert out.ok, out.error
    predicted = evaluate(m, load_cluster(CLUSTER), plan).comm["pp"]
    # activations of every micro-batch, plus a few bytes of the stages' shape handshake
    assert out.result["collectives"]["ring_bytes_by_dim"]["pp"] == pytest.approx(predicted, rel=1e-3)


@pytest.mark.slow
def test_injected_crash_is_classified(tmp_path: Path) -> None:
    """(OOM and hang: tests/test_tune.py, through the study.)"""
    fault = "crash"
    pytest.importorskip("torch")
    from autoplace.runtime.launch import run_local

    out = run_local(load_model(MODEL), _plan("dp=2,zero=0"), tmp_path, timeout_s=120, extra=["--fail", fault])
    assert (out.status, out.reason) == ("failed", fault)
    assert "injected" in out.error or "simulated" in out.error


def test_unsupported_plan_is_reported_not_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from autoplace.runtime.launch import run_local

    out = run_local(load_model(MODEL), _plan("ep=2"), tmp_path, timeout_s=120)
    assert out.status == "unsupported" and "expert parallel" in out.reason


def test_trials_name_where_they_depart_from_their_plan() -> None:
    """FSDP2 has no ZeRO-1/2 and no optimizer-only offload: those native trials carry a labelled
    deviation; DeepSpeed runs them natively, and ring CP and ZeRO-3 are exact."""
    from autoplace.runtime.spec import deviation

    for text in ("dp=2,zero=1", "dp=2,zero=2"):
        zero = text[-1]
        assert f"zero{zero} ran as FSDP2 reshard_after_forward=False" in (deviation(_plan(text)) or "")
        assert deviation(_plan(text), "deepspeed") is None
    offload = deviation(_plan("dp=2,zero=3,offload_optimizer=cpu"))
    assert offload is not None and "parameters and gradients are offloaded too" in offload
    assert deviation(_plan("dp=2,zero=3,offload_optimizer=cpu"), "deepspeed") is None
    for text in ("dp=2,zero=3", "dp=2,zero=0", "cp=2", "tp=2", "dp=2,zero=3,offload_optimizer=cpu,offload_params=cpu"):
        assert deviation(_plan(text)) is None, text
