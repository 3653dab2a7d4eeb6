"""Hostile inputs through the CLI: every reader, N inputs, counts by exit code and the tracebacks found.

    python benchmarks/fuzz.py N [--seed S] [--surface NAME ...]

The surfaces: model files (shorthand, layer graph, a Hugging Face config.json of every family in
tests/data/hf), cluster files and ``NODESxGPUSxGPU`` strings, plan strings (``--plan``) and ``--fix``
values, calibration files (``--calibration``), and the framework configs ``autoplace check`` reads
(DeepSpeed JSON, accelerate YAML, torchtitan TOML; Megatron-LM has no reader behind ``check``).
Inputs are hypothesis strategies: seed documents mutated one to three times (a key deleted, an
unknown key added, a value replaced by a wrong type, a negative, zero, a huge or non-finite number,
a string), whole random documents and token soup.  Each input runs through the CLI in-process
(typer's runner), never a subprocess per input.

The contract (README "Exit codes"): 0, 1 (``check``'s REJECT), 2 (bad input: one stderr line), 3
(infeasible).  Any exception escaping the CLI, an ``internal error`` line, or an exit 2 that is not
one line is a *traceback*: printed with its input at the end.  tests/test_fuzz_inputs.py runs a
bounded slice of the same strategies.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fix_seed
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXAMPLES = REPO / "examples"
TINY = EXAMPLES / "models" / "tiny-llama.json"
HF = REPO / "tests" / "data" / "hf"
UNKNOWN_KEY = "zz_not_a_key"
BAD: list[Any] = ["bogus", "", "auto", [1], [], {"a": 1}, {}, None, True, False, -1, -0.5, 0, 0.5, 1, 2, 3, 7, 10**30,
                  -10**30, 2**63, math.nan, math.inf, -math.inf, "1e400", "8x8xh100"]
PLAN_KEYS = ["dp", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "vpp", "sp", "zero", "mbs", "grad_accum",
             "schedule", "offload_optimizer", "offload_params", "recompute", "layers", "zeropp", "compress", "", "x"]
PLAN_VALUES = ["1", "2", "0", "-1", "8", "3", "true", "false", "none", "cpu", "nvme", "full", "selective", "1f1b",
               "interleaved", "zb", "", "=", ",", "1:2", "2:2:2", "nan", "inf", "1e9", "99999999999999999999",
               "0x10", "1.5", " 2", "é", "\x00", "[1]", "{", "auto"]
GPU_NAMES = ["h100", "a100", "a100-80gb", "h100-sxm5-80gb", "cpu", "gb200", "mi300x", "bogus", "", "x", "H100"]
ONE_GPU = "name: one\nnodes: 1\ngpus_per_node: 1\ngpu: h100-sxm5-80gb\nintra_node: nvlink4\n"
CLUSTER_LINES = ["name: c", "nodes: 1", "gpus_per_node: 1", "gpu: h100-sxm5-80gb", "intra_node: nvlink4",
                 "inter_node: ib-ndr", "host_memory_GB: 16", "gpu: cpu", "intra_node: loopback"]


@dataclass(frozen=True)
class Case:
    """One input: the surface, the files it writes (name -> bytes) and the CLI arguments
    (``{name}`` is replaced by the file's path)."""

    surface: str
    files: tuple[tuple[str, bytes], ...]
    args: tuple[str, ...]


# ---- documents and their mutations --------------------------------------------------------------


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _mutate(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    """A deep copy of ``doc`` with one change at ``path``: ``del``, ``set`` or ``add`` (an unknown key)."""
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    target = parent[path[-1]] if path else doc
    if op == "add" and isinstance(target, dict):
        target[UNKNOWN_KEY] = value
    elif op == "del" and path:
        del parent[path[-1]]
    elif op == "set" and path:
        parent[path[-1]] = value
    return doc


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=8),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                       max_leaves=12)


@st.composite
def mutated(draw: st.DrawFn, seeds: list[Any]) -> Any:
    """A seed document with one to three changes."""
    doc = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 3))):
        paths: list[tuple[Any, ...]] = _paths(doc)
        at_root = not paths or draw(st.integers(0, 5)) == 0  # the root: only an unknown key can go there
        path: tuple[Any, ...] = () if at_root else draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["del", "set", "set", "add"]))
        doc = _mutate(doc, path, op, draw(st.sampled_from(BAD) | JSONISH))
    return doc


def _dump(doc: Any, suffix: str) -> bytes:
    if suffix == ".json":
        return json.dumps(doc, allow_nan=True).encode()
    if suffix == ".toml":
        return _toml(doc).encode()
    return yaml.safe_dump(doc, allow_unicode=True).encode()


