"""``autoplace tune``: benchmark the solver's top plans with real torch.distributed steps.

An Optuna study over a plan among the CP-SAT top-K (a categorical over plan strings) and knobs
the cost model cannot judge well: the DDP bucket size, and on GPU hosts NCCL's algorithm and
channel count (``NCCL_ALGO``, ``NCCL_MIN/MAX_NCHANNELS``).  The worker that creates the study
enqueues the top-K once, best predicted first, at the default knobs; when the queue is empty,
Optuna's TPESampler proposes (those top-K are its start-up trials).  A proposal some trial
already measured, or is measuring, is told PRUNED (``duplicate_of``) and never re-run; after
eight such proposals in a row the first unmeasured combination in priority order is queued.
Each trial launches :mod:`autoplace.runtime.worker` with torchrun as a subprocess group under a
timeout -- on this host, NCCL with one process per GPU for a GPU profile, gloo for ``cpu`` --
or as a Slurm job; measured figures become trial user attributes.  A trial that crashes, runs
out of memory or hangs is told to the study as FAIL with its reason (``fail_reason``) and the
study goes on.

Many workers, one study: any number of ``tune`` processes, on any hosts, may share a study in
an RDB (PostgreSQL) or a journal file.  Each pops queued trials atomically and claims a sampled
one against the others (:func:`autoplace.studies.claim`), so no combination runs twice, and a
worker starts a trial only while finished plus running trials stay under ``trials``: together
they leave the ledger one worker would.  Resuming is the same: a re-run joins the study, keeps
its stored candidates and runs only what no finished trial ran.

Interrupted trials: while a trial runs, a thread records its heartbeat in the storage.  A
worker killed at any point stops beating; once the grace period has passed, any live worker
(between trials or from its own trial's heartbeat thread) fails that trial and re-enqueues its
combination, up to ``Heartbeat.max_retry`` times per candidate (Optuna's
``RetryHeartbeatStaleTrialCallback``), so the study still measures every combination once (a
worker killed between failing a stale trial and queueing its retry leaves the retry to any other
worker, after the grace period).  A combination whose retries all died is *given up*: the report names it, ``autoplace tune`` exits
4, and the next invocation on the study enqueues it again (``revived``) -- a re-run finishes
exactly what was given up or left unmeasured.  Storage outages are waited out
(:mod:`autoplace.patience`).
"""

from __future__ import annotations

import itertools
import logging
import shlex
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autoplace.errors import BenchmarkError
from autoplace.plan import Plan, build_plan, parse_plan_string
from autoplace.studies import Heartbeat, beating, claim, dashboard_command, fail_stale_trials, open_storage, replaced

log = logging.getLogger("autoplace")

BUCKETS_MB = (25, 10, 50)  # DDP bucket_cap_mb choices; 25 (PyTorch's default) first
# NCCL_ALGO and NCCL_MIN/MAX_NCHANNELS choices on GPU hosts; NCCL's own choice ("default", 0) first
NCCL_ALGOS = ("default", "Ring", "Tree")
NCCL_CHANNELS = (0, 4, 8, 16)
DUPLICATE_PROPOSALS = 8  # TPE proposals in a row that were already measured before the next untried one is queued
DEFAULT_FEATURES = frozenset({"hsdp", "cp", "ep", "interleave", "offload"})  # what the runtime implements


