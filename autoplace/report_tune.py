"""``tune --report FILE.html``: the study on one page -- how the measured step time of each trial
stands against the cost model's prediction (a scatter on the y = x line, and the table beside it),
the best trial marked, and the optuna-dashboard command that opens the same study.

The page is built from the ``autoplace.tune/v1`` document (what ``--json`` prints) with
:mod:`autoplace.report_html`'s parts; every number carries its JSON path (``data-json``).
"""

from __future__ import annotations

import html
import shlex
from pathlib import Path
from typing import Any

from autoplace import charts
from autoplace.report_html import GiB, card, copyable, num, page, sortable_table, write_page


def _label(trial: dict[str, Any]) -> str:
    return f"#{trial['number']}"


def _measured(doc: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The trials with both a prediction and a measurement, with their index in ``trials``."""
    return [(i, t) for i, t in enumerate(doc["trials"])
            if t["measured_step_s"] is not None and t["predicted_step_s"] is not None]


def _header(doc: dict[str, Any]) -> str:
    """The study, its storage, how many trials it holds and how many this run added."""
    done = sum(t["state"] == "COMPLETE" for t in doc["trials"])
    return (f"<h1>tune study {html.escape(doc['study'])}: {len(doc['trials'])} trial(s)</h1>"
            f'<p class="sub">storage {html.escape(doc["storage"])} · {done} complete · '
            f"{doc['ran']} run by this invocation</p>")


def _cards(doc: dict[str, Any]) -> str:
    """The best measured trial and how far the cost model missed over the study."""
    best = doc.get("best")
    if not best:
        return '<div class="bad"><b>No trial measured a step</b>: see the states and reasons below.</div>'
    i = next(i for i, t in enumerate(doc["trials"]) if t["number"] == best["number"])
    key, errors = f"trials.{i}", [abs(t["error"]) for _, t in _measured(doc) if t["error"] is not None]
    cells = [card("best measured", f"trial {_label(best)}", html.escape(_short(best["plan"]))),
             card("its step time", num(f"{key}.measured_step_s", best["measured_step_s"],
                                       f"{best['measured_step_s']:.4f}") + " s",
                  "predicted " + num(f"{key}.predicted_step_s", best["predicted_step_s"],
                                     f"{best['predicted_step_s']:.4f}") + " s"
                  if best["predicted_step_s"] is not None else "no prediction")]
    if errors:
        cells.append(card("cost model's miss", f"{max(errors):.0%}", f"largest |measured / predicted − 1| of "
                                                                      f"{len(errors)} trial(s)"))
    return '<div class="cards">' + "".join(cells) + "</div>"


def _short(plan: str) -> str:
    from autoplace.tune import short_plan

    return short_plan(plan) or "one device, defaults"


def _scatter(doc: dict[str, Any]) -> str:
    """Measured against predicted step time, one point per measured trial, the best ringed."""
    points = [(_label(t), t["predicted_step_s"], t["measured_step_s"]) for _, t in _measured(doc)]
    if not points:
        return '<p class="note">No trial has both a prediction and a measurement to plot.</p>'
    fig, ax = charts.figure(7.5, 5.0)
    charts.measured_vs_predicted(ax, points, _label(doc["best"]) if doc.get("best") else None)
    return f'<div class="charts">{charts.svg(fig, "tv")}</div>'


def _table(doc: dict[str, Any]) -> str:
    """Every trial: its state, plan string, predicted and measured step time, signed error."""
    best = (doc.get("best") or {}).get("number")
    head = ("trial", "state", "predicted s", "measured s", "error", "tokens/s", "peak RSS GiB", "--plan")
    rows = []
    for i, t in enumerate(doc["trials"]):
        key = f"trials.{i}"

        def cell(field: str, shown: str, scale: float = 1.0) -> str:
            value = t[field]  # noqa: B023
            if value is None:
                return '<td class="n" data-sort="-1e300"></td>'
            return f'<td class="n" data-sort="{value!r}">{num(f"{key}.{field}", value, shown, scale)}</td>'  # noqa: B023

        state = html.escape(t["state"] + (f" ({t['reason']})" if t["reason"] else ""))
        knobs = " ".join(filter(None, [f"bucket {t['bucket_mb']} MB", t["nccl"]]))
        rows.append(f'<tr{" class=best" if t["number"] == best else ""}>' + "".join([
            f'<td class="n" data-sort="{t["number"]}">{_label(t)}{" ★ best" if t["number"] == best else ""}</td>',
            f"<td>{state}</td>",
            cell("predicted_step_s", f"{t['predicted_step_s'] or 0:.4f}"),
            cell("measured_step_s", f"{t['measured_step_s'] or 0:.4f}"),
            cell("error", f"{t['error'] or 0:+.1%}", 0.01),
            cell("tokens_per_s", f"{t['tokens_per_s'] or 0:,.0f}"),
            cell("peak_rss_bytes", f"{(t['peak_rss_bytes'] or 0) / GiB:.2f}", GiB),
            f"<td>{copyable(t['plan'])}<br><small>{html.escape(knobs)}</small></td>"]) + "</tr>")
    return (sortable_table("trials", head, rows) + '<p class="note">error: measured / predicted − 1 (positive: the step ran slower than the cost model '
            "said). Click a column to sort.</p>")


def tune_page(doc: dict[str, Any]) -> str:
    """The whole page of ``tune``: ``doc`` as ``--json`` prints it."""
    command = shlex.join(doc["dashboard"])
    body = [_header(doc), _cards(doc), "<h2>Measured against predicted</h2>", _scatter(doc),
            "<h2>Every trial</h2>", _table(doc),
            "<h2>The study in optuna-dashboard</h2>",
            f"<p>{copyable(command)}</p><p class='note'>Serves the study's storage at http://127.0.0.1:8080 "
            "(<code>tune --dashboard</code> runs it after the study).</p>"]
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in doc.get("notes", []))
    deviations = "".join(f"<li>trial {_label(t)} deviates from its plan: {html.escape(t['deviation'])}</li>"
                         for t in doc["trials"] if t.get("deviation"))
    body.append(f'<h2>Notes</h2><ul class="note">{deviations}{notes}</ul>')
    return page(f"autoplace tune: study {doc['study']}", body)


def write_tune_report(path: Path, doc: dict[str, Any]) -> int:
    """Write the page of ``tune`` to ``path``; returns its size in bytes."""
    return write_page(path, tune_page(doc))
