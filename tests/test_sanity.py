"""A prediction above the best published MFU on its GPU is reported with the kernel rates that lift it
(autoplace.sanity): the README's first example (Llama-3-8B on 8 A100), and plans that stay below."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.cost.attention import FA_BACKWARD_FLOPS
from autoplace.evaluation import evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.sanity import kernel_rates, mfu_check
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from tests.helpers import REPO

MODEL, CLUSTER = REPO / "examples" / "models" / "llama-3-8b.json", REPO / "examples" / "clusters" / "1x8-a100-80gb.yaml"
README_PLAN = "dp_shard=8,zero=2,mbs=1,compile=true,recompute=none"


def _evaluated(text: str):
    model, cluster = load_model(MODEL), load_cluster(CLUSTER)
    plan = build_plan(parse_plan_string(text), world=cluster.gpus, blocks=model.layers,
                      global_batch=model.training.global_batch)
    return evaluate(model, cluster, plan), model, cluster


def test_the_readme_plan_is_above_every_published_a100_run_and_says_what_lifts_it() -> None:
    ev, model, cluster = _evaluated(README_PLAN)
    above = mfu_check(ev, model, cluster)
    gpu = cluster.pools[0].gpu
    assert above is not None and above.best == gpu.best_published_mfu.bf16 < ev.mfu
    assert above.drivers == ["attention", "GEMMs"] and above.compute_share > 0.95
    # attention at 8k counts as MFU counts it: the executed (causal) FLOPs at the kernel table's rate, times
    # the FLOPs MFU counts (3 x the full forward) over those executed (half of 1 + 2.5 forward's), each pass
    # at its own rate
    fwd, bwd = (float(rows[-2][1]) * gpu.sustained_fraction  # seq 8192
                for rows in (gpu.attention_efficiency.forward, gpu.attention_efficiency.backward))
    assert above.attention == pytest.approx(3 / (0.5 * (1 / fwd + FA_BACKWARD_FLOPS / bwd)), rel=1e-9)
    assert above.gemm == pytest.approx(kernel_rates(model, cluster, ev)[0]) and above.gemm < above.attention
    assert "FlashAttention-2 GPT3-2.7B" in above.line() and "attention at 85%" in above.line()


def test_a_plan_below_the_best_run_or_on_a_gpu_without_one_is_not_reported() -> None:
    ev, model, cluster = _evaluated("dp_shard=8,zero=3,mbs=1,recompute=full")  # its recompute: MFU ~55%
    assert ev.mfu < cluster.pools[0].gpu.best_published_mfu.bf16 and mfu_check(ev, model, cluster) is None
    ev, model, _ = _evaluated(README_PLAN)
    known = load_cluster(CLUSTER)
    gpu = known.pools[0].gpu.model_copy(update={"best_published_mfu": None})
    unknown = known.model_copy(update={"pools": (known.pools[0].model_copy(update={"gpu": gpu}),)})
    assert mfu_check(ev, model, known) is not None and mfu_check(ev, model, unknown) is None


def test_solve_and_evaluate_print_the_warning_and_state_it_in_json() -> None:
    runner = CliRunner()
    doc = json.loads(runner.invoke(app, ["solve", str(MODEL), str(CLUSTER), "--json", "--top", "1"]).output)
    above = doc["plans"][0]["above_published"]
    assert above["drivers"] == ["attention", "GEMMs"] and above["best_published"] == 0.721
    assert doc["notes"][0].startswith("warning: plan 1's MFU")
    text = runner.invoke(app, ["evaluate", str(MODEL), str(CLUSTER), "--plan", README_PLAN]).output
    assert "warning: MFU 74." in " ".join(text.split())
