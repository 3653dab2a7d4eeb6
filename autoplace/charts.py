"""The plots of a plan, drawn on matplotlib axes: one drawing path for ``explain --png`` and the
HTML report (``--report``), so a chart reads the same wherever it appears.

Every function takes the numbers as the solution document (``--json``) holds them -- per-stage
memory dicts, the time breakdown, bytes per dimension -- and never recomputes them.  matplotlib
is imported only inside :func:`figure` and :func:`svg` (``solve`` without a chart does not load it).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

from autoplace.pipeline_timeline import Op

GiB = 2**30
MEMORY = ("params", "grads", "optimizer", "activations", "buffers", "reserve")
# One colour per state and per step-time part, the same in every chart (matplotlib's tab10/tab20)
_PASS = {"F": "#4c78a8", "B": "#f58518"}


def figure(width: float, height: float, ncols: int = 1, nrows: int = 1) -> tuple[Any, Any]:
    """A matplotlib figure (headless Agg back end) and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width, height))


def svg(fig: Any, prefix: str) -> str:
    """The figure as an inline ``<svg>`` element: text kept as text (searchable, small), no XML
    prolog or DOCTYPE (whose DTD address a browser could try to fetch), every id and reference to
    one prefixed (the SVGs of one page share its id space), the figure closed afterwards."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "autoplace"}):  # stable ids
        fig.tight_layout()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    close(fig)
    text = buf.getvalue()
    text = re.sub(r'\bid="([^"]+)"', rf'id="{prefix}-\1"', text[text.index("<svg"):])
    return re.sub(r'(url\(#|href="#)([^")]+)', rf"\1{prefix}-\2", text)


def close(fig: Any) -> None:
    """Free the figure (pyplot keeps every open one)."""
    import matplotlib.pyplot as plt

    plt.close(fig)


def _legend(ax: Any, **kwargs: Any) -> None:
    """The legend beside the axes, not over the bars."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kwargs)


