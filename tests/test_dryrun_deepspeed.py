"""``autoplace dryrun`` of DeepSpeed bundles: DeepSpeed's own setup of the user's script on a fake group of 8.

Ten Hugging Face families (layers shrunk) x the shapes DeepSpeed runs -- ZeRO-0/1/2/3, ZeRO-Offload of the
optimizer, its pipeline engine (first and last stage), LoRA and QLoRA through the bundle's PEFT script, fp32
training -- each built in this process (:func:`autoplace.dryrun.run.build_in_process`): every step done or
skipped with a reason, the rank on the stage plan.json planned, and each state's bytes as DeepSpeed allocated
them within 2% of plan.json's (a ZeRO-2 gradient partition on the rank that holds the most, which plan.json
predicts); its up-front reduce buckets and its host bytes under ZeRO-Offload too.  Then the framework's
refusals of files a user edited, a bf16 pipeline edited to stage 0 (BF16_Optimizer: ZeRO-1's bytes), the
launch that hands the PEFT script no config (issue 34 defect 4), builds that leave nothing behind, and the
CLI's worker processes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autoplace.dryrun.bundle import edits, read_bundle
from autoplace.dryrun.run import TOLERANCE, RankRun, build_in_process
from autoplace.frameworks._deepspeed_bytes import FULLEST
from tests.dryrun_bundles import CLUSTER, hf_bundle, state_cases, within, write_test_bundle
from tests.helpers import REPO

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

# case -> (family, plan, method); the ranks built: 0, and the last stage's first rank for a pipeline
CASES: dict[str, tuple[str, str, str]] = {
    "llama-zero3": ("llama-3.1-8b.json", "zero=3", "full"),
    "llama-pp2-zero1": ("llama-3.1-8b.json", "pp=2,zero=1", "full"),
    "qwen2.5-zero1": ("qwen2.5-0.5b.json", "zero=1", "full"),
    "qwen2.5-pp2-zero1": ("qwen2.5-0.5b.json", "pp=2,zero=1", "full"),
    "gemma2-zero2": ("gemma-2-9b.json", "zero=2", "full"),
    "mixtral-zero3-offload": ("mixtral-8x7b-v0.1.json", "zero=3,offload_optimizer=cpu", "full"),
    "phi3-zero0": ("phi-3-mini-4k-instruct.json", "zero=0", "full"),
    "olmo2-zero2-offload": ("olmo-2-1124-7b.json", "zero=2,offload_optimizer=cpu", "full"),
    "falcon-zero3": ("falcon-7b-refinedwebmodel.json", "zero=3", "full"),
    "qwen3moe-zero1": ("qwen3-30b-a3b.json", "zero=1", "full"),
    "deepseek-v2-zero3": ("deepseek-v2-lite.json", "zero=3", "full"),
    "gpt2-pp2-zero1": ("gpt2.json", "pp=2,zero=1", "full"),
    "llama-pp2-zero1-offload": ("llama-3.1-8b.json", "pp=2,zero=1,offload_optimizer=cpu", "full"),
    "llama-lora-zero3": ("llama-3.1-8b.json", "zero=3", "lora"),
    "qwen2.5-qlora-zero2": ("qwen2.5-0.5b.json", "zero=2", "qlora"),
    "llama-qlora-zero3": ("llama-3.1-8b.json", "zero=3", "qlora"),
    "mistral-zero3-ga1": ("mistral-7b-v0.1.json", "zero=3", "full"),
}
BATCH = {"mistral-zero3-ga1": 8}  # one micro-batch per rank: no accumulation (the others: 64, 8 per rank)
RANK = {"llama-lora-zero3": 256}  # adapters large enough that their dtype shows in the parameters' bytes
PIPELINES = {"llama-pp2-zero1", "qwen2.5-pp2-zero1", "gpt2-pp2-zero1", "llama-pp2-zero1-offload"}
WRAPPED = {"phi3-zero0"}  # FP16_UnfusedOptimizer: no reduce buckets
ZERO2 = {"gemma2-zero2", "qwen2.5-qlora-zero2"}  # uneven gradient partitions: compared on the fullest rank

# cost-model terms that differ from what DeepSpeed allocates, by case and state: a strict xfail naming the term
DIFFERS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each case's bundle, built once per rank on demand."""
    root = tmp_path_factory.mktemp("ds")
    cache: dict[tuple[str, int], RankRun] = {}
    bundles: dict[str, Path] = {}

    def build(case: str, rank: int = 0) -> RankRun:
        if case not in bundles:
            family, plan, method = CASES[case]
            bundles[case] = hf_bundle(root, family, plan, "deepspeed", method, BATCH.get(case, 64), RANK.get(case))
        if (case, rank) not in cache:
            cache[case, rank] = build_in_process(bundles[case], rank)
        return cache[case, rank]

    build.bundles = bundles  # type: ignore[attr-defined]
    return build