@dataclass
class TrialRecord:
    """One trial as the report shows it."""

    number: int
    plan: str
    bucket_mb: int
    state: str  # COMPLETE, FAIL, PRUNED (duplicate), RUNNING
    nccl: str = ""  # NCCL knobs the trial set (GPU hosts), e.g. ``algo=Ring channels=8``
    reason: str = ""
    predicted_step_s: float | None = None
    measured_step_s: float | None = None
    tokens_per_s: float | None = None
    peak_rss_bytes: int | None = None
    predicted_comm_bytes: dict[str, float] = field(default_factory=dict)
    measured_comm_bytes: dict[str, float] = field(default_factory=dict)
    deviation: str | None = None  # how the trial departed from the plan's semantics, if it did

    @property
    def error(self) -> float | None:
        """The cost model's signed miss, measured / predicted - 1 (positive: slower than predicted)."""
        if self.measured_step_s is None or not self.predicted_step_s:
            return None
        return self.measured_step_s / self.predicted_step_s - 1

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``tune --json``: the fields and the signed error."""
        return {**self.__dict__, "error": self.error}


@dataclass
class TuneReport:
    """The study after this run: every trial, the best one and the files written."""

    study: str
    storage: str
    records: list[TrialRecord]
    ran: int  # trials run by this invocation
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)  # plans whose every retry died (a re-run revives them)
    unmeasured: list[str] = field(default_factory=list)  # plans left RUNNING without a verdict when this run stopped

    @property
    def incomplete(self) -> str:
        """Why the study is not done (``tune`` then exits 4), or ""."""
        parts = [f"given up after their retries died: {'; '.join(self.given_up)}" if self.given_up else "",
                 f"left unmeasured: {'; '.join(self.unmeasured)}" if self.unmeasured else ""]
        text = ", ".join(filter(None, parts))
        return f"candidate(s) {text}; run the same command again to finish exactly those" if text else ""

    @property
    def best(self) -> TrialRecord | None:
        done = [r for r in self.records if r.state == "COMPLETE" and r.measured_step_s is not None]
        return min(done, key=lambda r: r.measured_step_s or 0.0) if done else None

    @property
    def dashboard(self) -> list[str]:
        """The optuna-dashboard command that shows this study's trials in a browser."""
        return dashboard_command(self.storage)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``autoplace tune --json``."""
        best = self.best
        return {"study": self.study, "storage": self.storage, "dashboard": self.dashboard, "ran": self.ran,
                "best": best.to_dict() if best else None, "trials": [r.to_dict() for r in self.records],
                "plots": [str(p) for p in self.plots], "notes": self.notes, "given_up": self.given_up,
                "unmeasured": self.unmeasured}


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


Combo = tuple[str, int, str, int]  # plan, bucket_mb, nccl_algo, nccl_channels: what one trial measures


def _key(params: dict[str, Any]) -> Combo:
    """The combination a trial's parameters measure, knobs without effect folded to their default:
    the bucket outside DDP, the NCCL knobs where they were not sampled (CPU hosts, gloo)."""
    plan = parse_plan_string(params["plan"])
    ddp = plan.get("zero", 0) == 0 and plan.get("dp_replicate", 1) * plan.get("dp_shard", 1) > 1
    return (params["plan"], int(params["bucket_mb"]) if ddp else BUCKETS_MB[0],
            str(params.get("nccl_algo", NCCL_ALGOS[0])), int(params.get("nccl_channels", NCCL_CHANNELS[0])))


def _default(plan: str) -> Combo:
    return _key({"plan": plan, "bucket_mb": BUCKETS_MB[0]})


def _distributions(candidates: list[str], nccl: bool) -> dict[str, Any]:
    """The search space TPE samples after the enqueued top-K: the plan among the top-K and the
    knobs the cost model cannot judge well (DDP bucket size; NCCL algorithm and channels on GPUs)."""
    cat = optuna.distributions.CategoricalDistribution
    dists = {"plan": cat(candidates), "bucket_mb": cat(list(BUCKETS_MB))}
    if nccl:
        dists |= {"nccl_algo": cat(list(NCCL_ALGOS)), "nccl_channels": cat(list(NCCL_CHANNELS))}
    return dists


def _combos(candidates: list[str], dists: dict[str, Any]) -> list[Combo]:
    """Every distinct combination in priority order: each plan at the default knobs, then the rest."""
    grid = [dict(zip(dists, values, strict=True)) for values in itertools.product(*(d.choices for d in dists.values()))]
    rest = sorted({_key(g) for g in grid}, key=lambda c: (candidates.index(c[0]), c[1:]))
    return list(dict.fromkeys([_default(c) for c in candidates] + rest))


def _nccl_env(combo: Combo) -> dict[str, str]:
    """The environment that sets a combination's NCCL knobs (nothing for NCCL's own choice)."""
    env = {"NCCL_ALGO": combo[2]} if combo[2] != NCCL_ALGOS[0] else {}
    if combo[3]:
        env |= {"NCCL_MIN_NCHANNELS": str(combo[3]), "NCCL_MAX_NCHANNELS": str(combo[3])}
    return env


# ----------------------------------------------------------------------------------------
# the study


def run_tune(model_path: str | Path, cluster_path: str | Path, trials: int = 3, top: int = 3,
             storage: str | None = None, study: str = "autoplace", launcher: str = "local",
             timeout_s: float = 300.0, out_dir: str | Path = "autoplace-tune", *, steps: int = 3, warmup: int = 1,
             scale: float = 1.0, candidates: list[str] | None = None, inject: dict[str, str] | None = None,
             solver_time_s: float = 10.0, seed: int = 0, progress: bool = True,
             heartbeat: Heartbeat | None = None, framework: str = "native") -> TuneReport:
    """Run (or join, or resume) the study until it holds ``trials`` finished trials.

    Args:
        model_path, cluster_path: the job; trials run on ``cluster.gpus`` processes.
        trials: finished trials (complete or failed) the study should hold after this run.
        top: plans taken from CP-SAT (ignored when ``candidates`` is given).
        storage: Optuna storage URL (``postgresql://...`` for workers on many hosts) or journal
            file; default ``sqlite:///OUT_DIR/study.db``.
        study: study name (joined or resumed when it exists).
        launcher: ``local`` (torchrun on this host: NCCL, one process per GPU, for a GPU profile;
            gloo for a ``cpu`` one) or ``slurm`` (one submitit job per trial).
        timeout_s: per trial; past it the process group is killed and the trial fails as ``hang``.
        out_dir: trial directories, logs, default storage and plots.
        steps, warmup, scale: passed to the worker.
        candidates: plan strings to use instead of CP-SAT's top-K.
        inject: plan string -> ``crash|oom|hang``, a failure injected into that plan's trials (tests).
        seed: of the TPE sampler.
        heartbeat: when a trial whose worker died is failed and retried (default :class:`Heartbeat`).
        framework: ``native`` (PyTorch parallelism) or ``deepspeed`` (trials train with the
            ds_config.json autoplace emits for the plan; data-parallel plans only).

    Returns:
        A :class:`TuneReport`; print it with :func:`print_report`.

    Raises:
        SpecError: ``launcher="local"`` and the plans need more devices than this host has.
    """
    from autoplace.cost.layers import layer_table
    from autoplace.runtime.launch import local_launch, visible_devices
    from autoplace.runtime.spec import scaled_model
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    if trials < 1 or launcher not in ("local", "slurm") or framework not in ("native", "deepspeed"):
        raise BenchmarkError(f"trials >= 1, launcher in (local, slurm) and framework in (native, deepspeed) must hold, "
                             f"but got trials={trials}, launcher={launcher!r}, framework={framework!r}")
    out = Path(out_dir)
    model, cluster = load_model(model_path), load_cluster(cluster_path)
    small = scaled_model(model, scale)
    gpus = any(p.gpu.name != "cpu" for p in cluster.pools)  # a `cpu` profile: CPU ranks on gloo
    backend = "nccl" if gpus else "gloo"
    if launcher == "local":  # before any solve or storage: this host cannot run the plans at all
        backend = local_launch(gpus, visible_devices(gpus), cluster.gpus, cluster.name).backend
    hb = heartbeat or Heartbeat()
    store, url = open_storage(storage, out, hb)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    notes: list[str] = []
    nccl = launcher == "local" and backend == "nccl"  # NCCL knobs reach local ranks through their environment
    st, cands = _join_study(store, study, candidates, model, cluster, top, solver_time_s, notes, framework, nccl)
    # the enqueued top-K are TPE's start-up trials; after them it models what they measured
    st.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=len(cands))
    dists = _distributions(cands, nccl)
    ctx = _Context(model_path=Path(model_path), model=model, small=small, cluster=cluster, out=out,
                   blocks=layer_table(model).blocks, launcher=launcher, timeout_s=timeout_s, steps=steps,
                   warmup=warmup, scale=scale, inject=inject or {}, storage=store, heartbeat=hb, framework=framework,
                   backend=backend)
    _revive(st, _snapshot(st, hb.grace_s, hb.max_retry))  # what earlier runs gave up, this one runs again
    ran, stranded = _loop(st, dists, _combos(cands, dists), trials, ctx, progress, notes)
    records = [_record(t) for t in st.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    report = TuneReport(study, url, records, ran, notes=notes,
                        given_up=sorted({short_plan(c[0]) for c in _snapshot(st, hb.grace_s, hb.max_retry).given_up}),
                        unmeasured=sorted({short_plan(c[0]) for c in stranded}))
    report.plots = save_plots(st, out)
    return report


def _join_study(store: Any, name: str, given: list[str] | None, model: Any, cluster: Any, top: int,
                solver_time_s: float, notes: list[str], framework: str, nccl: bool) -> tuple[Any, list[str]]:
    """The study and its candidates.  The worker that creates the study (the storage lets exactly
    one succeed) stores the candidates and enqueues each once, best predicted first; workers that
    join wait for that list and keep it, as a re-run does."""
    try:
        st = optuna.load_study(study_name=name, storage=store)
    except KeyError:  # no such study yet
        cands = list(given) if given else top_candidates(model, cluster, top, solver_time_s, framework)
        try:
            st = optuna.create_study(study_name=name, storage=store, direction="minimize")
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it meanwhile
            st = optuna.load_study(study_name=name, storage=store)
        else:
            for plan in cands:
                st.enqueue_trial(_params(_default(plan), nccl))
            st.set_user_attr("model", model.name)
            st.set_user_attr("candidates", cands)  # last: joining workers wait for it
            return st, cands
    stored = _stored_candidates(st, max(60.0, 3 * solver_time_s))
    if given and list(given) != stored:
        notes.append("the study keeps the candidates it was created with; --top/candidates ignored")
    return st, stored


def _stored_candidates(st: Any, wait_s: float) -> list[str]:
    """The study's candidate list, waiting while its creator is still solving and enqueuing."""
    deadline = time.monotonic() + wait_s
    while not (stored := st.user_attrs.get("candidates")):
        if time.monotonic() > deadline:
            raise BenchmarkError(f"study {st.study_name!r} has no candidate list after {wait_s:.0f} s: the worker that "
                                 "created it died before storing one; delete the study and start again")
        time.sleep(0.5)
    return list(stored)


def _params(combo: Combo, nccl: bool) -> dict[str, Any]:
    """Trial parameters for ``combo``; the NCCL knobs only where they are sampled."""
    params: dict[str, Any] = {"plan": combo[0], "bucket_mb": combo[1]}
    return params | ({"nccl_algo": combo[2], "nccl_channels": combo[3]} if nccl else {})


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
    backend: str


@dataclass
class _Snapshot:
    """The study as one loop iteration sees it."""

    finished: dict[Combo, int]  # combination -> trial number (COMPLETE or FAIL)
    busy: set[Combo]  # combinations RUNNING (here or on a worker that may be dead) or queued
    running: int
    waiting: int  # queued trials: ask() pops the oldest
    given_up: dict[Combo, Any] = field(default_factory=dict)  # FAIL by heartbeat verdict, retries spent
    queued_done: int = 0  # queued trials whose combination finished meanwhile (a retry and a revival raced)
    dropped: list[Any] = field(default_factory=list)  # failed as stale, budget left, retry not (yet) queued


def _snapshot(st: Any, grace_s: float, max_retry: int | None = None) -> _Snapshot:
    """Finished, busy and queued combinations.  A FAIL that was retried (its worker died) does
    not finish its combination: the retry, queued or running, stands for it; one failed by a
    heartbeat verdict (no ``fail_reason``) whose ``max_retry`` retries are spent was given up
    (None: any such FAIL not retried).  A RUNNING trial without its parameters past the grace
    period belongs to a worker that died while asking: it does not count as running (the next
    sweep fails it)."""
    trials = st.get_trials(deepcopy=False)
    retried = replaced(trials)
    ended = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.number not in retried
             and {"plan", "bucket_mb"} <= set(t.params)]  # a worker that died while asking measured nothing
    verdicts = [t for t in ended if t.state == TrialState.FAIL and "fail_reason" not in t.user_attrs]
    spent = [t for t in verdicts if max_retry is None or len(t.system_attrs.get("retry_history", [])) >= max_retry]
    # a verdict with budget left whose retry was never queued: its sweeper died between the two writes
    dropped = [t for t in verdicts if t not in spent]
    finished = {_key(t.params): t.number for t in ended if t not in dropped}
    given_up = {_key(t.params): t for t in spent}
    pending = {t.number: (t, _combo(t)) for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)}
    now = datetime.now()
    running = [t for t, combo in pending.values() if t.state == TrialState.RUNNING and (
        combo or not t.datetime_start or (now - t.datetime_start).total_seconds() < grace_s)]
    queued_done = sum(t.state == TrialState.WAITING and c in finished for t, c in pending.values())
    return _Snapshot(finished, {c for _, c in pending.values() if c} | {_key(t.params) for t in dropped}, len(running),
                     sum(t.state == TrialState.WAITING for t, _ in pending.values()), given_up, queued_done, dropped)


