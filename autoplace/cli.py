"""The ``autoplace`` command line: a thin layer over the library.

Exit codes (docs/ARCHITECTURE.md): 0 success, 2 bad input (one line, no traceback without --debug),
3 no plan (infeasible, or none found in the time limit), 4 ``tune`` left candidates given up or unmeasured.  Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from autoplace.cli_inputs import (
    ClusterOpt,
    ForceOpt,
    FormatOpt,
    GpnOpt,
    GpuOpt,
    InterOpt,
    IntraOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    MethodOpt,
    NodesOpt,
    OptClusterArg,
    PagedOpt,
    TraceDtype,
    TraceInput,
    check_deadline,
    check_lora_rank,
    cluster_from_args,
    cluster_ref,
    model_origin_of,
    model_ref,
    output_format,
    tuning_overrides,
)
from autoplace.cli_usage import OneLineUsage, finite
from autoplace.errors import AutoplaceError, Incomplete, SpecError
from autoplace.plan import DEFAULT_FEATURES, FEATURES

app = typer.Typer(cls=OneLineUsage, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the best way to place a training job on a cluster.")
log = logging.getLogger("autoplace")
_state = {"debug": False}

ModelArg = Annotated[Path, typer.Argument(metavar="MODEL",
                                          help="model.json (shorthand or layer graph), a Hugging Face config.json, "
                                               "or a Hub id ORG/NAME read from the local Hugging Face cache")]
ClusterArg = Annotated[Path, typer.Argument(metavar="CLUSTER", help="cluster.yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else.")]
ReportOpt = Annotated[Path | None, typer.Option("--report", help="Write a self-contained HTML page here: charts of "
                                                "the plan, each framework's part, the numbers --json prints "
                                                "(needs matplotlib).")]


SeqOpt = Annotated[int | None, typer.Option("--seq-len", min=1, help="Override the model's training sequence length.")]
BatchOpt = Annotated[int | None, typer.Option("--global-batch", min=1, help="Override the global batch (sequences).")]
CalibrationOpt = Annotated[Path | None, typer.Option("--calibration", help="calibration.yaml written by "
                                                     "`autoplace calibrate` (measured efficiency factors).")]
TokensOpt = Annotated[str | None, typer.Option("--tokens", help="Token budget, e.g. 15T or 300B: print days, "
                                               "GPU-hours and (with a price) cost to train on it.",
                                               rich_help_panel="Time and cost")]
# Bounds that keep the arithmetic finite: a price up to $1e6 per GPU-hour (cloud H100s rent for a few
# dollars) times GPU-hours of at most 1e18 tokens; a loss up to 100 nats (a uniform guess over a
# 100,000-token vocabulary is 11.5), where Kaplan's L**(1/0.21) would overflow past ~1e64
PriceOpt = Annotated[float | None, typer.Option("--price-per-gpu-hour", min=0.0, max=1e6, callback=finite,
                                                help="Dollars per GPU-hour (cost = GPU-hours x price).",
                                                rich_help_panel="Time and cost")]
LossOpt = Annotated[float | None, typer.Option("--target-loss", min=1e-3, max=100.0, callback=finite,
                                               help="Target loss in nats: the critical batch from Kaplan et al. 2020 "
                                               "eq. 1.4 at this loss.", rich_help_panel="Batch advice")]
# CP-SAT's num_workers and random_seed are int32 fields (ortools/sat/sat_parameters.proto)
WorkersOpt = Annotated[int, typer.Option("--workers", min=1, max=2**31 - 1, help="CP-SAT worker threads.")]
SeedOpt = Annotated[int, typer.Option("--seed", min=0, max=2**31 - 1, help="CP-SAT random seed.")]
NoiseOpt = Annotated[str | None, typer.Option("--noise-scale", help="Measured gradient noise scale in tokens "
                                              "(McCandlish et al. 2018), e.g. 4M: used as the critical batch.",
                                              rich_help_panel="Batch advice")]


# the help lists the features from the list the search reads, so neither can name one the other lacks
AllowOpt = Annotated[list[str] | None, typer.Option("--allow", help="Enable a feature that is off by default: " + ", ".join(
    f for f in FEATURES if f not in DEFAULT_FEATURES) + " (repeatable; compression and fp8 change the numbers the "
    "optimizer sees).")]
DenyOpt = Annotated[list[str] | None, typer.Option("--deny", help="Disable a feature that is on by default: " + ", ".join(
    f for f in FEATURES if f in DEFAULT_FEATURES) + " (repeatable).")]
FrameworkOpt = Annotated[str, typer.Option("--framework", help="any (default): plans at least one supported framework "
                                           "can run; none: the theoretical optimum, unfiltered; or one of deepspeed, "
                                           "megatron, torchtitan, fsdp, accelerate: the plans it can run, costed with "
                                           "its precision recipe.")]


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


def guarded(command: Callable[..., None]) -> Callable[..., None]:
    """A command whose every failure becomes one stderr line and its exit code (:func:`_fail`)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BrokenPipeError:  # `autoplace solve ... | head`: end quietly with 0, as standard tools do
            _quiet_stdout()
            raise typer.Exit(0) from None
        except OSError as exc:  # a path the file system refuses (--out naming a file, --png a directory): bad input
            _fail(SpecError(exc.strerror or type(exc).__name__, source=str(exc.filename)) if exc.filename else exc)
        except Exception as exc:  # noqa: BLE001 - every failure, output included, becomes one line and an exit code
            _fail(exc)

    return run


