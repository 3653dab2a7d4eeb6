"""The bundles ``solve --out DIR`` wrote, on the report's page: per framework, each file's name,
size and what it is.

What a file is comes from the bundle's own README.txt (``name: what``, one line per file, written
by :func:`autoplace.bundle.write_bundle` from each emitter's description), so the page and the
folder say the same; plan.json and README.txt, which README.txt does not list, are named here.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

_OWN = {"plan.json": "the plan and the cost model's numbers for it (autoplace.solution/v1's plan object)",
        "README.txt": "what each file is, and the formats left out and why"}


def _whats(readme: Path) -> dict[str, str]:
    """``name -> what`` from a bundle's README.txt (empty when it is gone)."""
    try:
        lines = readme.read_text().splitlines()
    except OSError:
        return {}
    return {name: what for name, sep, what in (line.partition(": ") for line in lines) if sep and " " not in name}


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _files(b: dict[str, Any]) -> str:
    """One bundle's files: name, size, what it is."""
    files = b["files"]
    whats = _whats(Path(files.get("README.txt", Path(b["dir"]) / "README.txt")))
    rows = []
    for file, path in files.items():
        size = _size(Path(path))
        rows.append(f'<tr><td class="file"><code>{html.escape(file)}</code></td>'
                    f'<td class="n">{"gone" if size is None else f"{size / 1e3:,.1f} kB"}</td>'
                    f"<td>{html.escape(whats.get(file) or _OWN.get(file, ''))}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("file", "size", "what it is"))
    return f'<table class="bundle"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def bundles_table(bundles: dict[str, dict[str, Any]]) -> str:
    """Every framework's bundle (``framework_bundles`` of the solve's JSON) as a folded list of its
    files, the first (the chosen plan's) unfolded; a bundle not written says why."""
    parts = []
    for i, (name, b) in enumerate(bundles.items()):
        if not b.get("written") or not b.get("files"):
            parts.append(f"<p><b>{html.escape(name)}</b>: not written: {html.escape(str(b.get('reason')))}</p>")
            continue
        total = sum(_size(Path(path)) or 0 for path in b["files"].values())
        parts.append(f'<details{" open" if i == 0 else ""}><summary><b>{html.escape(name)}</b>: '
                     f"{len(b['files'])} files, {total / 1e3:,.1f} kB in <code>{html.escape(b['dir'])}/</code>"
                     f"</summary>{_files(b)}</details>")
    return f'<div id="bundles">{"".join(parts)}</div>'
