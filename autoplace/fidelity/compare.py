"""autoplace's prediction for the plan a tracker run measured, and the comparison row by row."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from autoplace.cost.layers import layer_table
from autoplace.evaluation import Evaluation, evaluate
from autoplace.fidelity.trackers import Measurement, Setup, measure
from autoplace.specs.cluster import ClusterSpec, cluster_from_dict
from autoplace.specs.model import TransformerSpec

log = logging.getLogger("autoplace")

def tracker_spec(spec: TransformerSpec, setup: Setup) -> TransformerSpec:
    """``spec`` with the training settings of ``setup``: precision, AdamW, one micro-batch per rank."""
    data = spec.model_dump(exclude_none=True)
    data["training"] = {"global_batch": setup.mbs * setup.world // setup.tp, "precision": setup.precision,
                        "optimizer": "adamw", "method": spec.training.method,
                        "lora": spec.training.lora.model_dump()}
    return TransformerSpec.model_validate(data)


def fidelity_cluster(world: int) -> ClusterSpec:
    """A cluster the plan runs on; only memory and bytes are compared, never seconds."""
    per_node = min(world, 8)
    return cluster_from_dict({"name": f"fidelity-{world}", "nodes": max(1, world // per_node), "gpus_per_node": per_node,
                              "gpu": "a100-sxm4-80gb", "intra_node": "nvlink3", "inter_node": "ib-hdr"})


def predict(spec: TransformerSpec, setup: Setup) -> Evaluation:
    """autoplace's evaluation of the plan ``setup`` runs (reshard True: ZeRO-3; False: ZeRO-2)."""
    return evaluate(tracker_spec(spec, setup), fidelity_cluster(setup.world), setup.plan(spec))


