"""Output that survives pipes: no table cell or plan string cut at 80 columns, --format
table|json|csv|markdown, a header that says where the model's numbers came from, --version."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.plan import parse_plan_string
from autoplace.report import fmt_count

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "models" / "tiny-llama.json")
LLAMA_70B = str(REPO / "examples" / "models" / "llama-3-70b.json")
H100_64 = str(REPO / "examples" / "clusters" / "8x8-h100.yaml")
QWEN3 = str(REPO / "tests" / "data" / "hf" / "qwen3-8b.json")
PLAN = "tp=8,pp=4,zero=1,recompute=selective"
LLAMA_8B = str(REPO / "examples" / "models" / "llama-3-8b.json")
A100_8 = str(REPO / "examples" / "clusters" / "1x8-a100-80gb.yaml")
# proved optimal in a few seconds; one worker keeps CP-SAT deterministic, so the --json run and
# the text run return the same plans
SOLVE = ["solve", LLAMA_8B, A100_8, "--time-limit", "120", "--top", "3", "--workers", "1"]


def invoke(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def plan_strings(doc: dict[str, Any]) -> list[str]:
    """Each plan of a --json document as the string --plan takes, rebuilt independently."""
    from autoplace.plan import Plan

    return [Plan.from_dict(p).to_string() for p in doc["plans"]]


def assert_unabridged(text: str, fields: list[str]) -> None:
    """Nothing cut, and every field whole on one line once a folded plan string is joined again."""
    assert "…" not in text and "..." not in text
    lines = unfolded(text)
    for value in fields:
        assert any(value in line for line in lines), f"{value!r} is not on one line"


def unfolded(text: str) -> list[str]:
    """The lines with folded plan strings joined: a line ending in ',' or ':' continues on the next
    line, indented (autoplace.report.fold)."""
    out: list[str] = []
    for line in text.splitlines():
        if out and out[-1].endswith((",", ":")) and line.startswith("  "):
            out[-1] += line.strip()
        else:
            out.append(line)
    return out


def assert_fits(text: str, width: int = 100) -> None:
    wide = [line for line in text.splitlines() if len(line) > width]
    assert not wide, f"{len(wide)} lines over {width} columns, e.g. {wide[0]!r}"


def test_piped_solve_shows_every_plan_field() -> None:
    """--wide: every column, none folded; the default compact table keeps each plan's figures whole."""
    doc = json.loads(invoke(*SOLVE, "--json").stdout)
    compact = invoke(*SOLVE).stdout
    for p in doc["plans"]:
        d = p["degrees"]
        assert_unabridged(compact, [f"{d['dp']}×{d['tp']}×{d['pp']}×{d['cp']}×{d['ep']}", f"{p['step_time_s']:.3f}",
                                    f"{p['mfu']:.1%}"])
    text = invoke(*SOLVE, "--wide").stdout
    fields = plan_strings(doc)
    for p in doc["plans"]:
        d = p["degrees"]
        fields += [f"{d['dp']}x{d['tp']}x{d['pp']}x{d['cp']}x{d['ep']}", f"{p['step_time_s']:.3f}",
                   f"{p['mfu']:.1%}", f"{p['micro_batch']}x{p['grad_accum']}", f"{p['schedule']}/v{p['virtual_stages']}"]
    assert_unabridged(text, fields)
    assert any(len(line) > 80 for line in text.splitlines())  # wide, not folded to 80


