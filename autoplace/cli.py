"""The ``autoplace`` command line: a thin layer over the library.

Exit codes (DESIGN.md): 0 success, 2 bad input (one line, no traceback without --debug),
3 infeasible.  Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from autoplace.errors import AutoplaceError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the best way to place a training job on a cluster.")
log = logging.getLogger("autoplace")
_state = {"debug": False}

ModelArg = Annotated[Path, typer.Argument(help="model.json (shorthand or layer graph) or a Hugging Face config.json")]
ClusterArg = Annotated[Path, typer.Argument(help="cluster.yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else.")]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", min=1, help="Override the model's training sequence length.")]
BatchOpt = Annotated[int | None, typer.Option("--global-batch", min=1, help="Override the global batch (sequences).")]


class Allow(str, Enum):
    tp_across_nodes = "tp-across-nodes"


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
         verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log diagnostics to stderr.")] = False) -> None:
    """autoplace: placement search for distributed training."""
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(name)s: %(message)s")


def _fail(exc: BaseException) -> NoReturn:
    if _state["debug"]:
        raise exc
    code = exc.exit_code if isinstance(exc, AutoplaceError) else 1
    text = str(exc) if isinstance(exc, AutoplaceError) else f"internal error: {exc!r} (rerun with --debug)"
    typer.echo(f"autoplace: error: {text}", err=True)
    raise typer.Exit(code)


def _load(model: Path, cluster: Path, seq_len: int | None, global_batch: int | None) -> tuple[Any, Any]:
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    return (load_model(model, overrides={"seq_len": seq_len, "global_batch": global_batch}), load_cluster(cluster))


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
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        _fail(exc)
    if as_json:
        doc = {"schema": "autoplace.evaluation/v1", "model": {"name": m.name, "params": int(table.params)},
               "cluster": c.summary(), "plan": ev.to_dict()}
        typer.echo(json.dumps(doc))
        return
    from autoplace.report import print_evaluation

    print_evaluation(ev, c)


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
