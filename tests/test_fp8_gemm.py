"""FP8 GEMM time per shape and per recipe (issue 35 item 1): a large GEMM runs near the fp8 peak
times its efficiency, a skinny one at HBM speed; each recipe's casts cost their bytes over HBM; fp8
never loses to bf16 on large GEMMs and grows with every dimension; the recipes order as their casts
say on a whole plan; mxfp8 needs Blackwell; and the recipe a bundle states is the one each
framework's own parser reads (torchtitan's ConfigManager, Megatron-LM's validate_args restated)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.compute import FP8_CASTS, fp8_cast_bytes
from autoplace.cost.hardware import kernels_of
from autoplace.cost.layers import Gemm
from autoplace.evaluation import evaluate
from autoplace.specs.cluster import fp8_refusal, load_profile
from autoplace.specs.model import load_model
from tests.helpers import gpu_cluster
from tests.test_cli import MODELS
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan
from tests.test_emit_torchtitan import parse as parse_toml
from tests.test_emit_torchtitan import titan  # noqa: F401 - a fixture

H100 = load_profile("gpu", "h100-sxm5-80gb")
FP8 = kernels_of(H100, "fp8")
BF16 = kernels_of(H100, "bf16")
RECIPES = ("tensorwise", "rowwise", "delayed")  # what an H100 runs


def rate(m: float, n: float, k: float) -> float:
    """FLOP/s of one fp8 GEMM (e4m3 operands, a bf16 output)."""
    return 2 * m * n * k / float(FP8.gemm(m, n, k, 1.0, out_bytes=2.0))


def test_a_large_square_gemm_runs_near_the_fp8_peak_times_its_efficiency() -> None:
    reach = rate(16384, 16384, 8192) / (FP8.peak_flops * FP8.gemm_efficiency)
    assert 0.95 <= reach <= 1.0  # only the last wave's idle SMs below it
    assert FP8.peak_flops == pytest.approx(2 * BF16.peak_flops, rel=1e-3)  # H100 datasheet: fp8 twice bf16


def test_a_skinny_gemm_is_bound_by_streaming_its_operands() -> None:
    m, n, k = 16384.0, 64.0, 8192.0  # a narrow projection: ~2n FLOPs per byte, below the fp8 ridge
    streamed = ((m * k + k * n) * 1.0 + m * n * 2.0) / FP8.hbm_Bps
    assert float(FP8.gemm(m, n, k, 1.0, out_bytes=2.0)) == pytest.approx(streamed)
    assert rate(m, n, k) < 0.5 * rate(16384, 16384, 8192)


def test_small_gemms_reach_a_lower_share_of_the_fp8_peak_than_large_ones() -> None:
    assert rate(1024, 1024, 1024) < rate(4096, 4096, 4096) < rate(16384, 16384, 8192)


@pytest.mark.parametrize("library", sorted(FP8_CASTS))
@pytest.mark.parametrize("recipe", ("tensorwise", "rowwise", "delayed", "mxfp8"))
def test_casts_cost_their_bytes_over_hbm(library: str, recipe: str) -> None:
    b_in, b_weight, b_grad, b_rescale = FP8_CASTS[library][recipe]
    tokens, gemm = np.array([[8192.0]]), Gemm(n=14336.0, k=4096.0, split="n")
    forward, backward = fp8_cast_bytes((gemm,), tokens, np.array([[2.0]]), np.array([[1.0]]),
                                       (np.array(b_in), np.array(b_weight), np.array(b_grad), np.array(b_rescale)))
    n = 14336 / 2  # column-parallel at tp=2
    assert float(forward[0, 0]) == b_in * 8192 * 4096 + b_weight * 4096 * n
    assert float(backward[0, 0]) == b_grad * 8192 * n + b_rescale * (8192 * 4096 + 4096 * n)
    assert float(FP8.stream(forward)[0, 0]) == float(forward[0, 0]) / FP8.hbm_Bps
    assert b_in >= 4 and b_grad >= 4  # at least a read in bf16 and two fp8 layouts written


def _fp8_seconds(m: float, n: float, k: float, recipe: str) -> float:
    """Forward and backward seconds of a linear layer under ``recipe``'s GEMMs and casts."""
    b_in, b_weight, b_grad, b_rescale = FP8_CASTS["torchao"][recipe]
    casts = b_in * m * k + b_weight * k * n + b_grad * m * n + b_rescale * (m * k + k * n)
    slower = DEFAULT.fp8_rowwise_gemm_time if recipe == "rowwise" else 1.0
    return float(FP8.gemm(m, n, k, 1.0, out_bytes=2.0)) * (slower + 2) + casts / FP8.hbm_Bps


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(RECIPES), st.integers(2, 8), st.integers(2, 8), st.integers(2, 8))
def test_fp8_never_loses_to_bf16_on_large_gemms(recipe: str, a: int, b: int, c: int) -> None:
    m, n, k = 4096.0 * a, 2048.0 * b, 2048.0 * c
    assert _fp8_seconds(m, n, k, recipe) <= 3 * float(BF16.gemm(m, n, k, 2.0))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(RECIPES), st.sampled_from((256.0, 1024.0, 4096.0, 16384.0)),
       st.sampled_from((64.0, 512.0, 4096.0, 14336.0)), st.sampled_from((128.0, 1024.0, 8192.0)),
       st.sampled_from(("m", "n", "k")))
