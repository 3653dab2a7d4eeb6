"""A prediction above what has been measured: a plan whose MFU exceeds the best run published on
its GPU and compute dtype (``GPUProfile.best_published_mfu``, from the development set) is
reported with the kernel rates that carry it there.

Not a cap: the prediction stays what the cost model computes.  The check says which term lifts
it -- the GEMMs at their measured rate, or attention, whose causal kernel executes half the
``12 L h s`` FLOPs MFU counts (PaLM's convention, which the published runs use too), so that at
long sequences it counts at a higher share of peak than any GEMM -- and how much of the step is
compute at all, so a user can judge the plan against the runs that were measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplace.evaluation import Evaluation
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec


@dataclass(frozen=True)
class AboveMeasured:
    """A plan's MFU above the best published on its GPU (:func:`mfu_check`).

    Attributes:
        mfu: the plan's predicted MFU.
        best: the best MFU published on that GPU and dtype, and ``source``, the run it is.
        compute_share: compute's share of the step.
        gemm, attention: the GEMMs' and attention's rate as MFU counts it (model FLOPs over
            their seconds, against the dtype's peak); attention None without attention.
    """

    mfu: float
    best: float
    source: str
    gpu: str
    dtype: str
    compute_share: float
    gemm: float
    attention: float | None

    @property
    def drivers(self) -> list[str]:
        """The kernel classes that run above the best run's MFU, fastest first: what lifts the plan past it
        (a plan's MFU is at most its fastest class's rate times compute's share of the step)."""
        rates = {"GEMMs": self.gemm, **({"attention": self.attention} if self.attention is not None else {})}
        return [name for name, rate in sorted(rates.items(), key=lambda x: -x[1]) if rate > self.best]

    def line(self) -> str:
        """One line for the report."""
        said = {"GEMMs": f"GEMMs at {self.gemm:.0%} of peak",
                "attention": f"attention at {self.attention or 0:.0%} (its causal kernel executes half the FLOPs MFU "
                             "counts)"}
        return (f"MFU {self.mfu:.1%} is above the best published on {self.gpu} {self.dtype} ({self.best:.1%}, "
                f"{self.source}), driven by {' and '.join(said[d] for d in self.drivers)} at the kernels' measured "
                f"rates, with compute {self.compute_share:.0%} of the step")

    def to_dict(self) -> dict[str, Any]:
        return {"mfu": round(self.mfu, 5), "best_published": self.best, "source": self.source,
                "drivers": self.drivers, "compute_share": round(self.compute_share, 4),
                "gemm_rate": round(self.gemm, 4), "attention_rate": None if self.attention is None
                else round(self.attention, 4)}


def mfu_check(ev: Evaluation, model: ModelSpec, cluster: ClusterSpec) -> AboveMeasured | None:
    """The plan's MFU against the best published on its GPU and compute dtype, or None when it is not
    above it (or no run on that GPU and dtype is known, or the cluster mixes GPUs)."""
    gpus = {p.gpu.name for p in cluster.pools}
    plan = ev.plan
    dtype = "fp8" if plan.fp8 != "none" else model.training.recipe().compute_dtype
    gpu = cluster.pools[0].gpu
    best = getattr(gpu.best_published_mfu, dtype, None) if gpu.best_published_mfu is not None else None
    if len(gpus) > 1 or best is None or ev.mfu <= best:
        return None
    gemm, attention = kernel_rates(model, cluster, ev)
    source = gpu.sources.get("best_published_mfu", "development set").split(":")[0]  # the profile names the run first
    return AboveMeasured(ev.mfu, float(best), source, gpu.name, dtype, ev.time["compute"] / ev.step_time_s, gemm,
                         attention)


def kernel_rates(model: ModelSpec, cluster: ClusterSpec, ev: Evaluation) -> tuple[float, float | None]:
    """The plan's GEMMs' and attention's rates as MFU counts them: each class's model FLOPs over its
    seconds per micro-batch (forward and backward, :mod:`autoplace.cost.compute`), as a share of the
    compute dtype's dense peak, over every block of the model."""
    from autoplace.cost.compute import gemms_forward
    from autoplace.cost.hardware import kernels_of
    from autoplace.cost.layers import layer_table

    plan, table = ev.plan, layer_table(model)
    gpu = cluster.pools[0].gpu
    dtype = "fp8" if plan.fp8 != "none" else model.training.recipe().compute_dtype
    kern = kernels_of(gpu, dtype)
    peak = gpu.peak_TFLOPS.for_dtype(dtype) * 1e12
    tokens = np.array([[plan.mbs * table.seq_len / plan.cp]])
    tp, ep = np.array([[float(plan.tp)]]), float(plan.ep)
    counts = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds))
    gemm_flops = gemm_s = attn_flops = attn_s = 0.0
    for n, k in zip(counts, table.kinds, strict=True):
        gemm_flops += n * 3 * (k.flops - k.flops_score) * float(tokens[0, 0]) / plan.tp
        gemm_s += n * 3 * float(gemms_forward(kern, k.gemms, tokens, tp, ep, 1.0 if dtype == "fp8" else 2.0).ravel()[0])
        if k.flops_score and k.flash:
            score = tokens * k.flops_score / plan.tp
            fwd, bwd = kern.attention(score, np.array([[table.seq_len / plan.cp]]), head_dim=k.head_dim)
            attn_flops += n * 3 * float(score[0, 0])  # forward and twice it backward, as MFU counts them
            attn_s += n * float(fwd.ravel()[0] + bwd.ravel()[0])
    return gemm_flops / gemm_s / peak, (attn_flops / attn_s / peak if attn_s else None)
