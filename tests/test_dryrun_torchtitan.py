"""torchtitan's dry run: torchtitan 0.2.2's own build of one rank, below its trainer, on a fake world.

Bundles as ``solve --out`` writes them (tests/dryrun_bundles.py) for the families torchtitan trains
(its llama3 flavors and custom ones for Llama 3 and a windowless Mistral, qwen3 dense and MoE, Mixtral
as a qwen3 MoE flavor, DeepSeek-V2-Lite and -V3 as deepseek_v3) in every plan shape torchtitan's
config states (FSDP2, HSDP, DDP, TP, CP, EP, 1F1B and interleaved pipelines, FSDP2 without resharding,
CPU offload), layers shrunk.  Each rank builds every step (or skips it saying why), sits on the stage
the plan put it on, and allocates per state what plan.json predicts, within 2%.  Bundles edited the way a
user might fail with torchtitan's own message and autoplace's fix.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autoplace.dryrun.run import TOLERANCE, RankRun, build_in_process
from autoplace.plan import V_PLACED
from tests.dryrun_bundles import unpadded, write_test_bundle
from tests.helpers import REPO

pytest.importorskip("torch")
pytest.importorskip("tyro", reason="torchtitan's ConfigManager needs tyro")
if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan 0.2.2 is not installed", allow_module_level=True)

# torch's parallelize_module warns for every plan key a pipeline chunk does not hold (torchtitan's plans name them all)
pytestmark = pytest.mark.filterwarnings("ignore:Parallelize plan key")
HF = REPO / "tests" / "data" / "hf"
GPUS8, GPUS16 = "1x8xh100-sxm5-80gb", "2x8xh100-sxm5-80gb"


def family(name: str, blocks: int, **edit: Any) -> dict[str, Any]:
    """tests/data/hf/``name``.json with ``blocks`` blocks (and ``edit``): a model's states grow with its
    blocks, and a pipeline needs as many as it has chunks."""
    config = json.loads((HF / f"{name}.json").read_text())
    return {**config, "num_hidden_layers": blocks, **edit}


# (config, blocks, plan, cluster): the plan shapes torchtitan's config states, over its families
CASES = {
    "llama3.1-fsdp": (family("llama-3.1-8b", 2), "zero=3", GPUS8),
    "llama3-hsdp": (family("meta-llama-3-8b", 2), "zero=3,preset=hsdp", GPUS16),
    "llama3.1-ddp": (family("llama-3.1-8b", 2), "zero=0", GPUS8),
    "llama3.1-tp-ac": (family("llama-3.1-70b", 2), "tp=2,zero=3,recompute=full", GPUS8),
    "qwen3-tp-noreshard": (family("qwen3-8b", 2), "tp=2,zero=2", GPUS8),
    "mistral-pp-1f1b": (family("mistral-7b-v0.1", 4, sliding_window=None), "pp=2,zero=3", GPUS8),
    "llama3.1-pp-interleaved": (family("llama-3.1-405b", 4), "pp=2,vpp=2,schedule=interleaved,zero=2", GPUS8),
    # the zero-bubble schedules (issue 38): looped chunks, and two chunks a rank in a V
    "llama3.1-pp-interleaved-zb": (family("llama-3.1-405b", 4), "pp=2,vpp=2,schedule=interleaved-zb,zero=2", GPUS8),
    "llama3.1-pp-zbv": (family("llama-3.1-405b", 4), "pp=2,vpp=2,schedule=zbv,zero=2", GPUS8),
    # DualPipeV with expert parallelism: torchtitan wraps the experts for its all-to-all overlap (dual_pipe_v.py).
    # Every block MoE: the cost model gives a rank a contiguous run of blocks (plan.stage_mode_counts), where a
    # V gives rank 0 the first and the last chunk -- with DeepSeek-V3's dense first blocks, other kinds
    "deepseekv3-pp-ep-dualpipev": (family("deepseek-v3", 4, num_nextn_predict_layers=0, first_k_dense_replace=0),
                                   "pp=2,vpp=2,ep=2,schedule=dualpipev,zero=3", GPUS8),
    "mixtral-cp": (family("mixtral-8x22b", 2), "cp=2,zero=3", GPUS8),
    "qwen3moe-ep": (family("qwen3-30b-a3b", 2), "ep=2,zero=3", GPUS8),
    "mixtral-ep-tp": (family("mixtral-8x7b-v0.1", 2), "ep=2,tp=2,zero=3", GPUS8),
    "deepseekv3-ep": (family("deepseek-v3", 4, num_nextn_predict_layers=0), "ep=8,zero=3", GPUS8),
    "deepseekv2lite-pp-ep": (family("deepseek-v2-lite", 2), "pp=2,ep=2,zero=3", GPUS8),
    "llama3.1-offload": (family("llama-3.1-8b", 2), "zero=3,offload_optimizer=cpu,offload_params=cpu", GPUS8),
    "llama3.1-pp-offload": (family("llama-3.1-8b", 2), "pp=2,zero=3,offload_optimizer=cpu,offload_params=cpu",
                            GPUS8),
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("titan")
    return {name: write_test_bundle(root / name, model, cluster, plan, "torchtitan")
            for name, (model, plan, cluster) in CASES.items()}


def last_stage_rank(bundle: Path) -> int:
    plan = json.loads((bundle / "plan.json").read_text())
    pp = plan["degrees"]["pp"]
    return (pp - 1) * (plan["degrees"]["dp"] * plan["degrees"]["tp"] * plan["degrees"]["cp"])


def check_built(run: RankRun, stage: int, chunks: list[int]) -> None:
    """Every step done or skipped with a reason; the stage as planned; each state within 2% of plan.json."""
    assert run.crash is None, run.crash
    assert run.failed is None, run.failed
    assert all(s["status"] == "done" or (s["status"] == "skipped" and s["why"]) for s in run.steps)
    assert (run.stage, list(run.chunks)) == (stage, chunks)
    assert set(run.measured) == {"params", "grads", "optimizer"}
    for state, error in run.errors().items():
        assert abs(error) <= TOLERANCE, (state, run.measured[state], run.predicted[state])
    for state in ("params", "optimizer"):  # a state plan.json puts off the device (CPU offload) is off it here
        assert (run.measured[state][0] == 0) == (run.predicted[state] == 0), (state, run.measured[state])


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_builds_as_planned(name: str, bundles: dict[str, Path]) -> None:
    bundle = bundles[name]
    plan = json.loads((bundle / "plan.json").read_text())
    pp, vpp = plan["degrees"]["pp"], plan["virtual_stages"]
    ranks = [(0, 0)] + ([(last_stage_rank(bundle), pp - 1)] if pp > 1 else [])
    v_shape = plan["schedule"] in V_PLACED  # torch places ZBV's / DualPipeV's two stages a rank in a V: r and 2 pp - 1 - r
    for rank, stage in ranks:
        run = build_in_process(bundle, rank)
        chunks = [stage, 2 * pp - 1 - stage] if v_shape else [stage + pp * v for v in range(vpp)]
        check_built(run, stage, chunks if pp > 1 else [])


def test_fsdp2_pads_each_shard_at_large_shard_groups(tmp_path: Path) -> None:
    """FSDP2 shards each parameter's dim 0 in chunks of ceil(rows / group) rows and every rank stores a full
    chunk (FSDPParam.padded_sharded_param_size): sharded 1024 ways, Llama-3.1-405B's K/V projections (128 rows
    at tp=8) take 1024 rows.  plan.json counts the padding (autoplace.cost.shards): +7.85% on this rank (2
    blocks and the edges) against the parameters divided evenly, in params, grads and optimizer state alike."""
    bundle = write_test_bundle(tmp_path / "b", family("llama-3.1-405b", 2), "1024x8xh100-sxm5-80gb", "tp=8,zero=3",
                               "torchtitan")
    run = build_in_process(bundle, 0)
    check_built(run, 0, [])
    even = unpadded(bundle)  # 1,392,704 / 1,291,264 elements per rank
    assert run.measured["params"][0] / even["params"] - 1 == pytest.approx(0.0785, abs=5e-4)
    assert run.measured["optimizer"][0] / even["optimizer"] - 1 == pytest.approx(0.0785, abs=5e-4)


def test_a_pipeline_leaves_each_unit_unsharded_after_its_backward(tmp_path: Path) -> None:
    """torch.distributed.pipelining keeps FSDP2 from resharding after backward until REDUCE_GRAD, so the end
    of a backward holds every ZeRO-3 unit's unsharded copy (bf16, padded): plan.json counts them as params at
    the end of the first backward, where stage 0 of this plan peaks (2 micro-batches, every activation
    recomputed), and the dry run counts them there -- and leaves them out on the last stage, which peaks at
    the start of backward (the loss's workspace)."""
    bundle = write_test_bundle(tmp_path / "b", family("llama-3.1-8b", 4), GPUS8, "pp=2,zero=3,recompute=full",
                               "torchtitan", {"global_batch": 8})
    assert json.loads((bundle / "plan.json").read_text())["memory_peak_at_per_stage"] == ["bwd end", "bwd start"]
    first, last = build_in_process(bundle, 0), build_in_process(bundle, 4)
    check_built(first, 0, [0])
    check_built(last, 1, [1])
    assert "+ the unsharded copies of the 19 tensors of units that reshard after forward" in first.measured["params"][1]
    assert "not counted: the unsharded copies of the 20 tensors" in last.measured["params"][1]
    # stage 0: 2 blocks of Llama-3.1-8B and the embedding, fp32 shards over 4 ranks and bf16 copies (param_dtype)
    assert first.measured["params"][0] == (2 * 218_112_000 + 525_336_576) * (4 / 4 + 2)


# --- bundles a user edited: torchtitan's own refusal, and autoplace's fix ------------------------------


def edited(bundle: Path, tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of ``bundle`` whose file ``name`` says ``new`` where it said ``old``."""
    copy = tmp_path / bundle.name
    shutil.copytree(bundle, copy)
    text = (copy / name).read_text()
    assert old in text, (name, old)
    (copy / name).write_text(text.replace(old, new))
    return copy


def failed(run: RankRun) -> dict[str, Any]:
    assert run.crash is None, run.crash
    assert run.failed is not None, "the dry run built what torchtitan refuses"
    return run.failed


def test_degrees_that_miss_the_world_fail_in_parallel_dims(bundles: dict[str, Path], tmp_path: Path) -> None:
    bundle = edited(bundles["llama3.1-fsdp"], tmp_path, "torchtitan.toml", "data_parallel_shard_degree = 8",
                    "data_parallel_shard_degree = 3")
    step = failed(build_in_process(bundle, 0))
    assert step["step"].startswith("ParallelDims")
    assert "Invalid parallel dims: dp_replicate(1) * dp_shard(3) * cp(1) * tp(1) * pp(1) != WORLD_SIZE(8)" \
        in step["error"]
    assert step["fix"].startswith("set [parallelism] data_parallel_shard_degree = 8")


def test_fewer_micro_batches_than_stages_fail_in_torchs_schedule(bundles: dict[str, Path], tmp_path: Path) -> None:
    """The Llama-3.1-405B bundle's failure (issue 34): 1F1B with fewer micro-batches than stages."""
    original = bundles["mistral-pp-1f1b"]
    toml = (original / "torchtitan.toml").read_text()
    local = next(line for line in toml.splitlines() if line.startswith("local_batch_size"))
    bundle = edited(original, tmp_path, "torchtitan.toml", local, "local_batch_size = 1")
    step = failed(build_in_process(bundle, 0))
    assert step["step"] == "the pipeline schedule: 1F1B (build_pipeline_schedule)"
    assert step["error"] == ("ValueError: Number of microbatches (1) must be greater than or equal to the number of "
                             "stages (2).")
    assert step["fix"].startswith("set [training] local_batch_size = 2 (2 micro-batches of 1 for 2 stages;")


def test_a_launch_without_the_bundle_on_pythonpath_cannot_import_its_flavor(bundles: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """Issue 34, defect 5: torchtitan's custom_import needs the bundle on the program's PYTHONPATH."""
    bundle = edited(bundles["mistral-pp-1f1b"], tmp_path, "launch_torchrun.sh",
                    'export PYTHONPATH="$AUTOPLACE_BUNDLE${PYTHONPATH:+:$PYTHONPATH}"', "")
    step = failed(build_in_process(bundle, 0))
    assert step["error"] == "ModuleNotFoundError: No module named 'autoplace_torchtitan_model'"
    assert "put the bundle on the program's PYTHONPATH" in step["fix"]


def test_a_list_option_given_as_two_words_is_refused_by_torchtitans_command_line(bundles: dict[str, Path]) -> None:
    """Issue 34, defect 7: torchtitan 0.2.2 takes a list option as one comma-joined word."""
    run = build_in_process(bundles["llama3.1-fsdp"], 0, extra=("--compile.components", "model", "loss"))
    step = failed(run)
    assert (step["step"], step["error"]) == ("torchtitan's ConfigManager on the launch's words",
                                             "ValueError: Unrecognized options: loss")
    assert "--compile.components model,loss" in step["fix"]


# --- one process, many bundles ----------------------------------------------------------------------


def test_builds_leave_nothing_behind(bundles: dict[str, Path]) -> None:
    """Two bundles whose flavor modules share a name, built one after the other in one process, each give
    what they give alone: torchtitan's registries, the flavor module and the process group are as before."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.tools import utils

    flavors = dict(llama3_args)
    first = build_in_process(bundles["mistral-pp-1f1b"], 0)
    other = build_in_process(bundles["llama3.1-pp-interleaved"], 0)
    again = build_in_process(bundles["mistral-pp-1f1b"], 0)
    assert first.measured == again.measured != other.measured
    assert dict(llama3_args) == flavors and "autoplace_torchtitan_model" not in sys.modules
    assert parallel_dims.device_type == utils.device_type  # torchtitan's own (cuda here), not the dry run's cpu
    assert not dist.is_initialized()


# --- the command line --------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_builds_rank_0_and_the_last_stage(bundles: dict[str, Path]) -> None:
    """``autoplace dryrun BUNDLE --json``: one worker process per default rank."""
    bundle = bundles["mistral-pp-1f1b"]
    done = subprocess.run([sys.executable, "-m", "autoplace.cli", "dryrun", str(bundle), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    doc = json.loads(done.stdout)
    assert [(r["rank"], r["stage"], r["ok"]) for r in doc["ranks"]] == [(0, 0, True), (4, 1, True)]
    for rank in doc["ranks"]:
        assert all(abs(s["error"]) <= TOLERANCE for s in rank["states"].values())
    assert done.returncode == (0 if doc["ok"] else 1) and doc["ok"] == (not doc["disagreements"])
