"""Readable output of solve, evaluate and explain: tables as rich text, markdown or CSV.

Every table is built once as a :class:`Section` (title, columns, rows) and rendered by
:func:`render`.  Piped or redirected output is never cut: a rich console that is not a
terminal gets an unbounded width, and on a terminal cells fold instead of ending in '…'.
"""

from __future__ import annotations

import csv
import io
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autoplace.compression import COMPRESSIONS, label
from autoplace.cost.comm import members_per_domain
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
        inside = int(members_per_domain(np.array(size), np.array(stride), cluster.nvlink_domain))
        if dim == "pp":
            out[dim] = f"{pool.inter_node.name if stride >= cluster.nvlink_domain else pool.intra_node.name} x{size}"
        elif inside == size:
            out[dim] = f"{pool.intra_node.name} x{size}"
        elif inside == 1:
            out[dim] = f"{pool.inter_node.name} x{size}"
        else:
            out[dim] = f"{pool.intra_node.name} x{inside} + {pool.inter_node.name} x{size // inside}"
    return out


def tier_bytes(ev: Evaluation, cluster: ClusterSpec) -> dict[str, dict[str, float]]:
    """Each dimension's bytes per device per step (``ev.comm``) split over the link tiers it crosses:
    NVLink inside a domain and the network across domains, split as the cost model sends them
    (:func:`autoplace.cost.comm.ring_bytes` for the collectives, ``alltoall_bytes`` for experts;
    pipeline and context send/recv on the network when their group leaves a domain,
    ``cost.terms_time``), offload on the host link.  An HSDP plan's data-parallel bytes are split
    as one ring over all its ranks (its replica all-reduce, at most ``2 / dp_shard`` of them, is
    not told apart)."""
    from autoplace.cost.comm import alltoall_bytes, ring_bytes

    p, pool, domain = ev.plan, cluster.pools[0], cluster.nvlink_domain
    groups = group_layout(*(np.array([x]) for x in (p.tp, p.cp, p.ep, p.dp_shard, p.dp_replicate, p.pp)))
    out: dict[str, dict[str, float]] = {}
    for dim, (_, key) in _COLLECTIVES.items():
        sent = ev.comm[dim]
        if not sent or not key:
            if sent:
                out[dim] = {pool.host_link.name: sent}
            continue
        size, stride = (int(x[0]) for x in groups[key])
        inside = int(members_per_domain(np.array(size), np.array(stride), domain))
        if dim in ("pp", "cp"):
            shares = (0.0, 1.0) if inside < size else (1.0, 0.0)
        else:
            split = (alltoall_bytes if dim == "ep" else ring_bytes)(1.0, np.array(size), np.array(inside))
            shares = (float(split[0]), float(split[1]))
        out[dim] = {}
        for tier, share in zip((pool.intra_node.name, pool.inter_node.name), shares, strict=True):
            if share:
                out[dim][tier] = out[dim].get(tier, 0.0) + sent * share / sum(shares)
    return out


# A console that is not a terminal (a pipe, a file, CliRunner) prints at this width: wide
# enough that no table row or plan string is wrapped or cut (--wide, CSV, markdown).
UNBOUNDED_WIDTH = 100_000
# Default table output fits a terminal of this many columns; --wide lifts it
WIDTH = 100
FORMATS = ("table", "json", "csv", "markdown")


def fold(text: str, width: int = WIDTH, indent: str = "  ") -> str:
    """Plain ``text`` in lines of at most ``width`` columns, broken after a space or a comma (a plan
    string's ``key=value`` runs stay whole; a run longer than a line breaks after a ``:``), each
    continuation indented by ``indent``."""
    lines, line = [], ""
    room = width - len(indent)
    for token in re.findall(r"[^ ,]+[ ,]*|[ ,]+", text):
        pieces = [token] if len(token.rstrip()) <= room else re.findall(r"[^:]+:?", token)
        for piece in pieces:
            if line.strip() and len(line) + len(piece.rstrip()) > width:
                lines.append(line.rstrip())
                line = indent
            line += piece
    lines.append(line.rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class Section:
    """One table: its title, column headers (units in them), rows of text, right-aligned columns."""

    title: str
    columns: tuple[str, ...]
    rows: Sequence[Sequence[str]]
    right: frozenset[str] = frozenset()
    styles: list[str | None] = field(default_factory=list)
    wrap: frozenset[str] | None = None  # the columns that may wrap (None: all)


def make_console(width: int | None = None) -> Console:
    """The terminal's width on a terminal, unbounded when piped or redirected; at most ``width``
    columns either way when given (the default table output: :data:`WIDTH`)."""
    if sys.stdout.isatty():
        console = _Console()
        return _Console(width=min(console.width, width)) if width else console
    return _Console(width=width or UNBOUNDED_WIDTH, no_color=True, highlight=False)


class _Console(Console):
    """rich's Console, but a closed pipe (``autoplace solve | head``) ends the command quietly with 0
    (rich's own handler exits 1, the code of a failure)."""

    def on_broken_pipe(self) -> None:
        import os
        import sys

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0)


