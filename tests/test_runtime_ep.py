"""MoE blocks and expert parallelism in the runtime (world 2, gloo, fp32, a tiny MoE via scaled_model).

Bytes: the cost model files 4 all-to-alls per MoE block per micro-batch under "ep" (dispatch and
combine, forward and backward), each of ``top_k * tokens * h`` elements spread over the ep group,
counted like the runtime's counter as ``(ep-1)/ep`` of the input.  Real routing is not balanced:
the dispatch and the combine's backward send this rank's ``top_k * tokens`` rows (fixed), but the
combine and the dispatch's backward send back the rows this rank's experts *received*, which vary.
What every rank received sums to what every rank sent, so the mean over the ep group's ranks is
the cost model's figure exactly, once the runtime's one extra all-to-all per block and micro-batch
(the per-expert counts, ``experts`` int64, that fix the split sizes) is taken off; the busiest rank
sends more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autoplace.cost.layers import layer_table
from autoplace.evaluation import evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.runtime.spec import scaled_model, unsupported_reason
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import TransformerSpec, model_from_dict

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "examples" / "clusters" / "cpu-2.yaml"
SCALE = 0.5
TINY_MOE = {
    "name": "tiny-moe", "layers": 4, "hidden": 128, "ffn_hidden": 344, "heads": 4, "kv_heads": 2, "vocab": 512,
    "seq_len": 32, "ffn": "swiglu", "tied_embeddings": False, "flash_attention": False,
    "moe": {"experts": 4, "top_k": 2, "expert_ffn_hidden": 128, "shared_experts": 1},
    "training": {"global_batch": 8, "precision": "fp32", "optimizer": "adam"},
}


def _full() -> TransformerSpec:
    return model_from_dict(TINY_MOE, source="<tiny moe>")  # type: ignore[return-value]


def _plan(model: TransformerSpec, text: str):
    return build_plan(parse_plan_string(text), world=2, blocks=layer_table(model).blocks,
                      global_batch=model.training.global_batch)


def test_scale_shrinks_experts_like_the_ffn() -> None:
    s = scaled_model(_full(), SCALE)
    assert s.moe is not None and (s.moe.experts, s.moe.top_k, s.moe.shared_experts) == (4, 2, 1)
    assert s.moe.expert_ffn_hidden == 64 and s.ffn_hidden == 172 and s.hidden == 64


def test_expert_parallel_plans_are_supported() -> None:
    assert unsupported_reason(_plan(scaled_model(_full(), SCALE), "dp=2,ep=2,zero=0")) is None


def test_moe_block_is_the_gate_weighted_sum_of_its_top_k_experts() -> None:
    """The sorted dispatch / index_copy combine against a per-token loop over the chosen experts."""
    torch = pytest.importorskip("torch")
    from autoplace.runtime.model import build_model

    torch.manual_seed(0)
    spec = scaled_model(_full(), SCALE)
    moe = build_model(spec).layers["0"].feed_forward  # block 0 routes (no first_dense_layers)
    x = torch.randn(2, 5, spec.hidden)
    flat = x.reshape(-1, spec.hidden)
    gates, chosen = torch.softmax(moe.router(flat), -1).topk(spec.moe.top_k, -1)
    expected = torch.stack([sum(g * moe.experts[str(int(e))](t) for g, e in zip(gs, es, strict=True))
                            for t, gs, es in zip(flat, gates, chosen, strict=True)]) + moe.shared_experts(flat)
    torch.testing.assert_close(moe(x), expected.view_as(x))


# dp=2 holds each replica's experts on one rank (DDP ignores them); zero=3 shards the dense part with FSDP2
# and the experts on their own (size-1) edp mesh; cp=2 carves ep from the context-parallel ranks.  mbs is
# chosen so all three share one single-process reference run (4 rows x 2 micro-batches).
@pytest.mark.slow
@pytest.mark.parametrize("text", ["dp=2,ep=2,zero=0,mbs=2", "dp=2,ep=2,zero=3,mbs=2", "cp=2,ep=2,mbs=4"],
                         ids=["ddp", "fsdp2-zero3", "cp"])
def test_expert_parallel_matches_single_process(text: str) -> None:
    pytest.importorskip("torch")
    from autoplace.verify import run_verify

    m = scaled_model(_full(), SCALE)  # pre-scaled: verify launches at scale 1
    report = run_verify(m, _plan(m, text), steps=5, world=2)
    assert report.ok, report.detail
    assert report.loss_rel_err <= 1e-5 and report.param_rel_err <= 1e-5


@pytest.mark.slow
def test_ep_bytes_average_to_the_cost_model(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from autoplace.runtime.comms import ring_bytes
    from autoplace.runtime.launch import run_local

    full, m = _full(), scaled_model(_full(), SCALE)
    plan = _plan(m, "dp=2,ep=2,zero=0,mbs=2")
    out = run_local(full, plan, tmp_path, timeout_s=180, steps=1, warmup=1, scale=SCALE)
    assert out.ok, out.error
    per_rank = [r["ep"] for r in out.result["ring_bytes_by_rank"]]
    assert m.moe is not None
    blocks = sum(m.moe.is_moe_layer(i) for i in range(m.layers))
    counts = blocks * plan.grad_accum * ring_bytes("all_to_all", 8 * m.moe.experts, plan.ep)
    predicted = evaluate(m, load_cluster(CLUSTER), plan).comm["ep"]
    tokens = plan.mbs * m.seq_len
    assert predicted == pytest.approx(4 * blocks * plan.grad_accum * ring_bytes(
        "all_to_all", m.moe.top_k * tokens * m.hidden * 4, plan.ep))
    assert sum(per_rank) / len(per_rank) - counts == pytest.approx(predicted, abs=1)  # integer rounding per rank
    assert max(per_rank) >= predicted + counts
    # dense weights are all-reduced over dp (the experts are not: edp = dp / ep = 1), as the cost model says
    assert out.result["collectives"]["ring_bytes_by_dim"]["dp"] == pytest.approx(
        evaluate(m, load_cluster(CLUSTER), plan).comm["dp"])
