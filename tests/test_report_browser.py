"""solve, explain (evaluate's page and more), scale and tune --report opened in a real browser (Debian's chromium, headless, driven by Playwright): the
page logs no console error, requests nothing but itself, draws something, and every number it
shows equals the same command's --json.  Skipped where chromium or playwright is missing (.ci/run
installs chromium; playwright is in the ``test`` extra and uses the system browser, never its own)."""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli import A100_8, CLUSTERS, MODELS, invoke, strict_json

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")

# Every number the page ties to the JSON: path, exact value, unit of its text, the text
_NUMBERS = """[...document.querySelectorAll('[data-json]')].map(e =>
  [e.dataset.json, e.dataset.value, parseFloat(e.dataset.scale), e.textContent])"""


# On 8 A100s: a solve that finds plans (exit 0), one that finds none (exit 3: the page shows the nearest
# plan), explain of an interleaved pipeline plan (evaluate's page and the alternatives); and scale over
# 8 and 16 A100s
CASES = {"solve": (("solve", MODELS / "llama-3-8b.json", A100_8, "--time-limit", "60"), 0),
         "solve-infeasible": (("solve", MODELS / "llama-3-405b.json", A100_8, "--time-limit", "60"), 3),
         "explain": (("explain", MODELS / "llama-3-8b.json", A100_8, "--plan", "tp=2,pp=2,vpp=2,schedule=interleaved"),
                     0),
         "scale": (("scale", MODELS / "llama-3-8b.json", "--gpu", "a100", "--gpus", "8,16", "--tokens", "1e10",
                    "--time-limit", "5"), 0),
         # real gloo trials of the tiny model on 2 CPU ranks: the smallest study (one trial)
         "tune": (("tune", MODELS / "tiny-llama.json", CLUSTERS / "cpu-2.yaml", "--trials", "1", "--top", "1",
                   "--out", "{tmp}"), 0)}
