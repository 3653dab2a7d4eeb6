"""benchmarks/fuzz.py's surfaces for every reader ``autoplace check`` has, and for keys given twice.

``check CONFIG MODEL CLUSTER`` reads a plan.json (``solve --out``), DeepSpeed JSON, accelerate
YAML, torchtitan TOML, Megatron-LM arguments (``megatron_args.sh``) and the FSDP2 module
(``fsdp2_parallelize.py``).  Seeds are what autoplace writes for llama-3-8b on 8 A100s; each is
mutated (a value replaced by a hostile one: a float where an int goes, 1e308, [], [2**40], [33]
layers on a 32-layer model, ...), or replaced by garbage.  Keys given twice -- in a model,
cluster, calibration, plan.json or DeepSpeed file -- must be refused by name (``expect``).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import yaml
from hypothesis import strategies as st

from benchmarks.fuzz_kit import (
    A100,
    EXAMPLES,
    LLAMA,
    ONE_GPU,
    TINY,
    Case,
    calibration_seed,
    dump,
    file_case,
    garbage,
    mutated,
    repeating,
)

PLANS = ("dp_shard=8,zero=3,mbs=1", "dp_shard=8,zero=1,mbs=2,recompute=full", "tp=2,dp_shard=4,zero=3,mbs=1",
         "dp_shard=8,zero=3,offload_optimizer=cpu,mbs=1", "pp=2,tp=2,dp_shard=2,zero=1,mbs=1",
         "pp=4,vpp=2,dp_shard=2,zero=1,mbs=1,recompute_layers=" + ":".join("fn"[i % 2] for i in range(32)))
# words a Megatron-LM argument may become: bounds, other spellings of numbers, shell quoting
WORDS = ["0", "-1", "1", "2", "3", "8", "33", "2147483648", "99999999999999999999", "1.5", "2.0", "x", "", "'", '"',
         "\u0663", "+8", "8_0", " 8", "1e3", "--", "\\", "--bogus-flag", "none", "full", "block", "uniform", "selective",
         "t|t", "E|t*32|L", "t*33", "optim_grads", "tensorwise", "9" * 5000]
# literal sources an FSDP2 module's constant may become (the reader literal_evals them, never imports)
LITERALS = ["0", "-1", "2147483648", "10**30", "1e308", "2.0", "True", "None", "[]", "''", "'x'", "[1]", "{[1]: 2}",
            "(", "'none'", "('bogus',)", "('none',) * 32", "1j", "[" * 300 + "]" * 300, "'llama-3-8b'", "('full',)"]


def _seeds() -> dict[str, list[Any]]:
    """What autoplace writes for llama-3-8b on 1x8 A100 for each reader: plan.json documents,
    DeepSpeed / accelerate / torchtitan documents, Megatron argument files and FSDP2 modules (text)."""
    import tomllib

    from autoplace.bundle import render
    from autoplace.cost.layers import layer_table
    from autoplace.errors import AutoplaceError
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.cluster import load_cluster
    from autoplace.specs.model import load_model

    model, cluster = load_model(LLAMA), load_cluster(A100)
    parse = {"deepspeed": json.loads, "accelerate": yaml.safe_load, "torchtitan": tomllib.loads, "megatron": str,
             "fsdp": str}
    out: dict[str, list[Any]] = {"plan.json": [], **{fmt: [] for fmt in parse}}
    for text in PLANS:
        plan = build_plan(parse_plan_string(text), world=8, blocks=layer_table(model).blocks,
                          global_batch=model.training.global_batch, gpus_per_node=8)
        out["plan.json"].append(plan.to_dict())
        for fmt, read in parse.items():
            try:
                out[fmt].append(read(render(fmt, plan, model, cluster)[0].text))  # the framework's config first
            except AutoplaceError:  # a plan the framework cannot state
                continue
    return out


@st.composite
def megatron_args(draw: st.DrawFn, seeds: list[str]) -> bytes:
    """A Megatron argument file with one to three words replaced, dropped or added, or a quote put anywhere."""
    text = draw(st.sampled_from(seeds))
    if draw(st.integers(0, 5)) == 0:  # raw text: an unclosed quote, a stray byte
        at = draw(st.integers(0, len(text)))
        return (text[:at] + draw(st.sampled_from(["'", '"', "\\", "\x00", "(", ")", "#", "\n"])) + text[at:]).encode()
    words = shlex.split(text, comments=True)[1:-1]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(0, len(words) - 1)))
        op = draw(st.sampled_from(["set", "set", "del", "add", "repeat"]))
        if op == "set" and words:
            words[at] = draw(st.sampled_from(WORDS))
        elif op == "del" and words:
            del words[at]
        elif op == "add":
            words[at:at] = [draw(st.sampled_from([w for w in WORDS if w.startswith("--")] + [
                "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--fp8-format",
                "--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout",
                "--decoder-first-pipeline-num-layers", "--use-megatron-fsdp", "--num-distributed-optimizer-instances"])),
                draw(st.sampled_from(WORDS))]
        elif op == "repeat" and words:  # a flag given twice: Megatron's argparse keeps the last
            flag = draw(st.sampled_from([w for w in words if w.startswith("--")] or ["--micro-batch-size"]))
            words += [flag, draw(st.sampled_from(WORDS))]
    return ("MEGATRON_ARGS=(\n" + "\n".join(f"  {shlex.quote(w)}" for w in words) + "\n)\n").encode()


@st.composite
def fsdp_module(draw: st.DrawFn, seeds: list[str]) -> bytes:
    """An FSDP2 module with one to three of its plan constants given another literal, or deleted."""
    text = draw(st.sampled_from(seeds))
    names = re.findall(r"^([A-Z_]+) = ", text, flags=re.M)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        line = "" if draw(st.integers(0, 6)) == 0 else f"{name} = {draw(st.sampled_from(LITERALS))}"
        text = re.sub(rf"^{name} = .*$", lambda _m, line=line: line, text, count=1, flags=re.M)
    return text.encode()


def _check(name: str, suffix: str, data: st.SearchStrategy[bytes]) -> st.SearchStrategy[Case]:
    return data.map(file_case(name, suffix, ["check", "{input" + suffix + "}", str(LLAMA), str(A100)]))


def strategies() -> dict[str, st.SearchStrategy[Case]]:
    """The check readers' surfaces and the repeated-keys-in-files surface."""
    seeds = _seeds()

    def docs(fmt: str, suffix: str) -> st.SearchStrategy[bytes]:
        return st.one_of(mutated(seeds[fmt]).map(lambda d: dump(d, suffix)), garbage(suffix))

    return {
        "plan.json": _check("plan.json", ".json", docs("plan.json", ".json")),
        "deepspeed": _check("deepspeed", ".json", docs("deepspeed", ".json")),
        "accelerate": _check("accelerate", ".yaml", docs("accelerate", ".yaml")),
        "torchtitan": _check("torchtitan", ".toml", docs("torchtitan", ".toml")),
        "megatron": _check("megatron", ".sh", st.one_of(megatron_args(seeds["megatron"]), garbage(".sh"))),
        "fsdp": _check("fsdp", ".py", st.one_of(fsdp_module(seeds["fsdp"]), garbage(".py"))),
        "repeated_keys_in_files": repeated_in_files(seeds),
    }


