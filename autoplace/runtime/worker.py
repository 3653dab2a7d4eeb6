"""The benchmark program torchrun launches: build, parallelize, train a few steps, report JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m autoplace.runtime.worker \\
        --plan-json plan.json --model-json model.json --out run.json [--steps 3 --warmup 1 --scale 1]

Order (torchtitan's): mesh -> model on every rank from one seed -> pipeline split (one chunk
per virtual stage) -> tensor parallel -> context parallel -> expert parallel -> activation
checkpointing -> FSDP2 / DDP -> optimizer; ``--framework deepspeed`` instead hands the model to
``deepspeed.initialize`` with the emitted config (:mod:`autoplace.runtime.ds`).  Then ``warmup`` steps (the
last one counted by the collective counter, untimed; under PowerSGD at least one past its plain
all-reduce steps, :func:`warmup_steps`) and ``steps`` timed steps on synthetic tokens.  Rank 0 writes the result; a rank that fails writes ``OUT.rank<r>.error.json`` with
the reason (``oom`` or ``crash``) and exits non-zero, so torchrun stops the other ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplace.plan import Plan
from autoplace.runtime import parallel as par
from autoplace.runtime.comms import CommLog, CountingMode
from autoplace.runtime.data import micro_batch, split_inputs
from autoplace.runtime.ds import DeepSpeedTrainer, Unsupported
from autoplace.runtime.model import build_model, causal_lm_loss, pipeline_stage
from autoplace.runtime.spec import (
    deviation,
    plan_from_json,
    scaled_model,
    scaled_plan,
    unsupported_reason,
    virtual_stages,
)
from autoplace.specs.model import TransformerSpec, model_from_dict

log = logging.getLogger("autoplace")
FAULTS = ("crash", "oom", "hang")
BREAKS = ("none", "sum-grads", "desync")
FRAMEWORKS = ("native", "deepspeed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autoplace.runtime.worker", description=__doc__.splitlines()[0])
    p.add_argument("--plan-json", type=Path, required=True)
    p.add_argument("--model-json", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing; the last is counted")
    p.add_argument("--scale", type=float, default=1.0, help="shrink hidden size, FFN, vocabulary and layers")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--framework", choices=FRAMEWORKS, default="native",
                   help="PyTorch-native parallelism, or DeepSpeed with the config autoplace emits")
    p.add_argument("--fail", choices=FAULTS, default=None, help="inject a failure at the first step (tests)")
    p.add_argument("--break", dest="fault", choices=BREAKS, default="none",
                   help="inject a correctness fault: sum gradients instead of averaging, or skip the reduction")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP gradient bucket size (bucket_cap_mb)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-params", type=Path, default=None, help="write every rank's full parameters to PREFIX.rank<r>.pt")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps >= 1 and --warmup >= 0 must hold, but got steps={args.steps}, warmup={args.warmup}")
    if args.framework == "deepspeed" and args.fault != "none":
        p.error(f"--break {args.fault} injects faults into the native path only, but got --framework deepspeed")
    return args


# ----------------------------------------------------------------------------------------
# one training step


class Trainer:
    """Holds the parallelized model and runs one optimizer step at a time."""

    def __init__(self, args: argparse.Namespace, spec: TransformerSpec, plan: Plan, device: torch.device) -> None:
        self.args, self.spec, self.plan, self.device = args, spec, plan, device
        if spec.moe is not None and plan.tp > 1:  # alike on every rank, before any collective
            raise Unsupported("tensor-parallel MoE blocks (expert tensor parallelism) are not implemented by the runtime")
        if spec.moe is None and plan.ep > 1:
            raise Unsupported(f"expert parallel (ep={plan.ep}) needs a MoE model, but {spec.name} has no experts")
        if spec.tied_embeddings and plan.pp > 1:
            raise Unsupported("tied embeddings across pipeline stages (a shared-weight gradient sync) are not implemented")
        if spec.dropout and plan.cp > 1:
            raise Unsupported("attention dropout under ring attention (cp > 1) is not implemented")
        self.layout = par.build_layout(plan, dist.get_world_size(), device.type)
        self.comm = CommLog(par.group_dims(self.layout))
        self.manual_reduce = False
        self.fsdp = False
        # the head's logits stay sharded over the vocabulary for the loss (torchtitan, and what the
        # tracker harness measures); pipelining's loss_fn gets them gathered
        self.loss_parallel = plan.tp > 1 and plan.pp == 1
        self.grad_bytes = 0
        self.schedule: Any = None
        self.model = self._build()
        lr = args.lr or (0.05 if args.optimizer == "sgd" else 1e-3)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = (torch.optim.SGD(params, lr=lr) if args.optimizer == "sgd"
                      else torch.optim.AdamW(params, lr=lr, foreach=False))

    def _build(self) -> torch.nn.Module:
        """The parallelized model: one module, or this rank's virtual pipeline stages in a ModuleList."""
        plan, lay = self.plan, self.layout
        par.check_heads(self.spec.heads, self.spec.n_kv_heads, plan.tp)
        torch.manual_seed(self.args.seed)  # the same full model on every rank, then split
        model = build_model(self.spec).to(self.device)
        if plan.pp == 1:
            return self._parallelize(model)
        last = plan.pp * plan.vpp - 1
        chunks = virtual_stages(plan, lay.pp_rank)
        parts = [self._parallelize(pipeline_stage(model, start, stop, v == 0, v == last))
                 for v, start, stop in chunks]
        self.schedule = self._schedule(parts, [v for v, _, _ in chunks])
        return parts[0] if len(parts) == 1 else nn.ModuleList(parts)

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plan's parallelisms on one model (chunk) (:func:`parallel.parallelize`), then DDP if it asks for it."""
        plan, lay = self.plan, self.layout
        mode = par.parallelize(model, plan, lay, loss_parallel=self.loss_parallel)  # type: ignore[arg-type]
        self.manual_reduce = self.manual_reduce or mode == "manual"
        self.fsdp = self.fsdp or mode == "fsdp"
        if mode == "ddp":
            return par.apply_ddp(model, lay.dp_group, self.comm, self.args.bucket_mb, self.args.fault,
                                 ignore=par.expert_names(model) if plan.ep > 1 else None,
                                 compress=plan.compress, powersgd_rank=plan.powersgd_rank)
        return model

    def _schedule(self, parts: list[torch.nn.Module], indices: list[int]) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        n = self.plan.pp * self.plan.vpp
        stages: list[Any] = [PipelineStage(part, v, n, self.device, group=self.layout.group("pp"))
                             for part, v in zip(parts, indices, strict=True)]
        if self.plan.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, n_microbatches=self.plan.grad_accum, loss_fn=causal_lm_loss)
        cls = ScheduleGPipe if self.plan.schedule == "gpipe" else Schedule1F1B
        return cls(stages[0], n_microbatches=self.plan.grad_accum, loss_fn=causal_lm_loss)

    def step(self, step: int) -> float:
        """One optimizer step (all micro-batches); returns this rank's mean loss (NaN if none)."""
        plan, lay = self.plan, self.layout
        batches = [micro_batch(self.spec, plan, self.args.seed, step, m, lay.dp_rank).to(self.device)
                   for m in range(plan.grad_accum)]
        if self.schedule is not None:
            loss = self._pipeline_step(torch.cat(batches))
        else:
            total = 0.0
            for m, tokens in enumerate(batches):
                with self._no_sync(last=m == len(batches) - 1), self._loss_context():
                    inputs, targets = split_inputs(tokens, plan.cp, lay.cp_rank)
                    out = causal_lm_loss(self.model(inputs), targets) / plan.grad_accum
                    out.backward()
                total += float(out.detach())
            loss = total
        if self.manual_reduce:
            par.reduce_dtensor_grads(self.model, lay.dp_group, self.comm, self.args.fault, experts=plan.ep == 1,
                                     dtype=par.reduce_dtype(plan.compress))
        if plan.ep > 1:
            par.reduce_expert_grads(self.model, lay, self.args.fault, fsdp=self.fsdp, dtype=par.reduce_dtype(plan.compress))
        if self.fsdp and self.args.fault == "sum-grads":
            # gloo has no PREMUL_SUM, so FSDP2's divide factor cannot be set to 1: scale instead
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(plan.dp * plan.cp)
        self.optim.step()
        self.grad_bytes = sum(_local_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
        self.optim.zero_grad(set_to_none=True)
        return loss

    def _pipeline_step(self, tokens: torch.Tensor) -> float:
        first, last = self.layout.pp_rank == 0, self.layout.pp_rank == self.plan.pp - 1
        losses: list[torch.Tensor] = []
        inputs, targets = split_inputs(tokens, self.plan.cp, self.layout.cp_rank)
        args = (inputs,) if first else ()
        self.schedule.step(*args, target=targets if last else None, losses=losses if last else None)
        return float(torch.stack(losses).mean()) if last else float("nan")

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each model state this rank holds between steps (gradients: at the last step's end)."""
        params = sum(_local_bytes(p) for p in self.model.parameters())
        optim = sum(_local_bytes(v) for s in self.optim.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": self.grad_bytes, "optimizer": optim}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter in full under its plain model name (collective)."""
        parts = self.model if isinstance(self.model, nn.ModuleList) else [self.model]
        return {name: t for part in parts for name, t in par.full_state(part).items()}

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel`` when the logits are vocabulary-sharded DTensors (forward and backward)."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """What a non-final micro-batch skips, following the cost model (and torchtitan, DeepSpeed):

        * DDP and ZeRO-1 reduce gradients once per step (ZeRO-1 keeps them replicated, R);
        * ZeRO-2/3 reduce-scatter every micro-batch (gradients stay sharded, S);
        * ZeRO-1/2 keep the gathered parameters until the step ends, so they are all-gathered once
          per step (ZeRO-3 gathers them again in every forward and backward).
        """
        if last:
            return contextlib.nullcontext()
        if hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()  # type: ignore[operator]
        if self.fsdp:
            return _fsdp_accumulate(self.model, sync=self.plan.zero >= 2, reshard=self.plan.zero >= 3)
        return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_accumulate(model: Any, *, sync: bool, reshard: bool) -> Any:
    """FSDP2 for one non-final micro-batch: reduce-scatter gradients or not, reshard after backward
    or not.  HSDP's all-reduce across replicas waits for the last micro-batch (FSDP2's
    ``set_requires_all_reduce``), once per step as the cost model charges it; without that
    FSDP2 all-reduces the shards after every micro-batch's reduce-scatter."""
    model.set_requires_gradient_sync(sync)
    model.set_requires_all_reduce(False)
    model.set_reshard_after_backward(reshard)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(True)
        model.set_reshard_after_backward(True)


# ----------------------------------------------------------------------------------------
# measurement


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return t.numel() * t.element_size()


def _global_loss(trainer: Trainer | DeepSpeedTrainer, local: float) -> float:
    """Mean loss over the global batch: ranks on the last stage each hold the mean over their dp
    shard of rows and cp chunk of the sequence (chunks are equal, so the mean of means is exact)."""
    plan = trainer.plan
    holds = trainer.layout.pp_rank == plan.pp - 1
    t = torch.tensor([local if holds else 0.0], dtype=torch.float64, device=trainer.device)
    dist.all_reduce(t)
    return float(t) / (plan.dp * plan.tp * plan.cp)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train and measure; returns the result every rank agrees on (rank 0 writes it)."""
    spec = scaled_model(model_from_dict(json.loads(args.model_json.read_text()), source=str(args.model_json)),
                        args.scale)
    plan = scaled_plan(plan_from_json(json.loads(args.plan_json.read_text())), spec.layers)
    why = deviation(plan, args.framework)
    base = {"schema": "autoplace.trial/v1", "plan": plan.to_string(), "world": dist.get_world_size(),
            "framework": args.framework, "deviation": why, "exact": why is None,
            "model": spec.model_dump(exclude_none=True), "scale": args.scale}
    reason = unsupported_reason(plan, args.framework)
    if reason:
        return {**base, "status": "unsupported", "reason": reason}
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}") if args.backend == "nccl" else torch.device("cpu")
    rss0 = _rss_bytes()
    try:
        trainer = DeepSpeedTrainer(args, spec, plan, device) if args.framework == "deepspeed" else Trainer(
            args, spec, plan, device)
    except Unsupported as exc:  # raised alike on every rank, before any collective
        return {**base, "status": "unsupported", "reason": str(exc)}
    losses: list[float] = []
    args.warmup = warmup_steps(plan, args.warmup)
    for s in range(args.warmup):
        _inject(args, s)
        counted = s == args.warmup - 1
        trainer.comm.enabled = counted
        with CountingMode(trainer.comm) if counted else contextlib.nullcontext():
            local = trainer.step(s)
        trainer.comm.enabled = False
        losses.append(_global_loss(trainer, local))
    dist.barrier()
    times = []
    for s in range(args.warmup, args.warmup + args.steps):
        _inject(args, s)
        t0 = time.perf_counter()
        local = trainer.step(s)
        dist.barrier()  # the step ends when the slowest rank ends
        times.append(time.perf_counter() - t0)
        losses.append(_global_loss(trainer, local))
    return {**base, **_measure(trainer, args, times, losses, rss0)}


def warmup_steps(plan: Plan, asked: int) -> int:
    """Warm-up steps of a run: as asked, but under PowerSGD at least one past its plain all-reduce
    steps (``parallel.POWERSGD_START``), so the counted step -- the last warm-up step -- and the
    timed ones are compressed.  No warm-up (nothing counted) stays none."""
    if plan.compress == "powersgd" and asked > 0:
        return max(asked, par.POWERSGD_START + 1)
    return asked


def _measure(trainer: Trainer | DeepSpeedTrainer, args: argparse.Namespace, times: list[float], losses: list[float],
             rss0: int) -> dict[str, Any]:
    plan, spec = trainer.plan, trainer.spec
    step = sorted(times)[len(times) // 2]  # the median resists one slow step
    tokens = plan.mbs * plan.grad_accum * plan.dp * spec.seq_len
    mine: dict[str, Any] = {"comm": trainer.comm.summary(), "state": trainer.state_bytes(),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss0": rss0}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    busiest = max(every, key=lambda r: r["comm"]["total_ring_bytes"])
    out = {"status": "ok", "steps": args.steps, "warmup": args.warmup, "step_time_s": step, "step_times_s": times,
           "tokens_per_step": tokens, "tokens_per_s": tokens / step if step > 0 else 0.0, "losses": losses,
           "memory": {"peak_rss_bytes": max(r["peak_rss"] for r in every),
                      "baseline_rss_bytes": max(r["rss0"] for r in every),
                      "method": "getrusage ru_maxrss of each rank's process (whole process: Python, torch and "
                                "the model), max over ranks; baseline is RSS before the model was built",
                      "state_bytes_per_device": {k: max(r["state"][k] for r in every) for k in mine["state"]}},
           "collectives": busiest["comm"] if args.warmup else None,
           # per rank too: routed tokens make expert-parallel all-to-alls uneven, the cost model assumes the mean
           "ring_bytes_by_rank": [r["comm"]["ring_bytes_by_dim"] for r in every] if args.warmup else None,
           "collectives_note": "counted over one step (the last warm-up step), busiest rank; ring_bytes are bytes "
                               "sent per rank under ring algorithms, the cost model's convention"}
    if args.save_params:
        state = trainer.full_state()
        torch.save(state, f"{args.save_params}.rank{dist.get_rank()}.pt")
    return out


def _inject(args: argparse.Namespace, step: int) -> None:
    if args.fail is None or step != 0 or dist.get_rank() != 0:
        return
    if args.fail == "crash":
        raise RuntimeError("injected crash (--fail crash)")
    if args.fail == "oom":
        raise torch.OutOfMemoryError("simulated out of memory (--fail oom): tried to allocate 1.00 GiB")
    time.sleep(10**6)  # hang: the other ranks block in the next collective


def failure_reason(exc: BaseException) -> str:
    """``oom`` for out-of-memory errors (CUDA's or a host MemoryError), else ``crash``."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower():
        return "oom"
    return "crash"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    try:
        result = run(args)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then re-raised
        err = {"status": "failed", "reason": failure_reason(exc), "error": f"{type(exc).__name__}: {exc}", "rank": rank}
        Path(f"{args.out}.rank{rank}.error.json").write_text(json.dumps(err))
        raise
    if rank == 0:
        args.out.write_text(json.dumps(result, indent=1))
    # tear down together: a rank that leaves while its peer is still in gloo can abort at exit
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