def fmt_count(n: float) -> str:
    """A parameter count with a unit that keeps 3 significant digits: 70.6B, 124M, 45.1K, 512."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}" if n / scale < 100 else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}"


def render(sections: Sequence[Section], lines: Sequence[str], fmt: str, console: Console | None = None,
           *, header: Sequence[str] = (), wide: bool = False) -> None:
    """Print ``header``, the tables and the closing ``lines`` as ``fmt`` (table, markdown or csv).

    Tables and lines fit :data:`WIDTH` columns (long lines wrap at spaces, text cells fold)
    unless ``wide``.  CSV holds the tables only (one block per table: a title row unless it is the
    only one, the header row, the rows; blocks separated by an empty line) so it loads into a spreadsheet.
    """
    console = console or make_console(None if wide or fmt != "table" else WIDTH)
    if fmt == "csv":
        console.print(_csv(sections), end="", markup=False, highlight=False, soft_wrap=True)
        return
    if fmt == "markdown":
        console.print(_markdown(sections, lines, header), end="", markup=False, highlight=False, soft_wrap=True)
        return
    for line in header:
        _print_wrapped(console, line)
    for sec in sections:
        tab = Table(title=sec.title)
        for col in sec.columns:  # only text columns may wrap: a number is never split over two lines
            wraps = sec.wrap is None or col in sec.wrap
            tab.add_column(col, justify="right" if col in sec.right else "left", overflow="fold", no_wrap=not wraps)
        for i, row in enumerate(sec.rows):
            tab.add_row(*row, style=sec.styles[i] if i < len(sec.styles) else None)
        console.print(tab)
    for line in lines:
        _print_wrapped(console, line)


def _print_wrapped(console: Console, line: str) -> None:
    """One line of rich markup, wrapped at spaces to the console's width without trailing blanks."""
    from rich.text import Text

    for part in Text.from_markup(line).wrap(console, console.width, overflow="fold"):
        part.rstrip()
        console.print(part)


def _csv(sections: Sequence[Section]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for i, sec in enumerate(sections):
        if i:
            buf.write("\n")
        if len(sections) > 1:
            writer.writerow([sec.title])
        writer.writerow(sec.columns)
        writer.writerows(sec.rows)
    return buf.getvalue()


def _markdown(sections: Sequence[Section], lines: Sequence[str], header: Sequence[str]) -> str:
    out = [f"{_plain(line)}  " for line in header]
    for sec in sections:
        out += ["", f"**{sec.title}**", "", "| " + " | ".join(sec.columns) + " |",
                "|" + "|".join("---:" if c in sec.right else "---" for c in sec.columns) + "|"]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in sec.rows]
    if lines:
        out += [""] + [f"{_plain(line)}  " for line in lines]
    return "\n".join(out) + "\n"


def _plain(text: str) -> str:
    """Rich markup removed (``[bold]x[/bold]`` -> ``x``)."""
    from rich.text import Text

    return Text.from_markup(text).plain


# ---------------------------------------------------------------- evaluate / explain


