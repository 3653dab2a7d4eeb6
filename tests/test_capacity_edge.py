"""Memory at the capacity edge and fixed per-kernel costs (issue 25, items 2 and 3).

Published runs without activation checkpointing sit at the largest micro-batch that fit, so a
few percent of over-count calls them infeasible; published out-of-memory configurations must
stay infeasible.  The implementation-specific terms (Megatron-Core's fused SwiGLU and in-place
cross-entropy) and the host's kernel-issue floor are checked against their own formulas.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplace.cost.assumptions import DEFAULT
from autoplace.evaluation import evaluate
from autoplace.frameworks import get as framework
from autoplace.plan import build_plan
from autoplace.specs.model import model_from_dict
from autoplace.validation import load_runs, predict
from tests.helpers import gpt_model, gpu_cluster

REFERENCE = Path(__file__).parent / "reference"
RUNS = load_runs(REFERENCE / "published_runs.yaml")
NO_RECOMPUTE = [r for r in RUNS if r.plan.recompute_mode == "none"]
OOMS = load_runs(REFERENCE / "published_oom.yaml")


def test_the_development_set_has_runs_without_checkpointing_and_published_ooms() -> None:
    assert len(NO_RECOMPUTE) >= 10 and len(OOMS) >= 2
    assert all(r.metric == "oom" for r in OOMS)


@pytest.mark.parametrize("run", NO_RECOMPUTE, ids=lambda r: r.id)
def test_every_run_without_checkpointing_fits_at_its_published_micro_batch(run) -> None:
    ev = predict(run)[1]
    assert ev.fits, f"{run.id}: {ev.memory['total'] / 2**30:.1f} of {ev.memory['capacity'] / 2**30:.1f} GiB"


@pytest.mark.parametrize("run", OOMS, ids=lambda r: r.id)
def test_a_published_out_of_memory_configuration_does_not_fit(run) -> None:
    assert not predict(run)[1].fits


def _llama(seq: int = 1024, vocab: int = 32000, batch: int = 1):
    return model_from_dict({"name": "tiny-llama", "layers": 4, "hidden": 512, "ffn_hidden": 1536, "heads": 8,
                            "kv_heads": 8, "vocab": vocab, "seq_len": seq, "ffn": "swiglu", "norm": "rmsnorm",
                            "flash_attention": True, "training": {"global_batch": batch, "precision": "bf16"}})


def _eval(model, plan: dict, assume=DEFAULT, gpus: int = 1):
    p = build_plan(plan, world=gpus, blocks=model.layers, global_batch=model.training.global_batch)
    return evaluate(model, gpu_cluster(gpus), p, assume)


@pytest.mark.parametrize("compile_", [False, True])
def test_megatrons_fused_swiglu_keeps_one_f_wide_tensor_fewer_than_eager(compile_: bool) -> None:
    model = _llama()
    plan = {"mbs": 1, "compile": compile_}
    eager = _eval(model, plan).memory["activations"]
    fused = _eval(model, plan, DEFAULT.replace(swiglu_kept=3.0)).memory["activations"]
    one_tensor = 4 * 1024 * 1536 * 2  # blocks x tokens x f x bf16
    assert eager - fused == pytest.approx(0.0 if compile_ else one_tensor)


def test_megatron_declares_its_kernels_behaviour() -> None:
    behaviour = framework("megatron").behaviour
    assert behaviour["swiglu_kept"] == 3.0 and behaviour["fused_loss_fuses_mlp"] is False
    assert behaviour["loss_workspace_bytes_per_vocab"] == 2.0


def test_megatrons_fused_loss_leaves_its_swiglu_at_three_tensors() -> None:
    model = _llama()
    megatron = DEFAULT.replace(swiglu_kept=3.0, fused_loss_fuses_mlp=False)
    plain = _eval(model, {"mbs": 1}, megatron).memory["activations"]
    fused = _eval(model, {"mbs": 1, "fused_loss": True}, megatron).memory["activations"]
    # a fused cross-entropy keeps 16-bit logits instead of fp32 ones and leaves the blocks alone
    assert plain - fused == pytest.approx(1024 * 32000 * (4 - 2))
    assert _eval(model, {"mbs": 1, "fused_loss": True}).memory["activations"] < plain  # Liger's fuses the MLP


def test_an_in_place_cross_entropy_needs_only_the_16_bit_gradient() -> None:
    model = _llama()
    torch_ce = _eval(model, {"mbs": 1}).memory["buffers"]
    in_place = _eval(model, {"mbs": 1}, DEFAULT.replace(loss_workspace_bytes_per_vocab=2.0)).memory["buffers"]
    assert torch_ce - in_place == pytest.approx(1024 * 32000 * (8 - 2))


def _compute_s(model, mbs: int, dispatch_us: float) -> float:
    return _eval(model, {"mbs": mbs}, DEFAULT.replace(host_dispatch_us=dispatch_us)).time["compute"]


def test_tiny_blocks_run_no_faster_than_the_host_issues_their_kernels() -> None:
    model = gpt_model(4, 256, 4, seq=64, batch=1, vocab=1024)
    per_block = 3 * DEFAULT.kernels_per_block * 50e-6  # forward's kernels and twice as many in backward
    assert _compute_s(model, 1, 0.0) < 4 * per_block  # the GPU alone would be faster
    assert _compute_s(model, 1, 50.0) >= 4 * per_block
    assert _compute_s(model, 1, 100.0) > _compute_s(model, 1, 50.0)  # grows with the host's cost per kernel


def test_large_blocks_hide_the_hosts_kernel_issue() -> None:
    model = gpt_model(4, 2048, 16, seq=2048, batch=8, vocab=1024)
    assert _compute_s(model, 8, 10.0) == pytest.approx(_compute_s(model, 8, 0.0))


def _fsdp2_llama():
    return model_from_dict({"name": "tiny-llama", "layers": 4, "hidden": 512, "ffn_hidden": 1536, "heads": 8,
                            "kv_heads": 8, "vocab": 32000, "seq_len": 1024, "ffn": "swiglu", "norm": "rmsnorm",
                            "flash_attention": True, "training": {"global_batch": 32, "precision": "bf16-fsdp2"}})


def test_a_pipeline_that_defers_fsdp_sync_keeps_full_fp32_gradients() -> None:
    """torch.distributed.pipelining holds FSDP2's reduce-scatter to the last micro-batch: every
    stage accumulates its gradients unsharded in the reduce dtype (fp32 for bf16-fsdp2)."""
    model = _fsdp2_llama()
    plan = {"pp": 2, "zero": 3, "mbs": 1, "dp_shard": 4}
    per_sync = _eval(model, plan, gpus=8).model_states["grads"]
    deferred = _eval(model, plan, DEFAULT.replace(pipeline_defers_grad_sync=True), gpus=8).model_states["grads"]
    assert deferred == pytest.approx(4 * per_sync)  # unsharded over the 4 shard ranks, same fp32 bytes
    assert framework("torchtitan").behaviour["pipeline_defers_grad_sync"] is True
    flat = {"pp": 1, "zero": 3, "mbs": 1, "dp_shard": 8}  # no pipeline: FSDP2 reduce-scatters every backward
    assert _eval(model, flat, DEFAULT.replace(pipeline_defers_grad_sync=True), gpus=8).model_states["grads"] == \
        pytest.approx(_eval(model, flat, gpus=8).model_states["grads"])


def test_deferred_gradients_stay_on_the_device_when_the_optimizer_is_offloaded() -> None:
    """FSDP2's CPUOffloadPolicy sends only the reduce-scatter output to the host (foreach_reduce); a
    deferred reduce accumulates the unsharded fp32 gradients on the device first
    (FSDPParam.to_accumulated_grad_if_needed; tests/test_dryrun_torchtitan.py counts them)."""
    model, assume = _fsdp2_llama(), DEFAULT.replace(pipeline_defers_grad_sync=True)
    kept = {"pp": 2, "zero": 3, "mbs": 1, "dp_shard": 4}
    offloaded = {**kept, "offload_optimizer": "cpu", "offload_params": "cpu"}
    grads = _eval(model, offloaded, assume, gpus=8).model_states["grads"]
    assert grads > 0 and grads == pytest.approx(_eval(model, kept, assume, gpus=8).model_states["grads"])
    flat = {"pp": 1, "zero": 3, "mbs": 1, "dp_shard": 8, "offload_optimizer": "cpu", "offload_params": "cpu"}
    assert _eval(model, flat, assume, gpus=8).model_states["grads"] == 0  # reduced to the host every backward


def _zero3_compute_s(model, mbs: int, assume) -> float:
    return _eval(model, {"mbs": mbs, "zero": 3}, assume).time["compute"]


def test_zero3_hooks_add_host_work_to_each_block() -> None:
    """A ZeRO-3 unit's hooks (Assumptions.zero3_hook_ops_*, benchmarks/fsdp_hooks.py: ~120 and ~155
    eager-op equivalents per block) make a small block host-bound: 4 tiny blocks take at least
    4 x (20 + 120 + 40 + 155) x 10 us; without hooks they are bound by their kernels alone, and a
    large block's compute hides the hooks."""
    tiny = gpt_model(4, 256, 4, seq=64, batch=1, vocab=1024)
    with_hooks = _zero3_compute_s(tiny, 1, DEFAULT)
    no_hooks = _zero3_compute_s(tiny, 1, DEFAULT.replace(zero3_hook_ops_forward=0.0, zero3_hook_ops_backward=0.0))
    ops = 3 * DEFAULT.kernels_per_block + DEFAULT.zero3_hook_ops_forward + DEFAULT.zero3_hook_ops_backward
    assert with_hooks >= 4 * ops * DEFAULT.host_dispatch_us * 1e-6
    assert no_hooks < with_hooks
    big = gpt_model(2, 8192, 64, seq=4096, batch=8, vocab=1024)
    assert _zero3_compute_s(big, 4, DEFAULT) == pytest.approx(
        _zero3_compute_s(big, 4, DEFAULT.replace(zero3_hook_ops_forward=0.0, zero3_hook_ops_backward=0.0)))


@settings(max_examples=25, deadline=None)
@given(fwd=st.floats(0, 500), bwd=st.floats(0, 500), mbs=st.sampled_from([1, 2, 8]))
def test_more_host_work_never_shortens_a_step(fwd: float, bwd: float, mbs: int) -> None:
    """Adding hook work (any amount) to a ZeRO-3 plan never makes its compute faster."""
    model = gpt_model(2, 512, 8, seq=256, batch=8, vocab=1024)
    base = DEFAULT.replace(zero3_hook_ops_forward=0.0, zero3_hook_ops_backward=0.0)
    assert _zero3_compute_s(model, mbs, DEFAULT.replace(zero3_hook_ops_forward=fwd, zero3_hook_ops_backward=bwd)) \
        >= _zero3_compute_s(model, mbs, base) * (1 - 1e-12)
