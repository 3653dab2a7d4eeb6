"""The enumerated space's fast paths equal the plain ones they replace: configurations made
without ``__init__``, the arrays enumeration builds beside them (:class:`solvers.space.ConfigList`)
and the even-split block counts, all against the scalar code they replaced."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.cost.assumptions import DEFAULT
from autoplace.cost.candidates import Candidates, pack
from autoplace.cost.layers import LayerTable, layer_table
from autoplace.errors import Infeasible, SpecError
from autoplace.frameworks import search
from autoplace.frameworks.base import unstated_recipe
from autoplace.plan import CONFIG_FIELDS, RECIPE_KEYS, Config, Plan, split_units
from autoplace.specs.model import ModelSpec, model_from_dict
from solvers.problem import FEATURES, Problem
from solvers.space import ConfigList, _dominates, _groups, _recipes, enumerate_configs, to_candidates
from tests.helpers import gpu_cluster


def _model(layers: int, batch: int, moe: bool, alibi: bool = False) -> ModelSpec:
    """A small Llama (or, with ``alibi``, ALiBi positions: Megatron-LM and torchtitan refuse it, so
    DeepSpeed alone expresses its pipelines, at its own split)."""
    spec: dict[str, Any] = {"name": "small", "layers": layers, "hidden": 512, "ffn_hidden": 2048, "heads": 8,
                            "kv_heads": 4, "vocab": 4096, "seq_len": 1024, "training": {"global_batch": batch},
                            **({"position": "alibi"} if alibi else {})}
    if moe:
        spec["moe"] = {"experts": 4, "top_k": 2, "expert_ffn_hidden": 512, "first_dense_layers": 1}
    return model_from_dict(spec)


def _reference_candidates(configs: list[Config], table: LayerTable, mode: int) -> Candidates:
    """to_candidates as it was: every configuration's attributes read, its split looked up."""
    S, K = max(cf.pp for cf in configs), len(table.kinds)
    counts = np.zeros((len(configs), S, K, 3))
    seq = np.asarray(table.sequence)
    for i, cf in enumerate(configs):
        start = 0
        for s, n in enumerate(split_units(table.blocks, cf.pp, cf.vpp, cf.pp_embedding, cf.pp_loss)):
            counts[i, s, :, mode] = np.bincount(seq[start:start + n], minlength=K)
            start += n
    return pack(configs, counts)


def _assert_same(got: Candidates, want: Candidates) -> None:
    for f in dataclasses.fields(Candidates):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f.name


ONE_NODE = sorted(set(FEATURES) - {"tp-across-nodes"})  # what a one-node cluster can use
FIXES = [{}, {"mbs": 2}, {"pp": 2, "vpp": 2}, {"zero": 3, "offload_params": "cpu"}, {"compress": "bf16"}]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([3, 4, 6, 8, 12]), gpus=st.sampled_from([1, 2, 4, 8, 16]),
       batch=st.sampled_from([8, 16, 24]), moe=st.booleans(), framework=st.sampled_from(["none", "any", "megatron"]),
       features=st.sets(st.sampled_from(ONE_NODE)), fix=st.sampled_from(FIXES),
       max_mbs=st.sampled_from([None, 2]), mode=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_enumerated_arrays_are_the_configurations_packed(layers: int, gpus: int, batch: int, moe: bool, framework: str,
                                                          features: set[str], fix: dict[str, Any],
                                                          max_mbs: int | None, mode: int, seed: int) -> None:
    model = _model(layers, batch, moe)
    problem = search.problem_for(framework, model, gpu_cluster(gpus), fixed=fix, features=features)
    problem = dataclasses.replace(problem, max_mbs=max_mbs)
    try:
        configs = enumerate_configs(problem)
    except Infeasible:
        return
    assert isinstance(configs, ConfigList) and configs.arrays.size == len(configs)
    table = layer_table(problem.model)
    plain = list(configs)
    # each configuration's costing as enumeration recorded it is the one its problem gives it
    assert configs.costing.tolist() == [problem.costing_index(cf) for cf in plain]
    for rows in _groups(configs, configs.costing):  # as score_space takes them
        _assert_same(to_candidates(configs, table, mode, rows), _reference_candidates([plain[i] for i in rows], table,
                                                                                      mode))
    rows = np.random.default_rng(seed).permutation(len(configs))[:50]  # any rows, in any order, as Space.scored's
    want = _reference_candidates([plain[i] for i in rows], table, mode)
    _assert_same(to_candidates(configs, table, mode, rows), want)
    subset = configs.subset(rows)
    assert subset == [plain[i] for i in rows]
    _assert_same(to_candidates(subset, table, mode), want)
    _assert_same(to_candidates(plain, table, mode, rows), want)  # a plain list is packed