def evaluation_sections(ev: Evaluation, cluster: ClusterSpec) -> tuple[list[Section], list[str]]:
    """Memory against capacity per stage, communication by dimension and tier, the time split;
    then the plan, throughput and verdict lines."""
    p = ev.plan
    parts = ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total", "capacity")
    mem = Section(
        f"Memory per device, GiB (fullest stage: {ev.worst_stage} of {p.pp})",
        ("stage", "params", "grads", "optim", "activ", "buffers", "reserve", "total", "capacity", "peak at"),
        [(str(s), *(f"{stage[k] / GiB:.2f}" for k in parts),
          ev.memory_peak_at[s] if s < len(ev.memory_peak_at) else "") for s, stage in enumerate(ev.memory_per_stage)],
        right=frozenset({"stage", "params", "grads", "optim", "activ", "buffers", "reserve", "total", "capacity"}),
        styles=["red" if st["total"] > st["capacity"] else ("bold" if s == ev.worst_stage else None)
                for s, st in enumerate(ev.memory_per_stage)])
    links = tiers(ev, cluster)
    exposed = {"dp": ev.time["dp"] + ev.time["zero"], "tp": ev.time["tp"], "pp": ev.time["pp"], "cp": ev.time["cp"],
               "ep": ev.time["ep"], "offload": ev.time["offload"]}
    com_rows = [(dim, name, links[dim], _fmt_bytes(ev.comm[dim]), f"{exposed[dim]:.3f}")
                for dim, (name, _) in _COLLECTIVES.items() if ev.comm[dim] or exposed[dim]]
    com_rows.append(("total", "", "", _fmt_bytes(ev.comm["total"]), ""))
    com = Section("Communication per step, busiest device",
                  ("dim", "collective", "link tiers (group)", "bytes", "exposed s"), com_rows,
                  right=frozenset({"bytes", "exposed s"}), styles=[None] * (len(com_rows) - 1) + ["bold"])
    tim_rows = [(part, f"{sec:.3f}", f"{sec / ev.step_time_s:.1%}") for part, sec in ev.time.items() if sec]
    tim_rows.append(("step", f"{ev.step_time_s:.3f}", "100%"))
    tim = Section("Step time", ("part", "seconds", "share"), tim_rows, right=frozenset({"seconds", "share"}),
                  styles=[None] * (len(tim_rows) - 1) + ["bold"])
    lines = [f"host memory per GPU for offloaded states: {ev.host['offloaded'] / GiB:.1f} of "
             f"{ev.host['capacity'] / GiB:.1f} GiB (its share of host_memory_GB)"] if ev.host["offloaded"] else []
    lines += [f"[bold]plan[/bold] {escape(fold(p.to_string(), WIDTH - len('plan ')))}",
             f"tokens/s {ev.tokens_per_s:,.0f} · model TFLOP/s per GPU {ev.tflops_per_gpu:.1f} "
             f"(with recompute {ev.hw_tflops_per_gpu:.1f}) · MFU {ev.mfu:.1%}"]
    if p.compress in COMPRESSIONS:  # "none" is not an option
        lines.append(f"[yellow]compress={p.compress}[/yellow]: {COMPRESSIONS[p.compress].moves}; "
                     f"accuracy risk {COMPRESSIONS[p.compress].risk}")
    if p.fp8 != "none":
        lines.append(f"[yellow]fp8={p.fp8}[/yellow]: {FP8_RISK}")
    if ev.violations:
        lines += [f"[red]violation[/red] {v.rule}: {escape(v.message)}" for v in ev.violations]
    else:
        lines.append("[green]fits and is sound[/green]")
    return [mem, com, tim], lines


def print_evaluation(ev: Evaluation, cluster: ClusterSpec, console: Console | None = None, *,
                     fmt: str = "table", header: Sequence[str] = ()) -> None:
    """Memory against capacity, communication by dimension and tier, and the time split."""
    sections, lines = evaluation_sections(ev, cluster)
    render(sections, lines, fmt, console, header=header)


# ---------------------------------------------------------------- solve

_PLAN_COLUMNS = ("#", "dp x tp x pp x cp x ep", "zero", "mbs x ga", "schedule/vpp", "recompute", "offload",
                 "mem GiB / cap GiB", "comm/step", "step s", "±95%", "MFU")


def _band_text(plan: dict[str, Any]) -> str:
    """The 95% band of a plan's step time as ``-a/+b%`` (from calibration or published runs)."""
    band = plan.get("step_time_band_95_s")
    if not band or not plan["step_time_s"]:
        return "-"
    low, high = band[0] / plan["step_time_s"] - 1, band[1] / plan["step_time_s"] - 1
    return f"{low:+.0%}/{high:+.0%}"


_TITLES = {None: "Top plans", "any": "Top plans (each runs with at least one framework)",
           "none": "Top plans (theoretical optimum: not filtered by what frameworks can run)"}


