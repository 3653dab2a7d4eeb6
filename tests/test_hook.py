"""The job-submission hook: check as a pre-submit gate, submit --dry-run, emit from plan.json."""

from __future__ import annotations

import json
from pathlib import Path

from autoplace.hook import submitit_parameters
from autoplace.plan import Plan
from autoplace.specs.cluster import load_cluster
from tests.test_cli import A100_8, MODELS, invoke, strict_json

TINY = MODELS / "tiny-llama.json"
CPU2 = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "cpu-2.yaml"
LLAMA_8B = MODELS / "llama-3-8b.json"


def _bundle(tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    result = invoke("solve", LLAMA_8B, A100_8, "--out", out, "--json", "--fix", "cp=1")  # DeepSpeed has no ring CP
    assert result.exit_code == 0, result.output
    return out


def test_solve_out_writes_a_bundle_with_a_readme_line_per_file(tmp_path: Path) -> None:
    out = _bundle(tmp_path)
    readme = (out / "README.txt").read_text()
    for name in ("job.sbatch", "launch_torchrun.sh", "plan.json"):
        assert (out / name).is_file()
    # the best plan compiles (torchtitan), which DeepSpeed's config does not state: its own folder has its plan
    assert (out / "deepspeed" / "ds_config.json").is_file() and "(not written) deepspeed: " in readme
    assert "deepspeed: deepspeed:" not in readme  # the reason names its framework once
    for path in out.iterdir():
        if path.name not in ("README.txt", "plan.json"):
            assert path.name in readme
    assert json.loads((out / "plan.json").read_text())["inputs"]["model"].endswith("llama-3-8b.json")


def test_check_accepts_the_emitted_configs_and_rejects_an_oom(tmp_path: Path) -> None:
    out = _bundle(tmp_path)
    for config in ("plan.json", "deepspeed/ds_config.json"):
        result = invoke("check", out / config, LLAMA_8B, A100_8)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("ok:")
    doc = json.loads((out / "plan.json").read_text())
    doc["micro_batch"] *= 64  # same plan, 64x the activations
    doc["grad_accum"] = max(1, doc["grad_accum"] // 64)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = invoke("check", bad, LLAMA_8B, A100_8, "--json")
    assert result.exit_code == 1
    reasons = strict_json(result.stdout)["reasons"]
    assert any(r.startswith("out-of-memory:") and "short by" in r for r in reasons)


def test_emit_one_format_from_plan_json(tmp_path: Path) -> None:
    out = _bundle(tmp_path) / "deepspeed"  # the best plan DeepSpeed can run
    result = invoke("emit", out / "plan.json", "--format", "deepspeed", "--out", tmp_path / "ds")
    assert result.exit_code == 0, result.output
    ds = json.loads((tmp_path / "ds" / "ds_config.json").read_text())
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    assert ds["train_batch_size"] == plan.global_batch


def test_emit_for_a_format_that_cannot_express_the_plan_is_bad_input(tmp_path: Path) -> None:
    """A pipeline plan asked of FSDP2: exit 2 (bad input, documented in README), one line naming
    the format, what it cannot say and who can -- not the undocumented 1."""
    solved = invoke("solve", LLAMA_8B, A100_8, "--fix", "pp=2,fused_loss=false,tp_overlap=none", "--framework", "none",
                    "--time-limit", "600",
                    "--out", tmp_path / "pp2", "--json")
    assert solved.exit_code == 0, solved.output
    result = invoke("emit", tmp_path / "pp2" / "plan.json", "--format", "fsdp", "--out", tmp_path / "fsdp")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplace: error: fsdp: pp=2") and "torchtitan" in lines[0]
    assert not (tmp_path / "fsdp").exists() or not any((tmp_path / "fsdp").iterdir())


def test_submit_dry_run_prints_the_command_and_refuses_oom(tmp_path: Path) -> None:
    result = invoke("submit", TINY, CPU2, "--script", "train.py", "--dry-run", "--out", tmp_path / "job", "--json",
                    "--", "--lr", "1e-3")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["job_id"] is None and doc["command"][:2] == ["sbatch", "--parsable"]
    assert "'--lr' '1e-3'" in (tmp_path / "job" / "job.sbatch").read_text() or \
        "--lr 1e-3" in (tmp_path / "job" / "job.sbatch").read_text()
    refused = invoke("submit", MODELS / "llama-3-405b.json", A100_8, "--script", "train.py", "--dry-run",
                     "--plan", "tp=8,zero=3", "--out", tmp_path / "big")
    assert refused.exit_code == 3
    assert "refusing to submit" in refused.stderr and "out-of-memory" in refused.stderr


def test_submitit_parameters_follow_the_plan() -> None:
    cluster = load_cluster(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "8x8-h100.yaml")
    plan = Plan(tp=8, pp=4, dp_shard=2, zero=1, layers_per_stage=(20, 20, 20, 20), recompute=("none",) * 80)
    assert submitit_parameters(plan, cluster) == {"nodes": 8, "tasks_per_node": 8, "gpus_per_node": 8}