def _reference_admission(problem: Problem) -> Any:
    """``--framework any``'s verdict as it was: every framework that states the configuration's
    recipe asked its configuration check, on the configuration's plan (the even split of whole
    chunks, plan.split_units; no recompute): (admitted, the costing of the
    frameworks that express it when they all cost alike -- alike but in behaviours idle on it
    (search.IDLE_BEHAVIOUR) -- else 0, the recompute forms of them all, the split they all make when none takes an
    explicit one, else None)."""
    model, blocks = problem.model, layer_table(problem.model).blocks
    able = [f for f in search.members(search.ANY) if f.model_refusal(model) is None]
    judges = [(f, f.config_check(model)) for f in able]

    def alike(f: Any, config: Config) -> int:  # f's costing with the behaviours idle on config as given
        costed, assumptions = f.costing(model, DEFAULT)
        idle = [name for name, unused in search.IDLE_BEHAVIOUR.items() if unused(config)]
        return problem.costings.index((costed, assumptions.replace(**{name: getattr(DEFAULT, name) for name in idle}))) + 1

    def verdict(config: Config) -> tuple[bool, int, int, tuple[int, ...] | None]:
        split = split_units(blocks, config.pp, config.vpp, config.pp_embedding, config.pp_loss)
        plan = config.to_plan(split, ["none"] * blocks)
        express = [(alike(f, config), f) for f, check in judges
                   if unstated_recipe(config, f) is None and check(plan) is None]
        forms = functools.reduce(lambda acc, kf: search.recompute_forms(kf[1], config, acc), express, 0)
        costings = {k for k, _ in express}
        splits = {f.forced_split(blocks, config.pp) if config.pp > 1 else None for _, f in express}
        return bool(costings), (costings.pop() if len(costings) == 1 else 0), forms, (
            splits.pop() if len(splits) == 1 else None)

    return verdict


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([3, 4, 8]), gpus=st.sampled_from([2, 4, 8, 16]), batch=st.sampled_from([8, 16]),
       moe=st.booleans(), features=st.sets(st.sampled_from(ONE_NODE)), fix=st.sampled_from(FIXES),
       alibi=st.booleans())
def test_the_frameworks_admission_is_every_frameworks_check(layers: int, gpus: int, batch: int, moe: bool,
                                                            features: set[str], fix: dict[str, Any],
                                                            alibi: bool) -> None:
    """Enumeration under ``--framework any`` (its screens by recipe and pinned degree, its checks
    memoized by the fields they read) keeps the configurations, and records the costings and
    recompute forms and forced splits, that asking every framework's check of every configuration gives."""
    problem = search.problem_for("any", _model(layers, batch, moe, alibi), gpu_cluster(gpus), fixed=fix,
                                 features=features)
    verdict = _reference_admission(problem)
    reference = dataclasses.replace(problem, admissible=lambda cf: verdict(cf)[0], costing_key=lambda cf: verdict(cf)[1],
                                    recompute_forms=lambda cf: verdict(cf)[2], forced_split=lambda cf: verdict(cf)[3])
    try:
        want = enumerate_configs(reference)
    except Infeasible:
        with pytest.raises(Infeasible):
            enumerate_configs(problem)
        return
    got = enumerate_configs(problem)
    assert got == want and got.costing.tolist() == want.costing.tolist() and got.forms.tolist() == want.forms.tolist()
    assert got.splits == want.splits


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([4, 8]), gpus=st.sampled_from([4, 8]), moe=st.booleans(),
       framework=st.sampled_from(["megatron", "torchtitan", "fsdp"]),
       features=st.sets(st.sampled_from(ONE_NODE)).map(lambda f: f | {"fp8"}))  # fp8 recipes dominate no others
