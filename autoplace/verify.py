"""``autoplace verify``: does a plan train exactly like one device? (the seed paper's test)

The same small model, seed and global batch are trained for ``steps`` SGD steps twice: on one
process, and with the plan on its world size (fp32 both).  Then, in this order:

1. **state consistency** -- every copy of a replicated parameter (DDP replicas, TP-replicated
   norms, ranks of an FSDP group after gathering) must be identical across ranks (checked
   first: a plan that fails it needs no reference run);
2. **gradient integrity** -- the losses of every step and the final parameters must match the
   single-process run within ``tol`` (relative): every update used the exact average of the
   gradients over the global batch.

Plain SGD, not Adam: Adam's update is invariant to a constant gradient scale, so a plan that
sums gradients over the replicas instead of averaging them would pass undetected.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace.errors import BenchmarkError
from autoplace.plan import Plan
from autoplace.specs.model import ModelSpec

log = logging.getLogger("autoplace")

GRADIENT_INTEGRITY = "gradient integrity"
STATE_CONSISTENCY = "state consistency"


@dataclass
class VerifyReport:
    """The verdict of one verification.

    Attributes:
        ok: both conditions hold within ``tol``.
        broken: the condition that failed first (``state consistency`` or ``gradient integrity``), or None.
        detail: one sentence naming the step or parameter and the error.
        loss_rel_err, param_rel_err: largest relative errors against the single-process run.
        losses_single, losses_plan: loss per step of both runs.
    """

    plan: str
    ok: bool
    broken: str | None
    detail: str
    tol: float
    loss_rel_err: float = math.nan
    param_rel_err: float = math.nan
    worst_param: str = ""
    losses_single: list[float] = field(default_factory=list)
    losses_plan: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def reference_plan(plan: Plan) -> Plan:
    """One process holding the whole global batch of every micro-batch (``mbs * dp`` rows)."""
    blocks = sum(plan.layers_per_stage)
    return Plan(mbs=plan.mbs * plan.dp, grad_accum=plan.grad_accum, recompute=plan.recompute,
                layers_per_stage=(blocks,))


def run_verify(model: ModelSpec, plan: Plan, steps: int = 5, world: int | None = None, *, tol: float = 1e-5,
               fault: str = "none", timeout_s: float = 300.0, workdir: Path | None = None) -> VerifyReport:
    """Train ``steps`` steps on one process and with ``plan``; compare losses and parameters.

    Args:
        model: a small model (the runtime builds it in full on every rank).
        plan: the plan to check; its world size is the number of processes.
        steps: SGD steps of each run (>= 2: the first loss precedes any update).
        world: expected world size (checked against the plan), e.g. 2.
        tol: largest relative error accepted (fp32 reassociation stays near 1e-7).
        fault: inject ``sum-grads`` or ``desync`` into the plan's run (tests of the checker).

    Raises:
        BenchmarkError: a run that fails, a plan whose world size is not ``world``, or a plan
            that compresses its communication (lossy by design: it cannot match one device).
    """
    if plan.compress != "none":
        raise BenchmarkError(f"compress={plan.compress} changes the gradients by design, so its training cannot "
                             "match one device; verify the plan without compress")
    if world is not None and plan.world != world:
        raise BenchmarkError(f"the plan's world size {plan.world} != world({world})")
    if steps < 2:
        raise BenchmarkError(f"steps >= 2 must hold, but got steps={steps}")
    with tempfile.TemporaryDirectory(prefix="autoplace-verify-") as tmp:
        base = Path(workdir or tmp)
        dist = _train(model, plan, base / "plan", steps, fault, timeout_s)
        merged = consistent_state(plan.to_string(), dist, tol)
        if isinstance(merged, VerifyReport):  # replicas disagree: no reference run needed
            return merged
        ref = reference_plan(plan)
        key = (model.model_dump_json(), ref.to_string(), steps)
        if key not in _REFERENCES:  # one single-process run serves every plan of the same batch
            _REFERENCES[key] = _train(model, ref, base / "single", steps, "none", timeout_s)
        return compare(plan.to_string(), _REFERENCES[key], dist[0], merged, tol)


# (model JSON, reference plan, steps) -> (losses, full parameters): the reference run is
# deterministic, so a process verifying several plans of one model trains it once
_REFERENCES: dict[tuple[str, str, int], tuple[list[float], list[dict[str, Any]]]] = {}


def _train(model: ModelSpec, plan: Plan, d: Path, steps: int, fault: str,
           timeout_s: float) -> tuple[list[float], list[dict[str, Any]]]:
    """Run the worker with plain SGD; returns the losses and every rank's full parameters."""
    import torch

    from autoplace.runtime.launch import run_local

    d.mkdir(parents=True, exist_ok=True)
    extra = ["--optimizer", "sgd", "--break", fault, "--save-params", str(d / "params")]
    out = run_local(model, plan, d, timeout_s=timeout_s, steps=steps - 1, warmup=1, extra=extra)
    if not out.ok:
        raise BenchmarkError(f"verify could not train {plan.to_string()}: {out.status} ({out.reason}) "
                             f"{out.error} -- log: {out.log}")
    ranks = sorted(d.glob("params.rank*.pt"), key=lambda p: int(p.suffixes[-2][len(".rank"):]))
    return out.result["losses"], [torch.load(p) for p in ranks]


