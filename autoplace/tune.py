"""``autoplace tune``: benchmark the solver's top plans with real torch.distributed steps.

An Optuna study whose trials choose a plan among the CP-SAT top-K (a categorical over plan
strings) plus knobs the cost model cannot see (the DDP bucket size).  The top-K plans are
enqueued first, best predicted first; later trials are sampled (TPE).  Each trial launches
:mod:`autoplace.runtime.worker` with torchrun as a subprocess group under a timeout; measured
figures become trial user attributes.  A trial that crashes, runs out of memory or hangs is
told to the study as FAIL with its reason (``fail_reason``) and the study goes on.

Resuming: the candidate list is stored in the study on creation; a re-run loads the study
(SQLite by default, any Optuna RDB URL, or a journal file for many workers) and runs only
combinations no finished trial has run, until the study holds ``trials`` finished trials.
A sampled combination that was already run is told as PRUNED (``duplicate_of``), never re-run.

Interrupted trials: while a trial runs, a thread records its heartbeat in the storage.  A
worker killed mid-trial stops beating; once the grace period has passed, the next ask of any
worker (or a re-run) fails that trial and re-enqueues its combination (Optuna's
``RetryHeartbeatStaleTrialCallback``), so the study still measures every combination once.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autoplace.errors import BenchmarkError
from autoplace.plan import Plan, build_plan, parse_plan_string
from autoplace.studies import Heartbeat, beating, fail_stale_trials, open_storage

log = logging.getLogger("autoplace")

BUCKETS_MB = (25, 10, 50)  # DDP bucket_cap_mb choices; 25 (PyTorch's default) first
DEFAULT_FEATURES = frozenset({"hsdp", "cp", "ep", "interleave", "offload"})  # what the runtime implements


@dataclass
class TrialRecord:
    """One trial as the report shows it."""

    number: int
    plan: str
    bucket_mb: int
    state: str  # COMPLETE, FAIL, PRUNED (duplicate), RUNNING
    reason: str = ""
    predicted_step_s: float | None = None
    measured_step_s: float | None = None
    tokens_per_s: float | None = None
    peak_rss_bytes: int | None = None
    predicted_comm_bytes: dict[str, float] = field(default_factory=dict)
    measured_comm_bytes: dict[str, float] = field(default_factory=dict)


@dataclass
class TuneReport:
    """The study after this run: every trial, the best one and the files written."""

    study: str
    storage: str
    records: list[TrialRecord]
    ran: int  # trials run by this invocation
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> TrialRecord | None:
        done = [r for r in self.records if r.state == "COMPLETE" and r.measured_step_s is not None]
        return min(done, key=lambda r: r.measured_step_s or 0.0) if done else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``autoplace tune --json``."""
        best = self.best
        return {"study": self.study, "storage": self.storage, "ran": self.ran,
                "best": best.__dict__ if best else None, "trials": [r.__dict__ for r in self.records],
                "plots": [str(p) for p in self.plots], "notes": self.notes}


# ----------------------------------------------------------------------------------------
# storage and candidates


def top_candidates(model: Any, cluster: Any, top: int, time_limit_s: float = 10.0,
                   framework: str = "native") -> list[str]:
    """The CP-SAT top-K plans the runtime can run with ``framework``, as plan strings, best predicted first."""
    from autoplace.runtime.spec import unsupported_reason
    from solvers.problem import Budget, Problem
    from solvers.registry import get_solver

    result = get_solver("cpsat").solve(Problem(model, cluster, features=DEFAULT_FEATURES, top_k=top),
                                       Budget(time_limit_s=time_limit_s))
    plans = [ev.plan for ev in result.plans if unsupported_reason(ev.plan, framework) is None]
    if not plans:
        raise BenchmarkError(f"the solver found no plan the runtime can run (status {result.status})")
    return [p.to_string() for p in plans]


def _key(params: dict[str, Any]) -> tuple[str, int]:
    """Plan and bucket, the bucket folded to the default where it has no effect (not DDP)."""
    plan = parse_plan_string(params["plan"])
    ddp = plan.get("zero", 0) == 0 and plan.get("dp_replicate", 1) * plan.get("dp_shard", 1) > 1
    return params["plan"], int(params["bucket_mb"]) if ddp else BUCKETS_MB[0]


