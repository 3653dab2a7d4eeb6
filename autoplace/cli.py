"""The ``autoplace`` command line: a thin layer over the library.

Exit codes (docs/ARCHITECTURE.md): 0 success, 2 bad input (one line, no traceback without --debug),
3 infeasible.  Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from autoplace.cli_inputs import (
    ClusterOpt,
    ForceOpt,
    FormatOpt,
    GpnOpt,
    GpuOpt,
    InterOpt,
    IntraOpt,
    NodesOpt,
    OptClusterArg,
    TraceDtype,
    TraceInput,
    cluster_from_args,
    cluster_ref,
    model_origin_of,
    model_ref,
    output_format,
)
from autoplace.errors import AutoplaceError, SpecError

if TYPE_CHECKING:
    from autoplace.specs.cluster import ClusterSpec

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the best way to place a training job on a cluster.")
log = logging.getLogger("autoplace")
_state = {"debug": False}

ModelArg = Annotated[Path, typer.Argument(metavar="MODEL",
                                          help="model.json (shorthand or layer graph), a Hugging Face config.json, "
                                               "or a Hub id ORG/NAME read from the local Hugging Face cache")]
ClusterArg = Annotated[Path, typer.Argument(metavar="CLUSTER", help="cluster.yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else.")]


SeqOpt = Annotated[int | None, typer.Option("--seq-len", min=1, help="Override the model's training sequence length.")]
BatchOpt = Annotated[int | None, typer.Option("--global-batch", min=1, help="Override the global batch (sequences).")]
CalibrationOpt = Annotated[Path | None, typer.Option("--calibration", help="calibration.yaml written by "
                                                     "`autoplace calibrate` (measured efficiency factors).")]
TokensOpt = Annotated[str | None, typer.Option("--tokens", help="Token budget, e.g. 15T or 300B: print days, "
                                               "GPU-hours and (with a price) cost to train on it.",
                                               rich_help_panel="Time and cost")]
PriceOpt = Annotated[float | None, typer.Option("--price-per-gpu-hour", min=0.0, help="Dollars per GPU-hour "
                                                "(cost = GPU-hours x price).", rich_help_panel="Time and cost")]
LossOpt = Annotated[float | None, typer.Option("--target-loss", min=1e-3, help="Target loss in nats: the critical "
                                               "batch from Kaplan et al. 2020 eq. 1.4 at this loss.",
                                               rich_help_panel="Batch advice")]
NoiseOpt = Annotated[str | None, typer.Option("--noise-scale", help="Measured gradient noise scale in tokens "
                                              "(McCandlish et al. 2018), e.g. 4M: used as the critical batch.",
                                              rich_help_panel="Batch advice")]


class Allow(StrEnum):
    tp_across_nodes = "tp-across-nodes"


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"autoplace {version('autoplace')}")
        except PackageNotFoundError:
            typer.echo("autoplace (not installed: version unknown)")
        raise typer.Exit(0)


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
         verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log diagnostics to stderr.")] = False,
         show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = False) -> None:
    """autoplace: placement search for distributed training."""
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(name)s: %(message)s")


def _fail(exc: BaseException) -> NoReturn:
    """Report ``exc`` as one stderr line and exit with its code (re-raise it under --debug)."""
    if _state["debug"]:
        raise exc
    from autoplace.specs._io import one_line

    code = exc.exit_code if isinstance(exc, AutoplaceError) else 1
    text = str(exc) if isinstance(exc, AutoplaceError) else f"internal error: {exc!r} (rerun with --debug)"
    typer.echo(f"autoplace: error: {one_line(text)}", err=True)
    raise typer.Exit(code)


def _load(model: Path, cluster: Path | Any, seq_len: int | None, global_batch: int | None) -> tuple[Any, Any]:
    """Load both; a GPU without a peak for the model's compute dtype is the cluster's error.

    ``cluster`` is a cluster.yaml (or NODESxGPUSxGPU) path, or a ClusterSpec built from flags.
    """
    from autoplace.specs.cluster import check_compute_dtype
    from autoplace.specs.hub import resolve_model
    from autoplace.specs.model import load_model

    path, repo = resolve_model(model)
    m = load_model(path, overrides={"seq_len": seq_len, "global_batch": global_batch})
    if repo is not None:  # named as the user typed it, not by the snapshot's file
        m = m.model_copy(update={"name": repo})
    c = cluster_from_args(cluster) if isinstance(cluster, Path) else cluster
    check_compute_dtype(c, m.training.recipe().compute_dtype, source=str(cluster) if isinstance(cluster, Path)
                        else c.name)
    return m, c


def _band(cluster: ClusterSpec, calibrated: tuple[float, float] | None) -> tuple[tuple[float, float], str]:
    """The 95% band of a predicted step time: the calibration's when one is given, otherwise
    from the development-set error of the cluster's least well predicted GPU."""
    if calibrated is not None:
        return calibrated, "calibration"
    sigma = max(p.gpu.throughput_error for p in cluster.pools)
    gpu = max(cluster.pools, key=lambda p: p.gpu.throughput_error).gpu.name
    return (math.exp(-1.96 * sigma), math.exp(1.96 * sigma)), f"published runs on {gpu}"


