"""Calibration: fit the cost model's efficiency factors to measured trials.

Two factors of :class:`~autoplace.cost.assumptions.Assumptions` are fitted:

* ``compute_scale`` -- measured / predicted compute time (achieved matmul efficiency relative
  to the profile's table);
* ``bandwidth_scale`` -- predicted / measured link bandwidth (effective bandwidth of every
  link tier relative to the profile).

The fit minimises the squared error of log step time, ``sum_i (log t_i - log T_i(c, b))^2``,
where ``T_i`` is the evaluator itself (one source of truth, docs/ARCHITECTURE.md) -- not a linearisation,
since exposed communication is a ``max(0, ...)`` of overlap.  Two parameters, a few trials:
a coarse grid in log space then Nelder-Mead from its three best points -- no optimiser
dependency.  A
small ridge term keeps a factor the data cannot see (e.g. bandwidth when every reduction is
hidden) at 1.

Uncertainty: a 95 % prediction interval in log space for a new step time,
``t(0.975, n - 2) * sqrt(s^2 + g' C g)``, where ``s`` is the residuals' standard deviation
(n - 2 degrees of freedom), ``C = s^2 (J'J)^-1`` the fitted factors' covariance (J: the
Jacobian of log step time in the log factors at the fit) and ``g`` the worst (largest-variance)
row of J among the trials -- the Student-t interval of a nonlinear least-squares fit (Seber &
Wild 1989, Sec. 5.1).  With fewer than MIN_BAND_TRIALS trials no band is given: two factors
fitted to one or two step times leave the residuals no freedom to say anything (one trial
used to report x0.9996..x1.0004).

What it was measured on: the GPU, its link tiers and the framework the trials ran are
written beside the factors (``measured_on``); applying the file to other hardware or
another framework is refused unless forced (:func:`check_applies`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.errors import SpecError
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

log = logging.getLogger("autoplace")

SCHEMA = "autoplace.calibration/v1"
FITTED = ("compute_scale", "bandwidth_scale")
RIDGE = 1e-4  # per squared log-factor: breaks ties toward 1 without moving a well-determined fit
MIN_BAND_TRIALS = 4  # n - 2 >= 2 degrees of freedom: the t quantile is finite and the band means something
_TOP_KEYS = {"schema", "assumptions", "uncertainty", "fit", "measured_on"}
_MEASURED_KEYS = ("gpu", "gpus_per_node", "intra_node", "inter_node", "framework")


@dataclass(frozen=True)
class Observation:
    """One measured trial: the model actually built (already scaled), the plan, seconds per step."""

    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    measured_s: float
    label: str = ""
    framework: str = "native"


@dataclass(frozen=True)
class Calibration:
    """The fitted assumptions, the band and the errors before and after.

    Attributes:
        assumptions: DEFAULT (or the base) with the fitted factors.
        sigma: standard deviation of log residuals after the fit.
        band: multiplicative 95 % band (low, high) for a predicted step time.
        error_before, error_after: mean and max absolute relative error of predicted step time.
    """

    assumptions: Assumptions
    sigma: float
    band: tuple[float, float] | None
    error_before: dict[str, float]
    error_after: dict[str, float]
    n: int
    measured_on: dict[str, Any] = dataclasses.field(default_factory=dict)
    factor_sd: tuple[float, float] | None = None  # standard errors of the log factors

    def to_dict(self) -> dict[str, Any]:
        uncertainty: dict[str, Any] = {"log_sigma": self.sigma, "band_95": list(self.band) if self.band else None}
        if self.band is None:
            uncertainty["note"] = f"no band: it needs >= {MIN_BAND_TRIALS} trials, got {self.n}"
        if self.factor_sd is not None:
            uncertainty["log_factor_sd"] = dict(zip(FITTED, self.factor_sd, strict=True))
        return {"schema": SCHEMA, "measured_on": self.measured_on,
                "assumptions": {k: float(getattr(self.assumptions, k)) for k in FITTED},
                "uncertainty": uncertainty,
                "fit": {"trials": self.n, "objective": "least squares on log step time",
                        "error_before": self.error_before, "error_after": self.error_after}}


def predict(obs: Observation, assume: Assumptions) -> float:
    """The evaluator's step time for one observation under ``assume``."""
    from autoplace.evaluation import evaluate

    return evaluate(obs.model, obs.cluster, obs.plan, assume).step_time_s


def errors(observations: list[Observation], assume: Assumptions) -> dict[str, float]:
    """Mean and max of |predicted - measured| / measured."""
    rel = [abs(predict(o, assume) - o.measured_s) / o.measured_s for o in observations]
    return {"mean_abs_rel": float(np.mean(rel)), "max_abs_rel": float(np.max(rel))}


