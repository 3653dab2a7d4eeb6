"""solve searches what frameworks can run (--framework any, the default; none = the theoretical
optimum), and solve --out writes each framework's own best plan, its files consistent with its
plan.json as the framework's own parser reads them."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from autoplace import frameworks
from autoplace.bundle import render
from autoplace.cost.assumptions import DEFAULT
from autoplace.errors import EmitError
from autoplace.evaluation import evaluate
from autoplace.frameworks import search
from autoplace.plan import Plan
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from solvers.problem import DEFAULT_FEATURES
from solvers.space import enumerate_configs
from tests.test_cli import A100_8, MODELS, invoke, strict_json
from tests.test_emit_accelerate import accelerate_launch_env, plugins_from
from tests.test_emit_deepspeed import check_parsed, deepspeed_accepts
from tests.test_emit_megatron import mcore, megatron_core_config  # noqa: F401 - mcore is a fixture
from tests.test_emit_torchtitan import titan  # noqa: F401 - a fixture

TINY = MODELS / "tiny-llama.json"
# cp=2 with ZeRO-3 and optimizer-only offload: DeepSpeed and the FSDP2 module have no ring CP, Megatron
# offloads only with its distributed optimizer, torchtitan and accelerate offload parameters along.
NOBODY = ["--fix", "cp=2,zero=3,offload_optimizer=cpu,offload_params=none", "--allow", "cp", "--allow", "offload"]


PLAIN = {"compile": False, "fused_loss": False, "tp_overlap": "none", "overlap": True}  # every framework's recipe


def test_the_default_search_space_is_what_some_framework_can_express() -> None:
    model, cluster = load_model(TINY), load_cluster(A100_8)
    features = set(DEFAULT_FEATURES) | {"cp", "offload", "hsdp"}
    # recipes pinned: each framework searches its own best recipe, the theoretical optimum the best of all
    every = enumerate_configs(search.problem_for("none", model, cluster, fixed=dict(PLAIN), features=features))
    admitted = enumerate_configs(search.problem_for("any", model, cluster, fixed=dict(PLAIN), features=features))
    each = {f: search.admissible([frameworks.get(f)], model) for f in frameworks.FRAMEWORKS}
    assert admitted == [c for c in every if any(ok.expresses(c) for ok in each.values())]
    assert 0 < len(admitted) < len(every)  # the filter is part of the search and excludes something


def test_torchtitan_searches_each_pipeline_at_the_micro_batchings_its_schedules_run() -> None:
    """Issue 34: torchtitan's 1F1B needs as many micro-batches per step as stages.  The search keeps
    each pipeline shape torchtitan expresses at exactly the micro-batchings its schedule builder runs
    (Framework.batching_refusal), judged per micro-batching, not at the shape's one."""
    from tests.test_emit_plans import CLUSTER16, small_model

    model = small_model(batch=16)
    fixed = dict(PLAIN)
    every = enumerate_configs(search.problem_for("none", model, CLUSTER16, fixed=fixed, features=set(DEFAULT_FEATURES)))
    searched = enumerate_configs(search.problem_for("torchtitan", model, CLUSTER16, fixed=fixed,
                                                 features=set(DEFAULT_FEATURES)))
    ok = search.admissible([frameworks.get("torchtitan")], model)
    assert searched == [c for c in every if ok.expresses(c)]
    one_f_one_b = [c for c in searched if c.pp > 1 and c.schedule == "1f1b"]
    assert one_f_one_b and all(c.grad_accum >= c.pp for c in one_f_one_b)
    assert any(ok(c) and c.pp > 1 and c.schedule == "1f1b" and c.grad_accum < c.pp for c in every)


def test_admissibility_does_not_depend_on_the_micro_batching() -> None:
    """Enumeration judges each shape once, at mbs=1, for every (mbs, grad_accum) (solvers.space._micro):
    the emitters' own checks must give every configuration its shape's verdict."""
    model, cluster = load_model(TINY), load_cluster(A100_8)
    problem = search.problem_for("none", model, cluster, fixed=dict(PLAIN), features=set(DEFAULT_FEATURES) | {"offload"})
    configs = enumerate_configs(problem)
    for framework in frameworks.FRAMEWORKS:
        ok = search.admissible([frameworks.get(framework)], model)
        verdicts = [ok(c) for c in configs]
        assert verdicts == [ok(c.with_micro_batching(1, 1)) for c in configs]
        assert len({c.mbs for c in configs}) > 1 and any(verdicts) and not all(verdicts)


