"""The solver interface.

A back end is used in this order: ``available()`` (can it run here?), then
``solve(problem, budget)``, which returns a :class:`~solvers.problem.SolveResult` whose plans
have all been re-scored by the evaluator (the single source of cost).  Back ends are found by
name in :mod:`solvers.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from solvers.problem import DEFAULT_FEATURES, FEATURES, OBJECTIVES, Budget, Problem, SolveResult, objective_key

__all__ = ["DEFAULT_FEATURES", "FEATURES", "OBJECTIVES", "Budget", "Problem", "SolveResult", "Solver", "objective_key"]


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