def solution_sections(doc: dict[str, Any], plans: Sequence[str] = (), *, wide: bool = True
                      ) -> tuple[list[Section], list[str]]:
    """The top-K plans as one table and each full plan string (what --plan and --fix accept)
    on its own line; for an infeasible problem, the nearest plan and its shortfall.  ``wide``:
    every column; else the compact table that fits 100 columns (:func:`compact_section`)."""
    if not doc["plans"]:
        return [], _infeasible_lines(doc)
    if not wide:
        _, lines = solution_sections(doc, [fold(text, WIDTH - len("plan 1: ")) for text in plans])
        return [compact_section(doc)], lines
    # robust ranking put a simpler plan ahead of the fastest: one line right under the table says so
    ranked = [f"[yellow]{doc['ranking']['note']}[/yellow]"] if (doc.get("ranking") or {}).get("note") else []
    runs_with = all("frameworks" in p for p in doc["plans"])  # which frameworks' configs can run each plan
    compressed = any(p.get("compress", "none") != "none" for p in doc["plans"])  # the column only when used
    rows = []
    for p in doc["plans"]:
        d, mem = p["degrees"], p["memory_per_device_bytes"]
        off = "/".join(v for v in (p["offload"]["optimizer"], p["offload"]["params"]) if v != "none") or "-"
        rows.append((str(p["rank"]), f"{d['dp']}x{d['tp']}x{d['pp']}x{d['cp']}x{d['ep']}", str(p["zero_stage"]),
                     f"{p['micro_batch']}x{p['grad_accum']}", f"{p['schedule']}/v{p['virtual_stages']}",
                     p["recompute"], off, *((_compress_text(p),) if compressed else ()),
                     f"{mem['total'] / GiB:.1f} / {mem['capacity'] / GiB:.0f}",
                     _fmt_bytes(p["comm_bytes_per_step_per_device"]["total"]), f"{p['step_time_s']:.3f}",
                     _band_text(p), f"{p['mfu']:.1%}", *((", ".join(p["frameworks"]) or "none",) if runs_with else ())))
    title = _TITLES.get(doc.get("framework"), f"Top plans {doc.get('framework')} can run")
    columns = (*_PLAN_COLUMNS[:7], *(("compress",) if compressed else ()), *_PLAN_COLUMNS[7:])
    tab = Section(title, (*columns, *(("runs with",) if runs_with else ())), rows,
                  right=frozenset({"#", "step s", "±95%", "MFU", "comm/step"}))
    lines = ranked + [f"plan {i + 1}: {escape(text)}" for i, text in enumerate(plans)]
    risks: dict[str, list[str]] = {}  # one line per option, naming the plans that use it
    for p in doc["plans"]:
        if p.get("compress_risk"):
            risks.setdefault(p["compress"], []).append(str(p["rank"]))
    lines += [f"[yellow]{name} (plans {', '.join(ranks)})[/yellow]: accuracy risk {COMPRESSIONS[name].risk}"
              for name, ranks in risks.items()]
    by_recipe: dict[str, list[str]] = {}  # one line per recipe (a column would not fit 80 columns)
    for p in doc["plans"]:
        by_recipe.setdefault(recipe_text(p.get("recipe", {})), []).append(str(p["rank"]))
    lines += [f"recipe {text} (plans {', '.join(ranks)}): {recipe_legend(text)}" if text != "-" else
              f"recipe: none (plans {', '.join(ranks)})" for text, ranks in by_recipe.items()]
    fp8 = [str(p["rank"]) for p in doc["plans"] if p.get("recipe", {}).get("fp8", "none") != "none"]
    if fp8:
        lines.append(f"[yellow]fp8 (plans {', '.join(fp8)})[/yellow]: {FP8_RISK}")
    lines.append(f"layers per stage (best): {doc['plans'][0]['layers_per_stage']}")
    lines.append(f"[dim]±95%: step-time band from {doc['plans'][0].get('step_time_band_source', 'no data')}[/dim]")
    return [tab], lines


_COMPACT = ("#", "dp×tp×pp×cp×ep", "zero", "mbs×ga", "sched", "recomp", "offload", "mem/cap", "step s", "MFU",
            "runs with")
_SCHED = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "int"}


def compact_section(doc: dict[str, Any]) -> Section:
    """The plans table in at most 100 columns: short headers and cells, the offload and compress
    columns only when a plan uses them, bytes moved and the band left to ``--wide`` and the JSON."""
    offloads = any(p["offload"]["optimizer"] != "none" or p["offload"]["params"] != "none" for p in doc["plans"])
    compressed = any(p.get("compress", "none") != "none" for p in doc["plans"])
    rows = []
    for p in doc["plans"]:
        d, mem = p["degrees"], p["memory_per_device_bytes"]
        sched = _SCHED.get(p["schedule"], p["schedule"]) + (f"×{p['virtual_stages']}" if p["virtual_stages"] > 1 else "")
        off = "/".join(v for v in (p["offload"]["optimizer"], p["offload"]["params"]) if v != "none") or "-"
        rows.append((str(p["rank"]), f"{d['dp']}×{d['tp']}×{d['pp']}×{d['cp']}×{d['ep']}", str(p["zero_stage"]),
                     f"{p['micro_batch']}×{p['grad_accum']}", sched, {"selective": "sel"}.get(p["recompute"], p["recompute"]),
                     *((off,) if offloads else ()), *((_compress_text(p),) if compressed else ()),
                     f"{mem['total'] / GiB:.0f}/{mem['capacity'] / GiB:.0f}G", f"{p['step_time_s']:.3f}",
                     f"{p['mfu']:.1%}", ", ".join(p.get("frameworks", [])) or "none"))
    columns = [c for c in _COMPACT if c != "offload" or offloads]
    if compressed:
        columns.insert(columns.index("mem/cap"), "compress")
    title = _TITLES.get(doc.get("framework"), f"Top plans {doc.get('framework')} can run")
    return Section(title, tuple(columns), rows, right=frozenset({"#", "step s", "MFU"}),
                   wrap=frozenset({"runs with"}))


