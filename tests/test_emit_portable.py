"""Bundles are portable: moved elsewhere and run from another directory, every launch script
finds its configs; the PyTorchJob mounts the bundle and /dev/shm; accelerate takes the machine
rank and head address from the launcher's environment; sbatch asks for time and whole nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from autoplace.bundle import emit
from autoplace.emit.launch import K8S_BUNDLE_MOUNT, Launch, emit_k8s, emit_slurm
from autoplace.errors import SpecError
from tests.helpers import gpu_cluster
from tests.test_emit_launch import RECORDER as _RECORDER
from tests.test_emit_plans import MODEL, cpu_cluster, make_plan

BASH = shutil.which("bash")
RECORDER = _RECORDER.replace('"job": os.environ.get("AUTOPLACE_JOB")',
                             '"job": os.environ.get("AUTOPLACE_JOB"), "pythonpath": os.environ.get("PYTHONPATH")')
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")
CLUSTER16 = gpu_cluster(16)  # 2 nodes x 8 GPUs, InfiniBand HDR between them


def _fake_bin(tmp_path: Path, submitted: Path) -> Path:
    """Recording launchers, and an scontrol that reports ``submitted`` as the job's Command (as Slurm does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "deepspeed", "srun", "accelerate"):
        (bin_dir / name).write_text(RECORDER)
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\nif [ "$1 $2" = "show job" ]; then\n'
        f'  printf "JobId=$3 JobName=x\\n   Command={submitted}\\n   WorkDir=/\\n"\n'
        "else printf 'node-a\\nnode-b\\n'; fi\n")
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    return bin_dir


def _run(script: Path, tmp_path: Path, cwd: Path, env: dict[str, str]) -> dict:
    record = tmp_path / "record.jsonl"
    record.unlink(missing_ok=True)
    full = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "RECORD_TO": str(record), **env}
    result = subprocess.run([BASH, str(script)], cwd=cwd, env=full, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    return call


def test_a_moved_bundle_runs_from_any_directory(tmp_path: Path) -> None:
    plan = make_plan("zero=3", MODEL, CLUSTER16)
    first = tmp_path / "written"
    emit(plan, MODEL, CLUSTER16, ["deepspeed", "accelerate", "torchrun", "slurm"], first)
    for path in first.iterdir():  # nothing in the bundle names where it was written
        assert str(first) not in path.read_text(), path.name
    moved = tmp_path / "moved here" / "bundle"
    moved.parent.mkdir()
    shutil.move(str(first), moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _fake_bin(tmp_path, moved / "job.sbatch")

    call = _run(moved / "launch_torchrun.sh", tmp_path, elsewhere, {})
    assert call["bundle"] == str(moved) and call["pythonpath"].split(":")[0] == str(moved)  # torchtitan's flavor module
    call = _run(moved / "launch_deepspeed.sh", tmp_path, elsewhere, {})
    config = Path(call["argv"][call["argv"].index("--deepspeed_config") + 1])
    assert config == moved / "ds_config.json" and config.is_file()
    call = _run(moved / "launch_accelerate.sh", tmp_path, elsewhere, {"NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3"})
    assert Path(call["argv"][call["argv"].index("--config_file") + 1]) == moved / "accelerate_config.yaml"
    # under Slurm the script runs from a spool copy; the bundle comes from the submitted path
    spool = tmp_path / "spool" / "slurm_script"
    spool.parent.mkdir()
    shutil.copy(moved / "job.sbatch", spool)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
             "SLURM_SUBMIT_DIR": str(elsewhere)}
    assert _run(spool, tmp_path, elsewhere, slurm)["bundle"] == str(moved)


def test_under_slurm_without_a_usable_command_the_submit_directory_is_the_bundle(tmp_path: Path) -> None:
    plan = make_plan("zero=3", MODEL, CLUSTER16)
    emit(plan, MODEL, CLUSTER16, ["slurm"], tmp_path / "b")
    _fake_bin(tmp_path, tmp_path / "gone" / "job.sbatch")  # scontrol names a path that no longer exists
    spool = tmp_path / "slurm_script"
    shutil.copy(tmp_path / "b" / "job.sbatch", spool)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-a", "SLURM_NNODES": "2",
           "SLURM_SUBMIT_DIR": str(tmp_path / "b")}
    assert _run(spool, tmp_path, tmp_path, env)["bundle"] == str(tmp_path / "b")


def test_accelerate_takes_machine_rank_and_head_address_from_the_environment(tmp_path: Path) -> None:
    """accelerate's own launch parser and validation, given the script's arguments on node 1 of 2."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    plan = make_plan("zero=3", MODEL, CLUSTER16)
    emit(plan, MODEL, CLUSTER16, ["accelerate"], tmp_path / "b")
    _fake_bin(tmp_path, tmp_path / "b" / "job.sbatch")
    call = _run(tmp_path / "b" / "launch_accelerate.sh", tmp_path, tmp_path,
                {"SLURM_NODEID": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "6000"})
    args = launch_command_parser().parse_args(call["argv"][1:])  # drop the "launch" subcommand
    _validate_launch_command(args)
    assert (args.machine_rank, args.main_process_ip, args.main_process_port) == (1, "10.1.2.3", 6000)
    assert (args.num_machines, args.num_processes, args.use_fsdp) == (2, 16, True)


def test_pytorchjob_mounts_the_bundle_and_shared_memory() -> None:
    plan = make_plan("zero=3", MODEL, CLUSTER16)
    job = emit_k8s(plan, MODEL, CLUSTER16)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        spec = replica["template"]["spec"]
        (container,) = spec["containers"]
        assert container["image"] == "YOUR_TRAINING_IMAGE"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert mounts == {"autoplace-bundle": K8S_BUNDLE_MOUNT, "dshm": "/dev/shm"}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
        configmap = volumes["autoplace-bundle"]["configMap"]["name"]
        assert {"name": "AUTOPLACE_BUNDLE", "value": K8S_BUNDLE_MOUNT} in container["env"]
    assert f"kubectl create configmap {configmap} " in job["metadata"]["annotations"]["autoplace/bundle"]
    assert yaml.safe_load(yaml.safe_dump(job)) == job


def test_sbatch_asks_for_time_whole_nodes_and_sets_nccl_for_the_fabric() -> None:
    plan = make_plan("zero=3", MODEL, CLUSTER16)
    text = emit_slurm(plan, MODEL, CLUSTER16, Launch(time_limit="2-00:00:00"))
    assert "#SBATCH --time=2-00:00:00" in text and "#SBATCH --exclusive" in text
    assert 'export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"' in text
    roce = gpu_cluster(16, inter="roce-400")
    assert 'NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"' in emit_slurm(make_plan("zero=3", MODEL, roce), MODEL, roce)
    cpu = cpu_cluster(2)  # the CPU test cluster: no GRES, no NCCL
    text = emit_slurm(make_plan("zero=3", MODEL, cpu), MODEL, cpu)
    assert "--gpus-per-node" not in text and "NCCL" not in text and "#SBATCH --time=" in text
    with pytest.raises(SpecError, match="time_limit"):
        Launch(time_limit="1 day")