def _ranks(case: str) -> list[int]:
    return [0, 4] if case in PIPELINES else [0]


def fullest(run: RankRun) -> int:
    """The global rank a ZeRO-2 run's note names as holding the largest gradient partition."""
    note = next(n for n in run.notes if n.startswith(FULLEST))
    return int(re.search(r"\(global rank (\d+)\)", note).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize("case", CASES)
def test_every_step_is_done_or_skipped_and_the_rank_is_on_its_planned_stage(case: str, builds: Any) -> None:
    for rank in _ranks(case):
        run = builds(case, rank)
        assert run.ok, run.failed
        assert all(s["status"] == "done" or (s["status"] == "skipped" and s["why"]) for s in run.steps)
        assert run.stage == rank // 4 if case in PIPELINES else run.stage == 0
        assert any("deepspeed.initialize" in s["step"] for s in run.steps)


@pytest.mark.parametrize(("case", "state"), state_cases(CASES, DIFFERS))
def test_each_state_is_within_2_percent_of_plan_json(case: str, state: str, builds: Any) -> None:
    ranks = [fullest(builds(case))] if case in ZERO2 and state == "grads" else _ranks(case)
    for rank in ranks:
        run = builds(case, rank)
        measured, _how = run.measured[state]
        assert within(measured, run.predicted[state], TOLERANCE), (rank, measured, run.predicted[state])


@pytest.mark.parametrize("case", sorted(ZERO2))
def test_zero2_names_the_rank_whose_gradient_partition_holds_most(case: str, builds: Any) -> None:
    """DeepSpeed copies the whole gradient of every parameter overlapping a rank's flat partition
    (copy_grads_in_partition): rank 0 says which rank holds the most and what it holds itself -- each as that
    rank's own build measures it -- and that rank holds more than rank 0 and more than an even share."""
    first = builds(case)
    rank = fullest(first)
    note = next(n for n in first.notes if n.startswith(FULLEST))
    most, own = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) bytes; this rank ([\d,]+)", note)[0])
    assert own == first.measured["grads"][0] and most == builds(case, rank).measured["grads"][0]
    even = first.predicted["optimizer"] / 6  # 2 bytes of gradient per parameter of the share, 12 of optimizer
    assert rank != 0 and most > own and most > 1.3 * even


@pytest.mark.parametrize("case", ["llama-pp2-zero1", "gpt2-pp2-zero1", "llama-pp2-zero1-offload"])
def test_up_front_buffers_are_plan_jsons_buffers(case: str, builds: Any) -> None:
    """Where plan.json's buffers hold nothing the step allocates later -- a pipeline's first stage at ZeRO-1:
    no gathers, no loss -- they are DeepSpeed's reduce buckets: reduce_bucket_size elements, one (its
    pipeline engine turns overlap_comm off), and with the optimizer offloaded the largest parameter's staging
    buffer (the embedding, there).  Elsewhere they hold the buckets and more."""
    run = builds(case)
    assert within(run.measured["buffers"][0], run.predicted["buffers"], TOLERANCE)
    for other in (c for c in CASES if c not in WRAPPED):
        assert builds(other).measured["buffers"][0] <= builds(other).predicted["buffers"], other


@pytest.mark.parametrize("case", ["olmo2-zero2-offload", "mixtral-zero3-offload", "llama-pp2-zero1-offload"])
def test_offloaded_states_are_on_the_host_as_plan_json_predicts(case: str, builds: Any) -> None:
    """ZeRO-Offload: nothing of the optimizer on the device, its host bytes against host_memory_per_gpu_bytes:
    the fp32 master, Adam, the fp32 gradients and a pinned 16-bit partition (ZeRO-3 its gradient partition
    buffer, ZeRO-1/2 the weights, with the largest parameter's gradient staging buffer)."""
    run = builds(case)
    assert run.measured["optimizer"] == (0, "on the host") and run.predicted["optimizer"] == 0
    note = next(n for n in run.notes if n.startswith("on the host"))
    host, predicted = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) bytes.*plan\.json: ([\d,]+)", note)[0])
    assert within(host, predicted, TOLERANCE), note