def _requeue_dropped(st: Any, dropped: list[Any], ctx: _Context) -> None:
    """Queue the retry a sweeper failed to queue (it was killed, or the database went away, between
    failing a stale trial and queueing its retry) -- once the sweeper has had ``grace_s`` to do it.
    A race with a late sweeper queues a duplicate, which :func:`claim` prunes."""
    now = datetime.now()
    for t in dropped:
        if t.datetime_complete and (now - t.datetime_complete).total_seconds() > ctx.heartbeat.grace_s:
            log.info("trial %d was failed as stale but its retry was never queued; queueing it", t.number)
            ctx.storage.get_heartbeat_stale_trial_callback()(st, t)


def _revive(st: Any, snap: _Snapshot) -> None:
    """Queue each given-up combination once more (``revived``: a fresh retry budget).  Workers
    starting together may both queue one; :func:`claim` makes the later copy yield."""
    for combo, t in snap.given_up.items():
        if combo in snap.busy:  # another worker revived it already
            continue
        system = {"revived": [*t.system_attrs.get("revived", []), t.number]}
        if "fixed_params" in t.system_attrs:
            system["fixed_params"] = t.system_attrs["fixed_params"]
        st.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, params=t.params,
                                               distributions=t.distributions, system_attrs=system))
        log.info("trial %d was given up; queued again", t.number)


