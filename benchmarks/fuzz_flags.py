"""benchmarks/fuzz.py's surfaces for the command line itself: every flag's range, usage errors on
every command, and plan keys given twice.

The flags are read from the app (typer's click command), so a flag added later is fuzzed without
a change here: an int option gets its bounds and beyond, odd spellings (``1e3``, ``+2``, an Arabic
digit), a float option ``nan``, ``inf``, ``1e308``..., a choice its values and near misses, a text
option the values its parser takes and refuses (``--gpus 8..4``, ``--tokens 1e400``).  solve,
evaluate, explain, scale, emit, check, profiles, submit (``--dry-run``), trace (a small torch model on
the meta device) and dryrun (on a folder that is no bundle) run to the end on a tiny model; tune,
calibrate and verify (which train, launch trials or read a study) only with a value their parser refuses, so each must stop at one
``autoplace: error: FLAG: ...`` line (``expect``).
"""

from __future__ import annotations

import functools
from typing import Any

from hypothesis import strategies as st

from benchmarks.fuzz_kit import ONE_GPU, TINY, Case

# commands run to the end: their arguments before the fuzzed options (later options win in click)
RUN: dict[str, list[list[str]]] = {
    "solve": [[str(TINY), ONE_GPU, "--time-limit", "0.5", "--top", "1"], [str(TINY), "--gpu", "h100"]],
    "evaluate": [[str(TINY), ONE_GPU, "--plan", "tp=1"], [str(TINY), "--gpu", "h100", "--plan", "tp=1"]],
    "explain": [[str(TINY), "--gpu", "h100", "--plan", "tp=1"]],
    "scale": [[str(TINY), "--gpu", "h100", "--gpus", "1,2", "--time-limit", "0.5"]],
    "emit": [["{plan.json}", "--model", str(TINY), "--cluster", ONE_GPU, "--out", "{work}/bundle"]],
    "check": [["{plan.json}", str(TINY), ONE_GPU]],
    "profiles": [[]],
    "submit": [[str(TINY), ONE_GPU, "--script", "train.py", "--dry-run", "--out", "{work}/job"]],  # never submits
    "trace": [["tests.trace_models:build", "--out", "{work}/model.json"]],  # on the meta device
    # never a bundle: the work directory's plan.json is the fixture, which names no inputs (no rank is started)
    "dryrun": [["{work}"], ["{work}/no-such-dir"]],
}
# commands that train, launch trials or read a study: fuzzed only where their parser refuses the line
PARSE_ONLY: dict[str, list[str]] = {
    "tune": [str(TINY), ONE_GPU, "--out", "{work}/tune"],
    "calibrate": [str(TINY), ONE_GPU, "--storage", "sqlite:///{work}/none.db", "--out", "{work}/cal.yaml"],
    "verify": [str(TINY), "--plan", "tp=1"],
}
INTS = ["-1", "0", "1", "2", "3", "4", "8", "16", "20", "21", "1024", "2147483647", "2147483648", "99999999999999999999",
        "1e3", "1.5", "2.0", "x", "", "+2", " 2", "\u0663", "0x10", "1_0"]
FLOATS = ["nan", "inf", "-inf", "1e308", "1e-308", "1e400", "0", "-0", "-1", "0.001", "0.1", "0.5", "1", "2", "10",
          "3600", "1e9", "x", "", "1,5", "0x1p3"]
