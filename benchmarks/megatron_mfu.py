"""Print (never assert) predicted vs published throughput for Megatron-LM 2021 Table 1.

Each row's published plan (degrees from Table 1, full recompute, micro-batch 1, interleaved
where the paper says so) is scored with the shipped default profiles and no per-row tuning.
Megatron's TFLOP/s count the recompute forward (Eq. 3), so they are compared with our
``hw_tflops_per_gpu`` (FLOPs actually executed); MFU excludes recompute (PaLM's definition).

Run: python benchmarks/megatron_mfu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import reference, score  # noqa: E402
from tests.test_solve_cases import _published  # noqa: E402


def main() -> None:
    rows = reference("megatron2021_table1.yaml")["cases"]
    print(f"{'case':24s} {'GPUs':>5s} {'pred TF/s':>9s} {'paper TF/s':>10s} {'error':>7s} {'pred MFU':>9s}")
    errors = []
    for case in rows:
        model, cluster, plan = _published(case)
        ev = score(model, cluster, plan)
        measured = case["measured"]["tflops_per_gpu"]
        err = ev.hw_tflops_per_gpu / measured - 1
        errors.append(abs(err))
        print(f"{case['id']:24s} {cluster.gpus:5d} {ev.hw_tflops_per_gpu:9.1f} {measured:10.1f} {err:+7.1%} {ev.mfu:9.1%}")
    print(f"{'mean absolute % error':24s} {'':5s} {'':9s} {'':10s} {sum(errors) / len(errors):7.1%}")


if __name__ == "__main__":
    main()