FP8_RISK = ("accuracy risk: 8-bit GEMM inputs (e4m3/e5m2) change the numerics; compare the loss curve with a "
            "bf16 run (Micikevicius et al. 2022)")
_RECIPE_SHORT = {"compile": "C", "fused_loss": "L", "overlap": "O"}
_RECIPE_NAMES = {"C": "compile", "L": "fused loss", "O": "overlapped data-parallel communication"}


def recipe_legend(text: str) -> str:
    """What a recipe cell (:func:`recipe_text`) says, only the parts it uses: its letters, then its
    TP-communication overlap and fp8 recipe."""
    parts = text.split(" ")
    letters = parts.pop(0) if parts and set(parts[0]) <= set(_RECIPE_NAMES) else ""
    named = {"tp": "TP-communication overlap", "fp8": "fp8 GEMMs"}
    return ", ".join([*(f"{c} {name}" for c, name in _RECIPE_NAMES.items() if c in letters),
                      *(f"{named[k]} {v}" for k, v in (p.split(":", 1) for p in parts))])


def recipe_text(recipe: dict[str, Any]) -> str:
    """A plan's recipe for a table cell: letters for what is on (C compile, L fused loss, O
    overlapped DP communication), the TP overlap and fp8 recipe by name; ``-`` for none."""
    parts = ["".join(letter for key, letter in _RECIPE_SHORT.items() if recipe.get(key))]
    parts += [f"tp:{recipe['tp_overlap']}"] if recipe.get("tp_overlap", "none") != "none" else []
    parts += [f"fp8:{recipe['fp8']}"] if recipe.get("fp8", "none") != "none" else []
    return " ".join(x for x in parts if x) or "-"


def _compress_text(plan: dict[str, Any]) -> str:
    """A plan's compression for a table cell: ``-``, ``bf16``, ``zero++``, ``powersgd r4``."""
    compress = plan.get("compress", "none")
    return {"none": "-", "zeropp": "zero++"}.get(compress) or label(compress, plan.get("powersgd_rank", 0))


# a solve whose status is "unknown" (solvers.problem.SolveResult): the time limit cut the search short
TIMED_OUT = ("no plan found in the time limit", "the search stopped before it visited every configuration, so a plan "
             "may still fit; raise --time-limit")


def _infeasible_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    unknown = doc.get("status") == "unknown"
    if unknown:
        lines.append(f"[yellow]{TIMED_OUT[0]}[/yellow]: {TIMED_OUT[1]}")
    near = doc.get("nearest")
    if near:
        mem = near["memory_per_device_bytes"]
        degrees = " ".join(f"{k}={v}" for k, v in near["degrees"].items())
        lines.append(f"{'of those searched, none fits' if unknown else '[red]no plan fits[/red]'}; nearest: {degrees} zero={near['zero_stage']} "
                     f"recompute={near['recompute']} needs {mem['total'] / GiB:.1f} GiB of {mem['capacity'] / GiB:.1f}"
                     f"{_missed_by(near)}")
    return lines + [f"  - {escape(line)}" for line in doc.get("advice", [])]


def _missed_by(near: dict[str, Any]) -> str:
    """How the nearest plan misses: device memory, host memory, or -- when it fits both -- the pins
    it breaks (key, pinned value, its own); never a negative shortfall."""
    if near.get("short_by_bytes", 0) > 0:
        return f" (short by {near['short_by_bytes'] / GiB:.1f} GiB per device)"
    if near.get("host_short_by_bytes", 0) > 0:
        return (f" per device, and its offloaded states {near['host_short_by_bytes'] / GiB:.1f} GiB per GPU more "
                "host memory than it has")
    broken = ", ".join(f"{b['key']}={b['value']} (pinned {b['pinned']})" for b in near.get("breaks", []))
    return f": it fits, but breaks the pin{'s' * (len(near['breaks']) > 1)} {broken}" if broken else ": it fits"


def solution_header(doc: dict[str, Any]) -> str:
    """One line: model, cluster, status, objective, seconds."""
    return (f"[bold]{doc['model']['name']}[/bold] ({fmt_count(doc['model']['params'])} params) on "
            f"{doc['cluster']['gpus']} x {doc['cluster']['gpu']}: status [bold]{doc['status']}[/bold], "
            f"objective {doc['objective']}, {doc['solve_seconds']:.2f} s")


