"""OR-Tools' CP-SAT API, imported without pandas.

``ortools.sat.python.cp_model`` imports pandas at module level for its ``*_series`` helpers
(``new_int_var_series`` and friends), which autoplace never calls.  On a two-core machine
that import is about 0.2 s of a solve that should take under two (issue 12), more than the
CP-SAT search itself.  :func:`cp_model` imports the module with a placeholder ``pandas`` in
``sys.modules`` for the duration of the import: the names cp_model reads at import time
(``pd.Index``, ``pd.Series`` in annotations) resolve to placeholder classes that nothing is an
instance of and that refuse to be built.  The placeholder is removed at once, so a later
``import pandas`` anywhere in the process gets the real library.

If pandas is already loaded, or the placeholder import fails for any reason (a future
OR-Tools reading something else of pandas at import), the module is imported the ordinary
way: the shim can cost time, never correctness.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

MODULE = "ortools.sat.python.cp_model"


class _Placeholder:
    """Stands for a pandas class in cp_model's annotations; never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("autoplace imports OR-Tools' cp_model without pandas; its pandas-based helpers "
                           "(new_*_series) are unavailable")


def _placeholder_pandas() -> types.ModuleType:
    module = types.ModuleType("pandas", "placeholder for cp_model's import (solvers._ortools)")

    def __getattr__(name: str) -> type:  # PEP 562: any class cp_model names at import time
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_Placeholder,), {"__module__": "pandas"})
        setattr(module, name, cls)
        return cls

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def cp_model() -> types.ModuleType:
    """``ortools.sat.python.cp_model``, imported once per process without pandas if it can be."""
    if MODULE in sys.modules or "pandas" in sys.modules:
        return importlib.import_module(MODULE)
    before = set(sys.modules)
    placeholder = sys.modules["pandas"] = _placeholder_pandas()
    try:
        return importlib.import_module(MODULE)
    except Exception:  # noqa: BLE001 -- fall back to the ordinary import below
        for name in set(sys.modules) - before:  # forget the half-imported modules
            sys.modules.pop(name, None)
    finally:
        if sys.modules.get("pandas") is placeholder:
            del sys.modules["pandas"]
    return importlib.import_module(MODULE)