def _calibration(path: Path | None, cluster: Any, framework: str | None = None,
                 force: bool = False) -> tuple[Any, tuple[float, float] | None]:
    """(assumptions, 95% band or None) from a calibration file, or the defaults.

    A file measured on other hardware (GPU, link tiers) or another framework is refused
    unless ``force``; then, and for a file that records nothing, a warning goes to stderr.
    """
    from autoplace.cost.assumptions import DEFAULT

    if path is None:
        return DEFAULT, None
    from autoplace.calibrate import check_applies, load_band, load_calibration

    for warning in check_applies(path, cluster, framework, force=force):
        log.warning(warning)
    return load_calibration(path), load_band(path)


def _json(doc: dict[str, Any]) -> str:
    """Strict JSON: a NaN or infinity is a bug to report, not ``NaN``/``Infinity`` on stdout."""
    return json.dumps(doc, allow_nan=False)


@app.command()
def evaluate(
    model: ModelArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "dp=64,tp=8,pp=16,zero=1,mbs=1,recompute=selective"')],
    cluster: OptClusterArg = None,
    as_json: JsonOpt = False,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    allow: Annotated[list[Allow] | None, typer.Option("--allow", help="Permit a feature off by default.")] = None,
    calibration: CalibrationOpt = None,
    force: ForceOpt = False,
    fmt: FormatOpt = None,
    short: ClusterOpt = None,
    gpu: GpuOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    intra_node: IntraOpt = None,
    inter_node: InterOpt = None,
    tokens: TokensOpt = None,
    price: PriceOpt = None,
    target_loss: LossOpt = None,
    noise_scale: NoiseOpt = None,
) -> None:
    """Score one plan: memory by state against capacity, communication, step time, violations."""
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.evaluation import evaluate as score
        from autoplace.plan import build_plan, parse_plan_string

        m, c = _load(model, cluster_from_args(cluster, short, gpu, nodes, gpus_per_node, intra_node, inter_node),
                     seq_len, global_batch)
        table = layer_table(m)
        p = build_plan(parse_plan_string(plan), world=c.gpus, blocks=table.blocks,
                       global_batch=m.training.global_batch, gpus_per_node=c.gpus_per_node)
        ev = score(m, c, p, _calibration(calibration, c, force=force)[0],
                   allow_tp_across_nodes=Allow.tp_across_nodes in (allow or []))
        out, origin = output_format(fmt, as_json), model_origin_of(model, m, seq_len, global_batch)
        view = _outlook(m, c, ev.tokens_per_s, tokens, price, target_loss, noise_scale)
        if out == "json":
            typer.echo(_json({"schema": "autoplace.evaluation/v1",
                              "model": {"name": m.name, "params": int(table.params), **origin},
                              "cluster": c.summary(), "plan": ev.to_dict(), **view.to_dict()}))
        else:
            from autoplace.report import origin_lines, print_evaluation

            print_evaluation(ev, c, fmt=out, header=origin_lines(m.name, table.params, origin, c))
            _print_lines(view.lines(), out)
    except Exception as exc:  # noqa: BLE001 - every failure, output included, becomes one line and an exit code
        _fail(exc)


@app.command()
def explain(
    model: ModelArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "tp=8,pp=4,zero=1,recompute=selective"')],
    cluster: OptClusterArg = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write the stacked-bar chart here (needs matplotlib).")] = None,
    as_json: JsonOpt = False,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    fmt: FormatOpt = None,
    short: ClusterOpt = None,
    gpu: GpuOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    intra_node: IntraOpt = None,
    inter_node: InterOpt = None,
) -> None:
    """Where every GB and second goes, beside the alternatives that change the most."""
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.evaluation import evaluate as score
        from autoplace.explain import alternatives, plot, print_explanation
        from autoplace.plan import build_plan, parse_plan_string

        m, c = _load(model, cluster_from_args(cluster, short, gpu, nodes, gpus_per_node, intra_node, inter_node),
                     seq_len, global_batch)
        p = build_plan(parse_plan_string(plan), world=c.gpus, blocks=layer_table(m).blocks,
                       global_batch=m.training.global_batch, gpus_per_node=c.gpus_per_node)
        ev = score(m, c, p)
        alts = alternatives(m, c, p, ev)
        if png is not None:
            plot(ev, alts, png)
        out, origin = output_format(fmt, as_json), model_origin_of(model, m, seq_len, global_batch)
        params = layer_table(m).params
        if out == "json":
            typer.echo(_json({"schema": "autoplace.explanation/v1",
                              "model": {"name": m.name, "params": int(params), **origin}, "plan": ev.to_dict(),
                              "alternatives": [{"change": a.change, **a.evaluation.to_dict()} for a in alts],
                              "png": str(png) if png else None}))
        else:
            from autoplace.report import origin_lines

            print_explanation(ev, alts, c, png, fmt=out, header=origin_lines(m.name, params, origin, c))
    except ImportError as exc:
        _fail(AutoplaceError(f"{exc.name} is needed for --png: pip install 'autoplace[plot]'"))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)


class Objective(StrEnum):
    time = "time"
    comm = "comm"
    memory = "memory"
    cost = "cost"


