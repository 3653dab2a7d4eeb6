"""Print (never assert) how fast `autoplace solve` proves its optimum, per case (issue 3).

For each case: configurations enumerated, kept after bounding, status, seconds to the top-3
(median of --repeat runs), and the exhaustive back end's throughput in configurations per
second of the vectorized evaluator on the same space.

Run: python benchmarks/solve_speed.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace.cost.evaluate import evaluate_batch  # noqa: E402
from autoplace.cost.layers import layer_table  # noqa: E402
from autoplace.specs.cluster import cluster_from_dict  # noqa: E402
from autoplace.specs.model import load_model  # noqa: E402
from solvers.problem import Budget, Problem  # noqa: E402
from solvers.registry import get_solver  # noqa: E402
from solvers.space import enumerate_configs, to_candidates  # noqa: E402


def cluster(nodes: int, gpu: str, intra: str, inter: str) -> object:
    return cluster_from_dict({"name": f"{nodes}x8 {gpu}", "nodes": nodes, "gpus_per_node": 8, "gpu": gpu,
                              "intra_node": intra, "inter_node": inter})


CASES = [  # the cases named in issue 3
    ("Llama-3-8B", "llama-3-8b.json", cluster(1, "h100-sxm5-80gb", "nvlink4", "ib-ndr")),
    ("Llama-3-70B", "llama-3-70b.json", cluster(8, "h100-sxm5-80gb", "nvlink4", "ib-ndr")),
    ("GPT-3 175B", "gpt-3-175b.json", cluster(128, "a100-sxm4-80gb", "nvlink3", "ib-hdr")),
    ("Mixtral 8x7B", "hf/mixtral-8x7b/config.json", cluster(32, "h100-sxm5-80gb", "nvlink4", "ib-ndr")),
    ("Llama-3-405B", "llama-3-405b.json", cluster(2048, "h100-sxm5-80gb", "nvlink4", "ib-ndr")),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    head = f"{'case':14s} {'GPUs':>6s} {'configs':>8s} {'kept':>5s} {'status':>8s} {'median s':>9s} {'step s':>8s} {'eval plans/s':>13s}"
    print(head)
    print("-" * len(head))
    for name, path, c in CASES:
        model = load_model(REPO / "examples" / "models" / path)
        times, result = [], None
        for _ in range(args.repeat):
            t = time.perf_counter()
            result = get_solver("cpsat").solve(Problem(model, c, top_k=3), Budget(time_limit_s=args.time_limit))
            times.append(time.perf_counter() - t)
        assert result is not None
        configs = enumerate_configs(Problem(model, c))
        table = layer_table(model)
        cand = to_candidates(configs, table)
        t = time.perf_counter()
        evaluate_batch(table, c, cand, model.training.recipe())
        rate = len(configs) / (time.perf_counter() - t)
        kept = result.notes[0].split(", ")[1].split()[0] if result.notes else "?"
        step = f"{result.plans[0].step_time_s:.3f}" if result.plans else "-"
        print(f"{name:14s} {c.gpus:6d} {len(configs):8d} {kept:>5s} {result.status:>8s} "
              f"{statistics.median(times):9.2f} {step:>8s} {rate:13.0f}")


if __name__ == "__main__":
    main()
