"""The multi-node path of ``autoplace tune --launcher slurm``: one submitit job per trial
(torch-free here; the job itself runs torchrun on every node).

Each node of the job runs one torchrun agent; agents meet through the c10d rendezvous on the
first node's host name, the recipe of PyTorch's Slurm examples.  Not exercised by the CPU CI
(ECOSYSTEM.md: a local slurmctld works, but GRES/GPUs do not).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from autoplace.plan import Plan
from autoplace.runtime.launch import Outcome, read_outcome, worker_env
from autoplace.runtime.spec import write_inputs
from autoplace.specs.model import ModelSpec


def _node_main(args: list[str], log_path: str) -> int:
    """Runs inside the job on every node: torchrun with a rendezvous on the first node."""
    import submitit

    env = submitit.JobEnvironment()
    head = env.hostnames[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={env.num_nodes}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={head}:29500", f"--rdzv-id={env.job_id}", *args]
    with open(f"{log_path}.node{env.node}", "wb") as logf:
        return subprocess.call(cmd, stdout=logf, stderr=subprocess.STDOUT, env=worker_env())


def run_slurm(model: ModelSpec, plan: Plan, directory: Path, *, nodes: int, gpus_per_node: int, timeout_s: float,
              steps: int, warmup: int, scale: float, extra: list[str], partition: str | None = None) -> Outcome:
    """Submit one trial as a Slurm job of ``nodes`` nodes and wait for it (timeout -> ``hang``)."""
    try:
        import submitit
    except ImportError:
        return Outcome("failed", "crash", error="--launcher slurm needs submitit (pip install submitit)")
    model_path, plan_path = write_inputs(directory, model, plan)
    out = directory / "result.json"
    per_node = max(1, plan.world // nodes)
    args = [f"--nproc-per-node={per_node}", "-m", "autoplace.runtime.worker", "--plan-json", str(plan_path),
            "--model-json", str(model_path), "--out", str(out), "--steps", str(steps), "--warmup", str(warmup),
            "--scale", str(scale), "--backend", "nccl", *extra]
    ex = submitit.AutoExecutor(folder=str(directory / "slurm"))
    params: dict[str, Any] = {"nodes": nodes, "tasks_per_node": 1, "gpus_per_node": gpus_per_node,
                              "timeout_min": max(1, int(timeout_s // 60) + 1)}
    if partition:
        params["slurm_partition"] = partition
    ex.update_parameters(**params)
    log_path = directory / "run.log"
    t0 = time.perf_counter()
    job = ex.submit(_node_main, args, str(log_path))
    try:
        code = job.result() if timeout_s <= 0 else _wait(job, timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed job is a failed trial
        return Outcome("failed", "crash", wall_s=time.perf_counter() - t0, log=str(log_path), error=str(exc))
    return read_outcome(out, code, time.perf_counter() - t0, log_path)


def _wait(job: Any, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel()
            return None
        time.sleep(2.0)
    return job.result()
