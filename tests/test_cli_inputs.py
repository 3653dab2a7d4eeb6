"""Issue 36, "Inputs": what the command line takes, said back in one line naming the flag or file.

A key given twice is refused, never the last one silently kept (``--plan``, ``--fix``, a file);
a flag's bad value is the flag's error, not the model file's; a LoRA rank is bounded by the
projections it adapts, by one rule for the file and the flags; click's own usage errors are one
line like every other error; ``check`` reads every config strictly; ``--allow``'s help lists
what it takes.  Each test runs the command through typer's CliRunner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from autoplace.cli import app
from autoplace.plan import DEFAULT_FEATURES, FEATURES, build_plan

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models"
LLAMA, TINY = MODELS / "llama-3-8b.json", MODELS / "tiny-llama.json"
A100 = REPO / "examples" / "clusters" / "1x8-a100-80gb.yaml"
RUNNER = CliRunner()


def invoke(*args: str | Path) -> Result:
    return RUNNER.invoke(app, [str(a) for a in args])


def error_line(result: Result) -> str:
    """The one stderr line of a bad-input exit (2), with nothing on stdout."""
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("autoplace: error: "), result.output
    assert result.stdout == "", result.stdout
    return lines[0].removeprefix("autoplace: error: ")


def model_file(tmp_path: Path, **training: Any) -> Path:
    """llama-3-8b with ``training`` fields added."""
    doc = json.loads(LLAMA.read_text())
    doc["training"] = {**doc.get("training", {}), **training}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    return path


# --------------------------------------------------------------------------- 5: a key given twice


@pytest.mark.parametrize(("args", "says"), [
    (["evaluate", LLAMA, A100, "--plan", "tp=2,tp=4"], "--plan: tp: given twice (tp=2 and tp=4); give it once"),
    (["evaluate", LLAMA, A100, "--plan", "fp8=rowwise,fp8=none"],  # fp8=rowwise alone is refused on A100
     "--plan: fp8: given twice (fp8=rowwise and fp8=none); give it once"),
    (["solve", TINY, "1x1xh100", "--fix", "compile=true", "--fix", "compile=false"],
     "--fix: compile: given twice (compile=true and compile=false); give it once"),
    (["solve", TINY, "1x1xh100", "--fix", "tp=1,zero=1", "--fix", "zero=1"], "--fix: zero: given twice"),
])
def test_a_plan_key_given_twice_is_refused_naming_both_values(args: list[Any], says: str) -> None:
    assert error_line(invoke(*args)).startswith(says)


def test_a_repeat_no_longer_hides_a_clash_with_the_model_files_pin(tmp_path: Path) -> None:
    """The file pins fp8=none; ``fp8=rowwise,fp8=none`` kept the last and agreed with the pin."""
    model = model_file(tmp_path, recipe={"fp8": "none"})
    assert "given twice" in error_line(invoke("evaluate", model, "1x8xh100", "--plan", "fp8=rowwise,fp8=none"))
    assert "contradicts the model file's training.recipe.fp8=none" in error_line(
        invoke("evaluate", model, "1x8xh100", "--plan", "fp8=rowwise"))


@pytest.mark.parametrize(("name", "text", "says"), [
    ("model.json", '{"name": "m", "layers": 4, "layers": 40}', "key 'layers' given twice"),
    ("cluster.yaml", "name: c\nnodes: 1\nnodes: 2\n", "key 'nodes' given twice"),
])
def test_a_file_naming_a_key_twice_is_refused(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    args = ["evaluate", path, "1x1xh100"] if name == "model.json" else ["evaluate", TINY, path]
    line = error_line(invoke(*args, "--plan", "tp=1"))
    assert line.startswith(f"{path}: ") and says in line, line


# --------------------------------------------------------------------------- 6: the flag named, not the file


@pytest.mark.parametrize(("flags", "says"), [
    (["--method", "lora", "--lora-rank", "10000001"], "--lora-rank: must be in [1, 10_000_000] (got 10000001)"),
    (["--method", "lora", "--lora-alpha", "0"], "--lora-alpha: must be in (0, 1e+06] (got 0.0)"),
    (["--method", "lora", "--lora-alpha", "nan"], "--lora-alpha: expected a finite number, got nan"),
    (["--method", "lora", "--lora-alpha", "inf"], "--lora-alpha: expected a finite number, got inf"),
    (["--method", "lora", "--lora-targets", "q,q"], "--lora-targets: names q more than once"),
    (["--seq-len", "99999999999"], "--seq-len: must be in [1, 10_000_000] (got 99999999999)"),
    (["--global-batch", "999999999"], "--global-batch: must be in [1, 100_000_000] (got 999999999)"),
])
def test_a_flags_bad_value_names_the_flag_not_the_model_file(flags: list[str], says: str) -> None:
    line = error_line(invoke("evaluate", LLAMA, A100, "--plan", "tp=1", *flags))
    assert line.startswith(says) and str(LLAMA) not in line, line


# --------------------------------------------------------------------------- 7: the LoRA rank, one rule


def test_a_lora_rank_above_a_projections_smaller_side_is_refused() -> None:
    """llama-3-8b's k and v project 4096 features to 1024 (8 KV heads of 128): rank 1024 at most
    (rank 10,000,000 was accepted: "26.2T trainable")."""
    line = error_line(invoke("evaluate", LLAMA, A100, "--plan", "tp=1", "--method", "lora", "--lora-rank", "1025"))
    assert line.startswith("--lora-rank: rank 1025 exceeds the k projection, 4096 -> 1024 features") \
        and "r <= min(d_in, d_out); valid: 1 to 1024" in line, line
    assert invoke("evaluate", LLAMA, A100, "--plan", "tp=1", "--method", "lora", "--lora-rank", "1024").exit_code == 0
    # without k and v the smallest side is 4096
    assert invoke("evaluate", LLAMA, A100, "--plan", "tp=1", "--method", "lora", "--lora-rank", "2048",
                  "--lora-targets", "q,o").exit_code == 0


def test_the_model_files_lora_rank_is_held_to_the_same_bound(tmp_path: Path) -> None:
    model = model_file(tmp_path, method="lora", lora={"rank": 2048})
    line = error_line(invoke("evaluate", model, A100, "--plan", "tp=1"))
    assert line.startswith(f"{model}: training.lora.rank: rank 2048 exceeds the k projection"), line


def test_lora_settings_with_method_full_are_refused_in_the_file_as_on_the_command_line(tmp_path: Path) -> None:
    """One rule: settings that would change nothing are named, wherever they are given (the file's
    ``lora:`` block beside ``method: full`` used to be accepted, the same flags refused)."""
    model = model_file(tmp_path, method="full", lora={"rank": 8})
    assert error_line(invoke("evaluate", model, A100, "--plan", "tp=1")) == (
        f"{model}: training.lora: LoRA settings need method lora or qlora (training.method, or --method); "
        "the method is full")
    assert error_line(invoke("evaluate", LLAMA, A100, "--plan", "tp=1", "--lora-rank", "8")) == (
        "--lora-rank: LoRA settings need method lora or qlora (training.method, or --method); the method is full")


def test_method_full_on_the_command_line_sets_a_lora_files_adapters_aside(tmp_path: Path) -> None:
    """Asked to train every weight, a LoRA file's adapter settings no longer apply: no error."""
    model = model_file(tmp_path, method="lora", lora={"rank": 64})
    doc = json.loads(invoke("evaluate", model, A100, "--plan", "tp=1", "--method", "full", "--json").stdout)
    assert doc["plan"]["memory_per_device_bytes"]["optimizer"] > 0
    lora = json.loads(invoke("evaluate", model, A100, "--plan", "tp=1", "--json").stdout)
    assert doc["plan"]["memory_per_device_bytes"]["optimizer"] > 10 * lora["plan"]["memory_per_device_bytes"]["optimizer"]