def test_none_keeps_the_theoretical_optimum_and_says_so_any_refuses_it() -> None:
    result = invoke("solve", TINY, A100_8, "--framework", "none", "--json", "--time-limit", "5", *NOBODY)
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["framework"] == "none" and doc["notes"][0].startswith("theoretical optimum (--framework none)")
    assert all(p["frameworks"] == [] for p in doc["plans"])  # nobody can run these
    result = invoke("solve", TINY, A100_8, "--time-limit", "5", *NOBODY)
    assert result.exit_code == 3
    assert "among the configurations some supported framework can run" in result.output


def test_default_solve_lists_who_runs_each_plan() -> None:
    result = invoke("solve", TINY, A100_8, "--json", "--time-limit", "5")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    model, cluster = load_model(TINY), load_cluster(A100_8)
    assert doc["framework"] == "any"
    for p in doc["plans"]:
        assert p["frameworks"]
        plan = Plan.from_dict(p)
        for f in frameworks.FRAMEWORKS:  # runs with: expresses it, and it fits as the framework runs it
            costed, assumptions = frameworks.get(f).costing(model, DEFAULT)
            try:
                render(f, plan, model, cluster)
                assert (f in p["frameworks"]) == evaluate(costed, cluster, plan, assumptions).fits
            except EmitError:
                assert f not in p["frameworks"]
    table = invoke("solve", TINY, A100_8, "--time-limit", "5").stdout
    assert "each runs with at least one framework" in table and "runs with" in table


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("solve") / "b"
    result = invoke("solve", TINY, A100_8, "--out", out, "--json", "--time-limit", "5")
    assert result.exit_code == 0, result.output
    console = invoke("solve", TINY, A100_8, "--out", out.parent / "c", "--time-limit", "5").stdout
    return out, strict_json(result.stdout), console


def _plan(folder: Path) -> Plan:
    return Plan.from_dict(json.loads((folder / "plan.json").read_text()))


def test_each_framework_gets_its_best_plan_with_its_slowdown(bundle) -> None:
    out, doc, console = bundle
    best = doc["plans"][0]
    assert json.loads((out / "plan.json").read_text())["degrees"] == best["degrees"]  # top level: overall best
    per = doc["framework_bundles"]
    assert set(per) == set(frameworks.FRAMEWORKS)
    for f, entry in per.items():
        assert entry["written"], (f, entry)
        folder = out / f
        assert Path(entry["dir"]) == folder and json.loads((folder / "plan.json").read_text())["framework"] == f
        assert entry["slowdown"] == pytest.approx(entry["plan"]["step_time_s"] / best["step_time_s"] - 1, abs=0.01)  # JSON rounds times
        for path in entry["files"].values():
            assert Path(path).is_file() and Path(path).name in console
        # the same run, to c/ (a framework's line folds at 100 columns, its continuation indented)
        line = " ".join(re.split(r"\n(?! {3})", console.split(f"\n  {f:<10} ", 1)[1], maxsplit=1)[0].split())
        assert f"{out.parent / 'c' / f}/: " in line and "vs the best plan" in line


def test_a_frameworks_bundle_is_the_plan_solve_recommends_for_it(tmp_path: Path) -> None:
    """Ranked as ``solve --framework F`` ranks its plans (robustly: within the error band, fewer
    moving parts first), not only the fastest: Llama-3-8B on 4 H100, where torchtitan's fastest
    plan is not the one recommended."""
    model = MODELS / "llama-3-8b.json"
    alone = invoke("solve", model, "1x4xh100", "--framework", "torchtitan", "--top", "1", "--json", "--time-limit", "10")
    assert alone.exit_code == 0, alone.output
    doc = strict_json(alone.stdout)
    assert doc["status"] == "optimal" and doc["ranking"]["reordered"]  # so the ranking has something to change
    result = invoke("solve", model, "1x4xh100", "--out", tmp_path / "b", "--json", "--time-limit", "30")
    assert result.exit_code == 0, result.output
    assert _plan(tmp_path / "b" / "torchtitan").to_string() == Plan.from_dict(doc["plans"][0]).to_string()


def test_deepspeed_folder_is_its_own_plan(bundle, monkeypatch) -> None:
    folder = bundle[0] / "deepspeed"
    plan = _plan(folder)
    cfg = json.loads((folder / "ds_config.json").read_text())
    check_parsed(deepspeed_accepts(cfg, plan, monkeypatch), cfg, plan)