def plans_csv_section(doc: dict[str, Any], plans: Sequence[str]) -> Section:
    """One row per plan with every field as a plain number or word, and the full plan string."""
    columns = ("rank", "dp", "tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "vpp", "schedule", "zero", "mbs",
               "ga", "global_batch", "recompute", "offload_optimizer", "offload_params", "compress", "powersgd_rank",
               "layers_per_stage", "memory_GiB", "capacity_GiB", "comm_bytes_per_step", "step_time_s", "step_time_low_95_s",
               "step_time_high_95_s", "tokens_per_s", "tflops_per_gpu", "mfu", "plan")
    rows = []
    for p, text in zip(doc["plans"], plans, strict=False):
        d, mem = p["degrees"], p["memory_per_device_bytes"]
        rows.append(tuple(str(x) for x in (
            p["rank"], d["dp"], d["tp"], d["pp"], d["cp"], d["ep"], p["dp_replicate"], p["dp_shard"],
            p["virtual_stages"], p["schedule"], p["zero_stage"], p["micro_batch"], p["grad_accum"], p["global_batch"],
            p["recompute"], p["offload"]["optimizer"], p["offload"]["params"], p["compress"], p["powersgd_rank"],
            ":".join(map(str, p["layers_per_stage"])), f"{mem['total'] / GiB:.3f}", f"{mem['capacity'] / GiB:.3f}",
            p["comm_bytes_per_step_per_device"]["total"], p["step_time_s"],
            *(p.get("step_time_band_95_s") or ("", "")), p["tokens_per_s"], p["tflops_per_gpu"], p["mfu"], text)))
    return Section("Top plans", columns, rows)


def print_solution(doc: dict, result: object, console: Console | None = None, *, fmt: str = "table",
                   header: Sequence[str] = (), wide: bool = False) -> None:
    """The top-K plans as a table; for an infeasible problem, the nearest plan and its shortfall.

    ``header`` replaces the one-line summary (the CLI passes the model's and cluster's origin).
    """
    plans = [ev.plan.to_string() for ev in getattr(result, "plans", [])]
    sections, lines = solution_sections(doc, plans, wide=wide or fmt != "table")
    if fmt == "csv" and doc["plans"]:
        sections = [plans_csv_section(doc, plans)]
    notes = [f"[dim]{escape(note)}[/dim]" for note in doc.get("notes", [])]
    status = (f"status [bold]{doc['status']}[/bold], objective {doc['objective']}, "
              f"{doc['solve_seconds']:.2f} s")
    if doc["status"] == "feasible" and doc["plans"]:
        gap = f"within {doc['gap']:.2%} of the proven bound" if doc.get("gap") is not None else "with no proven bound"
        lines = [f"[yellow]the time limit stopped the search: the best plan is {gap} "
                 "(raise --time-limit to prove optimality)[/yellow]", *lines]
    render(sections, lines + notes, fmt, console, header=[*header, status] if header else [solution_header(doc)],
           wide=wide)


# ---------------------------------------------------------------- where the numbers came from


def model_origin(model: Any, origin: Any, path: Any, repo: str | None) -> dict[str, Any]:
    """Where the model came from and which training numbers were assumed rather than given
    (``origin``: the loader's :class:`~autoplace.specs.model.ModelOrigin`).

    A Hugging Face config carries no training setup: its global batch (1024 sequences) and
    sequence length (the config's context, capped at 8192) are autoplace's defaults, as is a
    model.json's global batch when its ``training`` block leaves it out.

    Returns:
        {"source", "seq_len", "global_batch", "defaulted": [...], "seq_len_default": how it was derived}
    """
    from autoplace.specs.hf import SEQ_LEN_CAP

    out: dict[str, Any] = {"seq_len": model.seq_len, "global_batch": model.training.global_batch}
    if origin.kind == "hf":
        kind = f"Hugging Face config (model_type {origin.model_type})"
        out["source"] = f"{kind} of {repo}, {path}" if repo else f"{kind}, {path}"
        if "seq_len" in origin.defaulted:
            out["seq_len_default"] = (f"{origin.seq_len_key} {origin.seq_len_value} capped at {SEQ_LEN_CAP}"
                                      if origin.seq_len_value is not None else "the family's training length")
    else:
        out["source"] = f"{'layer graph' if origin.kind == 'graph' else 'model shorthand'}, {path}"
    out["defaulted"] = list(origin.defaulted)
    method = getattr(model.training, "method", "full")
    if method != "full":  # fine-tuning: what trains
        from autoplace.cost.layers import layer_table

        out["method"] = method
        out["trainable_params"] = int(layer_table(model).trainable)
    pins = model.training.recipe_pins.values()
    if pins:  # held in every plan, as --fix holds a key
        out["recipe_pinned"] = pins
    return out