def test_solve_in_a_real_pipe_fits_100_columns_and_keeps_every_plan() -> None:
    """Piped at COLUMNS=80 (a pipe has no width): every line fits 100 columns, plan strings folded
    at their commas, so each joins back to the string --plan takes."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "autoplace.cli", *SOLVE], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(invoke(*SOLVE, "--json").stdout)
    assert_unabridged(proc.stdout, plan_strings(doc))
    assert_fits(proc.stdout)


@pytest.mark.parametrize("command", ["evaluate", "explain"])
def test_piped_evaluate_and_explain_are_unabridged(command: str) -> None:
    doc = json.loads(invoke(command, LLAMA_70B, H100_64, "--plan", PLAN, "--json").stdout)
    text = invoke(command, LLAMA_70B, H100_64, "--plan", PLAN).stdout
    from autoplace.plan import Plan

    fields = [Plan.from_dict(doc["plan"]).to_string(), "all-reduce / SP gather+scatter"]
    fields += [a["change"] for a in doc.get("alternatives", [])]
    fields += [f"{s['total'] / 2**30:.2f}" for s in doc["plan"]["memory_per_stage_bytes"]]
    assert_unabridged(text, fields)
    assert_fits(text)


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them() -> None:
    from autoplace.report import Section, render

    console = Console(width=60, force_terminal=True, color_system=None, record=True)
    row = ("dp_replicate=4,dp_shard=2,tp=1,pp=2", "187.462", "68.0%", "1f1b/v1", "78.8 / 80", "47.75 TB")
    render([Section("t", ("plan", "step s", "MFU", "sched", "mem GiB / cap GiB", "comm"), [row])], [], "table", console)
    text = console.export_text()
    assert "…" not in text
    body = [line.split("│") for line in text.splitlines() if line.startswith("│")]
    for col, cell in enumerate(row, start=1):  # each column read down its folded lines
        assert "".join(parts[col].strip() for parts in body).replace(" ", "") == cell.replace(" ", "")


def test_format_json_is_the_json_flag() -> None:
    a = json.loads(invoke("evaluate", TINY, "--cluster", "1x2xcpu", "--plan", "dp=2", "--format", "json").stdout)
    b = json.loads(invoke("evaluate", TINY, "--cluster", "1x2xcpu", "--plan", "dp=2", "--json").stdout)
    assert a == b


def test_json_and_format_must_agree() -> None:
    result = CliRunner().invoke(app, ["evaluate", TINY, "--cluster", "1x2xcpu", "--plan", "dp=2", "--json",
                                      "--format", "csv"])
    assert result.exit_code == 2 and "disagree" in result.stderr


def test_solve_csv_has_every_field_and_the_plan() -> None:
    text = invoke(*SOLVE, "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    doc = json.loads(invoke(*SOLVE, "--json").stdout)
    assert len(rows) == len(doc["plans"])
    by_plan = dict(zip(plan_strings(doc), doc["plans"], strict=True))
    for row in rows:
        p = by_plan[row["plan"]]
        assert parse_plan_string(row["plan"])
        assert float(row["step_time_s"]) == p["step_time_s"] and int(row["tp"]) == p["degrees"]["tp"]


def test_evaluate_csv_blocks_and_markdown_tables() -> None:
    text = invoke("evaluate", TINY, "--cluster", "1x2xcpu", "--plan", "dp=2", "--format", "csv").stdout
    blocks = text.strip().split("\n\n")
    parsed = [list(csv.reader(io.StringIO(b))) for b in blocks]
    assert [p[0][0].split(",")[0] for p in parsed] == ["Memory per device", "Communication per step", "Step time"]
    assert all(len(p) >= 3 for p in parsed) and parsed[0][1][:2] == ["stage", "params"]
    md = invoke("explain", TINY, "--cluster", "1x2xcpu", "--plan", "dp=2", "--format", "markdown").stdout
    assert "| stage | params |" in md and "**Alternatives that change the most (one knob each)**" in md
    assert "[bold]" not in md and "global batch 8 sequences" in md


def test_header_names_the_source_and_the_defaults() -> None:
    text = invoke("evaluate", QWEN3, "--cluster", "1x8xh100", "--plan", "tp=8").stdout
    header = " ".join(text.split("\ncluster ")[0].split())  # the model line, wrapped at 100 columns
    assert header.startswith("model qwen3-8b: 8.19B params")
    assert "global batch 1,024 sequences (default; --global-batch)" in header
    assert "seq len 8,192 (default: max_position_embeddings 40960 capped at 8192; --seq-len)" in header
    assert "Hugging Face config (model_type qwen3)" in header
    doc = json.loads(invoke("solve", QWEN3, "--cluster", "1x8xh100", "--json", "--seq-len", "4096",
                            "--time-limit", "3").stdout)
    assert doc["model"]["defaulted"] == ["global_batch"] and doc["model"]["seq_len"] == 4096
    tiny = json.loads(invoke("evaluate", TINY, "--cluster", "1x2xcpu", "--plan", "dp=2", "--json").stdout)
    assert tiny["model"]["defaulted"] == []  # tiny-llama.json gives its own global batch


def test_small_models_are_not_zero_billion() -> None:
    text = invoke("solve", TINY, "--cluster", "1x2xcpu", "--time-limit", "3").stdout
    assert "3.43M params" in text and "0.00B" not in text
    assert [fmt_count(n) for n in (70.55e9, 124.4e6, 45_100, 512, 1.2e12, 405e9)] == [
        "70.5B", "124M", "45.1K", "512", "1.2T", "405B"]


def test_version() -> None:
    result = invoke("--version")
    assert result.stdout.startswith("autoplace ")


def test_the_plans_table_fits_100_columns_without_splitting_a_number() -> None:
    """solve's default table in a 100-column terminal: every table line fits, every figure is whole."""
    import io

    from rich.console import Console

    from autoplace.report import print_solution
    from tests.test_cli import H100_64, LLAMA_70B, invoke, strict_json

    doc = strict_json(invoke("solve", LLAMA_70B, H100_64, "--json", "--top", "3").stdout)
    out = io.StringIO()
    print_solution(doc, object(), Console(file=out, width=100, no_color=True))
    table = [line for line in out.getvalue().splitlines() if line[:1] in "┏┃┡│└"]
    assert table and all(len(line) <= 100 for line in table)
    for plan in doc["plans"]:
        assert f"{plan['step_time_s']:.3f}" in out.getvalue() and f"{plan['mfu']:.1%}" in out.getvalue()
    wide = io.StringIO()
    print_solution(doc, object(), Console(file=wide, width=300, no_color=True), wide=True)
    assert "comm/step" in wide.getvalue() and "comm/step" not in out.getvalue()


def test_scale_fits_100_columns_and_wide_keeps_every_column() -> None:
    args = ["scale", LLAMA_70B, "--gpu", "h100", "--gpus", "64,128", "--tokens", "15T", "--price-per-gpu-hour", "2",
            "--time-limit", "0.5", "--workers", "1"]
    compact, wide = invoke(*args).stdout, invoke(*args, "--wide").stdout
    assert_fits(compact)
    assert "┃ cost $ ┃" in compact and "scaling eff." not in compact
    assert "scaling eff." in wide and "nodes x GPUs" in wide and any(len(line) > 100 for line in wide.splitlines())


def test_the_recipe_line_explains_only_what_its_plans_use() -> None:
    from autoplace.report import recipe_legend, recipe_text

    assert recipe_legend(recipe_text({"overlap": True})) == "O overlapped data-parallel communication"
    assert recipe_legend(recipe_text({"compile": True, "fused_loss": True, "overlap": True, "tp_overlap": "async"})) == (
        "C compile, L fused loss, O overlapped data-parallel communication, TP-communication overlap async")
    assert recipe_legend(recipe_text({"fp8": "rowwise"})) == "fp8 GEMMs rowwise"
