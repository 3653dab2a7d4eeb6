"""The cost model of fine-tuning with a frozen base (LoRA, QLoRA; issue 28).

What the frozen base changes, each checked by arithmetic on the layer table or by comparing a
plan with the same plan under full training: frozen weights have no gradients and no optimizer
states and are stored in the compute dtype (or 4-bit NF4 with double-quantized constants, whose
size is checked against bitsandbytes' own quantizer); ZeRO-3 shards them like any parameter,
ZeRO-1/2 keep them whole; data parallelism reduces only the adapters' gradients; backward skips
the frozen weights' gradient GEMMs; QLoRA pays for its dequantization.
"""

from __future__ import annotations

import pytest

from autoplace.cost.finetune import nf4_bytes_per_param
from autoplace.cost.layers import layer_table
from autoplace.evaluation import Evaluation
from autoplace.specs.model import TransformerSpec, with_overrides
from tests.helpers import gpu_cluster, score

# Llama proportions at a size that scores in milliseconds
SMALL = TransformerSpec.model_validate({"name": "small-llama", "layers": 8, "hidden": 2048, "ffn_hidden": 5632,
                                        "heads": 16, "kv_heads": 4, "vocab": 32000, "seq_len": 2048,
                                        "training": {"global_batch": 64}})


def tuned(method: str, **extra: object) -> TransformerSpec:
    spec = with_overrides(SMALL, {"method": method, **extra}, source="test")
    assert isinstance(spec, TransformerSpec)
    return spec


def states(ev: Evaluation) -> tuple[float, float, float]:
    mem = ev.to_dict()["memory_per_device_bytes"]
    return mem["params"], mem["grads"], mem["optimizer"]


def test_double_quantized_nf4_is_the_papers_bits() -> None:
    # Dettmers et al. 2023, Sec. 3 (Double Quantization): constants cost 32/64 = 0.5 bits per
    # parameter with blocksize 64, and 8/64 + 32/(64 * 256) = 0.127 bits once double-quantized
    constants_bits = nf4_bytes_per_param() * 8 - 4
    assert constants_bits == pytest.approx(0.127, abs=5e-4)