def fit(observations: list[Observation], base: Assumptions = DEFAULT) -> Calibration:
    """Fit ``compute_scale`` and ``bandwidth_scale`` (see the module docstring).

    Raises:
        SpecError: no observations, or a measured time that is not a positive number.
    """
    if not observations:
        raise SpecError("calibration needs at least one measured trial, but got none")
    bad = [o.label for o in observations if not (o.measured_s > 0 and math.isfinite(o.measured_s))]
    if bad:
        raise SpecError(f"measured step times must be positive and finite; bad: {', '.join(bad)}")
    logs = np.log([o.measured_s for o in observations])

    def log_predicted(lc: float, lb: float) -> np.ndarray:
        a = base.replace(compute_scale=float(np.exp(lc)), bandwidth_scale=float(np.exp(lb)))
        return np.log([predict(o, a) for o in observations])

    center = fit_log_factors(logs, log_predicted)
    fitted = base.replace(compute_scale=float(np.exp(center[0])), bandwidth_scale=float(np.exp(center[1])))
    resid = logs - np.log([predict(o, fitted) for o in observations])
    n = len(observations)
    dof = max(n - len(FITTED), 1)
    sigma = float(math.sqrt(float((resid**2).sum()) / dof))
    band, factor_sd = None, None
    if n >= MIN_BAND_TRIALS:
        jac = _jacobian(observations, base, center)
        cov = sigma**2 * np.linalg.inv(jac.T @ jac + RIDGE * np.eye(len(FITTED)))
        factor_sd = (float(math.sqrt(cov[0, 0])), float(math.sqrt(cov[1, 1])))
        leverage = max(float(g @ cov @ g) for g in jac)
        half = t_quantile(0.975, n - len(FITTED)) * math.sqrt(sigma**2 + leverage)
        band = (math.exp(-half), math.exp(half))
    return Calibration(fitted, sigma, band, errors(observations, base), errors(observations, fitted), n,
                       measured_on(observations), factor_sd)


def fit_log_factors(logs: np.ndarray, log_predicted: Callable[[float, float], np.ndarray]) -> tuple[float, float]:
    """The (log compute_scale, log bandwidth_scale) minimising ``sum (logs - log_predicted(lc, lb))^2``
    plus the ridge: the fit itself, apart from where its predictions come from (:func:`fit` evaluates
    the trials; benchmarks/loso.py refits the published runs with every source held out in turn)."""

    def loss(lc: float, lb: float) -> float:
        return float(((logs - log_predicted(lc, lb)) ** 2).sum() + RIDGE * (lc**2 + lb**2))

    # a coarse grid over factors 1/1000 .. 1000 finds the basins; Nelder-Mead polishes the best three
    grid = np.linspace(-math.log(1000.0), math.log(1000.0), 13)
    coarse = sorted(((loss(x, y), (x, y)) for x in grid for y in grid), key=lambda t: t[0])
    return min((_nelder_mead(loss, start) for _, start in coarse[:3]), key=lambda p: loss(*p))


def _jacobian(observations: list[Observation], base: Assumptions, center: tuple[float, float],
              step: float = 1e-3) -> np.ndarray:
    """d log T_i / d (log compute_scale, log bandwidth_scale) at the fit, by central differences."""

    def logs_at(lc: float, lb: float) -> np.ndarray:
        a = base.replace(compute_scale=float(np.exp(lc)), bandwidth_scale=float(np.exp(lb)))
        return np.log([predict(o, a) for o in observations])

    lc, lb = center
    return np.stack([(logs_at(lc + step, lb) - logs_at(lc - step, lb)) / (2 * step),
                     (logs_at(lc, lb + step) - logs_at(lc, lb - step)) / (2 * step)], axis=1)


