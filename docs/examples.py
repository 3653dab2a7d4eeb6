"""README.md's examples, printed by the commands they show: regenerate them, or check they still hold.

    python docs/examples.py            # run every `$ autoplace ...` block's command, write its output in
    python docs/examples.py --check    # exit 1 naming each block whose command now prints something else
    python docs/examples.py --screenshot  # only docs/report-*.png (also taken by a plain run)

A block is a fenced code block whose first line is ``$ autoplace ...`` (continued with a trailing
backslash); what follows the command is its output.  Commands run as a user would, in a scratch
folder holding the repo's ``examples/`` (so ``--out b`` writes there), one after the other (a later
block may read what an earlier one wrote, e.g. ``dryrun b/megatron``).  Only what differs between two
runs of the same code is masked when checking: wall-clock seconds.  tests/test_readme.py runs the check.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```\n(\$ autoplace .*?)^```\n", re.MULTILINE | re.DOTALL)
# wall-clock seconds: the solve's time, a sweep's, a dry run's steps and ranks
MASKS = [(re.compile(r"(objective \w+), \d+(\.\d+)? s\b"), r"\1, N s"),
         (re.compile(r"(sweep: \d+ sizes in )\d+(\.\d+)? s\b"), r"\1N s"),
         (re.compile(r"(│ ok )\d+\.\d+ s(?= +│)"), r"\1N s"),
         (re.compile(r"(built in )\d+(\.\d+)? s\b"), r"\1N s")]


@dataclass(frozen=True)
class Block:
    """One example: where it is in the README, the command as written, and the output shown."""

    start: int
    end: int
    command: str
    output: str

    @property
    def argv(self) -> list[str]:
        """The command's words after ``autoplace`` (the shell's continuations joined)."""
        return shlex.split(self.command.replace("\\\n", " "))[2:]


def blocks(text: str) -> list[Block]:
    """Every example block of ``text``, in order."""
    found = []
    for match in FENCE.finditer(text):
        body = match.group(1)
        lines = body.splitlines(keepends=True)
        n = 1
        while lines[n - 1].rstrip("\n").endswith("\\"):
            n += 1
        found.append(Block(match.start(1), match.end(1), "".join(lines[:n]).rstrip("\n"), "".join(lines[n:])))
    return found


def run(block: Block, cwd: Path) -> str:
    """What the block's command prints on stdout, run from ``cwd`` as a user would run it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "autoplace.cli", *block.argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    return done.stdout


def masked(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def scratch() -> tempfile.TemporaryDirectory[str]:
    """A folder to run the examples from, with the repo's examples/ in it."""
    folder = tempfile.TemporaryDirectory(prefix="autoplace-readme-")
    (Path(folder.name) / "examples").symlink_to(REPO / "examples")
    return folder


# The README's pictures of reports: each PNG in docs/ and the command that writes its page (the last
# word), run from the scratch folder: a solve (Llama-3-70B on 64 H100), an interleaved pipeline
# plan (pp=4, vpp=2) explained, and a scale sweep with its chosen and cheapest sizes
REPORTS = {
    "report-solve.png": ("solve", "examples/models/llama-3-70b.json", "examples/clusters/8x8-h100.yaml",
                         "--report", "report-solve.html"),
    "report-interleaved.png": ("explain", "examples/models/llama-3-70b.json", "examples/clusters/8x8-h100.yaml",
                               "--plan", "tp=8,pp=4,vpp=2,schedule=interleaved,zero=1,recompute=selective",
                               "--report", "report-interleaved.html"),
    "report-scale.png": ("scale", "examples/models/llama-3-70b.json", "--gpu", "h100-sxm5-80gb", "--gpus", "64..1024",
                         "--tokens", "2T", "--price-per-gpu-hour", "2.50", "--time-limit", "10",
                         "--report", "report-scale.html"),
}
DOCS = REPO / "docs"


def screenshot(cwd: Path) -> str:
    """docs/report-*.png: each page its command writes, whole, in headless chromium (the system
    browser, as tests/test_report_browser.py opens it); one line per PNG."""
    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "docs/report-*.png: not taken (pip install playwright)"
    if chromium is None:
        return "docs/report-*.png: not taken (no chromium on PATH; Debian: apt-get install chromium)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    lines = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for png, command in REPORTS.items():
            subprocess.run([sys.executable, "-m", "autoplace.cli", *command], cwd=cwd, env=env, check=True,
                           capture_output=True, timeout=600)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((cwd / command[-1]).as_uri())
            page.screenshot(path=str(DOCS / png), full_page=True)
            page.close()
            lines.append(f"docs/{png}: {(DOCS / png).stat().st_size / 1e3:.0f} kB")
        browser.close()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--screenshot", action="store_true", help="take only the reports' screenshots")
    args = parser.parse_args(argv)
    if args.screenshot:
        with scratch() as cwd:
            print(screenshot(Path(cwd)))
        return 0
    text = README.read_text()
    found = blocks(text)
    stale, out, at = [], [], 0
    with scratch() as cwd:
        for block in found:
            printed = run(block, Path(cwd))
            if masked(printed) != masked(block.output):
                stale.append(block.command.splitlines()[0])
            out += [text[at:block.start], block.command, "\n", printed]
            at = block.end
    out.append(text[at:])
    if args.check:
        for command in stale:
            print(f"README.md: this example prints something else now: {command}")
        return 1 if stale else 0
    README.write_text("".join(out))
    print(f"README.md: {len(found)} examples, {len(stale)} rewritten")
    with scratch() as cwd:
        print(screenshot(Path(cwd)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