def _combo(t: Any) -> Combo | None:
    """A queued or running trial's combination; None while it is being asked (parameters partly set)."""
    params = t.system_attrs.get("fixed_params") or t.params
    return _key(params) if {"plan", "bucket_mb"} <= set(params) else None


def _loop(st: Any, dists: dict[str, Any], combos: list[Combo], target: int, ctx: _Context, progress: bool,
          notes: list[str]) -> tuple[int, set[Combo]]:
    """Pop or sample, claim, run, tell -- until ``target`` finished trials or the space is exhausted.

    A trial starts only while finished plus running trials stay under ``target``, so workers
    sharing the study stop where one worker would.  Queued trials (the top-K, retries) go first;
    then TPE proposes.  A proposal another trial already holds is told PRUNED (``duplicate_of``).

    Returns:
        Trials this worker ran, and the combinations it stopped waiting for (no verdict came).
    """
    from rich.progress import Progress

    ran = dups = 0
    idle_since: float | None = None
    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("trials", total=target)
        while True:
            fail_stale_trials(st)
            snap = _snapshot(st, ctx.heartbeat.grace_s, ctx.heartbeat.max_retry)
            _requeue_dropped(st, snap.dropped, ctx)
            bar.update(task, completed=min(len(snap.finished), target))
            if len(snap.finished) >= target and not snap.queued_done:
                return ran, set()
            untried = [c for c in combos if c not in snap.finished and c not in snap.busy]
            # a queued duplicate is popped and told PRUNED at once: no trial left WAITING for ever
            if not snap.queued_done and (len(snap.finished) + snap.running >= target or not (snap.waiting or untried)):
                idle_since = idle_since or time.monotonic()
                if _stop_waiting(snap, time.monotonic() - idle_since, ctx, notes):
                    return ran, snap.busy
                time.sleep(min(1.0, ctx.heartbeat.interval_s))
                continue
            idle_since = None
            if not snap.waiting:
                first = [c for c in untried if c == _default(c[0])]  # a study from before the top-K was enqueued
                if first or dups >= DUPLICATE_PROPOSALS:  # or TPE keeps proposing measured combinations
                    st.enqueue_trial(_params((first or untried)[0], "nccl_algo" in dists))
                    dups = 0
            try:
                trial = _ask(st, dists)
            except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale while it was being asked
                log.warning("a trial was failed as stale while this worker asked for it (it had not beaten yet: "
                            "a storage outage outlasted the grace period); asking again")
                continue
            key = _key(trial.params)
            bar.update(task, description=f"trial {trial.number}: {short_plan(key[0])}")
            if _claim_and_run(st, trial, key, ctx):
                dups, ran = 0, ran + 1
            else:
                dups += 1