class SolverName(StrEnum):
    cpsat = "cpsat"
    exhaustive = "exhaustive"


@app.command()
def solve(
    model: ModelArg,
    cluster: OptClusterArg = None,
    as_json: JsonOpt = False,
    top: Annotated[int, typer.Option("--top", min=1, max=20, help="How many distinct plans to return.")] = 3,
    objective: Annotated[Objective, typer.Option("--objective", help="time (step time), comm (bytes), memory, or "
                                                 "cost (to --tokens): on this fixed cluster the same ranking as "
                                                 "time; `autoplace scale --objective cost` chooses the GPU count.")
                         ] = Objective.time,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, help="Seconds for the search.")] = 10.0,
    solver: Annotated[SolverName, typer.Option("--solver")] = SolverName.cpsat,
    fix: Annotated[list[str] | None, typer.Option("--fix", help="KEY=VALUE pinned in every plan (repeatable).")] = None,
    allow: Annotated[list[str] | None, typer.Option("--allow", help="Enable a feature: offload, cp, ep, interleave, hsdp, tp-across-nodes, compress (off by default: gradient/weight compression changes the numbers).")] = None,
    deny: Annotated[list[str] | None, typer.Option("--deny", help="Disable a feature.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the best plan's bundle here (plan.json and every "
                                             "framework file that expresses it) and, unless --framework names one, "
                                             "each framework's own best plan in OUT/<framework>/.")] = None,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="CP-SAT worker threads.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="CP-SAT random seed.")] = 0,
    calibration: CalibrationOpt = None,
    force: ForceOpt = False,
    framework: Annotated[str, typer.Option("--framework", help="any (default): only plans at least one supported "
                                           "framework can run; none: the theoretical optimum, unfiltered; or one of "
                                           "deepspeed, megatron, torchtitan, fsdp, accelerate: the plans it can run, "
                                           "costed with its precision recipe.")] = "any",
    fmt: FormatOpt = None,
    short: ClusterOpt = None,
    gpu: GpuOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    intra_node: IntraOpt = None,
    inter_node: InterOpt = None,
    tokens: TokensOpt = None,
    price: PriceOpt = None,
    target_loss: LossOpt = None,
    noise_scale: NoiseOpt = None,
) -> None:
    """Rank plans with the integer program; with --out, write the best plan's bundle and each framework's best."""
    import time as _time

    t0 = _time.perf_counter()
    try:
        from autoplace import frameworks
        from autoplace.plan import parse_plan_string
        from solvers.problem import Budget
        from solvers.registry import get_solver

        out_fmt = output_format(fmt, as_json)
        m, c = _load(model, cluster_from_args(cluster, short, gpu, nodes, gpus_per_node, intra_node, inter_node),
                     seq_len, global_batch)
        origin = model_origin_of(model, m, seq_len, global_batch)
        fixed = parse_plan_string(",".join(fix or []), source="--fix")
        features = _features(allow, deny)
        # any/none name no framework: the calibration's own is not compared
        named = None if framework in (frameworks.ANY, frameworks.NONE) else framework
        assume, band = _calibration(calibration, c, named, force)
        from autoplace.report import SolveProgress

        progress = None if out_fmt == "json" else SolveProgress(time_limit)
        budget = Budget(time_limit_s=time_limit, workers=workers, seed=seed, progress=progress)
        # cost to a token budget on a fixed cluster is GPUs x time: the time ranking
        search = {"objective": "time" if objective == Objective.cost else objective.value, "assumptions": assume}
        problem = frameworks.problem_for(framework, m, c, fixed=fixed, features=features, top_k=top, **search)
        m = problem.model
        try:
            if framework == frameworks.NONE:
                result = get_solver(solver.value).solve(problem, budget)
            else:
                result = frameworks.solve_for(framework, get_solver(solver.value), problem, budget, top)
        finally:
            if progress is not None:
                progress.close()
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    from autoplace.cost.layers import layer_table

    doc = {"schema": "autoplace.solution/v1", "status": result.status, "objective": result.objective,
           "solve_seconds": round(_time.perf_counter() - t0, 3), "bound": result.bound, "gap": result.gap,
           "disagreement": result.disagreement, "advice": result.advice, "framework": framework,
           "phases_s": {k: round(v, 3) for k, v in result.phases.items()}, "cpsat_model": result.model_size,
           "model": {"name": m.name, "params": int(layer_table(m).params), **origin}, "cluster": c.summary(),
           "plans": [{**ev.to_dict(rank=i + 1), "frameworks": frameworks.runnable_by(ev.plan, m, c)}
                     for i, ev in enumerate(result.plans)], "notes": result.notes}
    if framework == frameworks.NONE:
        doc["notes"] = ["theoretical optimum (--framework none): the search ignored what frameworks can run; "
                        "'frameworks' lists who can run each plan", *result.notes]
    # the calibration's prediction interval when it has one (>= 4 trials), else the development set's
    band, band_source = _band(c, band)
    for plan_doc in doc["plans"]:
        plan_doc["step_time_band_95_s"] = [plan_doc["step_time_s"] * band[0], plan_doc["step_time_s"] * band[1]]
        plan_doc["step_time_band_source"] = band_source
    if result.nearest is not None:
        doc["nearest"] = result.nearest.to_dict()
    hint = _compression_hint(problem, result)
    if hint:
        doc["notes"] = [*doc["notes"], hint]
    awkward = _batch_hint(problem, result, budget, solver.value, framework)
    if awkward:
        doc["batch_hint"], doc["notes"] = awkward, [*doc["notes"], awkward["note"]]
    try:
        view = _outlook(m, c, result.plans[0].tokens_per_s if result.plans else None, tokens, price, target_loss,
                        noise_scale)
        doc.update(view.to_dict())
        advice_lines = view.lines() + (_advised_solve(view, m, c, problem, budget, solver.value, framework)
                                       if out_fmt != "json" else [])
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    per_framework: dict[str, Any] = {}
    if out is not None and result.plans:
        try:
            from autoplace.hook import write_bundle, write_framework_bundles

            inputs = {"model": model_ref(model), "cluster": cluster_ref(cluster, c)}
            files = write_bundle(result.plans[0], m, c, out, inputs=inputs)
            doc["bundle"] = {k: str(v) for k, v in files.items()}
            if framework in (frameworks.ANY, frameworks.NONE):
                per_framework = write_framework_bundles(
                    result.plans[0], problem.model, c, out, get_solver(solver.value), budget, fixed=fixed,
                    features=features, inputs=inputs, **search)
                doc["framework_bundles"] = {f: b.to_dict() for f, b in per_framework.items()}
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
            _fail(exc)
    if out_fmt == "json":
        typer.echo(_json(doc))
    else:
        from autoplace.report import origin_lines, print_solution

        print_solution(doc, result, fmt=out_fmt, header=origin_lines(m.name, doc["model"]["params"], origin, c))
        _print_lines(advice_lines, out_fmt)
        if out is not None and result.plans:
            _print_bundles(out, doc, per_framework)
    if not result.plans:
        raise typer.Exit(3)