def _load(model: Path, cluster: Path | Any, seq_len: int | None, global_batch: int | None,
          tuning: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Load both; a GPU without a peak for the model's compute dtype is the cluster's error.

    ``cluster`` is a cluster.yaml (or NODESxGPUSxGPU) path, or a ClusterSpec built from flags;
    ``tuning`` the fine-tuning overrides (:func:`autoplace.cli_inputs.tuning_overrides`).
    """
    m, c, _ = _load_recorded(model, cluster, seq_len, global_batch, tuning)
    return m, c


def _load_recorded(model: Path, cluster: Path | Any, seq_len: int | None, global_batch: int | None,
                   tuning: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """:func:`_load`, and where the model came from with which of its numbers are defaults."""
    from autoplace.specs.cluster import check_compute_dtype, fp8_refusal
    from autoplace.specs.hub import resolve_model
    from autoplace.specs.model import read_model

    path, repo = resolve_model(model)
    m, recorded = read_model(path, overrides={"seq_len": seq_len, "global_batch": global_batch, **(tuning or {})})
    check_lora_rank(m, tuning or {}, path)
    if repo is not None:  # named as the user typed it, not by the snapshot's file
        m = m.model_copy(update={"name": repo})
    c = cluster_from_args(cluster) if isinstance(cluster, Path) else cluster
    check_compute_dtype(c, m.training.recipe().compute_dtype, source=str(cluster) if isinstance(cluster, Path)
                        else c.name)
    why = fp8_refusal(c, m.training.recipe_pins.fp8 or "none")
    if why:
        raise SpecError(why, source=str(path), field="training.recipe.fp8")
    return m, c, model_origin_of(model, m, recorded)


def _scored(model: Path, cluster: Any, plan: str, seq_len: int | None, global_batch: int | None,
            allow: list[str] | None, calibration: Path | None, force: bool, tuning: dict[str, Any]
            ) -> tuple[Any, Any, dict[str, Any], Any, Any, tuple[float, float] | None]:
    """(model, cluster, origin, the --plan's Evaluation, assumptions, the calibration's 95% band or
    None): evaluate's and explain's first steps."""
    from autoplace.cost.layers import layer_table
    from autoplace.evaluation import evaluate
    from autoplace.plan import build_plan, parse_plan_string, with_pins
    from autoplace.specs.cluster import fp8_refusal

    m, c, origin = _load_recorded(model, cluster, seq_len, global_batch, tuning)
    values = with_pins(parse_plan_string(plan), m.training.recipe_pins.values(), source="--plan")
    p = build_plan(values, world=c.gpus, blocks=layer_table(m).blocks,
                   global_batch=m.training.global_batch, gpus_per_node=c.gpus_per_node)
    why = fp8_refusal(c, p.fp8)
    if why:
        raise SpecError(why, source="--plan", field="fp8")
    assume, band = _calibration(calibration, c, force=force)
    ev = evaluate(m, c, p, assume, allow_tp_across_nodes="tp-across-nodes" in _features(allow, None))
    return m, c, origin, ev, assume, band


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
@guarded
def evaluate(
    model: ModelArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "dp=64,tp=8,pp=16,zero=1,mbs=1,recompute=selective"')],
    cluster: OptClusterArg = None,
    as_json: JsonOpt = False,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    allow: AllowOpt = None,
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
    method: MethodOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    paged_optimizer: PagedOpt = None,
    report: ReportOpt = None,
) -> None:
    """Score one plan: memory by state against capacity, communication, step time, violations."""
    from autoplace import solving
    from autoplace.cost.layers import layer_table

    out = output_format(fmt, as_json)
    _check_report(report)
    m, c, origin, ev, assume, band = _scored(model, cluster_from_args(cluster, short, gpu, nodes, gpus_per_node, intra_node,
                                                                  inter_node), plan, seq_len, global_batch, allow,
                                       calibration, force, tuning_overrides(method, lora_rank, lora_alpha,
                                                                            lora_targets, paged_optimizer))
    table = layer_table(m)
    view = _outlook(m, c, ev.tokens_per_s, tokens, price, target_loss, noise_scale)
    from autoplace.sanity import mfu_check

    above = mfu_check(ev, m, c)  # a prediction past every published run on the GPU, with what lifts it
    doc = {"schema": "autoplace.evaluation/v1", "model": {"name": m.name, "params": int(table.params), **origin},
           "cluster": c.summary(), "plan": {**ev.to_dict(), **_above(above)}, **view.to_dict()}
    solving.add_band([doc["plan"]], c, band)
    if report is not None:
        _write_evaluation_report(report, doc, m, c, ev, assume)
    if out == "json":
        typer.echo(_json(doc))
    else:
        from autoplace.report import origin_lines, print_evaluation

        print_evaluation(ev, c, fmt=out, header=origin_lines(m.name, table.params, origin, c))
        _print_lines(view.lines() + ([f"warning: {above.line()}"] if above else []) + _report_line(doc), out)


def _above(above: Any) -> dict[str, Any]:
    """``above_published`` of a plan's JSON when its MFU is past the best published (autoplace.sanity)."""
    return {"above_published": above.to_dict()} if above else {}


@app.command()
@guarded
def explain(
    model: ModelArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "tp=8,pp=4,zero=1,recompute=selective"')],
    cluster: OptClusterArg = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write the stacked-bar chart here (needs matplotlib).")] = None,
    as_json: JsonOpt = False,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    allow: AllowOpt = None,
    calibration: CalibrationOpt = None,
    force: ForceOpt = False,
    fmt: FormatOpt = None,
    short: ClusterOpt = None,
    gpu: GpuOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    intra_node: IntraOpt = None,
    inter_node: InterOpt = None,
    method: MethodOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    paged_optimizer: PagedOpt = None,
    report: ReportOpt = None,
) -> None:
    """Where every GB and second goes, beside the alternatives that change the most."""
    _check_report(report)
    try:
        from autoplace import solving
        from autoplace.cost.layers import layer_table
        from autoplace.explain import alternatives, plot, print_explanation

        m, c, origin, ev, assume, band = _scored(model, cluster_from_args(cluster, short, gpu, nodes, gpus_per_node,
                                                                      intra_node, inter_node), plan, seq_len,
                                           global_batch, allow, calibration, force,
                                           tuning_overrides(method, lora_rank, lora_alpha, lora_targets, paged_optimizer))
        alts = alternatives(m, c, ev.plan, ev, assumptions=assume,
                            allow_tp_across_nodes="tp-across-nodes" in _features(allow, None))
        if png is not None:
            plot(ev, alts, png)
        out = output_format(fmt, as_json)
        params = layer_table(m).params
        doc = {"schema": "autoplace.explanation/v1", "model": {"name": m.name, "params": int(params), **origin},
               "cluster": c.summary(), "plan": ev.to_dict(),
               "alternatives": [{"change": a.change, **a.evaluation.to_dict()} for a in alts],
               "png": str(png) if png else None}
        solving.add_band([doc["plan"]], c, band)
        if report is not None:
            _write_evaluation_report(report, doc, m, c, ev, assume)
        if out == "json":
            typer.echo(_json(doc))
        else:
            from autoplace.report import origin_lines

            print_explanation(ev, alts, c, png, fmt=out, header=origin_lines(m.name, params, origin, c))
            _print_lines(_report_line(doc), out)
    except ImportError as exc:
        raise AutoplaceError(f"{exc.name} is needed for --png: pip install 'autoplace[plot]'") from None


class Objective(StrEnum):
    time = "time"
    comm = "comm"
    memory = "memory"
    cost = "cost"


class Rank(StrEnum):
    robust = "robust"
    fastest = "fastest"


RankOpt = Annotated[Rank, typer.Option("--rank", help="robust: among the plans within the model's 95% band of the "
                                       "fastest, those with fewer moving parts (offload, context parallelism on "
                                       "short chunks, cross-node TP, more parallel dimensions) first; fastest: by "
                                       "predicted step time alone.")]


class SolverName(StrEnum):
    cpsat = "cpsat"
    exhaustive = "exhaustive"


@app.command()
@guarded
def solve(
    model: ModelArg,
    cluster: OptClusterArg = None,
    as_json: JsonOpt = False,
    top: Annotated[int, typer.Option("--top", min=1, max=20, help="How many distinct plans to return.")] = 3,
    objective: Annotated[Objective, typer.Option("--objective", help="time (step time), comm (bytes), memory, or "
                                                 "cost (to --tokens): on this fixed cluster the same ranking as "
                                                 "time; `autoplace scale --objective cost` chooses the GPU count.")
                         ] = Objective.time,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, callback=finite,
                                                              help="Seconds for the search.")] = 10.0,
    solver: Annotated[SolverName, typer.Option("--solver")] = SolverName.cpsat,
    fix: Annotated[list[str] | None, typer.Option("--fix", help="KEY=VALUE pinned in every plan (repeatable).")] = None,
    allow: AllowOpt = None,
    deny: DenyOpt = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the best plan's bundle here (plan.json and every "
                                             "framework file that expresses it) and, unless --framework names one, "
                                             "each framework's own best plan in OUT/<framework>/.")] = None,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    workers: WorkersOpt = 2,
    seed: SeedOpt = 0,
    calibration: CalibrationOpt = None,
    force: ForceOpt = False,
    framework: FrameworkOpt = "any",
    rank: RankOpt = Rank.robust,
    fmt: FormatOpt = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every column of the plans table (bytes moved, the 95% "
                                       "band, long names); by default it fits 100 columns.")] = False,
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
    method: MethodOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    paged_optimizer: PagedOpt = None,
    report: ReportOpt = None,
) -> None:
    """Rank plans with the integer program; with --out, write the best plan's bundle and each framework's best."""
    import time

    from autoplace import solving
    from autoplace.report import SolveProgress, origin_lines, print_solution

    started = time.perf_counter()  # --time-limit bounds the whole command, loading and bundles included
    out_fmt = output_format(fmt, as_json)
    _check_report(report)
    inputs = _inputs(model, cluster_from_args(cluster, short, gpu, nodes, gpus_per_node, intra_node, inter_node),
                     seq_len, global_batch, tuning_overrides(method, lora_rank, lora_alpha, lora_targets, paged_optimizer))
    request = _request(inputs.cluster, framework, top, objective.value, time_limit, solver.value, fix, allow, deny,
                       workers, seed, calibration, force, started, rank.value)
    problem = solving.build_problem(inputs, request)
    progress = None if out_fmt == "json" else SolveProgress(time_limit)
    try:
        result = solving.run_search(problem, request, progress)
    finally:
        if progress is not None:
            progress.close()
    doc = solving.annotate(result, problem, inputs, request)
    solving.add_batch_hint(doc, problem, result, request)
    m, c = problem.model, inputs.cluster
    view = _outlook(m, c, result.plans[0].tokens_per_s if result.plans else None, tokens, price, target_loss,
                    noise_scale)
    doc.update(view.to_dict())
    bests = solving.search_per_framework(result, inputs, request) if (out or report) and result.plans else {}
    per_framework = solving.write_bundles(doc, result, problem, inputs, request, out, bests) if out and result.plans else {}
    if report is not None:
        _write_report(report, doc, result, inputs, request, bests)
    if out_fmt == "json":
        typer.echo(_json(doc))
    else:
        print_solution(doc, result, fmt=out_fmt, header=origin_lines(m.name, doc["model"]["params"], inputs.origin, c),
                       wide=wide)
        _print_lines(view.lines() + _advised_solve(view, m, c, problem, request), out_fmt)
        if out is not None and result.plans:
            _print_bundles(out, doc, per_framework)
        _print_lines(_report_line(doc), out_fmt)
    if not result.plans:
        raise typer.Exit(3)