def test_torchtitan_folder_is_its_own_plan(bundle, titan) -> None:  # noqa: F811
    folder = bundle[0] / "torchtitan"
    plan = _plan(folder)
    job = titan.ConfigManager().parse_args(["--job.config_file", str(folder / "torchtitan.toml")])
    p = job.parallelism
    assert (job.model.name, job.model.flavor) == ("llama3", "autoplace")
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
            p.pipeline_parallel_degree, p.context_parallel_degree) == (plan.dp_replicate, plan.dp_shard, plan.tp,
                                                                       plan.pp, plan.cp)
    assert job.training.global_batch_size == plan.global_batch


def test_accelerate_folder_is_its_own_plan(bundle, tmp_path, monkeypatch) -> None:
    folder = bundle[0] / "accelerate"
    plan = _plan(folder)
    cfg = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    env = accelerate_launch_env(cfg, tmp_path, monkeypatch)
    assert int(env.get("WORLD_SIZE", cfg["num_processes"])) == plan.world
    fsdp, _ = plugins_from(env, monkeypatch)
    assert (fsdp is not None) == (cfg["distributed_type"] == "FSDP")
    if fsdp is not None:
        assert fsdp.reshard_after_forward is (plan.zero == 3)


def test_megatron_folder_is_its_own_plan(bundle, mcore) -> None:  # noqa: F811
    import subprocess

    folder = bundle[0] / "megatron"
    plan = _plan(folder)
    printed = subprocess.run(["bash", "-c", 'source megatron_args.sh && printf "%s\\0" "${MEGATRON_ARGS[@]}"'],
                             cwd=folder, capture_output=True, text=True, check=True).stdout
    config, args = megatron_core_config(printed.split("\0")[:-1], plan)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (plan.tp, plan.pp)
    assert (args.micro_batch_size, args.global_batch_size) == (plan.mbs, plan.global_batch)


def test_fsdp_folder_is_its_own_plan(bundle) -> None:
    folder = bundle[0] / "fsdp"
    plan = _plan(folder)
    tree = ast.parse((folder / "fsdp2_parallelize.py").read_text())
    constants = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant | ast.Tuple)}
    assert (constants["DP_REPLICATE"], constants["DP_SHARD"], constants["TP"], constants["ZERO"]) == (
        plan.dp_replicate, plan.dp_shard, plan.tp, plan.zero)
    assert constants["RECOMPUTE"] == plan.recompute
    assert (constants["COMPRESS"], constants["POWERSGD_RANK"]) == (plan.compress, plan.powersgd_rank)


def test_compressed_plans_go_only_to_frameworks_that_run_them(tmp_path: Path, monkeypatch) -> None:
    """With --allow compress each framework's own best plan uses only options it declares, and its
    files state the option (the FSDP2 module's constants, DeepSpeed's ZeRO++ keys)."""
    runners = {c: {f for f in frameworks.FRAMEWORKS if c in frameworks.get(f).compressions}
               for c in ("bf16", "zeropp", "powersgd")}
    # ranked by speed alone: a robust ranking prefers no compression (a moving part) within the error band;
    # 8B's gradients over 100 GbE: halving the reduction pays (a tiny model's step is kernel-issue bound)
    result = invoke("solve", MODELS / "llama-3-8b.json", Path(__file__).resolve().parents[1] / "examples/clusters/"
                    "4x8-a100-100gbe.yaml", "--allow", "compress", "--out", tmp_path / "b", "--json",
                    "--time-limit", "30", "--rank", "fastest")
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    for p in doc["plans"]:
        if p["compress"] != "none":
            assert set(p["frameworks"]) <= runners[p["compress"]], p
    used = set()
    for f in frameworks.FRAMEWORKS:
        plan = _plan(tmp_path / "b" / f)
        used.add(plan.compress)
        assert plan.compress == "none" or f in runners[plan.compress], (f, plan.compress)
    assert used != {"none"}  # the option is taken somewhere (the FSDP2 recipe halves its reduction in bf16)
    test_fsdp_folder_is_its_own_plan((tmp_path / "b",))
    test_deepspeed_folder_is_its_own_plan((tmp_path / "b",), monkeypatch)


def test_a_framework_left_out_gets_a_one_line_reason(tmp_path: Path) -> None:
    """Mistral 7B: torchtitan has no sliding-window attention, so its folder is not written and the
    console says why."""
    model = Path(__file__).resolve().parents[1] / "tests/data/hf/mistral-7b-v0.1.json"
    cluster = Path(__file__).resolve().parents[1] / "examples/clusters/8x8-h100.yaml"
    result = invoke("solve", model, cluster, "--out", tmp_path / "b", "--time-limit", "5", "--top", "1")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("torchtitan"))
    assert "sliding-window attention" in line
    assert not (tmp_path / "b" / "torchtitan").exists()


