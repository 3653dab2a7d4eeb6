"""Print (never assert) the size of each ``--report`` page and the time it takes to write.

Each command runs in a fresh process with ``--json --report``; its JSON's ``report`` object gives the
page's bytes and the seconds spent writing it (drawing and serialising; the search is not in them),
beside the command's whole wall time and the page gzipped (what a chat or a pull request stores).

Run: python benchmarks/report_size.py [--no-tune]   (the tune row runs one real 2-rank gloo trial)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
M70, M8, TINY = (f"examples/models/{m}.json" for m in ("llama-3-70b", "llama-3-8b", "tiny-llama"))
H100_64, A100_8, CPU_2 = (f"examples/clusters/{c}.yaml" for c in ("8x8-h100", "1x8-a100-80gb", "cpu-2"))
INTERLEAVED = "tp=8,pp=4,vpp=2,schedule=interleaved,zero=1,recompute=selective"
# kind -> the command's words after ``autoplace`` ({tmp}: a scratch folder)
KINDS = {
    "solve (70B, 64 H100)": ["solve", M70, H100_64],
    "solve --out (8B, 8 A100)": ["solve", M8, A100_8, "--time-limit", "30", "--out", "{tmp}/bundle"],
    "evaluate (70B, 64 H100)": ["evaluate", M70, H100_64, "--plan", "tp=8,pp=4,zero=1"],
    "explain, interleaved (70B)": ["explain", M70, H100_64, "--plan", INTERLEAVED],
    "scale (70B, 64..1024 H100)": ["scale", M70, "--gpu", "h100-sxm5-80gb", "--gpus", "64..1024", "--tokens", "2T",
                                   "--price-per-gpu-hour", "2.50", "--time-limit", "10"],
    "tune (tiny, 1 trial, 2 CPU ranks)": ["tune", TINY, CPU_2, "--trials", "1", "--top", "1", "--out", "{tmp}/tune"],
}


def measure(words: list[str], tmp: Path) -> tuple[int, float, float, int]:
    """(page bytes, seconds writing it, the command's wall seconds, gzipped bytes)."""
    page = tmp / "page.html"
    argv = [w.replace("{tmp}", str(tmp)) for w in words]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    begun = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autoplace.cli", *argv, "--json", "--report", str(page)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - begun
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
    report = json.loads(done.stdout)["report"]
    return report["bytes"], report["seconds"], wall, len(gzip.compress(page.read_bytes()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tune", action="store_true", help="skip the tune row (it runs a real trial)")
    args = parser.parse_args()
    print(f"| {'report':34} | {'page kB':>8} | {'gzip kB':>8} | {'writing s':>9} | {'command s':>9} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 11}|")
    for kind, words in KINDS.items():
        if args.no_tune and words[0] == "tune":
            continue
        with tempfile.TemporaryDirectory(prefix="autoplace-report-size-") as tmp:
            size, seconds, wall, zipped = measure(words, Path(tmp))
        print(f"| {kind:34} | {size / 1e3:8,.0f} | {zipped / 1e3:8,.0f} | {seconds:9.2f} | {wall:9.1f} |")


if __name__ == "__main__":
    main()
