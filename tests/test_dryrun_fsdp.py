"""The FSDP2 bundle's dry run: train_fsdp2.py's own steps (its argparse, load_model, the module's mesh and
parallelize, build_optimizer, one micro-batch of the first step on fake tensors) on a fake process group,
and the bytes FSDP2 and AdamW allocate beside plan.json's prediction.

The contract: real Hugging Face configs (tests/data/hf, layers shrunk as tests/test_architectures.py does)
x the shapes the FSDP2 bundle expresses (ZeRO-3, ZeRO-2, ZeRO-0 replicas, HSDP, DTensor TP with and
without SP, FSDP x TP on a 2-D mesh, per-block recompute mixes, CPU offload, PowerSGD), each state
within 2% of plan.json's -- or an explicit strict xfail naming the cost-model term that differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autoplace.dryrun.run import TOLERANCE, RankRun, build_in_process
from autoplace.errors import SpecError
from tests.dryrun_bundles import unpadded, write_test_bundle
from tests.helpers import REPO
from tests.test_architectures import shrunk

pytest.importorskip("torch")
pytest.importorskip("transformers")

CLUSTER = "1x8xh100-sxm5-80gb"
NOWHERE = ("--model", "/nonexistent/model")  # not here: the plan's model file is built (a note says so)

# (family, plan): >= 8 families, every shape the module expresses at least once
CONTRACT = [
    ("llama-3.1-8b.json", "zero=3,recompute_layers=f:n"),
    ("qwen2.5-0.5b.json", "tp=2,sp=true,zero=3,recompute_layers=s:f"),  # tied head: one vocabulary-parallel shard
    ("qwen3-8b.json", "dp_replicate=2,zero=3"),  # HSDP: 2 replicas x 4 shards
    ("gemma-2-9b.json", "zero=2,recompute=selective"),  # the 16-bit copies kept gathered count as params
    ("mixtral-8x7b-v0.1.json", "zero=3,offload_optimizer=cpu,offload_params=cpu"),
    ("deepseek-v2-lite.json", "zero=3"),  # MLA + routed experts (forward on fake tensors)
    ("phi-3-mini-4k-instruct.json", "zero=0,dp_replicate=8,dp_shard=1"),  # replicas: fully_shard over one rank
    ("olmo-2-1124-7b.json", "zero=3,recompute=full"),
    ("pythia-1b.json", "zero=3,recompute=selective"),  # selective replay needs the script's use_cache=False
    ("starcoder2-3b.json", "tp=2,sp=false,zero=3"),
    ("mistral-7b-v0.1.json", "tp=4,dp_replicate=2,zero=3"),  # 2-D mesh: HSDP x TP
    ("falcon-7b-refinedwebmodel.json", "zero=2"),
]


def _bundle(root: Path, family: str, plan: str) -> Path:
    model = root / f"{family.removesuffix('.json')}-{abs(hash(plan))}.json"
    model.write_text(json.dumps(shrunk(family)))
    return write_test_bundle(root / model.stem, model, CLUSTER, plan, "fsdp")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, RankRun]]:
    """Every contract bundle built once, one after the other in this process (rank 0)."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {}
    for family, plan in CONTRACT:
        bundle = _bundle(root, family, plan)
        out[family, plan] = bundle, build_in_process(bundle, 0, extra=NOWHERE)
    return out


def _steps(run: RankRun) -> dict[str, str]:
    return {s["step"]: s["status"] for s in run.steps}


@pytest.mark.parametrize(("family", "plan"), CONTRACT)
def test_each_state_is_within_2_percent_of_the_plan(built, family: str, plan: str) -> None:
    _, run = built[family, plan]
    assert run.ok, run.failed
    assert run.stage == 0 and set(_steps(run).values()) == {"done"}
    assert set(run.measured) == {"params", "grads", "optimizer"}
    for state, (nbytes, how) in run.measured.items():
        predicted = run.predicted[state]
        assert abs(nbytes - predicted) <= TOLERANCE * predicted, (state, nbytes, predicted, how)