# --------------------------------------------------------------------------- 8: click's usage errors, one line


@pytest.mark.parametrize(("args", "says"), [
    (["evaluate", LLAMA, A100, "--plan", "tp=1", "--method", "Full"], "--method: 'Full' is not one of 'full', 'lora', "
                                                                       "'qlora'"),
    (["evaluate", LLAMA, A100, "--plan", "tp=1", "--lora-rank", "0"], "--lora-rank: must be >= 1, got 0"),
    (["evaluate", LLAMA, A100, "--plan", "tp=1", "--lora-alpha", ""], "--lora-alpha: expected a number, got ''"),
    (["evaluate", LLAMA, A100], "--plan: required; none given"),
    (["solve"], "MODEL: required; none given"),
    (["solve", TINY, "--bogus"], "--bogus: no such option (did you mean --gpu or --out?)"),
    (["solve", TINY, "--top", "21"], "--top: must be <= 20, got 21"),
    (["solve", TINY, "--time-limit", "inf"], "--time-limit: expected a finite number, got inf"),
    (["solve", TINY, "--seed", "2147483648"], "--seed: must be <= 2147483647, got 2147483648"),
    (["solve", TINY, "--json=3"], "--json: does not take a value"),
    (["scale", TINY, "--price-per-gpu-hour", "inf"], "--price-per-gpu-hour: must be <= 1000000.0, got inf"),
    (["scale", TINY, "--gpu", "h100", "--tokens", "1B", "--days", "inf"], "--days: the deadline must be a positive, "
                                                                       "finite number of days, got inf"),
    # found by benchmarks/fuzz.py: an option of two names was named by the longer (--max-days, scale's old name)
    (["scale", TINY, "--days", "x"], "--days: expected a number, got 'x'"),
    # found by benchmarks/fuzz.py: Kaplan's critical batch overflowed (OverflowError), and a token budget of
    # 1e-300 divided by zero, 1e300 at $1e308 an hour made the cost infinite (not JSON): internal errors
    (["evaluate", TINY, "1x1xh100", "--plan", "tp=1", "--target-loss", "1e308"], "--target-loss: must be <= 100.0, "
                                                                                   "got 1e308"),
    (["evaluate", TINY, "1x1xh100", "--plan", "tp=1", "--tokens", "1e-300"], "--tokens: expected an amount from 1 to "
     "1e18 such as 15T, 300B or 2.5e12 (suffixes K, M, B, T, P), got '1e-300'"),
    (["evaluate", TINY, "1x1xh100", "--plan", "tp=1", "--price-per-gpu-hour", "1e308"],
     "--price-per-gpu-hour: must be <= 1000000.0, got 1e308"),
    (["tune", TINY, A100, "--trials", "x"], "--trials: expected a whole number, got 'x'"),
    (["trace", "m:f", "--dtype", "bf8"], "--dtype: 'bf8' is not one of 'bf16', 'fp16', 'fp32'"),
    (["check", TINY], "MODEL: required; none given"),
    (["bogus"], "no such command 'bogus'"),
])
def test_a_usage_error_is_one_line_naming_the_flag(args: list[Any], says: str) -> None:
    assert error_line(invoke(*args)) == says


