"""Print (never assert) autoplace's memory and communication errors against PyTorch's trackers (issue 6).

Every case builds the model on fake tensors, shards it with FSDP2 (optionally HSDP, DTensor
TP or expert parallelism) over a fake process group, runs a training step under FSDPMemTracker and counts the
collectives (autoplace.fidelity); the prediction is autoplace's evaluation of the
same plan.  Error = (predicted - measured) / measured.  Memory in GiB per device, bytes
sent per device per step in GiB (ring: (n-1)/n of the full buffer, 2(n-1)/n for all-reduce).

Run: python benchmarks/accuracy.py [--quick] [--case SUBSTRING]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace.fidelity.compare import Comparison, compare  # noqa: E402
from autoplace.fidelity.trackers import Setup  # noqa: E402
from autoplace.specs.model import TransformerSpec, load_model  # noqa: E402

GiB = 2**30
MODELS = REPO / "examples" / "models"

# (model file, setup); reshard=True with the root kept gathered is what autoplace's FSDP2
# emitter writes for ZeRO-3, reshard=False for ZeRO-2.
CASES: list[tuple[str, Setup]] = [
    ("llama-3-8b.json", Setup(world=8, precision="bf16-fsdp2")),
    ("llama-3-8b.json", Setup(world=8, precision="bf16-fsdp2", root_reshard=True)),
    ("llama-3-8b.json", Setup(world=8, precision="fp32")),
    ("llama-3-8b.json", Setup(world=8, precision="bf16-fsdp2", reshard=False)),
    ("llama-3-8b.json", Setup(world=16, precision="bf16-fsdp2")),
    ("llama-3-8b.json", Setup(world=64, precision="bf16-fsdp2")),
    ("llama-3-8b.json", Setup(world=64, precision="bf16-fsdp2", dp_replicate=8)),
    ("llama-3-8b.json", Setup(world=64, precision="bf16-fsdp2", tp=8)),
    ("llama-3-70b.json", Setup(world=64, precision="bf16-fsdp2")),
    ("llama-3-70b.json", Setup(world=64, precision="bf16-fsdp2", tp=8)),
    ("gpt-3-175b.json", Setup(world=64, precision="bf16-fsdp2")),
    ("gpt-3-175b.json", Setup(world=64, precision="bf16-fsdp2", tp=8)),
    # Mixtral 8x7B (Hugging Face config): experts sharded by FSDP like dense weights (ep = 1),
    # tokens split evenly over the experts (autoplace.runtime.moe, balanced routing)
    ("hf/mixtral-8x7b/config.json", Setup(world=8, precision="bf16-fsdp2")),
    ("hf/mixtral-8x7b/config.json", Setup(world=64, precision="bf16-fsdp2")),
    # expert parallelism carved from the FSDP ranks: experts/ep experts per rank, FSDP2 over the
    # dp/ep expert-data-parallel group, all-to-all dispatch and combine over the EP group
    ("hf/mixtral-8x7b/config.json", Setup(world=8, precision="bf16-fsdp2", ep=2)),
    ("hf/mixtral-8x7b/config.json", Setup(world=8, precision="bf16-fsdp2", ep=8)),
    ("hf/mixtral-8x7b/config.json", Setup(world=64, precision="bf16-fsdp2", ep=8)),
]
NOT_RUN = {
    "MoE with TP, or EP with HSDP": "the TP plan covers dense MLPs only; EP is carved from a plain FSDP mesh",
}
PEAK_PARTS = ("Sharded Param", "Unsharded Param", "Sharded Grad", "Unsharded Grad", "OptState", "Activation",
              "Temp", "All Gather", "Reduce Scatter", "Buffer", "Inputs")


def print_case(name: str, c: Comparison, seconds: float) -> None:
    print(f"\n{name}  [{c.setup.label()}, seq {c.spec.seq_len}]  ({seconds:.0f} s)")
    print(f"  {'quantity':18s} {'predicted':>10s} {'measured':>10s} {'error':>9s}  how matched")
    for r in c.rows:
        err = f"{100 * r.error:+8.2f}%" if abs(r.error) < 1e6 else "     n/a"
        print(f"  {r.quantity:18s} {r.predicted / GiB:10.3f} {r.measured / GiB:10.3f} {err}  {r.note}")
    peak = c.measurement.peak
    parts = ", ".join(f"{k} {peak[k] / GiB:.2f}" for k in PEAK_PARTS if peak.get(k))
    print(f"  tracker peak {peak.get('Total', 0) / GiB:.2f} GiB = {parts}")
    own = c.measurement.category_peak
    print("  category maxima " + ", ".join(f"{k} {own[k] / GiB:.2f}" for k in PEAK_PARTS if own.get(k)))
    mem = c.evaluation.memory
    print("  autoplace      " + ", ".join(f"{k} {mem[k] / GiB:.2f}" for k in
                                          ("params", "grads", "optimizer", "activations", "buffers", "reserve")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first case")
    parser.add_argument("--case", default="", help="run the cases whose model file or label contains this")
    args = parser.parse_args(argv)
    cases = CASES[:1] if args.quick else [(f, s) for f, s in CASES if args.case in f or args.case in s.label()]
    for file, setup in cases:
        spec = load_model(MODELS / file)
        assert isinstance(spec, TransformerSpec)
        start = time.perf_counter()
        result = compare(spec, setup)
        print_case(spec.name, result, time.perf_counter() - start)
    print("\nnot run:")
    for name, why in NOT_RUN.items():
        print(f"  {name}: {why}")


if __name__ == "__main__":
    main()
