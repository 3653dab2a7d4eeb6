"""Fuzzing the input boundary: the model and cluster loaders, and ``autoplace evaluate`` on top.

The contract (docs/ARCHITECTURE.md, "Command-line contract"): bad input is exit code 2 with one line
naming the file, the field and what is wrong, never a traceback. Below the CLI that means a
loader either returns a spec or raises :class:`SpecError` -- never any other exception -- and
the error names the file and, for a one-field change, the dotted path of that field.

Inputs are mutations of the shipped example files (delete a key, add an unknown key, replace a
value with a wrong type, a negative, zero, 10**30, NaN, inf, a string, a list or null), plus
random bytes, YAML token soup, truncated files, empty files, alias bombs, deep nesting and
top-level non-mappings.

The loader/CLI bugs an earlier pass of these tests found are pinned by the regression tests
at the end.  Should a new one turn up, pin it there as ``xfail(strict=True)`` and step the fuzz
tests around exactly its inputs with a ``_known_*`` predicate, so that they keep guarding the
rest; when it is fixed, delete the marker and the predicate together.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from autoplace.cli import app
from autoplace.errors import SpecError
from autoplace.specs.cluster import load_cluster
from autoplace.specs.model import load_model
from benchmarks.fuzz import Case as FuzzCase
from benchmarks.fuzz import run_case as run_fuzz_case
from benchmarks.fuzz import strategies as fuzz_strategies

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
LOADERS: dict[str, Callable[[Path], Any]] = {"model": load_model, "cluster": load_cluster}
UNKNOWN_KEY = "zz_not_a_key"
HUGE = 10**30
# Values swapped in for a field. Integers stay tiny or absurd: a mid-size count (layers=10**8)
# is accepted by the loader and makes the evaluator allocate gigabytes, which is not what
# these tests are about.
BAD_VALUES: list[Any] = ["bogus", "", [1], [], {"a": 1}, {}, None, True, False, -1, -0.5, 0, 0.5, 3, 7, HUGE,
                         -HUGE, math.nan, math.inf, -math.inf]

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- seed documents


@dataclass(frozen=True)
class Seed:
    """A valid document to mutate: what it is, how it is written, and where its fields are."""

    kind: str  # "model" or "cluster"
    label: str
    suffix: str  # ".json" or ".yaml"
    doc: dict[str, Any]
    hf: bool = False
    paths: tuple[tuple[Any, ...], ...] = field(default=(), compare=False)

    @property
    def key_paths(self) -> list[tuple[Any, ...]]:
        """Paths that end in a mapping key (the ones a 'delete' can remove)."""
        return [p for p in self.paths if isinstance(p[-1], str)]

    @property
    def mapping_paths(self) -> list[tuple[Any, ...]]:
        """The document root and every nested mapping (where an unknown key can go)."""
        return [(), *(p for p in self.paths if isinstance(_get(self.doc, p), dict))]


def _walk(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _walk(value, (*prefix, key))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _seed(kind: str, label: str, suffix: str, doc: dict[str, Any], hf: bool = False) -> Seed:
    return Seed(kind, label, suffix, doc, hf, tuple(_walk(doc)))


def _shipped_seeds() -> list[Seed]:
    seeds = []
    for path in sorted((EXAMPLES / "models").rglob("*.json")):
        doc = json.loads(path.read_text())
        seeds.append(_seed("model", str(path.relative_to(EXAMPLES)), ".json", doc, hf="model_type" in doc))
    for path in sorted((EXAMPLES / "clusters").glob("*.yaml")):
        seeds.append(_seed("cluster", str(path.relative_to(EXAMPLES)), ".yaml", yaml.safe_load(path.read_text())))
    return seeds


def _synthetic_seeds() -> list[Seed]:
    """Valid documents reaching the nested fields the examples leave out (moe, precision mapping,
    layer graph, inline GPU and link profiles)."""
    moe = json.loads((EXAMPLES / "models" / "tiny-llama.json").read_text())
    moe["moe"] = {"experts": 8, "top_k": 2, "expert_ffn_hidden": 128, "shared_experts": 1,
                  "shared_ffn_hidden": 64, "first_dense_layers": 1, "layer_freq": 1}
    moe["training"]["precision"] = {"name": "custom", "param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12,
                                    "activation_bytes": 2, "compute_dtype": "bf16"}
    graph = {"name": "graph", "hidden": 64, "seq_len": 16, "vocab": 100,
             "graph": [{"name": "block", "params": 1000, "flops_per_token": 2000.0,
                        "activation_bytes_per_token": 128.0, "repeat": 2, "tp_shardable": True}],
             "training": {"global_batch": 8, "precision": "bf16", "optimizer": "adamw"}}
    inline = {"name": "inline", "nodes": 2, "gpus_per_node": 2,
              "gpu": {"name": "gpu-x", "memory_GiB": 80, "peak_TFLOPS": {"bf16": 100, "fp32": 10},
                      "hbm_bandwidth_TBps": 2, "host_link": "pcie4", "attention_efficiency": {"forward": [[512, 0.5], [4096, 0.7]]}},
              "intra_node": {"bandwidth_GBps": 100, "latency_us": 1, "achievable_fraction": 0.8},
              "inter_node": {"bandwidth_GBps": 25, "latency_us": 5}, "host_memory_GB": 256}
    return [_seed("model", "synthetic/moe-precision.json", ".json", moe),
            _seed("model", "synthetic/graph.yaml", ".yaml", graph),
            _seed("cluster", "synthetic/inline-profiles.yaml", ".yaml", inline)]


SEEDS = _shipped_seeds() + _synthetic_seeds()


def test_seeds_are_valid_and_cover_both_kinds(tmp_path: Path) -> None:
    """Every seed loads as written by the fuzz tests' own writer; otherwise a mutation proves nothing."""
    assert {s.kind for s in SEEDS} == {"model", "cluster"}
    assert any(s.hf for s in SEEDS)
    for seed in SEEDS:
        assert _load(seed.kind, _write(tmp_path, seed.suffix, _dump(seed.doc, seed.suffix))) is None, seed.label


