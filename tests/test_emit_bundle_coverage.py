"""Issue 11's must-show: on shipped examples and Hugging Face configs of Llama-3.1-70B, Qwen2.5-32B and
Mixtral-8x22B, the default ``solve --out`` bundle holds a framework config that runs the top plan, and
each framework's folder holds the best plan it can express, read back by the framework's own parser:
DeepSpeedConfig with the plan's world and data-parallel size, torchtitan's ConfigManager (model name,
flavor, degrees) for the Llama-family models, accelerate's loader and launch validation, megatron-core's
TransformerConfig for the Megatron arguments.  Slow: one full search per framework per model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from autoplace.plan import Plan
from tests.helpers import REPO
from tests.test_cli import invoke, strict_json
from tests.test_emit_accelerate import accelerate_launch_env
from tests.test_emit_deepspeed import check_parsed, deepspeed_accepts
from tests.test_emit_megatron import mcore, megatron_core_config  # noqa: F401 - mcore is a fixture
from tests.test_emit_torchtitan import titan  # noqa: F401 - a fixture

H100_4X8 = {"name": "h100-4x8", "nodes": 4, "gpus_per_node": 8, "gpu": "h100-sxm5-80gb", "intra_node": "nvlink4",
            "inter_node": "ib-ndr", "host_memory_GB": 2048}
CASES = [  # (model file, cluster, torchtitan (model, flavor) or None when torchtitan has no such model)
    ("examples/models/tiny-llama.json", "examples/clusters/cpu-2.yaml", ("llama3", "autoplace")),
    # Llama 3 8B has Llama 3.1 8B's shapes but no RoPE scaling: a custom flavor without it
    ("examples/models/llama-3-8b.json", "examples/clusters/1x8-a100-80gb.yaml", ("llama3", "autoplace")),
    ("tests/data/hf/llama-3.1-70b.json", "examples/clusters/8x8-h100.yaml", ("llama3", "70B")),
    ("tests/data/hf/qwen2.5-32b.json", H100_4X8, None),
    ("tests/data/hf/mixtral-8x22b.json", "examples/clusters/8x8-h100.yaml", ("qwen3", "autoplace")),
]
CONFIG_FILES = {"deepspeed": "ds_config.json", "megatron": "megatron_args.sh", "torchtitan": "torchtitan.toml",
                "fsdp": "fsdp2_parallelize.py", "accelerate": "accelerate_config.yaml"}


def _cluster_file(cluster: Any, tmp_path: Path) -> Path:
    if isinstance(cluster, dict):
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(cluster))
        return path
    return REPO / cluster


@pytest.mark.slow
@pytest.mark.parametrize("model_file, cluster, flavor", CASES, ids=[Path(c[0]).stem for c in CASES])
def test_default_bundle_runs_the_top_plan_and_every_framework_its_best(model_file: str, cluster: Any,
                                                                       flavor: tuple[str, str] | None, titan, mcore,  # noqa: F811
                                                                       tmp_path: Path, monkeypatch) -> None:
    cluster_path = _cluster_file(cluster, tmp_path)
    out = tmp_path / "bundle"
    # a limit no machine reaches: the searches end when proven (each framework is searched within
    # what the limit leaves, so a tight one would make the bundles depend on the machine's load)
    result = invoke("solve", REPO / model_file, cluster_path, "--out", out, "--json", "--top", "1",
                    "--time-limit", "120")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    top = doc["plans"][0]
    assert top["frameworks"], "the top plan must run with some framework"
    assert any((out / CONFIG_FILES[f]).is_file() for f in top["frameworks"])  # its config is in the bundle
    per = doc["framework_bundles"]
    # accelerate's FSDP2 shards Mixtral's stacked experts ([8, ...] in transformers 5) on dim 0: over 64 ranks
    # each holds a whole expert of every layer (padding), and no plan of its fits -- said, not written
    stacked = "mixtral" in model_file
    for f in ("deepspeed", "megatron", *(() if stacked else ("accelerate",))):
        assert per[f]["written"], (f, per[f])
    _deepspeed(out / "deepspeed", monkeypatch)
    if stacked:
        assert not per["accelerate"]["written"] and "no plan accelerate can express fits" in per["accelerate"]["reason"]
    else:
        _accelerate(out / "accelerate", tmp_path, monkeypatch)
    _megatron(out / "megatron")
    if flavor is None:
        assert not per["torchtitan"]["written"] and "torchtitan: q/k/v biases" in per["torchtitan"]["reason"]
    else:
        _torchtitan(out / "torchtitan", flavor, titan)


def _plan(folder: Path) -> Plan:
    return Plan.from_dict(json.loads((folder / "plan.json").read_text()))


def _deepspeed(folder: Path, monkeypatch) -> None:
    plan = _plan(folder)
    cfg = json.loads((folder / "ds_config.json").read_text())
    check_parsed(deepspeed_accepts(cfg, plan, monkeypatch), cfg, plan)  # world and dp size, batch, ZeRO


def _accelerate(folder: Path, tmp_path: Path, monkeypatch) -> None:
    plan = _plan(folder)
    cfg = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    accelerate_launch_env(cfg, tmp_path, monkeypatch)  # accelerate's loader and launch validation
    assert cfg["num_processes"] == plan.world and (cfg["distributed_type"] == "FSDP") == (plan.zero >= 2)


def _megatron(folder: Path) -> None:
    plan = _plan(folder)
    printed = subprocess.run(["bash", "-c", 'source megatron_args.sh && printf "%s\\0" "${MEGATRON_ARGS[@]}"'],
                             cwd=folder, capture_output=True, text=True, check=True).stdout
    config, args = megatron_core_config(printed.split("\0")[:-1], plan)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size) == (
        plan.tp, plan.pp, plan.cp)
    assert (args.micro_batch_size, args.global_batch_size) == (plan.mbs, plan.global_batch)


def _torchtitan(folder: Path, flavor: tuple[str, str], tt: Any) -> None:
    plan = _plan(folder)
    job = tt.ConfigManager().parse_args(["--job.config_file", str(folder / "torchtitan.toml")])
    assert (job.model.name, job.model.flavor) == flavor
    p = job.parallelism
    tt.ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                       cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                       ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=plan.world)
    assert (p.data_parallel_shard_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree,
            p.context_parallel_degree) == (plan.dp_shard, plan.tp, plan.pp, plan.cp)
    assert job.training.global_batch_size == plan.global_batch
