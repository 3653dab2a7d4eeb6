"""``autoplace dryrun`` of accelerate bundles: accelerate's launch, Accelerator and prepare on a fake group of 8.

Eight Hugging Face families (layers shrunk) x what accelerate's config states -- FSDP2 at ZeRO-3 and ZeRO-2,
HSDP, context parallelism, DDP, and LoRA / QLoRA through the bundle's PEFT script -- each built in this process:
every step done or skipped with a reason, and each state's bytes as accelerate's FSDP2 or DDP holds them within
2% of plan.json's (its DDP's second gradient copy for the user's script, one under the PEFT script's
gradient_as_bucket_view; a LoRA base in bf16; QLoRA's quant_state whole on every rank).  Then
accelerate's own refusals of files a user edited, and tensor parallelism said skipped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from autoplace.dryrun.run import TOLERANCE, RankRun, build_in_process
from tests.dryrun_bundles import hf_bundle, state_cases, unpadded, within, write_test_bundle

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

CASES: dict[str, tuple[str, str, str]] = {
    "llama-fsdp2-zero3": ("llama-3.1-8b.json", "zero=3", "full"),
    "qwen2.5-fsdp2-zero2": ("qwen2.5-0.5b.json", "zero=2", "full"),
    "mixtral-cp2": ("mixtral-8x7b-v0.1.json", "dp_shard=4,cp=2,zero=3", "full"),
    "olmo2-cp2": ("olmo-2-1124-7b.json", "dp_shard=4,cp=2,zero=3", "full"),
    "llama-hsdp": ("llama-3.1-8b.json", "dp_replicate=2,dp_shard=4,zero=3", "full"),
    "gemma2-fsdp2-zero3": ("gemma-2-9b.json", "zero=3", "full"),
    "phi3-ddp": ("phi-3-mini-4k-instruct.json", "zero=0,dp_shard=1,dp_replicate=8", "full"),
    "gpt2-fsdp2-zero2": ("gpt2.json", "zero=2", "full"),
    "deepseek-v2-fsdp2-zero3": ("deepseek-v2-lite.json", "zero=3", "full"),
    "gemma3-fsdp2-zero3": ("gemma-3-12b-it.json", "zero=3", "full"),
    "llama-lora-fsdp2": ("llama-3.1-8b.json", "zero=3", "lora"),
    "phi3-lora-ddp": ("phi-3-mini-4k-instruct.json", "zero=0,dp_shard=1,dp_replicate=8", "lora"),
    "qwen2.5-qlora-fsdp2": ("qwen2.5-0.5b.json", "zero=3", "qlora"),
}

# cost-model terms that differ from what accelerate allocates, by case and state: a strict xfail naming the term.
# (Its DDP keeps the reducer's buckets beside .grad for the user's script, one copy under the bundle's PEFT
# script, which asks for gradient_as_bucket_view; the PEFT script's LoRA base is bf16: the behaviour
# autoplace.frameworks.accelerate declares.)
DIFFERS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each case's bundle, built once on demand (rank 0: accelerate's ranks hold alike shards)."""
    root = tmp_path_factory.mktemp("acc")
    cache: dict[str, RankRun] = {}
    bundles: dict[str, Path] = {}

    def build(case: str) -> RankRun:
        if case not in bundles:
            bundles[case] = hf_bundle(root, *CASES[case][:2], "accelerate", CASES[case][2])
            cache[case] = build_in_process(bundles[case], 0)
        return cache[case]

    build.bundles = bundles  # type: ignore[attr-defined]
    build.root = root  # type: ignore[attr-defined]
    return build


@pytest.mark.parametrize("case", CASES)
def test_every_step_is_done_or_skipped_with_a_reason(case: str, builds: Any) -> None:
    run = builds(case)
    assert run.ok, run.failed
    assert all(s["status"] == "done" or (s["status"] == "skipped" and s["why"]) for s in run.steps)
    assert any(s["step"].startswith("accelerator.prepare") and s["status"] == "done" for s in run.steps)
    assert run.stage == 0


