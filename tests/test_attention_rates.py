"""Fused attention's rates (autoplace.cost.attention) against the FlashAttention-2 paper's A100 and H100
figures (tests/reference/kernels.yaml), and the GEMM's wave quantization (autoplace.cost.compute)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from autoplace.cost.attention import FA_BACKWARD_FLOPS, AttentionRates, rates_of
from autoplace.cost.hardware import kernels_of
from autoplace.errors import SpecError
from autoplace.specs.cluster import AttentionEfficiency, AttentionTable, load_profile
from autoplace.validation import _run, load_runs

REFERENCE = Path(__file__).resolve().parent / "reference"
FIGURE = [r for r in yaml.safe_load((REFERENCE / "kernels.yaml").read_text())["attention"] if r["direction"] == "fwd+bwd"]
SERIES = {"fa2": "flash-attention-2", "fa1": "flash-attention-1", "mem_efficient": "xformers"}


def _combined(rates: AttentionRates, seq: float, head_dim: float, causal: bool, kernel: str) -> float:
    """Forward + backward rate as the paper counts it (3.5 x the executed forward FLOPs over both passes'
    seconds), as a fraction of the peak."""
    fwd, bwd = rates.fractions(np.array(seq), head_dim, causal, kernel)
    return float(3.5 / (1 / fwd + FA_BACKWARD_FLOPS / bwd))


@pytest.mark.parametrize("row", FIGURE, ids=lambda r: f"{r['gpu_profile']}-d{r['setting']['head_dim']}-"
                                                      f"{'causal' if r['setting']['causal'] else 'full'}")
def test_every_panel_of_the_figure_is_reproduced_for_each_kernel(row: dict) -> None:
    """Each panel (head dim 64/128, causal or not) and each series the profile carries, at each published
    length: the forward + backward rate of the paper's Fig. 4 (A100) and its H100 figure, within 1%."""
    gpu = load_profile("gpu", row["gpu_profile"])
    rates, peak = rates_of(gpu.attention_efficiency), gpu.peak_TFLOPS.bf16
    kernels = ("fa2", "fa1", "mem_efficient") if row["gpu_profile"].startswith("a100") else ("fa2", "fa1")
    for kernel in kernels:
        for seq, tflops in row["series"][SERIES[kernel]]:
            got = _combined(rates, seq, row["setting"]["head_dim"], row["setting"]["causal"], kernel) * peak
            assert got == pytest.approx(tflops, rel=0.01), (kernel, seq)


def test_between_measured_points_the_rate_lies_between_them() -> None:
    """Interpolation: head dim 96 between the head-dim-64 and -128 rates, 3k keys between 2k and 4k (A100)."""
    rates = rates_of(load_profile("gpu", "a100-sxm4-80gb").attention_efficiency)
    at = {(d, s): _combined(rates, s, d, True, "fa2") for d in (64, 96, 128) for s in (2048, 3072, 4096)}
    assert at[(64, 2048)] < at[(96, 2048)] < at[(128, 2048)]
    assert at[(128, 2048)] < at[(128, 3072)] < at[(128, 4096)]
    assert at[(96, 2048)] == pytest.approx((at[(64, 2048)] + at[(128, 2048)]) / 2, rel=0.01)


@pytest.mark.parametrize("profile", ["a100-sxm4-80gb", "h100-sxm5-80gb"])
def test_long_sequences_never_run_slower_per_flop_and_hold_past_the_figure(profile: str) -> None:
    """From 4k to 64k keys each pass's rate never falls (the kernel is compute-bound past 16k, the
    figure's last length), and 16k-64k keep 16k's rate."""
    rates = rates_of(load_profile("gpu", profile).attention_efficiency)
    seq = np.array([4096, 6000, 8192, 12000, 16384, 24576, 32768, 65536], dtype=float)
    for causal in (True, False):
        fwd, bwd = rates.fractions(seq, 128.0, causal)
        assert np.all(np.diff(fwd) >= 0) and np.all(np.diff(bwd) >= 0)
        assert fwd[-1] == fwd[4] and bwd[-1] == bwd[4]
        assert np.all(bwd <= fwd)  # backward runs below forward's efficiency (Dao 2023, Sec. 4)


