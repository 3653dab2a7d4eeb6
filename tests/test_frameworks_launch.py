"""A bundle's launch line runs: the FSDP2 bundle's launch_torchrun.sh starts torchrun on 2 gloo ranks,
which runs the bundle's train_fsdp2.py, which imports the plan's module and trains a tiny
Hugging Face Llama (from its saved config) for two steps of the plan's batch; a LoRA bundle's
launch_accelerate.sh (accelerate launch) and launch_deepspeed.sh (the deepspeed launcher, ZeRO-3 on
DeepSpeed's CPU accelerator) run its peft_train.py with the bundle's config for two steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autoplace.bundle import emit
from autoplace.emit.launch import Launch
from tests.test_emit_fsdp import _free_port
from tests.test_emit_plans import cpu_cluster, make_plan, small_model

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")


@pytest.mark.slow
def test_the_fsdp2_bundle_launches_and_trains(tmp_path) -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, use_cache=False)
    config.save_pretrained(tmp_path / "hf")
    model, cluster = small_model("fp32", layers=4, batch=8, seq_len=32), cpu_cluster(2)
    written = emit(make_plan("zero=3,mbs=2,recompute_layers=f:n:s:f", model, cluster), model, cluster,
                   ["fsdp", "torchrun"], tmp_path / "bundle", launch=Launch(master_port=_free_port()))
    assert {"fsdp2_parallelize.py", "train_fsdp2.py", "launch_torchrun.sh"} <= set(written)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "HF_MODEL": str(tmp_path / "hf")}
    done = subprocess.run(["bash", str(written["launch_torchrun.sh"]), "--from-config", "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1: done" in done.stdout


# ---------------------------------------------------------------------------------------
# LoRA bundles: the launch scripts run peft_train.py with the bundle's framework config

# Test-only: DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce op (~40 s on a fresh
# machine) that only inference_all_reduce uses; training collectives go through gloo either way
# (tests/test_emit_deepspeed.py skips it in-process; the launched processes import this first).
SKIP_SHM_OP = """import importlib.abc, importlib.machinery, sys


class _SkipShmOp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "deepspeed.comm.torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.build_shm_op = lambda: None

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SkipShmOp())
"""


def _lora_bundle(framework: str, plan: str, tmp_path):
    """A tiny Llama's LoRA bundle for 2 CPU ranks, its Hugging Face weights, and the spec."""
    from autoplace.specs.model import TransformerSpec

    spec = TransformerSpec.model_validate({
        "name": "tiny-llama", "layers": 2, "hidden": 64, "ffn_hidden": 176, "heads": 4, "kv_heads": 2, "vocab": 256,
        "seq_len": 32, "family": "llama", "training": {"global_batch": 8, "precision": "fp32", "method": "lora"}})
    hf = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**hf)).save_pretrained(tmp_path / "hf")
    cluster = cpu_cluster(2)
    written = emit(make_plan(plan, spec, cluster), spec, cluster, [framework], tmp_path / "bundle",
                   launch=Launch(master_port=_free_port()))
    return written, hf, spec


def _trains_its_adapters(done, hf, spec, tmp_path) -> None:
    """Two optimizer steps on 2 data-parallel ranks, with PEFT's own count of trainable parameters
    (the script prints it) equal to autoplace's; the saved adapters are whole (gathered)."""
    from safetensors.torch import load_file

    from autoplace.cost.layers import layer_table
    from autoplace.fidelity.peft_count import peft_trainable

    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2 loss" in done.stdout and "on 2 data-parallel ranks" in done.stdout
    printed = {int(line.split()[2].replace(",", "")) for line in done.stdout.splitlines()
               if line.startswith("trainable params:")}
    assert printed == {peft_trainable(hf, spec)} == {layer_table(spec).trainable}
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sum(t.numel() for t in saved.values()) == layer_table(spec).trainable