def test_fp8_time_grows_with_every_dimension(recipe: str, m: float, n: float, k: float, dim: str) -> None:
    bigger = {"m": (2 * m, n, k), "n": (m, 2 * n, k), "k": (m, n, 2 * k)}[dim]
    assert _fp8_seconds(*bigger, recipe) >= _fp8_seconds(m, n, k, recipe)


LLAMA_70B = load_model(MODELS / "llama-3-70b.json")
H100_64 = gpu_cluster(64, "h100-sxm5-80gb", intra="nvlink4", inter="ib-ndr")


def _step(plan_text: str, costing: dict[str, Any] | None = None) -> float:
    plan = make_plan(plan_text, LLAMA_70B, H100_64)
    return evaluate(LLAMA_70B, H100_64, plan, DEFAULT.replace(**(costing or {}))).step_time_s


def test_on_a_whole_plan_the_recipes_order_as_their_casts_and_kernels_say() -> None:
    """Llama-3-70B on 64 H100: every recipe beats bf16; delayed scaling (one cast pass) beats per-tensor
    current scaling (an amax pass first), which beats rowwise (a transposed re-cast, a slower kernel)."""
    base = "tp=8,pp=2,zero=1,recompute=selective"
    bf16 = _step(base)
    te = {"fp8_casts": "transformer_engine"}
    delayed, tensorwise = _step(base + ",fp8=delayed", te), _step(base + ",fp8=tensorwise", te)
    rowwise = _step(base + ",fp8=rowwise")
    assert delayed < tensorwise < bf16 and _step(base + ",fp8=tensorwise") < rowwise < bf16


def test_mxfp8_runs_on_blackwell_only() -> None:
    why = fp8_refusal(gpu_cluster(8, "h100-sxm5-80gb", intra="nvlink4", inter="ib-ndr"), "mxfp8")
    assert why is not None and "mxfp8" in why and "h100-sxm5-80gb" in why and "tensorwise" in why
    assert fp8_refusal(gpu_cluster(8, "b200-sxm-180gb", intra="nvlink5", inter="ib-ndr"), "mxfp8") is None
    assert fp8_refusal(gpu_cluster(8, "h100-sxm5-80gb", intra="nvlink4", inter="ib-ndr"), "delayed") is None


@pytest.mark.parametrize("recipe", ("tensorwise", "rowwise"))
def test_torchtitans_config_manager_reads_the_recipe_and_keeps_the_head_in_bf16(
        recipe: str, titan: Any, tmp_path: Any) -> None:  # noqa: F811 - the fixture
    plan = make_plan(f"zero=3,compile=true,fp8={recipe}", MODEL, CLUSTER16)
    job = parse_toml(titan, plan, tmp_path)
    assert "quantize.linear.float8" in job.model.converters
    assert job.quantize.linear.float8.recipe_name == recipe
    assert "output" in job.quantize.linear.float8.filter_fqns  # the LM head the cost model keeps in bf16


@pytest.mark.parametrize("recipe", ("delayed", "tensorwise", "mxfp8"))
def test_megatron_validate_args_reads_the_recipe_and_keeps_every_layer_in_fp8(recipe: str) -> None:
    from autoplace.frameworks import megatron
    from autoplace.frameworks._megatron_validate import megatron_arguments

    plan = make_plan(f"tp=2,zero=1,fp8={recipe}", MODEL, CLUSTER16)
    args = megatron_arguments(megatron.emit_megatron(plan, MODEL, CLUSTER16), CLUSTER16.gpus,
                              env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, arch=10 if recipe == "mxfp8" else 9)
    assert (args.fp8, args.fp8_recipe) == ("hybrid", recipe)
    assert not args.first_last_layers_bf16  # the cost model's fp8 blocks: all of them


def test_a_model_files_fp8_keeps_the_head_in_bf16_in_torchtitans_job(titan: Any, tmp_path: Any) -> None:  # noqa: F811
    """``precision: fp8`` with no plan recipe: torchtitan's float8 converter (no default filter) is told to
    skip the head, which the cost model runs on bf16 kernels (``hardware.stage_hardware``)."""
    from tests.test_emit_plans import small_model

    fp8_model = small_model("fp8")
    job = parse_toml(titan, make_plan("zero=3", fp8_model, CLUSTER16), tmp_path, model=fp8_model)
    assert "quantize.linear.float8" in job.model.converters and job.quantize.linear.float8.recipe_name is None
    assert "output" in job.quantize.linear.float8.filter_fqns


def test_an_accelerate_config_in_fp8_is_refused_by_name_not_read_as_bf16() -> None:
    """accelerate's ``mixed_precision: fp8`` runs a backend autoplace does not cost for it (its reader took it
    for bf16 and gave fp8=none); the fp8 recipes are torchtitan's and Megatron-LM's."""
    from autoplace.errors import SpecError
    from autoplace.frameworks.accelerate import emit_accelerate
    from autoplace.frameworks.readers import plan_from_accelerate

    cfg = emit_accelerate(make_plan("zero=3", MODEL, CLUSTER16), MODEL, CLUSTER16)
    assert plan_from_accelerate(cfg, MODEL, CLUSTER16).fp8 == "none"
    with pytest.raises(SpecError, match="accelerate's fp8 backends .* not modelled") as err:
        plan_from_accelerate({**cfg, "mixed_precision": "fp8", "fp8_config": {"backend": "AO"}}, MODEL, CLUSTER16)
    assert err.value.field == "mixed_precision"
