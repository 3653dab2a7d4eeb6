"""`autoplace submit --scheduler slurm` and `autoplace tune --launcher slurm` through a real Slurm:
a single-node cluster on this machine (Debian's slurmctld, slurmd, munge; CI installs them), started
once for the module.  submit: sbatch + srun + torchrun with c10d rendezvous, two gloo ranks
all-reducing; tune: one submitit job per trial.  The daemons this module starts, it stops."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
TRAIN = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {int(t.item())}", flush=True)
assert os.path.isfile(os.path.join(os.environ["AUTOPLACE_BUNDLE"], "plan.json"))
dist.destroy_process_group()
"""


def _conf(root: Path) -> str:
    host = socket.gethostname().split(".")[0]
    return "\n".join([
        "ClusterName=autoplace-test", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={root}/munge/munge.sock", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
        "SelectType=select/linear", f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmdSpoolDir={root}/spool", f"StateSaveLocation={root}/state", f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log", f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running single-node Slurm; yields the environment its clients need."""
    if os.geteuid() != 0 or any(shutil.which(d) is None for d in DAEMONS):
        pytest.skip("needs root and Debian's slurmctld, slurmd, slurm-client and munge")
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("spool", "state", "munge"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o700)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (root / "slurm.conf").write_text(_conf(root))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={root}/munge/munge.sock",
                    f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"],
                   check=True, env=env)
    subprocess.run(["slurmctld"], check=True, env=env)
    subprocess.run(["slurmd"], check=True, env=env)
    try:
        deadline = time.time() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env).stdout:
            if time.time() > deadline:
                pytest.fail("the test Slurm node never became idle")
            time.sleep(0.5)
        yield env
    finally:
        for name in ("slurmd", "slurmctld", "munged"):
            _stop(root / f"{name}.pid")


def _stop(pid_file: Path) -> None:
    """SIGTERM the daemon, wait for it to exit, SIGKILL it if it will not."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        return
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _wait(job: str, env: dict[str, str], timeout: float = 180.0) -> str:
    deadline = time.time() + timeout
    state = ""
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), state)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(1)
    return f"still {state} after {timeout:.0f} s"


def test_submit_runs_a_tiny_job_through_sbatch_srun_torchrun(slurm: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    bundle = tmp_path / "job"
    env = {**slurm, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{slurm['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "autoplace.cli", "submit", str(REPO / "examples/models/tiny-llama.json"),
                           str(REPO / "examples/clusters/cpu-2.yaml"), "--scheduler", "slurm",
                           "--script", str(tmp_path / "train.py"), "--out", str(bundle), "--json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    import json

    job = json.loads(proc.stdout)["job_id"]
    assert job and job.isdigit()
    assert _wait(job, env) == "COMPLETED"
    output = "".join(p.read_text() for p in bundle.glob("*.out"))
    assert "rank 0 of 2 sum 3" in output and "rank 1 of 2 sum 3" in output, output


def test_tune_launcher_slurm_runs_a_trial_as_a_submitit_job(slurm: dict[str, str], tmp_path: Path) -> None:
    # CPU cluster: the job must ask for no GPUs (this Slurm has no GRES) and run gloo
    import json

    import optuna

    env = {**slurm, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{slurm['PATH']}"}
    out = tmp_path / "tune"
    proc = subprocess.run([sys.executable, "-m", "autoplace.cli", "tune", str(REPO / "examples/models/tiny-llama.json"),
                           str(REPO / "examples/clusters/cpu-2.yaml"), "--launcher", "slurm", "--trials", "1",
                           "--top", "1", "--timeout", "120", "--out", str(out), "--json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    [trial] = json.loads(proc.stdout)["trials"]
    assert trial["state"] == "COMPLETE", trial
    assert trial["measured_step_s"] > 0 and trial["tokens_per_s"] > 0 and trial["peak_rss_bytes"] > 0
    [frozen] = optuna.load_study(study_name="autoplace", storage=f"sqlite:///{out / 'study.db'}").get_trials()
    assert frozen.user_attrs["launcher"] == "slurm" and frozen.value == trial["measured_step_s"]
    # the torchrun agent's log (node 0 of the job); the ranks ran on a CPU-only node, so not on nccl
    assert Path(frozen.user_attrs["log"]) == out / "trials" / "0000" / "run.log.node0"
    assert json.loads((out / "trials" / "0000" / "result.json").read_text())["world"] == 2
    submission = next((out / "trials" / "0000" / "slurm").glob("*_submission.sh")).read_text()
    assert "#SBATCH --nodes=1" in submission and "--cpus-per-task=2" in submission
    assert "gpus" not in submission and "gres" not in submission