def _features(allow: list[str] | None, deny: list[str] | None) -> set[str]:
    """The search features: the defaults, plus --allow, less --deny.

    Raises:
        SpecError: a feature name that is not one (listing the valid ones).
    """
    from solvers.problem import DEFAULT_FEATURES, FEATURES

    for name in (allow or []) + (deny or []):
        if name not in FEATURES:
            raise SpecError(f"unknown feature {name!r}; valid: {', '.join(FEATURES)}", source="--allow/--deny")
    return (set(DEFAULT_FEATURES) | set(allow or [])) - set(deny or [])


def _batch_hint(problem: Any, result: Any, budget: Any, solver: str, framework: str) -> dict[str, Any] | None:
    """The nearest global batches all GPUs share, solved as this solve was (a quarter of its time
    limit each), when the batch divides badly (autoplace/batch_hint.py)."""
    import dataclasses

    from autoplace import frameworks
    from autoplace.batch_hint import batch_hint
    from solvers.registry import get_solver

    quick = dataclasses.replace(budget, time_limit_s=max(budget.time_limit_s / 4, 0.5), progress=None)
    if framework == frameworks.NONE:
        return batch_hint(problem, result, lambda p: get_solver(solver).solve(p, quick))
    return batch_hint(problem, result, lambda p: frameworks.solve_for(framework, get_solver(solver), p, quick, 1))


def _compression_hint(problem: Any, result: Any) -> str | None:
    """What compression would buy the best plan when the search left it out (cheap: a few evaluations)."""
    if "compress" in problem.features or not result.plans:
        return None
    from autoplace.explain import compression_hint

    return compression_hint(problem.model, problem.cluster, result.plans[0], problem.assumptions)


def _advised_solve(view: Any, m: Any, c: Any, problem: Any, budget: Any, solver: str, framework: str) -> list[str]:
    """Past the critical batch: the best plan at the advised batch (one more solve, top 1)."""
    if view.advice is None or not view.advice.over:
        return []
    from autoplace.sweep import SweepOptions, advised_plan_lines

    opts = SweepOptions(framework=framework, features=frozenset(problem.features), time_limit_s=budget.time_limit_s,
                        workers=budget.workers, seed=budget.seed,
                        price_per_gpu_hour=view.cost.price_per_gpu_hour if view.cost else None)
    return advised_plan_lines(m, c, view.advice.advised_batch, opts, view.cost.tokens if view.cost else None,
                              view.advice.batch_tokens, view.advice.critical_tokens)


def _print_bundles(out: Path, doc: dict[str, Any], per_framework: dict[str, Any]) -> None:
    """The files solve --out wrote: the best plan's bundle, then each framework's best or why none."""
    names = sorted(Path(p).name for k, p in doc.get("bundle", {}).items())
    typer.echo(f"written: {out}/ (the best plan): {', '.join(names)}")
    for f, bundle in per_framework.items():
        typer.echo(f"  {f:<10} {bundle.summary()}")



class ScaleObjective(StrEnum):
    time = "time"
    cost = "cost"


