"""solvers._ortools: CP-SAT's API without pandas (issue 12), and the ordinary import whenever
the placeholder cannot serve.  Each case runs in a fresh interpreter: sys.modules is the subject."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, tmp_path: Path | None = None) -> str:
    path = [str(REPO)] + ([str(tmp_path)] if tmp_path else [])
    prelude = f"import sys; sys.path[:0] = {path!r}\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cp_model_solves_without_importing_pandas_and_pandas_stays_importable() -> None:
    out = _run("""
        from solvers import _ortools
        cp_model = _ortools.cp_model()
        m = cp_model.CpModel()
        x = m.new_int_var(0, 10, "x")
        m.add(x >= 3)
        m.minimize(x)
        solver = cp_model.CpSolver()
        assert solver.solve(m) == cp_model.OPTIMAL and solver.value(x) == 3
        print("pandas loaded:", "pandas" in sys.modules)
        import pandas
        print("real pandas:", pandas.DataFrame({"a": [1]}).shape == (1, 1))
    """)
    assert "pandas loaded: False" in out and "real pandas: True" in out, out


def test_a_module_that_needs_more_of_pandas_gets_the_ordinary_import(tmp_path: Path) -> None:
    """A future OR-Tools reading pandas beyond class names at import: the shim steps aside."""
    (tmp_path / "fake_cp_model.py").write_text("import pandas as pd\nIS_INT = pd.api.types.is_integer\n")
    out = _run("""
        from solvers import _ortools
        _ortools.MODULE = "fake_cp_model"
        module = _ortools.cp_model()
        print("real:", module.IS_INT(3), type(sys.modules["pandas"].DataFrame).__name__)
    """, tmp_path)
    assert "real: True" in out, out


def test_pandas_already_loaded_is_used_as_it_is() -> None:
    out = _run("""
        import pandas
        from solvers import _ortools
        cp_model = _ortools.cp_model()
        print("same:", cp_model.pd is pandas)
    """)
    assert "same: True" in out, out
