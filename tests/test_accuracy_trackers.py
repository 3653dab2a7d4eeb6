"""autoplace against PyTorch's own trackers, CPU-sized (issue 6): FSDP2 (+HSDP, TP, EP) on fake tensors, world 8.

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

from autoplace.fidelity.compare import Comparison, compare  # noqa: E402
from autoplace.fidelity.trackers import Setup  # noqa: E402
from autoplace.runtime.model import build_model  # noqa: E402
from autoplace.specs.model import TransformerSpec, load_model  # noqa: E402
from tests.helpers import REPO  # noqa: E402

# Llama-3 proportions (ffn 3.5h, 4 query heads per KV head, untied head) at CPU size: every
# dimension divides the 8 ranks, so FSDP2 pads nothing.
MINI = TransformerSpec.model_validate({"name": "mini-llama-3", "layers": 2, "hidden": 512, "ffn_hidden": 1792, "heads": 8,
                                        "kv_heads": 2, "vocab": 4096, "seq_len": 512})

# Korthikanti et al.'s own layer (GPT: GeLU, LayerNorm, biases, learned positions, tied, dropout,
# s x s scores kept)
MINI_GPT = TransformerSpec.model_validate({
    "name": "mini-gpt", "layers": 2, "hidden": 512, "ffn_hidden": 2048, "heads": 8, "vocab": 4096, "seq_len": 512,
    "max_position": 512, "ffn": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True,
    "position": "learned", "dropout": True, "flash_attention": False})

# Mixtral proportions (8 experts of width 3.5h, top-2, vocab 8h) at CPU size; the 512 tokens
# split evenly over the experts (autoplace.runtime.moe routes them so on fake tensors)
MINI_MOE = TransformerSpec.model_validate({
    "name": "mini-mixtral", "layers": 4, "hidden": 512, "ffn_hidden": 1792, "heads": 8, "kv_heads": 2, "vocab": 4096,
    "seq_len": 512, "moe": {"experts": 8, "top_k": 2, "expert_ffn_hidden": 1792}})

# the layout autoplace's FSDP2 emitter writes and its cost model assumes: blocks resharded after
# forward, the root (embedding, final norm, head) kept gathered until backward
ZERO3 = Setup(world=8)
ZERO2 = Setup(world=8, reshard=False)
HSDP = Setup(world=8, dp_replicate=2)
TP = Setup(world=8, tp=2)
BF16 = Setup(world=8, precision="bf16-fsdp2")


@cache
def compared(setup: Setup, spec: TransformerSpec = MINI) -> Comparison:
    return compare(spec, setup)


def within(c: Comparison, quantity: str, tolerance: float) -> None:
    row = c.row(quantity)
    assert abs(row.error) <= tolerance, (
        f"{c.setup.label()}: {quantity} predicted {row.predicted:.0f} B, measured {row.measured:.0f} B "
        f"({100 * row.error:+.2f}%, tolerance {100 * tolerance:.0f}%)")


@pytest.mark.parametrize("spec", [MINI, MINI_GPT, load_model(REPO / "examples" / "models" / "llama-3-8b.json"),
                                  load_model(REPO / "examples" / "models" / "gpt-3-175b.json"), MINI_MOE,
                                  load_model(REPO / "examples" / "models" / "hf" / "mixtral-8x7b" / "config.json")],
                         ids=["mini", "mini-gpt", "llama-3-8b", "gpt-3-175b", "mini-moe", "mixtral-8x7b"])
def test_torch_model_has_autoplace_parameter_count(spec: TransformerSpec) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        build_model(spec)  # raises BenchmarkError when the counts differ


@pytest.mark.parametrize("setup", [ZERO3, HSDP, TP], ids=lambda s: s.label())
@pytest.mark.parametrize("state", ["params", "grads", "optimizer"])
def test_model_states_within_1_percent(setup: Setup, state: str) -> None:
    within(compared(setup), state, 0.01)


@pytest.mark.parametrize("state", ["params", "grads", "optimizer", "model states"])
def test_bf16_fsdp2_model_states_within_1_percent(state: str) -> None:
    """FSDP2's MixedPrecisionPolicy keeps fp32 shards of weights and gradients (4 + 4 + 8 B):
    autoplace's bf16-fsdp2 recipe."""
    within(compared(BF16), state, 0.01)


