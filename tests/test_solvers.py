"""Contract tests run on every back end, and CP-SAT against the exhaustive oracle."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.errors import Infeasible
from autoplace.specs.model import model_from_dict
from solvers.problem import FEATURES, Budget, Problem, objective_key
from solvers.registry import get_solver
from tests.helpers import REPO, gpu_cluster

BACKENDS = ["cpsat", "exhaustive"]


def _model(layers: int, hidden: int, batch: int, seq: int = 512):
    return model_from_dict({"name": "small", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                            "heads": 8, "kv_heads": 4, "vocab": 4096, "seq_len": seq,
                            "training": {"global_batch": batch}})


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_plans_are_rescored_sorted_and_fit(backend: str) -> None:
    problem = Problem(_model(8, 512, 16), gpu_cluster(4, gpu="a100-sxm4-40gb"), top_k=3)
    result = get_solver(backend).solve(problem, Budget(time_limit_s=600))
    assert result.status == "optimal"
    assert 1 <= len(result.plans) <= 3
    keys = [objective_key(ev, "time") for ev in result.plans]
    assert keys == sorted(keys)
    assert len({ev.plan.to_string() for ev in result.plans}) == len(result.plans)  # distinct
    for ev in result.plans:
        assert ev.ok, ev.violations
        assert ev.plan.world == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_fix_pins_the_plan(backend: str) -> None:
    problem = Problem(_model(8, 512, 16), gpu_cluster(4, gpu="a100-sxm4-40gb"), fixed={"tp": 2, "zero": 1}, top_k=2)
    for ev in get_solver(backend).solve(problem, Budget(time_limit_s=20)).plans:
        assert ev.plan.tp == 2 and ev.plan.zero == 1


ALL_FEATURES = frozenset(FEATURES) - {"tp-across-nodes"}  # what a one-node cluster can use


def _moe_model(layers: int, hidden: int, batch: int, seq: int, dense: int = 1, every: int = 1,
               window: int | None = None, flash: bool = True):
    """A DeepSeek-style stack: ``dense`` dense first layers, then an MoE block every ``every``
    layers (two block kinds); with a sliding ``window`` two layers in three windowed (four);
    without ``flash`` attention selective recompute saves the attention scores."""
    attention = {"sliding_window": window, "full_attention_every": 3} if window else {}
    attention = {**attention, "flash_attention": flash}
    return model_from_dict({"name": "small-moe", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
                            "heads": 8, "kv_heads": 4, "vocab": 4096, "seq_len": seq, **attention,
                            "moe": {"experts": 4, "top_k": 2, "expert_ffn_hidden": hidden, "first_dense_layers": dense,
                                    "layer_freq": every},
                            "training": {"global_batch": batch}})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([4, 6, 8, 12]), hidden=st.sampled_from([256, 512, 1024]),
       gpus=st.sampled_from([2, 4, 8, 16]),
       batch=st.sampled_from([8, 16]), objective=st.sampled_from(["time", "comm", "memory"]),
       gpu=st.sampled_from(["a100-sxm4-40gb", "v100-sxm2-32gb"]), seq=st.sampled_from([512, 2048]),
       moe=st.booleans())
def test_cpsat_optimum_equals_exhaustive(layers: int, hidden: int, gpus: int, batch: int, objective: str,
                                         gpu: str, seq: int, moe: bool) -> None:
    """On instances small enough to enumerate, CP-SAT's optimum is the oracle's (docs/ARCHITECTURE.md),
    with every feature on (cp, ep, offload, interleave, hsdp) and with one or two block kinds.
    (The oracle's cost grows with every stage split and recompute choice: 12 layers on 16 GPUs
    take it half a minute, 16 layers minutes; 8 layers already reach pp = 8.)"""
    if gpus == 16:
        layers = min(layers, 8)
    model = _moe_model(min(layers, 6), hidden, batch, seq) if moe else _model(layers, hidden, batch, seq)
    problem = Problem(model, gpu_cluster(gpus, gpu=gpu), objective=objective, top_k=1, features=ALL_FEATURES)
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=300))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=300))
    assert a.status == b.status
    if a.disagreement is not None:  # CP-SAT's own objective value is the evaluator's (integer rounding aside)
        assert a.disagreement <= 1e-5
    if a.plans:  # optimal: the proven bound is the optimum (up to the same rounding)
        assert a.gap is not None and a.gap <= 1e-5
    if b.plans:
        assert objective_key(a.plans[0], objective)[0] == pytest.approx(objective_key(b.plans[0], objective)[0],
                                                                         rel=1e-6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.sampled_from([(1, 1, None), (2, 1, None), (2, 2, None), (1, 2, 256)]), flash=st.booleans(),
       layers=st.sampled_from([5, 6]), hidden=st.sampled_from([512, 1024]), gpus=st.sampled_from([2, 4, 8]),
       objective=st.sampled_from(["time", "comm", "memory"]), gpu=st.sampled_from(["a100-sxm4-40gb", "v100-sxm2-32gb"]),
       seq=st.sampled_from([512, 4096]), fix=st.sampled_from([{}, {"recompute": "full"}, {"recompute": "none"},
                                                             {"layers": "halves"}]))
def test_cpsat_top_k_equals_exhaustive_with_several_block_kinds(kinds: tuple[int, int, int | None], flash: bool,
                                                                 layers: int, hidden: int, gpus: int, objective: str,
                                                                 gpu: str, seq: int, fix: dict[str, str]) -> None:
    """Dense first layers, MoE every k-th layer, windowed attention (two to four block kinds,
    :mod:`solvers.tables_mixed`): CP-SAT's top-3 objectives are the oracle's, pinned or not."""
    dense, every, window = kinds
    if fix.get("layers") == "halves":  # a two-stage split of this depth (a split must add up to the layers)
        fix = {"layers": f"{layers // 2}:{layers - layers // 2}"}
    model = _moe_model(layers, hidden, 16, seq, dense=dense, every=every, window=window, flash=flash)
    problem = Problem(model, gpu_cluster(gpus, gpu=gpu), objective=objective, top_k=3, features=ALL_FEATURES,
                      fixed=fix)
    try:
        b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=300))
    except Infeasible:
        return
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=300))
    assert a.status == b.status
    if a.plans:
        assert a.gap is not None and a.gap <= 1e-5
    assert [objective_key(ev, objective)[0] for ev in a.plans] == pytest.approx(
        [objective_key(ev, objective)[0] for ev in b.plans], rel=1e-6)


KNOBS = {"tp": [1, 2, 4], "pp": [1, 2, 4], "cp": [1, 2], "zero": [0, 1, 2, 3], "mbs": [1, 2, 4, 8, 16],
         "vpp": [1, 2, 3], "recompute": ["none", "selective", "full"], "offload_optimizer": ["none", "cpu"],
         "layers": ["4:8", "6:6", "8:4"]}


def test_no_single_fix_beats_the_free_solve() -> None:
    """Pinning any one knob to any value can only shrink the space: the free solve's optimum
    is at least as good as every pinned solve's (issue 12: the space is not clipped)."""
    problem = Problem(_model(12, 512, 32, 1024), gpu_cluster(4, gpu="a100-sxm4-40gb"), top_k=1, features=ALL_FEATURES)
    solver, budget = get_solver("cpsat"), Budget(time_limit_s=300)
    free = solver.solve(problem, budget)
    assert free.status == "optimal"
    best = free.plans[0].step_time_s
    pinned = 0
    for key, values in KNOBS.items():
        for value in values:
            try:
                result = solver.solve(dataclasses.replace(problem, fixed={key: value}), budget)
            except Infeasible:
                continue
            if result.plans:
                pinned += 1
                assert result.plans[0].step_time_s >= best * (1 - 1e-9), (key, value)
    assert pinned >= 15  # most pins leave a plan to compare