def origin_lines(name: str, params: float, origin: dict[str, Any], cluster: ClusterSpec) -> list[str]:
    """The header: model (source, params, batch and sequence, defaults named) and cluster."""
    batch = f"global batch {origin['global_batch']:,} sequences"
    if "global_batch" in origin["defaulted"]:
        batch += " (default; --global-batch)"
    seq = f"seq len {origin['seq_len']:,}"
    if "seq_len" in origin["defaulted"]:
        seq += f" (default: {origin.get('seq_len_default', 'assumed')}; --seq-len)"
    pool = cluster.pools[0]
    links = f"{pool.intra_node.name} / {pool.inter_node.name}" if len(cluster.pools) == 1 else "mixed pools"
    if cluster.nvlink_domain > cluster.gpus_per_node:
        links = f"NVLink domains of {cluster.nvlink_domain}, {links}"
    if len(cluster.pools) == 1 and 0 < pool.nics_per_node < pool.gpus_per_node:
        nics = pool.nics_per_node
        links += f", {nics} NIC{'s' if nics > 1 else ''} per node"  # the GPUs share them (specs.cluster.NodePool)
    tuned = (f" ({origin['method']}: {fmt_count(origin['trainable_params'])} trainable)"
             if origin.get("method") else "")
    pinned = ", ".join(f"{k}={str(v).lower()}" for k, v in origin.get("recipe_pinned", {}).items())
    return [f"model {name}: {fmt_count(params)} params{tuned} · {batch} · {seq} · from {origin['source']}",
            *([f"recipe pinned by the model file (training.recipe): {pinned}"] if pinned else []),
            f"cluster {cluster.name}: {cluster.gpus} x {cluster.gpu_label} "
            f"({_nodes(sum(p.nodes for p in cluster.pools))} x {cluster.gpus_per_node}, {links})"]


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


# ---------------------------------------------------------------- scale


def compact_scale_section(doc: dict[str, Any]) -> tuple[Section, list[str]]:
    """The sweep in at most 100 columns: per GPU count the degrees, ZeRO, step time, tokens/s, MFU and
    days and cost (or GPU-hours) to the budget, and who runs it; nodes, batch split, recompute, offload
    and scaling efficiency are left to ``--wide`` and the JSON, a row's note to a line below."""
    with_cost = any(p["training_cost"] for p in doc["points"])
    priced = any((p["training_cost"] or {}).get("cost") is not None for p in doc["points"])
    batched = len(doc.get("global_batches", ())) > 1
    money = ("cost $",) if priced else ("GPU-h",) if with_cost else ("eff.",)
    columns = ("GPUs", *(("batch",) if batched else ()), "dp×tp×pp×cp×ep", *(() if batched else ("zero",)),
               "step s", "tokens/s", "MFU", *(("days",) if with_cost else ()), *money, "runs with")
    rows, notes = [], []
    for p in doc["points"]:
        star = "*" if p["gpus"] == doc.get("chosen_gpus") else ""
        plan, tc = p["plan"], p["training_cost"] or {}
        if p["note"] or plan is None:
            notes.append(f"{p['gpus']:,} GPUs: {p['note'] or p['status']}")
        if plan is None:
            rows.append((f"{star}{p['gpus']:,}", *("-" for _ in columns[1:])))
            continue
        d = plan["degrees"]
        cost = (fmt_count(tc["cost"]) if priced else fmt_count(tc["gpu_hours"]) if with_cost
                else f"{p['scaling_efficiency']:.1%}")
        rows.append((f"{star}{p['gpus']:,}", *((f"{p['global_batch']:,}",) if batched else ()),
                     f"{d['dp']}×{d['tp']}×{d['pp']}×{d['cp']}×{d['ep']}",
                     *(() if batched else (str(plan["zero_stage"]),)), _seconds(plan["step_time_s"]),
                     f"{p['tokens_per_s']:,.0f}", f"{p['mfu']:.1%}", *((f"{tc['days']:,.1f}",) if with_cost else ()),
                     cost, ", ".join(p["frameworks"]) or "none"))
    right = frozenset({"GPUs", "batch", "step s", "tokens/s", "MFU", "days", "GPU-h", "cost $", "eff."})
    styles = ["bold" if p["gpus"] == doc.get("chosen_gpus") else None for p in doc["points"]]
    title = f"Best plan per GPU count (batch {doc['global_batch_text']}; * = chosen by {doc['objective']})"
    return Section(title, columns, rows, right=right, styles=styles, wrap=frozenset({"runs with"})), notes


