"""LoRA's trainable parameters against PEFT's own count (issue 28).

Every family in tests/data/hf is built by transformers on the meta device (no weights), wrapped
by PEFT's ``get_peft_model`` with the spec's default rank and targets (the module names
autoplace.specs.lora gives), and ``get_nb_trainable_parameters`` must equal
``layer_table(...).trainable``, which is what the cost model gives gradients and optimizer
states.  Each model is cut to a few layers (the first dense ones and two more) so the test runs
in seconds; adapters are per layer, so the per-layer count is what is checked, and the full
Llama-3-8B count is checked once against ECOSYSTEM's 41,943,040 (r = 16 on q,k,v,o,gate,up,down).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoplace.cost.layers import layer_table
from autoplace.specs.model import TransformerSpec, model_from_dict, with_overrides

pytest.importorskip("peft")
pytest.importorskip("transformers")

from autoplace.fidelity.peft_count import cut, peft_trainable  # noqa: E402

DATA = Path(__file__).parent / "data" / "hf"
FAMILIES = sorted(p.name for p in DATA.glob("*.json"))


def _spec(config: dict[str, Any], name: str, **tuning: Any) -> TransformerSpec:
    model = model_from_dict(config, source=name)
    assert isinstance(model, TransformerSpec)
    tuned = with_overrides(model, {"method": "lora", **tuning}, source=name)
    assert isinstance(tuned, TransformerSpec)
    return tuned


@pytest.mark.parametrize("name", FAMILIES)
def test_trainable_parameters_equal_peft(name: str) -> None:
    config = cut(json.loads((DATA / name).read_text()))
    spec = _spec(config, name)
    assert layer_table(spec).trainable == peft_trainable(config, spec)


@pytest.mark.parametrize(("name", "rank", "targets"), [
    ("gpt2.json", 4, ["q", "v"]),  # fused c_attn: one adapter serves q, k and v
    ("phi-3-mini-4k-instruct.json", 8, ["up", "down"]),  # fused gate_up_proj
    ("qwen3-30b-a3b.json", 8, ["q", "v", "down"]),  # routed experts' down projections only
    ("mistral-7b-v0.1.json", 4, ["q", "v"]),  # Hu et al.'s choice
])
def test_other_ranks_and_targets_equal_peft(name: str, rank: int, targets: list[str]) -> None:
    config = cut(json.loads((DATA / name).read_text()))
    spec = _spec(config, name, lora_rank=rank, lora_targets=targets)
    assert layer_table(spec).trainable == peft_trainable(config, spec)


def test_llama3_8b_whole_model() -> None:
    config = json.loads((DATA / "meta-llama-3-8b.json").read_text())
    spec = _spec(config, "meta-llama-3-8b.json")
    table = layer_table(spec)
    assert table.trainable == 41_943_040  # ECOSYSTEM.md: PEFT 0.21.2 on the meta device
    assert table.params == 8_030_261_248  # the frozen base: PEFT's total minus the adapters
