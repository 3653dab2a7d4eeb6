"""The bounds' fast paths equal the plain numpy they replace: the stage reductions of
:class:`solvers.bounds.Stages`, the memory phases' per-block bytes, and every field of
:func:`solvers.bounds.summarize`, against the code as it was, on the coefficient tables of
small spaces (groups of one pipeline depth, as scoring takes them, and rows of mixed depths,
as :meth:`solvers.space.Space.scored` takes them; one pool and two); and a deep pipeline's time
terms computed on its ends (:meth:`autoplace.cost.context.Context.ends`) against every stage's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from autoplace.cost.candidates import Candidates
from autoplace.cost.context import Context
from autoplace.cost.layers import LayerTable, layer_table
from autoplace.cost.step import bubble_shares
from autoplace.cost.terms import StageTerms
from autoplace.errors import Infeasible
from autoplace.frameworks import search
from autoplace.specs.cluster import ClusterSpec, load_cluster
from autoplace.specs.model import model_from_dict
from solvers.bounds import Stages, Summary, _recompute_time_lb, _shared, summarize
from solvers.problem import Problem
from solvers.space import Space, _groups, _terms, enumerate_configs, score_space, to_candidates
from tests.helpers import REPO, gpu_cluster

FEATURES = ["ep", "offload", "interleave", "hsdp", "cp"]


def _cluster(name: str) -> ClusterSpec:
    return load_cluster(REPO / "examples" / "clusters" / "mixed-a100-h100.yaml") if name == "mixed" \
        else gpu_cluster(int(name), gpu="a100-sxm4-40gb")


def _problem(layers: int, hidden: int, moe: bool, cluster: str, features: list[str], method: str = "full") -> Problem:
    spec: dict[str, Any] = {"name": "small", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden, "heads": 8,
                            "kv_heads": 4, "vocab": 32000, "seq_len": 4096,
                            "training": {"global_batch": 32, "method": method}}
    if moe:
        spec["moe"] = {"experts": 4, "top_k": 2, "expert_ffn_hidden": hidden, "first_dense_layers": 1}
    # the PEFT bundles run data parallel only, so --framework any plans LoRA without pipelines; the terms
    # are the cost model's, which the unfiltered space ("none") exercises at every depth
    framework = "any" if method == "full" else "none"
    return search.problem_for(framework, model_from_dict(spec), _cluster(cluster), fixed={}, features=set(features))


def _tables(layers: int, hidden: int, moe: bool, cluster: str, features: list[str], seed: int,
            method: str = "full") -> Iterator[tuple[Problem, LayerTable, Candidates, np.ndarray, StageTerms]]:
    """Every scoring group of a small space, then 40 random rows of it together (mixed depths):
    the problem, its layer table, the candidates, their costings and their tables."""
    problem = _problem(layers, hidden, moe, cluster, features, method)
    try:
        configs = enumerate_configs(problem)
    except Infeasible:
        return
    table = layer_table(problem.model)
    picks = [*_groups(configs, configs.costing),
             np.random.default_rng(seed).choice(len(configs), size=min(40, len(configs)), replace=False)]
    for rows in picks:
        cand = to_candidates(configs, table, rows=rows)
        yield problem, table, cand, configs.costing[rows], _terms(problem, table, cand, configs.costing[rows])


SPACES = dict(layers=st.sampled_from([4, 6, 9]), hidden=st.sampled_from([512, 4096, 8192]), moe=st.booleans(),
              cluster=st.sampled_from(["8", "32", "mixed"]),
              features=st.lists(st.sampled_from(FEATURES), unique=True), seed=st.integers(0, 2**16))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SPACES)
def test_summaries_are_the_plain_reductions(layers: int, hidden: int, moe: bool, cluster: str, features: list[str],
                                            seed: int) -> None:
    for _, table, cand, _, terms in _tables(layers, hidden, moe, cluster, features, seed):
        got, want = summarize(table, cand, terms), _reference_summary(table, cand, terms)
        for f in dataclasses.fields(Summary):
            a, b = getattr(got, f.name), getattr(want, f.name)
            assert a.shape == b.shape and np.array_equal(a, b), f.name
        _, per_block, _ = terms.phases
        np.testing.assert_allclose(per_block, np.einsum("cokp,csfp->csfk", terms.state_block, terms.state_live),
                                   rtol=1e-15, atol=0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SPACES)
def test_groups_sharing_a_pass_are_scored_as_alone(layers: int, hidden: int, moe: bool, cluster: str, features: list[str],
                                                   seed: int) -> None:
    """Small groups of a costing scored in one numpy pass (solvers.space._passes), as deep as its
    deepest pipeline, give each configuration the bounds and summary a pass of its own gives."""
    problem = _problem(layers, hidden, moe, cluster, features)
    try:
        configs = enumerate_configs(problem)
    except Infeasible:
        return
    together = score_space(problem, configs)
    table = layer_table(problem.model)
    parts = []
    for rows in _groups(configs, configs.costing):  # a pass of its own each, as score_space took them
        cand = to_candidates(configs, table, rows=rows)
        parts.append((rows, summarize(table, cand, _terms(problem, table, cand, configs.costing[rows]))))
    alone = Summary.stack(parts, len(configs))
    want = Space.of(problem, configs, table, alone)  # each configuration bounded in each of its recompute forms
    assert np.array_equal(together.lower_bound, want.lower_bound) and np.array_equal(together.memory_lb, want.memory_lb)
    for f in dataclasses.fields(Summary):
        assert np.array_equal(getattr(together.summary, f.name), getattr(alone, f.name)), f.name


@pytest.mark.parametrize(("layers", "hidden", "moe", "cluster", "features", "method"), [
    (9, 4096, True, "32", ["interleave", "offload"], "full"), (8, 8192, False, "8", ["hsdp", "cp"], "full"),
    (6, 512, True, "32", ["ep", "interleave"], "full"), (9, 8192, True, "mixed", ["interleave"], "full"),
    (8, 4096, False, "32", ["offload"], "lora"), (9, 4096, True, "8", ["interleave"], "qlora")])
def test_time_terms_on_the_ends_are_every_stages(monkeypatch: pytest.MonkeyPatch, layers: int, hidden: int,
                                                 moe: bool, cluster: str, features: list[str], method: str) -> None:
    """A deep pipeline's time terms and edge states computed on its first, second and last stages and spread
    (Context.ends) are the ones computed on every stage, to the bit and in the same layout."""
    spread = 0
    for problem, table, cand, costing, terms in _tables(layers, hidden, moe, cluster, features, 0, method):
        with monkeypatch.context() as m:
            m.setattr(Context, "ends", lambda self: None)
            every = _terms(problem, table, cand, costing)
        spread += cand.counts.shape[1] > 3 and cluster != "mixed" and bool((cand.pp == cand.pp.max()).all())
        for f in dataclasses.fields(StageTerms):
            a, b = getattr(terms, f.name), getattr(every, f.name)
            if isinstance(a, np.ndarray):
                assert a.shape == b.shape and np.array_equal(a, b), f.name
                assert a.flags.c_contiguous == b.flags.c_contiguous, f.name
    assert spread or cluster == "mixed"  # pipelines deep enough to spread (on one pool)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stages=st.integers(1, 6), trailing=st.lists(st.integers(1, 3), max_size=2))
def test_stage_reductions_are_numpys(data: st.DataObject, stages: int, trailing: list[int]) -> None:
    """Stages.sum / min / max over the real stages (pp of each row) equal numpy's reductions of
    the masked array, also for arrays whose stage axis broadcasts (length 1)."""
    pp = np.array(data.draw(st.lists(st.integers(1, stages), min_size=1, max_size=5)))
    width = data.draw(st.sampled_from([1, stages]))
    x = data.draw(hnp.arrays(float, (len(pp), width, *trailing), elements=st.floats(-1e6, 1e6)))
    s = Stages(pp, stages)
    real = np.broadcast_to(s.mask.reshape(s.mask.shape + (1,) * len(trailing)), (len(pp), stages, *trailing))
    full = np.broadcast_to(x, real.shape)
    assert np.array_equal(s.min(x, len(trailing)), np.where(real, full, np.inf).min(1))
    assert np.array_equal(s.max(x, len(trailing), fill=0.0), np.where(real, full, 0.0).max(1) if width > 1
                          else x[:, 0])  # a stage-constant array: its one value (every row has a real stage)
    if width == stages:
        assert np.array_equal(s.sum(x, len(trailing)), np.where(real, x, 0.0).sum(1))


# -- the code as it was --

def _reference_summary(table: LayerTable, cand: Candidates, terms: StageTerms) -> Summary:
    st = Stages(cand.pp, cand.counts.shape[1])
    mask = st.mask
    t_sum = _shared(terms.t_block).sum(-1)
    n_kind = np.bincount(np.asarray(table.sequence), minlength=len(table.kinds)).astype(float)
    rest_blocks = np.where(mask[..., None], terms.gather_block + terms.opt_block, np.inf).min(axis=1)
    static, per_block, mult = terms.phases  # its per-block bytes against the einsum they were: above
    static_real = st.where(static, 0, 1)
    t_min = st.where(t_sum, np.inf, 2).min(axis=1)
    return Summary(
        n_kind=n_kind, pp=cand.pp.astype(float), ga=cand.ga.astype(float), vpp=cand.vpp.astype(float),
        share=bubble_shares(cand.schedule),
        static_time=st.where(terms.t_static.sum(-1), 0).sum(1), t_min=t_min,
        recompute=_recompute_time_lb(terms, st, n_kind, t_min),
        rest=np.where(mask, terms.gather_static + terms.opt_static, 0).sum(1) + (rest_blocks * n_kind).sum(-1),
        static_mem=static_real.sum(1), static_max=static_real.max(1), state=st.where(per_block, np.inf, 2).min(1),
        mult_min=st.where(mult, np.inf, 1).min(1), act=terms.act_block[:, 0],
        cap_max=st.where(_shared(terms.capacity), 0).max(1),
        comm_static=np.where(mask[..., None], terms.bytes_static, 0).sum((1, 2)),
        comm_block=terms.bytes_block[:, 0].sum(-1),
        split_fits=_reference_split_fits(terms, st, cand, table.blocks, n_kind, per_block),
        host_fits=_reference_host_fits(terms, mask, n_kind))


def _reference_host_fits(terms: StageTerms, mask: np.ndarray, n_kind: np.ndarray) -> np.ndarray:
    host_block = np.where(mask[..., None], terms.host_block, np.inf).min(1)
    total = np.where(mask, terms.host_static, 0).sum(1) + (host_block * n_kind).sum(-1)
    return total / mask.sum(1) <= np.where(mask, terms.host_capacity, 0).max(1) * (1 + 1e-9)


def _reference_split_fits(terms: StageTerms, st: Stages, cand: Candidates, blocks: int, n_kind: np.ndarray,
                          state: np.ndarray) -> np.ndarray:
    static, _, mult = terms.phases
    act = terms.act_block[:, 0, None, None]
    per_block = (state[..., None] + mult[..., None, None] * act).min(-2)
    room = (_shared(terms.capacity)[..., None] - static)[..., None]
    n_max = np.full(np.broadcast_shapes(room.shape, per_block.shape), float(blocks))
    np.divide(room, per_block, out=n_max, where=per_block > 0)
    n_max = np.floor(functools.reduce(np.minimum, np.moveaxis(n_max, -2, 0)))
    v = cand.vpp[:, None, None]
    s = np.arange(n_max.shape[1])[None, :]  # the embedding's and the loss's places count with the stage's blocks
    slot = (((s == 0) & cand.pp_embedding[:, None]) + ((s == cand.pp[:, None] - 1) & cand.pp_loss[:, None]))[..., None]
    units = np.floor((np.clip(n_max, 0, blocks) + slot) / v) * v
    ok = st.where(units >= v, True, 1).all(1) & (st.where(units - slot, 0, 1).sum(1) >= blocks)
    if len(n_kind) > 1:
        kind = state[..., None] + mult[..., None, None] * act
        most = np.full(np.broadcast_shapes(room[..., None].shape, kind.shape), float(blocks))
        np.divide(room[..., None], kind, out=most, where=kind > 0)
        most = np.floor(np.clip(functools.reduce(np.minimum, np.moveaxis(most, 2, 0)), 0, blocks))
        ok &= (st.where(most, 0, 2).sum(1) >= n_kind[None, :, None]).all(1)
    return ok