def test_a_recipe_is_left_out_exactly_when_a_kept_one_dominates_it(layers: int, gpus: int, moe: bool, framework: str,
                                                                   features: set[str]) -> None:
    """Under one framework's costing, each shape keeps the recipes its framework states that no
    kept recipe dominates (never slower nor larger): the best first, the rest only where it
    cannot state the better ones."""
    h100 = gpu_cluster(gpus, "h100-sxm5-80gb", intra="nvlink4")  # fp8 units: the fp8 recipes are searched
    try:  # a framework may not train the MoE model, or run no configuration of it
        problem = search.problem_for(framework, _model(layers, 16, moe), h100, fixed={}, features=features)
        configs = enumerate_configs(problem)
    except Infeasible:
        return
    kept: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for cf in configs:
        rest = tuple((k, v) for k, v in vars(cf).items() if k not in RECIPE_KEYS)
        recipe = {k: getattr(cf, k) for k in RECIPE_KEYS}
        if recipe not in kept.setdefault(rest, []):
            kept[rest].append(recipe)
    for rest, recipes in kept.items():
        shape = Config(**dict(rest))
        for recipe in _recipes(problem, shape):
            others = [r for r in recipes if r != recipe]
            if recipe in recipes:
                assert not any(_dominates(r, recipe) for r in others)
            else:
                assert not problem.admissible(shape.replaced(recipe)) or any(_dominates(r, recipe) for r in others)


def test_enumerated_configurations_are_what_init_makes() -> None:
    """Configurations made from their fields' dict (Config.from_fields, with_micro_batching)
    are the ones ``__init__`` makes: equal, same hash and repr, no stray attribute."""
    problem = Problem(_model(8, 16, moe=True), gpu_cluster(8), features=frozenset(ONE_NODE))
    configs = enumerate_configs(problem)
    assert len({cf.mbs for cf in configs}) > 1 and len({cf.vpp for cf in configs}) > 1
    for cf in configs:
        made = Config(**{name: getattr(cf, name) for name in CONFIG_FIELDS})
        assert cf == made and hash(cf) == hash(made) and repr(cf) == repr(made)
        assert list(vars(cf)) == list(CONFIG_FIELDS)  # in field order, as __init__ sets them
    cf = configs[-1]
    assert cf.with_micro_batching(3, 5) == dataclasses.replace(cf, mbs=3, grad_accum=5)
    changed = cf.replaced({"tp": 4, "vpp": 1, "fp8": "rowwise"})
    assert changed == dataclasses.replace(cf, tp=4, vpp=1, fp8="rowwise") and list(vars(changed)) == list(CONFIG_FIELDS)
    assert vars(cf) == vars(configs[-1])  # the configuration it was made from is left as it was
    plan = cf.to_plan([8], ["full"] * 8)
    assert plan == Plan(**vars(cf), recompute=("full",) * 8, layers_per_stage=(8,))
    assert vars(plan).keys() == vars(Plan()).keys() and plan.to_plan([8], ["none"] * 8).recompute == ("none",) * 8


@pytest.mark.parametrize("values", [{"tp": 2}, {**vars(Config()), "tpp": 2}, {**vars(Plan())}])
def test_from_fields_refuses_anything_but_every_field(values: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="Config needs the fields tp, pp, cp"):
        Config.from_fields(values)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2", None])
def test_a_degree_that_is_no_whole_number_above_zero_is_refused(value: Any) -> None:
    with pytest.raises(SpecError, match=f"tp must be a whole number >= 1, got {value!r}"):
        Config(tp=value)


def test_a_whole_number_of_any_integral_type_is_a_degree() -> None:
    assert Config(tp=np.int64(2), mbs=4).tp == 2


@settings(max_examples=30, deadline=None)
@given(layers=st.sampled_from([5, 7, 8, 12]), moe=st.booleans(), mode=st.integers(0, 2),
       shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=12))
def test_even_counts_of_any_depth_and_interleave(layers: int, moe: bool, mode: int,
                                                 shapes: list[tuple[int, int]]) -> None:
    """Block counts of configurations whose interleave need not divide the blocks (the
    remainder goes to the last stage), against the per-configuration reference."""
    table = layer_table(_model(layers, 8, moe))
    configs = [Config(pp=pp, vpp=vpp) for pp, vpp in shapes if table.blocks // vpp >= pp]
    if configs:
        _assert_same(to_candidates(configs, table, mode), _reference_candidates(configs, table, mode))