def test_what_the_counts_are_and_where_they_come_from(built) -> None:
    _, zero3 = built[CONTRACT[0]]
    assert zero3.measured["params"][0] > 0 and "FSDP2's parameter shards (fp32, padded)" in zero3.measured["params"][1]
    assert "(fp32), the reduce-scatter outputs" in zero3.measured["grads"][1]
    assert zero3.measured["optimizer"][0] == 2 * zero3.measured["params"][0]  # AdamW: two fp32 moments per weight
    _, zero2 = built["gemma-2-9b.json", "zero=2,recompute=selective"]
    assert "+ the 16-bit copies FSDP2 keeps gathered from forward to backward" in zero2.measured["params"][1]
    _, offload = built["mixtral-8x7b-v0.1.json", "zero=3,offload_optimizer=cpu,offload_params=cpu"]
    assert {s: b for s, (b, _) in offload.measured.items()} == {"params": 0, "grads": 0, "optimizer": 0}
    host = next(n for n in offload.notes if n.startswith("host memory of the offloaded states"))
    assert host.endswith("+0.0%)"), host  # beside plan.json's host_memory_per_gpu_bytes.offloaded
    assert any("pin_memory=False" in n for n in offload.notes)
    assert any("built the plan's model file" in n for n in zero3.notes)


def test_bundles_built_one_after_another_give_what_each_gives_alone(built) -> None:
    """Each build imports its own bundle's modules (not the previous bundle's, still in sys.modules)
    and leaves no process group, path entry or module behind."""
    import torch.distributed as dist

    for key in (CONTRACT[1], CONTRACT[0]):
        bundle, first = built[key]
        again = build_in_process(bundle, 0, extra=NOWHERE)
        assert again.measured == first.measured and again.steps[-1]["status"] == "done", key
    assert not dist.is_initialized()
    assert "fsdp2_parallelize" not in sys.modules and "train_fsdp2" not in sys.modules
    assert not any(str(bundle) in p for p in sys.path)


def test_stacked_experts_that_do_not_divide_the_shards(tmp_path) -> None:
    """transformers stacks Qwen1.5-MoE's 60 experts in one tensor per projection; FSDP2 cuts dim 0 in chunks of
    ceil(60 / 8) = 8 experts, every rank storing a full chunk: 64 experts' worth over 8 shards (+6.7% on the
    experts, +3.9% on the rank against an even split), which plan.json counts (autoplace.cost.shards)."""
    bundle = _bundle(tmp_path, "qwen1.5-moe-a2.7b-chat-gptq-int4.json", "zero=3")
    run = build_in_process(bundle, 0, extra=NOWHERE)
    assert run.ok
    assert all(abs(e) <= TOLERANCE for e in run.errors().values()), run.errors()
    assert run.measured["params"][0] / unpadded(bundle)["params"] - 1 == pytest.approx(0.0393, abs=5e-4)


def test_powersgd_builds_all_but_ddp_and_says_what_it_leaves_out(tmp_path) -> None:
    """DDP cannot be built on fake tensors: skipped, named; its error feedback (a copy of each bucket from
    iteration 1000, which plan.json counts with the gradients) is not built, and the gap is exactly it."""
    plan = "zero=0,dp_replicate=8,dp_shard=1,compress=powersgd,powersgd_rank=2"
    run = build_in_process(_bundle(tmp_path, "llama-3.1-8b.json", plan), 0, extra=NOWHERE)
    assert run.ok and _steps(run)["DistributedDataParallel with the PowerSGD comm hook (apply_powersgd)"] == "skipped"
    errors = run.errors()
    assert abs(errors["params"]) <= TOLERANCE and abs(errors["optimizer"]) <= TOLERANCE
    assert errors["grads"] == pytest.approx(-0.5) and "error feedback" in run.measured["grads"][1]


def _copy(bundle: Path, to: Path) -> Path:
    to.mkdir()
    for f in bundle.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
        (to / f.name).chmod(f.stat().st_mode)
    return to


def test_the_script_without_its_model_fails_with_its_own_argparse_message(built, tmp_path) -> None:
    """A user drops --model "$HF_MODEL" from the launch line (and gives none after ``--``)."""
    copy = _copy(built[CONTRACT[0]][0], tmp_path / "b")
    launch = copy / "launch_torchrun.sh"
    launch.write_text(launch.read_text().replace(' --model "$HF_MODEL"', ""))
    failed = build_in_process(copy, 0).failed
    assert failed is not None and failed["step"] == "train_fsdp2.py's arguments, by its own argparse"
    assert failed["error"] == "SystemExit: train_fsdp2.py: error: the following arguments are required: --model"
    assert "autoplace dryrun BUNDLE -- --model PATH_OR_HUB_ID" in failed["fix"]


