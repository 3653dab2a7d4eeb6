"""``autoplace scale``: the best plan at every GPU count, and what a token budget costs at each.

The sweep is one orchestrator over small steps: the cluster at each size (:func:`cluster_at`),
one solve per size (:func:`best_plan`, the same search ``autoplace solve`` runs), the running
best kept so throughput never drops (:func:`sweep`), then efficiency, time and cost per row and
the row an objective picks (:func:`choose`).

Two conventions, stated in the output:

- The global batch is the model's (or ``--global-batch``) at every size: it is a training
  decision (learning rate, tokens per step, the critical batch), not something the cluster
  should change behind the user's back.  A list of batches lets the sweep choose per size.
- A plan found at N GPUs that is slower than the best at fewer GPUs (the batch does not divide,
  or the search hit its time limit) is replaced by that smaller plan on a subset of the N GPUs;
  the row says so, and its cost still pays for all N.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from autoplace.errors import Infeasible, SpecError
from autoplace.evaluation import Evaluation
from autoplace.frameworks import ANY, search
from autoplace.planning import TrainingCost, short_amount, tokens_at_batch, training_cost
from autoplace.ranking import DEFAULT_RANK, depth, rerank
from autoplace.report import fold
from autoplace.solving import step_band
from autoplace.specs.cluster import ClusterSpec, cluster_from_flags
from autoplace.specs.model import ModelSpec, with_overrides

log = logging.getLogger("autoplace")


@dataclass(frozen=True)
class SweepOptions:
    """How each size is searched and judged.

    Attributes:
        framework: as ``solve --framework`` (``none``: the theoretical optimum, fastest to search).
        features: what the search may use (None: solve's defaults).
        time_limit_s, workers, seed: the budget of each size's solve.
        tokens: the token budget (None: no time or cost columns).
        price_per_gpu_hour: dollars per GPU-hour (None: GPU-hours are the cost).
        objective: ``time`` (fastest to the budget) or ``cost`` (cheapest within the deadline).
        days: the deadline to train ``tokens`` in (``--days``): the cheapest size is the cheapest
            within it, and with it a sweep whose every size takes longer is infeasible; None: the
            cheapest is held to :data:`DEFAULT_DAYS` (:attr:`deadline`).
        critical_tokens: B_crit in tokens, to compare global batches fairly (None: batches are
            compared by throughput alone).
        rank: which plan each size keeps, as ``solve --rank`` (autoplace/ranking.py).
    """

    framework: str = ANY
    features: frozenset[str] | None = None
    time_limit_s: float = 2.0
    workers: int = 2
    seed: int = 0
    tokens: float | None = None
    price_per_gpu_hour: float | None = None
    objective: str = "time"
    days: float | None = None
    critical_tokens: float | None = None
    rank: str = DEFAULT_RANK

    @property
    def deadline(self) -> float:
        """The days the cheapest size must train the budget within: ``days``, else the default."""
        return DEFAULT_DAYS if self.days is None else self.days


# The deadline the cheapest size is held to when --days gives none: a quarter.  A cost optimum with
# no deadline is the smallest cluster, which trains a pre-training budget in decades (Llama-3-70B's
# 15T tokens on 8 H100: 56 years); published pre-training runs took two to four months of wall time
# (DeepSeek-V3: "less than two months", arXiv 2412.19437 sec. 1; BLOOM-176B: about 3.5 months,
# arXiv 2211.05100), so a plan is held to about a quarter unless its user says otherwise.
DEFAULT_DAYS = 90.0
DEFAULT_DAYS_WHY = "the default: published pre-training runs took two to four months; --days sets yours"


@dataclass(frozen=True)
class SweepPoint:
    """One GPU count: the plan run there and what it buys.

    Attributes:
        evaluation: the plan (None when nothing fits at this size or below).
        used_gpus: GPUs the plan runs on; fewer than ``gpus`` when a smaller plan was kept.
        found_tokens_per_s: what the search found at this size itself (None: nothing fits).
        effective_tokens_per_s: throughput scaled to the reference batch's data efficiency
            (equals tokens/s when one global batch is swept).
    """

    gpus: int
    cluster: str
    evaluation: Evaluation | None
    used_gpus: int
    global_batch: int
    status: str
    solve_s: float
    found_tokens_per_s: float | None
    effective_tokens_per_s: float
    frameworks: list[str] = field(default_factory=list)
    efficiency: float | None = None
    cost: TrainingCost | None = None
    note: str = ""
    ranking: dict[str, Any] | None = None  # how the plan was ranked (autoplace.ranking.summary)

    @property
    def tokens_per_s(self) -> float:
        return self.evaluation.tokens_per_s if self.evaluation is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        ev = self.evaluation
        return {"gpus": self.gpus, "cluster": self.cluster, "used_gpus": self.used_gpus,
                "global_batch": self.global_batch, "status": self.status, "solve_seconds": round(self.solve_s, 3),
                "tokens_per_s": round(self.tokens_per_s, 3),
                "found_tokens_per_s": None if self.found_tokens_per_s is None else round(self.found_tokens_per_s, 3),
                "effective_tokens_per_s": round(self.effective_tokens_per_s, 3),
                "mfu": round(ev.mfu * self.used_gpus / self.gpus, 5) if ev else None,
                "scaling_efficiency": None if self.efficiency is None else round(self.efficiency, 5),
                "training_cost": self.cost.to_dict() if self.cost else None, "note": self.note,
                "frameworks": self.frameworks, "plan": {**ev.to_dict(), "plan": ev.plan.to_string()} if ev else None,
                "ranking": _ranking_json(self.ranking)}


def _ranking_json(ranking: dict[str, Any] | None) -> dict[str, Any] | None:
    """A size's ranking with the chosen plan's parts (``complexity``, ``moving_parts``) inlined."""
    if not ranking:
        return None
    return {**{k: v for k, v in ranking.items() if k != "plans"}, **(ranking["plans"][0] if ranking["plans"] else {})}


def cluster_at(gpus: int, *, gpu: str | None = None, unit: ClusterSpec | None = None) -> ClusterSpec:
    """The cluster of ``gpus`` GPUs: whole nodes of the GPU profile's reference node (or of the
    unit cluster file's node: its GPU, links and host memory); fewer GPUs than a node is one node.

    Raises:
        SpecError: a count that is not a whole number of nodes, or a unit with several pools.
    """
    if unit is not None:
        return _sized(gpus, lambda: _replicated(unit, gpus))
    from autoplace.specs.cluster import gpu_profile_name, load_profile

    name = gpu_profile_name(gpu or "")
    gpn = load_profile("gpu", name).default_gpus_per_node
    if gpus < gpn:
        return cluster_from_flags(name, 1, gpus_per_node=gpus, name=f"1x{gpus}x{name}")
    if gpus % gpn:
        raise SpecError(f"{gpus} GPUs is not a whole number of {gpn}-GPU nodes", source="--gpus")
    return _sized(gpus, lambda: cluster_from_flags(name, gpus // gpn, gpus_per_node=gpn))


def _sized(gpus: int, build: Callable[[], ClusterSpec]) -> ClusterSpec:
    """``build()``; a cluster of that size refused (too many nodes) is --gpus's error, the size named."""
    try:
        return build()
    except SpecError as exc:
        raise SpecError(f"{gpus:,} GPUs: {exc.field + ': ' if exc.field else ''}{exc.detail}", source="--gpus") from None


def _replicated(unit: ClusterSpec, gpus: int) -> ClusterSpec:
    """``gpus`` GPUs of the unit file's node, its links (named or inline) and host memory kept."""
    if len(unit.pools) != 1:
        raise SpecError(f"a cluster file with {len(unit.pools)} pools cannot be replicated; give one pool",
                        source="--cluster-unit")
    pool = unit.pools[0]
    gpn = min(pool.gpus_per_node, gpus)
    if gpus % gpn:
        raise SpecError(f"{gpus} GPUs is not a whole number of {gpn}-GPU nodes", source="--gpus")
    nodes = gpus // gpn
    domain = min(pool.nvlink_domain, gpus) if pool.nvlink_domain > gpn else gpn
    resized = pool.model_copy(update={"nodes": nodes, "gpus_per_node": gpn, "nvlink_domain": domain})
    return unit.model_copy(update={"name": f"{nodes}x{gpn}x{pool.gpu.name}", "pools": (resized,)})


class Found(NamedTuple):
    """What one size's search found: the plan (None: nothing fits), the solve status, seconds, and
    how it was ranked (``autoplace.ranking``; None when nothing was ranked)."""

    evaluation: Evaluation | None
    status: str
    seconds: float
    ranking: dict[str, Any] | None = None


def best_plan(model: ModelSpec, cluster: ClusterSpec, opts: SweepOptions) -> Found:
    """The plan ``opts.rank`` puts first (the fastest, or robust: the simplest within the band of
    the fastest), the solve status and seconds: ``autoplace solve``'s search and ranking, top 1."""
    from solvers.problem import Budget
    from solvers.registry import get_solver

    t0 = time.perf_counter()
    budget = Budget(time_limit_s=opts.time_limit_s, workers=opts.workers, seed=opts.seed)
    deep = depth(1, opts.rank)
    try:
        features = set(opts.features) if opts.features is not None else _features()
        problem = search.problem_for(opts.framework, model, cluster, fixed={}, features=features,
                                     objective="time", top_k=deep)
        result = rerank(search.solve(opts.framework, get_solver("cpsat"), problem, budget, deep), problem.model,
                        cluster, step_band(cluster, None)[0], 1, opts.rank, what="the plan")
    except Infeasible:
        return Found(None, "infeasible", time.perf_counter() - t0)
    return Found(result.plans[0] if result.plans else None, result.status, time.perf_counter() - t0,
                 result.ranking if result.plans else None)


def _features() -> set[str]:
    from solvers.problem import DEFAULT_FEATURES

    return set(DEFAULT_FEATURES)


def sweep(model: ModelSpec, counts: list[int], opts: SweepOptions, *, gpu: str | None = None,
          unit: ClusterSpec | None = None, batches: list[int] | None = None) -> list[SweepPoint]:
    """The best plan at every count (ascending), never slower than a smaller count's plan."""
    batches = batches or [model.training.global_batch]
    reference = batches[0] * model.seq_len  # effective throughput is measured against the first batch
    points: list[SweepPoint] = []
    best: SweepPoint | None = None
    # every size's cluster before any search: a size no cluster can have is refused at once, not
    # after the smaller sizes' searches
    clusters = [cluster_at(gpus, gpu=gpu, unit=unit) for gpus in sorted(counts)]
    for cluster in clusters:
        found = [_at_batch(model, cluster, b, opts, reference) for b in batches]
        point = max(found, key=lambda p: p.effective_tokens_per_s)
        point = replace(point, solve_s=sum(p.solve_s for p in found))
        if best is not None and best.effective_tokens_per_s > point.effective_tokens_per_s:
            point = _keep_smaller(point, best)
        elif point.evaluation is not None:
            point = replace(point, frameworks=search.runnable_by(point.evaluation.plan,
                                                                 _batched(model, point.global_batch), cluster))
        points.append(point)
        if point.evaluation is not None:
            best = point
    return _finish(points, opts)


def _at_batch(model: ModelSpec, cluster: ClusterSpec, batch: int, opts: SweepOptions, reference: float) -> SweepPoint:
    m = _batched(model, batch)
    ev, status, seconds, ranking = Found(*best_plan(m, cluster, opts))
    tps = ev.tokens_per_s if ev else 0.0
    if ev and opts.critical_tokens:  # the same loss needs more tokens at a larger batch (McCandlish Sec. 2.3)
        tps *= 1.0 / tokens_at_batch(1.0, batch * model.seq_len, reference, opts.critical_tokens)
    return SweepPoint(cluster.gpus, cluster.name, ev, cluster.gpus, batch, status, seconds,
                      ev.tokens_per_s if ev else None, tps, ranking=ranking)


def _batched(model: ModelSpec, batch: int) -> ModelSpec:
    if batch == model.training.global_batch:
        return model
    return with_overrides(model, {"global_batch": batch}, source="--global-batch")


def _keep_smaller(point: SweepPoint, best: SweepPoint) -> SweepPoint:
    """The smaller count's plan on a subset of ``point``'s GPUs, with why."""
    found = ("no plan fits" if point.found_tokens_per_s is None
             else f"the plan found here ran {point.found_tokens_per_s:,.0f} tokens/s")
    note = f"{best.used_gpus} of {point.gpus} GPUs used ({found}; the {best.used_gpus}-GPU plan is faster)"
    return replace(point, evaluation=best.evaluation, used_gpus=best.used_gpus, global_batch=best.global_batch,
                   effective_tokens_per_s=best.effective_tokens_per_s, frameworks=best.frameworks, note=note,
                   ranking=best.ranking)


def _finish(points: list[SweepPoint], opts: SweepOptions) -> list[SweepPoint]:
    """Scaling efficiency against the smallest count with a plan, and time and cost per row."""
    base = next((p for p in points if p.evaluation is not None), None)
    out = []
    for p in points:
        if p.evaluation is None or base is None:
            out.append(p)
            continue
        eff = (p.effective_tokens_per_s / p.gpus) / (base.effective_tokens_per_s / base.gpus)
        cost = (training_cost(opts.tokens, p.effective_tokens_per_s, p.gpus, opts.price_per_gpu_hour)
                if opts.tokens else None)
        out.append(replace(p, efficiency=eff, cost=cost))
    return out


def choose(points: list[SweepPoint], objective: str, days: float | None = None) -> SweepPoint | None:
    """The row ``objective`` picks: ``time``, the highest throughput (fewest GPUs on a tie);
    ``cost``, the fewest GPU-hours per token (so the lowest cost to any budget) -- among the rows
    that finish within ``days`` when a budget and a deadline are given."""
    ok = [p for p in points if p.evaluation is not None]
    if days is not None:
        ok = [p for p in ok if p.cost is None or p.cost.days <= days]
    if not ok:
        return None
    if objective == "cost":
        return min(ok, key=lambda p: (p.gpus / p.effective_tokens_per_s, p.gpus))
    return max(ok, key=lambda p: (p.effective_tokens_per_s, -p.gpus))


class Choice(NamedTuple):
    """What a sweep answers: the row its objective picks, the fastest row, the cheapest row within
    the deadline, and the deadline (None without a token budget: rows have no days)."""

    chosen: SweepPoint | None
    fastest: SweepPoint | None
    cheapest: SweepPoint | None
    deadline: float | None

    @property
    def missed(self) -> bool:
        """No row trains the budget within the deadline, though some row has a plan."""
        return self.deadline is not None and self.cheapest is None and self.fastest is not None


def decide(points: list[SweepPoint], opts: SweepOptions) -> Choice:
    """The rows to report (:class:`Choice`): ``time`` picks the fastest row, which must meet a
    ``--days`` deadline; ``cost`` the cheapest within the deadline, given or :data:`DEFAULT_DAYS`."""
    deadline = opts.deadline if opts.tokens else None
    fastest, cheapest = choose(points, "time"), choose(points, "cost", deadline)
    chosen = cheapest if opts.objective == "cost" else choose(points, "time", opts.days if opts.tokens else None)
    return Choice(chosen, fastest, cheapest, deadline)


def choice_lines(choice: Choice, opts: SweepOptions) -> list[str]:
    """The chosen row and the other answer: with ``time``, the cheapest row within the deadline
    (the chosen fastest says what it costs); with ``cost``, the fastest and what it costs.  When no
    row trains the budget within the deadline, how long the fastest takes."""
    days = choice.deadline
    within = "" if days is None else f"within {days:g} day{'s' * (days != 1)}" + (
        "" if opts.days is not None else f" ({DEFAULT_DAYS_WHY})")
    lines = []
    if choice.chosen is not None:
        what = f"fewest GPU-hours per token {within}".rstrip() if opts.objective == "cost" else "fastest"
        lines.append(f"chosen ({opts.objective}: {what}): {_row(choice.chosen)}")
    if choice.missed and choice.fastest is not None and choice.fastest.cost is not None:
        took = (f"the fastest ({choice.fastest.gpus:,} GPUs) takes {choice.fastest.cost.days:,.1f} days"
                if choice.chosen is choice.fastest else f"the fastest, {_row(choice.fastest)}")
        lines.append(f"no size trains {short_amount(opts.tokens or 0)} tokens {within}: {took}")
    other, name = ((choice.fastest, "fastest") if opts.objective == "cost" else
                   (choice.cheapest, f"cheapest {within}".rstrip()))
    if other is not None and choice.chosen is not None and other.gpus != choice.chosen.gpus:
        lines.append(f"{name}: {_row(other)}")
    return lines


def _row(p: SweepPoint) -> str:
    """``1,024 GPUs, 936,794 tokens/s · 15T tokens: 185.3 days, 4.55M GPU-hours, $11.4M at ...``."""
    return f"{p.gpus:,} GPUs, {p.tokens_per_s:,.0f} tokens/s" + (f" · {p.cost.summary()}" if p.cost else "")


def fewest_gpus(points: list[SweepPoint]) -> SweepPoint | None:
    """The smallest size with a plan that fits: the fewest GPUs of the kind that train (or
    fine-tune, with the model's method) the model at its batch."""
    return min((p for p in points if p.evaluation is not None), key=lambda p: p.used_gpus, default=None)


def fewest_line(model: ModelSpec, points: list[SweepPoint], gpu: str) -> str:
    """The answer to "how few GPUs of this kind can train it", naming the training method."""
    how = {"full": "train", "lora": "fine-tune with LoRA", "qlora": "fine-tune with QLoRA"}[model.training.method]
    low = fewest_gpus(points)
    if low is None:
        return f"fewest {gpu} GPUs that {how} {model.name}: none of the sizes swept ({points[-1].gpus:,} at most)"
    return f"fewest {gpu} GPUs that {how} {model.name}: {low.used_gpus:,} (of the sizes swept)"


def plot(points: list[SweepPoint], path: Path, title: str) -> None:
    """Throughput (with the ideal line from the first row) and scaling efficiency against GPUs, as a PNG.

    Raises:
        ImportError: matplotlib is missing (``pip install 'autoplace[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [p for p in points if p.evaluation is not None and p.efficiency is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = [p.gpus for p in rows]
    ax.plot(gpus, [p.effective_tokens_per_s for p in rows], "o-", color="tab:blue", label="tokens/s")
    if rows:
        ax.plot(gpus, [rows[0].effective_tokens_per_s * g / rows[0].gpus for g in gpus], ":", color="tab:blue",
                label="linear from the first row")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s", title=title)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    eff = ax.twinx()
    eff.plot(gpus, [100 * (p.efficiency or 0) for p in rows], "s--", color="tab:orange", label="scaling efficiency")
    eff.set(ylabel="scaling efficiency, %", ylim=(0, 110))
    lines = ax.get_legend_handles_labels()[0] + eff.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")  # --png: PNG whatever the name ends in
    plt.close(fig)


def advised_plan_lines(model: ModelSpec, cluster: ClusterSpec, advised: int, opts: SweepOptions,
                       tokens: float | None, reference_batch_tokens: float, critical_tokens: float) -> list[str]:
    """What the best plan on ``cluster`` would be at the advised global batch, and the budget there
    (the tokens that reach the same loss, McCandlish et al. 2018 Sec. 2.3)."""
    m = _batched(model, advised)
    ev, status = best_plan(m, cluster, opts)[:2]
    if ev is None:
        return [f"  at the advised global batch {advised:,} sequences no plan fits on {cluster.gpus} GPUs ({status})"]
    text = (f"  at the advised global batch {advised:,} sequences on {cluster.gpus} GPUs: "
            f"step {ev.step_time_s:.2f} s, {ev.tokens_per_s:,.0f} tokens/s, MFU {ev.mfu:.1%}")
    if tokens:
        same_loss = tokens_at_batch(tokens, advised * model.seq_len, reference_batch_tokens, critical_tokens)
        cost = training_cost(same_loss, ev.tokens_per_s, cluster.gpus, opts.price_per_gpu_hour)
        text += f"; the same loss in {cost.summary()}"
    return [text, fold(f"    plan {ev.plan.to_string()}", indent="      ")]
