"""Fine-tuning memory against the figures the LoRA and QLoRA papers publish (issue 28).

The figures, their sources (QLoRA: Dettmers et al. 2023; LoRA: Hu et al. 2021) and the models and
methods behind them are in tests/reference/finetune.yaml.  48 GB: the l40s-48gb profile; 24 GB:
the same GPU with 24 GB (an RTX 3090/4090's memory).  Each fit is also shown able to fail: the
same model does not fit without 4-bit weights, or on the smaller GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from autoplace.cost.layers import layer_table
from autoplace.evaluation import Evaluation
from autoplace.specs.model import TransformerSpec, model_from_dict
from benchmarks.finetune import one_gpu
from tests.helpers import REFERENCE, gpu_cluster, score

GB = 1e9
REF = yaml.safe_load((REFERENCE / "finetune.yaml").read_text())
FIG = REF["figures"]
ONE_GPU = "dp=1,mbs=1,recompute=full"  # one sequence at a time, gradient checkpointing


def model(name: str, reference: str | None = None, **training: Any) -> TransformerSpec:
    """A reference model, trained with a reference method (or ``training`` fields)."""
    data = REF["models"][name]
    tuned = {**data["training"], **(REF["methods"][reference] if reference else {}), **training}
    spec = model_from_dict({**data, "training": tuned})
    assert isinstance(spec, TransformerSpec)
    return spec


def model_states(ev: Evaluation) -> float:
    mem = ev.to_dict()["memory_per_device_bytes"]
    return float(mem["params"] + mem["grads"] + mem["optimizer"])


def test_qlora_65b_fits_one_48gb_gpu() -> None:
    spec = model("llama-65b", "qlora-guanaco")
    ev = score(spec, one_gpu(), ONE_GPU)
    assert FIG["qlora_65b_gpu_GB"] == 48 and ev.fits, [v.to_dict() for v in ev.violations]
    # the 4-bit base (less the bf16 adapters beside it) is about 34 GB: what makes it fit
    base = ev.to_dict()["memory_per_device_bytes"]["params"] - 2 * layer_table(spec).trainable
    assert 33 * GB < base < 35 * GB


@pytest.mark.parametrize("training", [{}, {"method": "lora", "lora": {"rank": 64}}])
def test_65b_does_not_fit_one_48gb_gpu_without_4bit(training: dict[str, Any]) -> None:
    # full fine-tuning (16 bytes per parameter) and 16-bit LoRA (2 bytes per frozen weight: 130 GB)
    assert not score(model("llama-65b", **training), one_gpu(), ONE_GPU).fits


def test_qlora_33b_fits_one_24gb_gpu() -> None:
    ev = score(model("llama-33b", "qlora-guanaco"), one_gpu(FIG["qlora_33b_gpu_GB"]), ONE_GPU)
    assert ev.fits, [v.to_dict() for v in ev.violations]
    assert not score(model("llama-65b", "qlora-guanaco"), one_gpu(FIG["qlora_33b_gpu_GB"]), ONE_GPU).fits


def test_lora_gpt3_checkpoint_is_35MB() -> None:
    table = layer_table(model("gpt-3-175b", "lora-gpt3"))
    assert table.trainable == 96 * 2 * 4 * (12288 + 12288)  # r (in + out) on W_q and W_v of every layer
    assert 2 * table.trainable == pytest.approx(FIG["gpt3_lora_checkpoint_bytes"], rel=0.10)  # fp16: 37.7 MB
    assert 2 * table.params == pytest.approx(FIG["gpt3_checkpoint_bytes"], rel=0.01)  # the fp16 base


def test_lora_gpt3_training_memory_is_350GB() -> None:
    # tensor parallelism over 8 GPUs splits every weight matrix; summed over the 8, the model
    # states are the job's (replicated norms and biases, 0.01%, counted 8 times)
    cluster, plan = gpu_cluster(8), "tp=8,mbs=1,recompute=full"
    lora = 8 * model_states(score(model("gpt-3-175b", "lora-gpt3"), cluster, plan))
    assert lora == pytest.approx(FIG["gpt3_lora_training_bytes"], rel=0.10)
    # Hu et al.'s full fine-tuning figure (1.2 TB) is less than mixed-precision Adam's 16 bytes
    # per parameter (2.8 TB: ZeRO's K = 12 accounting, what autoplace predicts); the paper does not
    # give its accounting.  The predicted saving is at least the published one.
    full = 8 * model_states(score(model("gpt-3-175b"), cluster, plan))
    assert full == pytest.approx(16 * 175e9, rel=0.02)
    assert full / lora >= FIG["gpt3_full_training_bytes"] / FIG["gpt3_lora_training_bytes"]