def memory_bars(ax: Any, stages: Sequence[Mapping[str, float]]) -> None:
    """Memory per pipeline stage stacked by state, with the device's capacity as a dashed line."""
    bottom = [0.0] * len(stages)
    for part in MEMORY:
        values = [s[part] / GiB for s in stages]
        ax.bar(range(len(stages)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(stages[0]["capacity"] / GiB, color="black", linestyle="--", label="capacity")
    ax.set_xticks(range(len(stages)))
    ax.set(title="Memory per device by stage", xlabel="pipeline stage", ylabel="GiB")
    handles, labels = ax.get_legend_handles_labels()
    _legend(ax, handles=handles[::-1], labels=labels[::-1])  # in the order the stack reads, top first


def time_bars(ax: Any, rows: Sequence[tuple[str, Mapping[str, float]]],
              band: tuple[float, float] | None = None) -> None:
    """The step time's parts as stacked horizontal bars, one row per plan (the first on top);
    ``band``: the first plan's ±95% step-time interval, drawn as an error bar."""
    parts = [k for k in rows[0][1] if any(t[k] for _, t in rows)]
    left = [0.0] * len(rows)
    for part in parts:
        values = [t[part] for _, t in rows]
        ax.barh(range(len(rows)), values, left=left, label=part)
        left = [a + b for a, b in zip(left, values, strict=True)]
    if band is not None:
        ax.errorbar([left[0]], [0], xerr=[[left[0] - band[0]], [band[1] - left[0]]], color="black", capsize=6,
                    label="±95% band")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set(title="Step time by part", xlabel="seconds")
    _legend(ax)


_TIER = {"NVLink": "#54a24b", "network": "#e45756", "host": "#9d755d"}


def comm_bars(ax: Any, comm: Mapping[str, float], links: Mapping[str, str],
              split: Mapping[str, Mapping[str, float]], kinds: Mapping[str, str]) -> None:
    """Bytes each device moves per step, one bar per dimension that moves any, stacked by the link
    tier that carries them (``split``: :func:`autoplace.report.tier_bytes`; ``kinds``: each tier's
    NVLink, network or host, one colour each), labelled with the tiers its groups use
    (:func:`autoplace.report.tiers`) and its total."""
    dims = [d for d in comm if d != "total" and comm[d]]
    tiers = sorted({t for d in dims for t in split.get(d, {})}, key=lambda t: list(_TIER).index(kinds.get(t, "host")))
    left = [0.0] * len(dims)
    for tier in tiers:
        values = [split.get(d, {}).get(tier, 0.0) / 1e9 for d in dims]
        kind = kinds.get(tier, "host")
        ax.barh(range(len(dims)), values, left=left, color=_TIER[kind], label=f"{tier} ({kind})")
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_yticks(range(len(dims)), [f"{d}  ({links.get(d, '-')})" for d in dims], fontsize=8)
    ax.invert_yaxis()
    for i, d in enumerate(dims):
        ax.annotate(f"{comm[d] / 1e9:,.1f} GB", (comm[d] / 1e9, i), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set(title="Communication per step, per device, by link tier", xlabel="GB")
    ax.margins(x=0.2)
    _legend(ax)


def timeline(ax: Any, ops: Sequence[Op], pp: int, title: str) -> None:
    """A pipeline schedule as one row per device: forward (F) and backward (B) boxes labelled with
    their micro-batch (and chunk when interleaved), idle time shaded as bubble; ``ops`` in seconds."""
    end = max(op.end for op in ops)
    for d in range(pp):
        ax.broken_barh([(0, end)], (d - 0.45, 0.9), color="#e45756", alpha=0.25)
    for op in ops:
        ax.broken_barh([(op.start, (op.end - op.start))],
                       (op.device - 0.45, 0.9), facecolor=_PASS[op.kind], edgecolor="white", linewidth=0.5)
        if op.end - op.start >= 0.02 * end:  # a label only where it fits
            ax.text((op.start + op.end) / 2, op.device, op.label, ha="center", va="center",
                    fontsize=6, color="white")
    chunks = ops[0].chunks  # interleaved: device d holds stages d, d + pp, ...
    ax.set_yticks(range(pp), [f"stage {d}" if chunks == 1 else
                              f"GPU {d}: stages {', '.join(str(c * pp + d) for c in range(chunks))}" for d in range(pp)],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set(title=title, xlabel="seconds", xlim=(0, end))
    handles = [ax.bar(0, 0, color=c, label=lab) for lab, c in
               (("forward", _PASS["F"]), ("backward", _PASS["B"]), ("idle (bubble)", "#f4c7c6"))]
    _legend(ax, handles=handles)



def scaling(ax: Any, gpus: Sequence[int], tokens_per_s: Sequence[float], efficiency: Sequence[float],
            title: str) -> None:
    """Throughput against GPUs on log axes, the linear line from the first size, and scaling
    efficiency on a second axis (``scale --png`` and the scale report)."""
    import matplotlib.ticker

    ax.plot(gpus, tokens_per_s, "o-", color="tab:blue", label="tokens/s")
    if gpus:
        ax.plot(gpus, [tokens_per_s[0] * g / gpus[0] for g in gpus], ":", color="tab:blue",
                label="linear from the first row")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s", title=title)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    eff = ax.twinx()
    eff.plot(gpus, [100 * e for e in efficiency], "s--", color="tab:orange", label="scaling efficiency")
    eff.set(ylabel="scaling efficiency, %", ylim=(0, 110))
    lines = ax.get_legend_handles_labels()[0] + eff.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], loc="lower right", fontsize=8)


def against_gpus(ax: Any, gpus: Sequence[int], values: Sequence[float], ylabel: str,
                 marks: Mapping[str, int | None]) -> None:
    """One quantity against the GPU count (log x), the sizes named in ``marks`` (chosen, cheapest)
    ringed and labelled."""
    import matplotlib.ticker

    ax.plot(gpus, values, "o-", color="#4c78a8")
    for (name, at), colour, size in zip(marks.items(), ("#e45756", "#54a24b"), (17, 11), strict=False):
        if at is not None and at in gpus:  # rings of two sizes: one size can be both
            i = list(gpus).index(at)
            ax.plot([at], [values[i]], "o", markersize=size, markerfacecolor="none", markeredgecolor=colour,
                    markeredgewidth=2, label=f"{name}: {at} GPUs")
    ax.set(xscale="log", xlabel="GPUs", ylabel=ylabel, title=ylabel)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if max(values) >= 1e4:  # dollars as 10,465,918, not 1.046 with 1e7 above the axis
        ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    ax.legend(fontsize=8)


def measured_vs_predicted(ax: Any, points: Sequence[tuple[str, float, float]], best: str | None) -> None:
    """Each measured trial as a point, predicted step time (x) against measured (y), on the y = x line
    a perfect cost model would put every point on; ``best`` (a point's label) ringed."""
    xs, ys = [p for _, p, _ in points], [m for _, _, m in points]
    top = max(xs + ys) * 1.15
    ax.plot([0, top], [0, top], ":", color="grey", label="measured = predicted")
    ax.plot(xs, ys, "o", color="#4c78a8", label="trial")
    for label, x, y in points:
        ax.annotate(label, (x, y), xytext=(5, 3), textcoords="offset points", fontsize=8)
        if label == best:
            ax.plot([x], [y], "o", markersize=15, markerfacecolor="none", markeredgecolor="#e45756",
                    markeredgewidth=2, label=f"best measured: {label}")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="predicted step time, s", ylabel="measured step time, s",
           title="Measured against predicted, per trial")
    ax.set_aspect("equal")
    _legend(ax)