def test_a_causal_kernel_executes_half_the_full_forward_flops() -> None:
    """With the same rates for both masks, causal attention takes half the full one's time, forward and
    backward; backward executes 2.5x forward's FLOPs."""
    full_rows = AttentionTable(head_dim=128, causal=False, forward=[[1024, 0.5]], backward=[[1024, 0.4]])
    same = rates_of(AttentionEfficiency(forward=[[1024, 0.5]], backward=[[1024, 0.4]], tables=[full_rows]))
    full = same.seconds(np.array(1e12), np.array(1024.0), 1e14, 128.0, causal=False)
    causal = same.seconds(np.array(1e12), np.array(1024.0), 1e14, 128.0, causal=True)
    assert float(causal[0]) == pytest.approx(float(full[0]) / 2) and float(causal[1]) == pytest.approx(float(full[1]) / 2)
    assert float(full[0]) == pytest.approx(1e12 / (1e14 * 0.5)) and float(full[1]) == pytest.approx(2.5e12 / (1e14 * 0.4))


def test_flash_attention_1_runs_slower_and_an_unmeasured_kernel_runs_as_fa2() -> None:
    """FlashAttention (2022) at about half FlashAttention-2's rate on A100; a GPU without the kernel's
    rows (V100 has none) prices it as FlashAttention-2."""
    a100 = rates_of(load_profile("gpu", "a100-sxm4-80gb").attention_efficiency)
    assert _combined(a100, 8192, 128, True, "fa1") < 0.5 * _combined(a100, 8192, 128, True, "fa2")
    v100 = rates_of(load_profile("gpu", "v100-sxm2-32gb").attention_efficiency)
    assert _combined(v100, 2048, 128, True, "fa1") == _combined(v100, 2048, 128, True, "fa2")


def test_a_published_run_states_its_kernel_and_a_bad_one_is_refused() -> None:
    row = next(r for r in yaml.safe_load((REFERENCE / "published_runs.yaml").read_text())
               if r["id"] == "flashattn-train-gpt3-1.3b-a100x8")
    assert _run(row).assumptions.attention_kernel == "fa1"
    bad = {**row, "options": {**row["options"], "attention_kernel": "fa9"}}
    with pytest.raises(SpecError, match="attention_kernel 'fa9' is not one of fa2, fa1, mem_efficient"):
        _run(bad)
    assert any(r.assumptions.attention_kernel == "fa1" for r in load_runs(REFERENCE / "published_runs.yaml"))


def test_one_tile_past_a_full_wave_pays_a_whole_wave() -> None:
    """Wave quantization on A100 (108 SMs, 128 x 128 output tiles): 12 x 9 = 108 tiles fill one wave;
    one more row of tiles (13 x 9 = 117) runs a second, nearly empty wave, so almost twice the time
    (NVIDIA, Matrix Multiplication Background User's Guide, Sec. 3.2)."""
    k = kernels_of(load_profile("gpu", "a100-sxm4-80gb"), "bf16")
    assert (k.sm_count, k.tile) == (108, (128, 128))
    full, more = k.wave_utilization(12 * 128, 9 * 128), k.wave_utilization(12 * 128 + 1, 9 * 128)
    assert float(full) == 1.0 and float(more) == pytest.approx(117 / 216)
    t_full, t_more = (float(k.gemm(m, 9 * 128, 8192, 2.0)) for m in (12 * 128, 12 * 128 + 1))
    assert t_more / t_full == pytest.approx((12 * 128 + 1) / (12 * 128) * 216 / 117, rel=1e-9)
    square = dataclasses.replace(k, tile=(256, 128))
    assert float(square.wave_utilization(12 * 256, 9 * 128)) == 1.0  # the guide's 256 x 128 tiles: same count
