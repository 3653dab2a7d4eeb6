"""solve, evaluate and scale --report without a browser: bad report paths refused in one line before any search, the
pipeline timeline's layout against the bubble the cost model assumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplace.pipeline_timeline import drawn_microbatches, idle_share, lay_out
from tests.test_cli import A100_8, MODELS, invoke

LLAMA_8B = MODELS / "llama-3-8b.json"


@pytest.fixture
def no_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """A search that fails the test if it starts: the report path is judged first."""
    from autoplace import solving

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the search ran before the report path was checked")

    monkeypatch.setattr(solving, "build_problem", refuse)


@pytest.mark.parametrize(("where", "says"), [
    ("missing/report.html", "does not exist"),
    ("a-file.txt/report.html", "is not a folder"),
    (".", "is a folder"),
])
def test_a_report_path_that_cannot_be_written_is_one_line_before_the_search(
        tmp_path: Path, no_search: None, where: str, says: str) -> None:
    (tmp_path / "a-file.txt").write_text("x")
    result = invoke("solve", LLAMA_8B, A100_8, "--report", tmp_path / where)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplace: error: --report") and says in lines[0], lines


def test_evaluate_refuses_a_report_path_before_scoring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoplace import evaluation

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan was scored before the report path was checked")

    monkeypatch.setattr(evaluation, "evaluate", refuse)
    result = invoke("evaluate", LLAMA_8B, A100_8, "--plan", "tp=2", "--report", tmp_path / "missing" / "r.html")
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "does not exist" in result.stderr


def test_scale_refuses_a_report_path_before_sweeping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoplace import sweep

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep ran before the report path was checked")

    monkeypatch.setattr(sweep, "sweep", refuse)
    result = invoke("scale", LLAMA_8B, "--gpu", "a100", "--gpus", "8,16", "--report", tmp_path)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "is a folder" in result.stderr


def test_evaluate_writes_its_page_and_says_so_in_json(tmp_path: Path) -> None:
    """The page itself is opened in a browser for explain (tests/test_report_browser.py), the same page."""
    import json

    page = tmp_path / "plan.html"
    result = invoke("evaluate", LLAMA_8B, A100_8, "--plan", "tp=2,pp=2", "--json", "--report", page)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["report"]["path"] == str(page) and doc["report"]["bytes"] == page.stat().st_size
    assert doc["per_framework"] and all(f["runs_plan"] == (f["why_not"] is None) for f in doc["per_framework"].values())
    text = page.read_text()
    assert f'data-json="plan.step_time_s" data-value="{doc["plan"]["step_time_s"]}"' in text and "<svg" in text


def test_a_folder_the_file_system_refuses_is_named(no_search: None) -> None:
    if Path("/sys").is_dir() and not Path("/sys/kernel").exists():
        pytest.skip("no sysfs here")
    result = invoke("solve", LLAMA_8B, A100_8, "--report", "/sys/autoplace-report.html")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("autoplace: error: --report /sys/autoplace-report.html: cannot be written")
    assert len(result.stderr.strip().splitlines()) == 1


def test_without_matplotlib_the_report_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       no_search: None) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = invoke("solve", LLAMA_8B, A100_8, "--report", tmp_path / "r.html")
    assert result.exit_code == 2, result.output
    assert "pip install 'autoplace[plot]'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_a_page_written_into_a_pipe_leaves_the_pipe_a_pipe(tmp_path: Path) -> None:
    """--report /dev/null discards the page; a page renamed over the path would replace the device
    (a FIFO stands in for it here)."""
    import os
    import stat
    import threading

    from autoplace.report_html import write_page

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert write_page(fifo, "<p>page</p>") == len("<p>page</p>")
    reader.join(timeout=30)
    assert got == [b"<p>page</p>"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.parametrize(("schedule", "pp", "vpp", "m"), [
    ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2), ("1f1b", 8, 1, 16), ("interleaved", 4, 2, 8), ("interleaved", 8, 4, 16),
    ("interleaved", 2, 3, 2),
])
def test_the_drawn_schedule_idles_as_the_cost_model_says(schedule: str, pp: int, vpp: int, m: int) -> None:
    """Idle share of the laid-out span: bubble / (work + bubble) with the bubble (p - 1) / v stage
    times against m of work (autoplace/cost/step.py: bubble_time; Narayanan et al. 2021, Sec. 2.2)."""
    ops = lay_out(schedule, pp, vpp, m)
    assert idle_share(ops, pp) == pytest.approx((pp - 1) / (vpp * m + pp - 1))
    assert len(ops) == 2 * pp * m * (vpp if schedule == "interleaved" else 1)
    ends = {(op.kind, op.chunk * pp + op.device, op.micro): op for op in ops}
    for op in ops:  # every pass starts after its input: the stage before (forward), the stage after (backward)
        stage = op.chunk * pp + op.device
        before = ends.get(("F", stage - 1, op.micro)) if op.kind == "F" else \
            ends.get(("B", stage + 1, op.micro)) or ends[("F", stage, op.micro)]
        assert before is None or before.end <= op.start + 1e-9
    by_device: dict[int, list] = {}
    for op in ops:
        by_device.setdefault(op.device, []).append(op)
    for row in by_device.values():  # one pass at a time per device
        row.sort(key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(row, row[1:], strict=False))


@pytest.mark.parametrize(("schedule", "pp", "vpp", "m"), [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2), ("interleaved", 4, 2, 8), ("interleaved", 8, 4, 16),
])
def test_the_drawn_schedule_holds_the_activations_the_cost_model_counts(schedule: str, pp: int, vpp: int,
                                                                        m: int) -> None:
    """Micro-batches in flight on each device at its fullest (forwards begun, backwards not yet
    ended) are what the memory model charges (autoplace/cost/memory.py: inflight_microbatches)."""
    import numpy as np

    from autoplace.cost.memory import SCHEDULE_CODES, inflight_microbatches

    ops = lay_out(schedule, pp, vpp, m)
    for d in range(pp):
        held, peak = 0, 0
        for op in sorted((o for o in ops if o.device == d), key=lambda o: o.start):
            held += 1 if op.kind == "F" else -1
            peak = max(peak, held)
        expected = inflight_microbatches(np.array(SCHEDULE_CODES[schedule]), np.array(pp), np.array(vpp), np.array(m), np.array(d))
        assert peak / (vpp if schedule == "interleaved" else 1) == pytest.approx(float(expected)), d


def test_a_long_step_draws_whole_rounds() -> None:
    assert drawn_microbatches("1f1b", 4, 512) == 8
    assert drawn_microbatches("interleaved", 6, 300) == 12
    assert drawn_microbatches("1f1b", 4, 3) == 3


def test_a_scale_report_without_a_token_budget_says_it_has_no_deadline(tmp_path: Path) -> None:
    """Found by benchmarks/fuzz.py: without --tokens scale has no deadline (None in its JSON), and the page's
    header read its days (TypeError, an internal error)."""
    page = tmp_path / "scale.html"
    result = invoke("scale", MODELS / "tiny-llama.json", "--gpu", "h100", "--gpus", "1,2", "--time-limit", "0.5",
                    "--report", page, "--json")
    assert result.exit_code == 0, result.output
    assert "no deadline (no token budget: --tokens)" in page.read_text()
    # every size's plan carries the 95% band as solve's plans do (its chart draws the chosen one's)
    for point in json.loads(result.stdout)["points"]:
        low, high = point["plan"]["step_time_band_95_s"]
        assert low < point["plan"]["step_time_s"] < high


def test_tune_refuses_a_report_path_before_any_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autoplace.tune

    monkeypatch.setattr(autoplace.tune, "run_tune", lambda *a, **k: pytest.fail("trials ran"))
    result = invoke("tune", MODELS / "tiny-llama.json", MODELS.parent / "clusters" / "cpu-2.yaml", "--out", tmp_path,
                    "--report", tmp_path / "missing" / "study.html")
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "--report" in result.stderr and "does not exist" in result.stderr


def test_a_study_with_no_measured_trial_says_so_and_lists_why() -> None:
    """Every trial failed (a crash, a duplicate): no scatter, no best, each trial's state and reason in the table."""
    from autoplace.report_tune import tune_page

    trial = {"number": 0, "plan": "dp_shard=2,zero=3", "bucket_mb": 25, "state": "FAIL", "nccl": "",
             "reason": "crash: exit 1", "predicted_step_s": 0.07, "measured_step_s": None, "tokens_per_s": None,
             "peak_rss_bytes": None, "deviation": None, "error": None}
    text = tune_page({"study": "s", "storage": "sqlite:///s.db", "dashboard": ["optuna-dashboard", "sqlite:///s.db"],
                      "ran": 1, "best": None, "trials": [trial], "notes": []})
    assert "No trial measured a step" in text and "FAIL (crash: exit 1)" in text and "<svg" not in text
    assert 'data-json="trials.0.predicted_step_s"' in text and 'data-json="trials.0.measured_step_s"' not in text