@pytest.mark.parametrize("setup", [ZERO2, Setup(world=8, reshard=False, precision="bf16-fsdp2")], ids=lambda s: s.label())
def test_zero2_params_within_1_percent(setup: Setup) -> None:
    """reshard_after_forward=False keeps the sharded weights (4 B / N) beside the gathered copy."""
    within(compared(setup), "params", 0.01)


# Llama-3-8B's widths, sequence and vocabulary with 4 of its 32 layers: the terms that decide the
# peak (activations, the loss's fp32 workspace, the gathered root) at their real sizes.  Fake
# tensors cost nothing per byte, so this runs in about a second.
WIDE = TransformerSpec.model_validate({**load_model(REPO / "examples" / "models" / "llama-3-8b.json").model_dump(
    exclude_none=True), "layers": 4})


@pytest.mark.parametrize("setup", [Setup(world=8, precision="bf16-fsdp2"), Setup(world=8, precision="bf16-fsdp2", reshard=False),
                                   ZERO3, Setup(world=8, dp_replicate=2, precision="bf16-fsdp2"),
                                   Setup(world=8, tp=2, precision="bf16-fsdp2")], ids=lambda s: s.label())
def test_total_peak_within_2_percent(setup: Setup) -> None:
    """The step's peak: the larger of the start of backward and the end of the first backward."""
    within(compared(setup, WIDE), "peak", 0.02)


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


MIXED = Setup(world=8, precision="bf16-fsdp2")
# GPT-3's layout at CPU size: TP with the tied embedding shared by the vocab-parallel table and head
MIXED_TP = Setup(world=8, precision="bf16-fsdp2", tp=2)


@pytest.mark.parametrize("setup", [MIXED, MIXED_TP], ids=lambda s: s.label())
def test_gpt_layer_model_states_total_and_collectives_within_1_percent(setup: Setup) -> None:
    c = compared(setup, MINI_GPT)
    for quantity in ("model states", "dp all_gather", "dp reduce_scatter", "comm dp",
                     *(("comm tp",) if setup.tp > 1 else ())):
        within(c, quantity, 0.01)


@pytest.mark.parametrize("setup", [MIXED, MIXED_TP], ids=lambda s: s.label())
def test_gpt_layer_activations_within_10_percent(setup: Setup) -> None:
    # Korthikanti's sbh(34 + 5as/h) per layer is what this layer keeps (+ LayerNorm's mean and rstd)
    within(compared(setup, MINI_GPT), "activations kept", 0.10)


@pytest.mark.parametrize("state", ["params", "grads", "optimizer"])
def test_moe_model_states_within_1_percent(state: str) -> None:
    within(compared(ZERO3, MINI_MOE), state, 0.01)


def test_moe_dp_collective_bytes_within_1_percent() -> None:
    c = compared(ZERO3, MINI_MOE)
    for quantity in ("dp all_gather", "dp reduce_scatter", "comm dp"):
        within(c, quantity, 0.01)


def test_moe_activations_within_10_percent() -> None:
    within(compared(BF16, MINI_MOE), "activations kept", 0.10)


# Expert parallelism carved from the 8 FSDP ranks: 4 experts per rank, FSDP2 over the 4-rank
# expert-data-parallel group, tokens dispatched and combined by all-to-all over the EP pair
EP2 = Setup(world=8, precision="bf16-fsdp2", ep=2)


@pytest.mark.parametrize("state", ["params", "grads", "optimizer", "model states"])
def test_ep_model_states_within_1_percent(state: str) -> None:
    """Experts are sharded by ep, then by the expert ZeRO group (dp/ep): 1/dp of them per rank."""
    within(compared(EP2, MINI_MOE), state, 0.01)


@pytest.mark.parametrize("setup", [EP2, Setup(world=8, precision="bf16-fsdp2", ep=2, reshard=False)],
                         ids=lambda s: s.label())
def test_ep_collective_bytes_within_1_percent(setup: Setup) -> None:
    """Dense weights over dp, experts over edp, and four all-to-alls per MoE block over ep."""
    c = compared(setup, MINI_MOE)
    quantities = [r.quantity for r in c.rows if r.quantity.split()[0] in ("dp", "edp", "comm")]
    assert {"edp all_gather", "edp reduce_scatter", "comm ep"} <= set(quantities)
    for quantity in quantities:
        within(c, quantity, 0.01)


