"""autoplace trace: a PyTorch model, built on the meta device, becomes the layer graph solve reads.

The must-show: transformers' LlamaForCausalLM with tiny widths, built from a LlamaConfig (no
weights), traces to a graph whose parameters and forward FLOPs equal the shorthand model of
the same shape within 1% (FlopCounterMode and the shorthand's formulas both count matmuls
and the full, uncausal attention core).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.cost.layers import layer_table
from autoplace.specs.model import GraphSpec, load_model, model_from_dict

pytest.importorskip("torch")

TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}
SEQ = 64


def run_trace(tmp_path: Path, factory: str, args: dict[str, Any] | None, *extra: str) -> GraphSpec:
    out = tmp_path / "model.json"
    cmd = ["trace", factory, "--seq-len", str(SEQ), "--out", str(out), *extra]
    if args is not None:
        cmd += ["--args", json.dumps(args)]
    result = CliRunner().invoke(app, cmd)
    assert result.exit_code == 0, result.output
    model = load_model(out)
    assert isinstance(model, GraphSpec)
    return model


def forward_flops_per_token(model: Any) -> float:
    t = layer_table(model)
    blocks = sum(t.kinds[k].flops for k in t.sequence)
    return blocks + t.embed.flops + t.head.flops


def test_llama_trace_matches_the_shorthand(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    traced = run_trace(tmp_path, "transformers:LlamaForCausalLM", TINY_LLAMA)
    shorthand = model_from_dict({
        "layers": 3, "hidden": 64, "ffn_hidden": 176, "heads": 4, "kv_heads": 2, "vocab": 128, "seq_len": SEQ,
        "ffn": "swiglu", "norm": "rmsnorm", "tied_embeddings": False}, source="shorthand")
    assert layer_table(traced).params == pytest.approx(layer_table(shorthand).params, rel=0.01)
    assert forward_flops_per_token(traced) == pytest.approx(forward_flops_per_token(shorthand), rel=0.01)
    assert [(e.name, e.repeat) for e in traced.graph] == [("embed", 1), ("block", 3), ("head", 1)]
    assert all(e.activation_bytes_per_token > 0 for e in traced.graph[1:])


def test_plain_torch_factory(tmp_path: Path) -> None:
    traced = run_trace(tmp_path, "tests.trace_models:build", {"layers": 4, "hidden": 32, "width": 128})
    block = traced.graph[1]
    assert (block.name, block.repeat) == ("block", 4)
    assert block.params == 2 * 32 * 128 + 128 + 32
    assert block.flops_per_token == 2 * 2 * 32 * 128  # two matmuls, 2 FLOPs per multiply-add
    # saved for backward per token, bf16: up's input (32), gelu's input (128), down's input (128)
    assert block.activation_bytes_per_token == 2 * (32 + 128 + 128)
    assert traced.graph[0].params == 100 * 32 and traced.graph[-1].params == 32 * 100
    assert (traced.hidden, traced.vocab, traced.seq_len) == (32, 100, SEQ)


def test_hidden_input_without_an_embedding(tmp_path: Path) -> None:
    traced = run_trace(tmp_path, "tests.trace_models:Stack", None, "--input", "hidden", "--hidden", "16")
    [block] = traced.graph
    assert (block.repeat, block.params, block.flops_per_token) == (2, 2 * 16 * 64 + 64 + 16, 2 * 2 * 16 * 64)
    assert (traced.hidden, traced.vocab) == (16, 0)


def test_the_traced_graph_solves(tmp_path: Path) -> None:
    run_trace(tmp_path, "tests.trace_models:build", None)
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "model.json"), "--cluster", "1x2xcpu", "--json",
                                      "--time-limit", "3"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plans"]


@pytest.mark.parametrize(("factory", "args", "needle"), [
    ("no_colon", None, "module:factory"),
    ("no_such_module_xyz:build", None, "cannot import"),
    ("tests.trace_models:nothing", None, "no attribute"),
    ("tests.trace_models:build", "{not json", "not JSON"),
    ("tests.trace_models:build", '{"depth": 3}', "rejected the arguments"),
])
def test_bad_factories_are_one_line(tmp_path: Path, factory: str, args: str | None, needle: str) -> None:
    cmd = ["trace", factory, "--out", str(tmp_path / "m.json")] + (["--args", args] if args else [])
    result = CliRunner().invoke(app, cmd)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("extra", "needle"), [
    (["--input", "hidden"], "on hidden of shape (1, 2048, 32) (--input, --batch, --seq-len) failed: RuntimeError"),
    (["--seq-len", "2147483647", "--batch", "2147483647"], "failed: RuntimeError: Storage size calculation overflowed"),
])
def test_a_forward_the_model_cannot_run_is_one_line(tmp_path: Path, extra: list[str], needle: str) -> None:
    """Found by benchmarks/fuzz.py (issue 36): the user's model refusing the traced input (token ids
    fed as activations, a micro-batch too large for torch) was an internal error, exit 1."""
    result = CliRunner().invoke(app, ["trace", "tests.trace_models:build", "--out", str(tmp_path / "m.json"), *extra])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert result.stderr.startswith("autoplace: error: FACTORY: its forward and backward on") and needle in result.stderr
