"""Leave-one-source-out error of the development set (issue 35 item 7).

The calibration factors (``compute_scale``, ``bandwidth_scale``: autoplace/calibrate.py) are
fitted to the development runs of every source but one, and that source's runs are predicted
with them; every run is so scored by a fit that never saw its source.  Beside it: the
uncalibrated error (the shipped assumptions) and the in-sample one (one fit on every source).
A source whose held-out error is much worse than its in-sample error is one whose runs the
model fits only with their own help: the signal the issue asks for.

A source is the publication a run comes from (:func:`source_of`): the repository and file
for a run read from a repository (any commit), the citation before its first comma for a paper.

The fits use calibrate.fit_log_factors (the same objective and minimiser as ``autoplace
calibrate``) on a surrogate of each run's step time, linear in the two factors:
``T(c, b) = T0 + A (c - 1) + B (b - 1)``, A and B secants from two extra evaluations (c or b
at SECANT).  Compute terms scale with c and link transfers with b, so the surrogate is exact
but for where overlap switches a term between hidden and exposed; it lets 16 fits of ~500
objective evaluations each cost three evaluations per run in all.  The errors reported are
the evaluator's own at the fitted factors, never the surrogate's; the surrogate's largest
miss at them is printed beside.

Only the development set (tests/reference) is read here; the held-out sources of
/work/shared/DEVELOPERS.md are never fitted to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from autoplace.calibrate import fit_log_factors
from autoplace.validation import PublishedRun, predict

SECANT = 1.25  # where the secants are taken: every fit on the development set lands within x0.96..x1.13
LOSO_GAP = 0.05  # held-out MAPE this much above in-sample (absolute) marks a source that fits only itself


def source_of(run: PublishedRun) -> str:
    """The publication a run comes from: ``owner/repo path`` for a repository's file (the commit and
    table left out: one source re-measured over commits is still one source), else the citation
    before its first comma (``Narayanan et al. 2021``)."""
    words = run.source.split()
    if words and "/" in words[0] and len(words) > 1:
        return f"{words[0]} {words[1]}"
    return run.source.split(",")[0].strip()


def step_time(run: PublishedRun, compute: float, bandwidth: float) -> float:
    """The evaluator's step time of ``run`` under its framework's assumptions with the two factors set."""
    return predict(run, run.assumptions.replace(compute_scale=compute, bandwidth_scale=bandwidth))[1].step_time_s


def surrogate(base: np.ndarray, steps: Callable[[float, float], np.ndarray]) -> np.ndarray:
    """``[n, 3]``: T0 (``base``) and the secants A, B of each run's step time in compute_scale and
    bandwidth_scale, from ``steps(c, b)``, every run's step time under the factors."""
    dc = steps(SECANT, 1.0) - base
    db = steps(1.0, SECANT) - base
    return np.stack([base, dc / (SECANT - 1), db / (SECANT - 1)], axis=1)


def at(coef: np.ndarray, lc: float, lb: float) -> np.ndarray:
    """The surrogate's step times at log factors (lc, lb), kept positive (a secant across a regime
    change can extrapolate below zero far from 1)."""
    t = coef[:, 0] + coef[:, 1] * (np.exp(lc) - 1) + coef[:, 2] * (np.exp(lb) - 1)
    return np.maximum(t, 1e-3 * coef[:, 0])


def fit_without(measured_s: np.ndarray, coef: np.ndarray, keep: np.ndarray) -> tuple[float, float]:
    """(compute_scale, bandwidth_scale) fitted to the runs ``keep`` selects."""
    logs = np.log(measured_s[keep])
    lc, lb = fit_log_factors(logs, lambda x, y: np.log(at(coef[keep], x, y)))
    return float(np.exp(lc)), float(np.exp(lb))


@dataclass(frozen=True)
class SourceScore:
    """One source held out: its runs' errors (predicted / measured - 1 of their metric)."""

    source: str
    runs: int
    factors: tuple[float, float]  # fitted on every other source
    held_out: np.ndarray
    in_sample: np.ndarray  # under the fit on every source
    uncalibrated: np.ndarray

    @property
    def gap(self) -> float:
        """How much worse the source is predicted without its own runs in the fit (MAPE, absolute)."""
        return mape(self.held_out) - mape(self.in_sample)


def mape(errors: np.ndarray) -> float:
    return float(np.mean(np.abs(errors)))


def leave_one_source_out(sources: Sequence[str], measured_s: np.ndarray, coef: np.ndarray,
                         steps_at: Callable[[np.ndarray, float, float], np.ndarray]) -> dict[str, object]:
    """Fit on every source but one, for each source, and score the held-out runs.

    Args:
        sources: each run's source.
        measured_s: each run's measured step time (what its metric amounts to in seconds).
        coef: the runs' surrogate (:func:`surrogate`).
        steps_at: the step times of the runs a mask selects under factors (c, b): the evaluator's
            in the benchmark, so no reported error is the surrogate's.

    Returns:
        ``{"all": (c, b), "scores": [SourceScore, ...], "miss": largest |log| surrogate miss at a fit}``.
    """
    src = np.asarray(sources)
    everything = np.ones(len(src), bool)
    both = fit_without(measured_s, coef, everything)
    base = coef[:, 0]
    fitted_all = steps_at(everything, *both)
    misses = [np.abs(np.log(at(coef, *np.log(both)) / fitted_all)).max()]
    scores = []
    for name in dict.fromkeys(sources):
        mine = src == name
        factors = fit_without(measured_s, coef, ~mine) if (~mine).any() else (1.0, 1.0)
        held = steps_at(mine, *factors)
        misses.append(np.abs(np.log(at(coef[mine], *np.log(factors)) / held)).max())
        scores.append(SourceScore(name, int(mine.sum()), factors, measured_s[mine] / held - 1,
                                  measured_s[mine] / fitted_all[mine] - 1, measured_s[mine] / base[mine] - 1))
    return {"all": both, "scores": scores, "miss": float(max(misses))}


