"""Readable output: rich tables of an evaluation (what ``autoplace evaluate`` prints)."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from autoplace.cost.comm import members_per_node
from autoplace.cost.context import group_layout
from autoplace.evaluation import Evaluation
from autoplace.specs.cluster import ClusterSpec

GiB = 2**30

# dimension -> (collective, group key used for its tier)
_COLLECTIVES = {
    "dp": ("grad reduce / param gather", "dp"),
    "tp": ("all-reduce / SP gather+scatter", "tp"),
    "pp": ("send/recv", "pp"),
    "cp": ("ring send/recv of K,V", "cp"),
    "ep": ("all-to-all", "ep"),
    "offload": ("host <-> device copies", ""),
}


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def tiers(ev: Evaluation, cluster: ClusterSpec) -> dict[str, str]:
    """Which link tiers each dimension's groups use, e.g. ``nvlink4 x8`` or ``nvlink4 x8 + ib-ndr x4``."""
    p = ev.plan
    groups = group_layout(*(np.array([x]) for x in (p.tp, p.cp, p.ep, p.dp_shard, p.dp_replicate, p.pp)))
    pool = cluster.pools[0]
    out = {}
    for dim, (_, key) in _COLLECTIVES.items():
        if not key:
            out[dim] = pool.host_link.name
            continue
        size, stride = (int(x[0]) for x in groups[key])
        if size == 1:
            out[dim] = "-"
            continue
        inside = int(members_per_node(np.array(size), np.array(stride), cluster.gpus_per_node))
        if dim == "pp":
            out[dim] = f"{pool.inter_node.name if stride >= cluster.gpus_per_node else pool.intra_node.name} x{size}"
        elif inside == size:
            out[dim] = f"{pool.intra_node.name} x{size}"
        elif inside == 1:
            out[dim] = f"{pool.inter_node.name} x{size}"
        else:
            out[dim] = f"{pool.intra_node.name} x{inside} + {pool.inter_node.name} x{size // inside}"
    return out


