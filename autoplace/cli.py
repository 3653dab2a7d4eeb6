"""The ``autoplace`` command line: a thin layer over the library.

Exit codes (DESIGN.md): 0 success, 2 bad input (one line, no traceback without --debug),
3 infeasible.  Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import logging
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from autoplace.errors import AutoplaceError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the best way to place a training job on a cluster.")
log = logging.getLogger("autoplace")
_state = {"debug": False}

ModelArg = Annotated[Path, typer.Argument(metavar="MODEL",
                                          help="model.json (shorthand or layer graph) or a Hugging Face config.json")]
ClusterArg = Annotated[Path, typer.Argument(metavar="CLUSTER", help="cluster.yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else.")]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", min=1, help="Override the model's training sequence length.")]
BatchOpt = Annotated[int | None, typer.Option("--global-batch", min=1, help="Override the global batch (sequences).")]


class Allow(StrEnum):
    tp_across_nodes = "tp-across-nodes"


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
         verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log diagnostics to stderr.")] = False) -> None:
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


def _load(model: Path, cluster: Path, seq_len: int | None, global_batch: int | None) -> tuple[Any, Any]:
    """Load both files; a GPU without a peak for the model's compute dtype is the cluster file's error."""
    from autoplace.specs.cluster import check_compute_dtype, load_cluster
    from autoplace.specs.model import load_model

    m = load_model(model, overrides={"seq_len": seq_len, "global_batch": global_batch})
    c = load_cluster(cluster)
    check_compute_dtype(c, m.training.recipe().compute_dtype, source=str(cluster))
    return m, c


def _json(doc: dict[str, Any]) -> str:
    """Strict JSON: a NaN or infinity is a bug to report, not ``NaN``/``Infinity`` on stdout."""
    return json.dumps(doc, allow_nan=False)


@app.command()
def evaluate(
    model: ModelArg,
    cluster: ClusterArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "dp=64,tp=8,pp=16,zero=1,mbs=1,recompute=selective"')],
    as_json: JsonOpt = False,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    allow: Annotated[list[Allow] | None, typer.Option("--allow", help="Permit a feature off by default.")] = None,
) -> None:
    """Score one plan: memory by state against capacity, communication, step time, violations."""
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.evaluation import evaluate as score
        from autoplace.plan import build_plan, parse_plan_string

        m, c = _load(model, cluster, seq_len, global_batch)
        table = layer_table(m)
        p = build_plan(parse_plan_string(plan), world=c.gpus, blocks=table.blocks,
                       global_batch=m.training.global_batch, gpus_per_node=c.gpus_per_node)
        ev = score(m, c, p, allow_tp_across_nodes=Allow.tp_across_nodes in (allow or []))
        if as_json:
            typer.echo(_json({"schema": "autoplace.evaluation/v1", "model": {"name": m.name, "params": int(table.params)},
                              "cluster": c.summary(), "plan": ev.to_dict()}))
        else:
            from autoplace.report import print_evaluation

            print_evaluation(ev, c)
    except Exception as exc:  # noqa: BLE001 - every failure, output included, becomes one line and an exit code
        _fail(exc)


@app.command()
def explain(
    model: ModelArg,
    cluster: ClusterArg,
    plan: Annotated[str, typer.Option("--plan", help='e.g. "tp=8,pp=4,zero=1,recompute=selective"')],
    png: Annotated[Path | None, typer.Option("--png", help="Write the stacked-bar chart here (needs matplotlib).")] = None,
    as_json: JsonOpt = False,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
) -> None:
    """Where every GB and second goes, beside the alternatives that change the most."""
    try:
        from autoplace.cost.layers import layer_table
        from autoplace.evaluation import evaluate as score
        from autoplace.explain import alternatives, plot, print_explanation
        from autoplace.plan import build_plan, parse_plan_string

        m, c = _load(model, cluster, seq_len, global_batch)
        p = build_plan(parse_plan_string(plan), world=c.gpus, blocks=layer_table(m).blocks,
                       global_batch=m.training.global_batch, gpus_per_node=c.gpus_per_node)
        ev = score(m, c, p)
        alts = alternatives(m, c, p, ev)
        if png is not None:
            plot(ev, alts, png)
        if as_json:
            typer.echo(_json({"schema": "autoplace.explanation/v1", "plan": ev.to_dict(),
                              "alternatives": [{"change": a.change, **a.evaluation.to_dict()} for a in alts],
                              "png": str(png) if png else None}))
        else:
            print_explanation(ev, alts, c, png)
    except ImportError as exc:
        _fail(AutoplaceError(f"{exc.name} is needed for --png: pip install 'autoplace[plot]'"))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)


class Objective(StrEnum):
    time = "time"
    comm = "comm"
    memory = "memory"


class SolverName(StrEnum):
    cpsat = "cpsat"
    exhaustive = "exhaustive"


@app.command()
def solve(
    model: ModelArg,
    cluster: ClusterArg,
    as_json: JsonOpt = False,
    top: Annotated[int, typer.Option("--top", min=1, max=20, help="How many distinct plans to return.")] = 3,
    objective: Annotated[Objective, typer.Option("--objective", help="time (step time), comm (bytes), memory.")] = Objective.time,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, help="Seconds for the search.")] = 10.0,
    solver: Annotated[SolverName, typer.Option("--solver")] = SolverName.cpsat,
    fix: Annotated[list[str] | None, typer.Option("--fix", help="KEY=VALUE pinned in every plan (repeatable).")] = None,
    allow: Annotated[list[str] | None, typer.Option("--allow", help="Enable a feature: offload, cp, ep, interleave, hsdp, tp-across-nodes.")] = None,
    deny: Annotated[list[str] | None, typer.Option("--deny", help="Disable a feature.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write plan.json of the best plan here.")] = None,
    seq_len: SeqOpt = None,
    global_batch: BatchOpt = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="CP-SAT worker threads.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="CP-SAT random seed.")] = 0,
) -> None:
    """Rank plans with the integer program and write the best one's plan.json."""
    import time as _time

    t0 = _time.perf_counter()
    try:
        from autoplace.errors import SpecError
        from autoplace.plan import parse_plan_string
        from solvers.base import DEFAULT_FEATURES, FEATURES, Budget, Problem, get_solver

        m, c = _load(model, cluster, seq_len, global_batch)
        fixed = parse_plan_string(",".join(fix or []), source="--fix")
        features = set(DEFAULT_FEATURES)
        for name in (allow or []) + (deny or []):
            if name not in FEATURES:
                raise SpecError(f"unknown feature {name!r}; valid: {', '.join(FEATURES)}", source="--allow/--deny")
        features |= set(allow or [])
        features -= set(deny or [])
        problem = Problem(m, c, objective=objective.value, fixed=fixed, features=frozenset(features), top_k=top)
        result = get_solver(solver.value).solve(problem, Budget(time_limit_s=time_limit, workers=workers, seed=seed))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    from autoplace.cost.layers import layer_table

    doc = {"schema": "autoplace.solution/v1", "status": result.status, "objective": result.objective,
           "solve_seconds": round(_time.perf_counter() - t0, 3), "bound": result.bound, "gap": result.gap,
           "disagreement": result.disagreement, "advice": result.advice,
           "model": {"name": m.name, "params": int(layer_table(m).params)}, "cluster": c.summary(),
           "plans": [ev.to_dict(rank=i + 1) for i, ev in enumerate(result.plans)], "notes": result.notes}
    if result.nearest is not None:
        doc["nearest"] = result.nearest.to_dict()
    if out is not None and result.plans:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(doc["plans"][0], indent=2, allow_nan=False) + "\n")
    if as_json:
        typer.echo(_json(doc))
    else:
        from autoplace.report import print_solution

        print_solution(doc, result)
    if not result.plans:
        raise typer.Exit(3)


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
