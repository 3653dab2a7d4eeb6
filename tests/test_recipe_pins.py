"""Recipe keys pinned by the model file (``training.recipe``, issue 24) and fp8 refused on GPUs
without fp8 units: a pin behaves as ``--fix`` in solve and explain, is the default of evaluate
and check, and a bad pin, a contradicting --plan/--fix or fp8 on an A100 is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from autoplace.cli import app
from autoplace.errors import SpecError
from autoplace.specs.model import read_model
from benchmarks.fuzz import _model_seeds
from tests.test_cli import run_cli

REPO = Path(__file__).resolve().parents[1]
LLAMA_8B = REPO / "examples" / "models" / "llama-3-8b.json"
A100 = REPO / "examples" / "clusters" / "1x8-a100-80gb.yaml"
H100_64 = REPO / "examples" / "clusters" / "8x8-h100.yaml"


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def pinned_model(tmp_path: Path, recipe: Any, name: str = "pinned.json") -> Path:
    """llama-3-8b.json with ``training.recipe`` set to ``recipe``."""
    doc = json.loads(LLAMA_8B.read_text())
    doc["training"]["recipe"] = recipe
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def one_error_line(result: Result) -> str:
    """The single stderr line of an exit-2 failure (no traceback, nothing on stdout)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplace: error: "), result.stderr
    return lines[0]


def _titan_job(toml: Path) -> Any:
    """The JobConfig torchtitan's ConfigManager builds from ``toml`` (skipped without torchtitan)."""
    titan = pytest.importorskip("tests.test_emit_torchtitan")
    with titan.without_triton():
        from torchtitan.config.manager import ConfigManager

        return ConfigManager().parse_args(["--job.config_file", str(toml)])


def test_a_compile_pin_holds_in_every_plan_and_in_the_emitted_toml(tmp_path: Path) -> None:
    """Without the pin torchtitan's best plan compiles; with compile: false no plan does, the
    TOML has no [compile] turned on, and the output says the model file pinned it."""
    free = invoke("solve", LLAMA_8B, H100_64, "--framework", "torchtitan", "--top", "1", "--time-limit", "3", "--json",
                  "--out", tmp_path / "free")
    assert free.exit_code == 0, free.output
    assert json.loads(free.stdout)["plans"][0]["recipe"]["compile"] is True  # so the pin has something to change
    job = _titan_job(tmp_path / "free" / "torchtitan.toml")
    assert job.compile.enable and set(job.compile.components) == {"model", "loss"}

    model, out = pinned_model(tmp_path, {"compile": False}), tmp_path / "bundle"
    result = invoke("solve", model, H100_64, "--framework", "torchtitan", "--top", "3", "--time-limit", "3",
                    "--json", "--out", out)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["plans"] and all(p["recipe"]["compile"] is False for p in doc["plans"])
    assert doc["model"]["recipe_pinned"] == {"compile": False}
    assert not _titan_job(out / "torchtitan.toml").compile.enable  # as torchtitan's own ConfigManager reads it

    text = invoke("solve", model, H100_64, "--framework", "torchtitan", "--top", "1", "--time-limit", "3")
    assert "recipe pinned by the model file (training.recipe): compile=false" in text.stdout


def test_scale_holds_a_pin_at_every_size(tmp_path: Path) -> None:
    result = invoke("scale", pinned_model(tmp_path, {"compile": False}), "--gpu", "h100", "--gpus", "8",
                    "--framework", "torchtitan", "--time-limit", "1", "--json")
    assert result.exit_code == 0, result.output
    plans = [p["plan"] for p in json.loads(result.stdout)["points"]]
    assert plans and all(p is not None and p["recipe"]["compile"] is False for p in plans)


