"""The embedding and the loss counted as pipeline layers (plan keys ``pp_embedding`` / ``pp_loss``):
the keys as every plan key is read and refused, the chunks they make against megatron-core's own
layout code, Megatron-LM's flags for them (and back), their memory chunk by chunk against
megatron-core's schedule, and the search that tries them, against the exhaustive oracle.

NVIDIA's Llama-3.1-405B recipe (tp 8, pp 8, vpp 8, cp 2 on 126 layers) is the case in point: 126
layers do not make 64 equal chunks, 126 plus the embedding and the loss do."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.cost.assumptions import DEFAULT
from autoplace.errors import SpecError
from autoplace.evaluation import evaluate
from autoplace.frameworks import get
from autoplace.frameworks._megatron_read import plan_from_megatron
from autoplace.frameworks.megatron import emit_megatron, launch_args
from autoplace.plan import Plan, build_plan, model_chunks, parse_plan_string, split_units
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model, model_from_dict
from solvers.problem import FEATURES, Budget, Problem, objective_key
from solvers.registry import get_solver
from tests.helpers import REPO, gpu_cluster

LLAMA_405B = load_model(REPO / "examples" / "models" / "llama-3-405b.json")
H100_16K = load_cluster(REPO / "examples" / "clusters" / "2048x8-h100.yaml")
RECIPE = "tp=8,pp=8,vpp=8,cp=2,dp=128,zero=1,mbs=1,recompute=none,pp_embedding=true,pp_loss=true"
ENV = {"DATA_PATH": "/data/corpus_text_document", "TOKENIZER_MODEL": "/models/tokenizer",
       "CHECKPOINT_DIR": "/checkpoints", "TRAIN_ITERS": "5000"}


def _plan(text: str, model=LLAMA_405B, cluster=H100_16K) -> Plan:
    return build_plan(parse_plan_string(text), world=cluster.gpus, blocks=model.layers,
                      global_batch=model.training.global_batch)


# --------------------------------------------------------------------------------- the keys


def test_the_keys_read_like_every_plan_key_and_round_trip() -> None:
    plan = _plan(RECIPE)
    assert plan.layers_per_stage == (15, 16, 16, 16, 16, 16, 16, 15)  # 128 units, 16 a stage, a place at each end
    assert "pp_embedding=true,pp_loss=true" in plan.to_string()
    assert _plan(plan.to_string()) == plan
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert Plan.from_dict({k: v for k, v in plan.to_dict().items() if k not in ("pp_embedding", "pp_loss")}) == \
        plan.replace(pp_embedding=False, pp_loss=False)  # a plan.json written before the keys
    with pytest.raises(SpecError, match="pp_embedding.*expected true or false"):
        parse_plan_string("pp_embedding=maybe")
    with pytest.raises(SpecError, match="pp_loss.*expected true or false"):
        Plan.from_dict({**plan.to_dict(), "pp_loss": "yes"})


def test_nvidias_405b_recipe_evaluates_only_with_the_embedding_and_loss_as_layers() -> None:
    assert not [v.rule for v in evaluate(LLAMA_405B, H100_16K, _plan(RECIPE)).violations]
    plain = evaluate(LLAMA_405B, H100_16K, _plan(RECIPE.replace(",pp_embedding=true,pp_loss=true", "")))
    assert [v.rule for v in plain.violations] == ["interleave"]
    one = evaluate(LLAMA_405B, H100_16K, _plan(RECIPE.replace(",pp_loss=true", "")))  # 127 units: no 64 chunks
    assert [v.rule for v in one.violations] == ["interleave"] and "the embedding on the first" in one.violations[0].message
    model = model_from_dict({"name": "m", "layers": 8, "hidden": 256, "ffn_hidden": 1024, "heads": 4, "vocab": 512,
                             "seq_len": 256, "training": {"global_batch": 8}})
    flat = evaluate(model, gpu_cluster(2), _plan("dp=2,pp_embedding=true", model, gpu_cluster(2)))
    assert "layer-split" in [v.rule for v in flat.violations]  # one stage: the embedding takes no place


def test_the_chunks_hold_the_blocks_but_the_embedding_and_loss_places() -> None:
    assert model_chunks([3, 3], 2, True, True) == [1, 2, 2, 1]  # stage 0: E+t | t t ; stage 1: t t | t+L
    assert model_chunks([3, 4], 2) is None and model_chunks([4, 4], 2) == [2, 2, 2, 2]
    assert model_chunks([0, 7], 1, True, True) == [0, 7]  # a first stage of the embedding alone
    assert split_units(126, 8, 8, True, True) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert split_units(80, 4, 2) == (20, 20, 20, 20) and split_units(84, 4, 2) == (20, 22, 22, 20)


# -------------------------------------------------------------- Megatron-LM's flags and megatron-core


@pytest.fixture(scope="module")
def mcore() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is in the test extra")


def _words(plan: Plan) -> list[str]:
    return emit_megatron(plan, LLAMA_405B, H100_16K)


def _core_config(words: list[str], plan: Plan):
    """megatron-core 0.16.1's TransformerConfig of a launch of the words, as Megatron-LM builds it (the dry
    run's ``launch_checks``: Megatron-LM's parser and validate_args, core_transformer_config_from_args and
    TransformerConfig's own checks of the account-for flags and layouts, the schedule's)."""
    from autoplace.frameworks._megatron_dry import launch_checks
    from autoplace.frameworks.megatron import megatron_environment

    return launch_checks([*words, *launch_args(lambda var, _: ENV[var])], plan.world, env=megatron_environment(plan))[1]


def _core_chunks(config, pp: int, vpp: int) -> list[int]:
    """Decoder layers megatron-core builds in each chunk (virtual-stage order), by its own layout code."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    layout = config.pipeline_model_parallel_layout
    if layout is not None:  # (its get_num_layers_to_build asks the process group for the rank)
        return [layout.layout[r][v].count(LayerType.decoder) for v in range(vpp) for r in range(pp)]
    return [get_num_layers_to_build(config, vp_stage=v, pp_rank=r) for v in range(vpp) for r in range(pp)]