def _tell_duplicate(st: Any, trial: Any, holder: int) -> None:
    """PRUNED, never re-run; the holder's measured time as the intermediate value TPE reads for
    pruned trials, so it learns from a repeated proposal instead of counting it as the worst."""
    trial.set_user_attr("duplicate_of", holder)
    done = next(t for t in st.get_trials(deepcopy=False) if t.number == holder)
    if done.state == TrialState.COMPLETE and done.value is not None:
        trial.report(done.value, 0)
    st.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)


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


def _claim_and_run(st: Any, trial: Any, key: Combo, ctx: _Context) -> bool:
    """Claim the trial's combination and measure it, or tell it PRUNED as another trial's duplicate.

    The trial beats from the moment it was asked, so a claim that waits for another worker's
    ask is not mistaken for a dead worker's trial.  The beat stops before the trial is told (a
    journal refuses beats on finished trials).

    Returns:
        Whether the trial ran.
    """
    study_id = ctx.storage.get_study_id_from_name(st.study_name)
    try:
        with beating(ctx.storage, study_id, trial.number, ctx.heartbeat.interval_s, sweep=lambda: fail_stale_trials(st)):
            holder = claim(st, trial.number, _key, patience_s=ctx.heartbeat.grace_s)
            value = _measure(trial, key, ctx) if holder is None else None
        if holder is not None:
            _tell_duplicate(st, trial, holder)
        elif value is None:  # skip_if_finished: another worker failed it as stale meanwhile (below)
            st.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        else:
            st.tell(trial, value, skip_if_finished=True)
    except optuna.exceptions.UpdateFinishedTrialError:  # judged dead while alive (its beats could not land)
        log.warning("trial %d was failed as stale while it ran (storage outage?); its retry measures it instead",
                    trial.number)
        return False
    return holder is None


