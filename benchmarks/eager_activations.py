"""Print (never assert) eager activation memory against PyTorch's MemTracker (issue 35, item 5).

For transformers' LlamaForCausalLM (SDPA) and an MPT-style model (autoplace.fidelity.saved) at
several (batch, seq, hidden, heads, kv heads, ffn, vocab): the bytes one decoder layer keeps for
backward and the activation-side peak of the step (from the loss to the end of the last layer's
backward), measured and predicted, with the signed error (predicted / measured - 1).  Predicted
under accelerate's costing (transformers' modelling code), and with ``--fused-norm`` under a
fused RMSNorm's (torchtitan, Megatron-LM; and what every framework was costed with before
``rmsnorm_upcast_kept``).

At vocabulary 500 (two rows, on purpose) the tracker's peak comes later, in the last layer's
backward, 2-3% above the prediction: by then the head's saved tensors and the loss's workspace are
freed, and what the tracker adds as temporaries is a weight's gradient before autograd accumulates
it (the down projection's, h x f; the head's, held until the tied embedding's arrives) -- the
gradient side, which the state and FSDP reduce-buffer terms cost -- plus, for transformers'
Llama, its composite RMSNorm's backward (about four fp32 h-wide temporaries).  The activation
gradients alone (the block output's, one or two f-wide) stay below what the head freed.  From a
vocabulary of a few times the MLP width on -- every real model -- the loss's moment is the peak.

Run: python benchmarks/eager_activations.py [--fused-norm]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace import frameworks  # noqa: E402
from autoplace.cost.assumptions import DEFAULT  # noqa: E402
from autoplace.evaluation import evaluate  # noqa: E402
from autoplace.fidelity.saved import Shape, measure  # noqa: E402
from autoplace.plan import build_plan  # noqa: E402
from autoplace.specs.cluster import cluster_from_dict  # noqa: E402
from autoplace.specs.model import model_from_dict  # noqa: E402

# (batch, seq, hidden, heads, kv heads, ffn, vocab, layers): MHA and GQA, vocabularies from a
# tenth of the MLP width (the last layer's backward binds) to 50k (the loss binds)
SHAPES = [Shape(2, 128, 256, 4, 2, 688, 1000), Shape(1, 256, 512, 8, 8, 1376, 4000, 3),
          Shape(4, 64, 384, 6, 2, 1024, 50000), Shape(2, 256, 512, 8, 8, 1376, 500, 4),
          Shape(1, 512, 768, 12, 4, 2048, 32000, 2)]
CLUSTER = cluster_from_dict({"name": "one", "nodes": 1, "gpus_per_node": 1, "gpu": "a100-sxm4-80gb",
                             "intra_node": "nvlink3", "inter_node": "ib-hdr"})


def predicted(family: str, shape: Shape, layers: int, fused_norm: bool) -> dict[str, float]:
    """autoplace's memory of one GPU running ``shape`` with ``layers`` layers (no DDP buckets:
    the tracker files gradient buckets as gradients, and one GPU has none)."""
    spec = model_from_dict(shape.hf_config(family, layers))
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"global_batch": shape.batch})})
    assume = frameworks.get("accelerate").costing(spec, DEFAULT)[1].replace(
        comm_bucket_MiB=0.0, rmsnorm_upcast_kept=not fused_norm)
    plan = build_plan({"dp_shard": 1, "zero": 0, "mbs": shape.batch, "ga": 1}, world=1, blocks=layers,
                      global_batch=shape.batch)
    return evaluate(spec, CLUSTER, plan, assume).memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fused-norm", action="store_true", help="cost RMSNorm as one fused kernel")
    args = parser.parse_args()
    print(f"{'family':6} {'b x s':>8} {'h':>5} {'a/kv':>6} {'ffn':>5} {'vocab':>6} {'L':>2} | "
          f"{'layer B/tok':>11} {'pred':>7} {'err':>7} | {'peak B/tok':>10} {'pred':>8} {'err':>7}")
    for family in ("llama", "mpt"):
        for s in SHAPES:
            if family == "mpt":
                s = Shape(s.batch, s.seq, s.hidden, s.heads, s.kv_heads, 4 * s.hidden, s.vocab, s.layers)
            got = measure(family, s)
            tok = s.batch * s.seq
            base, more = (predicted(family, s, n, args.fused_norm) for n in (s.layers, s.layers + 1))
            layer = more["activations"] - base["activations"]
            peak = base["activations"] + base["buffers"]
            print(f"{family:6} {s.batch:>3}x{s.seq:<4} {s.hidden:>5} {s.heads:>3}/{s.kv_heads:<2} {s.ffn:>5} "
                  f"{s.vocab:>6} {s.layers:>2} | {got.per_layer / tok:>11.0f} {layer / tok:>7.0f} "
                  f"{layer / got.per_layer - 1:>+7.1%} | {got.peak / tok:>10.0f} {peak / tok:>8.0f} {peak / got.peak - 1:>+7.1%}")


if __name__ == "__main__":
    main()