# --------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Mutation:
    op: str  # "delete", "unknown" (add a key) or "replace"
    path: tuple[Any, ...]
    value: Any = None

    @property
    def dotted(self) -> str:
        return ".".join(map(str, self.path))

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(doc)
        parent = _get(out, self.path[:-1])
        if self.op == "delete":
            del parent[self.path[-1]]
        else:
            parent[self.path[-1]] = self.value
        return out


@st.composite
def mutations(draw: st.DrawFn, seed: Seed, values: st.SearchStrategy[Any]) -> Mutation:
    op = draw(st.sampled_from(["delete", "unknown", "replace", "replace"]))
    if op == "delete":
        return Mutation(op, draw(st.sampled_from(seed.key_paths)))
    if op == "unknown":
        return Mutation(op, (*draw(st.sampled_from(seed.mapping_paths)), UNKNOWN_KEY), draw(values))
    return Mutation(op, draw(st.sampled_from(list(seed.paths))), draw(values))


def _dump(doc: Any, suffix: str) -> str:
    if suffix == ".json":
        # json.dumps spells inf as Infinity (not JSON); 1e999 is valid JSON that Python reads as inf.
        return json.dumps(doc).replace("-Infinity", "-1e999").replace("Infinity", "1e999")
    return yaml.safe_dump(doc, sort_keys=False)


def _write(folder: Path, suffix: str, content: str | bytes, stem: str = "input") -> Path:
    path = folder / f"{stem}{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _load(kind: str, path: Path) -> SpecError | None:
    """Run the loader: None on success, the SpecError otherwise; anything else propagates (a bug)."""
    try:
        LOADERS[kind](path)
    except SpecError as err:
        assert str(err).startswith(f"{path}: "), f"error does not name the file first: {err}"
        assert len(str(err).splitlines()) == 1, f"error is not one line: {err!r}"
        return err
    return None


