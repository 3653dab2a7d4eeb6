"""The command-line contract (docs/ARCHITECTURE.md, "Command-line contract"), in-process and as a real process.

In-process runs use typer's CliRunner (stdout and stderr kept apart); the subprocess runs
``python -m autoplace.cli`` the way a script would, which also checks what a real shell sees
(tracebacks, the exit status) and which modules the command imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from autoplace.cli import app
from autoplace.errors import SpecError

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models"
CLUSTERS = REPO / "examples" / "clusters"
LLAMA_70B = MODELS / "llama-3-70b.json"
LLAMA_405B = MODELS / "llama-3-405b.json"
H100_64 = CLUSTERS / "8x8-h100.yaml"
A100_8 = CLUSTERS / "1x8-a100-80gb.yaml"
PLAN_70B = "tp=8,pp=4,zero=1,recompute=selective"

# The plan object of autoplace.solution/v1 (docs/ARCHITECTURE.md); `evaluate` adds `violations`.
PLAN_KEYS = {"degrees", "virtual_stages", "schedule", "micro_batch", "grad_accum", "global_batch", "zero_stage",
             "placement", "offload", "recompute", "layers_per_stage", "memory_per_device_bytes",
             "comm_bytes_per_step_per_device", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "violations"}
DEGREE_KEYS = {"dp", "tp", "pp", "cp", "ep"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "buffers", "total", "capacity"}
COMM_KEYS = {"dp", "tp", "pp", "cp", "ep", "offload", "total"}
PLACEMENT_KEYS = {"params", "optimizer", "grads", "activations"}

RUNNER = CliRunner()


def invoke(*args: str | Path) -> Result:
    return RUNNER.invoke(app, [str(a) for a in args])


def run_cli(*args: str | Path, python_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m autoplace.cli ARGS`` in a fresh interpreter, with the repo importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *python_args, "-m", "autoplace.cli", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def strict_json(text: str) -> Any:
    """Parse exactly one JSON document; NaN and Infinity are not JSON."""
    def reject(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=reject)


def one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("autoplace: error: "), lines[0]
    return lines[0]


# --------------------------------------------------------------------------- evaluate: tables


def test_evaluate_prints_the_tables() -> None:
    result = invoke("evaluate", LLAMA_70B, H100_64, "--plan", PLAN_70B)
    assert result.exit_code == 0, result.output
    for words in ("Memory per device", "Communication per step", "Step time", "MFU", "tokens/s"):
        assert words in result.stdout, words
    assert "tp=8" in result.stdout and "pp=4" in result.stdout
    assert result.stderr == ""


def test_evaluate_tables_in_a_real_process() -> None:
    proc = run_cli("evaluate", LLAMA_70B, H100_64, "--plan", PLAN_70B)
    assert proc.returncode == 0, proc.stderr
    for words in ("Memory per device", "Step time", "MFU"):
        assert words in proc.stdout, words
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- evaluate: --json


def _evaluate_json(*args: str | Path) -> dict[str, Any]:
    result = invoke("evaluate", *args, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    doc: dict[str, Any] = strict_json(result.stdout)
    return doc


def test_evaluate_json_is_one_document_with_the_contract_keys() -> None:
    doc = _evaluate_json(LLAMA_70B, H100_64, "--plan", PLAN_70B)
    assert {"schema", "model", "cluster", "plan"} <= doc.keys()
    assert doc["schema"] == "autoplace.evaluation/v1"
    assert doc["model"]["name"] == "llama-3-70b" and doc["model"]["params"] > 70e9
    assert doc["cluster"]["gpus"] == 64 and doc["cluster"]["gpu"] == "h100-sxm5-80gb"
    plan = doc["plan"]
    assert PLAN_KEYS <= plan.keys(), PLAN_KEYS - plan.keys()
    assert DEGREE_KEYS <= plan["degrees"].keys()
    assert MEMORY_KEYS <= plan["memory_per_device_bytes"].keys()
    assert COMM_KEYS <= plan["comm_bytes_per_step_per_device"].keys()
    assert PLACEMENT_KEYS <= plan["placement"].keys()
    assert {"params", "optimizer"} <= plan["offload"].keys()


def test_evaluate_json_plan_is_the_requested_one_and_adds_up() -> None:
    plan = _evaluate_json(LLAMA_70B, H100_64, "--plan", PLAN_70B)["plan"]
    assert plan["degrees"] == {"dp": 2, "tp": 8, "pp": 4, "cp": 1, "ep": 1}
    assert plan["zero_stage"] == 1 and plan["recompute"] == "selective" and plan["schedule"] == "1f1b"
    assert plan["placement"] == {"params": "R", "optimizer": "S", "grads": "R", "activations": "M"}  # ZeRO-1
    assert plan["offload"] == {"params": "none", "optimizer": "none"}
    assert plan["micro_batch"] * plan["grad_accum"] * plan["degrees"]["dp"] == plan["global_batch"] == 2048
    assert len(plan["layers_per_stage"]) == 4 and sum(plan["layers_per_stage"]) == 80
    memory = plan["memory_per_device_bytes"]
    parts = {k: v for k, v in memory.items() if k not in ("total", "capacity")}
    assert abs(sum(parts.values()) - memory["total"]) <= len(parts)  # rounding to whole bytes
    assert 0 < memory["total"] <= memory["capacity"]
    comm = plan["comm_bytes_per_step_per_device"]
    assert sum(v for k, v in comm.items() if k != "total") == pytest.approx(comm["total"], abs=len(comm))
    assert comm["tp"] > 0 and comm["pp"] > 0 and comm["dp"] > 0 and comm["cp"] == comm["ep"] == 0
    assert plan["step_time_s"] > 0 and plan["tokens_per_s"] > 0 and plan["tflops_per_gpu"] > 0
    assert 0 < plan["mfu"] < 1
    assert plan["violations"] == []


def test_evaluate_json_in_a_real_process_prints_only_the_document() -> None:
    proc = run_cli("evaluate", LLAMA_70B, H100_64, "--plan", PLAN_70B, "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1  # one line, one document, nothing else on stdout
    assert strict_json(proc.stdout)["plan"]["degrees"]["tp"] == 8
    assert proc.stderr == ""


def test_global_batch_and_seq_len_overrides_reach_the_plan() -> None:
    base = _evaluate_json(LLAMA_70B, H100_64, "--plan", PLAN_70B)["plan"]
    plan = _evaluate_json(LLAMA_70B, H100_64, "--plan", PLAN_70B, "--global-batch", "4096", "--seq-len", "4096")["plan"]
    assert plan["global_batch"] == 4096 and plan["grad_accum"] == 2 * base["grad_accum"]
    assert plan["memory_per_device_bytes"]["activations"] < base["memory_per_device_bytes"]["activations"]


# --------------------------------------------------------------------------- violations


def test_out_of_memory_plan_exits_0_with_a_violation() -> None:
    plan = _evaluate_json(LLAMA_405B, A100_8, "--plan", "tp=8")["plan"]
    oom = [v for v in plan["violations"] if v["rule"] == "out-of-memory"]
    assert oom, plan["violations"]
    assert "short by" in oom[0]["message"]
    memory = plan["memory_per_device_bytes"]
    assert memory["total"] > memory["capacity"]


def test_out_of_memory_plan_is_reported_in_the_tables() -> None:
    result = invoke("evaluate", LLAMA_405B, A100_8, "--plan", "tp=8")
    assert result.exit_code == 0, result.output
    assert "out-of-memory" in result.stdout and "short by" in result.stdout


def test_tp_across_nodes_is_a_violation_unless_allowed() -> None:
    rules = {v["rule"] for v in _evaluate_json(LLAMA_70B, H100_64, "--plan", "tp=16,pp=4")["plan"]["violations"]}
    allowed = _evaluate_json(LLAMA_70B, H100_64, "--plan", "tp=16,pp=4", "--allow", "tp-across-nodes")["plan"]
    assert "tp-within-node" in rules
    assert "tp-within-node" not in {v["rule"] for v in allowed["violations"]}


# --------------------------------------------------------------------------- bad input: exit 2, one line


@pytest.mark.parametrize(("plan", "names"), [
    ("foo=1", "foo"),
    ("tp=abc", "tp"),
    ("tp=0", "tp"),
    ("tp", "KEY=VALUE"),
    ("recompute=sometimes", "recompute"),
    ("schedule=zigzag", "schedule"),
    ("zero=4", "zero"),
    ("tp=3", "does not divide"),
    ("pp=100", "does not divide"),
    ("mbs=3", "mbs"),
    ("layers=1:2", "layers"),
])
def test_bad_plan_exits_2_with_one_line(plan: str, names: str) -> None:
    result = invoke("evaluate", LLAMA_70B, H100_64, "--plan", plan)
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert "--plan" in line and names in line
    assert result.stdout == ""


@pytest.mark.parametrize("missing", ["model", "cluster"])
def test_missing_file_exits_2_naming_it(tmp_path: Path, missing: str) -> None:
    gone = tmp_path / ("no-such-model.json" if missing == "model" else "no-such-cluster.yaml")
    model, cluster = (gone, H100_64) if missing == "model" else (LLAMA_70B, gone)
    result = invoke("evaluate", model, cluster, "--plan", "tp=8")
    assert result.exit_code == 2, result.output
    assert str(gone) in one_error_line(result.stderr)


def _bad_model(tmp_path: Path) -> Path:
    doc = json.loads(LLAMA_70B.read_text())
    doc["moe"] = {"experts": 8, "top_k": 9, "expert_ffn_hidden": 1024}
    path = tmp_path / "bad-model.json"
    path.write_text(json.dumps(doc))
    return path


def test_bad_field_exits_2_naming_file_field_and_problem(tmp_path: Path) -> None:
    bad = _bad_model(tmp_path)
    result = invoke("evaluate", bad, H100_64, "--plan", "tp=8")
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert str(bad) in line and "moe.top_k" in line and "experts (8)" in line
    assert "Traceback" not in result.output


def test_bad_file_in_a_real_process_is_one_line_without_traceback(tmp_path: Path) -> None:
    bad = _bad_model(tmp_path)
    proc = run_cli("evaluate", bad, H100_64, "--plan", "tp=8")
    assert proc.returncode == 2
    assert str(bad) in one_error_line(proc.stderr)
    assert proc.stdout == ""


def test_debug_lets_the_exception_through(tmp_path: Path) -> None:
    result = invoke("--debug", "evaluate", _bad_model(tmp_path), H100_64, "--plan", "tp=8")
    assert result.exit_code != 0
    assert isinstance(result.exception, SpecError)
    assert result.exception.field == "moe.top_k"


def test_debug_in_a_real_process_prints_the_traceback(tmp_path: Path) -> None:
    proc = run_cli("--debug", "evaluate", _bad_model(tmp_path), H100_64, "--plan", "tp=8")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "SpecError" in proc.stderr


def test_missing_plan_option_is_a_usage_error() -> None:
    result = invoke("evaluate", LLAMA_70B, H100_64)
    assert result.exit_code == 2
    assert "--plan" in result.output


# --------------------------------------------------------------------------- lazy imports


HEAVY = ("torch", "deepspeed", "transformers")


def test_evaluate_does_not_import_torch(tmp_path: Path) -> None:
    """Run the real entry point in a fresh interpreter, then look at sys.modules.

    A stand-in ``torch`` package first on the path records any import attempt, so the check
    also holds where torch is not installed (an import inside try/except would leave no trace
    in sys.modules).
    """
    trap = tmp_path / "trap"
    marker = tmp_path / "torch-was-imported"
    (trap / "torch").mkdir(parents=True)
    (trap / "torch" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('autoplace evaluate must not import torch')\n")
    argv = ["autoplace", "evaluate", str(LLAMA_70B), str(H100_64), "--plan", PLAN_70B, "--json"]
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.path.insert(0, {str(trap)!r})
        sys.argv = {argv!r}
        try:
            runpy.run_module("autoplace.cli", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print("HEAVY=" + ",".join(heavy), file=sys.stderr)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert strict_json(proc.stdout)["plan"]["degrees"]["tp"] == 8  # the command really ran
    assert "HEAVY=\n" in proc.stderr, proc.stderr
    assert not marker.exists(), "autoplace evaluate tried to import torch"


# --------------------------------------------------------------------------- profiles


def test_profiles_lists_gpus_and_interconnects() -> None:
    result = invoke("profiles")
    assert result.exit_code == 0, result.output
    assert "a100-sxm4-80gb" in result.stdout and "nvlink4" in result.stdout
    kinds = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert "a100-sxm4-80gb" in kinds["gpu"].split(", ")
    assert "nvlink4" in kinds["interconnect"].split(", ")


def test_profiles_in_a_real_process() -> None:
    proc = run_cli("profiles")
    assert proc.returncode == 0, proc.stderr
    assert "a100-sxm4-80gb" in proc.stdout and "nvlink4" in proc.stdout


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_a_closed_pipe_ends_quietly_with_0(extra: list[str]) -> None:
    """``autoplace solve ... | head -1``: the reader goes after one line; the command ends with 0 and
    says nothing (rich and click would exit 1, the code of a failure)."""
    proc = subprocess.Popen([sys.executable, "-m", "autoplace.cli", "solve", str(MODELS / "tiny-llama.json"),
                             str(A100_8), "--time-limit", "5", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "error" not in err