def test_nf4_bytes_match_bitsandbytes() -> None:
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(1024, 4096, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    stored = (packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
              + state.state2.absmax.numel() * state.state2.absmax.element_size())
    assert stored / weight.numel() == pytest.approx(nf4_bytes_per_param(), rel=1e-3)


def test_frozen_base_has_no_gradients_or_optimizer_states() -> None:
    table = layer_table(tuned("lora"))
    ev = score(tuned("lora"), gpu_cluster(1), "dp=1,mbs=1,recompute=full")
    params, grads, optimizer = states(ev)
    # one GPU holds everything: the frozen base in bf16, adapters in the recipe's 2 + 2 + 12 bytes
    assert params == pytest.approx(2 * table.params + 2 * table.trainable, rel=1e-9)
    assert grads == pytest.approx(2 * table.trainable, rel=1e-9)
    assert optimizer == pytest.approx(12 * table.trainable, rel=1e-9)


def test_qlora_stores_linear_weights_in_nf4() -> None:
    table = layer_table(tuned("qlora"))
    ev = score(tuned("qlora"), gpu_cluster(1), "dp=1,mbs=1,recompute=full")
    linear = sum(sum(g.n * g.k for g in k.frozen_gemms) for k in table.kinds) / len(table.kinds) * table.blocks
    other = table.params - linear  # embedding, head, norms: bf16
    assert states(ev)[0] == pytest.approx(nf4_bytes_per_param() * linear + 2 * other + 2 * table.trainable, rel=1e-9)


def test_zero3_shards_the_frozen_base_and_zero1_keeps_it_whole() -> None:
    spec, cluster = tuned("lora"), gpu_cluster(8)
    table = layer_table(spec)
    z3 = states(score(spec, cluster, "dp=8,zero=3,mbs=1,recompute=full"))
    z1 = states(score(spec, cluster, "dp=8,zero=1,mbs=1,recompute=full"))
    assert z3[0] == pytest.approx((2 * table.params + 2 * table.trainable) / 8, rel=1e-9)
    assert z1[0] == pytest.approx(2 * table.params + 2 * table.trainable, rel=1e-9)
    assert z1[2] == pytest.approx(12 * table.trainable / 8, rel=1e-9)  # ZeRO-1 shards the adapters' optimizer


def test_data_parallel_reduces_only_adapter_gradients() -> None:
    cluster = gpu_cluster(8)
    plan = "dp=8,zero=0,mbs=1,recompute=full"
    lora, full = score(tuned("lora"), cluster, plan), score(SMALL, cluster, plan)
    table = layer_table(tuned("lora"))
    dp = lora.to_dict()["comm_bytes_per_step_per_device"]["dp"]
    assert dp / full.to_dict()["comm_bytes_per_step_per_device"]["dp"] == pytest.approx(table.trainable / table.params,
                                                                                        rel=1e-3)


def test_frozen_weights_skip_their_gradient_gemms() -> None:
    cluster, plan = gpu_cluster(8), "dp=8,zero=1,mbs=1,recompute=none"
    full, lora, qlora = (score(s, cluster, plan) for s in (SMALL, tuned("lora"), tuned("qlora")))
    # backward of a frozen matmul is one GEMM (input gradient), not two: the step is shorter by
    # up to a third (attention, memory-bound kernels and the adapters' GEMMs stay)
    assert 0.6 < lora.step_time_s / full.step_time_s < 0.9
    # model FLOPs (MFU's numerator): full training's, less one pass of every frozen matmul (the
    # blocks' and the head's), plus forward and backward of the adapters' matmuls
    table, base = layer_table(tuned("lora")), layer_table(SMALL)
    per_token = [(k.frozen_flops, k.flops - b.flops) for k, b in zip(table.kinds, base.kinds, strict=True)]
    frozen, adapters = (table.blocks * sum(x[i] for x in per_token) for i in (0, 1))
    base_flops = table.blocks * 3 * sum(b.flops for b in base.kinds) + 3 * base.head.flops
    expected = (base_flops - frozen - table.head.flops + 3 * adapters) / base_flops
    measured = lora.tflops_per_gpu * lora.step_time_s / (full.tflops_per_gpu * full.step_time_s)
    assert measured == pytest.approx(expected, rel=1e-9)
    assert 0.6 < expected < 0.75
    # QLoRA dequantizes every weight before each use (forward and backward): slower than LoRA
    assert qlora.step_time_s > lora.step_time_s


def test_paged_optimizer_leaves_the_device() -> None:
    plan = "dp=1,mbs=1,recompute=full"
    paged = states(score(tuned("qlora", paged_optimizer=True), gpu_cluster(1), plan))
    assert paged[2] == 0.0 and paged[1] > 0


def test_graph_models_refuse_lora() -> None:
    from autoplace.errors import SpecError
    from autoplace.specs.model import model_from_dict

    with pytest.raises(SpecError, match="layer graph"):
        model_from_dict({"hidden": 64, "seq_len": 32, "graph": [{"name": "x", "params": 10, "flops_per_token": 20,
                                                                 "activation_bytes_per_token": 4}],
                         "training": {"method": "lora"}})


@pytest.mark.parametrize(("method", "moe", "gpus", "objective"), [
    ("lora", False, 8, "time"), ("qlora", False, 4, "memory"), ("lora", True, 8, "time"), ("qlora", True, 4, "comm")])
def test_cpsat_optimum_equals_exhaustive_for_fine_tuning(method: str, moe: bool, gpus: int, objective: str) -> None:
    """The search is the same one with the frozen and trainable states' sizes: CP-SAT's optimum is
    the oracle's, and every plan it returns is the evaluator's (docs/ARCHITECTURE.md)."""
    from solvers.problem import FEATURES, Budget, Problem, objective_key
    from solvers.registry import get_solver

    data: dict[str, object] = {"name": "small", "layers": 6, "hidden": 512, "ffn_hidden": 2048, "heads": 8,
                               "kv_heads": 4, "vocab": 4096, "seq_len": 1024,
                               "training": {"global_batch": 16, "method": method}}
    if moe:  # DeepSeek-style: the routed experts carry adapters (PEFT's conversion for this family)
        data |= {"family": "deepseek_v3", "moe": {"experts": 4, "top_k": 2, "expert_ffn_hidden": 512,
                                                  "first_dense_layers": 1, "shared_experts": 1}}
    spec = TransformerSpec.model_validate(data)
    problem = Problem(spec, gpu_cluster(gpus, gpu="a100-sxm4-40gb"), objective=objective, top_k=1,
                      features=frozenset(FEATURES) - {"tp-across-nodes"})
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=300))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=300))
    assert a.status == b.status == "optimal"
    assert a.disagreement is None or a.disagreement <= 1e-5
    assert objective_key(a.plans[0], objective)[0] == pytest.approx(objective_key(b.plans[0], objective)[0], rel=1e-6)


def test_an_unknown_family_is_refused() -> None:
    # the family names the modules LoRA adapts: a typo would silently fall back to Llama's names
    from autoplace.errors import SpecError
    from autoplace.specs.model import model_from_dict

    with pytest.raises(SpecError, match="family: unknown Hugging Face model_type"):
        model_from_dict({**SMALL.model_dump(exclude_none=True), "family": "lama"})