def test_infeasible_reports_the_nearest_plan() -> None:
    problem = Problem(_model(8, 4096, 8, seq=4096), gpu_cluster(1, gpu="v100-sxm2-32gb"),
                      features=frozenset())
    big = model_from_dict({"name": "too-big", "layers": 8, "hidden": 16384, "ffn_hidden": 65536, "heads": 8,
                           "vocab": 4096, "seq_len": 512, "training": {"global_batch": 8}})
    problem = Problem(big, gpu_cluster(1, gpu="v100-sxm2-32gb"), features=frozenset())
    result = get_solver("cpsat").solve(problem, Budget(time_limit_s=10))
    assert result.status == "infeasible" and not result.plans
    assert result.nearest is not None
    assert any(v.rule == "out-of-memory" and "short by" in v.message for v in result.nearest.violations)


def test_unknown_solver_lists_valid_names() -> None:
    from autoplace.errors import SolverError

    with pytest.raises(SolverError, match="cpsat"):
        get_solver("gurobi")


def test_cpsat_equals_exhaustive_at_the_largest_enumerable_size() -> None:
    """The issue's upper corner: 64 GPUs, 16 layers (the oracle takes ~7 s here)."""
    problem = Problem(_model(16, 1024, 64, 2048), gpu_cluster(64), top_k=1, features=frozenset({"interleave", "hsdp"}))
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=60))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=60))
    assert a.plans[0].step_time_s == pytest.approx(b.plans[0].step_time_s, rel=1e-6)