def _check_report(path: Path | None) -> None:
    """--report: a page that cannot be written (or drawn: no matplotlib) is refused before any work."""
    if path is not None:
        from autoplace.report_html import check_target

        check_target(path)


def _report_line(doc: dict[str, Any]) -> list[str]:
    """The closing line naming the page written, its size and seconds (none without --report)."""
    page = doc.get("report")
    return [f"report: {page['path']} ({page['bytes'] / 1e3:,.0f} kB, {page['seconds']:.1f} s)"] if page else []


def _timed_page(path: Path, doc: dict[str, Any], write: Callable[[], int]) -> None:
    """Write a page (``write`` returns its bytes), then record its size and seconds in ``doc["report"]``
    (after the page: they are not on it)."""
    import time

    begun = time.perf_counter()
    size = write()
    doc["report"] = {"path": str(path), "bytes": size, "seconds": round(time.perf_counter() - begun, 3)}


def _write_report(path: Path, doc: dict[str, Any], result: Any, inputs: Any, request: Any, bests: Any) -> None:
    """solve --report: each framework's part recorded in ``doc``, then the page written from ``doc``;
    its size and seconds recorded in ``doc["report"]`` (after the page: they are not on it)."""
    from autoplace import solving
    from autoplace.report_html import write_solve_report

    def write() -> int:
        if result.plans:
            doc["per_framework"] = solving.framework_summary(result, inputs, request, bests)
        return write_solve_report(path, doc, result, inputs.cluster)

    _timed_page(path, doc, write)