def test_the_peft_script_trains_what_autoplace_counts(builds: Any) -> None:
    """The bundle's own peft_train.py builds the adapters; PEFT's trainable count is autoplace's."""
    run = builds("llama-lora-zero3")
    assert any(s["step"].startswith("PEFT's trainable parameters") and s["status"] == "done" for s in run.steps)
    assert any(re.match(r"PEFT: [\d,]+ trainable of [\d,]+ parameters \(autoplace: [\d,]+\)", n) for n in run.notes)


def _copy(bundle: Path, to: Path) -> Path:
    shutil.copytree(bundle, to, symlinks=True)
    return to


def test_a_batch_that_does_not_split_fails_with_deepspeeds_own_message(builds: Any, tmp_path: Path) -> None:
    builds("llama-zero3")
    bundle = _copy(builds.bundles["llama-zero3"], tmp_path / "b")
    config = json.loads((bundle / "ds_config.json").read_text())
    config["train_batch_size"] += 8  # a user's edit: no longer micro-batch x accumulation x 8 ranks
    (bundle / "ds_config.json").write_text(json.dumps(config))
    failed = build_in_process(bundle, 0).failed
    assert failed is not None and failed["step"].startswith("DeepSpeedConfig at 8 ranks")
    assert "train_batch_size" in failed["error"] and "train_micro_batch_size_per_gpu" in failed["fix"]


def test_pipeline_stages_that_do_not_divide_the_world_fail_in_pipelinemodule(builds: Any, tmp_path: Path) -> None:
    builds("llama-pp2-zero1")
    bundle = _copy(builds.bundles["llama-pp2-zero1"], tmp_path / "b")
    config = json.loads((bundle / "ds_config.json").read_text())
    config["pipeline"]["stages"] = 3
    (bundle / "ds_config.json").write_text(json.dumps(config))
    failed = build_in_process(bundle, 0).failed
    assert failed is not None and failed["step"].startswith("DeepSpeed's PipelineModule: 3 stages")
    assert failed["error"] == "RuntimeError: num_stages (3) must divide distributed world size (8)"
    assert failed["fix"] and "pipeline.stages" in failed["fix"]


def test_a_peft_launch_without_the_deepspeed_config_fails_naming_it(builds: Any, tmp_path: Path) -> None:
    """Issue 34 defect 4: launch_deepspeed.sh ran peft_train.py without ds_config.json."""
    builds("llama-lora-zero3")
    bundle = _copy(builds.bundles["llama-lora-zero3"], tmp_path / "b")
    launch = bundle / "launch_deepspeed.sh"
    launch.write_text(launch.read_text().replace(' --deepspeed_config "$AUTOPLACE_BUNDLE"/ds_config.json', ""))
    failed = build_in_process(bundle, 0).failed
    assert failed is not None and failed["step"].startswith("every launch kind hands peft_train.py ds_config.json")
    assert failed["error"].startswith("ValueError: launch_deepspeed.sh: peft_train.py: error: one of the arguments "
                                      "--deepspeed_config --accelerate_config is required")
    assert "--deepspeed_config ds_config.json" in failed["fix"]


def test_bundles_built_one_after_another_give_what_each_gives_alone(builds: Any) -> None:
    """DeepSpeed's globals, the environment and accelerate's state are left as they were: the first case
    again, after every other, builds the same bytes."""
    first = builds("llama-zero3")
    for case in ("qwen2.5-qlora-zero2", "gpt2-pp2-zero1"):
        builds(case)
    again = build_in_process(builds.bundles["llama-zero3"], 0)
    assert again.ok and again.measured == first.measured and again.notes == first.notes