@pytest.mark.parametrize(("case", "state"), state_cases(CASES, DIFFERS))
def test_each_state_is_within_2_percent_of_plan_json(case: str, state: str, builds: Any) -> None:
    run = builds(case)
    measured, _how = run.measured[state]
    assert within(measured, run.predicted[state], TOLERANCE), (measured, run.predicted[state])


def test_the_accelerator_is_the_one_the_config_states(builds: Any) -> None:
    """accelerate's own Accelerator, from the launch's environment: FSDP2 over the config's mesh."""
    notes = builds("mixtral-cp2").notes
    assert any("FSDP, 8 processes, FSDP2, reshard_after_forward=True, mixed precision bf16" in n
               and "'cp': 2" in n for n in notes), notes


def test_stacked_experts_spread_over_more_ranks_than_experts(tmp_path: Path) -> None:
    """transformers 5 stacks Mixtral's 8 experts in one tensor per projection; accelerate's FSDP2 over 64 ranks
    cuts dim 0 in chunks of one expert and every rank stores one (FSDPParam.padded_sharded_param_size): 8 times
    the experts' even share, +623% on this rank (2 blocks, shrunk), as plan.json counts (autoplace.cost.shards)."""
    from tests.test_architectures import shrunk

    config = tmp_path / "mixtral.json"
    config.write_text(json.dumps(shrunk("mixtral-8x7b-v0.1.json")))
    bundle = write_test_bundle(tmp_path / "b", config, "8x8xh100-sxm5-80gb", "zero=3", "accelerate")
    run = build_in_process(bundle, 0)
    assert run.ok, run.failed
    for state in ("params", "grads", "optimizer"):
        assert within(run.measured[state][0], run.predicted[state], TOLERANCE), (state, run.measured[state])
    assert run.measured["params"][0] / unpadded(bundle)["params"] - 1 == pytest.approx(6.2346, abs=1e-3)


def test_tensor_parallelism_is_said_skipped(tmp_path: Path) -> None:
    bundle = hf_bundle(tmp_path, "llama-3.1-8b.json", "tp=2,sp=false,dp_shard=4,zero=3", "accelerate")
    run = build_in_process(bundle, 0)
    assert run.ok and not run.measured
    assert [s["step"] for s in run.steps if s["status"] == "skipped"] == [
        "accelerate's tensor parallelism (the model sharded by its tp_plan)"]


def _edited(builds: Any, case: str, to: Path, parallelism: dict[str, int]) -> Path:
    builds(case)
    bundle = Path(shutil.copytree(builds.bundles[case], to, symlinks=True))
    config = yaml.safe_load((bundle / "accelerate_config.yaml").read_text())
    config["parallelism_config"] = {f"parallelism_config_{k}_size": v for k, v in parallelism.items()}
    (bundle / "accelerate_config.yaml").write_text(yaml.safe_dump(config))
    return bundle


def test_context_parallelism_edited_into_sliding_window_attention_fails_in_accelerate(builds: Any,
                                                                                     tmp_path: Path) -> None:
    """Issue 34 defect 3, as a user's edit: accelerate's own context-parallel hooks refuse Gemma 2's layers."""
    bundle = _edited(builds, "gemma2-fsdp2-zero3", tmp_path / "b", {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "cp": 2})
    failed = build_in_process(bundle, 0).failed
    assert failed is not None and failed["step"].startswith("accelerator.prepare(model, optimizer)")
    assert "sliding" in failed["error"].lower() and "cp_size: 1" in failed["fix"]


def test_a_mesh_that_is_not_the_world_fails_in_accelerator(builds: Any, tmp_path: Path) -> None:
    bundle = _edited(builds, "llama-fsdp2-zero3", tmp_path / "b", {"dp_replicate": 1, "dp_shard": 16, "tp": 1, "cp": 1})
    failed = build_in_process(bundle, 0).failed
    assert failed is not None and failed["step"].startswith("accelerate's Accelerator from the launch's environment")
    assert failed["error"] == "RuntimeError: Mesh should not be bigger than default world size 8, but found 16 ranks!"
    assert "equal num_processes" in failed["fix"]