def test_help_is_still_printed_in_full() -> None:
    result = invoke("solve", "--help")
    assert result.exit_code == 0 and "--time-limit" in result.stdout and len(result.stdout.splitlines()) > 20


# --------------------------------------------------------------------------- 9: check reads every config strictly


def _plan_json(tmp_path: Path, change: tuple[str, Any]) -> Path:
    doc = build_plan({"dp_shard": 8, "zero": 3}, world=8, blocks=32, global_batch=1024).to_dict()
    key, value = change
    *parents, leaf = key.split(".")
    node = doc
    for part in parents:
        node = node[part]
    node[leaf] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("change", "says"), [
    (("degrees.tp", 1e308), "degrees.tp: expected a whole number >= 1 and below 2**31, got 1e+308"),
    (("degrees.tp", 2.0), "degrees.tp: expected a whole number >= 1 and below 2**31, got 2.0"),
    (("degrees.tp", True), "degrees.tp: expected a whole number >= 1 and below 2**31, got True"),
    (("degrees.pp", 2**40), "degrees.pp: expected a whole number >= 1 and below 2**31"),
    (("layers_per_stage", []), "layers_per_stage: expected a list of block counts, one per pipeline stage, got []"),
    (("layers_per_stage", ""), "layers_per_stage: expected a list of block counts"),
    (("layers_per_stage", [2**40]), "layers_per_stage.0: expected a whole number >= 0 and below 2**31"),
    (("layers_per_stage", [1e308]), "layers_per_stage.0: expected a whole number >= 0 and below 2**31, got 1e+308"),
    (("layers_per_stage", [33]), "layers_per_stage: the stages hold 33 blocks (33) but the model has 32"),
    (("sequence_parallel", "false"), "sequence_parallel: expected true or false, got 'false'"),
    (("global_batch", 2048), "global_batch: 2048 is not micro_batch x grad_accum x dp = 1 x 128 x 8 = 1024"),
])
def test_check_refuses_a_hostile_plan_json_in_one_line(tmp_path: Path, change: tuple[str, Any], says: str) -> None:
    """Each crashed ``check`` with exit 1, "internal error" (OverflowError, ValueError, MemoryError,
    IndexError), or was taken as another value (2.0 as 2, "false" as true)."""
    path = _plan_json(tmp_path, change)
    assert error_line(invoke("check", path, LLAMA, A100)).startswith(f"{path}: {says}")