def test_a_pin_survives_overrides_and_is_written_back_under_its_own_key(tmp_path: Path) -> None:
    spec, _ = read_model(pinned_model(tmp_path, {"overlap": False, "tp_overlap": "none"}),
                         overrides={"global_batch": 512})
    assert spec.training.global_batch == 512
    assert spec.training.recipe_pins.values() == {"overlap": False, "tp_overlap": "none"}
    assert spec.model_dump(exclude_none=True)["training"]["recipe"] == {"tp_overlap": "none", "overlap": False}


def test_a_graph_model_file_pins_recipes_too(tmp_path: Path) -> None:
    graph = {"name": "g", "hidden": 64, "seq_len": 16, "vocab": 100,
             "graph": [{"name": "block", "params": 1000, "flops_per_token": 2000.0,
                        "activation_bytes_per_token": 128.0, "repeat": 2}],
             "training": {"global_batch": 8, "recipe": {"compile": True}}}
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph))
    assert read_model(path)[0].training.recipe_pins.values() == {"compile": True}


@pytest.mark.parametrize(("recipe", "field", "says"), [
    ({"compile": "off"}, "training.recipe.compile", "must be true or false"),
    ({"fp8": "e4m3"}, "training.recipe.fp8", "must be one of none, tensorwise, rowwise, delayed, mxfp8"),
    ({"tp_overlap": True}, "training.recipe.tp_overlap", "got True"),
    ({"jit": True}, "training.recipe.jit", "valid keys here: compile, fused_loss, tp_overlap, overlap, fp8"),
    (["compile"], "training.recipe", "got ['compile']"),
])
def test_a_bad_pin_is_one_line_naming_file_and_field(tmp_path: Path, recipe: Any, field: str, says: str) -> None:
    model = pinned_model(tmp_path, recipe)
    line = one_error_line(invoke("solve", model, A100, "--time-limit", "1"))
    assert f"{model}: {field}: " in line and says in line


def test_fp8_on_an_a100_is_refused_from_plan_fix_and_model_file(tmp_path: Path) -> None:
    """Through a fresh interpreter (the real exit code and stderr): evaluate --plan fp8=rowwise."""
    proc = run_cli("evaluate", LLAMA_8B, A100, "--plan", "fp8=rowwise")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "autoplace: error: --plan: fp8: rowwise runs fp8 GEMMs and GPU profile 'a100-sxm4-80gb' has no fp8 units "
        "(it states no fp8 peak); valid on this cluster: none"]
    assert "'a100-sxm4-80gb' has no fp8 units" in one_error_line(
        invoke("solve", LLAMA_8B, A100, "--fix", "fp8=tensorwise", "--time-limit", "1"))
    model = pinned_model(tmp_path, {"fp8": "rowwise"})
    for args in (("solve", "--time-limit", "1"), ("evaluate", "--plan", "tp=1")):
        line = one_error_line(invoke(args[0], model, A100, *args[1:]))
        assert f"{model}: training.recipe.fp8: rowwise runs fp8 GEMMs" in line
    fine = invoke("evaluate", LLAMA_8B, A100, "--plan", "fp8=none")
    assert fine.exit_code in (0, 3), fine.output  # fp8=none stays valid (3: the plan may not fit)


def test_a_plan_or_fix_contradicting_a_pin_is_one_line_and_an_agreeing_one_is_fine(tmp_path: Path) -> None:
    model = pinned_model(tmp_path, {"compile": False})
    for args in (("solve", "--fix", "compile=true", "--time-limit", "1"), ("evaluate", "--plan", "compile=true")):
        line = one_error_line(invoke(args[0], model, A100, *args[1:]))
        assert "compile=true contradicts the model file's training.recipe.compile=false" in line
    agreeing = invoke("evaluate", model, A100, "--plan", "zero=3,compile=false", "--json")
    assert agreeing.exit_code in (0, 3) and json.loads(agreeing.stdout)["plan"]["recipe"]["compile"] is False