def _outlook(m: Any, c: Any, tokens_per_s: float | None, tokens: str | None, price: float | None,
             target_loss: float | None, noise_scale: str | None, *, advise: bool = False) -> Any:
    """Time and cost to --tokens, and the batch advice when asked or any of the planning flags is given."""
    from autoplace.cost.layers import layer_table
    from autoplace.planning import outlook, parse_amount

    budget = parse_amount(tokens, source="--tokens") if tokens is not None else None
    noise = parse_amount(noise_scale, source="--noise-scale") if noise_scale is not None else None
    advise = advise or any(x is not None for x in (tokens, target_loss, noise_scale))
    return outlook(m, layer_table(m), c.gpus, tokens_per_s, tokens=budget, price=price, target_loss=target_loss,
                   noise_scale=noise, advise=advise)


def _print_lines(lines: list[str], fmt: str) -> None:
    """Closing lines (rich markup) after a table; CSV holds the tables only."""
    if lines and fmt != "csv":
        from autoplace.report import render

        render([], lines, fmt)


@app.command()
def scale(
    model: ModelArg,
    gpus: Annotated[str, typer.Option("--gpus", help="GPU counts: LOW..HIGH doubles from LOW (powers of two from "
                                      "8..4096), or a list 8,16,64.")] = "8..1024",
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU profile or alias; the cluster at each size is whole "
                                            "reference nodes of it (its usual node and links).")] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="cluster.yaml whose node (GPU, GPUs per node, "
                                                 "links, host memory) is replicated instead.")] = None,
    tokens: TokensOpt = None,
    price: PriceOpt = None,
    objective: Annotated[ScaleObjective, typer.Option("--objective", help="time: the GPU count that trains fastest; "
                                                      "cost: the one with the fewest GPU-hours per token (lowest "
                                                      "cost), within --max-days.")] = ScaleObjective.time,
    max_days: Annotated[float | None, typer.Option("--max-days", min=0.0, help="Deadline for --objective cost "
                                                   "(needs --tokens).")] = None,
    global_batch: Annotated[str | None, typer.Option("--global-batch", help="Global batch in sequences at every "
                                                     "size (default: the model's); a range 512..4096 or list "
                                                     "searches it per size.")] = None,
    seq_len: SeqOpt = None,
    target_loss: LossOpt = None,
    noise_scale: NoiseOpt = None,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, help="Seconds of search per size.")] = 2.0,
    workers: Annotated[int, typer.Option("--workers", min=1, help="CP-SAT worker threads.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="CP-SAT random seed.")] = 0,
    framework: Annotated[str, typer.Option("--framework", help="none (default): the theoretical optimum, with who "
                                           "can run each plan; any or a framework name: as solve.")] = "none",
    allow: Annotated[list[str] | None, typer.Option("--allow", help="Enable a feature, as solve.")] = None,
    deny: Annotated[list[str] | None, typer.Option("--deny", help="Disable a feature, as solve.")] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Plot throughput and scaling efficiency against GPUs "
                                             "here (needs matplotlib).")] = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
) -> None:
    """The best plan at every GPU count: tokens/s, MFU, scaling efficiency, time and cost to a token budget."""
    import time as _time

    t0 = _time.perf_counter()
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.planning import parse_amount, parse_counts
        from autoplace.sweep import SweepOptions, choose, cluster_at, plot, sweep

        out_fmt = output_format(fmt, as_json)
        from autoplace import frameworks

        frameworks.check(framework)
        counts = parse_counts(gpus, source="--gpus")
        batches = parse_counts(global_batch, source="--global-batch") if global_batch else None
        if (gpu is None) == (cluster is None):
            raise SpecError("give the GPU (--gpu h100) or a cluster file to replicate (--cluster), one of them",
                            source="--gpu/--cluster")
        if max_days is not None and tokens is None:
            raise SpecError("--max-days needs --tokens (the budget to finish within the deadline)", source="--max-days")
        budget = parse_amount(tokens, source="--tokens") if tokens is not None else None
        unit = cluster_from_args(cluster) if cluster is not None else None
        m, _ = _load(model, cluster_at(counts[0], gpu=gpu, unit=unit), seq_len, batches[0] if batches else None)
        table = layer_table(m)
        advice = _outlook(m, cluster_at(counts[0], gpu=gpu, unit=unit), None, tokens, price, target_loss, noise_scale,
                          advise=True).advice
        opts = SweepOptions(framework=framework, features=frozenset(_features(allow, deny)), time_limit_s=time_limit,
                            workers=workers, seed=seed, tokens=budget,
                            price_per_gpu_hour=price, objective=objective.value, max_days=max_days,
                            critical_tokens=advice.critical_tokens if batches and len(batches) > 1 else None)
        points = sweep(m, counts, opts, gpu=gpu, unit=unit, batches=batches)
        chosen = choose(points, objective.value, max_days)
        doc = _scale_doc(m, table, points, chosen, opts, batches, gpu, unit, counts, advice)
        if advice.over and chosen is not None:
            from autoplace.sweep import advised_plan_lines

            doc["advice_lines"] += advised_plan_lines(m, cluster_at(chosen.gpus, gpu=gpu, unit=unit),
                                                      advice.advised_batch, opts, budget,
                                                      advice.batch_tokens, advice.critical_tokens)
        doc["sweep_seconds"] = round(_time.perf_counter() - t0, 3)
        if png is not None:
            plot(points, png, f"{m.name} on {points[0].cluster.split('x', 2)[2]}")
            doc["png"] = str(png)
    except ImportError as exc:
        _fail(AutoplaceError(f"{exc.name} is needed for --png: pip install 'autoplace[plot]'"))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    if out_fmt == "json":
        doc.pop("advice_lines")
        typer.echo(_json(doc))
        return
    from autoplace.report import print_scale

    print_scale(doc, fmt=out_fmt, header=[f"[bold]{m.name}[/bold] ({doc['model']['params_text']} params), "
                                          f"{len(counts)} sizes of {doc['gpu']}"])


