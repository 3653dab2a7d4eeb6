"""Search back ends behind one small interface (:class:`solvers.base.Solver`), found by name in
:mod:`solvers.registry`."""

from solvers.base import Solver
from solvers.problem import Budget, Problem, SolveResult
from solvers.registry import BACKENDS, get_solver

__all__ = ["BACKENDS", "Budget", "Problem", "SolveResult", "Solver", "get_solver"]
