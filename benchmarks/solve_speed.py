"""Print (never assert) how fast `autoplace solve` proves its optimum, pinned to two cores.

For each case (issues 12 and 26): wall seconds of the whole command (a fresh process: imports, input
parsing, the solve, the report) and the solve's own seconds, median of --repeat runs; the
configurations enumerated and kept after bounding, the CP-SAT model's size, the status, and
the share of the solve per phase (enumerate, score, bound, build, search, rescore).  CPU
seconds (the command's, all its threads) are printed beside the wall time: on a shared machine
the wall time grows with the load, the CPU time much less.

The process pins itself (and so its children) to CPUs 0 and 1 with ``os.sched_setaffinity``,
the laptop or login node users plan on.  It byte-compiles autoplace first, as ``pip install``
does for an installed package, so a machine that sets PYTHONDONTWRITEBYTECODE (these sandboxes
do) is not timed compiling ~60 modules from source on every run (about 0.05-0.1 s more).
Run: python benchmarks/solve_speed.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = [  # (name, model file from the repository's root, cluster shorthand): the cases of issue 12,
    # then the MoE stacks with a dense prefix of issue 26 (two block kinds: tables by first block)
    ("Llama-3-8B / 8 H100", "examples/models/llama-3-8b.json", "1x8xh100"),
    ("Llama-3-70B / 64 H100", "examples/models/llama-3-70b.json", "8x8xh100"),
    ("GPT-3 175B / 1,024 A100", "examples/models/gpt-3-175b.json", "128x8xa100"),
    ("Mixtral-8x7B / 256 H100", "examples/models/hf/mixtral-8x7b/config.json", "32x8xh100"),
    ("Llama-3-405B / 16,384 H100", "examples/models/llama-3-405b.json", "2048x8xh100"),
    ("DeepSeek-V2-Lite / 32 H100", "examples/models/hf/deepseek-v2-lite/config.json", "4x8xh100"),
    ("DeepSeek-V3 / 256 H100", "tests/data/hf/deepseek-v3.json", "32x8xh100"),
    ("DeepSeek-V3 / 2,048 H100", "tests/data/hf/deepseek-v3.json", "256x8xh100"),
]
PHASES = ("enumerate", "score", "bound", "build", "search", "rescore")


def run_once(model: str, cluster: str, args: argparse.Namespace) -> tuple[float, float, dict]:
    """One `autoplace solve --json` in a fresh process: (wall seconds, CPU seconds of the
    process and its threads -- what a shared, loaded machine does not inflate -- and its JSON
    document)."""
    cmd = [sys.executable, "-m", "autoplace.cli", "solve", str(REPO / model), cluster, "--json", "--top", "3",
           "--time-limit", str(args.time_limit), "--framework", args.framework,
           *(x for feature in args.allow for x in ("--allow", feature))]
    start, before = time.perf_counter(), os.times()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    wall, after = time.perf_counter() - start, os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return wall, cpu, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=10.0, help="as solve's (default 10 s, solve's own)")
    parser.add_argument("--framework", default="any", help="as solve's --framework (default any, as users run it)")
    parser.add_argument("--allow", action="append", default=[],
                        help="as solve's --allow (repeatable), e.g. compress: the space with the opt-in knobs")
    parser.add_argument("--json", action="store_true", help="machine-readable rows")
    parser.add_argument("--only", default="", help="the cases whose name contains this (e.g. DeepSeek)")
    args = parser.parse_args()
    for package in ("autoplace", "solvers", "hardware_profiles"):
        compileall.compile_dir(REPO / package, quiet=1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0, 1} & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = []
    for name, model, cluster in (c for c in CASES if args.only in c[0]):
        runs = [run_once(model, cluster, args) for _ in range(args.repeat)]
        walls = [w for w, _, _ in runs]
        doc = runs[len(runs) // 2][2]
        solve = statistics.median(d["solve_seconds"] for _, _, d in runs)
        phases = doc.get("phases_s", {})
        total = sum(phases.values()) or 1.0
        scored = next((n for n in doc["notes"] if "configurations scored" in n), "")
        rows.append({"case": name, "wall_s": statistics.median(walls), "solve_s": solve, "status": doc["status"],
                     "cpu_s": statistics.median(c for _, c, _ in runs),
                     "gap": doc.get("gap"),
                     "configs": scored.split()[0] if scored else "?", "kept": scored.split(", ")[1].split()[0] if scored else "?",
                     "phase_share": {p: phases.get(p, 0.0) / total for p in PHASES},
                     "cpsat_vars": doc.get("cpsat_model", {}).get("variables"),
                     "step_s": doc["plans"][0]["step_time_s"] if doc["plans"] else None})
    if args.json:
        print(json.dumps({"cpus": cpus, "repeat": args.repeat, "rows": rows}, indent=2))
        return
    print(f"pinned to {cpus} CPU(s); median of {args.repeat}; --framework {args.framework}; byte-compiled")
    head = (f"{'case':28s} {'wall s':>7s} {'cpu s':>6s} {'solve s':>8s} {'status':>8s} {'gap':>6s} {'configs':>8s} {'kept':>5s} "
            + f"{'vars':>6s} " + " ".join(f"{p[:6]:>6s}" for p in PHASES) + f" {'step s':>8s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        shares = " ".join(f"{100 * r['phase_share'][p]:5.0f}%" for p in PHASES)
        step = f"{r['step_s']:.3f}" if r["step_s"] is not None else "-"
        gap = f"{100 * r['gap']:.2f}%" if r["gap"] is not None else "-"
        print(f"{r['case']:28s} {r['wall_s']:7.2f} {r['cpu_s']:6.2f} {r['solve_s']:8.2f} {r['status']:>8s} {gap:>6s} {r['configs']:>8s} "
              f"{r['kept']:>5s} {r['cpsat_vars'] or '-':>6} {shares} {step:>8s}")


if __name__ == "__main__":
    main()
