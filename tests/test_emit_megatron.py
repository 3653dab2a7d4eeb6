"""Megatron-LM arguments: the right flags per plan, and Megatron's own parser when it is importable.

Megatron-LM is not a pip dependency (``megatron.training`` ships only in its repository), so
the parser test runs where a checkout is on the path and is skipped elsewhere.  The flags
below were checked against ``megatron/training/arguments.py`` (``add_megatron_arguments`` and
``validate_args``) of Megatron-LM's main branch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

from autoplace.emit import emit, emit_megatron
from autoplace.emit.megatron import block_pattern
from autoplace.errors import EmitError
from autoplace.specs.model import load_model
from tests.helpers import REPO, gpu_cluster
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan, small_model

LLAMA_70B = load_model(REPO / "examples/models/llama-3-70b.json")
C64 = gpu_cluster(64)


def args_of(text: str, model=MODEL, cluster=CLUSTER16) -> list[str]:
    return emit_megatron(make_plan(text, model, cluster), model, cluster)


def value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_megatron_3d_plan() -> None:
    args = args_of("tp=8,pp=4,vpp=2,zero=1,recompute=selective", LLAMA_70B, C64)
    assert [value(args, f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                     "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
                                     "--global-batch-size", "--recompute-granularity")] == [
        "8", "4", "10", "1", "2048", "selective"]
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--swiglu", "--group-query-attention",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"} <= set(args)
    assert (value(args, "--num-query-groups"), value(args, "--normalization")) == ("8", "RMSNorm")


def test_uneven_splits_use_first_last_counts_or_an_explicit_layout() -> None:
    args = args_of("pp=4,zero=1,layers=1:3:3:1")
    assert (value(args, "--decoder-first-pipeline-num-layers"), value(args, "--decoder-last-pipeline-num-layers")) == (
        "1", "1")
    args = args_of("pp=2,vpp=2,zero=1,layers=2:6")
    assert value(args, "--pipeline-model-parallel-layout") == "Et|t*3|t|t*3L"  # chunks in virtual-stage order


def test_recompute_block_method_matches_first_k_layers_of_each_chunk() -> None:
    args = args_of("pp=2,zero=1,recompute_layers=f:f:n:n:f:f:n:n")
    assert [value(args, f) for f in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")] == [
        "full", "block", "2"]
    assert block_pattern([4, 4], 2) == ("full", "full", "none", "none") * 2
    assert value(args_of("zero=1,recompute=full"), "--recompute-method") == "uniform"


def test_zero_levels_and_offload() -> None:
    assert "--use-distributed-optimizer" not in args_of("zero=0")
    z1 = args_of("zero=1,preset=hsdp,offload_optimizer=cpu")
    assert {"--optimizer-cpu-offload", "--use-precision-aware-optimizer"} <= set(z1)
    assert value(z1, "--num-distributed-optimizer-instances") == "2"
    z3 = args_of("zero=3")
    assert (value(z3, "--data-parallel-sharding-strategy"), value(z3, "--ckpt-format")) == (
        "optim_grads_params", "fsdp_dtensor")
    assert value(args_of("zero=2"), "--data-parallel-sharding-strategy") == "optim_grads"


def test_precision_and_moe_shape() -> None:
    assert "--fp16" in args_of("zero=1", small_model("fp16"))
    assert "--accumulate-allreduce-grads-in-fp32" in args_of("zero=1", small_model("bf16-fp32-grads"))
    moe = small_model(moe={"experts": 8, "top_k": 2, "expert_ffn_hidden": 128, "first_dense_layers": 1})
    args = args_of("ep=4,zero=1", moe)
    assert [value(args, f) for f in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                                     "--moe-layer-freq")] == ["8", "2", "128", "[0,1,1,1,1,1,1,1]"]


def test_what_megatron_cannot_express_raises() -> None:
    for text, message in [("pp=2,zero=1,schedule=gpipe", "GPipe"), ("zero=3,offload_optimizer=cpu,offload_params=cpu",
                                                                    "parameter offload"),
                          ("zero=1,recompute_layers=f:n:f:n:f:n:f:n", "first k")]:
        with pytest.raises(EmitError, match=message):
            args_of(text)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                    or importlib.util.find_spec("megatron.training") is None,
                    reason="Megatron-LM (megatron.training) is not on the path")
def test_megatrons_own_parser_accepts_the_arguments(monkeypatch) -> None:  # pragma: no cover - needs a checkout
    import argparse

    from megatron.training.arguments import add_megatron_arguments, validate_args

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(
        args_of("tp=8,pp=4,vpp=2,zero=1,recompute=selective", LLAMA_70B, C64)
        + ["--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "10", "--lr", "1e-4"])
    args.world_size, args.rank = 64, 0
    os.environ.setdefault("WORLD_SIZE", "64")
    validate_args(args, {})
    assert args.data_parallel_size == 2 and args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_the_bundles_bash_array_gives_back_every_argument_unglobbed(tmp_path) -> None:
    moe = small_model(moe={"experts": 8, "top_k": 2, "expert_ffn_hidden": 128, "first_dense_layers": 1})
    plan = make_plan("ep=4,pp=2,vpp=2,zero=1,layers=2:6", moe, CLUSTER16)
    emit(plan, moe, CLUSTER16, ["megatron"], tmp_path)
    (tmp_path / "1").write_text("")  # a file the glob [0,1,...] would match if the values were unquoted
    printed = subprocess.run(["bash", "-c", 'source megatron_args.sh && printf "%s\\0" "${MEGATRON_ARGS[@]}"'],
                             cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert printed.split("\0")[:-1] == emit_megatron(plan, moe, CLUSTER16)
    assert "[0,1,1,1,1,1,1,1]" in printed and "Et|t*3|t|t*3L" in printed
