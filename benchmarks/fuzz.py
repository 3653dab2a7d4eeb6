"""Hostile inputs through the CLI: every reader and flag, N inputs, counts by exit code and the tracebacks found.

    python benchmarks/fuzz.py N [--seed S] [--surface NAME ...]

The surfaces: model files (shorthand, layer graph, a Hugging Face config.json of every family in
tests/data/hf), cluster files and ``NODESxGPUSxGPU`` strings, plan strings (``--plan``) and ``--fix``
values, calibration files (``--calibration``); every reader ``autoplace check`` has (plan.json,
DeepSpeed JSON, accelerate YAML, torchtitan TOML, Megatron-LM arguments, the FSDP2 module:
benchmarks/fuzz_configs.py); keys given twice, in files and in ``--plan``/``--fix``; and every
flag of every command through its range, with usage errors on each (benchmarks/fuzz_flags.py).
Inputs are hypothesis strategies: seed documents mutated one to three times (a key deleted, an
unknown key added, a value replaced by a wrong type, a negative, zero, a huge or non-finite number,
a string), whole random documents and token soup.  Each input runs through the CLI in-process
(typer's runner), never a subprocess per input.

The contract (README "Exit codes"): 0, 1 (``check``'s REJECT), 2 (bad input: one stderr line), 3
(infeasible).  Any exception escaping the CLI, an ``internal error`` line, an exit 2 that is not
one line, or a bad-by-construction input (a repeat, a refused flag value) not refused with the
line it must print is a *traceback*: printed with its input at the end.  tests/test_fuzz_inputs.py
runs a bounded slice of the same strategies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fix_seed
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import fuzz_configs, fuzz_flags  # noqa: E402
from benchmarks.fuzz_kit import (  # noqa: E402
    A100,
    EXAMPLES,
    HF,
    LLAMA,
    ONE_GPU,
    ONE_GPU_TEXT,
    TINY,
    Case,
    calibration_seed,
    dump,
    file_case,
    garbage,
    mutated,
)

PLAN_KEYS = ["dp", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "vpp", "sp", "zero", "mbs", "grad_accum",
             "schedule", "offload_optimizer", "offload_params", "recompute", "layers", "zeropp", "compress", "", "x"]
PLAN_VALUES = ["1", "2", "0", "-1", "8", "3", "true", "false", "none", "cpu", "nvme", "full", "selective", "1f1b",
               "interleaved", "zb", "", "=", ",", "1:2", "2:2:2", "nan", "inf", "1e9", "99999999999999999999",
               "0x10", "1.5", " 2", "\u00e9", "\x00", "[1]", "{", "auto"]
GPU_NAMES = ["h100", "a100", "a100-80gb", "h100-sxm5-80gb", "cpu", "gb200", "mi300x", "bogus", "", "x", "H100"]
CLUSTER_LINES = ["name: c", "nodes: 1", "gpus_per_node: 1", "gpu: h100-sxm5-80gb", "intra_node: nvlink4",
                 "inter_node: ib-ndr", "host_memory_GB: 16", "gpu: cpu", "intra_node: loopback"]


# ---- the surfaces ----------------------------------------------------------------------------------


def _model_seeds() -> list[tuple[str, Any]]:
    docs = [(".json", json.loads(p.read_text())) for p in sorted((EXAMPLES / "models").rglob("*.json"))]
    docs += [(".json", json.loads(p.read_text())) for p in sorted(HF.glob("*.json"))]
    graph = {"name": "graph", "hidden": 64, "seq_len": 16, "vocab": 100,
             "graph": [{"name": "block", "params": 1000, "flops_per_token": 2000.0,
                        "activation_bytes_per_token": 128.0, "repeat": 2, "tp_shardable": True}],
             "training": {"global_batch": 8, "precision": "bf16", "optimizer": "adamw"}}
    # every recipe key pinned (training.recipe), in a shorthand and a graph, so mutations reach each
    recipe = {"compile": False, "fused_loss": True, "tp_overlap": "none", "overlap": True, "fp8": "none"}
    tiny = json.loads((EXAMPLES / "models" / "tiny-llama.json").read_text())
    pinned = {**tiny, "training": {**tiny.get("training", {}), "recipe": recipe}}
    pinned_graph = {**graph, "training": {**graph["training"], "recipe": {"overlap": False}}}
    return [*docs, (".yaml", graph), (".json", graph), (".json", pinned), (".yaml", pinned), (".yaml", pinned_graph)]


def _cluster_seeds() -> list[Any]:
    return [yaml.safe_load(p.read_text()) for p in sorted((EXAMPLES / "clusters").glob("*.yaml"))]


def strategies() -> dict[str, st.SearchStrategy[Case]]:
    """Every surface's strategy (``{one-gpu.yaml}``: a 1-GPU cluster, whose one GPU divides any batch)."""
    models = _model_seeds()
    llama, a100 = str(LLAMA), str(A100)
    eval_model = ["evaluate", "{input.json}", ONE_GPU, "--plan", "tp=1"]
    big = ["--global-batch", str(2**20)]
    plan_text = st.lists(st.tuples(st.sampled_from(PLAN_KEYS), st.sampled_from(PLAN_VALUES)), max_size=5).map(
        lambda kv: ",".join(f"{k}={v}" for k, v in kv)) | st.text(max_size=30)
    cluster_text = st.tuples(st.sampled_from(["1", "2", "0", "-1", "8", "1e3", "x", "", "99999999999"]),
                             st.sampled_from(["x", "X", "*", ""]), st.sampled_from(["1", "8", "0", "-8", "72", "a"]),
                             st.sampled_from(["x", "X", ""]), st.sampled_from(GPU_NAMES)).map("".join) | st.text(max_size=20)
    cluster_files = st.one_of(mutated(_cluster_seeds()).map(lambda d: dump(d, ".yaml")), garbage(".yaml"),
                              st.lists(st.sampled_from(CLUSTER_LINES), max_size=8).map(lambda ls: "\n".join(ls).encode()))

    def model_case(pair: tuple[str, Any]) -> Case:
        suffix, doc = pair
        return Case("model", (("input" + suffix, dump(doc, suffix)),), tuple(a.replace(".json", suffix) for a in eval_model))

    def model_docs(draw_seeds: list[tuple[str, Any]]) -> st.SearchStrategy[tuple[str, Any]]:
        by_suffix = [st.tuples(st.just(sfx), mutated([d for s, d in draw_seeds if s == sfx])) for sfx in (".json", ".yaml")]
        return st.one_of(*by_suffix)

    return {
        "model": st.one_of(model_docs(models).map(model_case), garbage(".json").map(file_case("model", ".json", eval_model))),
        "hf": mutated([d for _, d in models if "model_type" in d]).map(
            lambda d: Case("hf", (("config.json", dump(d, ".json")),), ("evaluate", "{config.json}", ONE_GPU,
                                                                        "--plan", "tp=1"))),
        "cluster_file": cluster_files.map(file_case("cluster_file", ".yaml",
                                                    ["evaluate", str(TINY), "{input.yaml}", "--plan", "tp=1", *big])),
        "cluster_string": cluster_text.map(lambda s: Case("cluster_string", (), ("evaluate", str(TINY), s, "--plan",
                                                                                 "tp=1", *big))),
        "plan": plan_text.map(lambda s: Case("plan", (), ("evaluate", llama, a100, "--plan", s))),
        "fix": st.lists(plan_text, min_size=1, max_size=2).map(lambda fs: Case(
            "fix", (), ("solve", str(TINY), ONE_GPU, "--time-limit", "0.1", "--top", "1",
                        *[a for f in fs for a in ("--fix", f)]))),
        "calibration": st.one_of(mutated([calibration_seed()]).map(lambda d: dump(d, ".yaml")), garbage(".yaml")).map(
            file_case("calibration", ".yaml", ["evaluate", str(TINY), ONE_GPU, "--plan", "tp=1", "--calibration",
                                               "{input.yaml}"])),
        **fuzz_configs.strategies(),
        **fuzz_flags.strategies(),
    }