def t_quantile(p: float, dof: int) -> float:
    """The Student-t quantile ``t(p, dof)`` for p in (0.5, 1), dof >= 1, without scipy.

    Bisection on the CDF, itself Simpson's rule on the density over [0, t] (2000 intervals;
    within 1e-4 of the tables: t(0.975, 2) = 4.303, t(0.975, 10) = 2.228).
    """
    norm = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf_above_half(x: float, steps: int = 2000) -> float:
        h = x / steps
        f = [norm * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(steps + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf_above_half(hi) < p - 0.5:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_above_half(mid) < p - 0.5 else (lo, mid)
    return (lo + hi) / 2


def measured_on(observations: list[Observation]) -> dict[str, Any]:
    """The hardware and framework the trials ran on (what a calibration is only valid for)."""
    pools = {(p.gpu.name, p.gpus_per_node, p.intra_node.name, p.inter_node.name)
             for o in observations for p in o.cluster.pools}
    frameworks = sorted({o.framework for o in observations})
    if len(pools) != 1 or len(frameworks) != 1:
        raise SpecError(f"trials mix hardware {sorted(pools)} or frameworks {frameworks}; calibrate each separately")
    gpu, gpn, intra, inter = pools.pop()
    return {"gpu": gpu, "gpus_per_node": gpn, "intra_node": intra, "inter_node": inter, "framework": frameworks[0]}


def check_applies(path: str | Path, cluster: ClusterSpec, framework: str | None, *, force: bool = False) -> list[str]:
    """Whether a calibration file was measured on this cluster's hardware and this framework.

    Args:
        path: the calibration file.
        cluster: where it is about to be applied.
        framework: the framework the plans are for (None: not stated, not compared).
        force: apply it anyway; the differences come back as warnings.

    Returns:
        Warnings (differences when forced; a file that records nothing).

    Raises:
        SpecError: it was measured elsewhere and ``force`` is false.
    """
    doc = read_calibration(path)
    measured = doc.get("measured_on") or {}
    if not measured:
        return [f"{path} does not record the hardware it was measured on; applied as it is"]
    here = {"gpu": cluster.gpu_label, "gpus_per_node": cluster.gpus_per_node,
            "intra_node": "+".join(dict.fromkeys(p.intra_node.name for p in cluster.pools)),
            "inter_node": "+".join(dict.fromkeys(p.inter_node.name for p in cluster.pools)),
            "framework": framework}
    diff = [f"{k} {measured.get(k)!r} (here {here[k]!r})" for k in _MEASURED_KEYS
            if here[k] is not None and measured.get(k) is not None and measured.get(k) != here[k]]
    if not diff:
        return []
    text = f"measured on other hardware or framework: {', '.join(diff)}"
    if not force:
        raise SpecError(f"{text}; calibrate on this cluster, or pass --force to apply it anyway", source=str(path))
    return [f"{path}: {text}; applied anyway (--force)"]


def _nelder_mead(f: Any, start: tuple[float, float], step: float = 0.5, tol: float = 1e-5,
                 iterations: int = 200) -> tuple[float, float]:
    """Minimise ``f(x, y)`` from ``start`` (Nelder & Mead 1965, standard coefficients)."""
    pts = [np.array(start), np.array(start) + [step, 0.0], np.array(start) + [0.0, step]]
    vals = [f(*p) for p in pts]
    for _ in range(iterations):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol and np.abs(pts[-1] - pts[0]).max() < 1e-3:
            break
        mid = (pts[0] + pts[1]) / 2
        refl = mid + (mid - pts[2])
        fr = f(*refl)
        if fr < vals[0]:
            exp = mid + 2 * (mid - pts[2])
            fe = f(*exp)
            pts[2], vals[2] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[1]:
            pts[2], vals[2] = refl, fr
        else:
            con = mid + 0.5 * (pts[2] - mid)
            fc = f(*con)
            if fc < vals[2]:
                pts[2], vals[2] = con, fc
            else:  # shrink toward the best point
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(*p) for p in pts[1:]]
    best = int(np.argmin(vals))
    return float(pts[best][0]), float(pts[best][1])


def write_calibration(cal: Calibration, path: str | Path) -> Path:
    """Write ``calibration.yaml`` (what ``solve --calibration`` reads)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("# written by autoplace calibrate: measured/predicted factors fitted to benchmark trials\n"
                 + yaml.safe_dump(cal.to_dict(), sort_keys=False))
    return p


def read_calibration(path: str | Path) -> dict[str, Any]:
    """Load and check a calibration file strictly; returns the document.

    Raises:
        SpecError: unreadable file, unknown keys (listing the valid ones), non-positive factors.
    """
    from autoplace.specs._io import read_document

    src = str(path)
    doc = read_document(path)
    unknown = sorted(map(str, set(doc) - _TOP_KEYS))  # YAML keys may be numbers or null
    if unknown:
        raise SpecError(f"unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_TOP_KEYS))}", source=src)
    if doc.get("schema", SCHEMA) != SCHEMA:
        raise SpecError(f"schema must be {SCHEMA}, got {doc.get('schema')!r}", source=src, field="schema")
    values = doc.get("assumptions") or {}
    if not isinstance(values, dict):
        raise SpecError("expected a mapping of assumption names to numbers", source=src, field="assumptions")
    # numbers only: a flag or a choice (compiled, zero12_grad_reduce) is not a fitted factor
    valid = {f.name for f in dataclasses.fields(Assumptions)
             if isinstance(getattr(DEFAULT, f.name), (int, float)) and not isinstance(getattr(DEFAULT, f.name), bool)}
    for key, value in values.items():
        if key not in valid:
            what = "a flag or a choice, not a factor a calibration sets" if hasattr(DEFAULT, key) else "unknown assumption"
            raise SpecError(f"{what}; valid: {', '.join(sorted(valid))}", source=src, field=f"assumptions.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise SpecError(f"expected a positive number, got {value!r}", source=src, field=f"assumptions.{key}")
        if isinstance(getattr(DEFAULT, key), int) and value != int(value):
            raise SpecError(f"expected a whole number, got {value!r}", source=src, field=f"assumptions.{key}")
    uncertainty = doc.get("uncertainty") or {}
    if not isinstance(uncertainty, dict):
        raise SpecError(f"expected a mapping, got {uncertainty!r}", source=src, field="uncertainty")
    band = uncertainty.get("band_95")
    if band is not None and not (isinstance(band, list) and len(band) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in band)
            and 0 < band[0] <= 1 <= band[1]):
        raise SpecError(f"expected [low <= 1, high >= 1], got {band!r}", source=src, field="uncertainty.band_95")
    measured = doc.get("measured_on")
    if measured is not None and (not isinstance(measured, dict) or set(measured) - set(_MEASURED_KEYS)):
        raise SpecError(f"expected a mapping with keys among {', '.join(_MEASURED_KEYS)}, got {measured!r}",
                        source=src, field="measured_on")
    return doc


def load_calibration(path: str | Path, base: Assumptions = DEFAULT) -> Assumptions:
    """The assumptions a calibration file sets, on top of ``base``.

    Raises:
        SpecError: see :func:`read_calibration`.
    """
    values = read_calibration(path).get("assumptions") or {}
    return base.replace(**{k: (int(v) if isinstance(getattr(base, k), int) else float(v)) for k, v in values.items()})


def load_band(path: str | Path) -> tuple[float, float] | None:
    """The multiplicative 95 % band of a calibration file, or None when it has none (too few trials)."""
    band = (read_calibration(path).get("uncertainty") or {}).get("band_95")
    return (float(band[0]), float(band[1])) if band else None


def observations_from_study(model_path: str | Path, cluster_path: str | Path, storage: str, study: str, *,
                            include_deviations: bool = False) -> list[Observation]:
    """Every completed trial of a tune study as an Observation of the model the runtime built.

    A trial whose run departed from its plan's semantics (user attribute ``deviation``, e.g. ZeRO-2
    run as unresharded FSDP2) measured another plan than the one it is labelled with, so it is
    left out of the fit unless ``include_deviations``; the ones left out are logged.
    """
    import optuna

    from autoplace.cost.layers import layer_table
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.runtime.spec import scaled_model, scaled_plan
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model
    from autoplace.studies import open_storage

    model, cluster = load_model(model_path), load_cluster(cluster_path)
    store, _ = open_storage(storage, Path("."))
    st = optuna.load_study(study_name=study, storage=store)
    out, skipped = [], []
    for t in st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if t.value is None:
            continue
        if t.user_attrs.get("deviation") and not include_deviations:
            skipped.append(f"trial {t.number} ({t.user_attrs['deviation']})")
            continue
        small = scaled_model(model, float(t.user_attrs.get("scale", 1.0)))
        plan = build_plan(parse_plan_string(t.params["plan"]), world=cluster.gpus, blocks=layer_table(model).blocks,
                          global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)
        out.append(Observation(small, cluster, scaled_plan(plan, small.layers), float(t.value), f"trial {t.number}",
                               str(t.user_attrs.get("framework", "native"))))
    if skipped:
        log.warning("calibration leaves out %d trial(s) that ran another plan than their label: %s", len(skipped),
                    "; ".join(skipped))
    return out


def calibrate_study(model_path: str | Path, cluster_path: str | Path, storage: str, study: str,
                    out: str | Path = "calibration.yaml") -> Calibration:
    """Fit a tune study's completed trials and write ``out``; returns the calibration."""
    cal = fit(observations_from_study(model_path, cluster_path, storage, study))
    write_calibration(cal, out)
    return cal


def print_calibration(cal: Calibration) -> None:
    """Before/after error and the fitted factors, as rich text."""
    from autoplace.report import make_console

    c = make_console()  # never cut when piped (autoplace.report)
    a = cal.assumptions
    c.print(f"fitted on {cal.n} trials: compute_scale={a.compute_scale:.4g}, bandwidth_scale={a.bandwidth_scale:.4g}")
    c.print(f"step-time error before: mean {cal.error_before['mean_abs_rel']:.1%}, max {cal.error_before['max_abs_rel']:.1%}")
    c.print(f"step-time error after:  mean {cal.error_after['mean_abs_rel']:.1%}, max {cal.error_after['max_abs_rel']:.1%}")
    c.print(f"measured on: {', '.join(f'{k} {v}' for k, v in cal.measured_on.items())}")
    if cal.band is None:
        c.print(f"no 95% band: it needs >= {MIN_BAND_TRIALS} trials, got {cal.n}")
    else:
        c.print(f"95% band on a prediction (t-interval, factors' uncertainty included): "
                f"x{cal.band[0]:.3f} .. x{cal.band[1]:.3f}")