@pytest.mark.parametrize(("name", "text", "says"), [
    ("megatron_args.sh", "MEGATRON_ARGS=(\n --tensor-model-parallel-size '2\n)\n", "not bash words: no closing quotation"),
    ("megatron_args.sh", "MEGATRON_ARGS=(\n --tensor-model-parallel-size 0\n --micro-batch-size 1\n)\n",
     "--tensor-model-parallel-size: expected a whole number >= 1 and below 2**31, got 0"),
    ("fsdp2_parallelize.py", "MODEL_NAME = 'llama-3-8b'\nDP_REPLICATE = {[1]: 2}\n", "DP_REPLICATE: expected a literal"),
    ("fsdp2_parallelize.py", "".join(f"{k} = {v}\n" for k, v in (
        ("MODEL_NAME", "'llama-3-8b'"), ("DP_REPLICATE", "1"), ("DP_SHARD", "'8'"), ("TP", "1"),
        ("SEQUENCE_PARALLEL", "False"), ("ZERO", "3"), ("OFFLOAD_TO_CPU", "False"), ("COMPRESS", "'none'"),
        ("POWERSGD_RANK", "0"), ("RECOMPUTE", repr(("none",) * 32)))), "DP_SHARD: expected a whole number"),
    ("job.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8.0\n',
     "parallelism.data_parallel_shard_degree: expected a whole number >= 1 and below 2**31, got 8.0"),
])
def test_check_reads_every_config_strictly(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    model = REPO / "tests" / "data" / "hf" / "llama-3.1-8b.json" if name.endswith(".toml") else LLAMA  # titan's 8B
    line = error_line(invoke("check", path, model, A100))
    assert line.startswith(f"{path}: ") and says in line, line


# --------------------------------------------------------------------------- 10: --allow's help


def test_allow_and_deny_help_list_every_feature_the_search_takes() -> None:
    """The help is made from the list the search reads: fp8 was accepted and not listed."""
    from typer.main import get_command

    params = {p.opts[0]: p.help for p in get_command(app).commands["solve"].params}  # type: ignore[attr-defined]

    def listed(help_text: str) -> list[str]:  # "...by default: a, b, c (repeatable..."
        return help_text.split("by default: ")[1].split(" (")[0].split(", ")

    assert listed(params["--allow"]) == [f for f in FEATURES if f not in DEFAULT_FEATURES] and "fp8" in FEATURES
    assert listed(params["--deny"]) == [f for f in FEATURES if f in DEFAULT_FEATURES]


# --------------------------------------------------------------------------- found by benchmarks/fuzz.py


def test_an_output_path_the_file_system_refuses_is_one_line(tmp_path: Path) -> None:
    """solve --out naming a file was FileExistsError (exit 1, internal error)."""
    taken = tmp_path / "taken"
    taken.write_text("")
    assert error_line(invoke("solve", TINY, "1x1xh100", "--time-limit", "1", "--out", taken)) == f"{taken}: File exists"


def test_png_is_written_as_png_whatever_its_name(tmp_path: Path) -> None:
    """scale --png x.json was matplotlib's ValueError ("Format 'json' is not supported"): exit 1."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart.json"
    result = invoke("scale", TINY, "--gpu", "h100", "--gpus", "1,2", "--time-limit", "0.5", "--png", out, "--json")
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("gpus", ["\u00b2", "1..2147483648"])
def test_scales_gpu_counts_are_ascii_whole_numbers_below_2_31(gpus: str) -> None:
    """``--gpus ²`` passed isdigit() and failed int(): ValueError, exit 1."""
    assert error_line(invoke("scale", TINY, "--gpu", "h100", "--gpus", gpus)).startswith("--gpus: expected LOW..HIGH")


def test_a_size_too_large_for_a_cluster_is_the_gpus_error_before_any_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpus 1..2147483647 searched 23 sizes before the 24th (8,388,608 GPUs: more nodes than a
    cluster may have) failed; every size's cluster is now built first."""
    import autoplace.sweep

    def no_search(*_: Any) -> None:
        raise AssertionError("searched before refusing the size")

    monkeypatch.setattr(autoplace.sweep, "_at_batch", no_search)
    line = error_line(invoke("scale", TINY, "--gpu", "h100", "--gpus", "1..2147483647", "--time-limit", "0.2"))
    assert line.startswith("--gpus: 8,388,608 GPUs: nodes: must be in [1, 1_000_000]"), line


def test_a_nested_hugging_face_key_is_named_as_the_config_spells_it(tmp_path: Path) -> None:
    """rope_scaling.original_max_position_embeddings = 0 was reported as autoplace's own
    ``rope_scaling.original_max_position`` (found by test_fuzz_inputs' single-field mutations)."""
    config = json.loads((MODELS / "hf" / "deepseek-v2-lite" / "config.json").read_text())
    config["rope_scaling"]["original_max_position_embeddings"] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    line = error_line(invoke("evaluate", path, "1x1xh100", "--plan", "tp=1"))
    assert line.startswith(f"{path}: rope_scaling.original_max_position_embeddings: must be in [1"), line


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_graph_layer_with_parameters_and_no_flops_solves_without_dividing_by_zero(tmp_path: Path) -> None:
    """What ``autoplace trace`` writes for an embedding, a lookup with parameters and no FLOPs, gave its
    block kind no module: ZeRO-3's per-module overlap took an index modulo 0 (tests/test_trace.py)."""
    layer = {"activation_bytes_per_token": 8.0, "repeat": 1, "tp_shardable": True}
    doc = {"name": "traced", "hidden": 32, "seq_len": 2048, "vocab": 100, "graph": [
        {**layer, "name": "embed", "params": 3200, "flops_per_token": 0.0},
        {**layer, "name": "block", "params": 8352, "flops_per_token": 16384.0, "repeat": 3},
        {**layer, "name": "head", "params": 3200, "flops_per_token": 6400.0}]}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    result = invoke("solve", path, "--cluster", "1x2xcpu", "--json", "--time-limit", "3")
    assert result.exit_code == 0, result.output


def test_a_bundles_recorded_overrides_are_named_as_plan_json_s(tmp_path: Path) -> None:
    """dryrun reloads the model with the overrides plan.json records: a bad one is that file's, not a flag's."""
    doc = {"inputs": {"model": str(TINY), "cluster": "1x1xh100", "overrides": {"seq_len": 0}}}
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    line = error_line(invoke("dryrun", tmp_path))
    assert line.startswith(f"{tmp_path / 'plan.json'}: inputs.overrides: seq_len: must be in [1"), line
