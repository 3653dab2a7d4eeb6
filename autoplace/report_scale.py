"""``scale --report FILE.html``: the sweep on one page -- step time, tokens/s, days and dollars
against the GPU count with the chosen and cheapest sizes marked, every size's plan in a sortable
table, and the chosen size's plan drawn as ``solve --report`` draws its best.

The page is built from the ``autoplace.scale/v1`` document (what ``--json`` prints) with
:mod:`autoplace.report_html`'s parts; every number carries its JSON path (``data-json``).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from autoplace import charts
from autoplace.report_html import (
    GiB,
    LinkView,
    card,
    copyable,
    link_view,
    model_params,
    num,
    page,
    plan_charts,
    sortable_table,
    write_page,
)


def _sized(doc: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The swept sizes that have a plan, with their index in ``points``."""
    return [(i, p) for i, p in enumerate(doc["points"]) if p.get("plan")]


def _header(doc: dict[str, Any]) -> str:
    """The title, the model, the budget and price, the deadline."""
    m, deadline = doc["model"], doc["deadline"]
    tokens = f"{doc['tokens']:.3g} tokens" if doc.get("tokens") else "no token budget (--tokens)"
    price = f"${doc['price_per_gpu_hour']}/GPU-hour" if doc.get("price_per_gpu_hour") else "no price (--price-per-gpu-hour)"
    seconds = num("sweep_seconds", doc["sweep_seconds"], f"{doc['sweep_seconds']:.1f}")
    return (f"<h1>{html.escape(m['name'])} on {html.escape(doc['gpu'])}: {len(doc['points'])} sizes</h1>"
            f'<p class="sub">model: {model_params(m)} · '
            f"global batch {html.escape(doc['global_batch_text'])} · {tokens} · {price}</p>"
            f'<p class="sub">objective {html.escape(doc["objective"])} · {_deadline(deadline)} · '
            f"swept in {seconds} s</p>")


def _deadline(deadline: dict[str, Any] | None) -> str:
    """The deadline the cheapest size is held to; none without a token budget (rows have no days)."""
    if not deadline:
        return "no deadline (no token budget: --tokens)"
    return (f"deadline {deadline['days']:g} days ({html.escape(deadline['why'])})"
            f"{'' if deadline.get('met', True) else ': <b>not met</b>'}")


def _cards(doc: dict[str, Any]) -> str:
    """The chosen size: GPUs, step, tokens/s, days and dollars (or GPU-hours)."""
    chosen = next(((i, p) for i, p in _sized(doc) if p["gpus"] == doc.get("chosen_gpus")), None)
    if chosen is None:
        return '<div class="bad"><b>No size fits</b>: none of the swept GPU counts runs the model.</div>'
    i, p = chosen
    key, cost = f"points.{i}", p.get("training_cost") or {}
    others = f"fastest {doc['fastest_gpus']} · cheapest in the deadline {doc.get('cheapest_gpus') or 'none'}"
    cells = [card("chosen size", f"{p['gpus']} GPUs", f"{others} · fewest {doc['fewest_gpus']}"),
             card("step time", num(f"{key}.plan.step_time_s", p["plan"]["step_time_s"],
                                   f"{p['plan']['step_time_s']:.3f}") + " s", ""),
             card("throughput", num(f"{key}.tokens_per_s", p["tokens_per_s"], f"{p['tokens_per_s']:,.0f}"),
                  "tokens/s · MFU " + num(f"{key}.mfu", p["mfu"], f"{p['mfu']:.1%}", 0.01))]
    if cost:
        cells.append(card("to the token budget", num(f"{key}.training_cost.days", cost["days"], f"{cost['days']:.1f}")
                          + " days", num(f"{key}.training_cost.gpu_hours", cost["gpu_hours"],
                                         f"{cost['gpu_hours']:,.0f}") + " GPU-hours"))
    if cost.get("cost") is not None:
        cells.append(card("cost", "$" + num(f"{key}.training_cost.cost", cost["cost"], f"{cost['cost']:,.0f}"), ""))
    return '<div class="cards">' + "".join(cells) + "</div>"