def _scale_doc(m: Any, table: Any, points: list[Any], chosen: Any, opts: Any, batches: list[int] | None,
               gpu: str | None, unit: Any, counts: list[int], advice: Any) -> dict[str, Any]:
    """The autoplace.scale/v1 document; ``advice_lines`` (removed from the JSON) are the printed advice."""
    from autoplace.report import fmt_count

    pool = points[0].cluster.split("x", 2)[2]
    batch_text = (f"{m.training.global_batch:,} sequences at every size" if not batches or len(batches) == 1
                  else f"searched per size among {', '.join(map(str, batches))}")
    why = ("a training decision, held fixed as GPUs are added" if not batches or len(batches) == 1
           else "the 'batch' column is each size's choice")
    notes = [f"global batch: {batch_text} ({why}; --global-batch takes a value, a range or a list)",
             "cluster at each size: " + (f"whole nodes of {pool}'s reference node (--gpu)" if unit is None else
                                         f"whole nodes like {unit.name}'s (--cluster)") +
             "; fewer GPUs than a node is one partial node",
             f"each size searched for up to {opts.time_limit_s:g} s (--time-limit); a row never runs slower than a "
             "smaller one: a slower plan found is replaced by the smaller plan on a subset of the GPUs (the note says so)"]
    if opts.framework == "none":
        notes.append("--framework none: the theoretical optimum at each size; 'runs with' lists the frameworks "
                     "whose config can express each plan")
    if batches and len(batches) > 1:
        notes.append(f"batches compared by tokens to the same loss: E grows as 1 + B/B_crit with B_crit = "
                     f"{fmt_count(advice.critical_tokens)} tokens (McCandlish et al. 2018); throughput is scaled to "
                     f"the first batch's data efficiency")
    lines = advice.lines()
    if chosen is not None:
        what = ("fewest GPU-hours per token" + (f" within {opts.max_days:g} days" if opts.max_days else "")
                if opts.objective == "cost" else "fastest")
        summary = f" · {chosen.cost.summary()}" if chosen.cost else ""
        lines.insert(0, f"chosen ({opts.objective}: {what}): {chosen.gpus:,} GPUs, {chosen.tokens_per_s:,.0f} tokens/s"
                        f"{summary}")
        other = _other_choice(points, opts, chosen)
        if other:
            lines.insert(1, other)
    elif opts.max_days is not None:
        lines.insert(0, f"[red]no size finishes within {opts.max_days:g} days[/red]")
    return {"schema": "autoplace.scale/v1", "model": {"name": m.name, "params": int(table.params),
                                                       "params_text": fmt_count(table.params)},
            "gpu": pool, "objective": opts.objective, "global_batch": m.training.global_batch,
            "global_batch_text": batch_text.split(" at every")[0], "global_batches": batches or [m.training.global_batch],
            "tokens": opts.tokens, "price_per_gpu_hour": opts.price_per_gpu_hour, "max_days": opts.max_days,
            "chosen_gpus": chosen.gpus if chosen else None, "points": [p.to_dict() for p in points],
            "batch_advice": advice.to_dict(), "notes": notes, "advice_lines": lines, "sweep_seconds": 0.0}


def _other_choice(points: list[Any], opts: Any, chosen: Any) -> str | None:
    """The other objective's pick, when it differs (the fastest against the cheapest)."""
    from autoplace.sweep import choose

    other = choose(points, "time" if opts.objective == "cost" else "cost", opts.max_days)
    if other is None or other.gpus == chosen.gpus:
        return None
    return (f"{'fastest' if opts.objective == 'cost' else 'cheapest'}: {other.gpus:,} GPUs, "
            f"{other.tokens_per_s:,.0f} tokens/s" + (f" · {other.cost.summary()}" if other.cost else ""))


@app.command()
def emit(
    plan_json: Annotated[Path, typer.Argument(metavar="PLAN_JSON", help="plan.json written by solve --out")],
    fmt: Annotated[list[str] | None, typer.Option("--format", help="deepspeed, accelerate, fsdp, torchtitan, "
                                                   "megatron, torchrun, deepspeed-launch, slurm, k8s (repeatable)")] = None,
    out: Annotated[Path, typer.Option("--out", help="Bundle directory.")] = Path("autoplace-bundle"),
    model: Annotated[Path | None, typer.Option("--model", help="Model file (default: the one plan.json names).")] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="Cluster file (default: plan.json's).")] = None,
    script: Annotated[str, typer.Option("--script", help="Training script the launch files run.")] = "train.py",
) -> None:
    """Write framework configs and launch scripts for a plan."""
    try:
        from autoplace.emit import Launch
        from autoplace.emit import emit as write
        from autoplace.plan import Plan
        from autoplace.specs._io import read_document

        doc = read_document(plan_json)
        inputs = doc.get("inputs", {}) if isinstance(doc.get("inputs"), dict) else {}
        model_path, cluster_path = model or inputs.get("model"), cluster or inputs.get("cluster")
        if not model_path or not cluster_path:
            raise SpecError("names no model/cluster file; pass --model and --cluster", source=str(plan_json))
        m, c = _load(Path(model_path), Path(cluster_path), None, None)
        files = write(Plan.from_dict(doc, source=str(plan_json)), m, c, fmt or None, out, launch=Launch(script=script))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    for name, path in files.items():
        typer.echo(f"{name}: {path}")


