"""Print (never assert) how fast the cost model is.

1. ``autoplace evaluate`` wall time in a fresh process, imports included, and whether torch
   was imported on that path.
2. The vectorized evaluator's throughput on ~1e5 candidate plans.

Run: python benchmarks/evaluate_speed.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples/models/llama-3-70b.json"
CLUSTER = REPO / "examples/clusters/8x8-h100.yaml"


def cli_wall() -> tuple[float, bool]:
    code = (f"import sys, runpy; sys.argv=['autoplace','evaluate',{str(MODEL)!r},{str(CLUSTER)!r},'--plan',"
            "'tp=8,pp=4,zero=1','--json'];"
            "import autoplace.cli as c\ntry:\n c.app()\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', file=sys.stderr)")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    return time.perf_counter() - t, "TORCH" in out.stderr and "NOTORCH" not in out.stderr


def throughput(n_target: int = 100_000) -> tuple[int, float]:
    sys.path.insert(0, str(REPO))
    from autoplace.cost.evaluate import evaluate_batch
    from autoplace.cost.layers import layer_table
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model
    from solvers.base import Problem
    from solvers.space import enumerate_configs, to_candidates

    model, cluster = load_model(MODEL), load_cluster(CLUSTER)
    configs = enumerate_configs(Problem(model, cluster))
    table = layer_table(model)
    reps = max(1, n_target // len(configs))
    chunk = to_candidates(configs, table)
    t = time.perf_counter()
    for _ in range(reps):
        evaluate_batch(table, cluster, chunk, model.training.recipe())
    return reps * len(configs), time.perf_counter() - t


if __name__ == "__main__":
    wall, torch_loaded = cli_wall()
    n, sec = throughput()
    print(f"{'measure':40s} {'value':>14s}")
    print(f"{'autoplace evaluate wall (s)':40s} {wall:14.3f}")
    print(f"{'torch imported on that path':40s} {str(torch_loaded):>14s}")
    print(f"{'candidates evaluated':40s} {n:14d}")
    print(f"{'plans / second (vectorized)':40s} {n / sec:14.0f}")