@dataclass(frozen=True)
class Row:
    """One compared quantity: autoplace's number, the measured one, and how they were matched."""

    quantity: str
    predicted: float
    measured: float
    note: str = ""

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted - measured) / measured."""
        if not self.measured:
            return 0.0 if not self.predicted else math.inf
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Comparison:
    """Rows of one model under one setup, with the raw measurement and evaluation behind them."""

    setup: Setup
    spec: TransformerSpec
    rows: list[Row]
    measurement: Measurement
    evaluation: Evaluation

    def row(self, quantity: str) -> Row:
        for r in self.rows:
            if r.quantity == quantity:
                return r
        raise KeyError(f"no row {quantity!r}; rows: {', '.join(r.quantity for r in self.rows)}")


def predicted_dp_collectives(spec: TransformerSpec, setup: Setup) -> dict[str, float]:
    """autoplace's ``comm["dp"]`` split by group and collective ("dp all_gather", "edp
    reduce_scatter", ...), from the formulas it implements (ZeRO paper Sec. 7;
    ``terms.stage_terms`` and ``terms._dp_terms``): ZeRO-3 gathers the blocks twice and the
    root (embedding, final norm, head: kept gathered until backward) once, and
    reduce-scatters the gradients once per micro-batch; ZeRO-2 gathers once per step; HSDP
    all-reduces the gradient shards over the replicas.  With ep > 1 the experts' ``1/ep``
    share moves over the expert-data-parallel group ``edp`` (dp/ep ranks), the rest over
    dp.  Bytes sent per device by the ring: (n-1)/n of the full buffer, 2(n-1)/n for
    all-reduce.  ``compare`` checks that the parts add up to ``comm["dp"]``."""
    recipe = tracker_spec(spec, setup).training.recipe()
    t = layer_table(spec)
    head_tp = 0.0 if t.tied else t.head.params_tp  # a tied head is the embedding table, counted once
    tp_local = sum(k.params_tp for k in (t.kinds[i] for i in t.sequence)) + t.embed.params_tp + head_tp
    experts = sum(t.kinds[i].params_expert for i in t.sequence) if setup.ep > 1 else 0.0
    psi = tp_local / setup.tp + (t.params - tp_local) - experts
    n, r = setup.dp_shard, setup.dp_replicate
    root = (t.embed.params_tp + head_tp) / setup.tp + t.embed.params_rep + t.head.params_rep
    adapters = t.trainable / setup.tp if t.frozen else 0.0  # gathered with the base they sit beside
    gathered = (2 * (psi + adapters) - (0.0 if setup.root_reshard else root)) if setup.reshard else psi + adapters
    # a frozen base is gathered like any weight but only the adapters' gradients are reduced
    # (their count over TP taken as its split of the whole: the adapters of one rank, tp = 1)
    reduced = t.trainable / setup.tp if t.frozen else psi
    if t.frozen and spec.training.method == "qlora":
        log.warning("the collective split counts a QLoRA base's gathers at the recipe's bytes, not NF4's")
    out = {"dp all_gather": gathered * recipe.gather_bytes * (n - 1) / n,
           "dp reduce_scatter": reduced * recipe.reduce_bytes * (n - 1) / n}
    if r > 1:
        out["dp all_reduce"] = 2 * (r - 1) / r * reduced * recipe.reduce_bytes / n
    if setup.ep > 1:
        m, local = n // setup.ep, experts / setup.ep
        out["edp all_gather"] = (2 if setup.reshard else 1) * local * recipe.gather_bytes * (m - 1) / m
        out["edp reduce_scatter"] = local * recipe.reduce_bytes * (m - 1) / m
    return out


DP_GROUPS = {"dp": ("dp_shard", "dp_replicate"), "edp": ("edp",)}  # row prefix -> mesh dimensions


def _collective_rows(pred: dict[str, float], ev: Evaluation, m: Measurement, setup: Setup) -> list[Row]:
    """Predicted against counted bytes: each data-parallel collective by group, their sum
    against ``comm["dp"]``, and ``comm["tp"]`` / ``comm["ep"]`` when those dimensions exist."""
    rows = []
    for group, dims in DP_GROUPS.items():
        kinds = {q.split()[1] for q in pred if q.split()[0] == group} | {k for d, k in m.collectives if d in dims}
        for kind in sorted(kinds):
            got = [c for (d, k), c in m.collectives.items() if k == kind and d in dims]
            rows.append(Row(f"{group} {kind}", pred.get(f"{group} {kind}", 0.0), sum(c.ring_bytes for c in got),
                            f"{sum(c.calls for c in got)} calls"))
    all_dp = [d for dims in DP_GROUPS.values() for d in dims]
    rows.append(Row("comm dp", ev.comm["dp"], sum(c.ring_bytes for (d, k), c in m.collectives.items() if d in all_dp),
                    "comm['dp'] vs counted ring bytes sent" + (" (dp + edp)" if setup.ep > 1 else "")))
    for dim, on in (("tp", setup.tp > 1), ("ep", setup.ep > 1)):
        if on:
            got = [c for (d, k), c in m.collectives.items() if d == dim]
            names = sorted({k for d, k in m.collectives if d == dim})
            rows.append(Row(f"comm {dim}", ev.comm[dim], sum(c.ring_bytes for c in got),
                            f"{sum(c.calls for c in got)} calls ({', '.join(names)})"))
    return rows


def compare(spec: TransformerSpec, setup: Setup) -> Comparison:
    """Measure ``setup`` and set autoplace's prediction beside it, state by state."""
    m = measure(spec, setup)
    ev = predict(spec, setup)
    mem, states, at_peak, cat, fwd = ev.memory, ev.model_states, m.peak, m.category_peak, m.after_forward
    params = cat.get("Sharded Param", 0.0) + (0.0 if setup.reshard else fwd.get("Unsharded Param", 0.0))
    rows = [Row("params", states["params"], params,
                "sharded" if setup.reshard else "sharded + gathered (ZeRO-2 keeps gathered params)"),
            Row("grads", states["grads"], cat.get("Sharded Grad", 0.0), "sharded grads"),
            Row("optimizer", states["optimizer"], fwd.get("OptState", 0.0), "AdamW exp_avg, exp_avg_sq, step (resident)")]
    rows.append(Row("model states", sum(r.predicted for r in rows), sum(r.measured for r in rows)))
    rows.append(Row("activations kept", mem["activations"], fwd.get("Activation", 0.0),
                    "Activation category once the loss exists"))
    rows.append(Row("activations peak", mem["activations"], cat.get("Activation", 0.0),
                    "Activation category at its own maximum (logits transients)"))
    gathered = sum(at_peak.get(k, 0.0) for k in ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"))
    if setup.reshard:
        rows.append(Row("buffers", mem["buffers"], gathered, "unsharded params/grads + AG/RS buffers at the peak"))
    else:
        rows.append(Row("buffers", mem["buffers"], gathered - fwd.get("Unsharded Param", 0.0),
                        "unsharded grads + AG/RS buffers at the peak"))
    rows.append(Row("peak", mem["total"] - mem["reserve"], at_peak.get("Total", 0.0),
                    "tracker total peak vs autoplace total minus reserve"))
    pred = predicted_dp_collectives(spec, setup)
    if abs(sum(pred.values()) - ev.comm["dp"]) > 1e-6 * max(ev.comm["dp"], 1.0):
        log.warning("the collective split %s does not add up to comm['dp'] = %s", pred, ev.comm["dp"])
    rows += _collective_rows(pred, ev, m, setup)
    return Comparison(setup=setup, spec=spec, rows=rows, measurement=m, evaluation=ev)

