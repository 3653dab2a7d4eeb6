"""Work CP-SAT shares between the solves a framework runs in turn (a deeper search for more plans), and
the bounds a scored space gives another problem (objective, pinned recompute)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import solvers.space
from solvers.problem import OBJECTIVES, Budget, Problem
from solvers.registry import get_solver
from solvers.space import enumerate_configs, score_space
from tests.helpers import gpu_cluster
from tests.test_solvers import _model

MODES = ("none", "selective", "full")


def _runs(objective: str = "time") -> list[Problem]:
    problem = Problem(_model(8, 512, 16), gpu_cluster(8, gpu="a100-sxm4-40gb"), top_k=2, objective=objective)
    return [problem] + [dataclasses.replace(problem, fixed={"recompute": mode}) for mode in MODES]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_bounds_read_off_a_scored_space_are_the_bounds_scored_afresh(objective: str) -> None:
    runs = _runs(objective)
    configs = enumerate_configs(runs[0])
    first = score_space(runs[0], configs)
    for run in runs:
        derived, alone = first.for_problem(run), score_space(run, configs)
        assert derived.problem is run
        assert np.array_equal(derived.lower_bound, alone.lower_bound)
        assert np.array_equal(derived.memory_lb, alone.memory_lb)


def test_deeper_solves_score_once_and_find_the_same_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _runs()[0]
    runs = [first, dataclasses.replace(first, top_k=6), dataclasses.replace(first, top_k=18)]
    alone = [get_solver("cpsat").solve(run, Budget(time_limit_s=60)) for run in runs]
    scorings = []
    real = solvers.space.summarize
    monkeypatch.setattr(solvers.space, "summarize", lambda *a: scorings.append(1) or real(*a))
    solver = get_solver("cpsat")
    shared = [solver.solve(run, Budget(time_limit_s=60)) for run in runs]
    once = len(scorings)
    scorings.clear()
    for run in runs:
        get_solver("cpsat").solve(run, Budget(time_limit_s=60))
    assert once * len(runs) == len(scorings)  # one scoring pass instead of one per solve
    for a, b in zip(alone, shared, strict=True):
        assert a.status == b.status == "optimal"
        assert [ev.plan for ev in a.plans] == [ev.plan for ev in b.plans]


def test_plans_scored_together_are_scored_as_they_are_alone() -> None:
    """A solve re-scores its top plans in one pass (evaluate_many): stages padded to the deepest
    pipeline change nothing -- every number, violation and stage is what evaluate gives alone."""
    from autoplace.cost.layers import layer_table
    from autoplace.evaluation import evaluate, evaluate_many
    from autoplace.plan import build_plan, parse_plan_string

    model, cluster = _model(16, 4096, 128, seq=2048), gpu_cluster(16, gpu="a100-sxm4-40gb")
    table = layer_table(model)
    texts = ["dp=16,zero=1", "tp=2,pp=4,mbs=2,recompute=selective", "pp=8,vpp=2,zero=1,recompute=full",
             "tp=8,pp=2,zero=3,mbs=4", "dp=2,tp=8,zero=0,mbs=64"]  # the last does not fit
    plans = [build_plan(parse_plan_string(t), world=cluster.gpus, blocks=table.blocks,
                        global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node) for t in texts]
    together = evaluate_many(model, cluster, plans)
    alone = [evaluate(model, cluster, p) for p in plans]
    assert [ev.to_dict() for ev in together] == [ev.to_dict() for ev in alone]
    assert any(v.rule == "out-of-memory" for v in together[-1].violations)