def _write_scale_report(path: Path, doc: dict[str, Any], chosen: Any, cluster: Any) -> None:
    """scale --report: the page written from ``doc``, then its size and seconds recorded in it."""
    from autoplace.report_scale import write_scale_report

    _timed_page(path, doc, lambda: write_scale_report(path, doc, chosen, cluster))


def _write_evaluation_report(path: Path, doc: dict[str, Any], model: Any, cluster: Any, ev: Any, assume: Any) -> None:
    """evaluate and explain --report: who runs the plan recorded in ``doc``, the page written, then its
    size and seconds."""
    from autoplace.frameworks.search import Runners
    from autoplace.report_html import write_evaluation_report
    from autoplace.solving import who_runs

    def write() -> int:
        doc["per_framework"] = who_runs(Runners(model, cluster, assume), ev.plan)
        return write_evaluation_report(path, doc, ev, cluster)

    _timed_page(path, doc, write)


def _inputs(model: Path, cluster: Any, seq_len: int | None, global_batch: int | None,
            tuning: dict[str, Any]) -> Any:
    """Load the model and cluster and record where they came from (solving.Inputs)."""
    from autoplace.solving import Inputs

    m, c, origin = _load_recorded(model, cluster, seq_len, global_batch, tuning)
    refs: dict[str, Any] = {"model": model_ref(model),
                            "cluster": cluster_ref(cluster if isinstance(cluster, Path) else None, c)}
    overrides = {k: v for k, v in {"seq_len": seq_len, "global_batch": global_batch, **tuning}.items() if v is not None}
    if overrides:  # what the flags changed, so `autoplace dryrun` loads the same model again
        refs["overrides"] = overrides
    return Inputs(m, c, origin, refs)


