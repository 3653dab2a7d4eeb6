"""Search back ends behind one small interface (:class:`solvers.base.Solver`) and a registry."""

from solvers.base import REGISTRY, Budget, Problem, Solver, SolveResult, get_solver

__all__ = ["REGISTRY", "Budget", "Problem", "SolveResult", "Solver", "get_solver"]