SLOW = {"tune"}


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def solved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One command with --json and --report: the document and the page."""
    folder = tmp_path_factory.mktemp("report")
    page = folder / "page.html"
    args, code = CASES[request.param]
    result = invoke(*(str(a).replace("{tmp}", str(folder)) for a in args), "--json", "--report", page)
    assert result.exit_code == code, result.output
    return strict_json(result.stdout), page


@pytest.fixture(scope="module")
def browser() -> Any:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with sync_api.sync_playwright() as pw:
        # the system chromium: Playwright's own browser download needs a network CI does not have
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def _at(doc: Any, key: str) -> Any:
    """The value at a dotted JSON path (list indices as numbers)."""
    for part in key.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _shown(text: str) -> tuple[float, int]:
    """The number a text shows and its decimals: ``'31,828'`` -> (31828.0, 0), ``'+7.9%'`` -> (7.9, 1)."""
    match = re.search(r"[-+]?[\d,]*\.?\d+", text)
    assert match, f"no number in {text!r}"
    digits = match.group().replace(",", "")
    return float(digits), len(digits.split(".")[1]) if "." in digits else 0


def check_numbers(numbers: list[list[Any]], doc: dict[str, Any]) -> None:
    """Each number's data-value is the JSON's, and its text is that value in its unit, to the digits shown."""
    for key, value, scale, text in numbers:
        expected = _at(doc, key)
        assert json.loads(value) == expected, f"{key}: the page holds {value}, --json {expected}"
        shown, decimals = _shown(text)
        assert abs(shown * scale - expected) <= (0.5 * 10 ** -decimals + 1e-9) * scale, \
            f"{key}: the page shows {text!r} (x{scale}), --json {expected}"


@needs_chromium
def test_the_report_is_offline_quiet_drawn_and_says_what_json_says(
        solved: tuple[dict[str, Any], Path], browser: Any, tmp_path: Path) -> None:
    doc, path = solved
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    png = page.screenshot(full_page=True)
    numbers = page.evaluate(_NUMBERS)
    if doc.get("plans"):
        page.dispatch_event("#plans th:nth-child(8)", "click")  # sort by step time
    order = page.evaluate("[...document.querySelectorAll('#plans tbody tr')].map(r => r.cells[0].textContent)")
    marked = page.evaluate("[...document.querySelectorAll('#trials tr.best')].map(r => r.cells[0].textContent)")
    codes = page.evaluate("[...document.querySelectorAll('code')].map(c => c.textContent)")
    page.close()

    assert requests == [path.as_uri()]
    assert errors == []
    # what the browser fetches outside the page's own requests (its icon) is named by no attribute either
    assert re.findall(r'(?:src|href)="(?!data:|#)[^"]*"', path.read_text()) == []
    _not_blank(png)
    check_numbers(numbers, doc)
    keys = {key for key, *_ in numbers}
    if "trials" in doc:  # tune: every measured trial's prediction, measurement and error; the best marked
        for i, t in enumerate(doc["trials"]):
            if t["measured_step_s"] is not None:
                assert {f"trials.{i}.predicted_step_s", f"trials.{i}.measured_step_s", f"trials.{i}.error"} <= keys
        assert marked == [f"#{doc['best']['number']} ★ best"]
        assert shlex.join(doc["dashboard"]) in codes
        return
    if "points" in doc:  # scale: every size's numbers and the chosen plan's
        chosen = next(i for i, p in enumerate(doc["points"]) if p["gpus"] == doc["chosen_gpus"])
        for i in range(len(doc["points"])):
            assert {f"points.{i}.plan.step_time_s", f"points.{i}.tokens_per_s", f"points.{i}.training_cost.days"} <= keys
        assert f"points.{chosen}.plan.comm_bytes_per_step_per_device.total" in keys  # its charts' numbers
        return
    if "plan" in doc:  # explain: the one plan, then its alternatives
        assert {"plan.step_time_s", "plan.mfu", "plan.memory_per_device_bytes.total",
                "plan.time_breakdown_s.bubble", "plan.step_time_band_95_s.0",  # the band, as solve's
                *(f"plan.stage_time_per_microbatch_s.{s}" for s in range(2))} <= keys  # each stage drawn
        assert {f"alternatives.{i}.step_time_s" for i in range(len(doc["alternatives"]))} <= keys
        return
    if not doc["plans"]:  # no plan fits: the nearest one and by how much it misses
        assert {"nearest.memory_per_device_bytes.total", "nearest.memory_per_device_bytes.capacity"} <= keys
        return
    for i in range(len(doc["plans"])):
        assert {f"plans.{i}.step_time_s", f"plans.{i}.mfu", f"plans.{i}.memory_per_device_bytes.total"} <= keys
    assert {f"per_framework.{f}.own_best.slowdown" for f, v in doc["per_framework"].items()
            if "plan" in v.get("own_best", {})} <= keys
    assert order == [str(p["rank"]) for p in sorted(doc["plans"], key=lambda p: p["step_time_s"])]


def test_a_number_that_differs_from_json_fails() -> None:
    """The check itself: one step time off by a millisecond in the page fails it."""
    p = {"step_time_s": 263.557401}
    doc = {"plans": [p]}
    good = [["plans.0.step_time_s", json.dumps(p["step_time_s"]), 1.0, f"{p['step_time_s']:.3f}"]]
    check_numbers(good, doc)
    for bad in ([good[0][0], json.dumps(p["step_time_s"] + 1e-3), 1.0, good[0][3]],
                [*good[0][:3], f"{p['step_time_s'] + 1e-3:.3f}"]):
        with pytest.raises(AssertionError):
            check_numbers([bad], doc)


def _not_blank(png: bytes) -> None:
    """A screenshot with content: many colours, and a good share of pixels off the background."""
    from matplotlib import image

    pixels = image.imread(io.BytesIO(png), format="png")[..., :3]
    background = pixels[0, 0]
    off = (abs(pixels - background).sum(axis=-1) > 0.1).mean()
    colours = len({tuple(px) for px in (pixels[::7, ::7].reshape(-1, 3) * 255).astype(int).tolist()})
    assert off > 0.05 and colours > 50, f"a blank page? {off:.1%} of pixels off the background, {colours} colours"