def _request(cluster: Any, framework: str, top: int, objective: str, time_limit: float, solver: str,
             fix: list[str] | None, allow: list[str] | None, deny: list[str] | None, workers: int, seed: int,
             calibration: Path | None, force: bool, started: float, rank: str = "robust") -> Any:
    """solve's options as a validated solving.Request (the calibration checked against the cluster)."""
    from autoplace.frameworks import ANY, NONE, check_name
    from autoplace.plan import parse_plan_string
    from autoplace.solving import Request

    check_name(framework)
    fixed = parse_plan_string(",".join(fix or []), source="--fix")
    # any/none name no framework: the calibration's own is not compared
    assume, band = _calibration(calibration, cluster, None if framework in (ANY, NONE) else framework, force)
    return Request(framework=framework, top=top, objective=objective, time_limit_s=time_limit, solver=solver,
                   fixed=fixed, features=frozenset(_features(allow, deny)), workers=workers, seed=seed,
                   assumptions=assume, band=band, started=started, rank=rank)


def _features(allow: list[str] | None, deny: list[str] | None) -> set[str]:
    """The search features: the defaults, plus --allow, less --deny.

    Raises:
        SpecError: a feature name that is not one (listing the valid ones).
    """
    for name in (allow or []) + (deny or []):
        if name not in FEATURES:
            raise SpecError(f"unknown feature {name!r}; valid: {', '.join(FEATURES)}", source="--allow/--deny")
    return (set(DEFAULT_FEATURES) | set(allow or [])) - set(deny or [])


def _advised_solve(view: Any, m: Any, c: Any, problem: Any, request: Any) -> list[str]:
    """Past the critical batch: the best plan at the advised batch (one more solve, top 1)."""
    if view.advice is None or not view.advice.over:
        return []
    from autoplace.sweep import SweepOptions, advised_plan_lines

    opts = SweepOptions(framework=request.framework, features=frozenset(problem.features),
                        time_limit_s=request.time_limit_s, workers=request.workers, seed=request.seed,
                        price_per_gpu_hour=view.cost.price_per_gpu_hour if view.cost else None, rank=request.rank)
    return advised_plan_lines(m, c, view.advice.advised_batch, opts, view.cost.tokens if view.cost else None,
                              view.advice.batch_tokens, view.advice.critical_tokens)


def _print_bundles(out: Path, doc: dict[str, Any], per_framework: dict[str, Any]) -> None:
    """The files solve --out wrote: the best plan's bundle, then each framework's best or why none."""
    from autoplace.report import fold

    names = sorted(Path(p).name for k, p in doc.get("bundle", {}).items())
    typer.echo(fold(f"written: {out}/ (the best plan): {', '.join(names)}"))
    for f, bundle in per_framework.items():
        typer.echo(fold(f"  {f:<10} {bundle.summary()}", indent=" " * 13))



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
@guarded
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
                                                      "cost), within the deadline (--days).")] = ScaleObjective.time,
    days: Annotated[float | None, typer.Option("--days", "--max-days", help="Deadline in days to train --tokens "
                                               "(needs --tokens): the cheapest size within it; when no size meets "
                                               "it, exit 3. Default: the cheapest within 90 days.")] = None,
    global_batch: Annotated[str | None, typer.Option("--global-batch", help="Global batch in sequences at every "
                                                     "size (default: the model's); a range 512..4096 or list "
                                                     "searches it per size.")] = None,
    seq_len: SeqOpt = None,
    target_loss: LossOpt = None,
    noise_scale: NoiseOpt = None,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, callback=finite,
                                                              help="Seconds of search per size.")] = 2.0,
    workers: WorkersOpt = 2,
    seed: SeedOpt = 0,
    framework: FrameworkOpt = "any",
    rank: RankOpt = Rank.robust,
    allow: AllowOpt = None,
    deny: DenyOpt = None,
    png: Annotated[Path | None, typer.Option("--png", help="Plot throughput and scaling efficiency against GPUs "
                                             "here (needs matplotlib).")] = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every column of the table (nodes, batch split, recompute, "
                                       "offload, scaling efficiency, GPU-hours, notes); by default it fits 100 "
                                       "columns.")] = False,
    method: MethodOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    paged_optimizer: PagedOpt = None,
    report: ReportOpt = None,
) -> None:
    """The best plan at every GPU count: tokens/s, MFU, scaling efficiency, time and cost to a token budget."""
    import time as _time

    t0 = _time.perf_counter()
    _check_report(report)
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.planning import parse_amount, parse_counts
        from autoplace.sweep import SweepOptions, cluster_at, decide, plot, sweep

        out_fmt = output_format(fmt, as_json)
        from autoplace.frameworks import check_name

        check_name(framework)
        counts = parse_counts(gpus, source="--gpus")
        batches = parse_counts(global_batch, source="--global-batch") if global_batch else None
        if (gpu is None) == (cluster is None):
            raise SpecError("give the GPU (--gpu h100) or a cluster file to replicate (--cluster), one of them",
                            source="--gpu/--cluster")
        check_deadline(days, tokens)
        budget = parse_amount(tokens, source="--tokens") if tokens is not None else None
        unit = cluster_from_args(cluster) if cluster is not None else None
        m, _ = _load(model, cluster_at(counts[0], gpu=gpu, unit=unit), seq_len, batches[0] if batches else None,
                     tuning_overrides(method, lora_rank, lora_alpha, lora_targets, paged_optimizer))
        table = layer_table(m)
        advice = _outlook(m, cluster_at(counts[0], gpu=gpu, unit=unit), None, tokens, price, target_loss, noise_scale,
                          advise=True).advice
        opts = SweepOptions(framework=framework, features=frozenset(_features(allow, deny)), time_limit_s=time_limit,
                            workers=workers, seed=seed, tokens=budget,
                            price_per_gpu_hour=price, objective=objective.value, days=days, rank=rank.value,
                            critical_tokens=advice.critical_tokens if batches and len(batches) > 1 and advice.applies
                            else None)
        points = sweep(m, counts, opts, gpu=gpu, unit=unit, batches=batches)
        choice = decide(points, opts)
        chosen = choice.chosen
        doc = _scale_doc(m, table, points, choice, opts, batches, gpu, unit, counts, advice)
        from autoplace.solving import add_band

        add_band([p["plan"] for p in doc["points"] if p.get("plan")], cluster_at(counts[0], gpu=gpu, unit=unit), None)
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
        raise AutoplaceError(f"{exc.name} is needed for --png: pip install 'autoplace[plot]'") from None
    if report is not None:
        _write_scale_report(report, doc, chosen, cluster_at(chosen.used_gpus, gpu=gpu, unit=unit) if chosen else None)
    if out_fmt == "json":
        doc.pop("advice_lines")
        typer.echo(_json(doc))
    else:
        from autoplace.report import print_scale

        print_scale(doc, fmt=out_fmt, header=[f"[bold]{m.name}[/bold] ({doc['model']['params_text']} params), "
                                              f"{len(counts)} sizes of {doc['gpu']}"], wide=wide)
        _print_lines(_report_line(doc), out_fmt)
    if choice.missed and days is not None:  # the deadline asked for cannot be met: infeasible, as solve says
        raise typer.Exit(3)