def consistent_state(plan: str, dist: tuple[list[float], list[dict[str, Any]]],
                     tol: float) -> dict[str, Any] | VerifyReport:
    """State consistency: every copy of a parameter agrees across ranks.

    Returns:
        one full tensor per parameter name, or the failing report.
    """
    merged: dict[str, tuple[int, Any]] = {}
    for r, state in enumerate(dist[1]):
        for name, t in state.items():
            if name not in merged:
                merged[name] = (r, t)
                continue
            err = _rel(t, merged[name][1])
            if err > tol:
                return VerifyReport(plan, False, STATE_CONSISTENCY, (
                    f"copies of {name} differ between rank {merged[name][0]} and rank {r} (relative error "
                    f"{err:.2e} > {tol:g}): a replicated state diverged"), tol, worst_param=name,
                    losses_plan=dist[0])
    return {name: t for name, (_, t) in merged.items()}


def compare(plan: str, single: tuple[list[float], list[dict[str, Any]]], losses: list[float],
            params: dict[str, Any], tol: float) -> VerifyReport:
    """Gradient integrity: losses and final parameters match the single-process run."""
    ref = single[1][0]
    loss_errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, single[0], strict=True)]
    param_errs = {n: _rel(params[n], t) if n in params else math.inf for n, t in ref.items()}
    worst = max(param_errs, key=lambda n: param_errs[n])
    loss_err, param_err = max(loss_errs), param_errs[worst]
    if loss_err > tol or param_err > tol:
        step = max(range(len(loss_errs)), key=lambda i: loss_errs[i])
        ok, broken, detail = False, GRADIENT_INTEGRITY, (
            f"training diverges from one device: loss relative error {loss_err:.2e} (step {step}), parameter "
            f"{worst} relative error {param_err:.2e} > {tol:g}: the updates did not use the exact average "
            f"gradient over the global batch")
    else:
        ok, broken, detail = True, None, f"matches one device within {tol:g} over {len(loss_errs)} steps"
    return VerifyReport(plan, ok, broken, detail, tol, loss_rel_err=loss_err, param_rel_err=param_err,
                        worst_param=worst, losses_single=single[0], losses_plan=losses)


def _rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| (Frobenius), inf when the shapes differ."""
    if a.shape != b.shape:
        return math.inf
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def print_verify(report: VerifyReport) -> None:
    """One rich line for the verdict plus the error figures."""
    from autoplace.report import make_console

    c = make_console()  # never cut when piped (autoplace.report)
    verdict = "[green]PASS[/green]" if report.ok else f"[red]FAIL: {report.broken}[/red]"
    c.print(f"{verdict}  {report.plan}")
    c.print(f"  {report.detail}")
    c.print(f"  loss rel err {report.loss_rel_err:.2e}, parameter rel err {report.param_rel_err:.2e}"
            f" (worst: {report.worst_param})")
