"""verify: a plan at world size 2 trains exactly like one process (fp32, 5 SGD steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoplace.cost.layers import layer_table
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.model import load_model
from autoplace.verify import GRADIENT_INTEGRITY, STATE_CONSISTENCY, run_verify

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

MODEL = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny-llama.json"


def _plan(text: str):
    m = load_model(MODEL)
    return m, build_plan(parse_plan_string(text), world=2, blocks=layer_table(m).blocks,
                         global_batch=m.training.global_batch)


# mbs chosen so every plan runs 2 micro-batches per step (grad accumulation exercised, runs short) and
# all three share one single-process reference run (4 rows x 2 micro-batches)
@pytest.mark.parametrize("text", ["dp=2,zero=0,mbs=2", "dp=2,zero=3,mbs=2", "tp=2,mbs=4"], ids=["ddp", "fsdp2-zero3", "tp-sp"])
def test_plan_matches_single_process(text: str) -> None:
    m, plan = _plan(text)
    report = run_verify(m, plan, steps=5, world=2)
    assert report.ok, report.detail
    assert report.loss_rel_err <= 1e-5 and report.param_rel_err <= 1e-5
    assert len(report.losses_plan) == 5


def test_summed_gradients_break_gradient_integrity() -> None:
    m, plan = _plan("dp=2,zero=0,mbs=2")
    report = run_verify(m, plan, steps=5, world=2, fault="sum-grads")
    assert not report.ok and report.broken == GRADIENT_INTEGRITY
    assert "gradient" in report.detail


def test_unsynchronised_replicas_break_state_consistency() -> None:
    m, plan = _plan("dp=2,zero=0,mbs=2")
    report = run_verify(m, plan, steps=3, world=2, fault="desync")
    assert not report.ok and report.broken == STATE_CONSISTENCY
    assert "rank 0 and rank 1" in report.detail