@app.command()
def check(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="plan.json, DeepSpeed .json, accelerate .yaml "
                                            "or torchtitan .toml")],
    model: ModelArg,
    cluster: ClusterArg,
    as_json: JsonOpt = False,
) -> None:
    """Pre-submit hook: exit 0 when the job fits and is sound, 1 with the reasons otherwise.

    The config's own batch is the truth; "auto" values (HF Trainer) are resolved from the model
    or listed as unresolved.  The output names the framework, the plan read and those notes.
    """
    try:
        from autoplace.hook import check_config

        m, c = _load(model, cluster, None, None)
        checked = check_config(config, m, c)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    ev = checked.evaluation
    if as_json:
        typer.echo(_json({"schema": "autoplace.check/v1", "ok": checked.ok, "framework": checked.framework,
                          "config": str(config), "reasons": checked.reasons, "notes": list(checked.notes),
                          "plan": ev.to_dict()}))
    else:
        typer.echo(f"{'ok' if checked.ok else 'REJECT'}: {checked.framework} config {config} for {m.name} on "
                   f"{c.name}")
        typer.echo(f"  plan read: {ev.plan.to_string()} (global batch {ev.plan.global_batch})")
        for note in checked.notes:
            typer.echo(f"  note: {note}")
        for line in checked.reasons:
            typer.echo(f"  {line}")
    raise typer.Exit(0 if checked.ok else 1)