def repeated_in_files(seeds: dict[str, list[Any]]) -> st.SearchStrategy[Case]:
    """A model, cluster, calibration, plan.json, DeepSpeed or accelerate file (JSON, or JSON text
    read as YAML) naming a key twice in one mapping: refused, never the last one silently kept."""
    models = [json.loads(p.read_text()) for p in sorted((EXAMPLES / "models").rglob("*.json"))]
    clusters = [yaml.safe_load(p.read_text()) for p in sorted((EXAMPLES / "clusters").glob("*.yaml"))]
    check = ["check", "{input}", str(LLAMA), str(A100)]
    either = (".json", ".yaml")
    kinds = [(models, ["evaluate", "{input}", ONE_GPU, "--plan", "tp=1"], either),
             (clusters, ["evaluate", str(TINY), "{input}", "--plan", "tp=1", "--global-batch", str(2**20)], either),
             ([calibration_seed()], ["evaluate", str(TINY), ONE_GPU, "--plan", "tp=1", "--calibration", "{input}"],
              either),
             (seeds["plan.json"], check, (".json",)), (seeds["deepspeed"], check, (".json",)),
             (seeds["accelerate"], check, (".yaml",))]

    def case(kind: int, suffix: str, text: str) -> Case:
        args = tuple(a.replace("{input}", "{input" + suffix + "}") for a in kinds[kind][1])
        return Case("repeated_keys_in_files", (("input" + suffix, text.encode()),), args, expect="given twice")

    return st.integers(0, len(kinds) - 1).flatmap(lambda k: st.tuples(
        st.just(k), st.sampled_from(kinds[k][2]), repeating(kinds[k][0]))).map(lambda t: case(*t))