def test_a_mesh_the_world_does_not_fill_fails_with_the_modules_message(built, tmp_path) -> None:
    """A user halves DP_SHARD in fsdp2_parallelize.py: its build_mesh refuses the launch's world."""
    copy = _copy(built[CONTRACT[0]][0], tmp_path / "b")
    module = copy / "fsdp2_parallelize.py"
    module.write_text(module.read_text().replace("DP_SHARD = 8", "DP_SHARD = 4"))
    failed = build_in_process(copy, 0, extra=NOWHERE).failed
    assert failed is not None and failed["step"] == "the device mesh: build_mesh()"
    assert failed["error"] == "ValueError: dp_replicate(1) * dp_shard(4) * tp(1) != WORLD_SIZE(8)"
    assert "make DP_REPLICATE x DP_SHARD x TP in fsdp2_parallelize.py the launch's 8 ranks" in failed["fix"]


def test_the_users_model_directory_is_the_model_built(built, tmp_path) -> None:
    """--model naming a directory with config.json: its model is built (here: a 4-layer copy, so the
    rank holds twice the blocks the plan was made for, and the module refuses it by name)."""
    config = shrunk("llama-3.1-8b.json")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    run = build_in_process(built[CONTRACT[0]][0], 0, extra=("--model", str(tmp_path / "hf")))
    assert any(n.startswith(f"model: --model {tmp_path / 'hf'} (its weights are not read") for n in run.notes)
    assert run.failed is not None and run.failed["error"] == (
        "ValueError: model.model.layers has 4 blocks but the plan was made for 2")


@pytest.mark.parametrize(("family", "plan", "refusal"), [
    ("pythia-1b.json", "tp=2", "tp=2 with gpt_neox: the module's TP splits q/k/v/o and gate/up/down projections by "
                               "name, which gpt_neox's blocks do not have all of"),
    ("mixtral-8x7b-v0.1.json", "tp=2", "tp=2 with mixtral"),
    ("llama-3.1-8b.json", "tp=16", "tp=16 with kv_heads=8: the module splits k_proj and v_proj by columns"),
])
def test_tp_the_module_cannot_split_as_planned_is_refused(family: str, plan: str, refusal: str) -> None:
    """What the dry run found (OLMo 2 stopped; Mixtral's stacked experts unsplit, +89% params; a KV head
    split in two): the FSDP2 framework refuses these plans, so the search never picks them."""
    from autoplace.frameworks import get
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.model import model_from_dict

    spec = model_from_dict(shrunk(family), source=family)
    p = build_plan(parse_plan_string(plan), world=16, blocks=2, global_batch=64, gpus_per_node=16)
    said = get("fsdp").plan_check(spec)(p)
    assert said is not None and refusal in said


def test_a_shorthand_llama_is_built_as_llamaconfig_and_others_are_refused() -> None:
    from autoplace.dryrun.hf_model import llama_config_args
    from autoplace.specs.model import load_model

    spec = load_model(REPO / "examples/models/llama-3-70b.json")
    args = llama_config_args(spec, "llama-3-70b.json")
    assert (args["num_hidden_layers"], args["num_key_value_heads"], args["intermediate_size"]) == (80, 8, 28672)
    gelu = spec.model_copy(update={"ffn": "gelu"})
    with pytest.raises(SpecError, match=r"llama-3-70b.json: ffn='gelu': the shorthand is built as transformers' "
                                        r"LlamaForCausalLM, which has ffn='swiglu'; give the model's config.json"):
        llama_config_args(gelu, "llama-3-70b.json")


def test_the_cli_dry_run_of_a_launch_that_requires_the_model(built) -> None:
    """The CLI's worker processes, default ranks; the launch requires HF_MODEL (bash's ${VAR:?}) and
    passes it as --model: the recording fills a stand-in, so the plan's model file is built."""
    done = subprocess.run([sys.executable, "-m", "autoplace.cli", "dryrun", str(built[CONTRACT[0]][0]), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    doc: dict[str, Any] = json.loads(done.stdout)
    (rank,) = doc["ranks"]
    assert rank["ok"] and rank["stage"] == 0, rank
    assert all(s["within_tolerance"] for s in rank["states"].values()), rank["states"]
    assert any("is the launch's required input, filled in by the recording" in n for n in rank["notes"])