def score_runs(runs: Sequence[PublishedRun], rows: Sequence[dict[str, object]]) -> dict[str, object]:
    """:func:`leave_one_source_out` over the development runs; ``rows`` are benchmarks/published.py's
    uncalibrated scores (their step time and predicted metric; every metric is inverse in step time)."""
    base = np.array([float(r["step_time_s"]) for r in rows])  # type: ignore[arg-type]
    # the measured metric as a step time: the predicted one rescaled by predicted / measured
    measured_s = base * np.array([float(r["predicted"]) / float(r["measured"]) for r in rows])  # type: ignore[arg-type]

    def steps_at(mask: np.ndarray, c: float, b: float) -> np.ndarray:
        return np.array([step_time(r, c, b) for r, m in zip(runs, mask, strict=True) if m])

    coef = surrogate(base, lambda c, b: steps_at(np.ones(len(runs), bool), c, b))
    return leave_one_source_out([source_of(r) for r in runs], measured_s, coef, steps_at)


def headline(result: dict[str, object]) -> dict[str, dict[str, float]]:
    """MAPE and mean signed error over every run: uncalibrated, in-sample fit, leave-one-source-out."""
    scores: list[SourceScore] = result["scores"]  # type: ignore[assignment]
    out = {}
    for name in ("uncalibrated", "in_sample", "held_out"):
        e = np.concatenate([getattr(s, name) for s in scores])
        out[name] = {"n": len(e), "mape": mape(e), "mean_signed": float(np.mean(e))}
    return out


def to_json(result: dict[str, object]) -> dict[str, object]:
    """The section as plain data for ``--json``."""
    scores: list[SourceScore] = result["scores"]  # type: ignore[assignment]
    c, b = result["all"]  # type: ignore[misc]
    return {"fit_all": {"compute_scale": c, "bandwidth_scale": b}, "surrogate_max_log_miss": result["miss"],
            "headline": headline(result),
            "sources": [{"source": s.source, "runs": s.runs, "compute_scale": s.factors[0], "bandwidth_scale": s.factors[1],
                         "held_out_mape": mape(s.held_out), "held_out_signed": float(np.mean(s.held_out)),
                         "in_sample_mape": mape(s.in_sample), "uncalibrated_mape": mape(s.uncalibrated),
                         "uncalibrated_signed": float(np.mean(s.uncalibrated))} for s in scores],
            "fits_only_itself": [s.source for s in scores if s.gap > LOSO_GAP]}


def print_loso(console: Console, result: dict[str, object]) -> None:
    """The per-source table, the headline and the sources that fit only themselves."""
    scores: list[SourceScore] = result["scores"]  # type: ignore[assignment]
    table = Table(title="Leave one source out: fit compute_scale, bandwidth_scale on every other source, predict this one")
    table.add_column("source (repository file, or paper)", no_wrap=True)
    for col in ("runs", "compute", "bandwidth", "LOSO MAPE", "LOSO signed", "in-sample MAPE", "uncal. MAPE",
                "uncal. signed"):
        table.add_column(col, justify="right")
    for s in scores:
        table.add_row(s.source[:64], str(s.runs), f"x{s.factors[0]:.3f}", f"x{s.factors[1]:.3f}", f"{mape(s.held_out):.1%}",
                      f"{np.mean(s.held_out):+.1%}", f"{mape(s.in_sample):.1%}", f"{mape(s.uncalibrated):.1%}",
                      f"{np.mean(s.uncalibrated):+.1%}")
    console.print(table)
    h = headline(result)
    c, b = result["all"]  # type: ignore[misc]
    console.print(f"headline over {h['held_out']['n']} runs -- leave-one-source-out: MAPE {h['held_out']['mape']:.1%}, "
                  f"mean signed {h['held_out']['mean_signed']:+.1%}; in-sample fit (compute x{c:.3f}, bandwidth x{b:.3f}): "
                  f"{h['in_sample']['mape']:.1%}, {h['in_sample']['mean_signed']:+.1%}; uncalibrated: "
                  f"{h['uncalibrated']['mape']:.1%}, {h['uncalibrated']['mean_signed']:+.1%} "
                  f"(surrogate's largest miss at a fit: {result['miss']:.1%} in log step time)")
    worse = sorted((s for s in scores if s.gap > LOSO_GAP), key=lambda s: -s.gap)
    said = "; ".join(f"{s.source} ({s.runs} runs): {mape(s.held_out):.1%} held out vs {mape(s.in_sample):.1%} in sample"
                     for s in worse)
    top = max(scores, key=lambda s: s.gap)
    console.print(f"sources predicted > {LOSO_GAP:.0%} (MAPE) worse held out than in sample: {said or 'none'} "
                  f"(largest: {top.source}, {mape(top.held_out):.1%} vs {mape(top.in_sample):.1%})")
