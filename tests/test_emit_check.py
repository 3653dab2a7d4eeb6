"""``autoplace check`` on configs users already have: their own batch is the truth, Hugging Face
Trainer "auto" values are resolved or reported, and the output names the framework and the plan."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_cli import A100_8, MODELS, invoke, strict_json

LLAMA_8B = MODELS / "llama-3-8b.json"  # global batch 1024 in the model file


def _llama_8b_4k(tmp_path: Path) -> Path:
    """Llama-3-8B at 4,096 tokens: a ZeRO-3 config without activation checkpointing fits 80 GB there
    (at the file's 8,192 the eager transformers model it trains keeps 57 GB of activations and does not)."""
    path = tmp_path / "llama-3-8b.json"
    path.write_text(json.dumps({**json.loads(LLAMA_8B.read_text()), "seq_len": 4096}))
    return path

# The shape of transformers' documented ZeRO-3 example (docs: "DeepSpeed" integration, ZeRO-3 config)
HF_TRAINER_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_batch_that_differs_from_the_model_default_is_the_truth(tmp_path: Path) -> None:
    cfg = _write(tmp_path, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1,
                            "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    model = _llama_8b_4k(tmp_path)
    result = invoke("check", cfg, model, A100_8)
    assert result.exit_code == 0, result.output
    first, rest = result.stdout.split("\n", 1)
    assert first.startswith(f"ok: deepspeed config {cfg} for llama-3-8b on ")
    plan_read = " ".join(rest.split("\n  note")[0].split())  # the plan read, folded at 100 columns
    assert plan_read.startswith("plan read: ") and "zero=3,mbs=1" in plan_read and "(global batch 64)" in plan_read
    doc = strict_json(invoke("check", cfg, model, A100_8, "--json").stdout)
    assert (doc["framework"], doc["plan"]["global_batch"], doc["plan"]["grad_accum"]) == ("deepspeed", 64, 8)


def test_hf_trainer_auto_values_are_resolved_or_reported(tmp_path: Path) -> None:
    result = invoke("check", _write(tmp_path, HF_TRAINER_ZERO3), _llama_8b_4k(tmp_path), A100_8, "--json")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["ok"] and doc["plan"]["zero_stage"] == 3 and doc["plan"]["global_batch"] == 1024
    notes = "\n".join(doc["notes"])
    assert 'bf16.enabled "auto": true (the model trains in bf16)' in notes
    assert 'fp16.enabled "auto": false' in notes
    assert "resolved from the model's global batch 1024" in notes
    assert 'unresolved "auto"' in notes and "optimizer.params.lr" in notes and "gradient_clipping" in notes


def test_auto_micro_batch_next_to_a_stated_batch_keeps_the_stated_batch(tmp_path: Path) -> None:
    cfg = _write(tmp_path, {**HF_TRAINER_ZERO3, "train_batch_size": 256, "gradient_accumulation_steps": 4})
    doc = strict_json(invoke("check", cfg, LLAMA_8B, A100_8, "--json").stdout)
    assert (doc["plan"]["global_batch"], doc["plan"]["micro_batch"], doc["plan"]["grad_accum"]) == (256, 8, 4)


def test_check_still_rejects_what_is_wrong(tmp_path: Path) -> None:
    """The gate can fail: a broken batch identity is bad input (2), an OOM is a reject (1)."""
    cfg = _write(tmp_path, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 3,
                            "gradient_accumulation_steps": 1, "bf16": {"enabled": True}})
    result = invoke("check", cfg, LLAMA_8B, A100_8)
    assert result.exit_code == 2 and "train_batch_size 64 != train_micro_batch_size_per_gpu(3)" in result.output
    oom = _write(tmp_path, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                            "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}})
    result = invoke("check", oom, LLAMA_8B, A100_8)
    assert result.exit_code == 1 and result.stdout.startswith("REJECT: deepspeed config")
    assert "out-of-memory" in result.stdout


def test_accelerate_says_the_batch_came_from_the_model(tmp_path: Path) -> None:
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: FSDP\nnum_processes: 8\nmixed_precision: bf16\n"
                   "fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: true}\n")
    doc = strict_json(invoke("check", cfg, LLAMA_8B, A100_8, "--json").stdout)
    assert doc["framework"] == "accelerate" and "state no batch size" in doc["notes"][0]
