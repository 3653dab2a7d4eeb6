"""Print (never assert) predicted against measured throughput on the development set.

Every run of tests/reference/published_runs.yaml and Megatron-LM 2021 Table 1 is scored with the
shipped profiles and the framework's assumptions, with no per-row constants; each row prints
the measured and predicted value of its own metric and the signed error (predicted / measured
- 1: positive means autoplace is optimistic).  Then a summary per GPU family, and the pairwise
ranking: for every two runs of the same model on the same cluster, whether the predicted order
matches the measured one.  Last, the headline development figure: the leave-one-source-out
error (benchmarks/loso.py), every run predicted by calibration factors fitted without its source.

Run: python benchmarks/published.py [--json] [--family h100]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace.validation import PublishedRun, load_runs, megatron_runs, predict  # noqa: E402
from benchmarks.loso import print_loso, score_runs, to_json  # noqa: E402

RUNS = REPO / "tests" / "reference" / "published_runs.yaml"
MEGATRON = REPO / "tests" / "reference" / "megatron2021_table1.yaml"
OOM = REPO / "tests" / "reference" / "published_oom.yaml"


def score(runs: list[PublishedRun]) -> list[dict[str, object]]:
    out = []
    for run in runs:
        value, ev = predict(run)
        out.append({"id": run.id, "family": run.family, "framework": run.framework, "metric": run.metric,
                    "measured": run.measured, "predicted": value, "error": value / run.measured - 1,
                    "fits": ev.fits, "mfu": ev.mfu, "step_time_s": ev.step_time_s, "group": "/".join(map(str, run.group))})
    return out


def ranking(rows: list[dict[str, object]]) -> list[tuple[float, bool]]:
    """Every pair of runs of the same model and cluster (same metric, measured apart): the
    predicted gap (|log| of the predicted ratio) and whether the predicted order is the measured one."""
    pairs = []
    by_group: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        by_group.setdefault(str(row["group"]), []).append(row)
    for members in by_group.values():
        for a, b in itertools.combinations(members, 2):
            if a["metric"] != b["metric"] or a["measured"] == b["measured"]:
                continue
            gap = abs(float(np.log(float(a["predicted"]) / float(b["predicted"]))))  # type: ignore[arg-type]
            pairs.append((gap, (a["measured"] > b["measured"]) == (a["predicted"] > b["predicted"])))  # type: ignore[operator]
    return pairs


def by_gap(pairs: list[tuple[float, bool]], gaps: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05, 0.08)) -> str:
    """How often the predicted order is right above each predicted gap (autoplace/ranking.py's
    PAIR_RESOLUTION reads this line)."""
    said = []
    for x in gaps:
        above = [ok for gap, ok in pairs if gap >= x]
        said.append(f">= {x:.0%}: {sum(above)} of {len(above)}")
    return "pairs by predicted gap, ordered as measured: " + "; ".join(said)


def summary(rows: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    groups: dict[str, list[float]] = {"all": []}
    for row in rows:
        groups.setdefault(str(row["family"]), []).append(float(row["error"]))  # type: ignore[arg-type]
        groups["all"].append(float(row["error"]))  # type: ignore[arg-type]
    return {name: {"n": len(e), "mape": float(np.mean(np.abs(e))), "mean_signed": float(np.mean(e)),
                   "worst": float(max(e, key=abs))} for name, e in groups.items()}


def no_recompute_section(console: Console, runs: list[PublishedRun]) -> None:
    """Runs without activation checkpointing (at the micro-batch they ran) and configurations their
    source reports out of memory: does autoplace predict they fit, and how close to capacity?"""
    edge = [r for r in runs if r.plan.recompute_mode == "none"]
    ooms = load_runs(OOM)
    table = Table(title="Memory at the capacity edge: runs without checkpointing, and published OOMs")
    for col in ("run", "fw", "mbs", "predicted GiB", "capacity GiB", "measured GiB", "ran", "predicted fits"):
        table.add_column(col, justify="left" if col in ("run", "fw") else "right")
    fits = ok_oom = 0
    gaps: list[float] = []
    for run in edge + ooms:
        ev = predict(run)[1]
        used, cap = ev.memory["total"] / 2**30, ev.memory["capacity"] / 2**30
        measured = (run.raw.get("measured") or {}).get("memory_GiB")
        ran = run.metric != "oom"
        fits += ran and ev.fits
        ok_oom += (not ran) and not ev.fits
        if measured and ran:
            gaps.append(used / float(measured) - 1)
        table.add_row(run.id[:60], run.framework, str(run.plan.mbs), f"{used:.1f}", f"{cap:.1f}",
                      f"{measured:.1f}" if measured else "-", "yes" if ran else "OOM", "yes" if ev.fits else "NO")
    console.print(table)
    memory = (f"; predicted / measured memory - 1 over {len(gaps)}: mean absolute {np.mean(np.abs(gaps)):.1%}, "
              f"signed {np.mean(gaps):+.1%}") if gaps else "; none of them publishes its memory"
    console.print(f"runs without checkpointing predicted to fit: {fits} of {len(edge)}; published OOMs predicted "
                  f"not to fit: {ok_oom} of {len(ooms)}{memory}")
    # every run that publishes its memory (torchtitan's: max reserved, which the caching allocator
    # grows beyond what the step needs when memory is not short)
    published = [(run, float(run.raw["measured"]["memory_GiB"])) for run in runs
                 if (run.raw.get("measured") or {}).get("memory_GiB")]
    if published:
        all_gaps = [predict(run)[1].memory["total"] / 2**30 / gib - 1 for run, gib in published]
        console.print(f"all runs publishing memory ({len(all_gaps)}): predicted / measured - 1 mean absolute "
                      f"{np.mean(np.abs(all_gaps)):.1%}, signed {np.mean(all_gaps):+.1%}, worst {max(all_gaps, key=abs):+.1%}")


def small_models_section(console: Console, runs: list[PublishedRun], rows: list[dict[str, object]]) -> None:
    """Small models on one node (hidden <= 2,048): where fixed per-step and per-kernel costs weigh most."""
    small = {r.id for r in runs if r.cluster.gpus <= r.cluster.pools[0].gpus_per_node and getattr(r.model, "hidden", 1 << 30) <= 2048}
    errors = [float(row["error"]) for row in rows if row["id"] in small]  # type: ignore[arg-type]
    if not errors:
        console.print("small models on one node: none in the development set")
        return
    console.print(f"small models on one node (hidden <= 2,048): {len(errors)} runs, mean absolute error "
                  f"{np.mean(np.abs(errors)):.1%}, mean signed {np.mean(errors):+.1%}, worst {max(errors, key=abs):+.1%}")


def small_models_by_source(console: Console, runs: list[PublishedRun], rows: list[dict[str, object]]) -> None:
    """The small single-node runs per source (the run id's first word: flashattn, llmc) and per hidden
    size, so a term that helps one trainer's runs and hurts another's shows."""
    small = {r.id: r.model.hidden for r in runs  # type: ignore[union-attr]
             if r.cluster.gpus <= r.cluster.pools[0].gpus_per_node and getattr(r.model, "hidden", 1 << 30) <= 2048}
    groups: dict[str, list[float]] = {}
    for row in rows:
        if row["id"] in small:
            err = float(row["error"])  # type: ignore[arg-type]
            groups.setdefault(f"source {str(row['id']).split('-')[0]}", []).append(err)
            groups.setdefault(f"hidden {small[str(row['id'])]}", []).append(err)
    said = [f"{name} ({len(e)}) {np.mean(e):+.1%}" for name, e in sorted(groups.items())]
    if said:
        console.print("small models, mean signed by source and hidden size: " + "; ".join(said))


SHARD_BUCKETS = ((1, 8, "sharded DP, 1-8 ranks"), (9, 64, "sharded DP, 9-64 ranks"),
                 (65, 255, "sharded DP, 65-255 ranks"), (256, 1023, "sharded DP, 256-1023 ranks"),
                 (1024, 10**9, "sharded DP, 1024+ ranks"))


def regime(run: PublishedRun) -> str:
    """The regime a run belongs to: fully sharded data parallel (ZeRO-3 / FSDP) by the ranks one
    shard group spans, else "not sharded (ZeRO 0-2)"."""
    plan = run.plan
    if plan.zero < 3:
        return "not sharded (ZeRO 0-2)"
    ranks = plan.dp_shard * plan.cp  # torchtitan and Megatron shard over dp_shard x cp
    return next(label for lo, hi, label in SHARD_BUCKETS if lo <= ranks <= hi)


def model_parallel(run: PublishedRun) -> bool:
    """Whether a run splits its layers (tensor or pipeline parallel): the 3-D side of a pair."""
    return run.plan.tp * run.plan.pp > 1


def regime_summary(runs: list[PublishedRun], rows: list[dict[str, object]]) -> list[tuple[str, int, float, float]]:
    """(regime, runs, mean absolute error, mean signed error) per sharding regime and GPU family."""
    groups: dict[str, list[float]] = {}
    for run, row in zip(runs, rows, strict=True):
        error = float(row["error"])  # type: ignore[arg-type]
        groups.setdefault(regime(run), []).append(error)
        groups.setdefault(f"family {run.family}", []).append(error)
    order = [label for _, _, label in SHARD_BUCKETS] + ["not sharded (ZeRO 0-2)"]
    names = [g for g in order if g in groups] + sorted(g for g in groups if g not in order)
    return [(g, len(groups[g]), float(np.mean(np.abs(groups[g]))), float(np.mean(groups[g]))) for g in names]


def sharded_vs_3d(runs: list[PublishedRun], rows: list[dict[str, object]]) -> tuple[int, int]:
    """(pairs ordered as measured, pairs) over runs of the same model and cluster where one is
    fully sharded data parallel alone (ZeRO-3, no TP/PP) and the other splits its layers."""
    good = total = 0
    by_group: dict[tuple[str, str, int, float], list[tuple[PublishedRun, dict[str, object]]]] = {}
    for run, row in zip(runs, rows, strict=True):
        by_group.setdefault(run.group, []).append((run, row))
    for members in by_group.values():
        for (ra, a), (rb, b) in itertools.combinations(members, 2):
            sharded = {ra.plan.zero >= 3 and not model_parallel(ra), rb.plan.zero >= 3 and not model_parallel(rb)}
            if sharded != {True, False} or not (model_parallel(ra) or model_parallel(rb)):
                continue
            if a["metric"] != b["metric"] or a["measured"] == b["measured"]:
                continue
            total += 1
            good += (a["measured"] > b["measured"]) == (a["predicted"] > b["predicted"])  # type: ignore[operator]
    return good, total


def print_regimes(console: Console, runs: list[PublishedRun], rows: list[dict[str, object]]) -> None:
    """The per-regime table and the sharded-vs-3-D ranking."""
    table = Table(title="By regime (error = predicted / measured - 1)")
    for col in ("regime", "runs", "mean |error|", "mean signed"):
        table.add_column(col, justify="left" if col == "regime" else "right")
    for name, n, mae, signed in regime_summary(runs, rows):
        table.add_row(name, str(n), f"{mae:.1%}", f"{signed:+.1%}")
    console.print(table)
    good, pairs = sharded_vs_3d(runs, rows)
    console.print(f"sharded-vs-3-D pairs (same model and cluster): {good} of {pairs} ordered as measured")


def sharded_at_scale_section(console: Console, runs: list[PublishedRun], rows: list[dict[str, object]]) -> None:
    """Fully sharded runs over 256 ranks or more, with what sets their exposure: tokens per GPU per
    micro-batch (the compute a block's gathers hide under) and the network each GPU gets."""
    table = Table(title="Sharded DP at 256+ ranks: tokens per GPU and network per GPU (error = predicted / measured - 1)")
    for col in ("run", "ranks", "tokens/GPU", "Gb/s per GPU", "measured", "predicted", "error"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for run, row in zip(runs, rows, strict=True):
        ranks = run.plan.dp_shard * run.plan.cp
        if run.plan.zero < 3 or ranks < 256:
            continue
        tokens = run.plan.mbs * run.model.seq_len
        gbps = run.cluster.pools[0].inter_Bps_per_gpu * 8 / 1e9
        table.add_row(str(row["id"])[:60], str(ranks), str(tokens), f"{gbps:.3g}", f"{row['measured']:.4g}",
                      f"{row['predicted']:.4g}", f"{row['error']:+.1%}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--family", default=None, help="only this GPU family (a100, h100, ...)")
    args = parser.parse_args()
    skipped: list[tuple[str, str]] = []
    runs = load_runs(RUNS, skipped) + megatron_runs(MEGATRON)
    if args.family:
        runs = [r for r in runs if r.family == args.family]
    rows = score(runs)
    ordered = ranking(rows)
    good, pairs = sum(ok for _, ok in ordered), len(ordered)
    stats = summary(rows)
    loso = score_runs(runs, rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": stats, "ranking": {"ordered": good, "pairs": pairs},
                          "leave_one_source_out": to_json(loso)}, indent=1))
        return
    console = Console(width=160)
    table = Table(title="Development set: predicted vs measured (error = predicted / measured - 1)")
    for col in ("run", "fw", "metric", "measured", "predicted", "error", "fits"):
        table.add_column(col, justify="left" if col in ("run", "fw", "metric") else "right")
    for row in rows:
        table.add_row(str(row["id"])[:60], str(row["framework"]), str(row["metric"]).replace("_per_gpu", "/gpu"),
                      f"{row['measured']:.4g}", f"{row['predicted']:.4g}", f"{row['error']:+.1%}",
                      "yes" if row["fits"] else "NO")
    console.print(table)
    summ = Table(title="By GPU family")
    for col in ("family", "runs", "MAPE", "mean signed", "worst"):
        summ.add_column(col, justify="right")
    for name, s in stats.items():
        summ.add_row(name, str(s["n"]), f"{s['mape']:.1%}", f"{s['mean_signed']:+.1%}", f"{s['worst']:+.1%}")
    console.print(summ)
    console.print(f"pairwise ranking: {good} of {pairs} pairs ordered as measured ({good / max(pairs, 1):.0%}); "
                  f"{sum(not r['fits'] for r in rows)} of {len(rows)} runs predicted not to fit")
    console.print(by_gap(ordered))
    no_recompute_section(console, runs)
    small_models_section(console, runs, rows)
    small_models_by_source(console, runs, rows)
    print_regimes(console, runs, rows)
    sharded_at_scale_section(console, runs, rows)
    print_loso(console, loso)


if __name__ == "__main__":
    main()