def _scale_doc(m: Any, table: Any, points: list[Any], choice: Any, opts: Any, batches: list[int] | None,
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
                     "whose config expresses each plan and that fit it in memory as they run it")
    if batches and len(batches) > 1:
        notes.append(f"batches compared by tokens to the same loss: E grows as 1 + B/B_crit with B_crit = "
                     f"{fmt_count(advice.critical_tokens)} tokens (McCandlish et al. 2018); throughput is scaled to "
                     f"the first batch's data efficiency")
    from autoplace.sweep import DEFAULT_DAYS_WHY, choice_lines, fewest_gpus, fewest_line

    lines = [*choice_lines(choice, opts), fewest_line(m, points, pool), *advice.lines()]
    deadline = None if choice.deadline is None else {
        "days": choice.deadline, "source": "--days" if opts.days is not None else "default",
        "why": None if opts.days is not None else DEFAULT_DAYS_WHY, "met": not choice.missed}
    return {"schema": "autoplace.scale/v1", "model": {"name": m.name, "params": int(table.params),
                                                       "params_text": fmt_count(table.params)},
            "gpu": pool, "objective": opts.objective, "global_batch": m.training.global_batch,
            "global_batch_text": batch_text.split(" at every")[0], "global_batches": batches or [m.training.global_batch],
            "tokens": opts.tokens, "price_per_gpu_hour": opts.price_per_gpu_hour, "max_days": opts.days,
            "deadline": deadline, "chosen_gpus": getattr(choice.chosen, "gpus", None),
            "fastest_gpus": getattr(choice.fastest, "gpus", None), "cheapest_gpus": getattr(choice.cheapest, "gpus", None),
            "method": m.training.method,
            "fewest_gpus": getattr(fewest_gpus(points), "used_gpus", None), "points": [p.to_dict() for p in points],
            "batch_advice": advice.to_dict(), "notes": notes, "advice_lines": lines, "sweep_seconds": 0.0}


