"""Where every GB and every second goes, beside the alternatives that change the most.

``autoplace explain`` scores the plan, then its neighbours -- one knob changed at a time
(ZeRO level, recompute, micro-batch, a factor of two moved between tp/pp and dp, optimizer
offload, compression) -- and shows the few that move the step time or the peak memory most.
:func:`compression_hint` tells a solve that did not search compression what it would buy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplace.compression import CHOICES, COMPRESSIONS, applies, label
from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.cost.layers import layer_table
from autoplace.errors import AutoplaceError
from autoplace.evaluation import Evaluation, evaluate
from autoplace.plan import Plan, build_plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

GiB = 2**30
MEMORY = ("params", "grads", "optimizer", "activations", "buffers", "reserve")


@dataclass(frozen=True)
class Alternative:
    """One neighbouring plan: what changed and how it scores."""

    change: str
    evaluation: Evaluation


def plan_values(plan: Plan) -> dict[str, Any]:
    """The ``--plan`` keys that rebuild ``plan`` (for changing one of them)."""
    values: dict[str, Any] = {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp,
                              "pp": plan.pp, "cp": plan.cp, "ep": plan.ep, "vpp": plan.vpp, "sp": plan.sp,
                              "zero": plan.zero, "mbs": plan.mbs, "schedule": plan.schedule,
                              "offload_optimizer": plan.offload_optimizer, "offload_params": plan.offload_params,
                              "compress": plan.compress, "powersgd_rank": plan.powersgd_rank or None,
                              **plan.recipe()}
    if plan.recompute_mode == "mixed":
        values["recompute_layers"] = ":".join(r[0] for r in plan.recompute)
    else:
        values["recompute"] = plan.recompute_mode
    return values


def _neighbours(plan: Plan) -> list[tuple[str, dict[str, Any]]]:
    base = plan_values(plan)
    base.pop("recompute_layers", None)
    dp = plan.dp
    out: list[tuple[str, dict[str, Any]]] = []
    for zero in range(4):
        if zero != plan.zero:
            out.append((f"zero {plan.zero} -> {zero}", {**base, "zero": zero, "dp": dp, "dp_replicate": None,
                                                         "dp_shard": None}))
    for mode in ("none", "selective", "full"):
        if mode != plan.recompute_mode:
            out.append((f"recompute {plan.recompute_mode} -> {mode}", {**base, "recompute": mode}))
    for mbs in (plan.mbs * 2, plan.mbs // 2):
        if mbs >= 1:
            out.append((f"micro-batch {plan.mbs} -> {mbs}", {**base, "mbs": mbs}))
    for key in ("tp", "pp"):
        for new in (getattr(plan, key) * 2, getattr(plan, key) // 2):
            if new >= 1 and (dp * getattr(plan, key)) % new == 0:
                out.append((f"{key} {getattr(plan, key)} -> {new}", {**base, key: new, "dp": dp * getattr(plan, key) // new,
                                                                      "dp_replicate": None, "dp_shard": None,
                                                                      "vpp": 1 if key == "pp" else plan.vpp,
                                                                      "schedule": "1f1b" if key == "pp" else plan.schedule,
                                                                      "sp": new > 1 if key == "tp" else plan.sp}))
    if plan.zero >= 1:
        other = "none" if plan.offload_optimizer != "none" else "cpu"
        out.append((f"optimizer offload {plan.offload_optimizer} -> {other}", {**base, "offload_optimizer": other}))
    for name, rank in CHOICES:
        if (name, rank) != (plan.compress, plan.powersgd_rank):
            out.append((f"compress {plan.compress} -> {label(name, rank)}",
                        {**base, "compress": name, "powersgd_rank": rank or None}))
    return out + _recipe_neighbours(plan, base)


def _recipe_neighbours(plan: Plan, base: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each recipe key changed alone: the booleans flipped, TP overlap on or off (where tp > 1);
    fp8 is left to the user (it changes the numerics, and needs fp8 units)."""
    out = [(f"{key} {str(getattr(plan, key)).lower()} -> {str(not getattr(plan, key)).lower()}",
            {**base, key: not getattr(plan, key)}) for key in ("compile", "fused_loss", "overlap")]
    if plan.tp > 1:
        other = "none" if plan.tp_overlap != "none" else "async"
        out.append((f"tp_overlap {plan.tp_overlap} -> {other}", {**base, "tp_overlap": other}))
    return out


def _compressed_twin(plan: Plan, name: str, rank: int) -> Plan:
    """``plan`` with compression ``name``, moved to the sharding the option needs (ZeRO++: ZeRO-3
    over the whole data-parallel group; PowerSGD: DDP), everything else kept."""
    twin = dataclasses.replace(plan, compress=name, powersgd_rank=rank)
    if name == "zeropp":  # over the whole data-parallel group: DeepSpeed has no HSDP beside hpZ
        twin = dataclasses.replace(twin, zero=3, dp_shard=plan.dp, dp_replicate=1)
    if name == "powersgd" and plan.zero != 0:
        twin = dataclasses.replace(twin, zero=0, dp_shard=1, dp_replicate=plan.dp, offload_optimizer="none",
                                   offload_params="none")
    return twin


HINT_GAIN = 0.01  # the least share of the step a compression hint must save: below it, not worth its accuracy risk


