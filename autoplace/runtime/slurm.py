"""The multi-node path of ``autoplace tune --launcher slurm``: one submitit job per trial
(torch-free here; the job itself runs torchrun on every node).

Each node of the job runs one torchrun agent; agents meet through the c10d rendezvous on the
first node's host name, the recipe of PyTorch's Slurm examples.  The job asks for GPUs and runs
nccl only when the cluster has GPUs; CPU ranks run gloo without a GPU request (a Slurm without
GRES refuses ``--gpus-per-node``).  tests/test_slurm.py runs it on a single-node Slurm.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from autoplace.errors import BenchmarkError
from autoplace.plan import Plan
from autoplace.runtime.launch import Outcome, read_outcome, worker_env
from autoplace.runtime.spec import unsupported_reason, write_inputs
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


def run_slurm(model: ModelSpec, plan: Plan, directory: Path, *, gpus_per_node: int, use_gpus: bool, timeout_s: float,
              steps: int, warmup: int, scale: float, extra: list[str], partition: str | None = None) -> Outcome:
    """Submit one trial as a Slurm job and wait for it (timeout -> ``hang``).

    Args:
        gpus_per_node: ranks per node (the job spans ``ceil(plan.world / gpus_per_node)`` nodes).
        use_gpus: request ``gpus_per_node`` GPUs and run nccl; otherwise CPU ranks on gloo.
        timeout_s: from submission, so it includes time in the queue.
    """
    reason = unsupported_reason(plan)
    if reason:  # as run_local: the worker would refuse it after starting torch
        return Outcome("unsupported", reason)
    try:
        submitit = _import_submitit()
    except ImportError:
        return Outcome("failed", "crash", error="--launcher slurm needs submitit (pip install submitit)")
    model_path, plan_path = write_inputs(directory, model, plan)
    out = directory / "result.json"
    for stale in [out, *directory.glob("result.json.rank*.error.json")]:
        stale.unlink(missing_ok=True)
    per_node = min(plan.world, gpus_per_node)
    args = [f"--nproc-per-node={per_node}", "-m", "autoplace.runtime.worker", "--plan-json", str(plan_path),
            "--model-json", str(model_path), "--out", str(out), "--steps", str(steps), "--warmup", str(warmup),
            "--scale", str(scale), "--backend", "nccl" if use_gpus else "gloo", *extra]
    try:  # cluster="slurm": never fall back to running the trial here unnoticed
        ex = submitit.AutoExecutor(folder=str(directory / "slurm"), cluster="slurm")
    except RuntimeError as exc:  # no srun on PATH: every trial would fail alike, so stop the study
        raise BenchmarkError(f"--launcher slurm: {exc}") from exc
    ex.update_parameters(**_job_parameters(-(-plan.world // per_node), per_node, use_gpus, timeout_s, partition))
    log_path = directory / "run.log"
    node0_log = Path(f"{log_path}.node0")
    t0 = time.perf_counter()
    try:
        job = ex.submit(_node_main, args, str(log_path))  # sbatch may refuse it (partition, GRES)
        code = job.result() if timeout_s <= 0 else _wait(job, timeout_s)
    except Exception as exc:  # noqa: BLE001 - a refused or failed job is a failed trial
        return Outcome("failed", "crash", wall_s=time.perf_counter() - t0, log=str(node0_log), error=str(exc))
    return read_outcome(out, code, time.perf_counter() - t0, node0_log)


def _import_submitit() -> Any:
    """submitit, minus the stdout handler it installs on import: stdout carries ``autoplace tune
    --json``'s one document, and submitit's warnings still reach stderr through its other handler."""
    import submitit

    logger = logging.getLogger("submitit")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            logger.removeHandler(handler)
    return submitit


def _job_parameters(nodes: int, per_node: int, use_gpus: bool, timeout_s: float,
                    partition: str | None) -> dict[str, Any]:
    """submitit parameters: one task (a torchrun agent) per node, with a GPU or else a CPU per rank.
    The job must import this package to unpickle :func:`_node_main`, so it gets the checkout on
    ``PYTHONPATH`` as the ranks do."""
    params: dict[str, Any] = {"nodes": nodes, "tasks_per_node": 1, "timeout_min": max(1, int(timeout_s // 60) + 1),
                              "slurm_setup": [f"export PYTHONPATH={shlex.quote(worker_env()['PYTHONPATH'])}"]}
    if use_gpus:
        params["gpus_per_node"] = per_node
    else:
        params["cpus_per_task"] = per_node
    if partition:
        params["slurm_partition"] = partition
    return params


def _wait(job: Any, timeout_s: float) -> int | None:
    """The job's exit code, or None after cancelling it at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel()
            return None
        time.sleep(1.0)
    return job.result()