def _charts(doc: dict[str, Any]) -> str:
    """Step time, tokens/s with scaling efficiency, days and dollars (or GPU-hours) against GPUs."""
    rows = [p for _, p in _sized(doc)]
    gpus = [p["gpus"] for p in rows]
    marks = {"chosen": doc.get("chosen_gpus"), "cheapest in the deadline": doc.get("cheapest_gpus")}
    fig, axes = charts.figure(12.5, 7.5, ncols=2, nrows=2)
    charts.against_gpus(axes[0][0], gpus, [p["plan"]["step_time_s"] for p in rows], "step time, s", marks)
    charts.scaling(axes[0][1], gpus, [p["effective_tokens_per_s"] for p in rows],
                   [p.get("scaling_efficiency") or 0 for p in rows], "tokens/s and scaling efficiency")
    costs = [p.get("training_cost") or {} for p in rows]
    if all(costs):
        charts.against_gpus(axes[1][0], gpus, [c["days"] for c in costs], "days to the token budget", marks)
        priced = all(c.get("cost") is not None for c in costs)
        charts.against_gpus(axes[1][1], gpus, [c["cost"] if priced else c["gpu_hours"] for c in costs],
                            "dollars" if priced else "GPU-hours (no price given)", marks)
    else:
        for ax in axes[1]:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "no token budget (--tokens): no days or cost", ha="center", transform=ax.transAxes)
    return f'<div class="charts">{charts.svg(fig, "sc")}</div>'


def _table(doc: dict[str, Any]) -> str:
    """Every swept size: its plan's numbers, who runs it, the plan string."""
    head = ("GPUs", "used", "status", "step s", "tokens/s", "MFU", "efficiency", "days", "memory GiB", "runs with",
            "--plan")
    rows = []
    for i, p in enumerate(doc["points"]):
        key, plan, cost = f"points.{i}", p.get("plan"), p.get("training_cost") or {}

        def cell(field: str, value: float | None, shown: str, scale: float = 1.0) -> str:
            if value is None:
                return '<td class="n" data-sort="-1">-</td>'
            return f'<td class="n" data-sort="{value!r}">{num(f"{key}.{field}", value, shown, scale)}</td>'  # noqa: B023

        mem = plan["memory_per_device_bytes"]["total"] if plan else None
        rows.append("<tr>" + "".join([
            f'<td class="n" data-sort="{p["gpus"]}">{p["gpus"]}</td><td class="n">{p["used_gpus"]}</td>',
            f"<td>{html.escape(p['status'])}{' · ' + html.escape(p['note']) if p.get('note') else ''}</td>",
            cell("plan.step_time_s", plan["step_time_s"] if plan else None, f"{plan['step_time_s']:.3f}" if plan else ""),
            cell("tokens_per_s", p["tokens_per_s"] if plan else None, f"{p['tokens_per_s']:,.0f}" if plan else ""),
            cell("mfu", p["mfu"] if plan else None, f"{p['mfu']:.1%}" if plan else "", 0.01),
            cell("scaling_efficiency", p.get("scaling_efficiency"), f"{(p.get('scaling_efficiency') or 0):.1%}", 0.01),
            cell("training_cost.days", cost.get("days"), f"{cost.get('days', 0):.1f}"),
            cell("plan.memory_per_device_bytes.total", mem, f"{(mem or 0) / GiB:.1f}", GiB),
            f"<td>{html.escape(', '.join(p.get('frameworks', [])) or 'none')}</td>",
            f"<td>{copyable(plan['plan']) if plan else ''}</td>"]) + "</tr>")
    return sortable_table("points", head, rows)


def scale_page(doc: dict[str, Any], links: LinkView) -> str:
    """The whole page of ``scale``: ``doc`` as ``--json`` prints it, ``links`` the chosen plan's link tiers."""
    body = [_header(doc), _cards(doc)]
    if _sized(doc):
        body += ["<h2>Against the GPU count</h2>", _charts(doc), "<h2>Every size</h2>", _table(doc)]
    chosen = next(((i, p) for i, p in _sized(doc) if p["gpus"] == doc.get("chosen_gpus")), None)
    if chosen is not None:
        i, p = chosen
        body += plan_charts([p["plan"]], f"points.{i}.plan", links, f"The chosen size ({p['gpus']} GPUs)")
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in doc.get("notes", []))
    body.append(f'<h2>Notes</h2><ul class="note">{notes}</ul>')
    return page(f"autoplace scale: {doc['model']['name']} on {doc['gpu']}", body)


def write_scale_report(path: Path, doc: dict[str, Any], chosen: Any, cluster: Any) -> int:
    """Write the page of ``scale`` to ``path``: ``chosen`` the chosen SweepPoint (or None), ``cluster``
    the cluster it runs on; returns the page's size in bytes."""
    links = link_view(chosen.evaluation, cluster) if chosen is not None and chosen.evaluation is not None else LinkView()
    return write_page(path, scale_page(doc, links))
