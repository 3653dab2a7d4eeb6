"""Print (never assert) what per-layer decisions buy on memory-tight cases (issue 3).

"Uniform" is the best plan over the whole configuration space with the same recompute
mode on every layer and an even layer split (the vectorized evaluator, exhaustively);
"CP-SAT" is the solver's plan, free to split unevenly and to recompute per layer.

Run: python benchmarks/per_layer_gain.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace.cost.evaluate import evaluate_batch  # noqa: E402
from autoplace.cost.layers import layer_table  # noqa: E402
from autoplace.specs.cluster import cluster_from_dict  # noqa: E402
from autoplace.specs.model import load_model  # noqa: E402
from solvers.problem import Budget, Problem  # noqa: E402
from solvers.registry import get_solver  # noqa: E402
from solvers.space import enumerate_configs, to_candidates  # noqa: E402


def cluster(nodes: int, gpu: str) -> object:
    return cluster_from_dict({"name": f"{nodes}x8 {gpu}", "nodes": nodes, "gpus_per_node": 8, "gpu": gpu,
                              "intra_node": "nvlink3", "inter_node": "ib-hdr"})


CASES = [
    ("Llama-3-70B / 64 A100-40GB", "llama-3-70b.json", cluster(8, "a100-sxm4-40gb")),
    ("GPT-3 175B / 128 A100-80GB", "gpt-3-175b.json", cluster(16, "a100-sxm4-80gb")),
]


def best_uniform(model: object, c: object) -> tuple[float, str]:
    problem = Problem(model, c)  # type: ignore[arg-type]
    configs = enumerate_configs(problem)
    table = layer_table(model)  # type: ignore[arg-type]
    best, label = np.inf, "-"
    for mode, name in enumerate(("none", "selective", "full")):
        batch = evaluate_batch(table, c, to_candidates(configs, table, mode), model.training.recipe())  # type: ignore
        step = np.where(batch.fits, batch.step_time, np.inf)
        i = int(np.argmin(step))
        if step[i] < best:
            cf = configs[i]
            best, label = float(step[i]), f"tp{cf.tp} pp{cf.pp} cp{cf.cp} z{cf.zero} mbs{cf.mbs} {name}"
    return best, label


def main() -> None:
    print(f"{'case':28s} {'uniform s':>10s} {'CP-SAT s':>10s} {'gain':>7s}  CP-SAT plan")
    for name, path, c in CASES:
        model = load_model(REPO / "examples" / "models" / path)
        uniform, label = best_uniform(model, c)
        result = get_solver("cpsat").solve(Problem(model, c, top_k=1), Budget(time_limit_s=60))
        ev = result.plans[0]
        counts = {m: ev.plan.recompute.count(m) for m in ("none", "selective", "full")}
        print(f"{name:28s} {uniform:10.3f} {ev.step_time_s:10.3f} {uniform / ev.step_time_s - 1:7.1%}  "
              f"layers {list(ev.plan.layers_per_stage)} recompute {counts}  (uniform: {label})")


if __name__ == "__main__":
    main()