@app.command()
@guarded
def emit(
    plan_json: Annotated[Path, typer.Argument(metavar="PLAN_JSON", help="plan.json written by solve --out")],
    fmt: Annotated[list[str] | None, typer.Option("--format", help="deepspeed, megatron, torchtitan, fsdp, "
                                                   "accelerate, torchrun, slurm, k8s (repeatable)")] = None,
    out: Annotated[Path, typer.Option("--out", help="Bundle directory.")] = Path("autoplace-bundle"),
    model: Annotated[Path | None, typer.Option("--model", help="Model file (default: the one plan.json names).")] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="Cluster file (default: plan.json's).")] = None,
    script: Annotated[str | None, typer.Option("--script", help="Training script the launch files run (default: "
                                                "the framework's entry point: Megatron-LM's pretrain_gpt.py, "
                                                "torchtitan.train, else train.py).")] = None,
) -> None:
    """Write framework configs and launch scripts for a plan.

    Without --format, a framework that expresses the plan but would run out of memory running it
    is left out (README.txt says why); asked for by --format, its files are written with a warning.
    """
    from autoplace.bundle import emit as write
    from autoplace.cost.layers import layer_table
    from autoplace.emit.launch import Launch
    from autoplace.frameworks.search import Runners
    from autoplace.plan import Plan, check_blocks
    from autoplace.specs._io import read_document

    doc = read_document(plan_json)
    inputs = doc.get("inputs", {}) if isinstance(doc.get("inputs"), dict) else {}
    model_path, cluster_path = model or inputs.get("model"), cluster or inputs.get("cluster")
    if not isinstance(model_path, (str, Path)) or not isinstance(cluster_path, (str, Path)) \
            or not model_path or not cluster_path:
        raise SpecError("names no model/cluster file; pass --model and --cluster", source=str(plan_json))
    m, c = _load(Path(model_path), Path(cluster_path), None, None)
    plan = Plan.from_dict(doc, source=str(plan_json))
    check_blocks(plan, layer_table(m).blocks, source=str(plan_json))
    unfit = Runners(m, c).unfit(plan)  # a framework that would run out of memory running the plan
    asked = {name: why for name, why in unfit.items() if fmt and name in fmt}
    files = write(plan, m, c, fmt or None, out, launch=Launch(script=script),
                  unfit={name: why for name, why in unfit.items() if name not in asked})
    for name, path in files.items():
        typer.echo(f"{name}: {path}")
    for why in asked.values():  # written as asked, with the warning
        typer.echo(f"autoplace: warning: {why}", err=True)