class Scheduler(StrEnum):
    slurm = "slurm"
    local = "local"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(
    ctx: typer.Context,
    model: ModelArg,
    cluster: ClusterArg,
    script: Annotated[str, typer.Option("--script", help="Training script every rank runs.")],
    scheduler: Annotated[Scheduler, typer.Option("--scheduler")] = Scheduler.slurm,
    plan: Annotated[str | None, typer.Option("--plan", help="Use this plan instead of solving.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Bundle directory.")] = Path("autoplace-job"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write the bundle, print the command, submit nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Plan, write the bundle and submit (sbatch) or launch locally (torchrun); args after -- go to the script."""
    try:
        from autoplace.hook import submit as run_submit

        m, c = _load(model, cluster, None, None)
        sub = run_submit(m, c, script, tuple(ctx.args), scheduler=scheduler.value, out_dir=out, plan=plan,
                         dry_run=dry_run)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    if as_json:
        typer.echo(_json({"schema": "autoplace.submission/v1", "job_id": sub.job_id, "bundle": str(sub.bundle),
                          "command": sub.command, "plan": sub.evaluation.to_dict()}))
    else:
        typer.echo(f"plan: {sub.evaluation.plan.to_string()}")
        typer.echo(f"bundle: {sub.bundle}")
        typer.echo(f"{'would run' if sub.job_id is None else 'ran'}: {' '.join(sub.command)}")
        if sub.job_id is not None:
            typer.echo(f"job id: {sub.job_id}")


@app.command()
def tune(
    model: ModelArg,
    cluster: ClusterArg,
    trials: Annotated[int, typer.Option("--trials", min=1, help="Finished trials the study should hold.")] = 3,
    top: Annotated[int, typer.Option("--top", min=1, help="CP-SAT plans to choose among.")] = 3,
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna RDB URL (postgresql://... for many "
                                                 "workers) or journal file (default sqlite:///OUT/study.db).")] = None,
    study: Annotated[str, typer.Option("--study", help="Study name (resumed when it exists).")] = "autoplace",
    launcher: Annotated[str, typer.Option("--launcher", help="local (torchrun here) or slurm (submitit).")] = "local",
    framework: Annotated[str, typer.Option("--framework", help="native (PyTorch parallelism) or deepspeed "
                                           "(trials train with the emitted ds_config.json).")] = "native",
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds per trial before it is killed.")] = 300.0,
    out: Annotated[Path, typer.Option("--out", help="Trial logs, storage and plots.")] = Path("autoplace-tune"),
    scale: Annotated[float, typer.Option("--scale", min=1e-6, max=1.0, help="Shrink the model to fit this machine.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="TPE sampler seed; workers sharing a study each want "
                                      "their own, or they propose the same knobs.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Benchmark the top plans with real torch.distributed steps (an Optuna study).

    Many workers (processes, hosts) may share one --storage (PostgreSQL, a journal file): each candidate runs once."""
    try:
        from autoplace.tune import print_report, run_tune

        if launcher not in ("local", "slurm"):
            raise SpecError(f"unknown launcher {launcher!r}; valid: local, slurm", field="--launcher")
        if framework not in ("native", "deepspeed"):
            raise SpecError(f"unknown framework {framework!r}; valid: native, deepspeed", field="--framework")
        report = run_tune(model, cluster, trials, top, storage, study, launcher, timeout, out, scale=scale,
                          progress=not as_json, framework=framework, seed=seed)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    if as_json:
        typer.echo(_json({"schema": "autoplace.tune/v1", **report.to_dict()}))
    else:
        print_report(report)


@app.command()
def calibrate(
    model: ModelArg,
    cluster: ClusterArg,
    storage: Annotated[str, typer.Option("--storage", help="The tune study's storage URL.")],
    study: Annotated[str, typer.Option("--study")] = "autoplace",
    out: Annotated[Path, typer.Option("--out", help="Where to write the calibration.")] = Path("calibration.yaml"),
) -> None:
    """Fit the cost model's efficiency factors to a tune study's measured trials."""
    try:
        from autoplace.calibrate import calibrate_study, print_calibration

        cal = calibrate_study(model, cluster, storage, study, out)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    print_calibration(cal)
    typer.echo(f"written: {out} (use with solve/evaluate --calibration {out})")


@app.command()
def verify(
    model: ModelArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "tp=2" or "zero=3" (world = the plan\'s degrees)')],
    steps: Annotated[int, typer.Option("--steps", min=1)] = 5,
    world: Annotated[int, typer.Option("--world", min=1, help="Processes to run the plan on.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Train a few steps on one process and under the plan; losses and parameters must match."""
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.plan import build_plan, parse_plan_string
        from autoplace.specs.model import load_model
        from autoplace.verify import print_verify, run_verify

        m = load_model(model)
        p = build_plan(parse_plan_string(plan), world=world, blocks=layer_table(m).blocks,
                       global_batch=m.training.global_batch)
        report = run_verify(m, p, steps=steps, world=world)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    if as_json:
        typer.echo(_json({"schema": "autoplace.verify/v1", **report.to_dict()}))
    else:
        print_verify(report)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def trace(
    factory: Annotated[str, typer.Argument(metavar="MODULE:FACTORY", help="e.g. transformers:LlamaForCausalLM or "
                                           "mypkg.model:build (called with --args as keyword arguments)")],
    args: Annotated[str | None, typer.Option("--args", help="JSON object of keyword arguments (for a Hugging Face "
                                             "model class: its config's keys)")] = None,
    out: Annotated[Path, typer.Option("--out", help="Where to write the layer-graph model.json.")] = Path("model.json"),
    seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="Training sequence length traced.")] = 2048,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Sequences in the traced micro-batch.")] = 1,
    global_batch: Annotated[int, typer.Option("--global-batch", min=1, help="Written as training.global_batch.")] = 1024,
    dtype: Annotated[TraceDtype, typer.Option("--dtype", help="Parameter and activation dtype.")] = TraceDtype.bf16,
    inputs: Annotated[TraceInput, typer.Option("--input", help="tokens (long ids) or hidden (float activations)")]
    = TraceInput.tokens,
    hidden: Annotated[int | None, typer.Option("--hidden", min=1, help="Hidden size when it cannot be read.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Model name (default: the factory's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build a PyTorch model on the meta device and write the layer graph solve reads (needs torch)."""
    try:
        try:
            from autoplace.trace import trace_factory
        except ImportError as exc:
            raise AutoplaceError(f"{exc.name} is needed for trace: pip install 'autoplace[torch]'") from None
        doc, measured = trace_factory(factory, args, seq_len=seq_len, batch=batch, dtype=dtype.value,
                                      inputs=inputs.value, hidden=hidden, global_batch=global_batch, name=name)
        from autoplace.specs.model import model_from_dict

        model_from_dict(doc, source=str(out))  # what solve will read must load
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    if as_json:
        typer.echo(_json({"schema": "autoplace.trace/v1", "model": doc, "out": str(out), "notes": measured.notes}))
        return
    from autoplace.report import Section, fmt_count, render

    rows = [(e["name"], str(e["repeat"]), fmt_count(e["params"]), f"{e['flops_per_token']:,.0f}",
             f"{e['activation_bytes_per_token']:,.0f}") for e in doc["graph"]]
    total = sum(e["params"] * e["repeat"] for e in doc["graph"])
    render([Section(f"Layer graph of {doc['name']} (seq_len {seq_len}, per token)",
                    ("layer", "repeat", "params", "fwd FLOPs", "saved bytes"), rows,
                    right=frozenset({"repeat", "params", "fwd FLOPs", "saved bytes"}))],
           [f"{fmt_count(total)} params; {'; '.join(measured.notes)}", f"written: {out}"], "table")


@app.command()
def profiles() -> None:
    """List the shipped GPU and interconnect profiles."""
    from autoplace.specs.cluster import profile_names

    for kind in ("gpu", "interconnect"):
        typer.echo(f"{kind}: {', '.join(profile_names(kind))}")


def run() -> None:
    """Console-script entry point: typer/click usage errors keep their exit code 2."""
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("autoplace: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    run()