def _mentions(text: str, name: str) -> bool:
    """``name`` appears in ``text`` as a whole dotted token (so 'heads' is not found in 'kv_heads')."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


def names_field(err: SpecError, path: tuple[Any, ...]) -> bool:
    """Whether the message names the field at ``path``.

    Accepted: the dotted path itself; for a list element, the list; for a cross-field check
    reported on a sibling (``kv_heads must divide heads (3)`` after changing ``heads``), the
    parent path and the key's own name in the message; for a top-level key, its name anywhere.
    """
    text = str(err).removeprefix(f"{err.source}: ") if err.source else str(err)
    if _mentions(text, ".".join(map(str, path))):
        return True
    parent, leaf = path[:-1], path[-1]
    if not parent:
        # A top-level default for a per-pool key (inter_node) may be reported where it is
        # missing: "pools.0.inter_node: required when there is more than one node".
        return re.search(rf"(?<!\w){re.escape(str(leaf))}(?!\w)", text) is not None
    return _mentions(text, ".".join(map(str, parent))) and (isinstance(leaf, int) or _mentions(text, str(leaf)))


def _unnamed_by_design(mutation: Mutation) -> bool:
    """Not a bug: without model_type a config is read as shorthand and without graph a model is a
    transformer, so the message names the first missing key of that form, not the deleted one."""
    return mutation.op == "delete" and mutation.path in {("model_type",), ("graph",)}


# --------------------------------------------------------------------------- the loaders


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@st.composite
def seeded_mutation(draw: st.DrawFn, seeds: list[Seed], values: st.SearchStrategy[Any]) -> tuple[Seed, Mutation]:
    seed = draw(st.sampled_from(seeds))
    return seed, draw(mutations(seed, values))


LOADER_VALUES = st.sampled_from(BAD_VALUES) | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)


@settings(FAST, max_examples=450)
@given(case=seeded_mutation(SEEDS, LOADER_VALUES))
def test_single_field_mutation_is_loaded_or_named(fuzz_dir: Path, case: tuple[Seed, Mutation]) -> None:
    """One changed field: the loader accepts it, or its SpecError names the file and that field."""
    seed, mutation = case
    doc = mutation.apply(seed.doc)
    path = _write(fuzz_dir, seed.suffix, _dump(doc, seed.suffix))
    err = _load(seed.kind, path)
    if err is None:
        return  # legitimately accepted (another valid int, an optional key removed, an HF key ignored)
    if seed.suffix == ".json" and isinstance(mutation.value, float) and math.isnan(mutation.value):
        assert "NaN" in str(err)  # NaN is not JSON: a parse error, there is no field yet
        return
    if _unnamed_by_design(mutation):
        return
    assert names_field(err, mutation.path), f"{seed.label}: {mutation} -> {err}"


JSON_KEYS = sorted({str(p[-1]) for s in SEEDS for p in s.paths if isinstance(p[-1], str)})
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10)
           | st.sampled_from(["llama", "mixtral", "deepseek_v2", "qwen2_moe", "gpt2", "gpt_neox", "a100-sxm4-80gb",
                              "nvlink4", "swiglu", "bf16"]))
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(JSON_KEYS) | st.text(max_size=6),
                                                                 inner, max_size=8),
    max_leaves=24)


@settings(FAST, max_examples=150)
@given(doc=DOCUMENTS, kind=st.sampled_from(["model", "cluster"]), suffix=st.sampled_from([".json", ".yaml"]))
def test_random_document_is_loaded_or_rejected(fuzz_dir: Path, doc: Any, kind: str, suffix: str) -> None:
    """Any JSON-shaped document (top-level list, scalar, null, mapping of known and unknown keys)."""
    _load(kind, _write(fuzz_dir, suffix, _dump(doc, suffix)))


@settings(FAST, max_examples=100)
@given(seed=st.sampled_from(SEEDS), overlay=st.dictionaries(st.sampled_from(JSON_KEYS), DOCUMENTS, min_size=1,
                                                             max_size=4))
def test_many_fields_replaced_is_loaded_or_rejected(fuzz_dir: Path, seed: Seed, overlay: dict[str, Any]) -> None:
    """A valid document with several top-level fields replaced by random values."""
    _load(seed.kind, _write(fuzz_dir, seed.suffix, _dump({**seed.doc, **overlay}, seed.suffix)))


@settings(FAST, max_examples=100)
@given(data=st.binary(max_size=400), kind=st.sampled_from(["model", "cluster"]),
       suffix=st.sampled_from([".json", ".yaml"]))
def test_random_bytes_are_rejected_cleanly(fuzz_dir: Path, data: bytes, kind: str, suffix: str) -> None:
    """Arbitrary bytes, most of them not UTF-8."""
    _load(kind, _write(fuzz_dir, suffix, data))


YAML_TOKENS = ["- ", "[", "]", "{", "}", ": ", ",", "&a ", "*a", "!!str ", "!!binary ", "!!python/name:os.system",
               "? ", "|", ">", "'", '"', "#", "---\n", "...\n", "%YAML 1.1\n", "\t", "\n", "  ", "layers", "gpu",
               "nodes", "pools", "1e999", ".nan", ".inf", "-1", "0x10", "0o7", "1_000", "2024-01-01", "~", "null",
               "yes", "\x00", "\ufeff", "é", "\\"]


@settings(FAST, max_examples=100)
@given(tokens=st.lists(st.sampled_from(YAML_TOKENS), max_size=40), kind=st.sampled_from(["model", "cluster"]))
def test_yaml_token_soup_is_rejected_cleanly(fuzz_dir: Path, tokens: list[str], kind: str) -> None:
    """Strings built from YAML syntax: anchors, aliases, tags, flow/block mixes, directives."""
    _load(kind, _write(fuzz_dir, ".yaml", "".join(tokens)))


EXAMPLE_FILES = sorted([*(EXAMPLES / "models").rglob("*.json"), *(EXAMPLES / "clusters").glob("*.yaml")])


def _kind_of(path: Path) -> str:
    return "model" if "models" in path.parts else "cluster"


@settings(FAST, max_examples=100)
@given(source=st.sampled_from(EXAMPLE_FILES), cut=st.floats(0, 1, exclude_max=True))
def test_truncated_example_is_rejected_cleanly(fuzz_dir: Path, source: Path, cut: float) -> None:
    """An example file cut short anywhere (mid-key, mid-number, mid multi-byte character)."""
    data = source.read_bytes()
    _load(_kind_of(source), _write(fuzz_dir, source.suffix, data[: int(len(data) * cut)]))


# --------------------------------------------------------------------------- fixed hostile inputs

BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]" for p, x in zip("abcdefgh", "bcdefghi", strict=True)]) + "\n"


@pytest.mark.parametrize("kind", ["model", "cluster"])
@pytest.mark.parametrize(("suffix", "content", "says"), [
    pytest.param(".json", "", "invalid JSON", id="empty-json"),
    pytest.param(".json", "   \n", "invalid JSON", id="blank-json"),
    pytest.param(".yaml", "", "empty file", id="empty-yaml"),
    pytest.param(".yaml", "# only a comment\n", "empty file", id="comment-only-yaml"),
    pytest.param(".json", "[]", "mapping", id="json-empty-list"),
    pytest.param(".json", "[1, 2]", "mapping", id="json-list"),
    pytest.param(".json", "42", "mapping", id="json-number"),
    pytest.param(".json", '"text"', "mapping", id="json-string"),
    pytest.param(".json", "null", "mapping", id="json-null"),
    pytest.param(".yaml", "- a\n- b\n", "mapping", id="yaml-list"),
    pytest.param(".yaml", "just a string\n", "mapping", id="yaml-string"),
    pytest.param(".yaml", "3.5\n", "mapping", id="yaml-number"),
    pytest.param(".json", '{"layers": 1,', "invalid JSON", id="json-truncated"),
    pytest.param(".json", "NaN", "NaN", id="json-nan"),
    pytest.param(".yaml", "a: 1\n---\nb: 2\n", "invalid YAML", id="yaml-two-documents"),
    pytest.param(".yaml", "a: [1, 2\n", "invalid YAML", id="yaml-unclosed"),
    pytest.param(".yaml", "? [1, 2]\n: 3\n", "invalid YAML", id="yaml-list-as-key"),
    pytest.param(".yaml", "a: !!python/object/apply:os.system ['true']\n", "invalid YAML", id="yaml-python-tag"),
    pytest.param(".yaml", BILLION_LAUGHS, "alias", id="billion-laughs"),
    pytest.param(".yaml", BILLION_LAUGHS + "name: *i\n", "alias", id="billion-laughs-in-a-field"),
    pytest.param(".json", "[" * 100_000 + "]" * 100_000, "invalid JSON", id="json-100k-nested-lists"),
    pytest.param(".yaml", "[" * 20_000 + "]" * 20_000, "invalid YAML", id="yaml-20k-nested-flow-lists"),
    pytest.param(".yaml", "a:\n" + "".join(" " * i + "-\n" for i in range(1, 1500)), "invalid YAML",
                 id="yaml-1500-nested-block-lists"),
])
def test_hostile_file_is_one_clear_spec_error(tmp_path: Path, kind: str, suffix: str, content: str, says: str) -> None:
    path = _write(tmp_path, suffix, content)
    err = _load(kind, path)
    assert err is not None and says in str(err), err


def test_deep_flow_nesting_is_refused_before_parsing() -> None:
    """The work a hostile document costs is bounded by a depth count before the parser runs
    (issue 12: bound work, not wall-clock time, in tests)."""
    from autoplace.specs import _io

    assert _io._flow_depth("a: [1, {b: [2]}]") == 3
    with pytest.raises(SpecError, match="nested deeper than"):
        _io._parse_yaml("[" * (_io.MAX_FLOW_DEPTH + 1), "x.yaml")


@pytest.mark.parametrize(("content", "says"), [
    pytest.param("é".encode("latin-1"), "not UTF-8", id="latin-1"),
    pytest.param((EXAMPLES / "models" / "llama-3-8b.json").read_text().encode("utf-16"), "not UTF-8", id="utf-16"),
    pytest.param(b"\xff\xfe\x00", "not UTF-8", id="bom-bytes"),
    pytest.param(b"{" + b" " * (5 * 2**20) + b"}", "bytes", id="over-4MiB"),
])
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_unreadable_bytes_are_one_clear_spec_error(tmp_path: Path, content: bytes, says: str, suffix: str) -> None:
    err = _load("model", _write(tmp_path, suffix, content))
    assert err is not None and says in str(err), err


def test_yaml_python_tags_are_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = _write(tmp_path, ".yaml", f"a: !!python/object/apply:os.system ['touch {marker}']\n")
    assert _load("cluster", path) is not None
    assert not marker.exists()


def test_deep_nesting_inside_a_field_names_the_field(tmp_path: Path) -> None:
    doc = json.loads((EXAMPLES / "models" / "llama-3-8b.json").read_text())
    text = json.dumps(doc).replace('"layers": 32', '"layers": ' + "[" * 500 + "]" * 500)
    err = _load("model", _write(tmp_path, ".json", text))
    assert err is not None and err.field == "layers", err


@pytest.mark.parametrize("name", ["missing.json", "missing.yaml", "a-directory.yaml"])
def test_unreadable_path_is_one_clear_spec_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.startswith("a-directory"):
        path.mkdir()
    for kind in LOADERS:
        err = _load(kind, path)
        assert err is not None and "cannot read" in str(err)


# --------------------------------------------------------------------------- through the CLI

RUNNER = CliRunner()


@pytest.fixture(scope="module")
def one_gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-GPU cluster: every model's global batch divides dp=1, so model errors are the file's."""
    path = tmp_path_factory.mktemp("clusters") / "one-gpu.yaml"
    path.write_text(yaml.safe_dump({"name": "one", "nodes": 1, "gpus_per_node": 1, "gpu": "h100-sxm5-80gb",
                                    "intra_node": "nvlink4"}))
    return path