def _measure(trial: Any, key: Combo, ctx: _Context) -> float | None:
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
    trial.set_user_attr("backend", ctx.backend)
    extra = ["--bucket-mb", str(key[1])]
    if key[0] in ctx.inject:
        extra += ["--fail", ctx.inject[key[0]]]
    outcome = launch_trial(ctx, plan, ctx.out / "trials" / f"{trial.number:04d}", extra, _nccl_env(key))
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
    # what the trial really ran: the plan's semantics, or a labelled deviation calibrate leaves out
    trial.set_user_attr("deviation", r.get("deviation"))
    trial.set_user_attr("semantics", "deviation" if r.get("deviation") else "exact")
    return float(r["step_time_s"])


def launch_trial(ctx: _Context, plan: Plan, directory: Path, extra: list[str], env: dict[str, str]) -> Any:
    """Run one trial with the chosen launcher; returns a :class:`~autoplace.runtime.launch.Outcome`.

    ``env`` (NCCL knobs) reaches local ranks only: a Slurm job keeps the environment it is given."""
    from autoplace.runtime.launch import run_local

    if ctx.launcher == "local":
        return run_local(ctx.model, plan, directory, timeout_s=ctx.timeout_s, steps=ctx.steps, warmup=ctx.warmup,
                         scale=ctx.scale, backend=ctx.backend, framework=ctx.framework, extra=extra, env=env)
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
        nccl=" ".join(f"{k.removeprefix('nccl_')}={v}" for k, v in t.params.items() if k.startswith("nccl_")),
        reason=_reason(t),
        predicted_step_s=a.get("predicted_step_time_s"), measured_step_s=a.get("measured_step_time_s"),
        tokens_per_s=a.get("tokens_per_s"), peak_rss_bytes=a.get("peak_rss_bytes"),
        predicted_comm_bytes=a.get("predicted_comm_bytes", {}), measured_comm_bytes=a.get("measured_comm_bytes", {}),
        deviation=a.get("deviation"))


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
    out.mkdir(parents=True, exist_ok=True)  # a worker on a shared storage may have run nothing here
    written = []
    for name, fn in (("optimization_history", ovm.plot_optimization_history), ("slice", ovm.plot_slice)):
        try:
            # optuna marks its matplotlib plots experimental, and sets plt.style "ggplot" for good
            # (optuna/visualization/matplotlib/_optimization_history.py, 4.x): kept to its own plots
            with warnings.catch_warnings(), matplotlib.rc_context():
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
    from rich.table import Table

    from autoplace.report import make_console

    table = Table(title=f"study {report.study} ({report.storage})")
    for col in ("#", "plan", "bucket MB", "state", "pred s", "meas s", "meas/pred", "tok/s", "RSS MiB"):
        table.add_column(col, justify="left" if col in ("plan", "state") else "right", overflow="fold")
    for r in report.records:
        ratio = (f"{r.measured_step_s / r.predicted_step_s:.2f}" if r.measured_step_s and r.predicted_step_s else "")
        state = r.state + (f" ({r.reason})" if r.reason else "")
        table.add_row(str(r.number), " ".join(filter(None, [short_plan(r.plan), r.nccl])), str(r.bucket_mb), state, _num(r.predicted_step_s),
                      _num(r.measured_step_s), ratio, _num(r.tokens_per_s, 0),
                      _num(r.peak_rss_bytes / 2**20 if r.peak_rss_bytes else None, 0))
    c = make_console()  # never cut when piped (autoplace.report)
    c.print(table)
    best = report.best
    if best:
        c.print(f"best measured: trial {best.number}, {short_plan(best.plan)} ({best.measured_step_s:.4f} s/step)")
    for r in report.records:
        if r.deviation:
            c.print(f"trial {r.number} deviates from its plan (left out of calibrate): {r.deviation}")
    for note in report.notes:
        c.print(f"note: {note}")
    for p in report.plots:
        c.print(f"plot: {p}")
    c.print(f"dashboard: {shlex.join(report.dashboard)}", soft_wrap=True)


def _num(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"
