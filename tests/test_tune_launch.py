"""Where a local tune trial runs: NCCL with one process per GPU for a GPU profile, gloo for a
``cpu`` profile, and a one-line refusal (exit 2) when the plan needs more devices than this host
has.  The decision is a pure function of (profile kind, visible devices, world), tested here with
made-up device counts; the CLI test runs on this CPU host, where torch sees no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autoplace.errors import SpecError
from autoplace.runtime.launch import LocalLaunch, local_launch, visible_devices, worker_env
from autoplace.tune import _combos, _distributions, _key, _nccl_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("gpu, visible, world, expected", [
    (True, 8, 8, LocalLaunch("nccl", 8)),  # a DGX node: one rank per GPU
    (True, 8, 4, LocalLaunch("nccl", 4)),  # a smaller plan uses the first GPUs
    (False, 2, 2, LocalLaunch("gloo", 2)),  # CPU ranks stay gloo
    (False, 64, 1, LocalLaunch("gloo", 1)),
])
def test_backend_and_processes_follow_the_profile(gpu: bool, visible: int, world: int,
                                                  expected: LocalLaunch) -> None:
    assert local_launch(gpu, visible, world) == expected


@pytest.mark.parametrize("gpu, visible, world, says", [
    (True, 0, 64, "has 0 GPU(s) torch.cuda.device_count() sees; use --launcher slurm, or tune a `gpu: cpu` cluster"),
    (True, 8, 64, "has 8 GPU(s) torch.cuda.device_count() sees; use --launcher slurm, or tune a cluster of at most 8"),
    (False, 2, 4, "has 2 usable CPU core(s); use --launcher slurm, or tune a cluster of at most 2 cpu devices"),
])
def test_a_plan_larger_than_the_host_is_refused_with_the_way_out(gpu: bool, visible: int, world: int,
                                                                 says: str) -> None:
    with pytest.raises(SpecError) as err:
        local_launch(gpu, visible, world, "c")
    assert err.value.exit_code == 2 and says in str(err.value) and f"world={world}" in str(err.value)
    assert "\n" not in str(err.value)


def test_this_host_counts_cores_for_cpu_and_cuda_devices_for_gpu() -> None:
    assert visible_devices(False) >= 1
    torch = pytest.importorskip("torch")
    assert visible_devices(True) == torch.cuda.device_count()


def test_local_tune_of_an_h100_cluster_on_a_cpu_host_refuses_in_one_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 64:
        pytest.skip("this host has 64 GPUs: the plan would run")
    proc = subprocess.run([sys.executable, "-m", "autoplace.cli", "tune", str(REPO / "examples/models/tiny-llama.json"),
                           str(REPO / "examples/clusters/8x8-h100.yaml"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=worker_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()  # no traceback
    assert line.startswith("autoplace: error: --launcher local:") and "world=64" in line and "--launcher slurm" in line
    assert not (tmp_path / "out").exists()  # refused before any study was created


def test_nccl_knobs_are_sampled_on_gpu_hosts_only_and_reach_the_ranks_environment() -> None:
    plans = ["dp_shard=2,zero=0", "tp=2"]
    cpu, gpu = _distributions(plans, nccl=False), _distributions(plans, nccl=True)
    assert set(cpu) == {"plan", "bucket_mb"} and set(gpu) == {"plan", "bucket_mb", "nccl_algo", "nccl_channels"}
    cpu_combos, gpu_combos = _combos(plans, cpu), _combos(plans, gpu)
    # each plan at the default knobs first, best predicted first; the bucket folds away outside DDP
    assert cpu_combos[:2] == [(plans[0], 25, "default", 0), (plans[1], 25, "default", 0)]
    assert len(cpu_combos) == 3 + 1 and len(gpu_combos) == (3 + 1) * 3 * 4
    assert _key({"plan": "tp=2", "bucket_mb": 50}) == ("tp=2", 25, "default", 0)
    assert _nccl_env(("tp=2", 25, "Ring", 8)) == {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "8",
                                                  "NCCL_MAX_NCHANNELS": "8"}
    assert _nccl_env(("tp=2", 25, "default", 0)) == {}
    assert worker_env({"NCCL_ALGO": "Tree"})["NCCL_ALGO"] == "Tree"