def _evaluate(model: Path, cluster: Path, *extra: str) -> Result:
    return RUNNER.invoke(app, ["evaluate", str(model), str(cluster), "--plan", "tp=1", *extra])


def _assert_cli_contract(result: Result, expected: SpecError | None, files: list[Path]) -> None:
    """Exit 0 or 2; on 2 exactly one stderr line 'autoplace: error: ...' naming the file; no traceback."""
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 2), (result.exit_code, result.output, result.exception)
    if result.exit_code == 0:
        assert expected is None, f"CLI accepted what the loader refused: {expected}"
        return
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplace: error:"), result.stderr
    assert result.stdout == "", result.stdout
    if expected is not None:
        assert lines[0] == f"autoplace: error: {expected}"
    else:
        assert any(str(f) in lines[0] for f in files) or "--plan" in lines[0], lines[0]


@st.composite
def cli_case(draw: st.DrawFn) -> tuple[Seed, list[Mutation], bool]:
    seed = draw(st.sampled_from(SEEDS))
    applied = draw(st.lists(mutations(seed, st.sampled_from(BAD_VALUES)), min_size=1, max_size=3))
    return seed, applied, draw(st.booleans())


@settings(FAST, max_examples=150)
@given(case=cli_case())
def test_cli_on_mutated_examples_keeps_the_exit_code_contract(fuzz_dir: Path, one_gpu_cluster: Path,
                                                              case: tuple[Seed, list[Mutation], bool]) -> None:
    """``autoplace evaluate MODEL CLUSTER --plan tp=1`` on one to three mutations of a seed file."""
    seed, applied, as_json = case
    doc = seed.doc
    for m in applied:
        try:
            doc = m.apply(doc)
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed or replaced the parent
            assume(False)
    path = _write(fuzz_dir, seed.suffix, _dump(doc, seed.suffix), stem="cli-input")
    expected = _load(seed.kind, path)
    model, cluster = (path, one_gpu_cluster) if seed.kind == "model" else (EXAMPLES / "models" / "tiny-llama.json", path)
    # A cluster under test gets --global-batch 2**20, a multiple of every shipped cluster's GPU
    # count; a model under test keeps its own batch (the 1-GPU cluster divides any).
    batch = ["--global-batch", str(2**20)] if seed.kind == "cluster" else []
    result = _evaluate(model, cluster, *batch, *(["--json"] if as_json else []))
    _assert_cli_contract(result, expected, [path])
    if expected is not None and len(applied) == 1 and not _unnamed_by_design(applied[0]) and not (
            seed.suffix == ".json" and isinstance(applied[0].value, float) and math.isnan(applied[0].value)):
        assert names_field(expected, applied[0].path), f"{seed.label}: {applied[0]} -> {expected}"
    if result.exit_code == 0 and as_json:
        assert json.loads(result.stdout)["plan"]["degrees"]["tp"] == 1