def _combos(candidates: list[str]) -> list[tuple[str, int]]:
    """Every distinct (plan, bucket) in priority order: each plan at the default bucket, then the rest."""
    first = [_key({"plan": c, "bucket_mb": BUCKETS_MB[0]}) for c in candidates]
    rest = [_key({"plan": c, "bucket_mb": b}) for c in candidates for b in BUCKETS_MB[1:]]
    return list(dict.fromkeys(first + rest))


# ----------------------------------------------------------------------------------------
# the study


def run_tune(model_path: str | Path, cluster_path: str | Path, trials: int = 3, top: int = 3,
             storage: str | None = None, study: str = "autoplace", launcher: str = "local",
             timeout_s: float = 300.0, out_dir: str | Path = "autoplace-tune", *, steps: int = 3, warmup: int = 1,
             scale: float = 1.0, candidates: list[str] | None = None, inject: dict[str, str] | None = None,
             solver_time_s: float = 10.0, seed: int = 0, progress: bool = True,
             heartbeat: Heartbeat | None = None, framework: str = "native") -> TuneReport:
    """Run (or resume) the study until it holds ``trials`` finished trials.

    Args:
        model_path, cluster_path: the job; trials run on ``cluster.gpus`` processes.
        trials: finished trials (complete or failed) the study should hold after this run.
        top: plans taken from CP-SAT (ignored when ``candidates`` is given).
        storage: Optuna storage URL or journal file; default ``sqlite:///OUT_DIR/study.db``.
        study: study name (resumed when it exists).
        launcher: ``local`` (torchrun on this host) or ``slurm`` (one submitit job per trial).
        timeout_s: per trial; past it the process group is killed and the trial fails as ``hang``.
        out_dir: trial directories, logs, default storage and plots.
        steps, warmup, scale: passed to the worker.
        candidates: plan strings to use instead of CP-SAT's top-K.
        inject: plan string -> ``crash|oom|hang``, a failure injected into that plan's trials (tests).
        heartbeat: when a trial whose worker died is failed and retried (default :class:`Heartbeat`).
        framework: ``native`` (PyTorch parallelism) or ``deepspeed`` (trials train with the
            ds_config.json autoplace emits for the plan; data-parallel plans only).

    Returns:
        A :class:`TuneReport`; print it with :func:`print_report`.
    """
    from autoplace.cost.layers import layer_table
    from autoplace.runtime.spec import scaled_model
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    if trials < 1 or launcher not in ("local", "slurm") or framework not in ("native", "deepspeed"):
        raise BenchmarkError(f"trials >= 1, launcher in (local, slurm) and framework in (native, deepspeed) must hold, "
                             f"but got trials={trials}, launcher={launcher!r}, framework={framework!r}")
    out = Path(out_dir)
    model, cluster = load_model(model_path), load_cluster(cluster_path)
    small = scaled_model(model, scale)
    hb = heartbeat or Heartbeat()
    store, url = open_storage(storage, out, hb)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = optuna.create_study(study_name=study, storage=store, direction="minimize", load_if_exists=True,
                             sampler=optuna.samplers.TPESampler(seed=seed))
    notes: list[str] = []
    cands = _study_candidates(st, candidates, model, cluster, top, solver_time_s, notes, framework)
    dists = {"plan": optuna.distributions.CategoricalDistribution(cands),
             "bucket_mb": optuna.distributions.CategoricalDistribution(list(BUCKETS_MB))}
    ctx = _Context(model_path=Path(model_path), model=model, small=small, cluster=cluster, out=out,
                   blocks=layer_table(model).blocks, launcher=launcher, timeout_s=timeout_s, steps=steps,
                   warmup=warmup, scale=scale, inject=inject or {}, storage=store, heartbeat=hb, framework=framework)
    ran = _loop(st, dists, _combos(cands), trials, ctx, progress, random.Random(seed), notes)
    report = TuneReport(study, url, [_record(t) for t in st.get_trials(deepcopy=False)], ran, notes=notes)
    report.plots = save_plots(st, out)
    return report


