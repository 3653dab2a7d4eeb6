"""Rank the search's plans robustly among those the model cannot tell apart (issue 25, item 4).

The cost model predicts a step time to within a 95% band (``solving.step_band``: the
calibration's, else the development set's error on the cluster's GPU), and orders two plans
reliably only when their predictions differ by more than :data:`PAIR_RESOLUTION`.  Among plans
closer to the fastest than that (and than the band) the plan with fewer *moving parts*
(:func:`moving_parts`) goes first: the parts are what the prediction models least well and what
most often breaks or needs tuning in a real run.

``--rank robust`` (the default) orders the plans the search returns like this:

1. the plans predicted within :func:`tolerance` of the fastest (``t <= t_fastest * tolerance``:
   the band's upper factor, at most :data:`PAIR_RESOLUTION` above 1) come first, ordered by
   their number of moving parts, then step time;
2. the other plans follow, ordered by step time;
3. ties are broken by the communication bytes per step (the search's own second key), then the
   full plan string, so the order never depends on the order the search found them in.

A plan outside the band never goes ahead of one inside it, and when two or more plans are asked
for the fastest is always among them (it takes the last place if it would fall off), so the
output can say what the choice costs.  ``--rank fastest`` orders by step time alone (same ties).
Only the ``time`` objective (and ``cost``, which ranks by time on a fixed cluster) is re-ranked;
``comm`` and ``memory`` keep the search's order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from autoplace.cost.comm import members_per_domain
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec, TransformerSpec
from solvers.problem import SolveResult

# The predicted gap below which the cost model does not order two plans reliably.  Over the
# development set's pairs (two runs of one model on one cluster, benchmarks/published.py prints
# "pairs by predicted gap"), the predicted order is the measured one for 91 of the 95 pairs whose
# predictions differ by 3% or more and for 4 of the 6 closer ones; at 8% or more, 80 of 82.  A
# plan's own 95% band (about +-16% on H100) bounds its absolute error, not how two plans compare:
# re-ranking inside it put plans 10% slower first (DeepSeek-V3 on 256 H100: +11.6% for one
# parallel dimension less).  The tolerance is the smaller of this and the band (a calibration's
# band may be narrower).
PAIR_RESOLUTION = 0.03

RANKS = ("robust", "fastest")
DEFAULT_RANK = "robust"
MAX_DEPTH = 20  # the search's widest single pass returns 20 plans (frameworks.search.solve_for)


@dataclass(frozen=True)
class Part:
    """One moving part of a plan: ``key`` (unique per plan), ``label`` for "needs no ...", ``why``."""

    key: str
    label: str
    why: str


def cp_chunk_floor(model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> float:
    """Tokens per context-parallel rank below which ring attention cannot hide its K/V exchange.

    Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers",
    Sec. 3 and Table 2) overlaps passing a block of K/V with computing attention on the previous
    one when the block of ``c`` tokens satisfies ``c >= F / B``: F the device's peak FLOP/s,
    B the per-direction bandwidth of the link the ring uses (e.g. ~1K tokens for A100 on
    NVLink, ~25K over 100 Gb/s InfiniBand).  That bound is derived for K and V as wide as the
    hidden size (4cd bytes against 4c^2 d FLOPs); a grouped-query model sends only
    ``kv_heads / heads`` of that, which lowers the floor by the same factor.  Causal masking
    (half the score blocks computed on average, Brandon et al. 2023 "Striped Attention")
    doubles it.  F is the peak for the model's compute dtype; B the slowest pool's intra-node
    link when the ring stays in one NVLink domain, else its inter-node link.
    """
    dtype = model.training.recipe().compute_dtype
    flops = max(p.gpu.peak_TFLOPS.for_dtype(dtype) for p in cluster.pools) * 1e12
    inside = int(members_per_domain(np.array(plan.cp), np.array(plan.tp), cluster.nvlink_domain))
    link = min((p.intra_node if inside == plan.cp else p.inter_node for p in cluster.pools),
               key=lambda lk: lk.bytes_per_s)
    kv_share = 1.0  # MLA and layer graphs: K/V as wide as the heads (MLA sends them decompressed)
    if isinstance(model, TransformerSpec) and model.attention is None:
        kv_share = model.n_kv_heads / model.heads
    return 2.0 * flops / link.bytes_per_s * kv_share


def moving_parts(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> tuple[Part, ...]:
    """The plan's moving parts, each with why it costs.  Its complexity is how many there are.

    Data parallelism is the baseline every plan has and is not counted.  Each of these is:

    - ``offload_optimizer`` / ``offload_params`` (cpu or nvme): states live on the host or
      disk; pinned host memory, PCIe traffic and the CPU optimizer step (ZeRO-Offload, Ren et
      al. 2021) are timed only approximately, and host memory is shared with the data loader.
    - ``tp``: tensor parallelism; collectives inside every layer (Shoeybi et al. 2019), a model
      split by hand or by the framework's TP plan.
    - ``tp_cross_node``: the TP group leaves the NVLink domain, so those per-layer collectives
      run on the inter-node network (Narayanan et al. 2021 Sec. 3.3 keep TP within a node).
    - ``pp``: pipeline parallelism; a layer split, a schedule and its bubble, stages that must
      balance (Huang et al. 2019; Narayanan et al. 2021).
    - ``vpp``: interleaved stages; more point-to-point messages and a stricter batch divisibility.
    - ``cp``: context parallelism; ring attention's K/V exchange and load-balanced sequence chunks.
    - ``cp_short``: context parallelism on chunks below :func:`cp_chunk_floor`, where its
      exchange cannot hide behind attention: cp below the sequence length where it pays.
    - ``ep``: expert parallelism; token all-to-alls whose cost follows the routing balance.
    - ``hsdp``: sharded *and* replicated data parallelism; two group shapes to tune.
    - ``compress``: lossy gradient or weight communication (an accuracy risk to check).
    - ``fp8``: 8-bit GEMMs (numerics to check against a bf16 run, Micikevicius et al. 2022).
    """
    parts: list[Part] = []
    for what, where in (("optimizer", plan.offload_optimizer), ("params", plan.offload_params)):
        if where != "none":
            device = "CPU" if where == "cpu" else "NVMe"
            name = "optimizer" if what == "optimizer" else "parameter"
            parts.append(Part(f"offload_{what}", f"{device} {name} offload",
                              f"{what} offloaded to {where}: host memory, PCIe copies and a host-side step "
                              "the model times only approximately"))
    if plan.tp > 1:
        parts.append(Part("tp", "tensor parallelism", f"tp={plan.tp}: collectives inside every layer"))
        inside = int(members_per_domain(np.array(plan.tp), np.array(1), cluster.nvlink_domain))
        if inside < plan.tp:
            parts.append(Part("tp_cross_node", "cross-node tensor parallelism",
                              f"the tp={plan.tp} group spans {plan.tp // inside} NVLink domains: per-layer "
                              "collectives on the inter-node network"))
    if plan.pp > 1:
        parts.append(Part("pp", "pipeline parallelism", f"pp={plan.pp}: a layer split, a schedule and its bubble"))
    if plan.vpp > 1:
        parts.append(Part("vpp", "interleaved pipeline stages",
                          f"vpp={plan.vpp}: more send/recv per step and a stricter batch divisibility"))
    if plan.cp > 1:
        parts.append(Part("cp", "context parallelism", f"cp={plan.cp}: ring attention over the sequence"))
        chunk, floor = model.seq_len / plan.cp, cp_chunk_floor(model, cluster, plan)
        if chunk < floor:
            parts.append(Part("cp_short", f"context parallelism on {chunk:,.0f}-token chunks",
                              f"cp={plan.cp} leaves {chunk:,.0f} tokens per rank, below the {floor:,.0f} at which "
                              "ring attention hides its K/V exchange (Liu et al. 2023)"))
    if plan.ep > 1:
        parts.append(Part("ep", "expert parallelism", f"ep={plan.ep}: token all-to-alls that follow the routing"))
    if plan.dp_replicate > 1 and plan.dp_shard > 1:
        parts.append(Part("hsdp", "hybrid sharding", f"{plan.dp_replicate} replicas x {plan.dp_shard} shards: "
                          "two data-parallel group shapes"))
    if plan.compress != "none":
        parts.append(Part("compress", f"{plan.compress} compression", f"compress={plan.compress}: lossy "
                          "communication, an accuracy risk to check"))
    if plan.fp8 != "none":
        parts.append(Part("fp8", "fp8 GEMMs", f"fp8={plan.fp8}: 8-bit GEMM numerics to check against bf16"))
    return tuple(parts)


class Item(NamedTuple):
    """What the order looks at for one plan."""

    step_time_s: float
    comm_bytes: float
    text: str  # the full plan string: the last tie-break
    complexity: int


def time_key(item: Item) -> tuple[float, float, str]:
    """Step time, then bytes moved, then the plan string."""
    return item.step_time_s, item.comm_bytes, item.text


def in_band(item: Item, fastest: Item, band_high: float) -> bool:
    """Whether ``item``'s predicted step time is within the 95% band above the fastest's."""
    return item.step_time_s <= fastest.step_time_s * band_high


def order(items: Sequence[Item], band_high: float, rank: str) -> list[int]:
    """Indices of ``items`` in ranked order (the module docstring's rules)."""
    by_time = sorted(range(len(items)), key=lambda i: time_key(items[i]))
    if rank == "fastest" or not items:
        return by_time
    fastest = items[by_time[0]]
    inside = [i for i in by_time if in_band(items[i], fastest, band_high)]
    outside = [i for i in by_time if not in_band(items[i], fastest, band_high)]
    return sorted(inside, key=lambda i: (items[i].complexity, *time_key(items[i]))) + outside


def keep(ranked: Sequence[int], fastest: int, top: int) -> list[int]:
    """The first ``top`` of ``ranked``, the fastest in the last place when it would fall off (top >= 2)."""
    shown = list(ranked[:top])
    if top >= 2 and fastest not in shown:
        shown[-1] = fastest
    return shown


EXTRA = 2  # plans asked for beyond --top when ranking robustly


def depth(top: int, rank: str) -> int:
    """How many plans to ask the search for: ``EXTRA`` more than ``top`` when ranking robustly, so a
    simpler plan just below the first ``top`` can be found.  Few more: the search's first pass looks
    at 2x the plans asked for (at most 20) anyway, but it searches deeper, within the time limit,
    while fewer than that many runnable plans are found (frameworks.search.solve_for)."""
    return top if rank == "fastest" else max(top, min(top + EXTRA, MAX_DEPTH))


@dataclass(frozen=True)
class Ranked(SolveResult):
    """A SolveResult whose plans were ranked, with ``ranking``: what the JSON and the output say."""

    ranking: dict[str, Any] = field(default_factory=dict)


def rerank(result: SolveResult, model: ModelSpec, cluster: ClusterSpec, band: tuple[float, float], top: int,
           rank: str, *, what: str = "plan 1") -> Ranked:
    """``result`` with its plans ranked by ``rank`` and cut to ``top``, and the ranking recorded.

    Args:
        model, cluster: the costed model and the cluster (for :func:`moving_parts`).
        band: the 95% band of a predicted step time as factors (low, high).
        what: how the output line names the first plan.
    """
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(SolveResult)}
    if not result.plans:
        return Ranked(**fields, ranking={"mode": rank, "reordered": False, "note": None, "plans": []})
    mode = rank if result.objective == "time" else "objective"  # comm, memory: not re-ranked
    parts = [moving_parts(ev.plan, model, cluster) for ev in result.plans]
    items = [Item(ev.step_time_s, ev.comm["total"], ev.plan.to_string(), len(p))
             for ev, p in zip(result.plans, parts, strict=True)]
    fastest = min(range(len(items)), key=lambda i: time_key(items[i]))
    if result.objective != "time":  # comm, memory: the search's own order
        shown = list(range(min(top, len(items))))
    else:
        shown = keep(order(items, tolerance(band), mode), fastest, top)
    fields["notes"] = _asked(result.notes, len(result.plans), top)
    plans = [result.plans[i] for i in shown]
    ranking = summary(items, parts, shown, fastest, band, mode, what)
    return Ranked(**{**fields, "plans": plans}, ranking=ranking)