def test_frameworks_are_not_searched_once_the_time_limit_is_spent() -> None:
    """The time limit bounds ``solve --out`` too: with nothing left of it, each framework's bundle
    says it was not searched instead of running a search past the limit (a zero budget forces it,
    whatever the machine's speed)."""
    from solvers.problem import Budget
    from solvers.registry import get_solver

    model, cluster = load_model(MODELS / "tiny-llama.json"), load_cluster(A100_8)
    bests = search.best_per_framework(model, cluster, get_solver("cpsat"), Budget(time_limit_s=0), fixed={},
                                      features=set(DEFAULT_FEATURES))
    assert set(bests) == set(frameworks.FRAMEWORKS)
    assert all(ev is None and "not searched: the time limit was spent" in str(why) for ev, why in bests.values())
    # with the overall best plan to fall back on, each framework that runs it gets it, costed its way
    problem = search.problem_for("any", model, cluster, fixed={}, features=set(DEFAULT_FEATURES), top_k=1)
    best = search.solve("any", get_solver("cpsat"), problem, Budget(time_limit_s=60), 1).plans[0].plan
    bests = search.best_per_framework(model, cluster, get_solver("cpsat"), Budget(time_limit_s=0), fixed={},
                                      features=set(DEFAULT_FEATURES), fallback=best)
    runs = [name for name in frameworks.FRAMEWORKS if search.refusal(best, model, name) is None]
    assert runs and all(bests[name][0].plan == best for name in runs)
    assert all(bests[name][0] is None for name in frameworks.FRAMEWORKS if name not in runs)
    # a framework that cannot train the model says so, not that time ran out (torchtitan: sliding windows)
    mistral = load_model(Path(__file__).resolve().parents[1] / "tests/data/hf/mistral-7b-v0.1.json")
    bests = search.best_per_framework(mistral, cluster, get_solver("cpsat"), Budget(time_limit_s=0), fixed={},
                                      features=set(DEFAULT_FEATURES))
    assert "sliding-window attention" in str(bests["torchtitan"][1])


def test_solve_out_searches_each_framework_then_writing_only_writes(tmp_path, monkeypatch) -> None:
    """``solve --out`` as named steps: :func:`autoplace.solving.search_per_framework` takes what is left
    of --time-limit (here nothing: each framework gets the best plan it runs, or says it was not
    searched), then :func:`autoplace.solving.write_bundles` writes what it is handed and searches nothing."""
    import dataclasses
    import time

    from autoplace import solving

    model, cluster = load_model(TINY), load_cluster(A100_8)
    inputs = solving.Inputs(model, cluster, {}, {"model": str(TINY), "cluster": str(A100_8)})
    request = solving.Request(time_limit_s=30, top=1)
    problem = solving.build_problem(inputs, request)
    result = solving.run_search(problem, request)
    spent = dataclasses.replace(request, started=time.perf_counter() - request.time_limit_s)
    bests = solving.search_per_framework(result, inputs, spent)
    assert set(bests) == set(frameworks.FRAMEWORKS)
    assert all(ev is None or ev.plan == result.plans[0].plan for ev, _ in bests.values())

    def searched(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("write_bundles searched")

    monkeypatch.setattr(search, "best_per_framework", searched)
    doc: dict[str, Any] = {}
    written = solving.write_bundles(doc, result, problem, inputs, request, tmp_path, bests)
    assert set(doc) == {"bundle", "framework_bundles"} and (tmp_path / "plan.json").is_file()
    assert {f for f, (ev, _) in bests.items() if ev is not None} == {f for f, b in written.items() if b.files}
    assert all((tmp_path / f / "plan.json").is_file() for f, b in written.items() if b.files)


def test_a_named_framework_s_bundle_launches_that_framework(tmp_path) -> None:
    """--framework fsdp: the bundle holds the FSDP2 files and its launch scripts run them, though torchtitan
    (before FSDP2 in the registry) expresses the same plan and used to take the launch scripts."""
    out = tmp_path / "b"
    invoke("solve", MODELS / "llama-3-8b.json", "--cluster", "1x8xh100", "--framework", "fsdp", "--out", out,
           "--time-limit", "20")
    assert json.loads((out / "plan.json").read_text())["framework"] == "fsdp"
    assert "launch scripts run PyTorch FSDP2" in (out / "README.txt").read_text()
    assert "train_fsdp2.py" in (out / "launch_torchrun.sh").read_text() and not (out / "ds_config.json").exists()