TEXT = ["", "x", "0", "-1", "1", "8", "1e400", "nan", ",", "..", "\u0663", "'", "\x00", "a" * 300]
# what the parser of each text option takes and refuses (every other text option gets TEXT)
TEXT_VALUES: dict[str, list[str]] = {
    "--gpus": ["1", "2", "1,2", "1..4", "8..4", "0..8", "1..0", "1,,2", "2,2", "1..99999999999", "1..2147483648",
               "\u00b2", "1.5", "4096", "99999999999999999999"],
    "--global-batch": ["1", "8", "16", "8..32", "0", "8,8", "1..100000000", "100000001", "1..2147483648"],
    "--tokens": ["15T", "300B", "1M", "2.5e12", "1e400", "0", "-1T", "1e300P", "1e18", "1x", "1P", "1e30"],
    "--noise-scale": ["4M", "1", "1e9", "0", "1e400", "1e300P", "-4M", "x"],
    "--lora-targets": ["q", "q,v", "q,q", "q,k,v,o,gate,up,down", ",", "x", "Q", "q,,v", "gate,up"],
    "--framework": ["any", "none", "deepspeed", "megatron", "torchtitan", "fsdp", "accelerate", "Any", "x"],
    "--allow": ["offload", "cp", "ep", "interleave", "hsdp", "tp-across-nodes", "compress", "fp8", "x", "FP8"],
    "--deny": ["offload", "cp", "ep", "interleave", "hsdp", "tp-across-nodes", "compress", "fp8", "x"],
    "--gpu": ["h100", "a100", "a100-80gb", "h100-sxm5-80gb", "cpu", "l40s", "gb200", "x", "H100"],
    "--intra-node": ["nvlink4", "nvlink3", "pcie4", "x"], "--inter-node": ["ib-ndr", "ib-hdr", "x"],
    "--cluster": ["1x1xh100", "1x8xa100", "0x8xh100", "2x0xh100", "1x1xcpu", "99999999999x8xh100", "x"],
    "--plan": ["tp=1", "tp=2", "zero=3", "mbs=2", "pp=2,layers=2:2", "tp=1,tp=1", "x", "dp=99999999999"],
    "--fix": ["tp=1", "zero=3", "mbs=99999", "compile=true", "fp8=rowwise", "layers=4", "x=1", "tp=1,tp=2"],
    "--format": ["deepspeed", "megatron", "torchtitan", "fsdp", "accelerate", "torchrun", "slurm", "k8s", "x"],
    "--script": ["train.py", "", "a b.py", "'"],
}


@functools.cache
def _commands() -> dict[str, Any]:
    """Every command of the app (typer's click commands), by name."""
    from typer.main import get_command

    from autoplace.cli import app

    group: Any = get_command(app)
    return dict(group.commands)


def _options() -> dict[str, list[Any]]:
    """Every command's options (typer's click parameters), by command name."""
    return {name: [p for p in cmd.params if p.opts and p.opts[0].startswith("-")] for name, cmd in _commands().items()}


def _kind(param: Any) -> str:
    desc = param.type_descriptor
    if getattr(param, "is_flag", False):
        return "flag"
    if desc.choices:
        return "choice"
    return {int: "int", float: "float"}.get(desc.annotation, "path" if "Path" in str(desc.annotation) else "text")


def _values(param: Any) -> list[str]:
    """Values worth trying for one option: its range and beyond."""
    kind, desc, name = _kind(param), param.type_descriptor, param.opts[0]
    if kind == "int":
        bounds = [str(b + d) for b in (desc.parameter_info.min, desc.parameter_info.max) if b is not None
                  for d in (-1, 0, 1)]
        return INTS + bounds
    if kind == "float":
        return FLOATS + [repr(b) for b in (desc.parameter_info.min, desc.parameter_info.max) if b is not None]
    if kind == "choice":
        names = [str(getattr(c, "value", c)) for c in desc.choices]
        return names + [n.upper() for n in names] + [n + " " for n in names] + ["", "x"]
    if kind == "path":  # inside the work directory only (the fuzz runs there): it writes where --out says
        return ["{work}/out", "{work}", "{work}/missing/dir/x", "", "{one-gpu.yaml}", "{plan.json}", "{work}/x.json"]
    return TEXT_VALUES.get(name, []) + TEXT


@st.composite
def _run_case(draw: st.DrawFn, options: dict[str, list[Any]]) -> Case:
    command = draw(st.sampled_from(sorted(RUN)))
    args = [command, *draw(st.sampled_from(RUN[command]))]
    for param in draw(st.lists(st.sampled_from(options[command]), max_size=4)) if options[command] else []:
        if _kind(param) == "flag":
            args.append(draw(st.sampled_from([*param.opts, *param.secondary_opts, param.opts[0] + "=x"])))
        else:
            args += [param.opts[0], draw(st.sampled_from(_values(param)))]
    return Case("flags", (), tuple(args))