GARBAGE = st.one_of(
    st.binary(max_size=200).map(lambda b: (b, ".json")),
    st.binary(max_size=200).map(lambda b: (b, ".yaml")),
    st.lists(st.sampled_from(YAML_TOKENS), max_size=30).map(lambda t: ("".join(t).encode(), ".yaml")),
    st.tuples(st.sampled_from(EXAMPLE_FILES), st.floats(0, 1, exclude_max=True)).map(
        lambda c: (c[0].read_bytes()[: int(c[0].stat().st_size * c[1])], c[0].suffix)),
    st.sampled_from([(b"", ".json"), (b"", ".yaml"), (b"[]", ".json"), (b"- 1\n", ".yaml"), (b"null", ".json"),
                     (BILLION_LAUGHS.encode(), ".yaml"), (b"[" * 50_000, ".json")]),
)


@settings(FAST, max_examples=60)
@given(garbage=GARBAGE, as_model=st.booleans())
def test_cli_on_garbage_files_prints_one_line(fuzz_dir: Path, one_gpu_cluster: Path, garbage: tuple[bytes, str],
                                              as_model: bool) -> None:
    content, suffix = garbage
    path = _write(fuzz_dir, suffix, content, stem="cli-garbage")
    expected = _load("model" if as_model else "cluster", path)
    model, cluster = (path, one_gpu_cluster) if as_model else (EXAMPLES / "models" / "tiny-llama.json", path)
    _assert_cli_contract(_evaluate(model, cluster, "--global-batch", str(2**20)), expected, [path])


# --------------------------------------------------------------------------- every reader (benchmarks/fuzz.py)

# The strategies benchmarks/fuzz.py runs N of: model files (shorthand, graph, the HF config of every
# family in tests/data/hf), cluster files and NxGxGPU strings, --plan and --fix values, calibration
# files, every config ``check`` reads (plan.json, DeepSpeed, accelerate, torchtitan, Megatron-LM, FSDP2),
# keys given twice (files, --plan, --fix), every flag's range and usage errors; a bounded slice here.
SURFACES = fuzz_strategies()
# issue 36's surfaces, fewer each: a flag case may run a (tiny) search
SLICE = {"plan.json": 6, "megatron": 6, "fsdp": 6, "repeated_keys_in_files": 6, "repeated_keys": 6, "usage": 8,
         "flags": 5}


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_reader_keeps_the_exit_code_contract(surface: str, tmp_path: Path) -> None:
    """No exception escapes the CLI: exit 0, 1 (check's REJECT), 2 with one line, or 3; an input
    bad by construction (a key given twice, a flag's refused value) exits 2 saying so."""

    @settings(FAST, max_examples=SLICE.get(surface, 12), database=None)
    @given(case=SURFACES[surface])
    def run(case: FuzzCase) -> None:
        verdict = run_fuzz_case(case, tmp_path)
        assert not verdict.crash, f"{case.args} {case.files}: {verdict.crash}"

    run()