def test_each_dimension_s_bytes_split_over_the_tiers_its_group_crosses() -> None:
    """tier_bytes on 8 nodes of 8 H100: tensor parallel inside a node is all NVLink, pipeline sends
    across nodes all network, and a data-parallel group of 16 ranks, 4 to a node, sends the
    hierarchical ring's shares (by hand: 3/4 of a buffer inside the node, 3/4 of its quarter across)."""
    from autoplace.cost.layers import layer_table
    from autoplace.evaluation import evaluate
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.report import tier_bytes
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    model, cluster = load_model(MODELS / "llama-3-70b.json"), load_cluster(MODELS.parent / "clusters" / "8x8-h100.yaml")
    plan = build_plan(parse_plan_string("tp=2,pp=2,zero=1"), world=64, blocks=layer_table(model).blocks,
                      global_batch=model.training.global_batch, gpus_per_node=8)
    ev = evaluate(model, cluster, plan)
    split = tier_bytes(ev, cluster)
    pool = cluster.pools[0]
    nvlink, network = pool.intra_node.name, pool.inter_node.name
    for dim, tiers in split.items():
        assert sum(tiers.values()) == pytest.approx(ev.comm[dim]), dim
    assert set(split["tp"]) == {nvlink} and set(split["pp"]) == {network}
    inside, across = 3 / 4, 3 / 4 / 4
    assert split["dp"][nvlink] / ev.comm["dp"] == pytest.approx(inside / (inside + across))


