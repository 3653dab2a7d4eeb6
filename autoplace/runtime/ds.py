"""Training a plan with DeepSpeed, configured by autoplace's own emitter (torch, deepspeed).

``--framework deepspeed`` runs the config ``autoplace emit`` hands the user (ZeRO 0-3, CPU
offload), not a hand-written one, so a trial measures what the user will run.  Only two keys
are added, both about the optimizer object the runtime passes in (DeepSpeed leaves the
optimizer to the user's code, so the emitter writes none):

* ``zero_allow_untested_optimizer`` when the optimizer is plain SGD (``verify`` needs SGD;
  DeepSpeed accepts only its listed optimizers under ZeRO without it);
* with ``offload_optimizer=cpu`` the optimizer is DeepSpeed's own ``DeepSpeedCPUAdam``
  (DeepSpeed refuses a torch optimizer under ZeRO-Offload); it is JIT-built on first use (~55 s).

The runtime keeps DeepSpeed to data-parallel plans (tp = pp = ep = 1, see
:func:`autoplace.runtime.spec.unsupported_reason`): its pipeline engine and AutoTP need the
model written as a ``PipelineModule`` / built under ``tp_model_init``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from autoplace.errors import BenchmarkError, EmitError
from autoplace.plan import Plan
from autoplace.runtime import parallel as par
from autoplace.runtime.comms import CommLog
from autoplace.runtime.data import micro_batch
from autoplace.runtime.model import build_model, causal_lm_loss
from autoplace.specs.model import TransformerSpec


class Unsupported(BenchmarkError):
    """The plan cannot run on this path; the worker reports ``unsupported`` with the message."""


def deepspeed_config(plan: Plan, spec: TransformerSpec, world: int) -> dict[str, Any]:
    """The emitted DeepSpeed config of ``plan`` for the model the runtime builds.

    Raises:
        Unsupported: the emitter cannot express the plan (the message is its reason).
    """
    from autoplace.frameworks.deepspeed import emit_deepspeed
    from autoplace.specs.cluster import cluster_from_dict

    # the emitter ignores the cluster (DeepSpeed's schema has no hardware keys); a nominal host of
    # `world` gloo processes stands in for it
    cluster = cluster_from_dict({"name": f"cpu-{world}", "nodes": 1, "gpus_per_node": world, "gpu": "cpu",
                                 "intra_node": "loopback"}, source="<runtime host>")
    try:
        return emit_deepspeed(plan, spec, cluster)
    except EmitError as exc:
        raise Unsupported(str(exc)) from exc


def init_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed (on its CPU accelerator for a CPU device) and attach it to the existing process group."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # The CPU accelerator JIT-builds a shared-memory op (~40 s on a fresh machine) used only by
    # inference_all_reduce; training collectives go through torch.distributed either way.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


class DeepSpeedTrainer:
    """The worker's Trainer interface (``step``, ``state_bytes``, ``full_state``) over a DeepSpeed engine."""

    def __init__(self, args: argparse.Namespace, spec: TransformerSpec, plan: Plan, device: torch.device) -> None:
        self.args, self.spec, self.plan, self.device = args, spec, plan, device
        cfg = deepspeed_config(plan, spec, dist.get_world_size())
        self.deepspeed = init_deepspeed(device)
        self.layout = par.build_layout(plan, dist.get_world_size(), device.type)
        # with tp = pp = 1 every group DeepSpeed creates (its clone of the world, hpZ groups) is data parallel
        self.comm = CommLog({}, default_dim="dp")
        torch.manual_seed(args.seed)
        model = build_model(spec).to(device)
        par.apply_ac(model, plan.recompute)
        optim, extra = self._optimizer(model)
        self.engine, self.optim, *_ = self.deepspeed.initialize(model=model, optimizer=optim, config={**cfg, **extra})
        self.model = self.engine.module
        self.grad_bytes = 0

    def _optimizer(self, model: torch.nn.Module) -> tuple[Any, dict[str, Any]]:
        """The optimizer object and the config keys DeepSpeed asks for to accept it."""
        args, params = self.args, model.parameters()
        lr = args.lr or (0.05 if args.optimizer == "sgd" else 1e-3)
        if self.plan.offload_optimizer == "cpu":
            if args.optimizer != "adamw":
                raise Unsupported("ZeRO-Offload runs DeepSpeedCPUAdam only (DeepSpeed refuses other optimizers)")
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True), {}
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr), {"zero_allow_untested_optimizer": True}
        return torch.optim.AdamW(params, lr=lr, foreach=False), {}

    def step(self, step: int) -> float:
        """One optimizer step: ``grad_accum`` engine micro-steps (DeepSpeed scales each loss by 1/ga)."""
        total = 0.0
        for m in range(self.plan.grad_accum):
            tokens = micro_batch(self.spec, self.plan, self.args.seed, step, m, self.layout.dp_rank).to(self.device)
            loss = causal_lm_loss(self.engine(tokens[:, :-1]), tokens[:, 1:])
            self.engine.backward(loss)
            if m == self.plan.grad_accum - 1:
                self.grad_bytes = self._grad_bytes()
            self.engine.step()
            total += float(loss.detach()) / self.plan.grad_accum
        return total

    def _grad_bytes(self) -> int:
        """Gradient bytes held before the update: ZeRO's partitions, or the full gradients at zero 0."""
        opt = self.engine.optimizer
        flat = getattr(opt, "grad_partitions_flat_buffer", None)  # ZeRO-3: one flat buffer of partitions
        if isinstance(flat, torch.Tensor):
            return flat.numel() * flat.element_size()
        parts = getattr(opt, "averaged_gradients", None)  # ZeRO-1/2: partitions per parameter group
        if isinstance(parts, dict):
            return sum(g.numel() * g.element_size() for gs in parts.values() if gs for g in gs)
        return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: ZeRO-3 parameter shards (``ds_tensor``), optimizer state."""
        params = sum(_param_bytes(p) for p in self.model.parameters())
        inner = getattr(self.engine, "basic_optimizer", None) or self.optim
        optim = sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": self.grad_bytes, "optimizer": optim}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter in full under its plain model name (collective under ZeRO-3)."""
        params = list(self.model.parameters())
        with self.deepspeed.zero.GatheredParameters(params, enabled=self.plan.zero == 3):
            return par.full_state(self.model)


def _param_bytes(p: torch.Tensor) -> int:
    shard = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps only this rank's partition
    t = shard if shard is not None else p
    return t.numel() * t.element_size()
