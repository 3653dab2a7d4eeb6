"""Back ends by name.

Each entry names the module and class of a :class:`~solvers.base.Solver`; a back end is imported
only when asked for, so this module depends on none of them (and they depend on it not at all).
"""

from __future__ import annotations

import importlib

from autoplace.errors import SolverError
from solvers.base import Solver

BACKENDS = {"cpsat": "solvers.cpsat:CpSatSolver", "exhaustive": "solvers.exhaustive:ExhaustiveSolver"}


def get_solver(name: str) -> Solver:
    """The back end called ``name``.

    Raises:
        SolverError: unknown or unavailable, listing the valid names.
    """
    if name not in BACKENDS:
        raise SolverError(f"unknown solver {name!r}; valid: {', '.join(sorted(BACKENDS))}")
    module, cls_name = BACKENDS[name].split(":")
    cls: type[Solver] = getattr(importlib.import_module(module), cls_name)
    if not cls.available():
        raise SolverError(f"solver {name!r} is not available here (missing dependency)")
    return cls()