def test_the_timeline_draws_each_stage_s_own_time() -> None:
    """A first stage twice as slow (its embedding, say) runs each pass twice as long; the others keep theirs."""
    ops = lay_out("interleaved", 4, 2, 8, forward=[2.0, 1.0, 1.0, 1.0])
    for op in ops:
        width = (2.0 if op.device == 0 else 1.0) * (1 if op.kind == "F" else 2) / 2
        assert op.end - op.start == pytest.approx(width)
    assert max(o.end for o in ops) > max(o.end for o in lay_out("interleaved", 4, 2, 8))


def test_evaluate_and_explain_carry_solve_s_95_percent_band() -> None:
    """One rule for the band (solving.add_band): evaluate's and explain's plan hold it as solve's plans do."""
    import json

    for command in ("evaluate", "explain"):
        result = invoke(command, LLAMA_8B, A100_8, "--plan", "tp=2,pp=2", "--json")
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout)["plan"]
        low, high = plan["step_time_band_95_s"]
        assert low < plan["step_time_s"] < high and plan["step_time_band_source"].startswith("published runs on")
        assert len(plan["stage_time_per_microbatch_s"]) == 2


def test_a_solve_with_out_lists_every_bundle_file_on_its_page(tmp_path: Path) -> None:
    import json

    page = tmp_path / "r.html"
    result = invoke("solve", MODELS / "tiny-llama.json", A100_8, "--time-limit", "10", "--out", tmp_path / "b",
                    "--json", "--report", page)
    assert result.exit_code == 0, result.output
    doc, text = json.loads(result.stdout), page.read_text()
    bundles = {"plan 1": doc["bundle"]} | {f: b["files"] for f, b in doc["framework_bundles"].items() if b["written"]}
    assert len(bundles) > 1
    for files in bundles.values():
        readme = Path(files["README.txt"]).read_text()
        for name, path in files.items():
            assert f"<code>{name}</code>" in text
            assert f"{Path(path).stat().st_size / 1e3:,.1f} kB" in text
        for line in readme.splitlines()[4:]:
            name, _, what = line.partition(": ")
            if name in files:  # each file's line of its README.txt, beside it
                import html

                assert html.escape(what) in text, line


def test_tune_s_optuna_plots_leave_the_report_s_style_alone(tmp_path: Path) -> None:
    """optuna's matplotlib plots set plt.style "ggplot" for good: the tune page drawn after them had grey charts."""
    import matplotlib
    import optuna

    from autoplace.tune import save_plots

    style = ("axes.facecolor", "axes.grid", "axes.edgecolor", "grid.color", "axes.prop_cycle")
    before = {k: matplotlib.rcParams[k] for k in style}
    study = optuna.create_study()
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert save_plots(study, tmp_path)
    assert {k: matplotlib.rcParams[k] for k in style} == before
