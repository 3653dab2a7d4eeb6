"""The solver interface, the problem every back end receives, and the result they return.

A back end is used in this order: ``available()`` (can it run here?), then
``solve(problem, budget)``, which returns a :class:`SolveResult` whose plans have all been
re-scored by the evaluator (the single source of cost, DESIGN.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.errors import SolverError
from autoplace.evaluation import Evaluation
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

OBJECTIVES = ("time", "comm", "memory")
FEATURES = ("offload", "cp", "ep", "interleave", "tp-across-nodes", "hsdp")
DEFAULT_FEATURES = frozenset({"cp", "ep", "interleave", "hsdp", "offload"})


@dataclass(frozen=True)
class Problem:
    """What to place where, and how to judge it.

    Attributes:
        model, cluster: the job and the machines.
        objective: ``time`` (predicted step time), ``comm`` (bytes per step of the busiest
            device) or ``memory`` (peak bytes per device); ties broken by the others.
        fixed: plan keys pinned by ``--fix`` (same keys as ``--plan``).
        features: what the search may use (FEATURES).
        max_mbs: largest micro-batch considered.
        admissible: a configuration filter (e.g. what one framework's config can express,
            :func:`autoplace.frameworks.admissible`); None admits every configuration.
    """

    model: ModelSpec
    cluster: ClusterSpec
    objective: str = "time"
    fixed: dict[str, Any] = field(default_factory=dict)
    features: frozenset[str] = DEFAULT_FEATURES
    assumptions: Assumptions = DEFAULT
    max_mbs: int = 8
    top_k: int = 3
    admissible: Callable[[dict[str, Any]], bool] | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SolverError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")


@dataclass(frozen=True)
class Budget:
    """Limits for one solve: wall time, CP-SAT workers and random seed."""

    time_limit_s: float = 10.0
    workers: int = 2
    seed: int = 0


@dataclass(frozen=True)
class SolveResult:
    """One result type for every back end.

    Attributes:
        plans: the top-K distinct plans, best first, each re-scored by the evaluator.
        status: ``optimal``, ``feasible`` (time limit hit) or ``infeasible``.
        bound: best proven lower bound of the objective (objective units), if known.
        wall_s: seconds spent.
        n_evaluated: candidate configurations scored by the vectorized evaluator.
        nearest: when infeasible, the plan that misses least; ``advice`` says what would fit.
        disagreement: largest relative difference between the back end's own objective value
            and the evaluator's re-score of the same plan (one source of truth, DESIGN.md).
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

    @property
    def gap(self) -> float | None:
        """Relative distance between the best plan and the proven bound (0 when optimal)."""
        if self.bound is None or not self.plans:
            return None
        from solvers.common import objective_key

        best = objective_key(self.plans[0], self.objective)[0]
        return max(0.0, (best - self.bound) / best) if best else 0.0


class Solver(ABC):
    """A search back end."""

    name: str = ""

    @classmethod
    def available(cls) -> bool:
        """Whether the back end's dependencies are importable here."""
        return True

    @abstractmethod
    def solve(self, problem: Problem, budget: Budget) -> SolveResult:
        """Find the best plans for ``problem`` within ``budget``."""


REGISTRY: dict[str, type[Solver]] = {}


def register(cls: type[Solver]) -> type[Solver]:
    REGISTRY[cls.name] = cls
    return cls


def get_solver(name: str) -> Solver:
    """The back end called ``name``.

    Raises:
        SolverError: unknown or unavailable, listing the valid names.
    """
    import solvers.cpsat  # noqa: F401  - registers
    import solvers.exhaustive  # noqa: F401

    if name not in REGISTRY:
        raise SolverError(f"unknown solver {name!r}; valid: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    if not cls.available():
        raise SolverError(f"solver {name!r} is not available here (missing dependency)")
    return cls()