# ---- running one input -----------------------------------------------------------------------------


@dataclass
class Verdict:
    code: int | None  # the exit code
    crash: str  # "" when the contract held, else what escaped (with its traceback)


def _fixtures() -> tuple[tuple[str, bytes], ...]:
    """The files every case may name: a 1-GPU cluster and a plan.json of tiny-llama on it."""
    from autoplace.plan import build_plan

    plan = build_plan({}, world=1, blocks=4, global_batch=8, gpus_per_node=1)
    return (("one-gpu.yaml", ONE_GPU_TEXT.encode()), ("plan.json", json.dumps(plan.to_dict()).encode()))


def run_case(case: Case, workdir: Path) -> Verdict:
    """Write the case's files, run the CLI in-process, check the exit-code contract."""
    from typer.testing import CliRunner

    from autoplace.cli import app

    args = [a.replace("{work}", str(workdir)) for a in case.args]
    for name, data in (*case.files, *_fixtures()):
        path = workdir / name
        path.write_bytes(data)
        args = [a.replace("{" + name + "}", str(path)) for a in args]
    logging.root.handlers.clear()  # basicConfig binds the runner's stderr of the first call, closed since
    with contextlib.chdir(workdir):  # an output path "" or a relative one is written there, nowhere else
        result = CliRunner().invoke(app, args)
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        return Verdict(None, "".join(traceback.format_exception(exc)))
    err = result.stderr
    if "internal error" in err or "Traceback (most recent call last)" in result.output:
        again = CliRunner().invoke(app, ["--debug", *args])  # the traceback _fail hides
        text = "".join(traceback.format_exception(again.exception)) if again.exception else ""
        return Verdict(result.exit_code, f"{err.strip()}\n{text}")
    if result.exit_code not in (0, 1, 2, 3):
        return Verdict(result.exit_code, f"undocumented exit code {result.exit_code}: {err.strip()}")
    if result.exit_code == 2 and (len(err.splitlines()) != 1 or not err.startswith("autoplace: error:")):
        return Verdict(2, f"exit 2 without one error line: {err!r}")
    if case.expect and (result.exit_code != 2 or case.expect not in err):
        return Verdict(result.exit_code, f"expected exit 2 saying {case.expect!r}, got exit {result.exit_code}: "
                                         f"{err.strip()!r}")
    return Verdict(result.exit_code, "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("n", type=int, help="inputs in all, spread evenly over the surfaces")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--surface", nargs="+", help="only these surfaces")
    args = parser.parse_args()
    import functools

    import typer.testing

    # typer's runner rebuilds the click command from the app on every call: half of a call's time
    typer.testing._get_command = functools.cache(typer.testing._get_command)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory(prefix="autoplace-fuzz-") as tmp:
        work = Path(tmp)
        surfaces = strategies()
        names = args.surface or list(surfaces)
        counts: dict[str, Counter[str]] = {name: Counter() for name in names}
        crashes: dict[str, tuple[Case, str]] = {}
        t0 = time.monotonic()
        for name in names:
            @fix_seed(args.seed)
            @settings(max_examples=max(1, args.n // len(names)), database=None, deadline=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=surfaces[name])
            def fuzz(case: Case) -> None:
                verdict = run_case(case, work)
                counts[case.surface]["traceback" if verdict.crash else str(verdict.code)] += 1
                if verdict.crash:
                    crashes.setdefault(verdict.crash.strip().splitlines()[-1][:200], (case, verdict.crash))

            fuzz()
            print(f"{name}: {dict(counts[name])} ({time.monotonic() - t0:.0f} s so far)", flush=True)
    total: Counter[str] = sum(counts.values(), Counter())
    print(f"\n{sum(total.values())} inputs in {time.monotonic() - t0:.0f} s; by exit code: "
          + ", ".join(f"{k}: {v}" for k, v in sorted(total.items())))
    print(f"tracebacks: {total['traceback']} ({len(crashes)} distinct)")
    for last, (case, text) in crashes.items():
        print(f"\n--- {case.surface}: {last}\nargs: {case.args}\nfiles: {[(n, d[:300]) for n, d in case.files]}\n{text}")


if __name__ == "__main__":
    main()