@pytest.mark.slow
def test_the_cli_builds_both_pipeline_ranks_in_worker_processes(builds: Any) -> None:
    builds("gpt2-pp2-zero1")
    bundle = builds.bundles["gpt2-pp2-zero1"]
    done = subprocess.run([sys.executable, "-m", "autoplace.cli", "dryrun", str(bundle), "--json"],
                          capture_output=True, text=True, timeout=600)
    doc = json.loads(done.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [0, 4] and [r["stage"] for r in doc["ranks"]] == [0, 1]
    assert all(r["ok"] and r["states"]["params"]["within_tolerance"] for r in doc["ranks"]), doc["ranks"]


def test_a_llama_style_shorthand_is_built_as_its_llamaconfig(tmp_path: Path) -> None:
    model = json.loads((REPO / "examples/models/tiny-llama.json").read_text())
    model["training"].update(precision="bf16", global_batch=64)
    bundle = write_test_bundle(tmp_path / "b", model, CLUSTER, "zero=3", "deepspeed")
    run = build_in_process(bundle, 0)
    assert run.ok and "the model: b-model.json as LlamaConfig, the model file plan.json was made for" in run.notes
    assert all(within(run.measured[s][0], run.predicted[s], TOLERANCE) for s in ("params", "grads", "optimizer"))


def test_another_shorthand_is_refused_naming_what_llama_has_not(tmp_path: Path) -> None:
    model = json.loads((REPO / "examples/models/gpt-3-175b.json").read_text())
    bundle = write_test_bundle(tmp_path / "b", {**model, "layers": 2}, CLUSTER, "zero=3", "deepspeed")
    failed = build_in_process(bundle, 0).failed
    assert failed is not None and failed["step"] == "transformers' config of the model"
    assert failed["error"].endswith("ffn='gelu': the shorthand is built as transformers' LlamaForCausalLM, which has "
                                    "ffn='swiglu'; give the model's config.json")
    assert failed["fix"] == "give the Hugging Face model after --: autoplace dryrun BUNDLE -- --model DIR_OR_HUB_ID"


def test_the_model_after_double_dash_is_the_one_built(builds: Any, tmp_path: Path) -> None:
    """``autoplace dryrun BUNDLE -- --model DIR``: the user's own model directory, said in a note."""
    builds("qwen2.5-zero1")
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    shutil.copy(next(builds.bundles["qwen2.5-zero1"].parent.glob("qwen2.5-0.5b-shrunk.json")), model_dir / "config.json")
    run = build_in_process(builds.bundles["qwen2.5-zero1"], 0, extra=["--model", str(model_dir)])
    assert run.ok and f"the model: {model_dir} (--model after --)" in run.notes
    assert run.measured == builds("qwen2.5-zero1").measured


@pytest.mark.parametrize("plan", ["zero=1", "zero=2", "zero=3"])
def test_fp32_training_keeps_a_cloned_fp32_master(plan: str, tmp_path: Path) -> None:
    """fp32 weights under ZeRO: DeepSpeed still keeps an fp32 master of the partition (12 bytes of optimizer
    state per parameter of it, not Adam's 8), ZeRO-1/2 the whole fp32 weights beside it."""
    model = json.loads((REPO / "examples/models/tiny-llama.json").read_text())
    model["training"].update(precision="fp32", global_batch=64)
    bundle = write_test_bundle(tmp_path / "b", model, CLUSTER, plan, "deepspeed")
    run = build_in_process(bundle, 0)
    assert run.ok and all(within(run.measured[s][0], run.predicted[s], TOLERANCE) for s in ("params", "optimizer"))
    grads = build_in_process(bundle, fullest(run)) if plan == "zero=2" else run  # on the fullest partition
    assert within(grads.measured["grads"][0], grads.predicted["grads"], TOLERANCE)
    trainable = run.measured["params"][0] / 4 * (8 if plan == "zero=3" else 1)
    assert run.measured["optimizer"][0] == pytest.approx(12 * trainable / 8, rel=0.01)


def test_a_bf16_pipeline_edited_to_stage_0_runs_bf16_optimizer_with_zero1s_bytes(builds: Any, tmp_path: Path) -> None:
    """Stage 0 under DeepSpeed's pipeline engine in bf16 is BF16_Optimizer, which shards the fp32 master and Adam
    over data parallelism: the zero=1 bundle edited to stage 0 builds it, reads back as the same plan, and
    allocates what plan.json predicts for zero=1 on both stages."""
    builds("qwen2.5-pp2-zero1")
    bundle = _copy(builds.bundles["qwen2.5-pp2-zero1"], tmp_path / "b")
    config = json.loads((bundle / "ds_config.json").read_text())
    config["zero_optimization"] = {"stage": 0}
    (bundle / "ds_config.json").write_text(json.dumps(config))
    assert edits(read_bundle(bundle)) == []  # autoplace reads the file back as the plan it runs: zero=1
    for rank in (0, 4):
        run = build_in_process(bundle, rank)
        assert run.ok and any(n.startswith("DeepSpeed's optimizer: BF16_Optimizer") for n in run.notes), run.notes
        assert all(within(run.measured[s][0], run.predicted[s], TOLERANCE) for s in ("params", "grads", "optimizer"))