@pytest.mark.parametrize(("name", "content", "says"), [
    ("calibration.yaml", "uncertainty: [1]\n", "uncertainty: expected a mapping"),
    ("calibration.yaml", "uncertainty: {band_95: [a, b]}\n", "uncertainty.band_95: expected [low <= 1"),
    ("calibration.yaml", "assumptions: {zero12_grad_reduce: 2.0}\n", "a flag or a choice"),
    ("calibration.yaml", "assumptions: {zero3_prefetch_units: 0.5}\n", "expected a whole number"),
])
def test_calibration_file_errors_are_one_line(tmp_path: Path, one_gpu_cluster: Path, name: str, content: str,
                                              says: str) -> None:
    """Found by benchmarks/fuzz.py: AttributeError / TypeError (exit 1, internal error), or a float
    silently accepted for a choice and truncated for a count."""
    cal = tmp_path / name
    cal.write_text(content)
    result = _evaluate(EXAMPLES / "models" / "tiny-llama.json", one_gpu_cluster, "--calibration", str(cal))
    assert result.exit_code == 2 and says in result.stderr and len(result.stderr.splitlines()) == 1, result.output


@pytest.mark.parametrize("plan", ["ep=99999999999999999999", "tp=\u00b2", "mbs=2147483648"])
def test_plan_integer_out_of_range_is_one_line(plan: str) -> None:
    """Found by benchmarks/fuzz.py: ep=10**20 overflowed the cost model's int64 arrays (OverflowError),
    and a Unicode digit passed isdigit() but not int() (ValueError): both exit 1, internal error."""
    result = RUNNER.invoke(app, ["evaluate", str(EXAMPLES / "models" / "llama-3-8b.json"),
                                 str(EXAMPLES / "clusters" / "1x8-a100-80gb.yaml"), "--plan", plan])
    assert result.exit_code == 2 and "below 2**31" in result.stderr and len(result.stderr.splitlines()) == 1, \
        result.output


def test_config_reader_refuses_counts_beyond_int64_range(tmp_path: Path) -> None:
    """benchmarks/fuzz.py 12000 found a torchtitan TOML whose huge count reached the cost model's
    int64 arrays in ``check`` (OverflowError, exit 1; the log kept only the input's first bytes).
    The readers' one integer check now bounds every count below 2**31 (autoplace.plan.count_at, as plan strings)."""
    cfg = tmp_path / "job.toml"
    cfg.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nseq_len = 8192\n'
                   'mixed_precision_param = "bfloat16"\nlocal_batch_size = 100000000000000000000\n'
                   '[parallelism]\ndata_parallel_shard_degree = 8\n')
    llama31 = Path(__file__).parent / "data" / "hf" / "llama-3.1-8b.json"  # torchtitan's own 8B flavor
    result = RUNNER.invoke(app, ["check", str(cfg), str(llama31), str(EXAMPLES / "clusters" / "1x8-a100-80gb.yaml")])
    assert result.exit_code == 2 and "below 2**31" in result.stderr and len(result.stderr.splitlines()) == 1, \
        result.output


