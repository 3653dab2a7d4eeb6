"""``solve --report FILE.html``: one self-contained page a reviewer opens offline -- the plan's
story in charts beside the numbers ``--json`` prints.

Every number on the page is read from the solution document (the object ``--json`` prints) and
carries its JSON path and exact value in ``data-json`` / ``data-value`` attributes, with the unit
its text is shown in as ``data-scale``: tests/test_report_browser.py opens the page in Chromium
and holds the DOM to the JSON.  Charts are matplotlib SVG inline (:mod:`autoplace.charts`, the
drawing ``explain --png`` uses); the only script is the table sort and the copy buttons below.
Nothing on the page names an address: it makes no network request.
"""

from __future__ import annotations

import html
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace import charts
from autoplace.errors import SpecError
from autoplace.plan import ZERO_BUBBLE

GiB = 2**30

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1240px;margin:0 auto;padding:20px 28px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin:2px 0}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:16px 0}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:10px 14px;min-width:140px;flex:1 1 auto}
.card b{display:block;font-size:22px;white-space:nowrap}.card small{color:#666}
.bad{background:#fdecea;border:1px solid #e45756;border-radius:8px;padding:10px 16px;margin:12px 0}
table{border-collapse:collapse;background:#fff;width:100%}th,td{border:1px solid #ddd;padding:4px 8px;text-align:left}
th{background:#f0f0f0;cursor:pointer;user-select:none}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code{font-size:12px;word-break:break-all}td>code{display:block;max-height:5.8em;overflow:auto}td.file code{white-space:nowrap;word-break:normal}
details{margin:4px 0}summary{cursor:pointer;padding:3px 0}button{font-size:11px;margin-left:6px}
.charts{display:flex;flex-wrap:wrap;gap:12px}.charts svg{max-width:100%;height:auto;background:#fff}
.note{color:#555;font-size:13px}tr.best td{background:#fff6d5}
"""
# Click a header to sort by it (numbers by data-sort); a copy button copies its plan string, and
# selects it when the clipboard is refused (a file:// page may not have one).
_JS = """
document.querySelectorAll('table.sortable th').forEach((th,i)=>th.addEventListener('click',()=>{
 const body=th.closest('table').tBodies[0],up=th.dataset.dir!=='asc';th.dataset.dir=up?'asc':'desc';
 const key=r=>{const c=r.cells[i],s=c.dataset.sort;return s!==undefined?parseFloat(s):c.textContent};
 [...body.rows].sort((a,b)=>{const x=key(a),y=key(b);return (x>y?1:x<y?-1:0)*(up?1:-1)})
  .forEach(r=>body.appendChild(r));}));
document.querySelectorAll('button.copy').forEach(b=>b.addEventListener('click',()=>{
 const code=b.previousElementSibling,done=()=>{b.textContent='copied'};
 const select=()=>{const r=document.createRange();r.selectNodeContents(code);
  const s=getSelection();s.removeAllRanges();s.addRange(r);b.textContent='selected: press Ctrl+C'};
 if(navigator.clipboard){navigator.clipboard.writeText(code.textContent).then(done,select)}else{select()}}));
"""


@dataclass(frozen=True)
class LinkView:
    """The chosen plan's links: the tiers each dimension's groups use (``nvlink4 x8 + ib-ndr x4``)
    and its bytes per step per device on each tier (:func:`autoplace.report.tier_bytes`)."""

    tiers: dict[str, str] = field(default_factory=dict)
    bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # tier name -> NVLink, network or host


def link_view(ev: Any, cluster: Any) -> LinkView:
    """:class:`LinkView` of an Evaluation on ``cluster``."""
    from autoplace.report import tier_bytes, tiers

    pool = cluster.pools[0]
    kinds = {pool.host_link.name: "host", pool.inter_node.name: "network", pool.intra_node.name: "NVLink"}
    return LinkView(tiers(ev, cluster), tier_bytes(ev, cluster), kinds)


def check_target(path: Path) -> None:
    """Refuse a report path before any search runs: its folder must exist and take a file, and
    matplotlib (the ``plot`` extra) must be installed.

    Raises:
        SpecError: one line naming ``--report``, what is wrong and what would do.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise SpecError("matplotlib is needed to draw the report: pip install 'autoplace[plot]'", source="--report")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise SpecError(f"folder {str(folder)!r} {what}; name a file in an existing folder", source=f"--report {path}")
    if path.is_dir():
        raise SpecError("is a folder; name the HTML file to write, e.g. report.html", source=f"--report {path}")
    existed = path.exists()
    try:  # the one sure test of writability (permissions, read-only mounts, root's exemptions)
        with path.open("a"):
            pass
    except OSError as exc:
        raise SpecError(f"cannot be written ({exc.strerror}); name a file in a writable folder",
                        source=f"--report {path}") from None
    if not existed:
        path.unlink()


def num(key: str, value: float, text: str, scale: float = 1.0) -> str:
    """A number tied to the JSON: its path ``key``, exact value, and the unit ``scale`` of ``text``
    (shown value x scale = value, to the digits shown)."""
    return (f'<span data-json="{key}" data-value="{html.escape(json.dumps(value))}" data-scale="{scale!r}">'
            f"{html.escape(text)}</span>")


def card(title: str, body: str, small: str = "") -> str:
    """One headline number: its name above, the value, a line of context below."""
    return f'<div class="card"><small>{title}</small><b>{body}</b><small>{small}</small></div>'


def model_params(m: dict[str, Any]) -> str:
    """The model's parameter count in billions, tied to ``model.params``."""
    return num("model.params", m["params"], f"{m['params'] / 1e9:.2f}", 1e9) + "B params"


def _origin(doc: dict[str, Any]) -> str:
    """The title and where the model and the cluster came from."""
    m, c = doc["model"], doc["cluster"]
    return (f"<h1>{html.escape(m['name'])} on {c['gpus']} × {html.escape(c['gpu'])}</h1>"
            f'<p class="sub">model: {model_params(m)} · '
            f"seq len {num('model.seq_len', m['seq_len'], str(m['seq_len']))} · global batch "
            f"{num('model.global_batch', m['global_batch'], str(m['global_batch']))} sequences · from "
            f"{html.escape(str(m.get('source', '?')))}</p>"
            f'<p class="sub">cluster {html.escape(c["name"])}: {c["nodes"]} node(s) × {c["gpus_per_node"]} GPUs '
            f"(NVLink domain {c.get('nvlink_domain', '?')})</p>")


def _search(doc: dict[str, Any]) -> str:
    """The search's status, proven gap and seconds."""
    gap = (num("gap", doc["gap"], f"{doc['gap']:.2%}", 0.01) if doc.get("gap") is not None else "none proven")
    seconds = num("solve_seconds", doc["solve_seconds"], f"{doc['solve_seconds']:.2f}")
    return (f'<p class="sub">search: status <b>{html.escape(doc["status"])}</b>, objective {doc["objective"]}, '
            f"framework {html.escape(doc['framework'])}, proven gap {gap}, {seconds} s</p>")


def _cards(p: dict[str, Any], key: str, runs: Sequence[str]) -> str:
    """The plan's headline numbers: the ten-second story (``runs``: the frameworks that run it)."""
    d, mem, band = p["degrees"], p["memory_per_device_bytes"], p.get("step_time_band_95_s")
    shape = " × ".join(f"{k}{d[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if d[k] > 1) or "one GPU"
    sched = f"{p['schedule']}" + (f" v{p['virtual_stages']}" if p["virtual_stages"] > 1 else "")
    band_text = (f"95%: {num(f'{key}.step_time_band_95_s.0', band[0], f'{band[0]:.3f}')}–"
                 f"{num(f'{key}.step_time_band_95_s.1', band[1], f'{band[1]:.3f}')} s") if band else ""
    return '<div class="cards">' + "".join([
        card("layout", html.escape(shape), f"ZeRO {p['zero_stage']} · {html.escape(sched)} · recompute "
              f"{html.escape(p['recompute'])}"),
        card("step time", num(f"{key}.step_time_s", p["step_time_s"], f"{p['step_time_s']:.3f}") + " s", band_text),
        card("throughput", num(f"{key}.tokens_per_s", p["tokens_per_s"], f"{p['tokens_per_s']:,.0f}"),
              "tokens/s · MFU " + num(f"{key}.mfu", p["mfu"], f"{p['mfu']:.1%}", 0.01)),
        card("memory, fullest device", num(f"{key}.memory_per_device_bytes.total", mem["total"],
                                            f"{mem['total'] / GiB:.1f}", GiB) + " GiB",
              "of " + num(f"{key}.memory_per_device_bytes.capacity", mem["capacity"], f"{mem['capacity'] / GiB:.1f}",
                          GiB) + " GiB"),
        card("micro-batches", f"{p['micro_batch']} × {p['grad_accum']}", "micro-batch × accumulation"),
        card("runs with", html.escape(", ".join(runs) or "none"), ""),
    ]) + "</div>"


def copyable(text: str) -> str:
    """A plan string with the button that copies it."""
    return f'<code>{html.escape(text)}</code><button class="copy" type="button">copy</button>'


def _plans_table(doc: dict[str, Any], strings: Sequence[str]) -> str:
    """The top plans, sortable, each with its ``--plan`` string and a copy button."""
    head = ("#", "dp×tp×pp×cp×ep", "ZeRO", "mbs×ga", "schedule", "recompute", "memory GiB", "step s",
            "tokens/s", "MFU", "runs with", "--plan")
    rows = []
    for i, (p, text) in enumerate(zip(doc["plans"], strings, strict=True)):
        d, mem, key = p["degrees"], p["memory_per_device_bytes"], f"plans.{i}"

        def cell(field: str, value: float, shown: str, scale: float = 1.0) -> str:
            return f'<td class="n" data-sort="{value!r}">{num(f"{key}.{field}", value, shown, scale)}</td>'  # noqa: B023

        rows.append("<tr>" + "".join([
            f'<td class="n" data-sort="{p["rank"]}">{p["rank"]}</td>',
            f"<td>{d['dp']}×{d['tp']}×{d['pp']}×{d['cp']}×{d['ep']}</td><td>{p['zero_stage']}</td>",
            f"<td>{p['micro_batch']}×{p['grad_accum']}</td><td>{html.escape(p['schedule'])}"
            f"{'/v' + str(p['virtual_stages']) if p['virtual_stages'] > 1 else ''}</td>",
            f"<td>{html.escape(p['recompute'])}</td>",
            cell("memory_per_device_bytes.total", mem["total"], f"{mem['total'] / GiB:.1f}", GiB),
            cell("step_time_s", p["step_time_s"], f"{p['step_time_s']:.3f}"),
            cell("tokens_per_s", p["tokens_per_s"], f"{p['tokens_per_s']:,.0f}"),
            cell("mfu", p["mfu"], f"{p['mfu']:.1%}", 0.01),
            f"<td>{html.escape(', '.join(p.get('frameworks', [])) or 'none')}</td>",
            f"<td>{copyable(text)}</td>"]) + "</tr>")
    return (sortable_table("plans", head, rows) + '<p class="note">Click a column to sort; each plan string is what <code>--plan</code> and '
            "<code>--fix</code> accept.</p>")


def sortable_table(table_id: str, head: Sequence[str], rows: Sequence[str]) -> str:
    """A table whose headers sort it (the page's script): ``head`` its column names, ``rows`` its ``<tr>``s."""
    ths = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f'<table class="sortable" id="{table_id}"><thead><tr>{ths}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _frameworks_table(per_framework: dict[str, Any]) -> str:
    """Per framework: runs the plan or why not; when searched (solve), its own best plan, step time
    and slowdown."""
    searched, rows = any("own_best" in f for f in per_framework.values()), []
    for name, f in per_framework.items():
        key, own = f"per_framework.{name}.own_best", f.get("own_best") or {}
        runs = "yes" if f["runs_plan"] else f"no: {html.escape(str(f['why_not']))}"
        if not searched:
            cells = ""
        elif "plan" in own:
            step = num(f"{key}.step_time_s", own["step_time_s"], f"{own['step_time_s']:.3f}")
            slow = num(f"{key}.slowdown", own["slowdown"], f"{own['slowdown']:+.1%}", 0.01)
            cells = (f'<td class="n" data-sort="{own["step_time_s"]!r}">{step}</td>'
                     f'<td class="n" data-sort="{own["slowdown"]!r}">{slow}</td><td>{copyable(own["plan"])}</td>')
        else:
            cells = f'<td></td><td></td><td>{html.escape(own.get("reason", "not searched (one framework asked for)"))}</td>'
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{runs}</td>{cells}</tr>")
    columns = ("framework", "runs plan 1", "its best: step s", "slowdown", "its best plan") if searched else \
        ("framework", "runs the plan")
    return sortable_table("frameworks", columns, rows)


def _bundles(doc: dict[str, Any]) -> str:
    """The chosen plan's bundle and each framework's, file by file (:mod:`autoplace.report_bundle`)."""
    from autoplace.report_bundle import bundles_table

    first = {"written": True, "dir": str(Path(doc["bundle"]["plan.json"]).parent), "files": doc["bundle"]}
    return bundles_table({"plan 1": first, **doc.get("framework_bundles", {})})


def _memory_and_time(plans: Sequence[dict[str, Any]]) -> str:
    """Memory per stage of the first plan against its capacity, and the step time's parts of every plan."""
    fig, (ax_mem, ax_time) = charts.figure(12.5, 3.8, ncols=2)
    charts.memory_bars(ax_mem, plans[0]["memory_per_stage_bytes"])
    band = plans[0].get("step_time_band_95_s")
    charts.time_bars(ax_time, [(p.get("change") or (f"plan {p['rank']}" if "rank" in p else "plan"), p["time_breakdown_s"])
                                for p in plans],
                     tuple(band) if band else None)
    return f'<div class="charts">{charts.svg(fig, "mt")}</div>'


def plan_charts(plans: Sequence[dict[str, Any]], key: str, links: LinkView, name: str) -> list[str]:
    """The first plan's charts with their headings: memory and step time, schedule, communication."""
    return [f"<h2>{name}: memory per stage and step time</h2>", _memory_and_time(plans),
            f"<h2>{name}: pipeline schedule</h2>", _timeline(plans[0], key),
            f"<h2>{name}: communication by dimension</h2>", _comm(plans[0], key, links)]


def _timeline(p: dict[str, Any], key: str) -> str:
    """The chosen plan's pipeline schedule laid out in time, or a line saying it has none."""
    from autoplace.pipeline_timeline import drawn_microbatches, idle_share, lay_out

    pp, m, vpp, schedule = p["degrees"]["pp"], p["grad_accum"], p["virtual_stages"], p["schedule"]
    bubble = p["time_breakdown_s"]["bubble"]
    if pp == 1:
        return (f'<p class="note">No pipeline (pp=1): each device runs all {m} micro-batches of the step '
                "back to back, accumulating gradients; there is no bubble.</p>")
    step = num(f"{key}.step_time_s", p["step_time_s"], f"{p['step_time_s']:.3f}")
    if schedule in ZERO_BUBBLE:  # autoplace.pipeline_timeline lays out GPipe, 1F1B and interleaved 1F1B only
        return (f'<p class="note">{schedule} schedule, pp={pp}, {vpp} chunks per device: its split backward is not '
                f"drawn. Over the whole step the bubble costs "
                f"{num(f'{key}.time_breakdown_s.bubble', bubble, f'{bubble:.3f}')} s of {step} s.</p>")
    drawn = drawn_microbatches(schedule, pp, m)
    stages = p.get("stage_time_per_microbatch_s") or []
    # one forward of a stage per micro-batch: a third of its forward and backward (each stage's own
    # time when the plan has them, else a third of the step's compute per micro-batch on every stage)
    forward = [t / 3 for t in stages] if len(stages) == pp else [p["time_breakdown_s"]["compute"] / (3 * m)] * pp
    ops = lay_out(schedule, pp, vpp, drawn, forward)
    title = (f"{schedule} schedule, pp={pp}" + (f", {vpp} chunks per device" if schedule == "interleaved" else "")
             + f": {drawn} of {m} micro-batches drawn")
    fig, ax = charts.figure(12.5, 0.45 * pp + 1.6)
    charts.timeline(ax, ops, pp, title)
    shown = "all micro-batches" if drawn == m else f"the first {drawn} of {m} micro-batches (warm-up, steady state, cool-down)"
    widths = ("each stage as long as the cost model says (" + ", ".join(
        num(f"{key}.stage_time_per_microbatch_s.{i}", t, f"{t * 1e3:.1f}", 1e-3) for i, t in enumerate(stages))
        + " ms a micro-batch, forward and backward)") if len(stages) == pp else "stages equal"
    return (charts.svg(fig, "tl") +
            f'<p class="note">Drawn: {shown}, {widths}, backward twice forward; idle share of the drawn span '
            f"{idle_share(ops, pp):.1%}. Over the whole step the bubble costs "
            f"{num(f'{key}.time_breakdown_s.bubble', bubble, f'{bubble:.3f}')} s of "
            f"{step} s.</p>")


def _comm(p: dict[str, Any], key: str, links: LinkView) -> str:
    """Bytes per step per device by dimension, stacked by the link tier that carries them."""
    comm = p["comm_bytes_per_step_per_device"]
    if not comm["total"]:
        return '<p class="note">This plan moves no bytes between devices.</p>'
    fig, ax = charts.figure(9.5, 0.4 * sum(1 for k, v in comm.items() if v and k != "total") + 1.4)
    charts.comm_bars(ax, comm, links.tiers, links.bytes, links.kinds)
    total = num(f"{key}.comm_bytes_per_step_per_device.total", comm["total"], f"{comm['total'] / 1e9:,.1f}", 1e9)
    per_tier: dict[str, float] = {}
    for split in links.bytes.values():
        for tier, sent in split.items():
            per_tier[tier] = per_tier.get(tier, 0.0) + sent
    tiers = ", ".join(f"{sent / 1e9:,.1f} GB on {html.escape(tier)} ({links.kinds.get(tier, '?')})"
                      for tier, sent in per_tier.items())
    return (charts.svg(fig, "cm") + f'<p class="note">In all {total} GB per device per step: {tiers}. Each '
            "dimension's bytes split over NVLink inside a domain and the network across, as the cost model sends "
            "them (hierarchical rings; pipeline and context send/recv on the network once their group leaves a "
            "domain).</p>")


def _alternatives(doc: dict[str, Any]) -> str:
    """explain's neighbours: the change, step time and peak memory against the plan's, fits or not."""
    base, rows = doc["plan"], []
    for i, a in enumerate(doc["alternatives"]):
        key, mem = f"alternatives.{i}", a["memory_per_device_bytes"]["total"]
        step = num(f"{key}.step_time_s", a["step_time_s"], f"{a['step_time_s']:.3f}")
        peak = num(f"{key}.memory_per_device_bytes.total", mem, f"{mem / GiB:.1f}", GiB)
        fits = mem <= a["memory_per_device_bytes"]["capacity"]
        rows.append(f"<tr><td>{html.escape(a['change'])}</td><td class='n' data-sort='{a['step_time_s']!r}'>{step}</td>"
                    f"<td class='n'>{a['step_time_s'] / base['step_time_s'] - 1:+.1%}</td>"
                    f"<td class='n' data-sort='{mem!r}'>{peak}</td>"
                    f"<td class='n'>{mem / base['memory_per_device_bytes']['total'] - 1:+.1%}</td>"
                    f"<td>{'yes' if fits else 'no'}</td></tr>")
    return sortable_table("alternatives", ("change", "step s", "step vs plan", "peak GiB", "peak vs plan", "fits"), rows)


def _infeasible(doc: dict[str, Any]) -> str:
    """No plan fits: the nearest plan, by how much it misses, its memory chart, and the advice."""
    from autoplace.report import TIMED_OUT, _missed_by

    near = doc.get("nearest")
    advice = "".join(f"<li>{html.escape(a)}</li>" for a in doc.get("advice", []))
    if doc.get("status") == "unknown":  # the time limit left configurations unsearched
        advice = f"<li>{html.escape(': '.join(TIMED_OUT))}.</li>{advice}"
    if not near:
        return f'<div class="bad"><b>No plan fits</b> and no nearest plan was found.<ul>{advice}</ul></div>'
    mem = near["memory_per_device_bytes"]
    need = num("nearest.memory_per_device_bytes.total", mem["total"], f"{mem['total'] / GiB:.1f}", GiB)
    cap = num("nearest.memory_per_device_bytes.capacity", mem["capacity"], f"{mem['capacity'] / GiB:.1f}", GiB)
    degrees = " ".join(f"{k}={v}" for k, v in near["degrees"].items())
    fig, ax = charts.figure(6.5, 3.8)
    charts.memory_bars(ax, near["memory_per_stage_bytes"])
    return (f'<div class="bad"><b>No plan fits.</b> Nearest: {html.escape(degrees)} zero={near["zero_stage"]} '
            f"recompute={html.escape(near['recompute'])} needs {need} GiB of {cap} GiB"
            f"{html.escape(_missed_by(near))}.<ul>{advice}</ul></div>"
            f'<h2>Memory of the nearest plan</h2><div class="charts">{charts.svg(fig, "nm")}</div>')


def solve_page(doc: dict[str, Any], strings: Sequence[str], links: LinkView) -> str:
    """The whole page of a solve: ``doc`` is what ``--json`` prints, ``strings`` each plan's
    ``--plan`` string, ``links`` the best plan's link tiers per dimension."""
    body = [_origin(doc), _search(doc)]
    if not doc["plans"]:
        body.append(_infeasible(doc))
    else:
        body += [_cards(doc["plans"][0], "plans.0", doc["plans"][0]["frameworks"]), "<h2>Top plans</h2>", _plans_table(doc, strings),
                 *plan_charts(doc["plans"], "plans.0", links, "Plan 1")]
        if doc.get("per_framework"):
            body += ["<h2>Per framework</h2>", _frameworks_table(doc["per_framework"])]
        if doc.get("bundle"):
            body += ["<h2>Bundles written (--out)</h2>", _bundles(doc)]
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in doc.get("notes", []))
    body.append(f'<h2>Notes</h2><ul class="note">{notes}</ul>')
    return page(_title(doc), body)


def evaluation_page(doc: dict[str, Any], string: str, links: LinkView) -> str:
    """The whole page of ``evaluate`` or ``explain`` (its ``alternatives`` too): ``doc`` as ``--json``
    prints it, the plan's string and link tiers."""
    p = doc["plan"]
    verdict = ('<p class="sub">verdict: <b>fits and is sound</b></p>' if not p["violations"] else
               '<div class="bad"><b>This plan cannot run as given.</b><ul>' +
               "".join(f"<li>{html.escape(v['rule'])}: {html.escape(v['message'])}</li>" for v in p["violations"]) +
               "</ul></div>")
    runs = [name for name, f in doc.get("per_framework", {}).items() if f["runs_plan"]]
    body = [_origin(doc), verdict, _cards(p, "plan", runs), f"<p>{copyable(string)}</p>",
            *plan_charts([p, *doc.get("alternatives", [])], "plan", links, "The plan")]
    if doc.get("alternatives"):
        body += ["<h2>Alternatives that change the most (one knob each)</h2>", _alternatives(doc)]
    if doc.get("per_framework"):
        body += ["<h2>Per framework</h2>", _frameworks_table(doc["per_framework"])]
    return page(_title(doc), body)


def _title(doc: dict[str, Any]) -> str:
    return f"autoplace: {doc['model']['name']} on {doc['cluster']['gpus']} × {doc['cluster']['gpu']}"


def page(title: str, body: Sequence[str]) -> str:
    """The document around ``body``: title, inline style and script, nothing fetched."""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            # no request of any kind: not even the browser's default /favicon.ico
            '<link rel="icon" href="data:,"><meta name="viewport" content="width=device-width">'
            f'<style>{_CSS}</style></head><body><main>{"".join(body)}</main><script>{_JS}</script></body></html>')


def write_page(path: Path, text: str) -> int:
    """Write a page into ``path``; returns its size in bytes.  Written in place, never renamed over
    the path: a path that is no regular file (``/dev/null``, a pipe) must stay what it is."""
    data = text.encode("utf-8")
    with path.open("wb") as f:
        f.write(data)
    return len(data)


def write_solve_report(path: Path, doc: dict[str, Any], result: Any, cluster: Any) -> int:
    """Write the page of a solve (:func:`solve_page`) to ``path``; returns its size in bytes."""
    strings = [ev.plan.to_string() for ev in result.plans]
    return write_page(path, solve_page(doc, strings, link_view(result.plans[0], cluster) if result.plans else LinkView()))


def write_evaluation_report(path: Path, doc: dict[str, Any], evaluation: Any, cluster: Any) -> int:
    """Write the page of ``evaluate`` (:func:`evaluation_page`) to ``path``; returns its size in bytes."""
    return write_page(path, evaluation_page(doc, evaluation.plan.to_string(), link_view(evaluation, cluster)))