def scale_sections(doc: dict[str, Any], *, wide: bool = True) -> tuple[list[Section], list[str]]:
    """The sweep as one table (a row per GPU count, the chosen one starred) and its notes: every column
    when ``wide``, else the table that fits 100 columns (:func:`compact_scale_section`)."""
    if not wide:
        table, notes = compact_scale_section(doc)
        return [table], [f"[dim]{escape(note)}[/dim]" for note in notes] + scale_sections(doc)[1]
    with_cost = any(p["training_cost"] for p in doc["points"])
    priced = any((p["training_cost"] or {}).get("cost") is not None for p in doc["points"])
    batched = len(doc.get("global_batches", ())) > 1  # the batch was searched: show each size's
    columns = ("GPUs", "nodes x GPUs", *(("batch",) if batched else ()), "dp x tp x pp x cp x ep", "zero", "mbs x ga",
               "recompute", "offload", "step s", "tokens/s", "MFU",
               "scaling eff.", *(("days", "GPU-hours") if with_cost else ()), *(("cost $",) if priced else ()),
               "runs with", "note")
    rows = []
    for p in doc["points"]:
        star = "*" if p["gpus"] == doc.get("chosen_gpus") else ""
        plan, tc = p["plan"], p["training_cost"] or {}
        if plan is None:
            rows.append((f"{star}{p['gpus']}", _node_shape(p), *(("-",) if batched else ()), "-", "-", "-", "-", "-", "-",
                         "-", "-", "-",
                         *(("-", "-") if with_cost else ()), *(("-",) if priced else ()), "-", p["note"] or p["status"]))
            continue
        d = plan["degrees"]
        rows.append((f"{star}{p['gpus']:,}", _node_shape(p), *((f"{p['global_batch']:,}",) if batched else ()),
                     f"{d['dp']}x{d['tp']}x{d['pp']}x{d['cp']}x{d['ep']}",
                     str(plan["zero_stage"]), f"{plan['micro_batch']}x{plan['grad_accum']}", plan["recompute"],
                     "/".join(v for v in (plan["offload"]["optimizer"], plan["offload"]["params"]) if v != "none") or "-",
                     _seconds(plan["step_time_s"]),
                     f"{p['tokens_per_s']:,.0f}", f"{p['mfu']:.1%}", f"{p['scaling_efficiency']:.1%}",
                     *((f"{tc['days']:,.1f}", fmt_count(tc["gpu_hours"])) if with_cost else ()),
                     *((fmt_count(tc["cost"]),) if priced else ()), ", ".join(p["frameworks"]) or "none", p["note"]))
    right = frozenset({"GPUs", "batch", "step s", "tokens/s", "MFU", "scaling eff.", "days", "GPU-hours", "cost $"})
    styles = ["bold" if p["gpus"] == doc.get("chosen_gpus") else None for p in doc["points"]]
    title = f"Best plan per GPU count (global batch {doc['global_batch_text']}; * = chosen by {doc['objective']})"
    lines = [f"[dim]{escape(note)}[/dim]" for note in doc["notes"]]
    # robust ranking kept a simpler plan than the fastest at these sizes (autoplace/ranking.py)
    lines += [f"[yellow]{p['gpus']:,} GPUs: {p['ranking']['note']}[/yellow]" for p in doc["points"]
              if (p.get("ranking") or {}).get("note") and p["used_gpus"] == p["gpus"]]
    lines.append(f"sweep: {len(doc['points'])} sizes in {doc['sweep_seconds']:.1f} s")
    return [Section(title, columns, rows, right=right, styles=styles)], lines


def _seconds(x: float) -> str:
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _node_shape(point: dict[str, Any]) -> str:
    return point["cluster"].split("x", 2)[0] + "x" + point["cluster"].split("x", 2)[1]


def print_scale(doc: dict[str, Any], console: Console | None = None, *, fmt: str = "table",
                header: Sequence[str] = (), wide: bool = False) -> None:
    """The sweep table, its notes, the chosen row's time and cost and the batch advice."""
    sections, lines = scale_sections(doc, wide=wide or fmt != "table")
    render(sections, [*lines, *doc.get("advice_lines", [])], fmt, console, header=header, wide=wide)


# ---------------------------------------------------------------- progress of a long solve

PHASE_NAMES = {"enumerate": "enumerating configurations", "score": "scoring the space (numpy)",
               "bound": "bounding configurations", "build": "building the CP-SAT model", "search": "CP-SAT search"}


class SolveProgress:
    """A transient progress line on stderr naming the solve's phase, shown only once a solve
    has run ``after`` seconds (quick solves print nothing extra); ``Budget.progress``."""

    def __init__(self, limit_s: float, after: float = 2.0) -> None:
        import threading

        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  TextColumn(f"[dim](--time-limit {limit_s:g} s)[/dim]"),
                                  console=Console(stderr=True), transient=True)
        self._task = self._progress.add_task("solving", total=None)
        self._lock = threading.Lock()
        self._shown = self._closed = False
        self._timer = threading.Timer(after, self._show)
        self._timer.daemon = True
        self._timer.start()

    def __call__(self, phase: str) -> None:
        self._progress.update(self._task, description=PHASE_NAMES.get(phase, phase))

    def _show(self) -> None:
        with self._lock:
            if not self._closed and self._progress.console.is_terminal:
                self._progress.start()
                self._shown = True

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._shown:
                self._progress.stop()