@pytest.mark.parametrize(("total", "parts", "step"), [(8, 1, 1), (8, 3, 1), (12, 3, 2), (12, 5, 2), (7, 2, 2), (6, 4, 1)])
def test_split_count_is_the_number_of_splits(total: int, parts: int, step: int) -> None:
    from solvers.exhaustive import compositions, count_compositions

    assert count_compositions(total, parts, step) == len(compositions(total, parts, step))


def test_exhaustive_refuses_an_oversized_space_before_scoring_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-3-8B on 8 GPUs has ~10^8 splits: the oracle says so without scoring anything."""
    import solvers.exhaustive as ex
    from autoplace.errors import SpecError
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    def never(*_: object) -> None:
        raise AssertionError("scored before refusing")

    monkeypatch.setattr(ex, "score_space", never)
    examples = Path(__file__).resolve().parents[1] / "examples"
    problem = Problem(load_model(examples / "models" / "llama-3-8b.json"), load_cluster(examples / "clusters" / "1x8-a100-80gb.yaml"))
    with pytest.raises(SpecError, match="would enumerate .* splits") as exc:  # bad input: exit 2
        get_solver("exhaustive").solve(problem, Budget())
    assert exc.value.exit_code == 2 and str(exc.value).startswith("--solver: ")


def test_a_search_stopped_before_its_first_solution_returns_the_bounding_plan_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--time-limit bounds the whole solve: when CP-SAT is stopped before its first solution
    (forced here, so the test does not depend on the machine's speed), the best plan the bounding
    found comes back as 'feasible' with a note, and the CLI prints that the limit stopped it."""
    from rich.console import Console

    import solvers.cpsat as cpsat
    from autoplace.report import print_solution

    monkeypatch.setattr(cpsat, "_search", lambda *_: cpsat._Search(status="unknown"))
    problem = Problem(_model(8, 512, 16), gpu_cluster(4, gpu="a100-sxm4-40gb"), top_k=2)
    result = get_solver("cpsat").solve(problem, Budget(time_limit_s=600))
    assert result.status == "feasible" and len(result.plans) == 1 and result.plans[0].ok
    assert any("stopped the search before CP-SAT's first solution" in n for n in result.notes)
    free = get_solver("exhaustive").solve(problem, Budget(time_limit_s=600))
    assert result.plans[0].step_time_s >= free.plans[0].step_time_s * (1 - 1e-9)  # a real plan, not better than optimal
    assert result.gap is not None and result.gap >= 0
    doc = {"status": result.status, "objective": "time", "solve_seconds": 1.0, "gap": result.gap, "notes": [],
           "plans": [ev.to_dict(rank=1) for ev in result.plans], "advice": [], "model": {"name": "small", "params": 1},
           "cluster": problem.cluster.summary()}
    console = Console(record=True, width=200)
    print_solution(doc, result, console)
    assert "the time limit stopped the search" in console.export_text()


