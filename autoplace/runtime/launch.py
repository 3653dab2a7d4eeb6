"""Running the worker as a subprocess and reading what it left behind (torch-free).

A run is one torchrun process group in its own session, so a timeout kills the launcher and
every rank at once (``os.killpg``) -- a hung collective cannot outlive its trial.

Which backend and how many ranks a local run gets is :func:`local_launch`'s decision: a GPU
profile runs NCCL with one process per GPU of this host (rank r on ``cuda:r``) and is refused when
the plan needs more GPUs than torch sees; a ``cpu`` profile runs gloo with one process per core.
Run one tune worker per GPU host, or give each worker its own ``CUDA_VISIBLE_DEVICES`` (torch
counts only those): two workers on the same GPUs would time each other's trials.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace.errors import SpecError
from autoplace.plan import Plan
from autoplace.runtime.spec import launch_command, write_inputs
from autoplace.specs.model import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]  # makes ``-m autoplace...`` importable in the ranks


@dataclass
class Outcome:
    """What one run produced.

    Attributes:
        status: ``ok``, ``failed`` or ``unsupported``.
        reason: for failures, ``oom``, ``crash`` or ``hang`` (timeout); for unsupported, why.
        result: the worker's JSON (empty unless ok).
        wall_s: seconds from launch to exit.
        log: path of the combined stdout/stderr of the run.
    """

    status: str
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    log: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class LocalLaunch:
    """How a plan runs on this host: the torch.distributed backend and the processes to start."""

    backend: str  # ``nccl`` (a GPU profile) or ``gloo`` (a ``cpu`` profile)
    nproc: int  # one per rank: a GPU each under NCCL, a core each under gloo


def local_launch(gpu_profile: bool, visible: int, world: int, what: str = "") -> LocalLaunch:
    """The backend and process count of a local run, or why this host cannot run the plan.

    Args:
        gpu_profile: the cluster's devices are GPUs (any pool whose profile is not ``cpu``).
        visible: the devices of this host a rank can own: ``torch.cuda.device_count()`` for a GPU
            profile, the usable cores for a ``cpu`` profile (:func:`visible_devices`).
        world: the plan's ranks (the cluster's GPUs).
        what: the cluster's name, for the message.

    Raises:
        SpecError: ``world`` exceeds ``visible`` -- a local run would oversubscribe the devices
            and measure something other than the plan (exit 2, one line).
    """
    if world <= visible:
        return LocalLaunch("nccl" if gpu_profile else "gloo", world)
    have = (f"{visible} GPU(s) torch.cuda.device_count() sees" if gpu_profile else f"{visible} usable CPU core(s)")
    smaller = (f"a cluster of at most {visible} {'GPUs' if gpu_profile else 'cpu devices'}" if visible
               else "a `gpu: cpu` cluster (gloo processes)")
    raise SpecError(f"a local trial of {what or 'this cluster'} runs world={world} ranks, one per device, but this host "
                    f"has {have}; use --launcher slurm, or tune {smaller}", field="--launcher local")


def visible_devices(gpu_profile: bool) -> int:
    """What :func:`local_launch` compares the world with: this host's CUDA devices (0 without
    torch or CUDA) for a GPU profile, else the cores this process may run on."""
    if not gpu_profile:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a run: the repository importable, one OpenMP thread per
    rank unless set, and ``extra`` (e.g. NCCL knobs) on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_command(cmd: list[str], log_path: Path, timeout_s: float,
                env: dict[str, str] | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` in a new session; on timeout kill its whole process group.

    Returns:
        (exit code, or None if it timed out; wall seconds)
    """
    t0 = time.perf_counter()
    with open(log_path, "wb") as logf:
        reaped = [sys.executable, "-m", "autoplace.runtime.reaper", str(os.getpid()), *cmd]  # dies with us
        proc = subprocess.Popen(reaped, stdout=logf, stderr=subprocess.STDOUT, env=worker_env(env),
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
    return code, time.perf_counter() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_outcome(out: Path, code: int | None, wall_s: float, log_path: Path) -> Outcome:
    """Classify a finished run from its exit code, result file and per-rank error files."""
    if code is None:
        return Outcome("failed", "hang", wall_s=wall_s, log=str(log_path), error="timed out; process group killed")
    if out.exists():
        # rank 0 writes the result only after every rank finished measuring; a non-zero exit
        # after that (an abort in process teardown) does not invalidate the figures
        result = json.loads(out.read_text())
        status = result.get("status", "ok")
        note = "" if code == 0 else f"exit code {code} after the result was written"
        return Outcome(status, result.get("reason", ""), result if status == "ok" else {}, wall_s, str(log_path),
                       error=note)
    errors = [json.loads(p.read_text()) for p in sorted(out.parent.glob(out.name + ".rank*.error.json"))]
    if errors:
        first = next((e for e in errors if e.get("reason") == "oom"), errors[0])
        return Outcome("failed", first["reason"], wall_s=wall_s, log=str(log_path), error=first.get("error", ""))
    tail = log_path.read_text(errors="replace")[-400:] if log_path.exists() else ""
    return Outcome("failed", "crash", wall_s=wall_s, log=str(log_path), error=f"exit code {code}: {tail.strip()}")


def run_local(model: ModelSpec, plan: Plan, directory: Path, *, timeout_s: float = 300.0, steps: int = 3,
              warmup: int = 1, scale: float = 1.0, backend: str = "gloo", framework: str = "native",
              extra: list[str] | None = None, env: dict[str, str] | None = None) -> Outcome:
    """Write the inputs, run the worker on this host with ``plan.world`` processes, classify the outcome.

    ``backend`` comes from :func:`local_launch` (``nccl``: rank r uses ``cuda:r``); ``framework``
    is ``native`` (PyTorch parallelism) or ``deepspeed`` (the emitted DeepSpeed config); ``env``
    is added to the ranks' environment (the NCCL knobs a tune trial sets).
    """
    from autoplace.runtime.spec import unsupported_reason

    reason = unsupported_reason(plan, framework)
    if reason:  # the worker would say the same after starting torch; save the launch
        return Outcome("unsupported", reason)
    model_path, plan_path = write_inputs(directory, model, plan)
    out = directory / "result.json"
    for stale in [out, *directory.glob("result.json.rank*.error.json")]:
        stale.unlink(missing_ok=True)
    cmd = launch_command(plan.world, plan_path, model_path, out, steps=steps, warmup=warmup, scale=scale,
                         backend=backend, framework=framework, extra=extra)
    log_path = directory / "run.log"
    code, wall = run_command(cmd, log_path, timeout_s, env)
    return read_outcome(out, code, wall, log_path)
