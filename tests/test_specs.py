"""The spec loaders' messages: each names the file, the field and what is valid, on one line.

Regression tests for the loader/CLI bugs tests/test_fuzz_inputs.py found, at unit level: bounds
that say the whole range, errors inside ``str | Model`` fields, the matmul efficiency table, the
compute-dtype peak check, HF key names, parse errors with a position, and finite scores for a
model with nothing to compute.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.cost.evaluate import per_second
from autoplace.errors import SpecError
from autoplace.specs._io import read_document
from autoplace.specs.cluster import check_compute_dtype, cluster_from_dict
from autoplace.specs.model import model_from_dict

REPO = Path(__file__).resolve().parents[1]
TINY = json.loads((REPO / "examples" / "models" / "tiny-llama.json").read_text())
INLINE: dict[str, Any] = {
    "name": "inline", "nodes": 1, "gpus_per_node": 2,
    "gpu": {"name": "gpu-x", "memory_GiB": 80, "peak_TFLOPS": {"bf16": 100, "fp32": 10}, "hbm_bandwidth_TBps": 2,
            "attention_efficiency": {"forward": [[512, 0.5], [4096, 0.7]]}},
    "intra_node": {"bandwidth_GBps": 100, "latency_us": 1}}


def _model_error(**changes: Any) -> str:
    with pytest.raises(SpecError) as info:
        model_from_dict({**TINY, **changes}, source="m.json")
    return str(info.value)


def _cluster_error(doc: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        cluster_from_dict(doc, source="c.yaml")
    return str(info.value)


def _with(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(("changes", "message"), [
    ({"layers": 10**30}, f"m.json: layers: must be in [1, 10_000] (got {10**30})"),
    ({"layers": 0}, "m.json: layers: must be in [1, 10_000] (got 0)"),
    ({"seq_len": 10**8}, "m.json: seq_len: must be in [1, 10_000_000] (got 100000000)"),
    ({"training": {"global_batch": 10**9}}, "m.json: training.global_batch: must be in [1, 100_000_000]"),
    ({"training": {"precision": {"param_bytes": 0}}}, "m.json: training.precision.param_bytes: must be in (0, 16]"),
])
def test_bounds_say_the_whole_range(changes: dict[str, Any], message: str) -> None:
    assert _model_error(**changes).startswith(message)


@pytest.mark.parametrize(("path", "value", "message"), [
    (("gpu", "memory_GiB"), -1, "c.yaml: gpu.memory_GiB: must be in [0.001, 100_000] (got -1)"),
    (("gpu", "zz"), 1, "c.yaml: gpu.zz: unknown key; valid keys here: name, memory_GiB, peak_TFLOPS,"),
    (("intra_node", "bandwidth_GBps"), None, "c.yaml: intra_node.bandwidth_GBps: required key is missing"),
    (("gpu",), 5, "c.yaml: gpu: must be a name or a mapping of fields (got 5)"),
    (("gpu", "peak_TFLOPS"), {"fp8": 1000}, "c.yaml: gpu.peak_TFLOPS: needs a peak for at least one of bf16, fp16"),
    (("nodes",), 2_000_000, "c.yaml: nodes: must be in [1, 1_000_000]"),
    (("gpus_per_node",), 2048, "c.yaml: gpus_per_node: must be in [1, 1024]"),
])
def test_inline_profile_errors_name_the_nested_field(path: tuple[str, ...], value: Any, message: str) -> None:
    doc = _with(INLINE, path, value)
    if value is None:
        doc = copy.deepcopy(INLINE)
        del doc[path[0]][path[1]]
    assert _cluster_error(doc).startswith(message)


def test_pool_profile_errors_name_the_pool() -> None:
    doc = {"name": "p", "pools": [{"nodes": 1, "gpus_per_node": 1, "gpu": INLINE["gpu"],
                                   "intra_node": {"bandwidth_GBps": 1, "latency_us": float("nan")}}]}
    assert _cluster_error(doc) == "c.yaml: pools.0.intra_node.latency_us: Input should be a finite number (got nan)"


@pytest.mark.parametrize(("table", "message"), [
    ([[float("nan"), 0.5]], "gpu.attention_efficiency.forward.0.0: Input should be a finite number"),
    ([[512, 0.5], [0, 0.7]], "gpu.attention_efficiency.forward.1.0: sequence length must be > 0 (got 0.0)"),
    ([[512, 0.5], [512, 0.7]], "gpu.attention_efficiency.forward.1.0: sequence length repeats row 0's"),
    ([[512, 0.5], [4096, 1.5]], "gpu.attention_efficiency.forward.1.1: fraction must be in [0.001, 1] (got 1.5)"),
    ([[512]], "gpu.attention_efficiency.forward.0: needs [sequence length, fraction]"),
    ([], "gpu.attention_efficiency.forward: needs at least one [sequence length, fraction] row"),
])
def test_attention_efficiency_rows_name_the_cell(table: list[list[float]], message: str) -> None:
    assert _cluster_error(_with(INLINE, ("gpu", "attention_efficiency", "forward"), table)).startswith(f"c.yaml: {message}")


def test_attention_efficiency_errors_name_the_cell() -> None:
    bad = {"forward": [[1024, 0.5]], "backward": [[1024, 0.4], [2048, 2.0]]}
    assert _cluster_error(_with(INLINE, ("gpu", "attention_efficiency"), bad)).startswith(
        "c.yaml: gpu.attention_efficiency.backward.1.1: fraction must be in [0.001, 1] (got 2.0)")


def test_attention_efficiency_rows_may_come_in_any_order() -> None:
    cluster = cluster_from_dict(_with(INLINE, ("gpu", "attention_efficiency", "forward"), [[4096, 0.7], [512, 0.5]]))
    assert cluster.pools[0].gpu.attention_efficiency.forward == [[512, 0.5], [4096, 0.7]]


def test_a_gpu_without_a_peak_for_the_model_dtype_names_the_cluster_file() -> None:
    bf16_only = cluster_from_dict(_with(INLINE, ("gpu", "peak_TFLOPS"), {"bf16": 100}))
    check_compute_dtype(bf16_only, "bf16", source="c.yaml")
    with pytest.raises(SpecError) as info:
        check_compute_dtype(bf16_only, "fp32", source="c.yaml")
    assert str(info.value) == ("c.yaml: gpu.peak_TFLOPS: GPU 'gpu-x' has no peak for fp32 (the model's compute "
                               "dtype) or a wider type; add a peak for fp32")


@pytest.mark.parametrize("key", ["flops_per_token", "activation_bytes_per_token"])
def test_graph_floats_are_finite_whole_counts(key: str) -> None:
    layer = {"name": "b", "params": 10, "flops_per_token": 20.0, "activation_bytes_per_token": 4.0}
    for value, says in [(float("inf"), "Input should be a finite number"), (0.5, "must be 0 or >= 1"),
                        (1e19, "must be in [0, ")]:
        doc = {"hidden": 8, "seq_len": 8, "graph": [{**layer, key: value}]}
        with pytest.raises(SpecError) as info:
            model_from_dict(doc, source="g.json")
        assert str(info.value).startswith(f"g.json: graph.0.{key}: {says}"), str(info.value)


def test_graph_with_nothing_to_train_is_refused() -> None:
    doc = {"hidden": 8, "seq_len": 8, "graph": [{"name": "b", "params": 0, "flops_per_token": 0,
                                                 "activation_bytes_per_token": 8}]}
    with pytest.raises(SpecError, match="^g.json: graph: every layer has params 0 and flops_per_token 0"):
        model_from_dict(doc, source="g.json")


def test_rates_are_zero_not_inf_when_nothing_takes_time() -> None:
    assert per_second(np.array([5.0, 6.0]), np.array([0.0, 2.0])).tolist() == [0.0, 3.0]


# --------------------------------------------------------------------------- Hugging Face configs

HF = REPO / "tests" / "data" / "hf"


def _hf_error(name: str, **changes: Any) -> SpecError:
    config = {**json.loads((HF / name).read_text()), **changes}
    with pytest.raises(SpecError) as info:
        model_from_dict(config, source=name)
    return info.value


@pytest.mark.parametrize(("name", "changes", "field", "says"), [
    ("meta-llama-3-8b.json", {"num_hidden_layers": 10**5}, "num_hidden_layers", "(autoplace's layers)"),
    ("deepseek-v2-lite.json", {"kv_lora_rank": 10**8}, "kv_lora_rank", "(autoplace's attention.kv_lora_rank)"),
    ("gpt2.json", {"n_positions": 10**9}, "n_positions", "(autoplace's max_position)"),
    ("gpt2.json", {"n_embd": 10, "n_head": 3}, "n_head", "must divide n_embd=10"),
    ("mixtral-8x7b-v0.1.json", {"hidden_size": 4095}, "num_attention_heads", "must divide hidden_size=4095"),
])
def test_hf_errors_use_the_config_keys(name: str, changes: dict[str, Any], field: str, says: str) -> None:
    err = _hf_error(name, **changes)
    assert err.field == field and says in str(err), str(err)


def test_hf_architecture_with_a_line_break_stays_one_line() -> None:
    err = _hf_error("gpt2.json", architectures=["GPT2\nLMHeadModel"])
    assert "'GPT2\\nLMHeadModel' is not supported" in str(err) and len(str(err).splitlines()) == 1


# --------------------------------------------------------------------------- parse errors and the CLI


@pytest.mark.parametrize(("suffix", "content", "message"), [
    (".json", '{"a": "NaN",\n "b": -Infinity}', "invalid JSON at line 2 column 7: -Infinity is not a valid number"),
    (".yaml", "a: 1\nb: x\x07y\n", "invalid YAML at line 2 column 5: unacceptable character #x0007"),
])
def test_parse_errors_give_line_and_column(tmp_path: Path, suffix: str, content: str, message: str) -> None:
    path = tmp_path / f"f{suffix}"
    path.write_text(content)
    with pytest.raises(SpecError) as info:
        read_document(path)
    assert str(info.value).startswith(f"{path}: {message}") and len(str(info.value).splitlines()) == 1


def test_evaluate_usage_names_its_arguments() -> None:
    result = CliRunner().invoke(app, ["evaluate", "--help"])
    assert "MODEL" in result.stdout and "CLUSTER" in result.stdout and "{model}" not in result.stdout


def test_hf_key_tables_name_real_shorthand_fields() -> None:
    from autoplace.specs.hf import _FAMILIES
    from autoplace.specs.model import MLA, MoE, TransformerSpec

    nested = {"moe": MoE, "attention": MLA}
    for name, family in _FAMILIES.items():
        for field in family.keys:
            owner, _, leaf = field.rpartition(".")
            assert leaf in (nested[owner] if owner else TransformerSpec).model_fields, (name, field)


def test_plan_round_trips_through_its_contract_dict() -> None:
    from autoplace.plan import Plan, build_plan

    plans = [build_plan({"tp": 2, "pp": 2, "zero": 1, "recompute": "selective"}, world=8, blocks=8, global_batch=16),
             build_plan({"zero": 3, "preset": "hsdp", "layers": "1:7", "pp": 2, "recompute_layers": "f:f:n:n:s:n:n:n",
                         "offload_optimizer": "cpu"}, world=16, blocks=8, global_batch=32, gpus_per_node=4),
             build_plan({"pp": 2, "vpp": 2, "dp": 4}, world=8, blocks=8, global_batch=16)]
    for plan in plans:
        assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_from_dict_names_the_missing_key() -> None:
    import pytest

    from autoplace.errors import SpecError
    from autoplace.plan import Plan, build_plan

    d = build_plan({}, world=8, blocks=8, global_batch=16).to_dict()
    del d["micro_batch"]
    with pytest.raises(SpecError, match="micro_batch"):
        Plan.from_dict(d)


def test_shipped_profiles_read_the_same_with_libyaml_as_with_the_guarded_reader(tmp_path: Path) -> None:
    """read_shipped (libyaml, for our own profiles) gives every shipped file the values the
    guarded pure-Python reader gives it; a file libyaml cannot read gets the guarded reader's
    one-line error."""
    from importlib import resources

    from autoplace.errors import SpecError
    from autoplace.specs._io import read_document, read_shipped
    from autoplace.specs.cluster import profile_names

    for kind in ("gpu", "interconnect"):
        for name in profile_names(kind):
            with resources.as_file(resources.files("hardware_profiles") / kind / f"{name}.yaml") as path:
                assert read_shipped(path) == read_document(path), (kind, name)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\n  bad: [1, 2\n")
    with pytest.raises(SpecError, match="invalid YAML"):
        read_shipped(broken)


@pytest.mark.parametrize(("path", "value", "said"), [
    (("gpu", "gemm_k_overhead"), -5, "gpu.gemm_k_overhead: must be in [0, 1e+06] (got -5)"),
    (("gpu", "gemm_efficiency_k"), 0, "gpu.gemm_efficiency_k: must be in [1, 1e+07] (got 0)"),
    (("gpu", "attention_efficiency", "head_dim_overhead"), "a", "gpu.attention_efficiency.head_dim_overhead: Input should be a valid number"),
])
def test_small_model_kernel_fields_are_checked(path: tuple[str, ...], value: Any, said: str) -> None:
    """The K-loop and head-dim overheads (issue 25 item 3) are one line naming the field."""
    message = _cluster_error(_with(INLINE, path, value))
    assert said in message and "\n" not in message


def test_qkv_bias_follows_bias_unless_stated() -> None:
    """Issue 36: ``bias: true`` alone is biases on every linear layer, q/k/v included (GPT-2/3, BLOOM);
    a stated qkv_bias is kept (Qwen2: true alone; false beside bias: every linear layer but q/k/v,
    whose q/k/v biases are then not counted)."""
    from autoplace.cost.layers import layer_table

    base = {"name": "m", "layers": 2, "hidden": 256, "ffn_hidden": 1024, "heads": 4, "vocab": 1000, "seq_len": 128}
    flags = [(m.bias, m.qkv_bias) for m in (model_from_dict({**base, **extra}) for extra in (
        {}, {"bias": True}, {"qkv_bias": True}, {"bias": True, "qkv_bias": False}, {"bias": False}))]
    assert flags == [(False, False), (True, True), (False, True), (True, False), (False, False)]
    every, but_qkv = (layer_table(model_from_dict({**base, "bias": True, **extra})).params
                      for extra in ({}, {"qkv_bias": False}))
    assert every - but_qkv == 2 * 3 * 256  # two layers' q, k and v biases
    assert model_from_dict(model_from_dict({**base, "bias": True}).model_dump()).qkv_bias  # round trip