@app.command()
@guarded
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
    from autoplace.hook import check_config

    m, c = _load(model, cluster, None, None)
    checked = check_config(config, m, c)
    ev = checked.evaluation
    if as_json:
        typer.echo(_json({"schema": "autoplace.check/v1", "ok": checked.ok, "framework": checked.framework,
                          "config": str(config), "reasons": checked.reasons, "notes": list(checked.notes),
                          "plan": ev.to_dict()}))
    else:
        typer.echo(f"{'ok' if checked.ok else 'REJECT'}: {checked.framework} config {config} for {m.name} on "
                   f"{c.name}")
        from autoplace.report import fold

        typer.echo(fold(f"  plan read: {ev.plan.to_string()} (global batch {ev.plan.global_batch})", indent="    "))
        for note in checked.notes:
            typer.echo(fold(f"  note: {note}", indent="    "))
        for line in checked.reasons:
            typer.echo(fold(f"  {line}", indent="    "))
    raise typer.Exit(0 if checked.ok else 1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@guarded
def dryrun(
    ctx: typer.Context,
    bundle: Annotated[Path, typer.Argument(metavar="BUNDLE_DIR", help="A folder `autoplace solve --out` wrote "
                                           "(the best plan's, or one framework's OUT/<framework>/).")],
    rank: Annotated[list[int] | None, typer.Option("--rank", min=0, help="Global rank to build (repeatable; "
                                                   "default: 0 and the first rank of the last pipeline stage).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build what the bundle's launch builds before its first step, with the framework's own code, on a fake
    process group at the planned world size; words after -- are passed as the launch would pass them."""
    from autoplace.dryrun.run import dry_run

    progress = None
    if not as_json:
        from autoplace.dryrun.show import DryRunProgress

        progress = DryRunProgress()
    try:
        run = dry_run(bundle, rank, extra=tuple(ctx.args), progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if as_json:
        typer.echo(_json(run.to_dict()))
    else:
        from autoplace.dryrun.show import print_dry_run

        print_dry_run(run)
    raise typer.Exit(0 if run.ok else 1)


class Scheduler(StrEnum):
    slurm = "slurm"
    local = "local"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@guarded
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
    from autoplace.hook import submit as run_submit

    m, c = _load(model, cluster, None, None)
    sub = run_submit(m, c, script, tuple(ctx.args), scheduler=scheduler.value, out_dir=out, plan=plan,
                     dry_run=dry_run)
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
@guarded
def tune(
    model: ModelArg,
    cluster: ClusterArg,
    trials: Annotated[int, typer.Option("--trials", min=1, help="Finished trials the study should hold.")] = 3,
    top: Annotated[int, typer.Option("--top", min=1, help="CP-SAT plans to choose among.")] = 3,
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna RDB URL (postgresql://... for many "
                                                 "workers) or journal file (default sqlite:///OUT/study.db).")] = None,
    study: Annotated[str, typer.Option("--study", help="Study name (resumed when it exists).")] = "autoplace",
    launcher: Annotated[str, typer.Option("--launcher", help="local (torchrun here) or slurm (submitit).")] = "local",
    trainer: Annotated[str, typer.Option("--trainer", help="What runs the trials: native (PyTorch parallelism) or "
                                         "deepspeed (trials train with the emitted ds_config.json).")] = "native",
    timeout: Annotated[float, typer.Option("--timeout", min=1, callback=finite, help="Seconds per trial before it is killed.")] = 300.0,
    out: Annotated[Path, typer.Option("--out", help="Trial logs, storage and plots.")] = Path("autoplace-tune"),
    scale: Annotated[float, typer.Option("--scale", min=1e-6, max=1.0, callback=finite, help="Shrink the model to fit this machine.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**31 - 1, help="TPE sampler seed; workers sharing a "
                                      "study each want their own, or they propose the same knobs.")] = 0,
    retries: Annotated[int, typer.Option("--retries", min=0, help="Re-runs of a candidate whose worker died "
                                         "(heartbeat stale) before it is given up.")] = 3,
    grace: Annotated[int, typer.Option("--grace", min=1, help="Seconds without a heartbeat before a trial's "
                                       "worker counts as dead (beats every grace/6 s).")] = 60,
    as_json: JsonOpt = False,
    dashboard: Annotated[bool, typer.Option("--dashboard", help="After the study, serve it with optuna-dashboard "
                                            "(pip install 'autoplace[dashboard]') until Ctrl-C; tune prints the "
                                            "command either way.")] = False,
    report_path: ReportOpt = None,
) -> None:
    """Benchmark the top plans with real torch.distributed steps (an Optuna study).

    Many workers (processes, hosts) may share one --storage (PostgreSQL, a journal file): each candidate runs once.
    Exit code 4: candidates were given up (their worker died --retries+1 times) or left unmeasured; they are
    named on stderr, and running the same command again finishes exactly those."""
    from autoplace.studies import Heartbeat
    from autoplace.tune import print_report, run_tune

    if launcher not in ("local", "slurm"):
        raise SpecError(f"unknown launcher {launcher!r}; valid: local, slurm", field="--launcher")
    if trainer not in ("native", "deepspeed"):
        raise SpecError(f"unknown trainer {trainer!r}; valid: native, deepspeed", field="--trainer")
    if dashboard and shutil.which("optuna-dashboard") is None:  # said before any trial runs
        raise SpecError("optuna-dashboard is not installed: pip install 'autoplace[dashboard]' (without --dashboard, "
                        "tune prints the command to run later)", field="--dashboard")
    _check_report(report_path)
    report = run_tune(model, cluster, trials, top, storage, study, launcher, timeout, out, scale=scale,
                      progress=not as_json, framework=trainer, seed=seed,
                      heartbeat=Heartbeat(interval_s=max(1, grace // 6), grace_s=grace, max_retry=retries))
    doc = {"schema": "autoplace.tune/v1", **report.to_dict()}
    if report_path is not None:
        from autoplace.report_tune import write_tune_report

        _timed_page(report_path, doc, lambda: write_tune_report(report_path, doc))
    if as_json:
        typer.echo(_json(doc))
    else:
        print_report(report)
        for line in _report_line(doc):
            typer.echo(line)
    if dashboard:  # in the foreground, as the user would run the printed command
        import subprocess

        subprocess.run(report.dashboard, check=False)
    if report.incomplete:
        _fail(Incomplete(report.incomplete))


@app.command()
@guarded
def calibrate(
    model: ModelArg,
    cluster: ClusterArg,
    storage: Annotated[str, typer.Option("--storage", help="The tune study's storage URL.")],
    study: Annotated[str, typer.Option("--study")] = "autoplace",
    out: Annotated[Path, typer.Option("--out", help="Where to write the calibration.")] = Path("calibration.yaml"),
) -> None:
    """Fit the cost model's efficiency factors to a tune study's measured trials."""
    from autoplace.calibrate import calibrate_study, print_calibration

    cal = calibrate_study(model, cluster, storage, study, out)
    print_calibration(cal)
    typer.echo(f"written: {out} (use with solve/evaluate --calibration {out})")


@app.command()
@guarded
def verify(
    model: ModelArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "tp=2" or "zero=3" (world = the plan\'s degrees)')],
    steps: Annotated[int, typer.Option("--steps", min=1)] = 5,
    world: Annotated[int, typer.Option("--world", min=1, help="Processes to run the plan on.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Train a few steps on one process and under the plan; losses and parameters must match."""
    from autoplace.cost.layers import layer_table
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.model import load_model
    from autoplace.verify import print_verify, run_verify

    m = load_model(model)
    p = build_plan(parse_plan_string(plan), world=world, blocks=layer_table(m).blocks,
                   global_batch=m.training.global_batch)
    report = run_verify(m, p, steps=steps, world=world)
    if as_json:
        typer.echo(_json({"schema": "autoplace.verify/v1", **report.to_dict()}))
    else:
        print_verify(report)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
@guarded
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
        from autoplace.trace import trace_factory
    except ImportError as exc:
        raise AutoplaceError(f"{exc.name} is needed for trace: pip install 'autoplace[torch]'") from None
    doc, measured = trace_factory(factory, args, seq_len=seq_len, batch=batch, dtype=dtype.value,
                                  inputs=inputs.value, hidden=hidden, global_batch=global_batch, name=name)
    from autoplace.specs.model import model_from_dict

    model_from_dict(doc, source=str(out))  # what solve will read must load
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
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
@guarded
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


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    run()