def test_ep_activations_within_10_percent() -> None:
    within(compared(EP2, MINI_MOE), "activations kept", 0.10)


# Mixtral 8x7B's widths, sequence and vocabulary with 4 of its 32 layers (as WIDE for Llama)
WIDE_MOE = TransformerSpec.model_validate({**load_model(REPO / "examples" / "models" / "hf" / "mixtral-8x7b" /
                                                        "config.json").model_dump(exclude_none=True), "layers": 4})


def test_ep_total_peak_within_2_percent_when_the_loss_sets_it() -> None:
    """ep = dp = 8: one expert per rank, no expert sharding; the loss's fp32 workspace at the
    start of backward is larger than the FSDP buffers and sets the peak."""
    within(compared(Setup(world=8, precision="bf16-fsdp2", ep=8), WIDE_MOE), "peak", 0.02)


@pytest.mark.xfail(strict=True, reason=(
    "autoplace over-predicts the peak by +3.7% (22.98 vs 22.16 GiB; +16.3% before the experts became "
    "their own FSDP unit in the model): it places the FSDP working buffers (experts' fp32 reduce-scatter "
    "+ the dense unit gathered twice, 3.27 GiB with the root) beside every activation, as at the start of "
    "backward, but they fill up during a block's backward, after part of the activations is freed (the "
    "tracker's peak here is the loss workspace, 1.95 GiB, at the start of backward).  When they meet "
    "depends on the block's position in the stage, which a per-stage linear term cannot see; with all 32 "
    "layers activations dominate and Mixtral's peak is within +1% (ep = 1, world 8)"))
def test_ep_total_peak_within_2_percent_when_experts_are_sharded() -> None:
    within(compared(EP2, WIDE_MOE), "peak", 0.02)


def test_expert_parallel_dispatch_gives_what_local_experts_give() -> None:
    """Simulated EP ranks (real tensors, balanced routing): dispatch, regroup by local expert,
    local experts and combine return each routed copy's output in the order the single-rank
    layer computes it (the steps of ``MoE._exchange``, with the all-to-alls done by hand)."""
    import torch

    from autoplace.runtime.moe import MoE, expert_major

    torch.manual_seed(0)
    hidden, experts, top_k, ep, tokens = 16, 8, 2, 4, 32
    mlps: list[torch.nn.Module] = [torch.nn.Linear(hidden, hidden) for _ in range(experts)]
    full, local = MoE(hidden, mlps, top_k, routing="balanced"), experts // ep
    xs = [torch.randn(tokens, hidden) for _ in range(ep)]
    routes = [full._route(torch.softmax(full.router(x), -1)) for x in xs]
    counts = routes[0][2]
    mine = [counts[r * local:(r + 1) * local] for r in range(ep)]
    rows = [x[order // top_k] for x, (_, order, _) in zip(xs, routes, strict=True)]
    sent = [r.split([sum(c) for c in mine]) for r in rows]  # rank s's rows for rank r: sent[s][r]
    returned = []
    for r in range(ep):
        recv = [mine[r]] * ep
        regroup = expert_major(recv)
        received = torch.cat([sent[s][r] for s in range(ep)])[regroup]
        parts = received.split([sum(c[e] for c in recv) for e in range(local)])
        done = torch.cat([mlps[r * local + e](part) for e, part in enumerate(parts)])
        returned.append(torch.empty_like(done).index_copy(0, regroup, done).split([sum(c) for c in recv]))
    for s in range(ep):
        combined = torch.cat([returned[r][s] for r in range(ep)])
        torch.testing.assert_close(combined, full.experts(rows[s], counts))


def test_balanced_routing_is_exact_and_inverted_by_expert_slots() -> None:
    from autoplace.runtime.moe import balanced_choice, expert_slots

    tokens, experts, top_k = 64, 8, 2
    choice = balanced_choice(tokens, experts, top_k)
    assert all(len(set(row.tolist())) == top_k for row in choice)  # distinct experts per token
    for e in range(experts):
        token, slot = expert_slots(tokens, experts, top_k, e)
        assert len(token) == tokens * top_k // experts
        assert (choice[token, slot] == e).all()