def _study_candidates(st: Any, given: list[str] | None, model: Any, cluster: Any, top: int,
                      solver_time_s: float, notes: list[str], framework: str) -> list[str]:
    """The candidate list stored in the study; set on creation, kept on resume."""
    stored = st.user_attrs.get("candidates")
    if stored:
        if given and list(given) != list(stored):
            notes.append("the study keeps the candidates it was created with; --top/candidates ignored")
        return list(stored)
    cands = list(given) if given else top_candidates(model, cluster, top, solver_time_s, framework)
    st.set_user_attr("candidates", cands)
    st.set_user_attr("model", model.name)
    return cands


@dataclass
class _Context:
    model_path: Path
    model: Any
    small: Any
    cluster: Any
    out: Path
    blocks: int
    launcher: str
    timeout_s: float
    steps: int
    warmup: int
    scale: float
    inject: dict[str, str]
    storage: Any
    heartbeat: Heartbeat
    framework: str


@dataclass
class _Snapshot:
    """The study as one loop iteration sees it."""

    finished: dict[tuple[str, int], int]  # combination -> trial number (COMPLETE or FAIL)
    busy: set[tuple[str, int]]  # combinations RUNNING (here or on a worker that may be dead) or queued
    waiting: bool  # a trial is queued: ask() pops it


