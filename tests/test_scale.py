"""autoplace scale: the sweep never loses throughput as GPUs are added, the cheapest size differs
from the fastest, bad input is one line and exit 2, and the cost flags of solve and evaluate."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from autoplace import sweep as sweep_mod
from autoplace.cli import app
from autoplace.specs.model import load_model
from autoplace.sweep import DEFAULT_DAYS, SweepOptions, choice_lines, choose, cluster_at, decide, sweep

REPO = Path(__file__).resolve().parents[1]
MODEL = str(REPO / "examples" / "models" / "llama-3-8b.json")
TINY = str(REPO / "examples" / "models" / "tiny-llama.json")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_cluster_at_uses_the_profiles_node() -> None:
    assert (cluster_at(4, gpu="h100").gpus, cluster_at(4, gpu="h100").gpus_per_node) == (4, 4)
    c = cluster_at(64, gpu="h100")
    assert (c.pools[0].nodes, c.gpus_per_node, c.pools[0].intra_node.name, c.pools[0].inter_node.name) == \
        (8, 8, "nvlink4", "ib-ndr")


def _fake(tps: dict[int, float | None]) -> Any:
    """A stand-in for the solver: the throughput it 'finds' at each size (None: nothing fits)."""
    def best_plan(model: Any, cluster: Any, opts: Any) -> Any:
        value = tps[cluster.gpus]
        if value is None:
            return None, "infeasible", 0.0
        plan = SimpleNamespace(to_string=lambda: f"plan@{cluster.gpus}")
        return SimpleNamespace(tokens_per_s=value, mfu=0.4, plan=plan), "optimal", 0.0
    return best_plan


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(1.0, 1e6)), min_size=1, max_size=6))
def test_throughput_never_drops_whatever_the_search_finds(found: list[float | None]) -> None:
    counts = [8 * 2**k for k in range(len(found))]
    model = load_model(TINY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_mod, "best_plan", _fake(dict(zip(counts, found, strict=True))))
        mp.setattr(sweep_mod.search, "runnable_by", lambda *a: [])
        points = sweep(model, counts, SweepOptions(tokens=1e9, price_per_gpu_hour=1.0), gpu="h100")
    tps = [p.tokens_per_s for p in points]
    assert tps == sorted(tps)
    for p, value in zip(points, found, strict=True):
        kept = p.evaluation is not None and (value is None or p.tokens_per_s > value)
        assert (p.used_gpus < p.gpus) == kept and (("GPUs used" in p.note) == kept)
        if p.cost is not None:  # idle GPUs are paid for
            assert p.cost.gpus == p.gpus


def test_cheapest_is_not_the_fastest() -> None:
    """Scaling efficiency below 1: the fastest size is the largest, the cheapest to a budget smaller."""
    counts = [8, 16, 32]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_mod, "best_plan", _fake({8: 1000.0, 16: 1900.0, 32: 3400.0}))
        mp.setattr(sweep_mod.search, "runnable_by", lambda *a: [])
        points = sweep(load_model(TINY), counts, SweepOptions(tokens=1e12, price_per_gpu_hour=2.0), gpu="h100")
    fastest, cheapest = choose(points, "time"), choose(points, "cost")
    assert fastest is not None and cheapest is not None
    assert (fastest.gpus, cheapest.gpus) == (32, 8)
    assert cheapest.cost and fastest.cost and cheapest.cost.cost < fastest.cost.cost  # type: ignore[operator]
    # a deadline rules the cheap, slow size out: 1e12 / 1000 tokens/s = 11,574 days
    limited = choose(points, "cost", days=8000)
    assert limited is not None and limited.gpus == 16


def _three_sizes(opts: SweepOptions) -> list[Any]:
    """8, 16 and 32 GPUs at 1,000, 1,900 and 3,400 tokens/s: the smaller, the cheaper and the slower."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_mod, "best_plan", _fake({8: 1000.0, 16: 1900.0, 32: 3400.0}))
        mp.setattr(sweep_mod.search, "runnable_by", lambda *a: [])
        return sweep(load_model(TINY), [8, 16, 32], opts, gpu="h100")


