"""Megatron-LM's dry run: rank by rank, what ``pretrain_gpt.py`` builds before step 1, on megatron-core.

The contract: over ten model families of tests/data/hf that Megatron-LM does not refuse (layers shrunk,
as tests/test_architectures.py does) and the plan shapes Megatron expresses -- tensor, pipeline with an
uneven split, interleaved (virtual) pipeline, an uneven interleaved layout, context and expert
parallelism; ZeRO-1 (the distributed optimizer) and ZeRO-0 -- every step is done or skipped with a reason, the rank sits on the pipeline
stage the plan put it on, and the parameter, gradient and optimizer bytes megatron-core allocated on
it are within 2% of plan.json's.  A bundle a user edited is refused with Megatron's own message and
autoplace's fix.  Megatron-LM's parser and validate_args, where a checkout of Megatron-LM is at hand,
are compared with autoplace's restatements of them.

Megatron-LM core_v0.16.1's launch needs --save-interval with --save, a --lr and an --eval-interval
(issue 34, defect 1): the bundles now say them; a bundle without them is refused with the fix.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autoplace.dryrun.run import TOLERANCE, RankRun, build_in_process
from autoplace.frameworks import megatron
from autoplace.specs.model import model_from_dict
from tests.dryrun_bundles import write_test_bundle
from tests.helpers import REPO

pytest.importorskip("megatron.core", reason="megatron-core is in the test extra")
HF = REPO / "tests" / "data" / "hf"

# plan shape -> (transformer layers, cluster, plan); dense layers are added to DeepSeek's MoE layers
DENSE = {"tp": (2, "1x8xh100", "tp=2,zero=1"),
         "pp-uneven": (4, "1x8xh100", "pp=2,zero=1,layers=1:3"),
         "vpp": (8, "2x8xh100", "tp=2,pp=4,vpp=2,zero=1"),
         "layout": (12, "2x8xh100", "tp=2,pp=4,vpp=2,zero=1,layers=2:4:4:2"),  # --pipeline-model-parallel-layout
         # --account-for-embedding/loss-in-pipeline-split: 6 layers and the two places in 2 x 4 chunks
         "places": (6, "1x8xh100", "tp=2,pp=2,vpp=4,zero=1,pp_embedding=true,pp_loss=true"),
         "cp": (2, "1x8xh100", "cp=2,zero=1"),
         "zero0": (2, "1x8xh100", "tp=2,zero=0")}
MOE = {"ep-pp": (4, "2x8xh100", "tp=2,pp=2,ep=4,zero=1"),
       "ep-cp": (2, "1x8xh100", "cp=2,ep=4,zero=1")}
CASES = [  # each family at two shapes (or three); every shape but the layout and the places at least twice
    ("llama-3.1-8b.json", "tp"), ("llama-3.1-8b.json", "vpp"), ("llama-3.1-8b.json", "places"),
    ("qwen2.5-0.5b.json", "pp-uneven"), ("qwen2.5-0.5b.json", "cp"), ("qwen2.5-0.5b.json", "layout"),
    ("qwen3-8b.json", "vpp"), ("qwen3-8b.json", "zero0"),
    ("mistral-7b-v0.1.json", "cp"), ("mistral-7b-v0.1.json", "pp-uneven"),
    ("phi-3-mini-4k-instruct.json", "tp"), ("phi-3-mini-4k-instruct.json", "zero0"),
    ("mixtral-8x7b-v0.1.json", "ep-pp"), ("mixtral-8x7b-v0.1.json", "ep-cp"),
    ("qwen3-30b-a3b.json", "ep-pp"), ("qwen1.5-moe-a2.7b-chat-gptq-int4.json", "ep-cp"),
    ("deepseek-v2-lite.json", "ep-pp"), ("deepseek-v2-lite.json", "ep-cp"),
    ("deepseek-v3.json", "ep-pp"),
]
def shrunk(name: str, layers: int) -> dict[str, Any]:
    """The config with ``layers`` transformer layers (after DeepSeek's dense prefix); layer types dropped."""
    config = json.loads((HF / name).read_text())
    dense = config.get("first_k_dense_replace", 0) if config.get("n_routed_experts") else 0
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if key in config:
            config[key] = dense + layers
    config.pop("layer_types", None)
    return config


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """One Megatron bundle per case, as ``solve --out`` writes it."""
    out = {}
    for family, shape in CASES:
        layers, cluster, plan = {**DENSE, **MOE}[shape]
        path = tmp_path_factory.mktemp("mt") / f"{family}-{shape}"
        out[family, shape] = write_test_bundle(path, shrunk(family, layers), cluster, plan, "megatron")
    return out


def test_the_families_are_ones_megatron_trains() -> None:
    families = {family for family, _ in CASES}
    assert len(families) >= 8
    for family in families:
        spec = model_from_dict(copy.deepcopy(shrunk(family, 2)), source="config.json")
        assert megatron.model_refusal(spec) is None, family


def _ranks(bundle: Path) -> list[tuple[int, int]]:
    """(rank, its pipeline stage): rank 0 and the first rank of the last stage (pp outermost)."""
    doc = json.loads((bundle / "plan.json").read_text())
    pp, world = doc["degrees"]["pp"], _world(bundle)
    return [(0, 0)] + ([((pp - 1) * (world // pp), pp - 1)] if pp > 1 else [])


def _world(bundle: Path) -> int:
    text = (bundle / "launch_torchrun.sh").read_text()
    nodes, per_node = (int(re.search(rf"--{k} (\d+)", text).group(1)) for k in ("nnodes", "nproc-per-node"))  # type: ignore[union-attr]
    return nodes * per_node


def _params() -> list[Any]:
    out = []
    for family, shape in CASES:
        for last in (False, True):
            if last and shape in ("tp", "cp", "zero0", "ep-cp"):
                continue  # one stage
            out.append(pytest.param(family, shape, last, id=f"{family}-{shape}-{'last' if last else 0}"))
    return out


@pytest.mark.parametrize(("family", "shape", "last"), _params())
def test_each_rank_builds_its_stage_with_the_planned_bytes(family: str, shape: str, last: bool,
                                                            bundles: dict[tuple[str, str], Path]) -> None:
    bundle = bundles[family, shape]
    rank, stage = _ranks(bundle)[-1 if last else 0]
    run = build_in_process(bundle, rank)
    assert run.ok, run.failed
    assert all(s["status"] == "done" or (s["status"] == "skipped" and s["why"]) for s in run.steps)
    assert run.stage == stage
    assert set(run.measured) == {"params", "grads", "optimizer"}
    errors = run.errors()
    assert set(errors) == {"params", "grads", "optimizer"}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), errors


def test_the_interleaved_stage_holds_its_virtual_chunks(bundles: dict[tuple[str, str], Path]) -> None:
    """pp=4, vpp=2: rank 0 holds virtual stages 0 and 4 (parallel_state's placement), rank 12 holds 3 and 7."""
    bundle = bundles["llama-3.1-8b.json", "vpp"]
    events: list[dict[str, Any]] = []
    from autoplace.dryrun.bundle import read_bundle
    from autoplace.dryrun.launches import record
    from autoplace.dryrun.steps import DryContext, Steps

    b = read_bundle(bundle)
    launched = record(bundle, "torchrun")
    for rank, chunks in ((0, [0, 4]), (12, [3, 7])):
        events.clear()
        b.framework.dry_run(DryContext(bundle, launched, b.plan, b.model, b.cluster, rank, launched.world),
                            Steps(events.append))
        assert [e["chunks"] for e in events if e["event"] == "stage"] == [chunks]
        assert any("forward_backward_pipelining_with_interleaving" in e["text"] for e in events
                   if e["event"] == "note")


def test_builds_leave_nothing_behind(bundles: dict[tuple[str, str], Path]) -> None:
    """Two bundles built one after the other give what each gives alone (parallel_state, the micro-batch
    calculator and the process group are reset after each)."""
    a, b = bundles["mixtral-8x7b-v0.1.json", "ep-pp"], bundles["qwen2.5-0.5b.json", "cp"]
    first = _summary(build_in_process(a, 0))
    _summary(build_in_process(b, 0))
    assert _summary(build_in_process(a, 0)) == first


def _summary(run: RankRun) -> tuple[Any, ...]:
    return (run.stage, tuple((s["step"], s["status"]) for s in run.steps), tuple(sorted(run.measured.items())))


# ---------------------------------------------------------------- what Megatron refuses, and the fix


def _edited(bundle: Path, tmp_path: Path, old: str, new: str) -> Path:
    copy_ = tmp_path / "edited"
    copy_.mkdir()
    for f in bundle.iterdir():
        (copy_ / f.name).write_bytes(f.read_bytes())
        (copy_ / f.name).chmod(f.stat().st_mode)
    args = copy_ / "megatron_args.sh"
    text = args.read_text()
    assert old in text
    args.write_text(text.replace(old, new))
    return copy_


def _failure(bundle: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    run = build_in_process(bundle, 0, extra=extra)
    assert run.failed is not None, "the dry run built what Megatron-LM refuses"
    return run.failed


def test_a_batch_that_does_not_split_is_refused_with_the_fix(bundles: dict[tuple[str, str], Path],
                                                             tmp_path: Path) -> None:
    """megatron-core's micro-batch calculator: 1024 sequences at micro-batch 3 over dp 4 do not split."""
    edited = _edited(bundles["llama-3.1-8b.json", "tp"], tmp_path, "--micro-batch-size 1", "--micro-batch-size 3")
    failed = _failure(edited)
    assert failed["step"].startswith("the micro-batch calculator")
    assert failed["error"] == ("AssertionError: global batch size (1024) is not divisible by micro batch size (3) "
                               "times data parallel size (4)")
    assert failed["fix"] == ("--global-batch-size 1024 is not divisible by micro-batch 3 x dp 4: set "
                             "--micro-batch-size to a divisor of 256 (1, 2, 4) or --global-batch-size to a "
                             "multiple of 12 (1020, 1032)")


def test_degrees_that_do_not_fill_the_world_are_refused(bundles: dict[tuple[str, str], Path],
                                                        tmp_path: Path) -> None:
    edited = _edited(bundles["qwen3-8b.json", "zero0"], tmp_path, "--tensor-model-parallel-size 2",
                     "--tensor-model-parallel-size 3")
    failed = _failure(edited)
    assert failed["error"] == "AssertionError: world size (8) is not divisible by total_model_size (total_model_size=3)"
    assert failed["fix"].startswith("tp x pp x cp = 3 does not divide the 8 ranks")


@pytest.mark.parametrize(("dropped", "step", "fix"), [
    (["--save-interval"], "Megatron-LM's arguments: parse_args and validate_args",
     "add --save-interval N > 0 (steps between checkpoints): Megatron-LM requires it whenever --save is given"),
    (["--lr", "--min-lr"], "the distributed optimizer: fp32 main-parameter shards",
     "add --lr (the peak learning rate, e.g. --lr 3e-4): Megatron-LM has no default learning rate"),
    (["--eval-interval"], "the datasets' sizes (get_train_valid_test_num_samples)",
     "add --eval-interval N (steps between evaluations): the validation set is sized from it; or --full-validation"),
])
def test_a_launch_without_what_a_run_needs_stops_where_megatron_lm_does(
        dropped: list[str], step: str, fix: str, bundles: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """Issue 34, defect 1: before the bundles said them, every launch stopped at one of these."""
    failed = _failure(_without(bundles["llama-3.1-8b.json", "tp"], tmp_path, dropped))
    assert (failed["step"], failed["fix"]) == (step, fix)


def _without(bundle: Path, tmp_path: Path, flags: list[str]) -> Path:
    """A copy of ``bundle`` whose megatron_args.sh no longer passes ``flags`` (each on a line of its own)."""
    text = (bundle / "megatron_args.sh").read_text()
    kept = [line for line in text.splitlines() if line.split()[:1] not in [[f] for f in flags]]
    assert len(kept) == len(text.splitlines()) - len(flags)
    return _edited(bundle, tmp_path, text, "\n".join(kept) + "\n")


@pytest.mark.parametrize(("flag", "step", "fix"), [
    ("--data-path", "the datasets and data iterators (build_train_valid_test_data_iterators)",
     "add --data-path PREFIX (your Megatron-indexed dataset) or --mock-data"),
    ("--tokenizer-model", "the tokenizer (HuggingFaceTokenizer) and the embedding's rows",
     "add --tokenizer-model (--tokenizer-type HuggingFaceTokenizer reads it)"),
])
def test_a_launch_without_its_data_or_tokenizer_is_refused(flag: str, step: str, fix: str,
                                                           bundles: dict[tuple[str, str], Path],
                                                           tmp_path: Path) -> None:
    """The launch line's required words, edited out of launch_torchrun.sh."""
    bundle = _edited(bundles["qwen3-8b.json", "zero0"], tmp_path, "", "")
    script = bundle / "launch_torchrun.sh"
    text = script.read_text()
    script.write_text(re.sub(rf' {flag} "[^"]*"', "", text, count=1))
    assert flag not in script.read_text()
    failed = _failure(bundle)
    assert (failed["step"], failed["fix"]) == (step, fix)


def test_an_unknown_flag_is_refused_by_megatrons_parser(bundles: dict[tuple[str, str], Path]) -> None:
    failed = _failure(bundles["qwen2.5-0.5b.json", "cp"], extra=("--tensor-parallel-size", "2"))
    assert failed["error"] == ("MegatronArgumentError: pretrain_gpt.py: error: unrecognized arguments: "
                               "--tensor-parallel-size 2")
    assert failed["fix"] == "remove --tensor-parallel-size: Megatron-LM core_v0.16.1's pretrain_gpt.py has no such flag"


# ---------------------------------------------------------------- the CLI, one process per rank


@pytest.mark.slow
def test_the_cli_builds_the_default_ranks(bundles: dict[tuple[str, str], Path]) -> None:
    bundle = bundles["mistral-7b-v0.1.json", "pp-uneven"]
    done = subprocess.run([sys.executable, "-m", "autoplace.cli", "dryrun", str(bundle), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    doc = json.loads(done.stdout)
    assert [(r["rank"], r["stage"], r["ok"]) for r in doc["ranks"]] == [(0, 0, True), (4, 1, True)]
    for r in doc["ranks"]:
        assert {s: v["within_tolerance"] for s, v in r["states"].items()} == dict.fromkeys(
            ("params", "grads", "optimizer"), True)


# ---------------------------------------------------------------- against Megatron-LM's own code


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.megatron_lm_reference import checkout

    tree = checkout(tmp_path_factory.mktemp("megatron-lm"))
    if tree is None:
        pytest.skip("no Megatron-LM core_v0.16.1 checkout (set MEGATRON_LM)")
    return tree


@pytest.mark.slow
def test_the_flag_table_is_megatron_lms_parser(megatron_lm: Path) -> None:
    from autoplace.frameworks._megatron_flags import TABLE
    from tests.megatron_lm_reference import run

    assert run(megatron_lm, "flags") == json.loads(TABLE.read_text())


@pytest.mark.slow
def test_validate_args_as_megatron_lm_has_it(megatron_lm: Path, bundles: dict[tuple[str, str], Path],
                                             tmp_path: Path) -> None:
    """The restated validate_args derives the same args and refuses with the same messages."""
    from autoplace.frameworks._megatron_read import megatron_words
    from autoplace.frameworks._megatron_validate import megatron_arguments
    from tests.megatron_lm_reference import run

    base = megatron_words((bundles["llama-3.1-8b.json", "vpp"] / "megatron_args.sh").read_text())
    base += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--train-iters", "10", "--lr", "1e-4"]
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    cases = [{"words": base, "world": 16, "env": env},
             {"words": [*base, "--data-path", "corpus", "--recompute-activations"], "world": 16, "env": env},
             {"words": [*base, "--save", "ckpt"], "world": 16, "env": env},
             {"words": base, "world": 16, "env": {}},
             {"words": base, "world": 12, "env": env},
             {"words": [*base, "--num-virtual-stages-per-pipeline-rank", "2"], "world": 16, "env": env},
             {"words": [*base, "--pipeline-model-parallel-size", "2"], "world": 16, "env": env},
             {"words": [*base, "--fp16"], "world": 16, "env": env},
             {"words": [*base, "--tensor-model-parallel-size", "1", "--tp-comm-overlap"], "world": 16, "env": env},
             {"words": [*base, "--expert-model-parallel-size", "2"], "world": 16, "env": env},
             {"words": [*base, "--recompute-activations", "--ffn-hidden-size", "1000"], "world": 8, "env": env},
             {"words": [w for w in base if w != "--use-distributed-optimizer"], "world": 16, "env": env},
             {"words": [*base, "--seq-length", "8191", "--context-parallel-size", "2"], "world": 32, "env": env}]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    theirs = run(megatron_lm, "validate", str(tmp_path / "cases.json"))
    for case, answer in zip(cases, theirs, strict=True):
        try:
            ours = {"args": {k: repr(v) for k, v in vars(megatron_arguments(case["words"], case["world"],
                                                                          env=case["env"])).items()}}
        except (AssertionError, ValueError, RuntimeError) as exc:
            ours = {"error": f"{type(exc).__name__}: {exc}"}
        if "error" in answer and answer["error"] == "AssertionError: ":  # a bare assert: ours names its condition
            assert ours["error"].startswith("AssertionError: assert "), ours
        else:
            assert ours == answer