def test_a_time_limit_spent_before_enumeration_ends_stops_it_and_says_so() -> None:
    """--time-limit bounds enumeration too: with the limit spent at the start (a zero budget: no
    machine is fast enough, so the test does not depend on speed) enumeration stops after the
    first set of degrees that gives a configuration, and the answer is a real plan, 'feasible',
    with a note that the rest of the space was not searched."""
    problem = Problem(_model(8, 512, 16), gpu_cluster(8, gpu="a100-sxm4-40gb"), top_k=2)
    stopped = get_solver("cpsat").solve(problem, Budget(time_limit_s=0))
    full = get_solver("cpsat").solve(problem, Budget(time_limit_s=600))
    assert stopped.status == "feasible" and full.status == "optimal"
    assert stopped.n_evaluated < full.n_evaluated
    assert any("stopped enumeration and scoring" in n and "not searched" in n for n in stopped.notes)
    assert stopped.plans and stopped.plans[0].ok
    assert stopped.plans[0].step_time_s >= full.plans[0].step_time_s * (1 - 1e-9)


def test_a_time_limit_that_stops_the_search_before_any_plan_is_unknown_not_infeasible() -> None:
    """Llama-3-8B on 2 A100 40GB fits only at configurations enumeration reaches late: a zero budget
    stops it with nothing kept, and the answer is 'unknown' with the advice to raise --time-limit,
    never 'infeasible' (which says no plan exists); with time, the same problem is solved."""
    from rich.console import Console

    from autoplace.report import print_solution
    from autoplace.specs.model import load_model

    problem = Problem(load_model(str(REPO / "examples" / "models" / "llama-3-8b.json")),
                      gpu_cluster(2, gpu="a100-sxm4-40gb"), top_k=1)
    stopped = get_solver("cpsat").solve(problem, Budget(time_limit_s=0))
    assert (stopped.status, stopped.plans) == ("unknown", [])
    assert get_solver("cpsat").solve(problem, Budget(time_limit_s=600)).status == "optimal"
    doc = {"status": stopped.status, "objective": "time", "solve_seconds": 0.0, "gap": None, "notes": [], "plans": [],
           "advice": [], "model": {"name": "llama-3-8b", "params": 8e9}, "cluster": problem.cluster.summary()}
    console = Console(record=True, width=200)
    print_solution(doc, stopped, console)
    text = console.export_text()
    assert "no plan found in the time limit" in text and "raise --time-limit" in text


def test_scoring_past_its_deadline_keeps_the_groups_it_scored() -> None:
    """Scoring stops between groups (pipeline depths) once the deadline has passed: the space
    holds exactly the configurations it scored, marked stopped, with the bounds a full scoring
    gives them."""
    from solvers.space import enumerate_configs, score_space

    problem = Problem(_model(8, 512, 16), gpu_cluster(8, gpu="a100-sxm4-40gb"), top_k=2)
    configs = enumerate_configs(problem)
    full, cut = score_space(problem, configs), score_space(problem, configs, deadline=0.0)
    assert not configs.stopped and cut.configs.stopped and 0 < len(cut.configs) < len(configs)
    where = {cf: i for i, cf in enumerate(configs)}
    rows = [where[cf] for cf in cut.configs]
    assert {cf.pp for cf in cut.configs} == {configs[rows[0]].pp}  # one whole group: one pipeline depth
    assert np.allclose(cut.lower_bound, full.lower_bound[rows])


def test_fixed_layers_pin_the_pipeline_depth() -> None:
    """``--fix layers=3:5`` is a two-stage split: every plan has pp = 2 and exactly that split
    (configurations of another depth were enumerated with their splits left free)."""
    problem = Problem(_model(8, 512, 16), gpu_cluster(4, gpu="a100-sxm4-40gb"), fixed={"layers": "3:5"}, top_k=3)
    plans = get_solver("cpsat").solve(problem, Budget(time_limit_s=600)).plans
    assert plans and all(ev.plan.pp == 2 and ev.plan.layers_per_stage == (3, 5) for ev in plans)