def test_the_cheapest_size_is_held_to_a_deadline() -> None:
    """Issue 36: 'cheapest: 8 GPUs' trained 15T tokens in 56 years.  Without --days the cheapest is the
    cheapest within DEFAULT_DAYS, and the fastest says what it costs; with --days, within those days;
    a deadline no size meets names how long the fastest takes."""
    def answer(**kw: Any) -> tuple[Any, list[str]]:
        opts = SweepOptions(tokens=1e10, price_per_gpu_hour=2.0, **kw)  # 8 GPUs: 116 days, 16: 61, 32: 34
        choice = decide(_three_sizes(opts), opts)
        return choice, choice_lines(choice, opts)

    choice, lines = answer()
    assert DEFAULT_DAYS == 90 and choice.deadline == 90
    assert (choice.chosen.gpus, choice.fastest.gpus, choice.cheapest.gpus) == (32, 32, 16)
    assert lines[0].startswith("chosen (time: fastest): 32 GPUs") and "$" in lines[0]
    assert lines[1].startswith("cheapest within 90 days (the default: ") and ": 16 GPUs" in lines[1]
    assert not any("8 GPUs" in line for line in lines)  # cheaper, but 116 days
    choice, lines = answer(objective="cost")
    assert choice.chosen.gpus == 16 and lines[1].startswith("fastest: 32 GPUs") and "$" in lines[1]
    choice, lines = answer(days=200.0)
    assert choice.cheapest.gpus == 8 and lines[1].startswith("cheapest within 200 days: 8 GPUs")
    choice, lines = answer(days=10.0)  # none trains 1e10 tokens in 10 days
    assert choice.missed and choice.chosen is None
    assert len(lines) == 1 and lines[0].startswith("no size trains 10B tokens within 10 days: the fastest, 32 GPUs, "
                                                   "3,400 tokens/s · 10B tokens: 34.0 days")
    choice, lines = answer(days=10.0, objective="cost")
    assert choice.missed and choice.chosen is None and lines[0].startswith("no size trains 10B tokens within 10 days")
    assert decide(_three_sizes(SweepOptions()), SweepOptions()).deadline is None  # no budget: no days to hold to


def test_a_deadline_no_size_meets_exits_3_and_says_the_fastest() -> None:
    args = ["scale", TINY, "--gpu", "h100", "--gpus", "1,2", "--tokens", "100T", "--time-limit", "0.2", "--workers", "1"]
    result = invoke(*args, "--days", "1")
    assert result.exit_code == 3, result.output
    assert "no size trains 100T tokens within 1 day: the fastest, 2 GPUs" in " ".join(result.stdout.split())
    doc = json.loads(invoke(*args, "--days", "1", "--json").stdout)
    assert doc["deadline"] == {"days": 1.0, "source": "--days", "why": None, "met": False}
    assert (doc["chosen_gpus"], doc["fastest_gpus"], doc["cheapest_gpus"]) == (None, 2, None)
    default = json.loads(invoke(*args, "--json").stdout)
    assert default["deadline"]["source"] == "default" and default["deadline"]["days"] == DEFAULT_DAYS


def test_scale_cli_cost_objective_picks_fewer_gpus_than_the_fastest(tmp_path: Path) -> None:
    png = tmp_path / "scale.png"
    result = invoke("scale", MODEL, "--gpu", "h100", "--gpus", "8,16,32", "--tokens", "1T",
                    "--price-per-gpu-hour", "2.5", "--objective", "cost", "--time-limit", "0.5", "--workers", "1",
                    "--json", "--png", str(png))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    points = {p["gpus"]: p for p in doc["points"]}
    assert [p["gpus"] for p in doc["points"]] == [8, 16, 32]
    tps = [p["tokens_per_s"] for p in doc["points"]]
    assert tps == sorted(tps)
    fastest = max(doc["points"], key=lambda p: p["tokens_per_s"])
    assert doc["chosen_gpus"] < fastest["gpus"]
    chosen = points[doc["chosen_gpus"]]["training_cost"]
    assert chosen["cost"] < fastest["training_cost"]["cost"]
    assert chosen["cost"] == pytest.approx(chosen["gpu_hours"] * 2.5)
    assert png.stat().st_size > 1000 and doc["batch_advice"]["source"].startswith("Kaplan")


