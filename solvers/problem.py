"""The problem every back end receives, its budget, and the one result type they all return."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.errors import SolverError
from autoplace.evaluation import Evaluation
from autoplace.plan import DEFAULT_FEATURES, FEATURES, PER_LAYER, RECOMPUTE, Config, parse_layers
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

# FEATURES and DEFAULT_FEATURES live beside the plan keys they gate (the CLI's --allow help reads them
# without importing the search); they are re-exported here, where the search's callers look for them
__all__ = ["DEFAULT_FEATURES", "FEATURES", "OBJECTIVES", "Budget", "Problem", "SolveResult", "objective_key"]
OBJECTIVES = ("time", "comm", "memory")


@dataclass(frozen=True)
class Problem:
    """What to place where, and how to judge it.

    Attributes:
        model, cluster: the job and the machines.
        objective: ``time`` (predicted step time), ``comm`` (bytes per step of the busiest
            device) or ``memory`` (peak bytes per device); ties broken by the others.
        fixed: plan keys pinned by ``--fix`` (same keys as ``--plan``).
        features: what the search may use (FEATURES).
        max_mbs: largest micro-batch considered (None: every micro-batch that divides the
            per-replica batch; memory bounds discard those that cannot fit).
        admissible: a configuration filter (e.g. what one framework's config can express,
            :func:`autoplace.frameworks.admissible`); None admits every configuration.
        recipes: the recipe keys (plan.RECIPE_KEYS) each configuration is tried with, one
            mapping per alternative (keys left out keep their defaults; tp_overlap applies
            only where tp > 1): :func:`autoplace.frameworks.search.recipe_choices`.
        costings, costing_key: other (model, assumptions) pairs, and which a configuration is
            costed with (``costing_key(config)`` = k >= 1: ``costings[k - 1]``; 0, or no key:
            ``model`` and ``assumptions``): ``--framework any`` prices a configuration as the
            frameworks that run it do when they cost alike (:func:`autoplace.frameworks.search.admissible`).
        microbatching: for a shape ``admissible`` accepts, None when the frameworks that express it run
            every micro-batching of it, else ``ok(mbs, grad_accum)``: whether one of them runs it with
            micro-batches of ``mbs`` sequences, ``grad_accum`` per step (torchtitan's 1F1B needs as many
            as it has stages: ``Framework.batching_refusal``).  No callable: every micro-batching.
        recompute_forms: the per-layer recompute a configuration's plans may take, as a set of
            :data:`autoplace.plan.FORMS` bits (``recompute_forms(config)``; no callable: any mix, ``PER_LAYER``):
            what the frameworks that express it can state.  A pinned recompute mode overrides it.
        pipeline_slots: whether interleaved shapes are also tried with the embedding and / or the
            loss counted as pipeline layers (``pp_embedding`` / ``pp_loss``, where the interleave
            then divides the layers and those places; :func:`autoplace.plan.stage_slots`), as a
            framework that states them runs them (``Framework.pipeline_slots``).  ``--fix`` may pin them.
        forced_split: the blocks per stage a configuration's plans must take, or None when the
            search chooses it (``forced_split(config)``; no callable: always chosen): the split
            every framework that expresses it makes, when none takes an explicit one (DeepSpeed's
            PipelineModule).  ``--fix layers`` overrides it (:meth:`split_of`).
    """

    model: ModelSpec
    cluster: ClusterSpec
    objective: str = "time"
    fixed: dict[str, Any] = field(default_factory=dict)
    features: frozenset[str] = DEFAULT_FEATURES
    assumptions: Assumptions = DEFAULT
    max_mbs: int | None = None
    top_k: int = 3
    admissible: Callable[[Config], bool] | None = None
    recipes: tuple[Mapping[str, Any], ...] = ({},)
    costings: tuple[tuple[ModelSpec, Assumptions], ...] = ()
    costing_key: Callable[[Config], int] | None = None
    recompute_forms: Callable[[Config], int] | None = None
    microbatching: Callable[[Config], Callable[[int, int], bool] | None] | None = None
    pipeline_slots: bool = False
    forced_split: Callable[[Config], tuple[int, ...] | None] | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SolverError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")

    @cached_property
    def fixed_split(self) -> tuple[int, ...] | None:
        """Blocks per stage pinned by ``--fix layers=...``, if any (parsed once per problem)."""
        return parse_layers(self.fixed["layers"], source="--fix") if "layers" in self.fixed else None

    def split_of(self, config: Config) -> tuple[int, ...] | None:
        """The blocks per stage ``config``'s plans must take (``--fix layers``, else its forced
        split), or None when the search chooses them."""
        if "layers" in self.fixed:
            return self.fixed_split
        return None if self.forced_split is None else self.forced_split(config)

    def costing(self, k: int) -> tuple[ModelSpec, Assumptions]:
        """(model, assumptions) of costing ``k``: 0 the problem's own, else ``costings[k - 1]``."""
        return (self.model, self.assumptions) if k == 0 else self.costings[k - 1]

    def costing_index(self, config: Config) -> int:
        """The costing (:meth:`costing`) of a configuration or plan."""
        return 0 if self.costing_key is None else self.costing_key(config)

    def costing_of(self, config: Config) -> tuple[ModelSpec, Assumptions]:
        """(model, assumptions) a configuration or plan is costed with."""
        return self.costing(self.costing_index(config))

    def forms(self, config: Config) -> int:
        """The recompute forms (:data:`autoplace.plan.FORMS` bits) of a configuration's plans: one per-layer
        search (``PER_LAYER``) when any mix may be stated or a mode is pinned."""
        if self.recompute_forms is None or "recompute" in self.fixed:
            return 1 << PER_LAYER
        return self.recompute_forms(config)

    @property
    def fixed_mode(self) -> int | None:
        """The recompute mode (index into RECOMPUTE) pinned by ``--fix recompute=...``, if any."""
        return RECOMPUTE.index(self.fixed["recompute"]) if "recompute" in self.fixed else None


