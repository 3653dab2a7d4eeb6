"""Launch scripts: valid bash, the right launcher arguments, and no user text ever executed.

The scripts are run for real with stand-in ``torchrun`` / ``deepspeed`` / ``srun`` /
``scontrol`` executables first on PATH that record the arguments they receive.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from autoplace.bundle import render
from autoplace.emit.launch import Launch, emit_k8s, emit_slurm, emit_torchrun
from autoplace.errors import EmitError
from autoplace.specs.cluster import cluster_from_dict
from tests.test_emit_plans import CLUSTER16, cpu_cluster, make_plan, small_model

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")

EVIL = 'x"; touch /tmp/pwned #'
EVIL_ARGS = ("--name", "$(touch {tmp}/pwned2)", "a b", "`touch {tmp}/pwned3`", "'; touch {tmp}/pwned4; '")

RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RECORD_TO"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "bundle": os.environ.get("AUTOPLACE_BUNDLE"),
                        "job": os.environ.get("AUTOPLACE_JOB")}) + "\\n")
"""


def fake_bin(tmp_path: Path) -> Path:
    """A directory of recording stand-ins for the launchers, and an scontrol that lists two nodes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "deepspeed", "srun"):
        (bin_dir / name).write_text(RECORDER)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'node-a\\nnode-b\\n'\n")
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    return bin_dir


def run_script(text: str, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> list[dict]:
    """``bash -n`` then run ``text`` with the stand-ins; return what each launcher recorded."""
    script = tmp_path / "launch.sh"
    script.write_text(text)
    assert subprocess.run([BASH, "-n", str(script)], capture_output=True).returncode == 0
    record = tmp_path / "record.jsonl"
    full_env = {**os.environ, "PATH": f"{fake_bin(tmp_path)}:{os.environ['PATH']}", "RECORD_TO": str(record),
                **(env or {})}
    result = subprocess.run([BASH, str(script), *extra], env=full_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def evil_launch(tmp_path: Path) -> Launch:
    return Launch(script=f"train $(touch {tmp_path}/pwned1).py", args=tuple(a.format(tmp=tmp_path) for a in EVIL_ARGS),
                  bundle_dir=f"{tmp_path}/b dir; touch {tmp_path}/pwned5", master_port=29511)


def assert_nothing_ran(tmp_path: Path, pwned_existed: bool) -> None:
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pwned")) == []
    assert pwned_existed or not Path("/tmp/pwned").exists()


def test_torchrun_script_passes_every_user_word_through_untouched(tmp_path) -> None:
    pwned_existed = Path("/tmp/pwned").exists()
    model = small_model(name=EVIL)
    launch = evil_launch(tmp_path)
    text = emit_torchrun(make_plan("zero=3", model, CLUSTER16), model, CLUSTER16, launch)
    (call,) = run_script(text, tmp_path, "--extra", "$(touch x)", env={"MASTER_ADDR": "10.0.0.1"})
    assert call["argv"] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "10.0.0.1:29511", "--rdzv-id", "x-touch-tmp-pwned",
                            launch.script, *launch.args, "--extra", "$(touch x)"]
    assert (call["job"], call["bundle"]) == (EVIL, launch.bundle_dir)
    assert_nothing_ran(tmp_path, pwned_existed)


def test_a_newline_in_the_model_name_cannot_end_the_comment(tmp_path) -> None:
    model = small_model(name=f"x\ntouch {tmp_path}/pwned6")
    text = emit_torchrun(make_plan("zero=3", model, CLUSTER16), model, CLUSTER16)
    run_script(text, tmp_path)
    assert not (tmp_path / "pwned6").exists()


def test_deepspeed_launcher_script_passes_the_bundles_config(tmp_path) -> None:
    pwned_existed = Path("/tmp/pwned").exists()
    model = small_model(name=EVIL)
    launch = evil_launch(tmp_path)
    files = {f.name: f.text for f in render("deepspeed", make_plan("zero=2", model, CLUSTER16), model, CLUSTER16,
                                            launch)}
    (call,) = run_script(files["launch_deepspeed.sh"], tmp_path)
    assert call["argv"] == ["--num_nodes", "2", "--num_gpus", "8", "--hostfile", "/job/hostfile",
                            "--master_addr", "127.0.0.1", "--master_port", "29511", launch.script, "--deepspeed",
                            "--deepspeed_config", f"{launch.bundle_dir}/ds_config.json", *launch.args]
    assert_nothing_ran(tmp_path, pwned_existed)


def test_slurm_script_rendezvous_at_the_first_allocated_node(tmp_path) -> None:
    pwned_existed = Path("/tmp/pwned").exists()
    model = small_model(name=EVIL)
    launch = evil_launch(tmp_path)
    text = emit_slurm(make_plan("zero=3", model, CLUSTER16), model, CLUSTER16, launch)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=x-touch-tmp-pwned", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --time=24:00:00", "#SBATCH --exclusive", "#SBATCH --gpus-per-node=8",
                          "#SBATCH --output=x-touch-tmp-pwned-%j.out"]
    env = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77"}
    (call,) = run_script(text, tmp_path, env=env)
    assert call["argv"] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "node-a:29511", "--rdzv-id", "77", launch.script, *launch.args]
    assert_nothing_ran(tmp_path, pwned_existed)


def test_cpu_clusters_ask_slurm_and_kubernetes_for_no_gpus() -> None:
    model, cluster = small_model(), cpu_cluster(2)
    plan = make_plan("zero=3", model, cluster)
    assert "--gpus-per-node" not in emit_slurm(plan, model, cluster)
    assert "resources" not in emit_k8s(plan, model, cluster)["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
        "spec"]["containers"][0]
    assert "--gpus-per-node=2" in emit_slurm(plan, model, cluster, Launch(gres=True))


def test_k8s_pytorchjob_passes_every_user_word_and_container_args_through_untouched(tmp_path) -> None:
    """The pod's command, run as the container runtime runs it (its ``args`` appended: bash -c takes
    them as "$@"), hands torchrun the user's words as given and runs none of them."""
    pwned_existed = Path("/tmp/pwned").exists()
    model = small_model(name=EVIL)
    launch = evil_launch(tmp_path)
    doc = yaml.safe_load(yaml.safe_dump(emit_k8s(make_plan("zero=3", model, CLUSTER16), model, CLUSTER16, launch)))
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob",
                                                                          "x-touch-tmp-pwned")
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert doc["spec"]["nprocPerNode"] == "8" and specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"][:2] == ["bash", "-c"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PATH": f"{fake_bin(tmp_path)}:{os.environ['PATH']}", "RECORD_TO": str(record),
           **{e["name"]: e["value"] for e in container["env"]}}
    done = subprocess.run([*container["command"], "--extra", "$(touch x)"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert call["argv"] == [launch.script, *launch.args, "--extra", "$(touch x)"]
    assert (call["job"], call["bundle"]) == (EVIL, launch.bundle_dir)
    assert_nothing_ran(tmp_path, pwned_existed)


def test_single_node_jobs_and_partial_nodes() -> None:
    model = small_model()
    one = cpu_cluster(2)
    assert "--nnodes 1 --nproc-per-node 2" in emit_torchrun(make_plan("zero=3", model, one), model, one)
    assert "Worker" not in emit_k8s(make_plan("zero=3", model, one), model, one)["spec"]["pytorchReplicaSpecs"]
    plan = make_plan("zero=3", model, CLUSTER16).replace(dp_shard=12)  # 12 ranks: one and a half nodes
    with pytest.raises(EmitError, match="not a whole number of 8-GPU nodes"):
        emit_torchrun(plan, model, CLUSTER16)


def test_pools_with_different_gpus_per_node_cannot_share_one_launch_line() -> None:
    mixed = cluster_from_dict({"name": "mixed", "inter_node": "ib-hdr", "pools": [
        {"name": "a", "nodes": 1, "gpus_per_node": 8, "gpu": "a100-sxm4-80gb", "intra_node": "nvlink3"},
        {"name": "b", "nodes": 1, "gpus_per_node": 4, "gpu": "a100-sxm4-80gb", "intra_node": "nvlink3"}]})
    model = small_model(batch=48)
    with pytest.raises(EmitError, match="different GPUs per node"):
        emit_slurm(make_plan("zero=3", model, mixed), model, mixed)


def test_launch_options_are_checked() -> None:
    from autoplace.errors import SpecError

    with pytest.raises(SpecError, match="master_port: expected a port number"):
        Launch(master_port="29500; touch /tmp/pwned")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="args: expected a tuple of strings"):
        Launch(args=["--lr", 1])  # type: ignore[arg-type]
