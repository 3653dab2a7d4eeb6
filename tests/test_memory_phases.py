"""The two moments a step's memory peaks, and the FSDP2 mixed-precision recipe.

FSDPMemTracker (autoplace.fidelity, benchmarks/accuracy.py) shows the peak of an FSDP2 step
with one micro-batch at the start of backward with *no* gradients allocated: sharded gradients
appear at the first reduce-scatter and zero_grad(set_to_none=True) frees them.  Summing every
part as if alive at once over-predicted Llama-3-8B on 8 ranks by 7.5%.
"""

from __future__ import annotations

import pytest

from autoplace.specs.model import model_from_dict
from tests.helpers import gpu_cluster, score

PSI = 12 * 1024 * 1024  # parameters per block
BLOCKS = 4


def _blocks(batch: int, precision: str = "bf16", act_per_token: int = 34 * 1024):
    """Four identical blocks, no embedding or head: every state byte is a block's."""
    return model_from_dict({"name": "blocks", "hidden": 1024, "seq_len": 1024, "graph": [
        {"name": "block", "params": PSI, "flops_per_token": 24 * 1024 * 1024,
         "activation_bytes_per_token": act_per_token, "repeat": BLOCKS}],
        "training": {"global_batch": batch, "precision": precision}})


def test_sharded_grads_are_absent_at_the_start_of_backward_with_one_micro_batch() -> None:
    dp = 8
    ev = score(_blocks(dp), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1")
    assert ev.memory_peak_at == ["bwd start"]
    assert ev.memory["grads"] == 0.0
    assert ev.memory["params"] == pytest.approx(BLOCKS * PSI * 2 / dp)
    assert ev.memory["activations"] == pytest.approx(BLOCKS * 34 * 1024 * 1024)


def test_an_earlier_micro_batch_leaves_its_gradients_alive() -> None:
    dp = 8
    ev = score(_blocks(2 * dp), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1")  # two micro-batches
    assert ev.memory["grads"] == pytest.approx(BLOCKS * PSI * 2 / dp)
    assert ev.memory["activations"] == pytest.approx(BLOCKS * 34 * 1024 * 1024)


@pytest.mark.parametrize("zero", [0, 1])
def test_unsharded_gradients_live_in_persistent_buffers(zero: int) -> None:
    """DDP's buckets and Megatron's grad buffer hold a gradient-sized buffer all the time."""
    dp = 8
    ev = score(_blocks(dp), gpu_cluster(dp), f"dp={dp},zero={zero},mbs=1")
    assert ev.memory["grads"] == pytest.approx(BLOCKS * PSI * 2)


def test_the_end_of_backward_binds_when_gradients_outweigh_the_freed_activations() -> None:
    """With tiny activations the fullest moment is the end of the first backward: every
    gradient allocated, that micro-batch's activations freed."""
    dp = 8
    ev = score(_blocks(dp, act_per_token=8), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1")
    assert ev.memory_peak_at == ["bwd end"]
    assert ev.memory["grads"] == pytest.approx(BLOCKS * PSI * 2 / dp)
    assert ev.memory["activations"] == 0.0


def test_the_peak_is_the_larger_phase_never_the_sum() -> None:
    dp = 8
    one = score(_blocks(dp), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1").memory
    two = score(_blocks(2 * dp), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1").memory
    assert two["total"] - one["total"] == pytest.approx(BLOCKS * PSI * 2 / dp)


def test_fsdp2_recipe_splits_sixteen_bytes_as_four_four_eight() -> None:
    """FSDP2 MixedPrecisionPolicy(bf16, reduce fp32): fp32 shards of weights and gradients, Adam's
    two fp32 moments, no separate master copy (torchtitan's default)."""
    dp = 8
    ev = score(_blocks(2 * dp, "bf16-fsdp2"), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1")
    psi = BLOCKS * PSI / dp
    assert (ev.memory["params"], ev.memory["grads"], ev.memory["optimizer"]) == pytest.approx((4 * psi, 4 * psi, 8 * psi))
    zero_recipe = score(_blocks(2 * dp), gpu_cluster(dp), f"dp={dp},zero=3,mbs=1").memory
    assert sum(ev.memory[k] for k in ("params", "grads", "optimizer")) == pytest.approx(
        sum(zero_recipe[k] for k in ("params", "grads", "optimizer")))


def test_fsdp2_zero2_keeps_the_gathered_bf16_copy_beside_the_fp32_shard() -> None:
    """reshard_after_forward=False: the fp32 shard stays (4Ψ/N) and the bf16 copy gathered in
    forward stays until the step ends (2Ψ)."""
    dp = 8
    ev = score(_blocks(2 * dp, "bf16-fsdp2"), gpu_cluster(dp), f"dp={dp},zero=2,mbs=1")
    assert ev.memory["params"] == pytest.approx(BLOCKS * PSI * (4 / dp + 2))


@pytest.mark.parametrize("dp", [2, 8])
def test_fsdp2_recipe_moves_bf16_gathers_and_fp32_reduce_scatters(dp: int) -> None:
    """Per step and micro-batch: two bf16 all-gathers (forward, backward) and one fp32
    reduce-scatter, ring (N-1)/N each: (2*2 + 4) Ψ (N-1)/N -- exactly fp32 DDP's all-reduce."""
    model = _blocks(dp, "bf16-fsdp2")
    zero3 = score(model, gpu_cluster(dp), f"dp={dp},zero=3,mbs=1").comm["dp"]
    assert zero3 == pytest.approx(BLOCKS * PSI * (2 * 2 + 4) * (dp - 1) / dp, rel=1e-12)
    ddp = score(_blocks(dp, "fp32"), gpu_cluster(dp), f"dp={dp},zero=0,mbs=1").comm["dp"]
    assert zero3 == pytest.approx(ddp, rel=1e-12)
