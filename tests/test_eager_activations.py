"""Eager activation memory (no recompute) against PyTorch's own MemTracker (issue 35, item 5).

The cost model's per-layer bytes come from what each op's autograd formula saves
(autoplace/cost/layers.py); :mod:`autoplace.fidelity.saved` runs transformers' ``LlamaForCausalLM``
(SDPA) and an MPT-style model for one bf16 step on fake tensors under ``MemTracker``.  No number
here was used to derive anything: the shapes are checks only.  Tolerance 1%: what is left is
bytes per token (LayerNorm's 8-byte statistics), not tensors.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from autoplace import frameworks  # noqa: E402
from autoplace.cost.assumptions import DEFAULT, Assumptions  # noqa: E402
from autoplace.evaluation import evaluate  # noqa: E402
from autoplace.fidelity.saved import Shape, measure  # noqa: E402
from autoplace.plan import build_plan  # noqa: E402
from autoplace.specs.model import TransformerSpec, model_from_dict  # noqa: E402
from tests.helpers import gpu_cluster  # noqa: E402

TOLERANCE = 0.01
# (batch, seq, hidden, heads, kv_heads, ffn, vocab) in a real model's proportions: GQA and MHA,
# a vocabulary several times the MLP width (where the loss's workspace is the backward's largest)
SHAPES = {
    "llama": [Shape(2, 64, 256, 4, 2, 688, 6000, layers=1), Shape(1, 128, 384, 6, 6, 1024, 9000, layers=2)],
    "mpt": [Shape(2, 64, 256, 4, 4, 1024, 6000, layers=1), Shape(1, 128, 384, 6, 2, 1536, 9000, layers=2)],
}
CASES = [(family, shape) for family, shapes in SHAPES.items() for shape in shapes]


def _spec(family: str, shape: Shape, layers: int) -> TransformerSpec:
    spec = model_from_dict(shape.hf_config(family, layers))
    assert isinstance(spec, TransformerSpec)
    return spec.model_copy(update={"training": spec.training.model_copy(update={"global_batch": shape.batch})})


def _assumptions(spec: TransformerSpec) -> Assumptions:
    """accelerate's costing (it trains transformers' modelling code), without DDP's buckets: one
    GPU, no data parallelism, and the tracker files buckets as gradients, not activations."""
    return frameworks.get("accelerate").costing(spec, DEFAULT)[1].replace(comm_bucket_MiB=0.0)


def _predicted(family: str, shape: Shape, layers: int) -> dict[str, float]:
    spec = _spec(family, shape, layers)
    plan = build_plan({"dp_shard": 1, "zero": 0, "mbs": shape.batch, "ga": 1}, world=1, blocks=layers,
                      global_batch=shape.batch)
    return evaluate(spec, gpu_cluster(1), plan, _assumptions(spec)).memory


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, Shape], object]:
    return {case: measure(*case) for case in CASES}


@pytest.mark.parametrize(("family", "shape"), CASES, ids=[f"{f}-h{s.hidden}-v{s.vocab}" for f, s in CASES])
def test_one_layer_keeps_what_memtracker_sees(family: str, shape: Shape, measured: dict) -> None:
    """The activations one more decoder layer adds, every saved storage once (shared inputs of
    q/k/v and gate/up, flash attention's log-sum-exp, no dropout masks, transformers' fp32 norm input)."""
    per_layer = (_predicted(family, shape, shape.layers + 1)["activations"]
                 - _predicted(family, shape, shape.layers)["activations"])
    truth = measured[family, shape].per_layer
    assert per_layer / truth - 1 == pytest.approx(0, abs=TOLERANCE), (per_layer, truth)


@pytest.mark.parametrize(("family", "shape"), CASES, ids=[f"{f}-h{s.hidden}-v{s.vocab}" for f, s in CASES])
def test_the_step_peak_is_every_layer_plus_the_loss_workspace(family: str, shape: Shape, measured: dict) -> None:
    """The step's activation-side peak (activations + temporaries) is at the start of backward:
    every layer's saved tensors, the head's and the loss's fp32 workspace, counted once."""
    memory = _predicted(family, shape, shape.layers)
    predicted = memory["activations"] + memory["buffers"]
    truth = measured[family, shape].peak
    assert predicted / truth - 1 == pytest.approx(0, abs=TOLERANCE), (predicted, truth)


@pytest.mark.parametrize("compiled", [True, False])
def test_the_fp32_norm_input_is_idle_exactly_where_the_search_says(compiled: bool) -> None:
    """search.IDLE_BEHAVIOUR calls ``rmsnorm_upcast_kept`` idle on compiled configurations (the
    compiled norm keeps a fused kernel's tensors): there the costing with it equals the costing
    without it, and on an eager configuration it does not."""
    from autoplace.frameworks import search
    from autoplace.plan import parse_plan_string

    spec = _spec("llama", SHAPES["llama"][0], 4)
    values = {**parse_plan_string(f"dp=8,zero=3,mbs=1,compile={str(compiled).lower()}"), "ga": 1}
    plan = build_plan(values, world=8, blocks=4, global_batch=8)
    kept = frameworks.get("fsdp").costing(spec, DEFAULT)[1]
    assert kept.rmsnorm_upcast_kept
    memory = [evaluate(spec, gpu_cluster(8), plan, kept.replace(rmsnorm_upcast_kept=k)).memory["activations"]
              for k in (True, False)]
    config = type("Config", (), {"compile": compiled})()
    assert search.IDLE_BEHAVIOUR["rmsnorm_upcast_kept"](config) == (memory[0] == memory[1])  # type: ignore[arg-type]