@st.composite
def _usage_case(draw: st.DrawFn, options: dict[str, list[Any]]) -> Case:
    """A command line its parser refuses, on any command: the one error line names the flag."""
    command = draw(st.sampled_from(sorted({*RUN, *PARSE_ONLY})))
    base = PARSE_ONLY.get(command) or RUN[command][0]
    typed = [p for p in options[command] if _kind(p) in ("int", "float", "choice")]
    # submit and dryrun pass options they do not know on to the launch (their context ignores them)
    unknown = [] if _commands()[command].context_settings.get("ignore_unknown_options") else ["unknown"]
    how = draw(st.sampled_from([*unknown, "no value", "missing", *(["bad value"] * 3 if typed else [])]))
    if how == "unknown":
        known = {o for p in _commands()[command].params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
        flag = draw(st.sampled_from(["--bogus", "--Top", "--time_limit", "--lora-rnk", "--jsonx"])
                    | st.from_regex(r"\A--[a-z][a-z_-]{0,14}\Z").filter(lambda f: f not in {*known, "--help"}))
        return Case("usage", (), (command, *base, flag), expect=f"{flag}: no such option")
    if how == "no value":  # an option that takes a value, last, without one
        valued = [p for p in options[command] if _kind(p) != "flag"]
        if not valued:
            return Case("usage", (), (command, *base, "--bogus"), expect="--bogus: no such option")
        param = draw(st.sampled_from(valued))
        return Case("usage", (), (command, *base, param.opts[0]), expect=f"{param.opts[0]}: ")
    if how == "missing":  # the arguments left out, the options kept
        if not base:
            return Case("usage", (), (command, "a", "b", "c", "d"), expect="unexpected extra argument")
        first = next((i for i, a in enumerate(base) if a.startswith("-")), len(base))
        return Case("usage", (), (command, *base[first:]), expect="required; none given")
    param = draw(st.sampled_from(typed))
    choices = {str(getattr(c, "value", c)) for c in param.type_descriptor.choices or ()}
    # letters are no number, and no choice once the choices are left out ("nan", "inf": not finite)
    letters = st.from_regex(r"\A[a-zA-Z]{1,10}\Z").filter(lambda v: v not in choices)
    value = draw(st.sampled_from(_refused(param)) | letters)
    return Case("usage", (), (command, *base, param.opts[0], value), expect=f"{param.opts[0]}: ")


def _refused(param: Any) -> list[str]:
    """Values the parser itself refuses for an int, float or choice option (never run)."""
    kind, desc = _kind(param), param.type_descriptor
    if kind == "choice":
        return ["x", "", "Full ", "NONE"]
    low = desc.parameter_info.min
    below = [str(low - 1)] if low is not None and kind == "int" else []
    if kind == "float":  # every float option refuses what is not a finite number (autoplace.cli_usage.finite)
        return ["x", "", "nan", "inf", "-inf", "1e400", *(["-1e9"] if low is not None else [])]
    return ["x", "", "1.5", "1e3", *below]


# plan keys and values the parser accepts, so a repeat is the one thing wrong with the line
KEY_VALUES = {"dp": ["1"], "dp_replicate": ["1"], "dp_shard": ["1"], "tp": ["1", "2"], "pp": ["1", "2"], "cp": ["1"],
              "ep": ["1"], "vpp": ["1"], "zero": ["0", "1", "3"], "mbs": ["1", "2"], "ga": ["1"],
              "sp": ["true", "false"], "recompute": ["none", "full"], "schedule": ["1f1b", "gpipe"],
              "offload_optimizer": ["none", "cpu"], "offload_params": ["none"], "layers": ["4", "2:2"],
              "recompute_layers": ["n:n:n:n"], "preset": ["zero1", "fsdp"], "compress": ["none", "bf16"],
              "powersgd_rank": ["1"], "compile": ["true", "false"], "fused_loss": ["true"], "tp_overlap": ["none"],
              "overlap": ["true", "false"], "fp8": ["none", "rowwise"]}


@st.composite
def _repeated_case(draw: st.DrawFn) -> Case:
    """A --plan string, or --fix words, naming a key twice: refused by name, never last-wins."""
    keys = draw(st.lists(st.sampled_from(sorted(KEY_VALUES)), min_size=1, max_size=4, unique=True))
    pairs = [f"{k}={draw(st.sampled_from(KEY_VALUES[k]))}" for k in keys]
    again = draw(st.sampled_from(keys))
    pairs.insert(draw(st.integers(pairs.index(next(p for p in pairs if p.startswith(again + "="))) + 1, len(pairs))),
                 f"{again}={draw(st.sampled_from(KEY_VALUES[again]))}")
    if draw(st.booleans()):
        return Case("repeated_keys", (), ("evaluate", str(TINY), ONE_GPU, "--plan", ",".join(pairs)),
                    expect=f"--plan: {again}: given twice")
    cut = draw(st.integers(0, len(pairs)))
    fixes = [",".join(part) for part in (pairs[:cut], pairs[cut:]) if part]
    return Case("repeated_keys", (), ("solve", str(TINY), ONE_GPU, "--time-limit", "0.2",
                                      *[a for f in fixes for a in ("--fix", f)]), expect=f"--fix: {again}: given twice")


def strategies() -> dict[str, st.SearchStrategy[Case]]:
    options = _options()
    return {"flags": _run_case(options), "usage": _usage_case(options), "repeated_keys": _repeated_case()}