def _toml(doc: Any, prefix: str = "") -> str:
    """A small TOML writer (tomllib reads only): tables of scalars and lists; anything else as a string."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return "nan" if v != v else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v if not isinstance(x, dict) and x is not None) + "]"
        return json.dumps(str(v))
    if not isinstance(doc, dict):
        return f"x = {value(doc)}\n"
    lines = [f"{json.dumps(str(k))} = {value(v)}" for k, v in doc.items() if not isinstance(v, dict) and v is not None]
    for k, v in doc.items():
        if isinstance(v, dict):
            name = f"{prefix}.{json.dumps(str(k))}" if prefix else json.dumps(str(k))
            lines.append(f"\n[{name}]\n" + _toml(v, name))
    return "\n".join(lines) + "\n"


def _file_case(surface: str, suffix: str, args: list[str]) -> Callable[[bytes], Case]:
    return lambda data: Case(surface, (("input" + suffix, data),), tuple(args))


def _garbage(suffix: str) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200), JSONISH.map(lambda d: _dump(d, suffix)),
                     st.lists(st.sampled_from(["{", "}", "[", "]", ":", ",", "-", " ", "\n", "a", "1", "'", '"',
                                               "&a", "*a", "!!python/object", "=", "[[x]]", "#"]), max_size=30)
                     .map(lambda t: "".join(t).encode()))


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


def _calibration_seed() -> dict[str, Any]:
    return {"schema": "autoplace.calibration/v1",
            "measured_on": {"gpu": "h100-sxm5-80gb", "gpus_per_node": 1, "intra_node": "nvlink4",
                            "inter_node": "ib-ndr", "framework": "native"},
            "assumptions": {"compute_scale": 0.9, "bandwidth_scale": 1.1, "overlap_slowdown": 0.2},
            "uncertainty": {"log_sigma": 0.1, "band_95": [0.8, 1.25]},
            "fit": {"trials": 5, "objective": "least squares on log step time", "error_before": 0.2,
                    "error_after": 0.1}}


def _framework_seeds() -> dict[str, list[Any]]:
    """DeepSpeed, accelerate and torchtitan configs autoplace emits for llama-3-8b on 8 GPUs."""
    import tomllib

    from autoplace.bundle import render
    from autoplace.cost.layers import layer_table
    from autoplace.errors import AutoplaceError
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    model, cluster = load_model(EXAMPLES / "models" / "llama-3-8b.json"), load_cluster(EXAMPLES / "clusters" /
                                                                                       "1x8-a100-80gb.yaml")
    out: dict[str, list[Any]] = {"deepspeed": [], "accelerate": [], "torchtitan": []}
    for text in ("dp_shard=8,zero=3,mbs=1", "dp_shard=8,zero=1,mbs=2,recompute=full", "tp=2,dp_shard=4,zero=3,mbs=1",
                 "dp_shard=8,zero=3,offload_optimizer=cpu,mbs=1", "pp=2,tp=2,dp_shard=2,zero=1,mbs=1"):
        plan = build_plan(parse_plan_string(text), world=8, blocks=layer_table(model).blocks,
                          global_batch=model.training.global_batch, gpus_per_node=8)
        for fmt, parse in (("deepspeed", json.loads), ("accelerate", yaml.safe_load), ("torchtitan", tomllib.loads)):
            try:
                out[fmt].append(parse(render(fmt, plan, model, cluster)[0].text))  # the framework's config first
            except AutoplaceError:
                continue
    return out


def strategies() -> dict[str, st.SearchStrategy[Case]]:
    """Every surface's strategy (``{one-gpu.yaml}``: a 1-GPU cluster, whose one GPU divides any batch)."""
    one_gpu = "{one-gpu.yaml}"
    models = _model_seeds()
    frameworks = _framework_seeds()
    llama, a100 = str(EXAMPLES / "models" / "llama-3-8b.json"), str(EXAMPLES / "clusters" / "1x8-a100-80gb.yaml")
    eval_model = ["evaluate", "{input.json}", str(one_gpu), "--plan", "tp=1"]
    big = ["--global-batch", str(2**20)]
    plan_text = st.lists(st.tuples(st.sampled_from(PLAN_KEYS), st.sampled_from(PLAN_VALUES)), max_size=5).map(
        lambda kv: ",".join(f"{k}={v}" for k, v in kv)) | st.text(max_size=30)
    cluster_text = st.tuples(st.sampled_from(["1", "2", "0", "-1", "8", "1e3", "x", "", "99999999999"]),
                             st.sampled_from(["x", "X", "*", ""]), st.sampled_from(["1", "8", "0", "-8", "72", "a"]),
                             st.sampled_from(["x", "X", ""]), st.sampled_from(GPU_NAMES)).map("".join) | st.text(max_size=20)
    cluster_files = st.one_of(mutated(_cluster_seeds()).map(lambda d: _dump(d, ".yaml")), _garbage(".yaml"),
                              st.lists(st.sampled_from(CLUSTER_LINES), max_size=8).map(lambda ls: "\n".join(ls).encode()))

    def model_case(pair: tuple[str, Any]) -> Case:
        suffix, doc = pair
        return Case("model", (("input" + suffix, _dump(doc, suffix)),), tuple(a.replace(".json", suffix) for a in eval_model))

    def model_docs(draw_seeds: list[tuple[str, Any]]) -> st.SearchStrategy[tuple[str, Any]]:
        by_suffix = [st.tuples(st.just(sfx), mutated([d for s, d in draw_seeds if s == sfx])) for sfx in (".json", ".yaml")]
        return st.one_of(*by_suffix)

    def check(fmt: str, suffix: str) -> st.SearchStrategy[Case]:
        return st.one_of(mutated(frameworks[fmt]).map(lambda d: _dump(d, suffix)), _garbage(suffix)).map(
            _file_case(fmt, suffix, ["check", "{input" + suffix + "}", llama, a100]))

    return {
        "model": st.one_of(model_docs(models).map(model_case), _garbage(".json").map(_file_case("model", ".json", eval_model))),
        "hf": mutated([d for _, d in models if "model_type" in d]).map(
            lambda d: Case("hf", (("config.json", _dump(d, ".json")),), ("evaluate", "{config.json}", str(one_gpu),
                                                                         "--plan", "tp=1"))),
        "cluster_file": cluster_files.map(_file_case("cluster_file", ".yaml",
                                                     ["evaluate", str(TINY), "{input.yaml}", "--plan", "tp=1", *big])),
        "cluster_string": cluster_text.map(lambda s: Case("cluster_string", (), ("evaluate", str(TINY), s, "--plan",
                                                                                 "tp=1", *big))),
        "plan": plan_text.map(lambda s: Case("plan", (), ("evaluate", llama, a100, "--plan", s))),
        "fix": st.lists(plan_text, min_size=1, max_size=2).map(lambda fs: Case(
            "fix", (), ("solve", str(TINY), str(one_gpu), "--time-limit", "0.1", "--top", "1",
                        *[a for f in fs for a in ("--fix", f)]))),
        "calibration": st.one_of(mutated([_calibration_seed()]).map(lambda d: _dump(d, ".yaml")), _garbage(".yaml")).map(
            _file_case("calibration", ".yaml", ["evaluate", str(TINY), str(one_gpu), "--plan", "tp=1", "--calibration",
                                                "{input.yaml}"])),
        "deepspeed": check("deepspeed", ".json"),
        "accelerate": check("accelerate", ".yaml"),
        "torchtitan": check("torchtitan", ".toml"),
    }