def test_hf_rope_type_that_is_not_a_name_is_one_line(tmp_path: Path, one_gpu_cluster: Path) -> None:
    """Found by test_cli_on_mutated_examples: ``rope_scaling.type: ["yarn"]`` was TypeError (unhashable)."""
    config = json.loads((REPO / "tests" / "data" / "hf" / "deepseek-v2-lite.json").read_text())
    config["rope_scaling"] = {**config["rope_scaling"], "type": ["yarn"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = _evaluate(path, one_gpu_cluster)
    assert result.exit_code == 2 and "rope_scaling: rope type ['yarn'] is not supported" in result.stderr


def test_accelerate_list_where_a_choice_goes_is_one_line(tmp_path: Path) -> None:
    """Found by benchmarks/fuzz.py: ``distributed_type: []`` was TypeError (unhashable) in ``check``."""
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: []\nnum_processes: 8\n")
    result = RUNNER.invoke(app, ["check", str(cfg), str(EXAMPLES / "models" / "llama-3-8b.json"),
                                 str(EXAMPLES / "clusters" / "1x8-a100-80gb.yaml")])
    assert result.exit_code == 2 and "distributed_type: [] is not valid" in result.stderr, result.output


# --------------------------------------------------------------------------- regressions (bugs found here, fixed)


def _mutated(tmp_path: Path, label: str, mutation: Mutation, stem: str = "input") -> tuple[Seed, Path]:
    seed = next(s for s in SEEDS if s.label == label)
    return seed, _write(tmp_path, seed.suffix, _dump(mutation.apply(seed.doc), seed.suffix), stem=stem)


def _case_id(value: Any) -> str | None:
    """Readable test ids for Mutation and path parameters (None: pytest's default)."""
    if isinstance(value, Mutation):
        return f"{value.op}:{value.dotted}"
    if isinstance(value, tuple):
        return ".".join(map(str, value))
    return None


# Fixed bug (was a strict xfail): counts >= 2**63 pass the loader and overflow int64 in the evaluator: exit
# 1 'internal error: OverflowError' instead of exit 2
@pytest.mark.parametrize(("label", "path"), [
    ("models/llama-3-8b.json", ("layers",)),
    ("models/llama-3-8b.json", ("seq_len",)),
    ("models/llama-3-8b.json", ("training", "global_batch")),
    ("models/hf/mixtral-8x7b/config.json", ("num_hidden_layers",)),
    ("synthetic/graph.yaml", ("graph", 0, "repeat")),
], ids=_case_id)
def test_huge_count_is_bad_input_not_an_internal_error(tmp_path: Path, one_gpu_cluster: Path, label: str,
                                                       path: tuple[Any, ...]) -> None:
    _, model = _mutated(tmp_path, label, Mutation("replace", path, HUGE))
    result = _evaluate(model, one_gpu_cluster)
    assert result.exit_code == 2, result.output
    assert str(model) in result.stderr and path[-1] in result.stderr


# Fixed bug (was a strict xfail): fields typed `str | Model` (gpu, intra_node, inter_node,
# training.precision) report '<field>.str: Input should be a valid string' for any bad inline mapping
# instead of the nested field
@pytest.mark.parametrize(("label", "mutation"), [
    ("synthetic/inline-profiles.yaml", Mutation("replace", ("gpu", "peak_TFLOPS", "bf16"), "fast")),
    ("synthetic/inline-profiles.yaml", Mutation("replace", ("gpu", "memory_GiB"), -1)),
    ("synthetic/inline-profiles.yaml", Mutation("unknown", ("gpu", UNKNOWN_KEY), 1)),
    ("synthetic/inline-profiles.yaml", Mutation("delete", ("intra_node", "bandwidth_GBps"))),
    ("synthetic/inline-profiles.yaml", Mutation("replace", ("inter_node", "latency_us"), math.nan)),
    ("synthetic/moe-precision.json", Mutation("replace", ("training", "precision", "param_bytes"), "two")),
], ids=_case_id)
def test_union_field_error_names_nested_field(tmp_path: Path, label: str, mutation: Mutation) -> None:
    seed, path = _mutated(tmp_path, label, mutation)
    err = _load(seed.kind, path)
    assert err is not None
    assert _mentions(str(err), mutation.dotted), str(err)


# Fixed bug (was a strict xfail): GraphLayer float fields accept inf (1e999 in JSON, .inf in YAML):
# Field(ge=0) without allow_inf_nan=False
@pytest.mark.parametrize("key", ["flops_per_token", "activation_bytes_per_token"])
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_infinite_graph_float_is_rejected(tmp_path: Path, key: str, suffix: str) -> None:
    seed = next(s for s in SEEDS if s.label == "synthetic/graph.yaml")
    doc = Mutation("replace", ("graph", 0, key), math.inf).apply(seed.doc)
    err = _load("model", _write(tmp_path, suffix, _dump(doc, suffix)))
    assert err is not None and err.field == f"graph.0.{key}", err


# Fixed bug (was a strict xfail): Evaluation.to_dict runs outside the CLI's try block; with an infinite
# activation size int(round(nan)) raises ValueError: exit 1, traceback in a real shell
def test_cli_json_survives_infinite_activation_size(tmp_path: Path, one_gpu_cluster: Path) -> None:
    _, model = _mutated(tmp_path, "synthetic/graph.yaml",
                        Mutation("replace", ("graph", 0, "activation_bytes_per_token"), math.inf))
    result = _evaluate(model, one_gpu_cluster, "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2)


# Fixed bug (was a strict xfail): a GPU with no peak for the model's dtype or a wider one loads, then
# evaluate fails with 'no peak TFLOPS given ...' naming no file/field
def test_cli_names_the_cluster_file_when_no_peak_fits(tmp_path: Path) -> None:
    _, cluster = _mutated(tmp_path, "synthetic/inline-profiles.yaml",
                          Mutation("replace", ("gpu", "peak_TFLOPS"), {"fp8": 1000}))
    result = _evaluate(EXAMPLES / "models" / "tiny-llama.json", cluster, "--global-batch", "8")
    assert result.exit_code == 2
    assert str(cluster) in result.stderr and "peak_TFLOPS" in result.stderr, result.stderr


# Fixed bug (was a strict xfail): a Hugging Face value the HF reader passes but the shorthand rejects is
# reported under the shorthand name ('heads: heads must divide hidden (2048); or give head_dim'), not the
# config's key.  The example, 48 heads over hidden_size 2048 in DeepSeek-V2-Lite, is now accepted: with MLA the
# head sizes come from the MLA dimensions, so the heads need not divide hidden.
@pytest.mark.parametrize(("label", "key"), [
    ("models/hf/deepseek-v2-lite/config.json", "num_attention_heads"),
    ("models/hf/mixtral-8x7b/config.json", "num_local_experts"),
    ("models/hf/mixtral-8x7b/config.json", "vocab_size"),
])
def test_hf_error_names_the_hugging_face_key(tmp_path: Path, label: str, key: str) -> None:
    _, path = _mutated(tmp_path, label, Mutation("replace", (key,), HUGE))
    err = _load("model", path)
    assert err is not None and err.field == key, str(err)


def test_mla_heads_need_not_divide_hidden(tmp_path: Path) -> None:
    seed, path = _mutated(tmp_path, "models/hf/deepseek-v2-lite/config.json",
                          Mutation("replace", ("num_attention_heads",), 48))
    assert seed.doc["hidden_size"] % 48 and _load("model", path) is None


# Fixed bug (was a strict xfail): an efficiency table accepted a NaN width (the sortedness check is vacuous
# for NaN); evaluate then printed NaN/garbage
def test_attention_efficiency_nan_length_is_rejected(tmp_path: Path) -> None:
    seed, path = _mutated(tmp_path, "synthetic/inline-profiles.yaml",
                          Mutation("replace", ("gpu", "attention_efficiency", "forward", 0, 0), math.nan))
    assert _load(seed.kind, path) is not None


# Fixed bug (was a strict xfail): a layer graph with zero FLOPs gave step_time 0, and --json printed
# tokens_per_s Infinity and mfu NaN, which are not JSON.  Now a graph with neither parameters nor FLOPs is
# refused at load time (nothing to train), and one with parameters but no FLOPs scores mfu 0.
def test_graph_with_nothing_to_train_is_bad_input(tmp_path: Path, one_gpu_cluster: Path) -> None:
    doc = {"name": "empty", "hidden": 8, "seq_len": 8,
           "graph": [{"name": "nothing", "params": 0, "flops_per_token": 0, "activation_bytes_per_token": 64}]}
    model = _write(tmp_path, ".json", json.dumps(doc))
    result = _evaluate(model, one_gpu_cluster, "--json")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"autoplace: error: {model}: graph: ") and "nothing to train" in result.stderr


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no division by zero on the way
def test_cli_json_is_strict_json_for_a_zero_flop_graph(tmp_path: Path, one_gpu_cluster: Path) -> None:
    doc = {"name": "table", "hidden": 8, "seq_len": 8,
           "graph": [{"name": "lookup", "params": 1000, "flops_per_token": 0, "activation_bytes_per_token": 0}]}
    model = _write(tmp_path, ".json", json.dumps(doc))
    result = _evaluate(model, one_gpu_cluster, "--json")
    assert result.exit_code == 0, result.output

    def reject(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    plan = json.loads(result.stdout, parse_constant=reject)["plan"]
    assert plan["mfu"] == 0 and plan["tflops_per_gpu"] == 0 and math.isfinite(plan["tokens_per_s"])


# Fixed bug (was a strict xfail): PyYAML's ReaderError (a control character such as NUL) becomes a two-line
# message ('...not allowed\n  in "<unicode string>", position 0'): _parse_yaml formats str(exc) for non-
# marked YAML errors
@pytest.mark.parametrize("content", [b"\x00", b"name: a\x01b\n", b"nodes: 1\x7f\n"])
def test_yaml_control_character_error_is_one_line(tmp_path: Path, content: bytes) -> None:
    cluster = _write(tmp_path, ".yaml", content)
    result = _evaluate(EXAMPLES / "models" / "tiny-llama.json", cluster)
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr


# Fixed bug (was a strict xfail): autoplace/specs/hf.py _heads() says 'must divide hidden size 1' -- the
# key is hidden_size (n_embd for gpt2); the message does not name it
def test_hf_error_says_hidden_size(tmp_path: Path) -> None:
    _, path = _mutated(tmp_path, "models/hf/mixtral-8x7b/config.json", Mutation("replace", ("hidden_size",), 1))
    err = _load("model", path)
    assert err is not None and _mentions(str(err), "hidden_size"), str(err)


# Fixed bug (was a strict xfail): user text is put into the message raw: an unknown key (the field path,
# _io.spec_error_from) or an HF 'architectures' entry (hf._check_architectures) containing a line break
# splits the one-line error
@pytest.mark.parametrize(("label", "mutation"), [
    ("models/llama-3-8b.json", Mutation("unknown", ("bad\nkey",), 1)),
    ("clusters/8x8-h100.yaml", Mutation("unknown", ("pools\r",), 1)),
    ("models/hf/mixtral-8x7b/config.json", Mutation("replace", ("architectures",), ["Mixtral\nForCausalLM"])),
], ids=_case_id)
def test_user_text_in_error_is_escaped(tmp_path: Path, label: str, mutation: Mutation) -> None:
    seed, path = _mutated(tmp_path, label, mutation)
    try:
        LOADERS[seed.kind](path)
    except SpecError as err:
        assert len(str(err).splitlines()) == 1, repr(str(err))
    else:
        pytest.fail("accepted")


@pytest.mark.parametrize("content", [b"?", b"1:"])
def test_calibration_with_a_key_that_is_not_a_name_is_one_line(tmp_path: Path, one_gpu_cluster: Path,
                                                               content: bytes) -> None:
    """Found by ``benchmarks/fuzz.py 100000``: YAML reads ``?`` as a null key and ``1:`` as a number
    key; listing them as unknown keys was TypeError (join of non-strings)."""
    path = tmp_path / "calibration.yaml"
    path.write_bytes(content)
    result = _evaluate(REPO / "examples" / "models" / "tiny-llama.json", one_gpu_cluster, "--calibration", str(path))
    assert result.exit_code == 2 and "unknown key(s)" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("layers", ["8", "3", "99999999999999999999", "-1:5"])
def test_fixed_layers_that_do_not_add_up_to_the_model_are_one_line(one_gpu_cluster: Path, layers: str) -> None:
    """Found by ``benchmarks/fuzz.py 100000``: ``--fix layers=8`` on a 4-layer model was IndexError,
    and a 20-digit count overflowed CP-SAT's coefficients."""
    result = RUNNER.invoke(app, ["solve", str(REPO / "examples" / "models" / "tiny-llama.json"), str(one_gpu_cluster),
                                 "--time-limit", "5", "--top", "1", "--fix", f"layers={layers}"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"autoplace: error: --fix: layers: needs counts (one per pipeline stage) adding "
                                      f"up to the model's 4 layers, got {layers}")