def test_evaluate_takes_the_pin_as_its_default(tmp_path: Path) -> None:
    model = pinned_model(tmp_path, {"compile": True, "overlap": False})
    result = invoke("evaluate", model, H100_64, "--plan", "zero=3", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["plan"]["recipe"]["compile"] is True and doc["plan"]["recipe"]["overlap"] is False
    assert doc["model"]["recipe_pinned"] == {"compile": True, "overlap": False}


def test_explain_never_changes_a_pinned_key(tmp_path: Path) -> None:
    from autoplace.explain import alternatives
    from autoplace.specs.cluster import load_cluster
    from tests.helpers import score

    cluster = load_cluster(H100_64)

    def changed(model_path: Path) -> set[str]:
        model = read_model(model_path)[0]
        ev = score(model, cluster, "zero=3")  # the pins below are the defaults: the same plan either way
        every = alternatives(model, cluster, ev.plan, ev, count=100)
        return {a.change.split()[0] for a in every}

    recipe_keys = {"compile", "fused_loss", "overlap"}
    assert recipe_keys <= changed(LLAMA_8B)  # unpinned, explain flips each (so the filter has work)
    pinned = changed(pinned_model(tmp_path, {"compile": False, "fused_loss": False, "overlap": True}))
    assert pinned and not pinned & recipe_keys
    result = invoke("explain", pinned_model(tmp_path, {"compile": False}, "c.json"), H100_64, "--plan", "zero=3",
                    "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["plan"]["recipe"]["compile"] is False


def test_a_framework_that_cannot_state_a_pin_is_refused_with_its_line(tmp_path: Path) -> None:
    result = invoke("solve", pinned_model(tmp_path, {"compile": True}), A100, "--framework", "deepspeed",
                    "--time-limit", "1")
    assert result.exit_code == 3
    assert ("deepspeed: compile=true is not configurable (it states compile=false); pinned by the model file's "
            "training.recipe.compile") in result.stderr


def test_check_reads_a_config_against_the_pins(tmp_path: Path) -> None:
    """plan.json's missing recipe keys take the pins; a config running another value is one line."""
    out = tmp_path / "b"
    solved = invoke("solve", LLAMA_8B, H100_64, "--framework", "torchtitan", "--top", "1", "--time-limit", "3",
                    "--out", out)
    assert solved.exit_code == 0, solved.output
    model = pinned_model(tmp_path, {"compile": False})
    line = one_error_line(invoke("check", out / "torchtitan.toml", model, H100_64))
    assert "compile=true contradicts the model file's training.recipe.compile=false" in line
    plan = json.loads((out / "plan.json").read_text())
    del plan["recipe"]
    (out / "plan.json").write_text(json.dumps(plan))
    overlap_off = pinned_model(tmp_path, {"overlap": False}, "overlap.json")
    checked = invoke("check", out / "plan.json", overlap_off, H100_64, "--json")
    assert checked.exit_code in (0, 1), checked.output
    assert json.loads(checked.stdout)["plan"]["recipe"]["overlap"] is False


def test_the_fuzz_seeds_include_model_files_with_a_recipe_section() -> None:
    pinned = [(suffix, doc) for suffix, doc in _model_seeds() if "recipe" in doc.get("training", {})]
    assert {suffix for suffix, _ in pinned} == {".json", ".yaml"}
    assert any("graph" in doc for _, doc in pinned) and any("layers" in doc for _, doc in pinned)
    keys = {k for _, doc in pinned for k in doc["training"]["recipe"]}
    assert keys == {"compile", "fused_loss", "tp_overlap", "overlap", "fp8"}


def test_the_pins_are_checked_where_a_spec_is_built_not_only_in_the_cli() -> None:
    from autoplace.specs.model import model_from_dict

    doc = json.loads(LLAMA_8B.read_text())
    doc["training"]["recipe"] = {"overlap": "yes"}
    with pytest.raises(SpecError, match=r"training\.recipe\.overlap: must be true or false"):
        model_from_dict(doc, source="m.json")