@dataclass(frozen=True)
class Budget:
    """Limits for one solve: wall time (the whole solve, not only CP-SAT), CP-SAT workers and
    random seed; ``progress`` is told the name of each phase as it starts."""

    time_limit_s: float = 10.0
    workers: int = 2
    seed: int = 0
    progress: Callable[[str], None] | None = None

    def phase(self, name: str) -> None:
        if self.progress is not None:
            self.progress(name)


@dataclass(frozen=True)
class SolveResult:
    """One result type for every back end.

    Attributes:
        plans: the top-K distinct plans, best first, each re-scored by the evaluator.
        status: ``optimal``, ``feasible`` (time limit hit), ``infeasible``, or ``unknown`` (the time limit hit
            before any plan was found, with configurations left unsearched).
        bound: best proven lower bound of the objective (objective units), if known.
        wall_s: seconds spent.
        n_evaluated: candidate configurations scored by the vectorized evaluator.
        nearest: when infeasible, the plan that misses least; ``advice`` says what would fit.
        disagreement: largest relative difference between the back end's own objective value
            and the evaluator's re-score of the same plan (one source of truth, docs/ARCHITECTURE.md).
        phases: seconds per phase (enumerate, score, bound, build, search, rescore).
        model_size: the CP-SAT model's variables and constraints, when one was built.
    """

    plans: list[Evaluation]
    status: str
    objective: str
    bound: float | None
    wall_s: float
    n_evaluated: int
    nearest: Evaluation | None = None
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    disagreement: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    model_size: dict[str, int] = field(default_factory=dict)

    @property
    def gap(self) -> float | None:
        """Relative distance between the best plan and the proven bound (0 when optimal)."""
        if self.bound is None or not self.plans:
            return None
        best = objective_key(self.plans[0], self.objective)[0]
        return max(0.0, (best - self.bound) / best) if best else 0.0


def objective_key(ev: Evaluation, objective: str) -> tuple[float, float]:
    """(primary, tie-break) of an evaluated plan, the order every back end ranks by."""
    if objective == "time":
        return ev.step_time_s, ev.comm["total"]
    if objective == "comm":
        return ev.comm["total"], ev.step_time_s
    return ev.memory["total"], ev.step_time_s