@pytest.mark.parametrize("layers", [None, "23:16:16:16:16:16:16:7"])
def test_megatron_core_builds_the_plans_chunks_from_the_emitted_flags(layers: str | None, mcore) -> None:
    plan = _plan(RECIPE + (f",layers={layers}" if layers else ""))
    words = _words(plan)
    even = layers is None  # every stage 16 units: Megatron-LM's own flags; else a layout of the same chunks
    assert ("--account-for-embedding-in-pipeline-split" in words and "--account-for-loss-in-pipeline-split" in words
            and "--pipeline-model-parallel-layout" not in words) == even
    core = _core_config(words, plan)
    assert _core_chunks(core, plan.pp, plan.vpp) == model_chunks(plan.layers_per_stage, plan.vpp, True, True)
    if even:  # and each chunk's first layer where the plan's blocks put it
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        chunks = model_chunks(plan.layers_per_stage, plan.vpp, True, True)
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        assert [get_transformer_layer_offset(core, vp_stage=v, pp_rank=r) for v in range(plan.vpp)
                for r in range(plan.pp)] == starts
    assert plan_from_megatron(words, LLAMA_405B, H100_16K) == plan  # and read back


def test_megatron_lm_refuses_the_places_when_the_chunks_do_not_hold_them(mcore) -> None:
    """The same checks refuse a launch whose chunks leave the 126 layers and the two places unsplit, or that
    joins the account-for flags with first/last stage counts (TransformerConfig refuses both together)."""
    from autoplace.frameworks._megatron_dry import launch_refusal
    from autoplace.frameworks.megatron import megatron_environment

    plan = _plan(RECIPE)
    words = [*_words(plan), *launch_args(lambda var, _: ENV[var])]
    env = megatron_environment(plan)
    assert launch_refusal(words, plan.world, env) is None
    wrong = [w if w != "2" or words[i - 1] != "--num-layers-per-virtual-pipeline-stage" else "3"
             for i, w in enumerate(words)]
    assert "must be divisible" in str(launch_refusal(wrong, plan.world, env))
    flat = _plan(RECIPE.replace("vpp=8,", ""))  # one chunk a stage: the account-for flags alone
    flat_words = [*_words(flat), *launch_args(lambda var, _: ENV[var])]
    assert "--account-for-loss-in-pipeline-split" in flat_words and launch_refusal(flat_words, flat.world, env) is None
    mixed = [*flat_words, "--decoder-first-pipeline-num-layers", "15"]
    assert "cannot be" in str(launch_refusal(mixed, flat.world, env))  # TransformerConfig: not with first/last counts


def test_frameworks_that_cannot_state_the_places_refuse_them() -> None:
    plan = _plan(RECIPE)
    assert get("megatron").plan_check(LLAMA_405B)(plan) is None
    why = get("torchtitan").plan_check(LLAMA_405B)(plan)
    assert why is not None and "pp_embedding=true" in why
    result = CliRunner().invoke(app, ["solve", str(REPO / "examples" / "models" / "llama-3-405b.json"),
                                      str(REPO / "examples" / "clusters" / "2048x8-h100.yaml"),
                                      "--framework", "torchtitan", "--fix", "pp_embedding=true"])
    assert result.exit_code == 3 and "pp_embedding=true" in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------------- memory by chunk


@pytest.mark.parametrize("pp, vpp, m", [(8, 8, 16), (4, 2, 8), (2, 4, 2)])
def test_chunk_inflight_is_megatron_cores_warmup(pp: int, vpp: int, m: int, mcore) -> None:
    """The forward chunks a stage runs before its first backward, per chunk, by megatron-core 0.16.1's own
    warm-up count (get_pp_rank_microbatches, one more forward before the first backward) and order
    (get_schedule_table)."""
    import numpy as np
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    from autoplace.cost.memory import chunk_inflight

    for stage in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda s=stage: s)
        p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)
        warmup = get_pp_rank_microbatches(m, vpp, pp, p2p_communicator=p2p)[2]
        first = get_schedule_table(m, vpp, pp)[:min(warmup + 1, m * vpp)]
        want = [sum(chunk == j for _, chunk in first) for j in range(vpp)]
        assert [int(chunk_inflight(pp, vpp, m, stage, j)) for j in range(vpp)] == want
        assert int(np.sum([chunk_inflight(pp, vpp, m, stage, j) for j in range(vpp)])) == len(first)


