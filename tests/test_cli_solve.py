"""`autoplace solve` against the docs/ARCHITECTURE.md contract, in-process and as a real process."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.test_cli import A100_8, COMM_KEYS, DEGREE_KEYS, MEMORY_KEYS, MODELS, invoke, run_cli, strict_json

TINY = MODELS / "tiny-llama.json"
CPU2 = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "cpu-2.yaml"
LLAMA_8B = MODELS / "llama-3-8b.json"


def test_json_is_one_solution_document() -> None:
    result = invoke("solve", LLAMA_8B, A100_8, "--json", "--top", "2", "--time-limit", "600")  # a budget no slow machine hits
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["schema"] == "autoplace.solution/v1"
    assert doc["status"] == "optimal" and doc["objective"] == "time"
    assert {"solve_seconds", "model", "cluster", "plans"} <= set(doc)
    assert doc["model"]["params"] == 8_030_261_248
    assert [p["rank"] for p in doc["plans"]] == [1, 2]
    plan = doc["plans"][0]
    assert set(plan["degrees"]) == DEGREE_KEYS
    assert MEMORY_KEYS <= set(plan["memory_per_device_bytes"])
    assert COMM_KEYS <= set(plan["comm_bytes_per_step_per_device"])
    assert plan["memory_per_device_bytes"]["total"] <= plan["memory_per_device_bytes"]["capacity"]
    assert doc["plans"][0]["step_time_s"] <= doc["plans"][1]["step_time_s"]


def test_fix_pins_keys_and_out_writes_plan_json(tmp_path: Path) -> None:
    result = invoke("solve", LLAMA_8B, A100_8, "--json", "--fix", "tp=2", "--fix", "zero=3", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    plan = strict_json(result.stdout)["plans"][0]
    assert plan["degrees"]["tp"] == 2 and plan["zero_stage"] == 3
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["degrees"] == plan["degrees"]


def test_objectives_and_the_exhaustive_back_end_agree_on_a_tiny_job() -> None:
    for objective in ("time", "comm", "memory"):
        docs = [strict_json(invoke("solve", TINY, CPU2, "--json", "--top", "1", "--objective", objective,
                                   "--solver", solver).stdout) for solver in ("cpsat", "exhaustive")]
        value = [{"time": p["step_time_s"], "comm": p["comm_bytes_per_step_per_device"]["total"],
                  "memory": p["memory_per_device_bytes"]["total"]}[objective] for p in (d["plans"][0] for d in docs)]
        assert abs(value[0] - value[1]) <= 1e-6 * value[1], (objective, value)


def test_infeasible_exits_3_with_the_nearest_plan(tmp_path: Path) -> None:
    result = invoke("solve", MODELS / "llama-3-405b.json", A100_8, "--json", "--deny", "offload")
    assert result.exit_code == 3
    doc = strict_json(result.stdout)
    assert doc["status"] == "infeasible" and doc["plans"] == []
    nearest = doc["nearest"]
    assert nearest["memory_per_device_bytes"]["total"] > nearest["memory_per_device_bytes"]["capacity"]
    assert any(v["rule"] == "out-of-memory" and "short by" in v["message"] for v in nearest["violations"])
    table = invoke("solve", MODELS / "llama-3-405b.json", A100_8, "--deny", "offload")
    assert table.exit_code == 3 and "short by" in " ".join(table.stdout.split())  # lines wrap at 100 columns
    # readable text, not a Python dict, and more GPUs counted in whole nodes of the cluster's 8
    assert "{" not in table.stdout and "'dp'" not in table.stdout
    assert "nearest: dp=" in table.stdout
    more = next(line for line in doc["advice"] if line.startswith("more GPUs"))
    nodes, gpus = (int(x) for x in re.search(r"about (\d+) nodes of 8 GPUs \((\d+) GPUs\) instead of 1 \(8 GPUs\)",
                                               more).groups())
    assert gpus == 8 * nodes and nodes > 1



@pytest.mark.parametrize(("pins", "kept", "dropped"), [
    (("--fix", "recompute=none", "--fix", "mbs=32"), ("recompute", "none"), "recompute=none (recompute=full instead)"),
    (("--fix", "pp=2", "--fix", "layers=31:1"), ("layers", "31:1"), "layers=31:1 (layers=16:16 instead)"),
])
def test_the_nearest_plan_keeps_the_pins_and_names_the_one_to_drop(pins: tuple[str, ...], kept: tuple[str, str],
                                                                    dropped: str) -> None:
    """Issue 36: the nearest plan of an infeasible solve was a full-recompute, even-split plan that fit and
    broke a pin ("short by -43.3 GiB per device").  It keeps the pins now, so it misses by a positive
    shortfall, and the advice names the pin whose dropping makes a plan fit, its value and the plan's."""
    cluster = "1x8xh100" if "mbs=32" in pins else "1x2xh100"
    args = ("solve", LLAMA_8B, cluster, *pins, "--deny", "offload", "--deny", "cp", "--time-limit", "60")
    result = invoke(*args, "--json")
    assert result.exit_code == 3, result.output
    doc = strict_json(result.stdout)
    near = doc["nearest"]
    value = near["recompute"] if kept[0] == "recompute" else ":".join(map(str, near["layers_per_stage"]))
    assert value == kept[1] and near["breaks"] == []
    assert near["short_by_bytes"] > 0 and near["short_by_bytes"] == pytest.approx(
        near["memory_per_device_bytes"]["total"] - near["memory_per_device_bytes"]["capacity"])
    assert doc["advice"][0].startswith(f"without the pin {dropped}, ") and " fits (" in doc["advice"][0]
    if kept[0] == "recompute":  # the printed line, once
        table = invoke(*args)
        text = " ".join(table.stdout.split())  # lines wrap at 100 columns
        assert table.exit_code == 3 and "short by -" not in text
        assert re.search(r"recompute=none needs [\d.]+ GiB of [\d.]+ \(short by [\d.]+ GiB per device\)", text)