def tolerance(band: tuple[float, float]) -> float:
    """How much slower than the fastest a plan may be and still count as tied with it (a
    factor): the band's upper factor, at most ``1 + PAIR_RESOLUTION``."""
    return min(band[1], 1.0 + PAIR_RESOLUTION)


def _asked(notes: Sequence[str], found: int, top: int) -> list[str]:
    """The search's notes with its "n of the K plans asked for" about the user's ``top``, not the
    deeper list :func:`depth` asked for (dropped when ``top`` plans were found)."""
    if found >= top:
        return [n for n in notes if " plans asked for: " not in n]
    return [re.sub(r" of the \d+ plans asked for: ", f" of the {top} plans asked for: ", n) for n in notes]


def summary(items: Sequence[Item], parts: Sequence[Sequence[Part]], shown: Sequence[int], fastest: int,
            band: tuple[float, float], mode: str, what: str = "plan 1") -> dict[str, Any]:
    """The ranking as JSON: mode, band, the fastest plan's time (and its place, or None when not
    shown), whether the order differs from time order, the output line, each shown plan's parts."""
    first = shown[0]
    reordered = mode == "robust" and first != fastest
    place = shown.index(fastest) + 1 if fastest in shown else None
    note = None
    if reordered:
        slower = items[first].step_time_s / items[fastest].step_time_s - 1
        missing = [p.label for p in parts[fastest] if p.key not in {q.key for q in parts[first]}]
        where = f"plan {place}" if place else "--rank fastest picks it"
        note = (f"{what} is {slower:.1%} slower than the fastest ({where}), within what the model tells apart "
                f"(+{tolerance(band) - 1:.1%}), and needs no {' and no '.join(missing)} "
                f"({_parts(len(parts[first]))} against {len(parts[fastest])})")
    return {"mode": mode, "band_95": [band[0], band[1]], "tolerance": tolerance(band), "fastest_step_time_s": items[fastest].step_time_s,
            "fastest_rank": place, "fastest_plan": items[fastest].text, "reordered": reordered, "note": note,
            "plans": [{"complexity": len(parts[i]), "moving_parts": [{"part": p.key, "why": p.why} for p in parts[i]],
                       "slower_than_fastest": items[i].step_time_s / items[fastest].step_time_s - 1} for i in shown]}


def _parts(n: int) -> str:
    return f"{n} moving part" + ("" if n == 1 else "s")


def annotate(doc: dict[str, Any], ranking: dict[str, Any]) -> None:
    """Record ``ranking`` in a solution document: ``doc["ranking"]`` and each plan's complexity,
    moving parts and how much slower than the fastest it is."""
    for plan, extra in zip(doc["plans"], ranking.get("plans", []), strict=False):
        plan.update(extra)
    doc["ranking"] = {k: v for k, v in ranking.items() if k != "plans"}