def print_evaluation(ev: Evaluation, cluster: ClusterSpec, console: Console | None = None) -> None:
    """Memory against capacity, communication by dimension and tier, and the time split."""
    console = console or Console()
    p = ev.plan
    console.print(f"[bold]plan[/bold] {p.to_string()}")
    mem = Table(title=f"Memory per device, GiB (fullest stage: {ev.worst_stage} of {p.pp})")
    mem.add_column("stage", justify="right")
    for head in ("params", "grads", "optim", "activ", "buffers", "reserve", "total", "capacity"):
        mem.add_column(head, justify="right")
    mem.add_column("peak at")
    for s, stage in enumerate(ev.memory_per_stage):
        style = "red" if stage["total"] > stage["capacity"] else ("bold" if s == ev.worst_stage else None)
        mem.add_row(str(s), *(f"{stage[k] / GiB:.2f}" for k in
                               ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total", "capacity")),
                    ev.memory_peak_at[s] if s < len(ev.memory_peak_at) else "", style=style)
    console.print(mem)
    if ev.host["offloaded"]:
        console.print(f"host memory per GPU for offloaded states: {ev.host['offloaded'] / GiB:.1f} of "
                      f"{ev.host['capacity'] / GiB:.1f} GiB (its share of host_memory_GB)")
    links = tiers(ev, cluster)
    com = Table(title="Communication per step, busiest device")
    for col in ("dim", "collective", "link tiers (group)", "bytes", "exposed s"):
        com.add_column(col, justify="right" if col in ("bytes", "exposed s") else "left")
    exposed = {"dp": ev.time["dp"] + ev.time["zero"], "tp": ev.time["tp"], "pp": ev.time["pp"], "cp": ev.time["cp"],
               "ep": ev.time["ep"], "offload": ev.time["offload"]}
    for dim, (name, _) in _COLLECTIVES.items():
        if ev.comm[dim] or exposed[dim]:
            com.add_row(dim, name, links[dim], _fmt_bytes(ev.comm[dim]), f"{exposed[dim]:.3f}")
    com.add_row("total", "", "", _fmt_bytes(ev.comm["total"]), "", style="bold")
    console.print(com)
    tim = Table(title="Step time")
    tim.add_column("part")
    tim.add_column("seconds", justify="right")
    tim.add_column("share", justify="right")
    for part, sec in ev.time.items():
        if sec:
            tim.add_row(part, f"{sec:.3f}", f"{sec / ev.step_time_s:.1%}")
    tim.add_row("step", f"{ev.step_time_s:.3f}", "100%", style="bold")
    console.print(tim)
    console.print(f"tokens/s {ev.tokens_per_s:,.0f} · model TFLOP/s per GPU {ev.tflops_per_gpu:.1f} "
                  f"(with recompute {ev.hw_tflops_per_gpu:.1f}) · MFU {ev.mfu:.1%}")
    if ev.violations:
        for v in ev.violations:
            console.print(f"[red]violation[/red] {v.rule}: {v.message}")
    else:
        console.print("[green]fits and is sound[/green]")


_TITLES = {None: "Top plans", "any": "Top plans (each runs with at least one framework)",
           "none": "Top plans (theoretical optimum: not filtered by what frameworks can run)"}


def _band_text(plan: dict) -> str:
    """The 95% band of a plan's step time as ``-a/+b%`` (from calibration or published runs)."""
    band = plan.get("step_time_band_95_s")
    if not band or not plan["step_time_s"]:
        return "-"
    low, high = band[0] / plan["step_time_s"] - 1, band[1] / plan["step_time_s"] - 1
    return f"{low:+.0%}/{high:+.0%}"


def print_solution(doc: dict, result: object, console: Console | None = None) -> None:
    """The top-K plans as a table; for an infeasible problem, the nearest plan and its shortfall."""
    console = console or Console()
    console.print(f"[bold]{doc['model']['name']}[/bold] ({doc['model']['params'] / 1e9:.2f}B params) on "
                  f"{doc['cluster']['gpus']} x {doc['cluster']['gpu']}: status [bold]{doc['status']}[/bold], "
                  f"objective {doc['objective']}, {doc['solve_seconds']:.2f} s")
    if doc["plans"]:
        runs_with = all("frameworks" in p for p in doc["plans"])
        tab = Table(title=_TITLES.get(doc.get("framework"), f"Top plans {doc.get('framework')} can run"))
        for col in ("#", "dp x tp x pp x cp x ep", "zero", "mbs x ga", "sched", "recompute", "offload",
                    "mem GiB / cap", "comm/step", "step s", "±95%", "MFU", *(("runs with",) if runs_with else ())):
            tab.add_column(col)
        for p in doc["plans"]:
            d = p["degrees"]
            mem = p["memory_per_device_bytes"]
            off = "/".join(v for v in (p["offload"]["optimizer"], p["offload"]["params"]) if v != "none") or "-"
            tab.add_row(str(p["rank"]), f"{d['dp']}x{d['tp']}x{d['pp']}x{d['cp']}x{d['ep']}", str(p["zero_stage"]),
                        f"{p['micro_batch']}x{p['grad_accum']}", f"{p['schedule']}/v{p['virtual_stages']}",
                        p["recompute"], off, f"{mem['total'] / GiB:.1f} / {mem['capacity'] / GiB:.0f}",
                        _fmt_bytes(p["comm_bytes_per_step_per_device"]["total"]), f"{p['step_time_s']:.3f}",
                        _band_text(p), f"{p['mfu']:.1%}",
                        *((", ".join(p["frameworks"]) or "none",) if runs_with else ()))
        console.print(tab)
        console.print(f"layers per stage (best): {doc['plans'][0]['layers_per_stage']}")
        console.print(f"[dim]±95%: step-time band from {doc['plans'][0].get('step_time_band_source', 'no data')}[/dim]")
    else:
        near = doc.get("nearest")
        if near:
            mem = near["memory_per_device_bytes"]
            console.print(f"[red]no plan fits[/red]; nearest: {near['degrees']} zero={near['zero_stage']} "
                          f"recompute={near['recompute']} needs {mem['total'] / GiB:.1f} GiB of {mem['capacity'] / GiB:.1f} "
                          f"(short by {(mem['total'] - mem['capacity']) / GiB:.1f} GiB per device)")
        for line in doc.get("advice", []):
            console.print(f"  - {line}")
    for note in doc.get("notes", []):
        console.print(f"[dim]{note}[/dim]")