def _snapshot(st: Any) -> _Snapshot:
    """Finished, busy and queued combinations.  A FAIL that was retried (its worker died) does
    not finish its combination: the retry, queued or running, stands for it."""
    trials = st.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    finished = {_key(t.params): t.number for t in trials
                if t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.number not in retried}
    pending = [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    busy = {_key(p) for t in pending if (p := t.params or t.system_attrs.get("fixed_params"))}
    return _Snapshot(finished, busy, any(t.state == TrialState.WAITING for t in trials))


def _loop(st: Any, dists: dict[str, Any], combos: list[tuple[str, int]], target: int, ctx: _Context,
          progress: bool, rng: random.Random, notes: list[str]) -> int:
    """Ask, skip duplicates, run, tell -- until ``target`` finished trials or the space is exhausted."""
    from rich.progress import Progress

    ran = 0
    idle_since: float | None = None
    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("trials", total=target)
        while True:
            fail_stale_trials(st)
            snap = _snapshot(st)
            bar.update(task, completed=min(len(snap.finished), target))
            if len(snap.finished) >= target:
                return ran
            untried = [c for c in combos if c not in snap.finished and c not in snap.busy]
            if not untried and not snap.waiting:
                idle_since = idle_since or time.monotonic()
                if _stop_waiting(snap, time.monotonic() - idle_since, ctx, notes):
                    return ran
                time.sleep(ctx.heartbeat.interval_s)
                continue
            idle_since = None
            first = [c for c in untried if c[1] == BUCKETS_MB[0]]
            if first and not snap.waiting:
                # the top-K at the default bucket first, in rank order; then TPE samples
                st.enqueue_trial({"plan": first[0][0], "bucket_mb": first[0][1]})
            trial = _ask(st, dists)
            key = _key(trial.params)
            if key in snap.finished:
                trial.set_user_attr("duplicate_of", snap.finished[key])
                st.tell(trial, state=TrialState.PRUNED)
                pick = rng.choice(untried)
                st.enqueue_trial({"plan": pick[0], "bucket_mb": pick[1]})
                continue
            bar.update(task, description=f"trial {trial.number}: {short_plan(key[0])}")
            _run_trial(st, trial, key, ctx)
            ran += 1


def _stop_waiting(snap: _Snapshot, waited_s: float, ctx: _Context, notes: list[str]) -> bool:
    """Whether to stop when nothing is left to start.  Combinations still RUNNING elsewhere
    either finish (a live worker: within the trial timeout) or go stale and come back as retries
    (a dead one: within the grace period); wait that long, no longer."""
    if not snap.busy:
        notes.append(f"every plan and knob combination has run ({len(snap.finished)} finished); stopping early")
        return True
    if waited_s > ctx.timeout_s + ctx.heartbeat.grace_s + ctx.heartbeat.interval_s:
        notes.append(f"{len(snap.busy)} combination(s) still RUNNING after {waited_s:.0f} s without a heartbeat "
                     "verdict; stopping")
        return True
    return False


def _ask(st: Any, dists: dict[str, Any]) -> Any:
    """``st.ask`` without Optuna's warning that heartbeats expect ``optimize`` (:func:`_beating` beats)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        return st.ask(dists)


def _run_trial(st: Any, trial: Any, key: tuple[str, int], ctx: _Context) -> None:
    """Measure one combination while its heartbeat beats, then tell the study."""
    study_id = ctx.storage.get_study_id_from_name(st.study_name)
    with beating(ctx.storage, study_id, trial.number, ctx.heartbeat.interval_s):
        value = _measure(trial, key, ctx)
    if value is None:
        st.tell(trial, state=TrialState.FAIL)
    else:
        st.tell(trial, value)


def _measure(trial: Any, key: tuple[str, int], ctx: _Context) -> float | None:
    """Launch the combination; its figures (or why it failed) become user attributes.

    Returns:
        The measured step time, or None when the run failed.
    """
    from autoplace.evaluation import evaluate
    from autoplace.runtime.spec import scaled_plan

    plan = build_plan(parse_plan_string(key[0]), world=ctx.cluster.gpus, blocks=ctx.blocks,
                      global_batch=ctx.model.training.global_batch, gpus_per_node=ctx.cluster.gpus_per_node)
    small_plan = scaled_plan(plan, ctx.small.layers)
    ev = evaluate(ctx.small, ctx.cluster, small_plan)
    trial.set_user_attr("predicted_step_time_s", ev.step_time_s)
    trial.set_user_attr("predicted_time_s", ev.time)
    trial.set_user_attr("predicted_comm_bytes", ev.comm)
    trial.set_user_attr("scale", ctx.scale)
    trial.set_user_attr("launcher", ctx.launcher)
    trial.set_user_attr("framework", ctx.framework)
    extra = ["--bucket-mb", str(key[1])]
    if key[0] in ctx.inject:
        extra += ["--fail", ctx.inject[key[0]]]
    outcome = launch_trial(ctx, plan, ctx.out / "trials" / f"{trial.number:04d}", extra)
    trial.set_user_attr("log", outcome.log)
    trial.set_user_attr("wall_s", outcome.wall_s)
    if not outcome.ok:
        reason = outcome.reason if outcome.status == "failed" else f"unsupported: {outcome.reason}"
        trial.set_user_attr("fail_reason", reason)
        trial.set_user_attr("error", outcome.error[:2000])
        log.warning("trial %d failed (%s): %s", trial.number, reason, outcome.error[:200])
        return None
    r = outcome.result
    if outcome.error:
        trial.set_user_attr("exit_note", outcome.error)
    trial.set_user_attr("measured_step_time_s", r["step_time_s"])
    trial.set_user_attr("tokens_per_s", r["tokens_per_s"])
    trial.set_user_attr("peak_rss_bytes", r["memory"]["peak_rss_bytes"])
    trial.set_user_attr("state_bytes_per_device", r["memory"]["state_bytes_per_device"])
    trial.set_user_attr("measured_comm_bytes", (r.get("collectives") or {}).get("ring_bytes_by_dim", {}))
    trial.set_user_attr("losses", r["losses"])
    return float(r["step_time_s"])


def launch_trial(ctx: _Context, plan: Plan, directory: Path, extra: list[str]) -> Any:
    """Run one trial with the chosen launcher; returns a :class:`~autoplace.runtime.launch.Outcome`."""
    from autoplace.runtime.launch import run_local

    if ctx.launcher == "local":
        return run_local(ctx.model, plan, directory, timeout_s=ctx.timeout_s, steps=ctx.steps, warmup=ctx.warmup,
                         scale=ctx.scale, framework=ctx.framework, extra=extra)
    from autoplace.runtime.slurm import run_slurm

    # a `cpu` device profile means CPU ranks (gloo, no GPUs requested), as in `autoplace submit`
    gpus = any(p.gpu.name != "cpu" for p in ctx.cluster.pools)
    return run_slurm(ctx.model, plan, directory, gpus_per_node=ctx.cluster.gpus_per_node, use_gpus=gpus,
                     timeout_s=ctx.timeout_s, steps=ctx.steps, warmup=ctx.warmup, scale=ctx.scale,
                     extra=[*extra, "--framework", ctx.framework])


# ----------------------------------------------------------------------------------------
# reporting


def _record(t: Any) -> TrialRecord:
    a = t.user_attrs
    plan = t.params.get("plan", "")
    return TrialRecord(
        number=t.number, plan=plan, bucket_mb=int(t.params.get("bucket_mb", BUCKETS_MB[0])), state=t.state.name,
        reason=_reason(t),
        predicted_step_s=a.get("predicted_step_time_s"), measured_step_s=a.get("measured_step_time_s"),
        tokens_per_s=a.get("tokens_per_s"), peak_rss_bytes=a.get("peak_rss_bytes"),
        predicted_comm_bytes=a.get("predicted_comm_bytes", {}), measured_comm_bytes=a.get("measured_comm_bytes", {}))


def _reason(t: Any) -> str:
    """Why a trial failed or was pruned, or which dead worker's trial it re-runs."""
    a = t.user_attrs
    if "fail_reason" in a:
        return str(a["fail_reason"])
    if "duplicate_of" in a:
        return f"duplicate of #{a['duplicate_of']}"
    if t.state == TrialState.FAIL:  # told by fail_stale_trials, not by a worker
        return "worker died (heartbeat stale)"
    retry_of = t.system_attrs.get("failed_trial")
    return f"retry of #{retry_of}" if retry_of is not None else ""


def short_plan(text: str) -> str:
    """The plan string without its default values, e.g. ``dp_shard=2 zero=3 mbs=4``."""
    defaults = {"dp_replicate": "1", "dp_shard": "1", "tp": "1", "pp": "1", "cp": "1", "ep": "1", "vpp": "1",
                "sp": "false", "schedule": "1f1b", "offload_optimizer": "none", "offload_params": "none",
                "recompute": "none"}
    parts = [p for p in text.split(",") if p and p.partition("=")[2] != defaults.get(p.partition("=")[0])]
    return " ".join(p for p in parts if not p.startswith("layers=") or ":" in p)


def save_plots(st: Any, out: Path) -> list[Path]:
    """Optuna's matplotlib plots as PNG files; none when matplotlib is missing or nothing completed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm
    except ImportError:
        return []
    if not any(t.state == TrialState.COMPLETE for t in st.get_trials(deepcopy=False)):
        return []
    written = []
    for name, fn in (("optimization_history", ovm.plot_optimization_history), ("slice", ovm.plot_slice)):
        try:
            with warnings.catch_warnings():  # optuna marks its matplotlib plots experimental
                warnings.simplefilter("ignore")
                ax = fn(st)
            first: Any = ax[0] if hasattr(ax, "__len__") else ax  # type: ignore[index]
            fig: Any = first.get_figure()
            path = out / f"{name}.png"
            fig.savefig(path, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
        except (ValueError, RuntimeError) as exc:  # e.g. too few trials for the plot
            log.info("plot %s skipped: %s", name, exc)
    return written


def print_report(report: TuneReport) -> None:
    """The trials as a rich table, predicted vs measured step time, then the best plan."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"study {report.study} ({report.storage})")
    for col in ("#", "plan", "bucket MB", "state", "pred s", "meas s", "meas/pred", "tok/s", "RSS MiB"):
        table.add_column(col, justify="left" if col in ("plan", "state") else "right", overflow="fold")
    for r in report.records:
        ratio = (f"{r.measured_step_s / r.predicted_step_s:.2f}" if r.measured_step_s and r.predicted_step_s else "")
        state = r.state + (f" ({r.reason})" if r.reason else "")
        table.add_row(str(r.number), short_plan(r.plan), str(r.bucket_mb), state, _num(r.predicted_step_s),
                      _num(r.measured_step_s), ratio, _num(r.tokens_per_s, 0),
                      _num(r.peak_rss_bytes / 2**20 if r.peak_rss_bytes else None, 0))
    c = Console()
    c.print(table)
    best = report.best
    if best:
        c.print(f"best measured: trial {best.number}, {short_plan(best.plan)} ({best.measured_step_s:.4f} s/step)")
    for note in report.notes:
        c.print(f"note: {note}")
    for p in report.plots:
        c.print(f"plot: {p}")


def _num(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"