def test_the_first_stage_holds_less_and_the_last_more_than_the_average_chunk() -> None:
    """With the embedding in the first chunk (in flight most) the first stage keeps fewer activations than
    its blocks at the average in-flight count; with the loss in the last chunk (in flight least) the last
    stage keeps more."""
    from autoplace.cost.memory import inflight_microbatches, slot_inflight

    first, _ = slot_inflight(8, 8, 16, 0, 16, 1, 0)
    last, _ = slot_inflight(8, 8, 16, 7, 16, 0, 1)
    assert first * 15 == pytest.approx(1 * 15 + 14 * 8)  # chunk 0: 1 block x 15 in flight, 7 chunks: 2 x 8
    assert last * 15 == pytest.approx(7 * 2 * 8 + 1 * 1)  # 7 chunks of 2 x 8, the loss's chunk: 1 x 1
    assert first < inflight_microbatches(2, 8, 8, 16, 0) and last > inflight_microbatches(2, 8, 8, 16, 7)
    # the recipe's plan is costed so: its first and last stages chunk by chunk, the others at the average
    from autoplace.cost.candidates import candidates_from_plans
    from autoplace.cost.layers import layer_table
    from autoplace.cost.terms import stage_terms

    plan, table = _plan(RECIPE), layer_table(LLAMA_405B)
    terms = stage_terms(table, H100_16K, candidates_from_plans([plan], table), LLAMA_405B.training.recipe(),
                        DEFAULT)
    m = plan.grad_accum
    want = [slot_inflight(8, 8, m, 0, 16, 1, 0)[0], *[float(inflight_microbatches(2, 8, 8, m, s)) for s in range(1, 7)],
            slot_inflight(8, 8, m, 7, 16, 0, 1)[0]]
    assert terms.act_mult[0, :, 0] == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------------- the search


def _model(layers: int, moe: bool):
    spec = {"name": "small", "layers": layers, "hidden": 512, "ffn_hidden": 2048, "heads": 8, "kv_heads": 4,
            "vocab": 4096, "seq_len": 512, "training": {"global_batch": 16}}
    if moe:
        spec["moe"] = {"experts": 4, "top_k": 2, "expert_ffn_hidden": 512, "first_dense_layers": 1}
    return model_from_dict(spec)


@pytest.mark.parametrize("layers, moe, gpus, fixed", [
    (6, False, 4, {"pp": 2, "vpp": 4}), (6, False, 4, {}), (6, True, 4, {"pp": 2}), (5, True, 2, {"pp_loss": True})])
def test_cpsat_equals_the_oracle_with_the_places_searched(layers: int, moe: bool, gpus: int, fixed: dict) -> None:
    """Shapes whose interleave divides the blocks with the embedding and / or loss places (6 blocks and
    both places in 2 x 4 chunks), one block kind and two (the arc tables): CP-SAT's top-3 is the oracle's."""
    problem = Problem(_model(layers, moe), gpu_cluster(gpus, gpu="a100-sxm4-40gb"), top_k=3, fixed=fixed,
                      features=frozenset(FEATURES) - {"tp-across-nodes"}, pipeline_slots=True)
    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=120))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=120))
    assert a.status == b.status == "optimal" and a.gap is not None and a.gap <= 1e-5
    assert [objective_key(ev, "time")[0] for ev in a.plans] == pytest.approx(
        [objective_key(ev, "time")[0] for ev in b.plans], rel=1e-6)
    if fixed.get("vpp") == 4:  # only the places make 2 x 4 chunks of 6 blocks
        assert all(ev.plan.pp_embedding and ev.plan.pp_loss and ev.plan.layers_per_stage == (3, 3) for ev in a.plans)
    for ev in a.plans:
        assert ev.ok, ev.violations


def test_the_recipe_solves_pinned_and_its_bundle_states_it(tmp_path: Path) -> None:
    model, cluster = REPO / "examples" / "models" / "llama-3-405b.json", REPO / "examples" / "clusters" / "2048x8-h100.yaml"
    pins = [x for key in ("tp=8", "pp=8", "vpp=8", "cp=2") for x in ("--fix", key)]
    result = CliRunner().invoke(app, ["solve", str(model), str(cluster), "--framework", "megatron", "--allow", "cp",
                                      *pins, "--top", "1", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["plans"][0]
    assert (plan["pp_embedding"], plan["pp_loss"], plan["layers_per_stage"]) == (True, True, [15, *[16] * 6, 15])
    args = (tmp_path / "megatron_args.sh").read_text()
    assert "--account-for-embedding-in-pipeline-split" in args and "--account-for-loss-in-pipeline-split" in args