@pytest.mark.slow
def test_a_lora_bundle_trains_through_accelerate_launch(tmp_path) -> None:
    """launch_accelerate.sh: accelerate launch with the bundle's config runs peft_train.py
    --accelerate_config (DDP on 2 gloo ranks: accelerate runs FSDP only on GPUs)."""
    written, hf, spec = _lora_bundle("accelerate", "dp_replicate=2,zero=0,mbs=2", tmp_path)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "HF_MODEL": str(tmp_path / "hf")}
    done = subprocess.run(["bash", str(written["launch_accelerate.sh"]), "--steps", "2", "--out",
                           str(tmp_path / "adapter")], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    _trains_its_adapters(done, hf, spec, tmp_path)


@pytest.mark.slow
def test_a_lora_bundle_trains_with_zero3_through_the_deepspeed_launcher(tmp_path) -> None:
    """launch_deepspeed.sh: the deepspeed launcher runs peft_train.py --deepspeed_config ds_config.json
    (ZeRO-3: the base partitioned as it loads); DeepSpeed's CPU accelerator, 2 gloo ranks."""
    written, hf, spec = _lora_bundle("deepspeed", "zero=3,mbs=2", tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SKIP_SHM_OP)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "HF_MODEL": str(tmp_path / "hf"), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(written["launch_deepspeed.sh"]), "--steps", "2", "--out",
                           str(tmp_path / "adapter")], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    _trains_its_adapters(done, hf, spec, tmp_path)
    assert "zero_optimization" in json.loads((tmp_path / "bundle" / "ds_config.json").read_text())


# ---------------------------------------------------------------------------------------
# Each bundle's launch line, as bash runs it, handed to the framework's own argument parser

RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RECORD_TO"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}) + "\\n")
"""
PLACEHOLDERS = {"DATA_PATH": "/data/corpus_text_document", "TOKENIZER_MODEL": "meta-llama/Meta-Llama-3-8B",
                "CHECKPOINT_DIR": "/ckpt", "TRAIN_ITERS": "1000", "HF_ASSETS_PATH": "/assets/llama-3-8b",
                "HF_MODEL": "meta-llama/Meta-Llama-3-8B"}


def launched(framework: str, text: str, tmp_path, script: str = "launch_torchrun.sh") -> dict:
    """Write ``framework``'s bundle for the plan ``text`` (16 A100s), run its launch script with recording
    stand-ins for the launchers (and CUDA_DEVICE_MAX_CONNECTIONS=1 already set by the site); what the
    launcher received, with the bundle's directory."""
    from tests.test_emit_plans import CLUSTER16, MODEL

    bundle = tmp_path / "bundle"
    emit(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16, [framework, "torchrun"], bundle)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "accelerate", "deepspeed"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "record.jsonl"
    env = {**os.environ, **PLACEHOLDERS, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_TO": str(record),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    done = subprocess.run(["bash", str(bundle / script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    return {**call, "bundle": bundle}


@pytest.mark.parametrize(("text", "connections"), [("tp=2,pp=2,zero=1", "1"), ("pp=2,zero=1", "1"),
                                                   ("tp=2,zero=3", None)])
def test_megatron_launch_line_is_megatrons_arguments(text: str, connections: str | None, tmp_path) -> None:
    """pretrain_gpt.py receives MEGATRON_ARGS and the placeholders: megatron-core's TransformerConfig and
    the restated validate_args accept them (tests/test_emit_megatron.py); CUDA_DEVICE_MAX_CONNECTIONS is 1
    under tensor parallelism (kept as the site set it otherwise) and unset under Megatron-FSDP."""
    from tests.test_emit_megatron import megatron_core_config

    call = launched("megatron", text, tmp_path)
    argv = call["argv"]
    args = argv[argv.index("pretrain_gpt.py") + 1:]
    for flag, var, _ in (("--data-path", "DATA_PATH", ""), ("--tokenizer-model", "TOKENIZER_MODEL", ""),
                         ("--save", "CHECKPOINT_DIR", ""), ("--train-iters", "TRAIN_ITERS", "")):
        assert args[args.index(flag) + 1] == PLACEHOLDERS[var]
    placeholders = {"data_path", "tokenizer_model", "tokenizer_type", "save", "load", "train_iters"}
    kept = [w for i, w in enumerate(args) if not (w.lstrip("-").replace("-", "_") in placeholders
                                                   or (i and args[i - 1].lstrip("-").replace("-", "_") in placeholders))]
    plan = make_plan(text, *_model_cluster())
    config, _ = megatron_core_config(kept, plan)
    assert config.tensor_model_parallel_size == plan.tp
    assert call["max_connections"] == connections


def _model_cluster():
    from tests.test_emit_plans import CLUSTER16, MODEL

    return MODEL, CLUSTER16


def test_torchtitan_launch_line_is_torchtitans_job(tmp_path) -> None:
    """torchrun runs ``-m torchtitan.train --job.config_file``: torchtitan's ConfigManager parses those very
    words into the job (degrees, model) the plan says."""
    from tests.test_emit_torchtitan import titan as titan_fixture

    call = launched("torchtitan", "tp=2,pp=2,zero=3", tmp_path)
    argv = call["argv"]
    assert argv[argv.index("-m") + 1] == "torchtitan.train"
    words = argv[argv.index("torchtitan.train") + 1:]
    with _fixture(titan_fixture) as titan:
        job = titan.ConfigManager().parse_args(words)
    assert (job.parallelism.tensor_parallel_degree, job.parallelism.pipeline_parallel_degree) == (2, 2)
    assert (job.model.name, job.model.flavor) == ("llama3", "autoplace")
    assert job.model.hf_assets_path == PLACEHOLDERS["HF_ASSETS_PATH"]  # the tokenizer, a required input


def test_deepspeed_launch_line_passes_deepspeeds_config(tmp_path, monkeypatch) -> None:
    """The script gets ``--deepspeed --deepspeed_config PATH`` (deepspeed.add_config_arguments) and that
    file is the config DeepSpeedConfig accepts for the plan."""
    import argparse

    import deepspeed

    from tests.test_emit_deepspeed import check_parsed, deepspeed_accepts

    call = launched("deepspeed", "zero=3", tmp_path)
    argv = call["argv"]
    parsed = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_known_args(argv[argv.index("train.py") + 1:])[0]
    assert parsed.deepspeed and parsed.deepspeed_config == str(call["bundle"] / "ds_config.json")
    model, cluster = _model_cluster()
    plan = make_plan("zero=3", model, cluster)
    cfg = json.loads((call["bundle"] / "ds_config.json").read_text())
    check_parsed(deepspeed_accepts(cfg, plan, monkeypatch), cfg, plan)


def test_accelerate_launch_line_is_accelerates_command(tmp_path, monkeypatch) -> None:
    """``accelerate launch`` receives the bundle's config and the node geometry; accelerate's own launch
    parser and validation accept the words, and read the plan's FSDP2 settings from the config."""
    from accelerate.commands import launch

    call = launched("accelerate", "zero=3", tmp_path)
    assert call["argv"][0] == "launch"
    args = launch.launch_command_parser().parse_args(call["argv"][1:])
    assert args.config_file == str(call["bundle"] / "accelerate_config.yaml")
    args, _, _ = launch._validate_launch_command(args)
    assert (args.num_machines, args.num_processes, int(args.fsdp_version)) == (2, 16, 2)
    assert args.training_script == "train.py"


class _fixture:
    """A generator fixture used as a context manager (the torchtitan import shim)."""

    def __init__(self, fixture) -> None:
        self.gen = fixture.__wrapped__()

    def __enter__(self):
        return next(self.gen)

    def __exit__(self, *exc) -> None:
        next(self.gen, None)
