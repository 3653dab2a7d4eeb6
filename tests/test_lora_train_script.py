"""The LoRA / QLoRA train script (autoplace.emit.peft_train): it compiles, its PEFT and
bitsandbytes configs say what the spec says, and on a tiny Llama its adapters are the ones the
cost model counts and the only weights that train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autoplace.cost.finetune import nf4_bytes_per_param
from autoplace.cost.layers import layer_table
from autoplace.emit.peft_train import render_peft_train
from autoplace.errors import EmitError
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.model import TransformerSpec, with_overrides
from tests.helpers import gpu_cluster

TINY = TransformerSpec.model_validate({"name": "tiny-llama", "layers": 2, "hidden": 64, "ffn_hidden": 176, "heads": 4,
                                       "kv_heads": 2, "vocab": 256, "seq_len": 32, "family": "llama",
                                       "training": {"global_batch": 8}})


def tuned(method: str, **extra: Any) -> TransformerSpec:
    spec = with_overrides(TINY, {"method": method, **extra}, source="test")
    assert isinstance(spec, TransformerSpec)
    return spec


def script(spec: TransformerSpec, plan: str = "dp=2,mbs=2,recompute=full") -> str:
    cluster = gpu_cluster(2, per_node=2)
    p = build_plan(parse_plan_string(plan), world=cluster.gpus, blocks=layer_table(spec).blocks,
                   global_batch=spec.training.global_batch, gpus_per_node=cluster.gpus_per_node)
    return render_peft_train(p, spec, cluster)


def namespace(text: str) -> dict[str, Any]:
    """The script executed as a module (its __main__ guard keeps it from training)."""
    pytest.importorskip("peft")
    ns: dict[str, Any] = {"__name__": "train_peft"}
    exec(compile(text, "train_peft.py", "exec"), ns)  # noqa: S102 - the script under test
    return ns


def script_function(text: str, name: str) -> Any:
    """One top-level function of a generated script, alone: the script's torch, PEFT and transformers
    imports take seconds and the functions tested here import what they use themselves."""
    import argparse
    import ast

    tree = ast.parse(text)
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    ns: dict[str, Any] = {"argparse": argparse, "__doc__": ast.get_docstring(tree)}
    exec(compile(ast.Module([function], type_ignores=[]), "peft_train.py", "exec"), ns)  # noqa: S102 - the script under test
    return ns[name]


def test_the_script_takes_one_framework_config_and_the_deepspeed_launchers_rank() -> None:
    """--deepspeed_config or --accelerate_config (one, required: the placement it was costed with), the
    model's weights, and the --local_rank=N the deepspeed launcher appends."""
    parse = script_function(script(tuned("lora")), "parse_args")
    args = parse(["--deepspeed_config", "ds.json", "--model", "m", "--local_rank=1"])
    assert (args.deepspeed_config, args.accelerate_config, args.model) == ("ds.json", None, "m")
    for words in (["--model", "m"], ["--model", "m", "--deepspeed_config", "a", "--accelerate_config", "b"],
                  ["--deepspeed_config", "a"]):
        with pytest.raises(SystemExit):
            parse(words)


def test_lora_config_is_the_specs() -> None:
    spec = tuned("lora", lora_rank=8, lora_alpha=16, lora_targets=["q", "v", "down"])
    ns = namespace(script(spec))
    config = ns["lora_config"]()
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.0)
    assert set(config.target_modules) == {"q_proj", "v_proj", "down_proj"}
    assert ns["quantization_config"]() is None
    assert (ns["MICRO_BATCH"], ns["GRAD_ACCUM"], ns["GRADIENT_CHECKPOINTING"]) == (2, 2, True)


def test_fused_families_name_their_fused_modules() -> None:
    spec = with_overrides(TINY.model_copy(update={"family": "gpt_neox"}), {"method": "lora"}, source="test")
    assert isinstance(spec, TransformerSpec)
    assert set(namespace(script(spec))["TARGET_MODULES"]) == {"query_key_value", "dense", "dense_h_to_4h",
                                                              "dense_4h_to_h"}


def test_qlora_config_is_nf4_double_quantized() -> None:
    torch = pytest.importorskip("torch")
    config = namespace(script(tuned("qlora", paged_optimizer=True)))["quantization_config"]()
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 == config.bnb_4bit_quant_storage


def test_full_training_has_no_peft_script() -> None:
    with pytest.raises(EmitError, match="method lora or qlora"):
        script(TINY)


def test_adapters_are_what_the_cost_model_trains(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = tuned("lora")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=32))
    base.save_pretrained(tmp_path)
    ns = namespace(script(spec, "dp=2,mbs=2,recompute=none"))
    model = ns["build_model"](str(tmp_path))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == layer_table(spec).trainable
    assert all("lora_" in n for n in trainable)
    ids = next(ns["batches"](None, 256, 1))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == set(trainable)  # the frozen base gets no gradient


def test_qlora_base_is_stored_as_the_cost_model_says(tmp_path: Path) -> None:
    # bitsandbytes 0.50 quantizes and runs NF4 on CPU (torch 2.13): the script's own model
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    bnb = pytest.importorskip("bitsandbytes")
    spec = tuned("qlora")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=32)).save_pretrained(tmp_path)
    ns = namespace(script(spec))
    model = ns["build_model"](str(tmp_path))
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 7 * TINY.layers  # every projection of every block; the head stays 16-bit
    stored = sum(m.weight.numel() * m.weight.element_size() + m.weight.quant_state.absmax.numel()
                 + 4 * m.weight.quant_state.state2.absmax.numel() for m in four_bit)
    table = layer_table(spec)
    predicted = sum(k.quant_tp + k.quant_rep for k in table.kinds) * table.blocks * nf4_bytes_per_param()
    assert stored == pytest.approx(predicted, rel=0.02)  # second-level constants round up per matrix
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == table.trainable
    ids = next(ns["batches"](None, 256, 1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