# ---- running one input -----------------------------------------------------------------------------


USAGE = -2  # exit 2 from click's own usage error (an option-like argument), counted apart


@dataclass
class Verdict:
    code: int | None  # the exit code; USAGE for click's usage errors
    crash: str  # "" when the contract held, else what escaped (with its traceback)


def run_case(case: Case, workdir: Path) -> Verdict:
    """Write the case's files, run the CLI in-process, check the exit-code contract."""
    from typer.testing import CliRunner

    from autoplace.cli import app

    args = list(case.args)
    for name, data in (*case.files, ("one-gpu.yaml", ONE_GPU.encode())):
        path = workdir / name
        path.write_bytes(data)
        args = [a.replace("{" + name + "}", str(path)) for a in args]
    logging.root.handlers.clear()  # basicConfig binds the runner's stderr of the first call, closed since
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
    if result.exit_code == 2 and err.startswith("Usage:"):  # click refused the command line itself
        return Verdict(USAGE, "")  # (e.g. a CLUSTER argument starting with "-": write it after "--")
    if result.exit_code == 2 and (len(err.splitlines()) != 1 or not err.startswith("autoplace: error:")):
        return Verdict(2, f"exit 2 without one error line: {err!r}")
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
                label = "2 (usage)" if verdict.code == USAGE else str(verdict.code)
                counts[case.surface]["traceback" if verdict.crash else label] += 1
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
