"""Calibration on measured CPU trials: step-time prediction error before and after.

Runs (or resumes) a tune study of a few plans of the tiny Llama on two local gloo processes,
fits compute_scale and bandwidth_scale to the measured step times, and prints per trial the
prediction before and after, plus leave-one-out errors (each trial predicted by a fit that did
not see it) -- the honest figure when there are only a few trials.  Prints tables; never
pass/fail on absolute time (docs/ARCHITECTURE.md, benchmarks/).

    python benchmarks/calibration.py [--out DIR] [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace.calibrate import errors, fit, observations_from_study, predict, write_calibration  # noqa: E402
from autoplace.cost.assumptions import DEFAULT  # noqa: E402
from autoplace.tune import print_report, run_tune  # noqa: E402

MODEL = REPO / "examples" / "models" / "tiny-llama.json"
CLUSTER = REPO / "examples" / "clusters" / "cpu-2.yaml"
PLANS = ["dp=2,zero=0,mbs=4", "dp=2,zero=3,mbs=4", "dp=2,zero=3,mbs=1", "tp=2,mbs=4", "pp=2,mbs=2,schedule=gpipe",
         "pp=2,mbs=1", "dp=2,zero=1,mbs=4,recompute=full", "dp=2,zero=0,mbs=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("autoplace-calibration-bench"))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from autoplace.cost.layers import layer_table
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.model import load_model

    m = load_model(MODEL)
    cands = [build_plan(parse_plan_string(p), world=2, blocks=layer_table(m).blocks,
                        global_batch=m.training.global_batch).to_string() for p in PLANS]
    report = run_tune(MODEL, CLUSTER, trials=len(cands), candidates=cands, out_dir=args.out, timeout_s=300,
                      steps=args.steps, study="calibration-bench")
    print_report(report)
    obs = observations_from_study(MODEL, CLUSTER, report.storage, "calibration-bench")
    cal = fit(obs)
    write_calibration(cal, args.out / "calibration.yaml")
    table = Table(title=f"step time on {len(obs)} measured CPU trials (compute_scale={cal.assumptions.compute_scale:.3g}, "
                        f"bandwidth_scale={cal.assumptions.bandwidth_scale:.3g})")
    for col in ("trial", "measured s", "before s", "err before", "after s", "err after", "leave-one-out err"):
        table.add_column(col, justify="right")
    loo = []
    for i, o in enumerate(obs):
        rest = obs[:i] + obs[i + 1:]
        held = abs(predict(o, fit(rest).assumptions) - o.measured_s) / o.measured_s if rest else float("nan")
        loo.append(held)
        before, after = predict(o, DEFAULT), predict(o, cal.assumptions)
        table.add_row(o.label, f"{o.measured_s:.4f}", f"{before:.4f}", f"{abs(before - o.measured_s) / o.measured_s:.1%}",
                      f"{after:.4f}", f"{abs(after - o.measured_s) / o.measured_s:.1%}", f"{held:.1%}")
    c = Console()
    c.print(table)
    b, a = errors(obs, DEFAULT), errors(obs, cal.assumptions)
    c.print(f"mean |error| before {b['mean_abs_rel']:.1%} -> after {a['mean_abs_rel']:.1%} "
            f"(leave-one-out {sum(loo) / len(loo):.1%}); 95% band x{cal.band[0]:.2f}..x{cal.band[1]:.2f}")


if __name__ == "__main__":
    main()
