"""Score one plan: the evaluator's arrays turned into named breakdowns and violations.

This is what ``autoplace evaluate`` prints and what every solver's plans are re-scored with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoplace.compression import risk
from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.cost.evaluate import (
    COMM_PARTS,
    MEMORY_PARTS,
    TIME_PARTS,
    Batch,
    candidates_from_plans,
    evaluate_batch,
    per_second,
)
from autoplace.cost.layers import LayerTable, layer_table
from autoplace.cost.terms import MEMORY_PHASES
from autoplace.plan import Plan
from autoplace.rules import Violation, check_plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

GiB = 2**30


@dataclass(frozen=True)
class Evaluation:
    """Everything the cost model says about one plan.

    Attributes:
        memory: bytes by part on the fullest stage, plus ``total`` and ``capacity``.
        memory_per_stage: the same for every stage.
        comm: bytes sent per step by the busiest device, by dimension, plus ``total``.
        time: seconds per step by part (compute, exposed communication, bubble, optimizer).
        violations: broken rules, out-of-memory included.
        memory_peak_at: when each stage's memory peaks (``MEMORY_PHASES``).
        model_states: params, grads and optimizer bytes on the fullest stage once every
            gradient exists (``memory`` shows them at the peak, which may precede the gradients).
        host: host memory per GPU the offloaded states take on the stage that needs most
            (``offloaded``) and the GPU's share of its node's host memory (``capacity``).
        stage_time_s: seconds of one micro-batch's forward and backward on each stage (the first
            holds the embedding, the last the head and loss; the slowest sets the pipeline's pace).
    """

    plan: Plan
    memory: dict[str, float]
    memory_per_stage: list[dict[str, float]]
    comm: dict[str, float]
    time: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    mfu: float
    tflops_per_gpu: float
    hw_tflops_per_gpu: float
    worst_stage: int
    violations: list[Violation] = field(default_factory=list)
    memory_peak_at: list[str] = field(default_factory=list)
    model_states: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=lambda: {"offloaded": 0.0, "capacity": float("inf")})
    stage_time_s: list[float] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory["capacity"] and self.host["offloaded"] <= self.host["capacity"]

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self, rank: int | None = None) -> dict[str, Any]:
        """The plan object of the contract (autoplace.solution/v1) plus ``violations``."""
        out: dict[str, Any] = {"rank": rank} if rank is not None else {}
        out.update(self.plan.to_dict())
        if (flagged := risk(self.plan)) is not None:
            out["compress_risk"] = flagged
        out["memory_per_device_bytes"] = {k: int(round(v)) for k, v in self.memory.items()}
        out["memory_per_stage_bytes"] = [{k: int(round(v)) for k, v in s.items()} for s in self.memory_per_stage]
        out["memory_peak_at_per_stage"] = list(self.memory_peak_at)
        out["model_states_bytes"] = {k: int(round(v)) for k, v in self.model_states.items()}
        out["host_memory_per_gpu_bytes"] = {k: int(round(v)) for k, v in self.host.items()}
        out["comm_bytes_per_step_per_device"] = {k: int(round(v)) for k, v in self.comm.items()}
        out["time_breakdown_s"] = {k: round(v, 6) for k, v in self.time.items()}
        out["stage_time_per_microbatch_s"] = [round(t, 9) for t in self.stage_time_s]
        out.update({"step_time_s": round(self.step_time_s, 6), "tokens_per_s": round(self.tokens_per_s, 3),
                    "tflops_per_gpu": round(self.tflops_per_gpu, 3), "hw_tflops_per_gpu": round(self.hw_tflops_per_gpu, 3),
                    "mfu": round(self.mfu, 5), "violations": [v.to_dict() for v in self.violations]})
        return out


def evaluate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, assume: Assumptions = DEFAULT,
             *, allow_tp_across_nodes: bool = False) -> Evaluation:
    """Score ``plan`` (memory, communication, time) and list the rules it breaks."""
    return evaluate_many(model, cluster, [plan], assume, allow_tp_across_nodes=allow_tp_across_nodes)[0]


def evaluate_many(model: ModelSpec, cluster: ClusterSpec, plans: list[Plan], assume: Assumptions = DEFAULT,
                  *, allow_tp_across_nodes: bool = False) -> list[Evaluation]:
    """:func:`evaluate` of every plan, scored in one vectorized pass (a solve's top plans)."""
    if not plans:
        return []
    table = layer_table(model)
    batch = evaluate_batch(table, cluster, candidates_from_plans(plans, table), model.training.recipe(), assume)
    return [_checked(from_batch(batch, i, plan, cluster.gpus), model, cluster, table, allow_tp_across_nodes)
            for i, plan in enumerate(plans)]


def _checked(ev: Evaluation, model: ModelSpec, cluster: ClusterSpec, table: LayerTable,
             allow_tp_across_nodes: bool) -> Evaluation:
    """``ev`` with the rules its plan breaks, memory and host memory included."""
    violations = check_plan(ev.plan, model, cluster, table, allow_tp_across_nodes=allow_tp_across_nodes)
    for s, stage in enumerate(ev.memory_per_stage):
        if stage["total"] > stage["capacity"]:
            short = stage["total"] - stage["capacity"]
            violations.append(Violation("out-of-memory", (
                f"stage {s} needs {stage['total'] / GiB:.2f} GiB per device but has {stage['capacity'] / GiB:.2f} GiB "
                f"(short by {short / GiB:.2f} GiB)")))
    if ev.host["offloaded"] > ev.host["capacity"]:
        need, have = ev.host["offloaded"], ev.host["capacity"]
        violations.append(Violation("host-out-of-memory", (
            f"the offloaded states need {need / GiB:.1f} GiB of host memory per GPU ({need * cluster.gpus_per_node / 1e9:.0f} GB "
            f"per node of {cluster.gpus_per_node} GPUs) but each GPU's share, after the OS and pinned buffers, is "
            f"{have / GiB:.1f} GiB (host_memory_GB in the cluster file)")))
    return Evaluation(**{**ev.__dict__, "violations": violations})


def from_batch(batch: Batch, i: int, plan: Plan, gpus: int) -> Evaluation:
    """The i-th candidate of a scored batch as an Evaluation (no rule checks)."""
    stages = []
    for s in range(plan.pp):
        parts = {k: float(v) for k, v in zip(MEMORY_PARTS, batch.memory[i, s], strict=True)}
        parts["total"] = float(batch.memory[i, s].sum())
        parts["capacity"] = float(batch.capacity[i, s])
        stages.append(parts)
    worst = int(batch.worst_stage[i])
    busiest = int(np.argmax(batch.comm_bytes[i, : plan.pp].sum(axis=-1)))
    comm = {k: float(v) for k, v in zip(COMM_PARTS, batch.comm_bytes[i, busiest], strict=True)}
    comm["total"] = float(sum(comm.values()))
    step = float(batch.step_time[i])
    return Evaluation(
        plan=plan, memory=stages[worst], memory_per_stage=stages, comm=comm,
        time={k: float(v) for k, v in zip(TIME_PARTS, batch.time[i], strict=True)}, step_time_s=step,
        tokens_per_s=float(batch.tokens_per_s[i]), mfu=float(batch.mfu[i]),
        tflops_per_gpu=float(per_second(batch.model_flops[i], step)) / gpus / 1e12,
        hw_tflops_per_gpu=float(per_second(batch.hardware_flops[i], step)) / gpus / 1e12, worst_stage=worst,
        memory_peak_at=[MEMORY_PHASES[int(f)] for f in batch.memory_phase[i, : plan.pp]],
        stage_time_s=[float(t) for t in batch.stage_time[i, : plan.pp]],
        model_states={k: float(v) for k, v in zip(MEMORY_PARTS[:3], batch.states[i, worst], strict=True)},
        host=_host(batch, i, plan.pp))


def _host(batch: Batch, i: int, stages: int) -> dict[str, float]:
    """Offloaded bytes per GPU and the host share on the stage closest to (or furthest over) its limit."""
    s = int(np.argmax(batch.host[i, :stages] - batch.host_capacity[i, :stages]))
    return {"offloaded": float(batch.host[i, s]), "capacity": float(batch.host_capacity[i, s])}