def compression_hint(model: ModelSpec, cluster: ClusterSpec, best: Evaluation,
                     assume: Assumptions = DEFAULT) -> str | None:
    """For a solve that did not search compression: the option that would shorten ``best``'s step
    most (the same plan, at the ZeRO level the option needs), or None when none would save at
    least ``HINT_GAIN`` of it."""
    if best.plan.compress != "none":
        return None
    reduce_bytes = model.training.recipe().reduce_bytes
    twins = [_compressed_twin(best.plan, name, rank) for name, rank in CHOICES[1:]]
    scored = [evaluate(model, cluster, twin, assume) for twin in twins if applies(twin, reduce_bytes)]
    faster = [ev for ev in scored if ev.fits and not ev.violations
              and ev.step_time_s < (1 - HINT_GAIN) * best.step_time_s]
    if not faster:
        return None
    ev = min(faster, key=lambda e: e.step_time_s)
    option = COMPRESSIONS[ev.plan.compress]
    moved = (ev.plan.zero, ev.plan.dp_shard) != (best.plan.zero, best.plan.dp_shard)
    zero = f" at zero={ev.plan.zero}, dp_shard={ev.plan.dp_shard}" if moved else ""
    return (f"compression was not searched (--allow compress): {label(option.name, ev.plan.powersgd_rank)}{zero} would take the best plan from "
            f"{best.step_time_s:.3f} s to {ev.step_time_s:.3f} s ({ev.step_time_s / best.step_time_s - 1:+.1%}); "
            f"accuracy risk {option.risk.split(':')[0]}")


def alternatives(model: ModelSpec, cluster: ClusterSpec, plan: Plan, current: Evaluation,
                 count: int = 3, assumptions: Assumptions = DEFAULT, *, allow_tp_across_nodes: bool = False
                 ) -> list[Alternative]:
    """The ``count`` neighbours whose step time or peak memory differs most from the plan's
    (scored with the same ``assumptions`` and rules as the plan).  A recipe key the model file
    pins (``training.recipe``) is not changed, as a search never changes it."""
    table = layer_table(model)
    pins = model.training.recipe_pins.values()
    scored = []
    for change, values in _neighbours(plan):
        values = {k: v for k, v in values.items() if v is not None}
        if any(values.get(k) != v for k, v in pins.items()):
            continue
        try:
            alt = build_plan(values, world=cluster.gpus, blocks=table.blocks, global_batch=model.training.global_batch,
                             gpus_per_node=cluster.gpus_per_node)
            ev = evaluate(model, cluster, alt, assumptions, allow_tp_across_nodes=allow_tp_across_nodes)
        except AutoplaceError:
            continue  # the change cannot make a plan here (batch, shapes)
        if any(v.rule != "out-of-memory" for v in ev.violations):
            continue
        shift = max(abs(ev.step_time_s / current.step_time_s - 1),
                    abs(ev.memory["total"] / current.memory["total"] - 1))
        scored.append((shift, Alternative(change, ev)))
    scored.sort(key=lambda x: -x[0])
    return [alt for _, alt in scored[:count]]


def plot(current: Evaluation, alts: list[Alternative], path: Path) -> Path:
    """A stacked bar of memory per stage (with capacity) and of the step time's parts, for the
    plan and its alternatives, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(13, 5))
    stages = current.memory_per_stage
    bottom = [0.0] * len(stages)
    for part in MEMORY:
        values = [s[part] / GiB for s in stages]
        ax_mem.bar(range(len(stages)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_mem.axhline(stages[0]["capacity"] / GiB, color="black", linestyle="--", label="capacity")
    ax_mem.set_xticks(range(len(stages)))
    ax_mem.set(title="Memory per device by stage", xlabel="pipeline stage", ylabel="GiB")
    ax_mem.legend(fontsize=8)
    rows = [("plan", current)] + [(a.change, a.evaluation) for a in alts]
    parts = [k for k in current.time if any(ev.time[k] for _, ev in rows)]
    left = [0.0] * len(rows)
    for part in parts:
        values = [ev.time[part] for _, ev in rows]
        ax_time.barh(range(len(rows)), values, left=left, label=part)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax_time.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax_time.invert_yaxis()
    ax_time.set(title="Step time by part", xlabel="seconds")
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # --png: PNG whatever the name ends in
    plt.close(fig)
    return path


def print_explanation(current: Evaluation, alts: list[Alternative], cluster: ClusterSpec, png: Path | None,
                      *, fmt: str = "table", header: Sequence[str] = ()) -> None:
    """The evaluation's tables, then the alternatives with their deltas (as table, markdown or csv)."""
    from autoplace.report import Section, evaluation_sections, render

    sections, lines = evaluation_sections(current, cluster)
    rows = [(alt.change, f"{alt.evaluation.step_time_s:.3f}",
             f"{alt.evaluation.step_time_s / current.step_time_s - 1:+.1%}",
             f"{alt.evaluation.memory['total'] / GiB:.1f}",
             f"{alt.evaluation.memory['total'] / current.memory['total'] - 1:+.1%}",
             "yes" if alt.evaluation.fits else "no") for alt in alts]
    sections.append(Section("Alternatives that change the most (one knob each)",
                            ("change", "step s", "step vs plan", "peak GiB", "peak vs plan", "fits"), rows,
                            right=frozenset({"step s", "step vs plan", "peak GiB", "peak vs plan", "fits"})))
    render(sections, lines + ([f"chart: {png}"] if png is not None else []), fmt, header=header)
