"""autoplace against PyTorch's own trackers, CPU-sized (issue 6): FSDP2 on fake tensors, world 8.

Ground truth: ``FSDPMemTracker`` (per-category bytes of one rank) and the bytes of every c10d
collective, counted by a dispatch mode, for a Llama-style model built from the same spec
(autoplace.fidelity.trackers).  Tolerances from the issue: model states and collective bytes
within 1%, activations within 10%.  Where the cost model misses today the test is written
with its tolerance and marked ``xfail(strict=True)``, the measured error and the diagnosis in
the reason; fixing the model turns it into a pass that must have its marker removed.
"""

from __future__ import annotations

from functools import cache

import pytest

pytest.importorskip("torch")

from autoplace.fidelity.trackers import Comparison, Setup, build_model, compare  # noqa: E402
from autoplace.specs.model import TransformerSpec, load_model  # noqa: E402
from tests.helpers import REPO  # noqa: E402

# Llama-3 proportions (ffn 3.5h, 4 query heads per KV head, untied head) at CPU size: every
# dimension divides the 8 ranks, so FSDP2 pads nothing.
MINI = TransformerSpec.model_validate({"name": "mini-llama-3", "layers": 2, "hidden": 512, "ffn_hidden": 1792, "heads": 8,
                                        "kv_heads": 2, "vocab": 4096, "seq_len": 512})

# Korthikanti et al.'s own layer (GPT: GeLU, LayerNorm, biases, learned positions, tied, dropout,
# s x s scores kept), fp16 mixed precision as in Megatron-LM 2021
MINI_GPT = TransformerSpec.model_validate({
    "name": "mini-gpt", "layers": 2, "hidden": 512, "ffn_hidden": 2048, "heads": 8, "vocab": 4096, "seq_len": 512,
    "max_position": 512, "ffn": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True,
    "position": "learned", "dropout": True, "flash_attention": False})

# the layout autoplace's FSDP2 emitter writes and its cost model assumes: blocks resharded after
# forward, the root (embedding, final norm, head) kept gathered until backward
ZERO3 = Setup(world=8)
ZERO2 = Setup(world=8, reshard=False)
HSDP = Setup(world=8, dp_replicate=2)
TP = Setup(world=8, tp=2)
BF16 = Setup(world=8, precision="bf16")


@cache
def compared(setup: Setup, spec: TransformerSpec = MINI) -> Comparison:
    return compare(spec, setup)


def within(c: Comparison, quantity: str, tolerance: float) -> None:
    row = c.row(quantity)
    assert abs(row.error) <= tolerance, (
        f"{c.setup.label()}: {quantity} predicted {row.predicted:.0f} B, measured {row.measured:.0f} B "
        f"({100 * row.error:+.2f}%, tolerance {100 * tolerance:.0f}%)")


@pytest.mark.parametrize("spec", [MINI, MINI_GPT, load_model(REPO / "examples" / "models" / "llama-3-8b.json"),
                                  load_model(REPO / "examples" / "models" / "gpt-3-175b.json")],
                         ids=["mini", "mini-gpt", "llama-3-8b", "gpt-3-175b"])
def test_torch_model_has_autoplace_parameter_count(spec: TransformerSpec) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        build_model(spec)  # raises BenchmarkError when the counts differ


@pytest.mark.parametrize("setup", [ZERO3, HSDP, TP], ids=lambda s: s.label())
@pytest.mark.parametrize("state", ["params", "grads", "optimizer"])
def test_model_states_within_1_percent(setup: Setup, state: str) -> None:
    within(compared(setup), state, 0.01)


def test_bf16_mixed_model_states_total_within_1_percent() -> None:
    within(compared(BF16), "model states", 0.01)


@pytest.mark.xfail(strict=True, reason=(
    "measured -50% params, -50% grads, +50% optimizer: FSDP2's MixedPrecisionPolicy keeps the fp32 "
    "master copy as the sharded parameter (4 B) and reduces into an fp32 sharded gradient (4 B); the bf16 "
    "copy exists only gathered, per unit.  autoplace's bf16 recipe files it as 2 + 2 + 12 (master in the "
    "optimizer).  The total, 16 B, agrees."))
@pytest.mark.parametrize("state", ["params", "grads", "optimizer"])
def test_bf16_mixed_model_state_split_within_1_percent(state: str) -> None:
    within(compared(BF16), state, 0.01)


@pytest.mark.xfail(strict=True, reason=(
    "measured -11.1% (= -1/N): with reshard_after_forward=False FSDP2 keeps the sharded parameters "
    "(psi*pb/N) besides the gathered ones (psi*pb); autoplace's ZeRO-2 counts only the gathered copy"))
def test_zero2_params_within_1_percent() -> None:
    within(compared(ZERO2), "params", 0.01)


@pytest.mark.parametrize("setup", [ZERO3, ZERO2, HSDP, TP], ids=lambda s: s.label())
def test_dp_collective_bytes_within_1_percent(setup: Setup) -> None:
    c = compared(setup)
    for row in c.rows:
        if row.quantity.startswith("dp ") or row.quantity == "comm dp":
            within(c, row.quantity, 0.01)


def test_tp_collective_bytes_within_1_percent() -> None:
    within(compared(TP), "comm tp", 0.01)


@pytest.mark.parametrize("setup", [ZERO3, BF16], ids=lambda s: s.label())
def test_activations_within_10_percent(setup: Setup) -> None:
    within(compared(setup), "activations kept", 0.10)


def test_activations_with_tp_within_10_percent() -> None:
    within(compared(TP), "activations kept", 0.10)


FP16 = Setup(world=8, precision="fp16")


def test_gpt_layer_model_states_total_and_collectives_within_1_percent() -> None:
    c = compared(FP16, MINI_GPT)
    for quantity in ("model states", "dp all_gather", "dp reduce_scatter", "comm dp"):
        within(c, quantity, 0.01)


def test_gpt_layer_activations_within_10_percent() -> None:
    # Korthikanti's sbh(34 + 5as/h) per layer is what this layer keeps (+ LayerNorm's mean and rstd)
    within(compared(FP16, MINI_GPT), "activations kept", 0.10)