def test_a_nearest_plan_that_fits_says_why_it_is_not_a_plan() -> None:
    """Never a negative shortfall: a nearest plan short of host memory only says so, and one that fits says
    which pins it breaks (key, its value, the pinned one)."""
    from autoplace.report import _missed_by

    assert _missed_by({"short_by_bytes": 2 * 2**30}) == " (short by 2.0 GiB per device)"
    host = _missed_by({"short_by_bytes": 0.0, "host_short_by_bytes": 3 * 2**30, "breaks": []})
    assert host == " per device, and its offloaded states 3.0 GiB per GPU more host memory than it has"
    broken = _missed_by({"short_by_bytes": 0.0, "host_short_by_bytes": 0.0,
                         "breaks": [{"key": "recompute", "pinned": "none", "value": "full"}]})
    assert broken == ": it fits, but breaks the pin recompute=full (pinned none)"


def test_bad_feature_and_bad_fix_are_exit_2_one_line() -> None:
    for args in (("--allow", "warp-drive"), ("--fix", "tp=three"), ("--fix", "colour=red")):
        result = invoke("solve", LLAMA_8B, A100_8, *args)
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("autoplace: error:")


def test_solve_as_a_process_prints_a_table_and_imports_no_torch() -> None:
    """Nor matplotlib: only --report draws."""
    probe = (f"import runpy, sys; sys.argv = ['autoplace', 'solve', {str(LLAMA_8B)!r}, {str(A100_8)!r}];"
             "\ntry:\n    runpy.run_module('autoplace.cli', run_name='__main__')\nexcept SystemExit as e:\n"
             "    code = e.code\nprint('MPL' if 'matplotlib' in sys.modules else 'NO-MPL')"
             "\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    proc = run_cli("--help")  # the entry point itself runs
    assert proc.returncode == 0
    import subprocess

    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert "Top plans" in out.stdout and out.stdout.strip().endswith("NO-MPL\nNO-TORCH"), out.stdout + out.stderr


def _plans_for(framework: str, *extra: str) -> tuple[dict, list]:
    from autoplace.cost.assumptions import DEFAULT
    from autoplace.frameworks import get
    from autoplace.frameworks.search import refusal
    from autoplace.plan import Plan
    from autoplace.specs.model import load_model

    result = invoke("solve", LLAMA_8B, A100_8, "--json", "--top", "3", "--framework", framework, *extra)
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    model = get(framework).costing(load_model(LLAMA_8B), DEFAULT)[0]
    plans = [Plan.from_dict(p) for p in doc["plans"]]
    assert plans and all(refusal(p, model, framework) is None for p in plans)
    return doc, plans


def test_framework_returns_only_plans_its_config_expresses() -> None:
    """Unconstrained, the best plans on 8 A100s use what DeepSpeed lacks (context parallelism, or
    torch.compile, which its config does not state); DeepSpeed's own plans use neither."""
    free = strict_json(invoke("solve", LLAMA_8B, A100_8, "--json", "--top", "3").stdout)
    assert any(p["degrees"]["cp"] > 1 or p["recipe"]["compile"] for p in free["plans"])
    assert all("deepspeed" not in p["frameworks"] for p in free["plans"])
    _, plans = _plans_for("deepspeed")
    assert all(p.cp == 1 and not p.compile for p in plans)
    _, plans = _plans_for("fsdp")
    assert all(p.pp == p.cp == p.ep == 1 and p.zero != 1 for p in plans)
    _, plans = _plans_for("accelerate")  # one activation-checkpointing switch for every block
    assert all(len(set(p.recompute)) == 1 and p.recompute[0] in ("none", "full") for p in plans)


def test_deepspeed_plans_keep_zero_low_under_a_pipeline() -> None:
    """DeepSpeed's pipeline engine allows ZeRO-0/1 only: the search leaves those configurations out
    instead of finding only plans the framework refuses (70B on 64 H100s prefers ZeRO-3 + pp)."""
    from tests.test_cli import CLUSTERS

    result = invoke("solve", MODELS / "llama-3-70b.json", CLUSTERS / "8x8-h100.yaml", "--json", "--framework",
                    "deepspeed", "--top", "2", "--time-limit", "600")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["status"] == "optimal" and doc["plans"]
    assert all(p["degrees"]["pp"] == 1 or p["zero_stage"] <= 1 for p in doc["plans"])


def test_framework_costs_the_plan_with_its_own_recipe() -> None:
    """torchtitan's FSDP2 keeps fp32 shards (4 B) where DeepSpeed keeps bf16 weights (2 B)."""
    doc, plans = _plans_for("torchtitan", "--fix", "zero=3")
    states = doc["plans"][0]["model_states_bytes"]
    assert states["params"] == states["grads"] and states["optimizer"] == 2 * states["params"]  # 4 + 4 + 8
    # states on the device (transformers' fp32 RMSNorm inputs, which DeepSpeed's costing keeps, make its
    # fastest zero=3 plan offload the optimizer)
    doc, _ = _plans_for("deepspeed", "--fix", "zero=3", "--fix", "offload_optimizer=none")
    states = doc["plans"][0]["model_states_bytes"]
    assert states["params"] == states["grads"] and states["optimizer"] == 6 * states["params"]  # 2 + 2 + 12


def test_framework_refuses_a_pinned_degree_it_cannot_run() -> None:
    result = invoke("solve", LLAMA_8B, A100_8, "--framework", "fsdp", "--fix", "pp=2")
    assert result.exit_code == 2
    assert "fsdp cannot run pp=2" in result.output
    result = invoke("solve", LLAMA_8B, A100_8, "--framework", "jax")
    assert result.exit_code == 2 and "valid: any, none, deepspeed, megatron" in result.output


def test_top_k_means_k_runnable_plans_or_says_why_fewer() -> None:
    """Llama-3-70B on 32 H100, --top 3: three runnable plans (the search gives each configuration
    only the recompute its frameworks can state, and looks deeper while fewer than 3 run)."""
    from tests.test_cli import LLAMA_70B

    doc = strict_json(invoke("solve", LLAMA_70B, "--cluster", "4x8xh100", "--json", "--top", "3").stdout)
    assert doc["status"] == "optimal" and len(doc["plans"]) == 3
    assert all(p["frameworks"] for p in doc["plans"])
    # one GPU, everything pinned: fewer plans than asked for exist, and the notes say why
    tiny = strict_json(invoke("solve", MODELS / "tiny-llama.json", "--cluster", "1x1xa100", "--json", "--top", "5",
                              "--fix", "mbs=1,zero=0,recompute=none").stdout)
    assert 0 < len(tiny["plans"]) < 5
    assert any(n.startswith(f"{len(tiny['plans'])} of the 5 plans asked for: no other configuration")
               for n in tiny["notes"]), tiny["notes"]


def test_an_awkward_global_batch_gets_the_nearest_even_ones_and_their_gain() -> None:
    """A prime batch allows dp = 1 on 8 GPUs: the solve says so, solves the nearest multiples of
    8 the same way and reports what each gains (JSON and a note); an even batch gets no hint."""
    from autoplace.batch_hint import neighbours

    assert neighbours(1021, 8) == [1016, 1024] and neighbours(1024, 8) == [] and neighbours(6, 8) == []
    doc = strict_json(invoke("solve", LLAMA_8B, A100_8, "--json", "--top", "1", "--global-batch", "1021",
                             "--framework", "none", "--time-limit", "600").stdout)
    hint = doc["batch_hint"]
    assert (hint["global_batch"], hint["gpus"], hint["shared"]) == (1021, 8, 1)
    assert {a["global_batch"] for a in hint["alternatives"]} <= {1016, 1024} and hint["alternatives"]
    best = hint["alternatives"][0]
    assert best["gain"] > 0.02
    assert best["tokens_per_s"] == pytest.approx(doc["plans"][0]["tokens_per_s"] * (1 + best["gain"]), rel=1e-3)
    assert hint["note"] in doc["notes"] and f"{best['global_batch']:,}" in hint["note"]
    even = strict_json(invoke("solve", LLAMA_8B, A100_8, "--json", "--top", "1", "--global-batch", "1024",
                              "--framework", "none", "--time-limit", "600").stdout)
    assert "batch_hint" not in even