def test_scale_table_says_the_batch_policy_and_the_runtime() -> None:
    result = invoke("scale", TINY, "--gpu", "h100", "--gpus", "1..16", "--time-limit", "0.2", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert "global batch: 8 sequences at every size" in result.stdout
    assert "sweep: 5 sizes in" in result.stdout
    assert "B_crit from Kaplan et al. 2020 eq. 1.4" in result.stdout


@pytest.mark.parametrize("args,flag", [
    (["scale", MODEL, "--gpu", "h100", "--gpus", "8..x"], "--gpus"),
    (["scale", MODEL, "--gpu", "h100", "--tokens", "15Q"], "--tokens"),
    (["scale", MODEL, "--gpus", "8..16"], "--gpu"),
    (["scale", MODEL, "--gpu", "h100", "--gpus", "12"], "--gpus"),
    (["scale", MODEL, "--gpu", "h100", "--days", "3"], "--days"),
    (["scale", MODEL, "--gpu", "h100", "--max-days", "3"], "--days"),
    (["scale", MODEL, "--gpu", "h100", "--tokens", "1T", "--days", "0"], "--days"),
    (["scale", MODEL, "--gpu", "h100", "--tokens", "1T", "--days", "-2"], "--days"),
    (["scale", MODEL, "--gpu", "h100", "--tokens", "1T", "--days", "inf"], "--days"),
    (["solve", MODEL, "--cluster", "1x8xh100", "--tokens", "15Q"], "--tokens"),
    (["evaluate", MODEL, "--cluster", "1x8xh100", "--plan", "tp=2", "--noise-scale", "x"], "--noise-scale"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], flag: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0]


def test_evaluate_and_solve_print_time_and_cost() -> None:
    ev = invoke("evaluate", MODEL, "--cluster", "1x8xh100", "--plan", "tp=2,zero=1", "--tokens", "1T",
                "--price-per-gpu-hour", "2", "--json")
    assert ev.exit_code == 0, ev.output
    doc = json.loads(ev.stdout)
    tc = doc["training_cost"]
    assert tc["days"] == pytest.approx(1e12 / doc["plan"]["tokens_per_s"] / 86400, rel=1e-3)
    assert tc["cost"] == pytest.approx(tc["gpu_hours"] * 2) and tc["gpu_hours"] == pytest.approx(8 * tc["days"] * 24)
    table = invoke("solve", MODEL, "--cluster", "1x8xh100", "--objective", "cost", "--tokens", "1T",
                   "--price-per-gpu-hour", "2", "--time-limit", "0.5", "--workers", "1", "--target-loss", "1.5")
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())  # lines wrap at 100 columns
    assert "time and cost: 1T tokens:" in text and "target loss 1.500 nats" in text


def test_a_cluster_file_is_the_unit_and_a_batch_range_is_searched() -> None:
    unit = str(REPO / "examples" / "clusters" / "1x8-a100-80gb.yaml")
    result = invoke("scale", TINY, "--cluster", unit, "--gpus", "1,2,16", "--global-batch", "4..8",
                    "--time-limit", "0.2", "--workers", "1", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["gpu"] == "a100-sxm4-80gb" and doc["global_batches"] == [4, 8]
    assert [p["cluster"] for p in doc["points"]] == ["1x1xa100-sxm4-80gb", "1x2xa100-sxm4-80gb", "2x8xa100-sxm4-80gb"]
    assert all(p["global_batch"] in (4, 8) for p in doc["points"])
    effective = [p["effective_tokens_per_s"] for p in doc["points"]]
    assert effective == sorted(effective)
